"""The lines a request is sent as, built from the store, and the messages files beside it.

A request's line is stored whole (re-asks) or rebuilt from its template and its message: stored
in `requests.user_message` (files from before migration 17), or in the messages file its
`message_file` names (`message_files`). Every send builds its lines here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import duckdb
import polars as pl

from lowtide.errors import LowtideError
from lowtide.request_lines import RequestLines, json_string
from lowtide.slices import file_slices
from lowtide.store import message_files
from lowtide.store._db import Database, frame
from lowtide.vocabulary import ANSWERED, IN_FLIGHT_RUN, sql_list

LINE_SQL = (
    "coalesce(q.line, t.head || '\"' || q.custom_id || '\"' || t.mid || "
    "to_json(coalesce(q.user_message, m.user)) || t.tail)"
)
"""A request's line: stored whole (re-asks), or rebuilt from its template (`t`) and message
(stored, or in its messages file: joined as `m` by `_WITH_MESSAGE`). `line_expr` builds the same
lines in polars."""

_HEX_ESCAPE = "\\u00"
"""How a JSON string holds a control character it has no short escape for: polars writes its
hex digits in lower case, DuckDB's `to_json` in upper case (the only difference between the two
found over a million real texts)."""


def json_strings(con: duckdb.DuckDBPyConnection, texts: pl.Series) -> pl.Series:
    """Each text as a JSON string, quotes included (null stays null), byte for byte as
    `LINE_SQL`'s `to_json` writes it, so a line is the same whichever builds it. polars
    escapes in compiled code: a night's million lines took half the CPU of DuckDB's building
    them. The rare strings holding a hex escape (or the text `\\u00` itself) are escaped by
    `to_json` itself."""
    escaped = (
        texts.rename("u")
        .to_frame()
        .select(pl.when(pl.col("u").is_not_null()).then(json_string("u")))
        .to_series()
    )
    # a literal search (a tenth of the CPU of testing the texts for control characters)
    odd = escaped.str.contains(_HEX_ESCAPE, literal=True).fill_null(False).arg_true()
    if odd.len():
        con.register("odd", texts.gather(odd).rename("u").to_frame())
        try:
            by_sql = con.sql("SELECT to_json(u) AS j FROM odd").pl()["j"]
        finally:
            con.unregister("odd")
        escaped = escaped.scatter(odd, by_sql)
    return escaped.rename(texts.name)


def line_expr(escaped_user: str) -> pl.Expr:
    """`LINE_SQL` in polars, over a frame of the requests' columns, their templates' (`head`,
    `mid`, `tail`) and the column `escaped_user` (`json_strings` of their messages)."""
    built = pl.concat_str(
        pl.col("head"),
        pl.lit('"'),
        pl.col("custom_id"),
        pl.lit('"'),
        pl.col("mid"),
        pl.col(escaped_user),
        pl.col("tail"),
    )
    return pl.coalesce(pl.col("line"), built)


_WITH_MESSAGE = (
    " LEFT JOIN {messages} m ON m.message_file = q.message_file AND m.custom_id = q.custom_id"
)


log = logging.getLogger(__name__)

_NO_FILE_NEEDED = _WITH_MESSAGE.format(messages=message_files.NO_MESSAGES)
"""The messages join for requests that need no file (`LINE_SQL` still names `m.user`)."""

_LINES_PER_PART = 50_000
"""Lines `each_batch_lines` hands over at a time."""


class LinesStore(Database):
    """Request lines for sending, and the messages files they are built from."""

    @property
    def messages_dir(self) -> Path:
        """Where the requests' messages files live: beside the state file, kept with it."""
        return message_files.folder_of(self.path)

    def prune_messages(self) -> int:
        """`_prune_messages`, for a run that is done: a failure is logged, not raised (the files
        are cut when the next run ends)."""
        try:
            return self._prune_messages()
        except (OSError, duckdb.Error, pl.exceptions.PolarsError) as e:
            log.warning("messages files in %s not cut down: %s", self.messages_dir, e)
            return 0

    def _prune_messages(self) -> int:
        """Cut each messages file that no unfinished run may still write or send from down to
        the messages of its requests without an answer (a retry or a later run may still send
        those) or asked by an unfinished run; a file left with none is removed. Returns how many
        files were cut or removed."""
        live = self._query(
            "SELECT run_id FROM runs WHERE list_contains(?, status)", [sql_list(IN_FLIGHT_RUN)]
        )["run_id"].to_list()
        files = message_files.prunable(self.messages_dir, live)
        if not files:
            return 0
        with self._connect() as con:
            con.register("names", pl.DataFrame({"message_file": [f.name for f in files]}))
            con.register("live", pl.DataFrame({"run_id": live}, schema={"run_id": pl.String}))
            # kept: what has no answer yet, and what an unfinished run asks (it may have found
            # the request unanswered and be about to send it with this file's message)
            unanswered = frame(
                con,
                "SELECT q.message_file, q.custom_id FROM requests q "
                "JOIN names USING (message_file) LEFT JOIN results r USING (custom_id) "
                "WHERE NOT coalesce(list_contains(?, r.outcome), false) OR q.custom_id IN "
                "(SELECT custom_id FROM units JOIN live USING (run_id))",
                [list(ANSWERED)],
            )
        changed = 0
        for path in files:
            wanted = unanswered.filter(pl.col("message_file") == path.name)["custom_id"]
            changed += message_files.cut_to(path, wanted)
        return changed

    def batch_lines(self, batch_id: str) -> RequestLines:
        """The JSONL lines of a batch, exactly as they are sent, built in the database and kept
        in Arrow (`RequestLines`)."""
        members = "batch_requests br JOIN requests q USING (custom_id) WHERE br.batch_id = ?"
        with self._connect() as con:
            messages = self._with_message(con, members, [batch_id])
            rows = con.sql(
                f"SELECT {LINE_SQL} AS line FROM batch_requests br JOIN requests q USING (custom_id) "
                f"LEFT JOIN request_templates t USING (template_id){messages} "
                "WHERE br.batch_id = ? ORDER BY q.custom_id",
                params=[batch_id],
            ).to_arrow_table()
        self._require_lines(rows.column("line").null_count)
        return RequestLines(rows.column("line"))

    def each_batch_lines(self, batch_ids: list[str], sink: Callable[[pl.DataFrame], None]) -> None:
        """The lines of every batch in `batch_ids`, handed to `sink` as frames of (batch_id,
        custom_id, line) in no particular order, each line as polars built it (a JSONL writer
        writes them from there: handing them over as Arrow's classic strings copied every line
        once more, ~1.8 GB of fresh memory at a million requests). One pass for
        them all, where `batch_lines` joins once per batch (each join reads every message:
        ~1.7 s of CPU per 50,000-line batch at a million requests). The requests whose
        messages are in a file meet it a slice of the file at a time: joined whole, DuckDB
        built its hash table on the ~1 GB of messages and spilled it to disk (12 s of CPU, not
        5)."""
        members = "batch_requests br JOIN wanted USING (batch_id) JOIN requests q USING (custom_id)"
        with self._connect() as con:
            con.register(
                "wanted", pl.DataFrame({"batch_id": batch_ids}, schema={"batch_id": pl.String})
            )
            # lines that need no file: sent whole (re-asks), or their message stored in the table
            reader = con.sql(
                f"SELECT br.batch_id, q.custom_id, {LINE_SQL} AS line FROM {members} "
                f"LEFT JOIN request_templates t USING (template_id){_NO_FILE_NEEDED} "
                "WHERE q.message_file IS NULL"
            ).to_arrow_reader(_LINES_PER_PART)
            for part in reader:
                self._require_lines(part.column("line").null_count)
                sink(pl.DataFrame(pl.from_arrow(part)))
            names = con.execute(
                f"SELECT DISTINCT q.message_file FROM {members} WHERE q.message_file IS NOT NULL"
            ).fetchall()
            for (name,) in names:
                requests = frame(
                    con,
                    "SELECT br.batch_id, q.custom_id, q.template_id, q.line, q.user_message "
                    f"FROM {members} WHERE q.message_file = ?",
                    [name],
                )
                placed = self._placed(name, requests)
                wanted = requests.height
                del requests  # `placed` holds them now: let go before any line is built
                found = self._lines_from_file(con, name, placed, sink)
                self._require_lines(wanted - found)

    def _placed(self, name: str, requests: pl.DataFrame) -> pl.DataFrame | None:
        """`requests`, whose messages are in the file `name`, each with its row in the file
        (`_at`), in that order; None when the file is gone. Placed by polars, a file at a
        time, in the order of the file's ids (read alone), so nothing is sorted: DuckDB copying
        every file's requests to Arrow, then joining and sorting them, topped this pass, the
        night's peak, at 1.73-1.80 GB in a 1M first night; this way at 1.39-1.45 GB."""
        path = self.messages_dir / name
        if not path.is_file():
            return None
        at = pl.scan_parquet(path).select("custom_id").with_row_index("_at").collect()
        return at.join(requests, on="custom_id", how="inner", maintain_order="left")

    def _lines_from_file(
        self,
        con: duckdb.DuckDBPyConnection,
        name: str,
        placed: pl.DataFrame | None,
        sink: Callable[[pl.DataFrame], None],
    ) -> int:
        """The lines of the requests `placed` in the file `name` (`_placed`), a slice of it at a
        time; returns how many (fewer than asked for when the file lacks some). Placed by their
        rows, each slice of messages meets only its own requests, not all of them again, and
        each takes its message by position, not by a join on custom_id."""
        if placed is None:
            return 0
        path = self.messages_dir / name
        at = placed["_at"]
        # the few templates, joined to each slice's requests in polars (repeated as views of
        # one copy) instead of by DuckDB for every line
        templates = frame(con, "SELECT template_id, head, mid, tail FROM request_templates")
        found, offset = 0, 0
        for part in file_slices(path, _LINES_PER_PART, ["user"]):  # rows are placed by `_at`
            lo, hi = (int(at.search_sorted(v)) for v in (offset, offset + part.height))
            q = placed.slice(lo, hi - lo).join(
                templates, on="template_id", how="left", maintain_order="left"
            )
            # each request's message is at its row of the slice, taken by position (a night's
            # lines at 1M requests: 15.0 -> 12.7 s of CPU against a hash join on custom_id)
            message = part["user"].gather(q["_at"] - offset)
            users = pl.select(pl.coalesce(q["user_message"], message)).to_series()
            offset += part.height
            lines = q.with_columns(json_strings(con, users).alias("_escaped")).select(
                "batch_id", "custom_id", line_expr("_escaped").alias("line")
            )
            self._require_lines(lines["line"].null_count())
            found += lines.height
            sink(lines)
        return found

    def request_lines(self, custom_ids: list[str]) -> pl.DataFrame:
        """(custom_id, request_key, line, est_input_tokens, error, finish_reason) of stored
        requests, with their last result's error if any."""
        with self._connect() as con:
            con.register(
                "wanted", pl.DataFrame({"custom_id": custom_ids}, schema={"custom_id": pl.String})
            )
            messages = self._with_message(con, "requests q JOIN wanted USING (custom_id)")
            lines = frame(
                con,
                f"SELECT q.custom_id, q.request_key, {LINE_SQL} AS line, q.est_input_tokens, "
                "r.error, r.finish_reason FROM requests q JOIN wanted USING (custom_id) "
                f"LEFT JOIN request_templates t USING (template_id){messages} "
                "LEFT JOIN results r USING (custom_id)",
            )
        self._require_lines(lines["line"].null_count())
        return lines

    def _with_message(
        self, con: duckdb.DuckDBPyConnection, requests: str, params: list[str] | None = None
    ) -> str:
        """The join that gives the `requests` (SQL naming them `q`) their messages: only the
        files they name are read."""
        names = con.execute(
            f"SELECT DISTINCT q.message_file FROM {requests}", params or []
        ).fetchall()
        relation = message_files.relation(self.messages_dir, (n for (n,) in names))
        return _WITH_MESSAGE.format(messages=relation)

    def _require_lines(self, missing: int) -> None:
        """Refuse to send requests whose line cannot be built (their messages file is gone)."""
        if missing:
            raise LowtideError(
                f"{missing} request(s) to send have no message: the file that holds it in "
                f"{self.messages_dir} is missing or lacks it (the folder is part of the state; "
                "restore it from the same backup). Nothing was sent. Without it, cancel the run "
                "(`lowtide cancel RUN_ID`) and run the job again: the new run stores the "
                "messages anew"
            )
