"""Where each long text was cut into chunks, so that a night re-tokenizes only new texts.

Cutting is a pure function of the text and the budget (encoding, max tokens, overlap), and
tokenizing the long tail is most of chunking's cost; an unchanged row's cuts are looked up by
the md5 of its text instead. Pieces are kept as character spans, never as copies of the text.
"""

from __future__ import annotations

import polars as pl

from lowtide.store._db import Database, frame

CUTS_SCHEMA: dict[str, pl.DataType] = {
    "text_md5": pl.String(),
    "starts": pl.List(pl.Int32),
    "lengths": pl.List(pl.Int32),
    "tokens": pl.List(pl.Int32),
}


class ChunkCutsStore(Database):
    def chunk_cuts(self, budget: str, digests: pl.Series) -> pl.DataFrame:
        """The remembered cuts of these texts (by md5) under `budget`: text_md5, starts,
        lengths, tokens; texts never cut under it are absent."""
        with self._connect() as con:
            con.register("wanted", pl.DataFrame({"text_md5": digests.unique()}))
            found = frame(
                con,
                "SELECT c.text_md5, c.starts, c.lengths, c.tokens FROM chunk_cuts c "
                "JOIN wanted w ON w.text_md5 = c.text_md5 WHERE c.budget = ?",
                [budget],
            )
        return found if found.height else pl.DataFrame(schema=CUTS_SCHEMA)

    def remember_chunk_cuts(self, budget: str, cuts: pl.DataFrame, recipe: str) -> None:
        """Keep new cuts (text_md5, starts, lengths, tokens); a text already known is kept as
        it was (the same text under the same budget is always cut the same way). Cuts made by
        another `recipe` (an older cutter or tokenizer, whose budgets no job asks again) are
        dropped, so an upgrade does not leave the state file holding both."""
        if not cuts.height:
            return
        with self._transaction() as con:
            self._make_room(con, cuts.height)
            con.execute("DELETE FROM chunk_cuts WHERE NOT starts_with(budget, ?)", [recipe + ":"])
            con.register("incoming", cuts.unique(subset="text_md5"))
            con.execute(
                "INSERT INTO chunk_cuts SELECT text_md5, ?, starts, lengths, tokens "
                "FROM incoming ON CONFLICT DO NOTHING",
                [budget],
            )
