"""chunk: rows → units (unit_id = source_id + '#' + chunk number), each within the token budget.

A token is at least one byte, so a text of at most `max_tokens` UTF-8 bytes always fits: only
longer texts are counted (most by the counts of their words, `lowtide.word_counts`), and cut
between words where they can be (`lowtide.splitting`); the chunks of a row (without overlap)
concatenate to the row's exact text.
"""

from __future__ import annotations

import hashlib
import time
from functools import lru_cache
from importlib import metadata
from typing import Protocol

import polars as pl

from lowtide.context import RunContext
from lowtide.digests import md5_hex, text_key
from lowtide.jobspec import JobSpec
from lowtide.orchestration import task
from lowtide.runlog import stage_log
from lowtide.slices import by_slices, file_slices
from lowtide.splitting import split_spans
from lowtide.store.chunk_cuts import CUTS_SCHEMA
from lowtide.word_counts import SPAN_COLUMNS, WordCounts
from tasks.carry import unchanged_rows
from tasks.dedupe import CUSTOM_ID_VERSION, Keyer


class CutMemo(Protocol):
    """Where earlier runs' cuts are remembered (the state store's `ChunkCutsStore`)."""

    def chunk_cuts(self, budget: str, keys: pl.Series) -> pl.DataFrame: ...

    def has_md5_cuts(self, budget: str) -> bool: ...

    def remember_chunk_cuts(self, budget: str, cuts: pl.DataFrame, recipe: str) -> None: ...


class RunCuts:
    """The cuts a stage makes, kept in memory and remembered in `memo` once, when the stage
    ends (`remember`), instead of slice by slice: the state file then compresses each new cut
    once, where a commit per slice recompressed the table's last, partly filled row group
    with every slice (at 1M rows: 20 commits of ~15,600 cuts each). Lookups see the cuts made
    so far, so a text met again in a later slice is not tokenized again. A run that stops
    before the end remembers nothing: its texts are cut again next time (cuts are a cache)."""

    def __init__(self, memo: CutMemo) -> None:
        self.memo = memo
        self._made: dict[str, list[pl.DataFrame]] = {}  # by budget
        self._recipes: dict[str, str] = {}
        self._md5_kept: dict[str, bool] = {}  # by budget

    def chunk_cuts(self, budget: str, keys: pl.Series) -> pl.DataFrame:
        known = self.memo.chunk_cuts(budget, keys)
        wanted = keys.unique().implode()
        made = [
            c.filter(pl.col("text_key").is_in(wanted)).select(list(CUTS_SCHEMA))
            for c in self._made.get(budget, [])
        ]
        if not made:
            return known
        # another process may have remembered a text this run cut too: one row per text
        return pl.concat([known, *made]).unique(subset="text_key", keep="first")

    def has_md5_cuts(self, budget: str) -> bool:
        # asked once a stage (it scanned every cut kept under the budget, once per slice): no
        # lowtide writes md5 keys any more, and this stage re-keys those it meets at its end
        if budget not in self._md5_kept:
            self._md5_kept[budget] = self.memo.has_md5_cuts(budget)
        return self._md5_kept[budget]

    def remember_chunk_cuts(self, budget: str, cuts: pl.DataFrame, recipe: str) -> None:
        if cuts.height:
            self._made.setdefault(budget, []).append(cuts)
            self._recipes[budget] = recipe

    def remember(self) -> None:
        """Hand every cut made to `memo`, one call per budget."""
        for budget, frames in self._made.items():
            made = pl.concat(frames, how="diagonal")  # `replaces` where a slice re-keyed cuts
            self.memo.remember_chunk_cuts(budget, made, self._recipes[budget])
        self._made.clear()


CUTS_VERSION = 1
"""Version of the cutting recipe: bump it only when remembered cuts become wrong (a piece over
its budget or miscounted), not when a new recipe merely cuts differently. A bump re-cuts every
long text, so their requests change and miss the row cache: every long row is asked and paid
again. Cutting between words (`lowtide.splitting`) kept version 1: a text cut before keeps its
pieces, and its answers."""


@lru_cache(maxsize=1)
def _tokenizer_version() -> str:
    return metadata.version("bpe-openai")


def cut_recipe() -> str:
    """The cutting recipe and the tokenizer's version: cuts remembered under another are dead."""
    return f"v{CUTS_VERSION}:bpe-openai {_tokenizer_version()}"


def units_recipe(schema: pl.Schema) -> str:
    """What a row's units depend on besides its values and the job spec: the types its columns
    were read with (a content key does not see them, but `0` and `0.0` render differently), and
    the cutting and custom_id recipes. A run whose recipe differs cannot lend its units."""
    columns = ",".join(f"{name}:{dtype!r}" for name, dtype in sorted(schema.items()))
    text = f"{cut_recipe()}|{CUSTOM_ID_VERSION}|{columns}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def budget_key(max_tokens: int, overlap: int, encoding: str) -> str:
    """What a text's cuts depend on besides the text: the recipe, the tokenizer's version, the
    vocabulary and the budget."""
    return f"{cut_recipe()}:{encoding}:{max_tokens}:{overlap}"


_SLICE_ROWS = 20_000
"""Long texts handled at a time: their Python strings, and each text repeated once per piece
before it is sliced, are held for one slice, not for every long text of the run."""


def _pieces(with_cuts: pl.DataFrame) -> pl.DataFrame:
    """Long rows with their cuts (`_cut_starts`, `_cut_lengths`, `_cut_tokens` lists) → one
    row per piece, its text the piece's slice."""
    return (
        with_cuts.with_columns(
            pl.col("_cut_starts").list.len().cast(pl.Int32).alias("n_chunks"),
            pl.int_ranges(0, pl.col("_cut_starts").list.len(), dtype=pl.Int32).alias("chunk_index"),
        )
        .explode("_cut_starts", "_cut_lengths", "_cut_tokens", "chunk_index")
        .with_columns(
            pl.col("text").str.slice(pl.col("_cut_starts"), pl.col("_cut_lengths")),
            pl.col("_cut_tokens").alias("unit_tokens"),
        )
    )


def long_text_cuts(
    texts: pl.Series,
    *,
    max_tokens: int,
    overlap: int,
    encoding: str,
    memo: CutMemo | None = None,
    words: WordCounts | None = None,
) -> pl.DataFrame:
    """starts, lengths, tokens (lists, one entry per piece) for each text, in order. Each
    distinct text is cut once; with a memo, only texts it has never cut under this budget
    are, and their cuts are remembered. `words`: the word counts learned so far this stage
    (a fresh one otherwise)."""
    budget = budget_key(max_tokens, overlap, encoding)
    texts_by_key = pl.DataFrame({"text_key": text_key(texts), "text": texts})
    known = memo.chunk_cuts(budget, texts_by_key["text_key"]) if memo else None
    todo = texts_by_key.unique(subset="text_key", keep="first", maintain_order=True)
    if known is not None:
        todo = todo.join(known.select("text_key"), on="text_key", how="anti")
    rekeyed = None
    if memo is not None and todo.height and memo.has_md5_cuts(budget):
        rekeyed = _md5_cuts(memo, budget, todo)
        todo = todo.join(rekeyed.select("text_key"), on="text_key", how="anti")
    todo_texts = todo["text"]
    # without overlap, most texts are counted by their words (`lowtide.word_counts`); the
    # others are cut one by one
    if overlap == 0:
        if words is None or words.encoding != encoding:
            words = WordCounts(encoding)
        flat, left = words.spans(todo_texts, max_tokens)
    else:
        flat, left = pl.DataFrame(schema=SPAN_COLUMNS), list(range(todo_texts.len()))
    each = _cut_each(todo_texts, left, max_tokens=max_tokens, overlap=overlap, encoding=encoding)
    flat = pl.concat([flat, each]).sort("i", "starts")
    fresh = (
        flat.group_by("i", maintain_order=True)
        .agg("starts", "lengths", "tokens")
        .join(todo.select("text_key").with_row_index("i"), on="i", how="right")
        .select(list(CUTS_SCHEMA))
    )
    if rekeyed is not None:
        # the cuts found by md5 are remembered under their new keys with the new ones: one write
        fresh = pl.concat([fresh, rekeyed], how="diagonal")
    if memo is not None:
        memo.remember_chunk_cuts(budget, fresh, cut_recipe())
    every = pl.concat([c.select(list(CUTS_SCHEMA)) for c in (known, fresh) if c is not None])
    return texts_by_key.join(every, on="text_key", how="left", maintain_order="left").select(
        "starts", "lengths", "tokens"
    )


def _cut_each(
    texts: pl.Series, at: list[int], *, max_tokens: int, overlap: int, encoding: str
) -> pl.DataFrame:
    """The pieces of the texts at `at` (SPAN_COLUMNS rows), each cut by `split_spans`."""
    # one flat row per piece, gathered into lists by polars (nested Python lists build a
    # Series per text)
    owner: list[int] = []
    pieces: list[tuple[int, int, int]] = []
    for offset in range(0, len(at), _SLICE_ROWS):
        # a slice at a time: a million long texts as Python strings would double their memory
        some = at[offset : offset + _SLICE_ROWS]
        for i, text in zip(some, texts.gather(some).to_list(), strict=True):
            spans = split_spans(text, max_tokens, overlap, encoding)
            owner.extend([i] * len(spans))
            pieces.extend(spans)
    flat = pl.DataFrame(pieces, schema=["starts", "lengths", "tokens"], orient="row")
    return flat.select(pl.Series("i", owner), pl.all()).cast(SPAN_COLUMNS)  # type: ignore[arg-type]


def _md5_cuts(memo: CutMemo, budget: str, todo: pl.DataFrame) -> pl.DataFrame:
    """The cuts of `todo`'s texts that were remembered by the md5 of their text (before
    `text_key`), under their new key, with the md5 they replace (`replaces`): kept so, the
    next night finds them by key alone."""
    digests = md5_hex(todo["text"])
    found = memo.chunk_cuts(budget, digests)
    return (
        pl.DataFrame({"text_key": todo["text_key"], "replaces": digests})
        .join(found.rename({"text_key": "replaces"}), on="replaces", how="inner")
        .select(*CUTS_SCHEMA, "replaces")
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
    words: WordCounts | None = None,
) -> pl.DataFrame:
    """(source_id, text, …) → units (unit_id, source_id, kind, chunk_index, n_chunks, text, …).

    Rows whose text fits the budget in bytes pass through untouched (vectorised); only the long
    tail is counted, and with a memo only the texts no earlier run cut (`words`: the word
    counts this stage learned, `long_text_cuts`). Null or whitespace-only text becomes an
    empty unit, which is never sent and fails with a reason.
    """
    # no character but whitespace (Unicode's, as strip_chars has it); found without a stripped
    # copy of every text (1.1 -> 0.2 s of CPU at a million rows)
    blank = pl.col("text").is_null() | ~pl.col("text").str.contains(r"\S")
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
            long_rows["text"],
            max_tokens=max_tokens,
            overlap=overlap,
            encoding=encoding,
            memo=memo,
            words=words,
        )
        if mode == "truncate":
            cuts = cuts.with_columns(pl.all().list.head(1))
        # private names: an input column may be called `starts` or `tokens`
        cuts = cuts.select(pl.all().name.prefix("_cut_"))
        with_cuts = pl.concat([long_rows, cuts], how="horizontal")
        del long_rows, cuts
        pieces = by_slices(with_cuts, _SLICE_ROWS, lambda part: _pieces(part).select(short.columns))
        del with_cuts
        short = pl.concat([short, pieces], how="vertical")
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
    any) as `eval_units`. With a memo, texts an earlier run already cut are not tokenized
    again."""
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
        parts.append(eval_units(job, evals, memo))
    return pl.concat(parts, how="diagonal_relaxed")


def eval_units(
    job: JobSpec,
    evals: pl.DataFrame,
    memo: CutMemo | None = None,
    words: WordCounts | None = None,
) -> pl.DataFrame:
    """The eval set's rows without their gold columns, truncated to one unit each
    (`kind = 'eval'`)."""
    c = job.chunk
    gold = [f for f in job.output_schema.get("properties", {})]
    evals = evals.drop([g for g in gold if g in evals.columns and g not in job.input.column_names])
    return chunk_units(
        evals,
        max_tokens=c.max_tokens,
        overlap=c.overlap_tokens,
        mode="truncate",
        encoding=c.encoding,
        kind="eval",
        memo=memo,
        words=words,
    )


_FILE_SLICE_ROWS = 50_000
"""Input rows chunked at a time: their texts and units are held for one slice, never for the
whole input."""


@task(name="chunk", task_run_name="chunk-{run_id}")
def chunk_task(ctx: RunContext, run_id: str, loaded: dict) -> dict:
    """Rows and eval rows → units, a slice of rows at a time, each slice keyed for dedupe as
    it is made (`Keyer`: the keyed and messages files in the run's work dir); rows unchanged
    since the run the job's view shows, all answered there, are left out and named for
    dedupe to carry."""
    started = time.perf_counter()
    job = ctx.job
    c = job.chunk
    work_dir = ctx.work_dir(run_id)
    schema = pl.scan_parquet(loaded["sources"]).collect_schema()
    recipe = units_recipe(schema)
    out: dict = {"carried_from": None, "carried": None, "rows_carried": 0, "units_recipe": recipe}
    carried = unchanged_rows(ctx, run_id, recipe)
    if carried is not None:
        out["carried_from"] = carried.from_run
        out["rows_carried"] = carried.source_ids.height
        out["carried"] = str(work_dir / "carried.parquet")
        carried.source_ids.write_parquet(out["carried"])

    cuts = RunCuts(ctx.store)  # later slices reuse earlier slices' cuts
    words = WordCounts(c.encoding)  # and the words they counted

    def units_of(rows: pl.DataFrame) -> pl.DataFrame:
        return chunk_units(
            rows,
            max_tokens=c.max_tokens,
            overlap=c.overlap_tokens,
            mode=c.mode,
            encoding=c.encoding,
            memo=cuts,
            words=words,
        )

    # each slice's units are keyed at once, for dedupe: never written to a file of their own
    keyer = Keyer(ctx, run_id, work_dir)
    n_rows = n_units = 0
    for rows in file_slices(loaded["sources"], _FILE_SLICE_ROWS):
        if carried is not None:
            rows = rows.join(carried.source_ids, on="source_id", how="anti")
        n_rows += rows.height
        units = units_of(rows)
        n_units += units.height
        keyer.add(units)
        del units
    evals = pl.read_parquet(loaded["eval"]) if loaded.get("eval") else None
    if evals is not None:
        keyer.add(eval_units(job, evals, memo=cuts, words=words))
    out.update(keyer.close())
    cuts.remember()
    stage_log(
        "chunk",
        "%d rows → %d units (budget %d tokens); %d unchanged rows keep run %s's units; in %.1f s",
        n_rows,
        n_units,
        c.max_tokens,
        out["rows_carried"],
        out["carried_from"],
        time.perf_counter() - started,
    )
    return {**out, "n_units": n_units}
