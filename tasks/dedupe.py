"""dedupe: units → unique request keys; identical units are asked once and fanned out.

key = sha256(prompt fingerprint @ answer family, normalised rendered user message). The
fingerprint covers the system prompt, examples, schema, model and parameters, so any change makes
new keys. The answer family (`BackendEntry.answer_family`: `emulator`, or `openai:<model>`,
`anthropic:<model>`, `vllm:<model>`) says whose answers the run's engine gives, so answers are
shared only between engines of one provider family running one model id, and the emulator's
invented answers never reach a real backend's run. Keys that an earlier run already answered are
cache hits; keys sitting in a live batch are attached, not resent.
"""

from __future__ import annotations

import string
import time
from pathlib import Path

import polars as pl

from lowtide.backends import backend_entry
from lowtide.context import RunContext
from lowtide.crashpoints import crash_point
from lowtide.digests import sha256_hex
from lowtide.jobspec import JobSpec
from lowtide.lowercase import lowercase
from lowtide.orchestration import task
from lowtide.runlog import stage_log
from lowtide.slices import FileWriter, by_slices, file_slices
from lowtide.store import Store
from tasks.load import PRIORITY

CUSTOM_ID_VERSION = "lt2"
"""Version of the custom_id recipe. Changing the recipe orphans in-flight batches: bump it.

lt2 (lt1 + the answer family in the key): answers stored under lt1 keys are never cache hits
again (they do not say which engine gave them), so the first lt2 run of a job asks afresh. A run
already in flight is unaffected: resuming reads its stored units and manifest, keys are computed
only before a run's manifest exists."""


def render_user(units: pl.DataFrame, template: str) -> pl.Expr:
    """The user message for each unit, rendered column-wise from the template."""
    parts: list[pl.Expr] = []
    for literal, field, _, _ in string.Formatter().parse(template):
        if literal:
            parts.append(pl.lit(literal))
        if field:
            parts.append(pl.col(field).cast(pl.String).fill_null(""))
    return pl.concat_str(parts) if parts else pl.lit("")


def normalise(texts: pl.Series) -> pl.Series:
    """Case and whitespace do not change what is asked: fold both before hashing (the case
    through Arrow where that gives polars' own result: `lowtide.lowercase`)."""
    return pl.select(fold_whitespace(pl.lit(lowercase(texts)))).to_series()


def fold_whitespace(expr: pl.Expr) -> pl.Expr:
    """Each run of whitespace becomes one space (a lone tab, newline, ... too), and none is
    left at either end. The regex takes a whole run at its first character, so no two spaces
    are left side by side (a second pass that folded runs of spaces changed no key and cost
    0.5 s of CPU at a million messages)."""
    return expr.str.replace_all(r"\s{2,}|[\t\n\r\f\v]", " ").str.strip_chars()


_SLICE_ROWS = 50_000


def request_keys(units: pl.DataFrame, template: str, fingerprint: str) -> pl.DataFrame:
    """Add `user` (the rendered message), `request_key` and `custom_id` to every unit."""
    # the normalised copy of every message is held only to be hashed
    return by_slices(units, _SLICE_ROWS, lambda part: _request_keys(part, template, fingerprint))


def _request_keys(units: pl.DataFrame, template: str, fingerprint: str) -> pl.DataFrame:
    framed = units.with_columns(render_user(units, template).alias("user"))
    material = pl.select(pl.lit(fingerprint + "\x1f") + pl.lit(normalise(framed["user"])))
    keys = sha256_hex(material.to_series())
    return framed.with_columns(keys.alias("request_key")).with_columns(
        (pl.lit(CUSTOM_ID_VERSION + "_") + pl.col("request_key").str.slice(0, 48)).alias(
            "custom_id"
        )
    )


def first_requests(keyed: pl.DataFrame) -> pl.DataFrame:
    """(`_row`, custom_id, urgent): for each request key, the row of its first unit with text
    (input order kept); a request is urgent when any unit that shares it is. Reads only the
    narrow columns `_narrow` makes."""
    return (
        keyed.filter("_sendable")
        .group_by("custom_id", maintain_order=True)
        .agg(pl.col("_row").first(), pl.col(PRIORITY).fill_null(False).any().alias("urgent"))
        .select("_row", "custom_id", "urgent")
    )


def _narrow(keyed: pl.DataFrame, offset: int = 0) -> pl.DataFrame:
    """What `first_requests` reads, rows numbered from `offset`."""
    return keyed.select(
        pl.int_range(pl.len(), dtype=pl.Int64).add(offset).alias("_row"),
        "custom_id",
        (pl.col(PRIORITY) if PRIORITY in keyed.columns else pl.lit(None, pl.Boolean)).alias(
            PRIORITY
        ),
        (pl.col("text").str.len_bytes() > 0).alias("_sendable"),
    )


def unique_requests(keyed: pl.DataFrame) -> pl.DataFrame:
    """One row per request key, carrying the first unit's text (input order is kept); a request
    is urgent when any unit that shares it is."""
    # Which rows are first is decided on the narrow key columns; the messages of those rows
    # are then copied once (filtering the whole frame first copied every text and message).
    firsts = first_requests(_narrow(keyed))
    return keyed.select(
        pl.col("custom_id", "request_key", "user", "unit_tokens").gather(firsts["_row"])
    ).with_columns(firsts["urgent"])


def answer_family(job: JobSpec) -> str:
    """Whose answers the job's engine gives (`[model] backend` running `[model] name`)."""
    return backend_entry(job.model.backend).answer_family(job.model.name)


def key_units(job: JobSpec, units: pl.DataFrame, run_id: str) -> pl.DataFrame:
    """`request_keys` for a run's units: row units under the job's prompt fingerprint and answer
    family, eval units under one that also carries `run_id` when `[qa] eval_every_run` (never a
    cache hit); an empty unit gets custom_id "" (no request: it ends as a failed row with a
    reason)."""
    fingerprint = f"{job.prompt_fingerprint()}@{answer_family(job)}"
    rows = units.filter(pl.col("kind") == "row")
    evals = units.filter(pl.col("kind") == "eval")
    # The eval set is asked afresh in every run (its keys carry the run id): a cached answer
    # could not reveal that the provider's model changed under the same name.
    eval_fingerprint = f"{fingerprint}:eval:{run_id}" if job.qa.eval_every_run else fingerprint
    keyed = pl.concat(
        [
            request_keys(rows, job.prompt.user_template, fingerprint),
            request_keys(evals, job.prompt.user_template, eval_fingerprint),
        ],
        how="diagonal_relaxed",
    )
    return keyed.with_columns(
        pl.when(pl.col("text").str.len_bytes() > 0)
        .then(pl.col("custom_id"))
        .otherwise(pl.lit(""))
        .alias("custom_id")
    )


def route_fingerprints(job: JobSpec) -> list[str]:
    """`fingerprint@family` of every other engine of the job's `[route]`, in route order: the
    keys under which another step of the route may already hold a unit's answer."""
    if job.route is None:
        return []
    out = []
    for engine in job.route.engines:
        if engine == job.model.backend:
            continue
        other = job.model_copy(deep=True)
        other.model.backend, other.model.name = engine, job.route_models[engine]
        out.append(f"{other.prompt_fingerprint()}@{answer_family(other)}")
    return out


def carry_route_answers(store: Store, job: JobSpec, keyed: pl.DataFrame) -> pl.DataFrame:
    """A route step's row units that another engine of the route answered take that answer's
    key: they count as cache hits and are not asked again. The step's own answers come first,
    then the route's engines in order."""
    rows = keyed.filter((pl.col("kind") == "row") & (pl.col("custom_id") != ""))
    own = store.known_outcomes(rows["custom_id"].unique()).filter(pl.col("answered"))
    # units no answer covers yet; each engine of the route may take some of them
    todo = rows.filter(~pl.col("custom_id").is_in(own["custom_id"].implode())).drop(
        "user", "request_key", "custom_id"
    )
    for fingerprint in route_fingerprints(job):
        if todo.height == 0:
            break
        alt = request_keys(todo, job.prompt.user_template, fingerprint).select(
            "unit_id", "kind", pl.col("request_key").alias("_key"), pl.col("custom_id").alias("_id")
        )
        found = store.known_outcomes(alt["_id"].unique()).filter(pl.col("answered"))
        alt = alt.filter(pl.col("_id").is_in(found["custom_id"].implode()))
        keyed = (
            keyed.join(alt, on=["unit_id", "kind"], how="left")
            .with_columns(
                pl.coalesce("_key", "request_key").alias("request_key"),
                pl.coalesce("_id", "custom_id").alias("custom_id"),
            )
            .drop("_key", "_id")
        )
        todo = todo.join(alt, on=["unit_id", "kind"], how="anti")
    return keyed


_UNIT_COLUMNS = ("unit_id", "source_id", "kind", "chunk_index", "n_chunks", "unit_tokens")
_MESSAGE_COLUMNS = ("custom_id", "request_key", "user", "unit_tokens")


class WrittenIds:
    """The custom_ids whose message is written already, for a night's slices in turn. Looked
    up by a 64-bit hash of each id first and by the id itself only where a hash was seen: at a
    million requests, testing each slice's ids against every id written before took 3.5 s of
    CPU; the hashes, 0.3 s."""

    def __init__(self) -> None:
        self._ids = pl.Series("custom_id", [], dtype=pl.String)
        self._hashes = pl.Series("h", [], dtype=pl.UInt64)

    def first_time(self, firsts: pl.DataFrame) -> pl.DataFrame:
        """The rows of `firsts` whose custom_id was never written, now counted as written."""
        ids = firsts["custom_id"]
        hashes = ids.hash()
        maybe = hashes.is_in(self._hashes.implode())
        if maybe.any():
            # the same hash: the same id, or (rarely) another one; the ids decide
            seen = self._ids.filter(self._hashes.is_in(hashes.filter(maybe).implode()))
            new = ~(maybe & ids.is_in(seen.implode()))
            firsts, hashes = firsts.filter(new), hashes.filter(new)
        self._ids.append(firsts["custom_id"])
        self._hashes.append(hashes)
        return firsts


class Keyer:
    """Keys units a slice at a time, as chunk makes them (no file of units between the two
    stages: at a million rows writing and reading one back cost ~3.5 s of CPU). Writes the
    units' narrow columns with their keys (in order, numbered by `_row`) and the message of
    each key's first unit, once: a key already written by an earlier slice is not written
    again (so on a first night the file is exactly what is sent, and `write_to_send` renames
    it instead of copying ~1 GB at a million rows). Only one slice's texts and messages are
    held at a time, and the ids written so far."""

    def __init__(self, ctx: RunContext, run_id: str, work_dir: Path) -> None:
        self.job, self.store, self.run_id = ctx.job, ctx.store, run_id
        self.route_step = self.store.require_run(run_id)["route_step"] is not None
        self.keys = FileWriter(work_dir / "keyed.parquet")
        self.messages = FileWriter(work_dir / "messages.parquet")
        self.written = WrittenIds()

    def add(self, units: pl.DataFrame) -> None:
        """Key the next slice of units (input rows' first, then the eval set's)."""
        keyed = key_units(self.job, units, self.run_id)
        if self.route_step:
            keyed = carry_route_answers(self.store, self.job, keyed)
        narrow = _narrow(keyed, self.keys.rows)
        firsts = self.written.first_time(first_requests(narrow))
        local = firsts["_row"] - self.keys.rows
        self.messages.write(
            keyed.select(*_MESSAGE_COLUMNS)
            .gather(local)
            .with_columns(firsts["_row"], firsts["urgent"])
        )
        self.keys.write(pl.concat([keyed.select(*_UNIT_COLUMNS), narrow], how="horizontal"))

    def close(self) -> dict[str, str]:
        """The files written: `keyed` and `messages`, as `dedupe_task` reads them."""
        self.keys.close()
        self.messages.close()
        return {"keyed": str(self.keys.path), "messages": str(self.messages.path)}


def write_to_send(messages: Path, wanted: pl.DataFrame, path: Path) -> int:
    """The messages of the `wanted` rows (`_row`, urgent), in their order, to `path` in row
    groups of at most a slice; returns how many. When `messages` holds exactly those rows
    with that urgency (a first night: nothing cached, and no key's urgency set only by a unit
    in a later slice), it is renamed to `path` instead of copied (a million messages are
    ~1 GB); `_row` stays in it then."""
    if _written_as_wanted(messages, wanted):
        messages.rename(path)
        return wanted.height
    out = FileWriter(path)
    for part in file_slices(messages, _SLICE_ROWS):
        out.write(
            part.drop("urgent")
            .join(wanted, on="_row", how="inner", maintain_order="left")
            .drop("_row")
        )
    out.close()
    return out.rows


def _written_as_wanted(messages: Path, wanted: pl.DataFrame) -> bool:
    """Whether `messages` has the `wanted` rows and no other, each as urgent as wanted (a key
    whose units span slices was written with its first slice's urgency)."""
    written = pl.read_parquet(messages, columns=["_row", "urgent"])
    return written.height == wanted.height and written.equals(wanted.select("_row", "urgent"))


@task(name="dedupe", task_run_name="dedupe-{run_id}")
def dedupe_task(ctx: RunContext, run_id: str, chunked: dict) -> dict:
    """Units (keyed by chunk as it made them) → unique requests; saves the run's units and
    writes what is left to send."""
    started = time.perf_counter()
    store = ctx.store
    work_dir = ctx.work_dir(run_id)
    messages_path = Path(chunked["messages"])  # chunk keyed its units (`Keyer`)
    keyed = pl.read_parquet(chunked["keyed"])  # narrow: ids, keys and flags, no text
    uniq = first_requests(keyed)
    # flags in uniq's row order
    known = uniq.select("custom_id").join(
        store.known_outcomes(uniq["custom_id"]), on="custom_id", how="left", maintain_order="left"
    )
    answered, in_flight = known["answered"], known["in_flight"]
    cached = uniq["custom_id"].filter(answered)
    n_unique, n_attached = uniq.height, int((~answered & in_flight).sum())
    keyed = keyed.with_columns(pl.col("custom_id").is_in(cached.implode()).alias("cache_hit"))
    carried = pl.read_parquet(chunked["carried"]) if chunked.get("carried") else None
    store.save_units(run_id, keyed, chunked.get("carried_from"), carried)
    crash_point("after_dedupe")
    path = work_dir / "to_send.parquet"
    # in row groups of a slice: assemble and the manifest read it back a group at a time
    n_to_send = write_to_send(
        messages_path, uniq.filter(~answered & ~in_flight).select("_row", "urgent"), path
    )
    messages_path.unlink(missing_ok=True)  # renamed to `path` when every message is sent
    counts = store.prepared_counts(run_id)  # with the carried units
    stage_log(
        "dedupe",
        "%d units → %d unique requests, %d answered by earlier runs, %d to send, in %.1f s",
        keyed.height,
        n_unique,
        cached.len(),
        n_to_send,
        time.perf_counter() - started,
    )
    return {
        "to_send": str(path),
        "unique_requests": counts["unique_requests"],
        "cache_hits": counts["cache_hits"],
        "attached": n_attached,
        "n_to_send": n_to_send,
        "row_units": counts["row_units"],
    }
