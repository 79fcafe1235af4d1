"""chunk: rows → units (unit_id = source_id + '#' + chunk number), each within the token budget.

A token is at least one byte, so a text of at most `max_tokens` UTF-8 bytes always fits: only
longer texts are tokenized. Splits are cut on token boundaries moved back to a character start,
so the chunks of a row (without overlap) concatenate to the row's exact text.
"""

from __future__ import annotations

import time
from functools import lru_cache
from importlib import metadata
from typing import Protocol

import polars as pl
from prefect import task

from lowtide.context import RunContext
from lowtide.jobspec import JobSpec
from lowtide.runlog import stage_log
from lowtide.store.chunk_cuts import CUTS_SCHEMA
from lowtide.store.compute import md5_hex
from lowtide.tokens import count_tokens, encode, get_encoding

# Re-encoding a cut piece can merge differently at its edges; keep a little headroom.
_EDGE_TOKENS = 2


def _char_start(data: bytes, pos: int) -> int:
    while 0 < pos < len(data) and (data[pos] & 0xC0) == 0x80:
        pos -= 1
    return pos


@lru_cache(maxsize=8)
def _token_lengths(encoding: str) -> pl.Series:
    """Bytes per token id: a token's end offset is a cumulative sum, not a decode per token."""
    values = get_encoding(encoding).token_byte_values()
    return pl.Series("n", [len(b) for b in values], dtype=pl.Int64)


def split_spans(
    text: str, max_tokens: int, overlap: int = 0, encoding: str = "o200k_base"
) -> list[tuple[int, int, int]]:
    """Cut `text` into pieces of at most `max_tokens` tokens, consecutive pieces sharing about
    `overlap` tokens: (first character, length in characters, token count) per piece. With
    overlap 0 the pieces concatenate to `text`. Each piece is counted once, so callers need not
    tokenize it again."""
    ids = encode(text, encoding)
    if len(ids) <= max_tokens:
        return [(0, len(text), len(ids))]
    data = text.encode("utf-8")
    ends = _token_lengths(encoding).gather(pl.Series(ids, dtype=pl.UInt32)).cum_sum()
    offsets = [0, *ends.to_list()]
    window = max(1, max_tokens - _EDGE_TOKENS)
    step = max(1, window - overlap)
    spans: list[tuple[int, int, int]] = []
    start_tok = 0
    prev_byte = prev_char = 0  # pieces start in order: count characters incrementally
    while True:
        end_tok = min(start_tok + window, len(ids))
        a = _char_start(data, offsets[start_tok])
        b = len(data) if end_tok == len(ids) else _char_start(data, offsets[end_tok])
        piece = data[a:b].decode("utf-8")
        # Re-encoding a cut piece can merge differently at its edges: count it as it is sent.
        tokens = count_tokens(piece, encoding)
        while tokens > max_tokens and b > a + 1:
            b = _char_start(data, b - 1)
            piece = data[a:b].decode("utf-8")
            tokens = count_tokens(piece, encoding)
        prev_char += len(data[prev_byte:a].decode("utf-8"))
        prev_byte = a
        spans.append((prev_char, len(piece), tokens))
        if end_tok >= len(ids):
            break
        start_tok += step
    return spans


def split_text(
    text: str, max_tokens: int, overlap: int = 0, encoding: str = "o200k_base"
) -> list[str]:
    """The pieces of `split_spans` as text."""
    if len(text.encode("utf-8")) <= max_tokens:
        return [text]
    return [text[s : s + n] for s, n, _ in split_spans(text, max_tokens, overlap, encoding)]


class CutMemo(Protocol):
    """Where earlier runs' cuts are remembered (the state store's `ChunkCutsStore`)."""

    def chunk_cuts(self, budget: str, digests: pl.Series) -> pl.DataFrame: ...

    def remember_chunk_cuts(self, budget: str, cuts: pl.DataFrame) -> None: ...


CUTS_VERSION = 1
"""Version of the cutting recipe (`split_spans`, `_EDGE_TOKENS`, the tokenizer's slicing): bump
it when any of them changes, so remembered cuts are not reused."""


@lru_cache(maxsize=1)
def _tokenizer_version() -> str:
    return metadata.version("bpe-openai")


def budget_key(max_tokens: int, overlap: int, encoding: str) -> str:
    """What a text's cuts depend on besides the text: the recipe, the tokenizer's version, the
    vocabulary and the budget."""
    return f"v{CUTS_VERSION}:bpe-openai {_tokenizer_version()}:{encoding}:{max_tokens}:{overlap}"


def long_text_cuts(
    texts: pl.Series,
    *,
    max_tokens: int,
    overlap: int,
    encoding: str,
    memo: CutMemo | None = None,
) -> pl.DataFrame:
    """starts, lengths, tokens (lists, one entry per piece) for each text, in order. Each
    distinct text is tokenized once; with a memo, only texts it has never cut under this
    budget are, and their cuts are remembered."""
    budget = budget_key(max_tokens, overlap, encoding)
    texts_by_digest = pl.DataFrame({"text_md5": md5_hex(texts), "text": texts})
    known = memo.chunk_cuts(budget, texts_by_digest["text_md5"]) if memo else None
    todo = texts_by_digest.unique(subset="text_md5", keep="first", maintain_order=True)
    if known is not None:
        todo = todo.join(known.select("text_md5"), on="text_md5", how="anti")
    spans = [split_spans(t, max_tokens, overlap, encoding) for t in todo["text"].to_list()]
    fresh = pl.DataFrame(
        {
            "text_md5": todo["text_md5"],
            "starts": [[s for s, _, _ in x] for x in spans],
            "lengths": [[n for _, n, _ in x] for x in spans],
            "tokens": [[t for _, _, t in x] for x in spans],
        },
        schema=CUTS_SCHEMA,
    )
    if memo is not None:
        memo.remember_chunk_cuts(budget, fresh)
    every = pl.concat([known, fresh]) if known is not None else fresh
    return texts_by_digest.join(every, on="text_md5", how="left", maintain_order="left").select(
        "starts", "lengths", "tokens"
    )


def chunk_units(
    rows: pl.DataFrame,
    *,
    max_tokens: int,
    overlap: int = 0,
    mode: str = "split",
    encoding: str = "o200k_base",
    kind: str = "row",
    memo: CutMemo | None = None,
) -> pl.DataFrame:
    """(source_id, text, …) → units (unit_id, source_id, kind, chunk_index, n_chunks, text, …).

    Rows whose text fits the budget in bytes pass through untouched (vectorised); only the long
    tail is tokenized, and with a memo only the texts no earlier run cut. Null or
    whitespace-only text becomes an empty unit, which is never sent and fails with a reason.
    """
    blank = pl.col("text").is_null() | (pl.col("text").str.strip_chars() == "")
    rows = rows.with_columns(
        pl.when(blank).then(pl.lit("")).otherwise(pl.col("text")).alias("text")
    )
    long_mask = pl.col("text").str.len_bytes() > max_tokens
    short = rows.filter(~long_mask).with_columns(
        pl.lit(0, pl.Int32).alias("chunk_index"),
        pl.lit(1, pl.Int32).alias("n_chunks"),
        pl.lit(None, pl.Int32).alias("unit_tokens"),
    )
    long_rows = rows.filter(long_mask)
    if long_rows.height:
        cuts = long_text_cuts(
            long_rows["text"], max_tokens=max_tokens, overlap=overlap, encoding=encoding, memo=memo
        )
        if mode == "truncate":
            cuts = cuts.with_columns(pl.all().list.head(1))
        # private names: an input column may be called `starts` or `tokens`
        cuts = cuts.select(pl.all().name.prefix("_cut_"))
        exploded = (
            pl.concat([long_rows, cuts], how="horizontal")
            .with_columns(
                pl.col("_cut_starts").list.len().cast(pl.Int32).alias("n_chunks"),
                pl.int_ranges(0, pl.col("_cut_starts").list.len(), dtype=pl.Int32).alias(
                    "chunk_index"
                ),
            )
            .explode("_cut_starts", "_cut_lengths", "_cut_tokens", "chunk_index")
            .with_columns(
                pl.col("text").str.slice(pl.col("_cut_starts"), pl.col("_cut_lengths")),
                pl.col("_cut_tokens").alias("unit_tokens"),
            )
        )
        short = pl.concat([short, exploded.select(short.columns)], how="vertical")
    return short.with_columns(
        (pl.col("source_id") + "#" + pl.col("chunk_index").cast(pl.String)).alias("unit_id"),
        pl.lit(kind).alias("kind"),
    ).select(
        "unit_id",
        "source_id",
        "kind",
        "chunk_index",
        "n_chunks",
        "unit_tokens",
        pl.exclude("unit_id", "source_id", "kind", "chunk_index", "n_chunks", "unit_tokens"),
    )


def job_units(
    job: JobSpec, rows: pl.DataFrame, evals: pl.DataFrame | None, memo: CutMemo | None = None
) -> pl.DataFrame:
    """A run's units: the input rows chunked as `[chunk]` says, then the eval set's rows (if
    any) without their gold columns, truncated to one unit each (`kind = 'eval'`). With a
    memo, texts an earlier run already cut are not tokenized again."""
    c = job.chunk
    parts = [
        chunk_units(
            rows,
            max_tokens=c.max_tokens,
            overlap=c.overlap_tokens,
            mode=c.mode,
            encoding=c.encoding,
            memo=memo,
        )
    ]
    if evals is not None:
        gold = [f for f in job.output_schema.get("properties", {})]
        evals = evals.drop(
            [g for g in gold if g in evals.columns and g not in job.input.column_names]
        )
        parts.append(
            chunk_units(
                evals,
                max_tokens=c.max_tokens,
                overlap=c.overlap_tokens,
                mode="truncate",
                encoding=c.encoding,
                kind="eval",
                memo=memo,
            )
        )
    return pl.concat(parts, how="diagonal_relaxed")


@task(name="chunk", task_run_name="chunk-{run_id}")
def chunk_task(ctx: RunContext, run_id: str, loaded: dict) -> dict:
    """Rows and eval rows → units, written to the run's work dir."""
    started = time.perf_counter()
    job = ctx.job
    c = job.chunk
    evals = pl.read_parquet(loaded["eval"]) if loaded.get("eval") else None
    units = job_units(job, pl.read_parquet(loaded["sources"]), evals, memo=ctx.store)
    path = ctx.work_dir(run_id) / "units.parquet"
    units.write_parquet(path)
    n_units = units.filter(pl.col("kind") == "row").height
    stage_log(
        "chunk",
        "%d rows → %d units (budget %d tokens) in %.1f s",
        loaded["rows"],
        n_units,
        c.max_tokens,
        time.perf_counter() - started,
    )
    return {"units": str(path), "n_units": n_units}
