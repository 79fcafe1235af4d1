"""Where each long text was cut into chunks, so that a night re-tokenizes only new texts.

Cutting is a pure function of the text and the budget (encoding, max tokens, overlap), and
tokenizing the long tail is most of chunking's cost; an unchanged row's cuts are looked up by
a key of its text instead (`lowtide.digests.text_key`; cuts remembered before it are keyed by
the text's md5 until a night meets the text again). Pieces are kept as character spans, never
as copies of the text.
"""

from __future__ import annotations

import polars as pl

from lowtide.digests import TEXT_KEY_PREFIX
from lowtide.store._db import Database, frame

CUTS_SCHEMA: dict[str, pl.DataType] = {
    "text_key": pl.String(),
    "starts": pl.List(pl.Int32),
    "lengths": pl.List(pl.Int32),
    "tokens": pl.List(pl.Int32),
}


class ChunkCutsStore(Database):
    def chunk_cuts(self, budget: str, keys: pl.Series) -> pl.DataFrame:
        """The remembered cuts of these texts (by their keys) under `budget`: text_key,
        starts, lengths, tokens; texts never cut under it are absent."""
        with self._connect() as con:
            con.register("wanted", pl.DataFrame({"text_key": keys.unique()}))
            found = frame(
                con,
                "SELECT c.text_key, c.starts, c.lengths, c.tokens FROM chunk_cuts c "
                "JOIN wanted w ON w.text_key = c.text_key WHERE c.budget = ?",
                [budget],
            )
        if not found.height:
            return pl.DataFrame(schema=CUTS_SCHEMA)
        # no key (migration 19): two processes that cut one text at once may both have kept it
        return found.unique(subset="text_key", keep="any")

    def has_md5_cuts(self, budget: str) -> bool:
        """Whether cuts remembered before `text_key` (keyed by md5) remain under `budget`: only
        then is a text not found by its key looked up by its md5."""
        with self._connect() as con:
            row = con.execute(
                "SELECT EXISTS (SELECT 1 FROM chunk_cuts WHERE budget = ? "
                "AND NOT starts_with(text_key, ?))",
                [budget, TEXT_KEY_PREFIX],
            ).fetchone()
        return bool(row and row[0])

    def remember_chunk_cuts(self, budget: str, cuts: pl.DataFrame, recipe: str) -> None:
        """Keep new cuts (text_key, starts, lengths, tokens); a text already known is kept as
        it was (the same text under the same budget is always cut the same way). A cut found
        by its md5 comes with that key in `replaces`: it is kept under its new key instead.
        Cuts made by another `recipe` (an older cutter or tokenizer, whose budgets no job
        asks again) are dropped, so an upgrade does not leave the state file holding both."""
        if not cuts.height:
            return
        with self._transaction() as con:
            con.execute("DELETE FROM chunk_cuts WHERE NOT starts_with(budget, ?)", [recipe + ":"])
            con.register("incoming", cuts.unique(subset="text_key"))
            if "replaces" in cuts.columns:
                con.execute(
                    "DELETE FROM chunk_cuts WHERE budget = ? AND text_key IN "
                    "(SELECT replaces FROM incoming WHERE replaces IS NOT NULL)",
                    [budget],
                )
            con.execute(
                "INSERT INTO chunk_cuts SELECT i.text_key, $budget, i.starts, i.lengths, "
                "i.tokens FROM incoming i ANTI JOIN "
                "(SELECT text_key FROM chunk_cuts WHERE budget = $budget) USING (text_key)",
                {"budget": budget},
            )
