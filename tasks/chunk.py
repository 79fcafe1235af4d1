"""chunk: rows → units (unit_id = source_id + '#' + chunk number), each within the token budget.

A token is at least one byte, so a text of at most `max_tokens` UTF-8 bytes always fits: only
longer texts are tokenized. Splits are cut on token boundaries moved back to a character start,
so the chunks of a row (without overlap) concatenate to the row's exact text.
"""

from __future__ import annotations

import time
from itertools import accumulate

import polars as pl
from prefect import task

from lowtide.context import RunContext
from lowtide.jobspec import JobSpec
from lowtide.runlog import stage_log
from lowtide.tokens import count_tokens, encode, get_encoding

# Re-encoding a cut piece can merge differently at its edges; keep a little headroom.
_EDGE_TOKENS = 2


def _char_start(data: bytes, pos: int) -> int:
    while 0 < pos < len(data) and (data[pos] & 0xC0) == 0x80:
        pos -= 1
    return pos


def split_counted(
    text: str, max_tokens: int, overlap: int = 0, encoding: str = "o200k_base"
) -> list[tuple[str, int]]:
    """Cut `text` into (piece, token count) pairs of at most `max_tokens` tokens, consecutive
    pieces sharing about `overlap` tokens. With overlap 0 the pieces concatenate to `text`.
    Each piece is counted once, so callers need not tokenize it again."""
    data = text.encode("utf-8")
    ids = encode(text, encoding)
    if len(ids) <= max_tokens:
        return [(text, len(ids))]
    enc = get_encoding(encoding)
    offsets = [0, *accumulate(len(b) for b in enc.decode_tokens_bytes(ids))]
    window = max(1, max_tokens - _EDGE_TOKENS)
    step = max(1, window - overlap)
    pieces: list[tuple[str, int]] = []
    start_tok = 0
    while True:
        end_tok = min(start_tok + window, len(ids))
        a = _char_start(data, offsets[start_tok])
        b = len(data) if end_tok == len(ids) else _char_start(data, offsets[end_tok])
        piece = data[a:b].decode("utf-8")
        tokens = count_tokens(piece, encoding)
        while tokens > max_tokens and b > a + 1:
            b = _char_start(data, b - 1)
            piece = data[a:b].decode("utf-8")
            tokens = count_tokens(piece, encoding)
        pieces.append((piece, tokens))
        if end_tok >= len(ids):
            break
        start_tok += step
    return pieces


def split_text(
    text: str, max_tokens: int, overlap: int = 0, encoding: str = "o200k_base"
) -> list[str]:
    """The pieces of `split_counted` without their counts."""
    if len(text.encode("utf-8")) <= max_tokens:
        return [text]
    return [piece for piece, _ in split_counted(text, max_tokens, overlap, encoding)]


def chunk_units(
    rows: pl.DataFrame,
    *,
    max_tokens: int,
    overlap: int = 0,
    mode: str = "split",
    encoding: str = "o200k_base",
    kind: str = "row",
) -> pl.DataFrame:
    """(source_id, text, …) → units (unit_id, source_id, kind, chunk_index, n_chunks, text, …).

    Rows whose text fits the budget in bytes pass through untouched (vectorised); only the long
    tail is tokenized. Null or whitespace-only text becomes an empty unit, which is never sent
    and fails with a reason.
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
        counted = [
            split_counted(t, max_tokens, overlap, encoding) for t in long_rows["text"].to_list()
        ]
        if mode == "truncate":
            counted = [c[:1] for c in counted]
        exploded = (
            long_rows.with_columns(
                pl.Series("text", [[p for p, _ in c] for c in counted], dtype=pl.List(pl.String)),
                pl.Series(
                    "unit_tokens", [[n for _, n in c] for c in counted], dtype=pl.List(pl.Int32)
                ),
            )
            .with_columns(pl.col("text").list.len().cast(pl.Int32).alias("n_chunks"))
            .explode("text", "unit_tokens")
            .with_columns(
                pl.int_range(pl.len()).over("source_id").cast(pl.Int32).alias("chunk_index"),
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


def job_units(job: JobSpec, rows: pl.DataFrame, evals: pl.DataFrame | None) -> pl.DataFrame:
    """A run's units: the input rows chunked as `[chunk]` says, then the eval set's rows (if
    any) without their gold columns, truncated to one unit each (`kind = 'eval'`)."""
    c = job.chunk
    parts = [
        chunk_units(
            rows,
            max_tokens=c.max_tokens,
            overlap=c.overlap_tokens,
            mode=c.mode,
            encoding=c.encoding,
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
    units = job_units(job, pl.read_parquet(loaded["sources"]), evals)
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
