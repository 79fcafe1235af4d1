"""Cutting many long texts at once from the token counts of their words.

A clean place (a space after a printable ASCII character, `lowtide.splitting`) starts a
pre-token of every tokenizer lowtide counts with, so the stretches of text between clean places
are tokenized independently: a text's tokens are its stretches' tokens, in order. Nearly every
stretch is one word with the space before it (" refund,"); the others hold a space after
whitespace or after a non-ASCII character ("  Zoë said"), or start the text.

Words repeat across a dataset: the 314,000 long texts of a million generated rows hold ~146
million words, 94% of them among the 30,000 most frequent. So each distinct stretch is counted
once a stage, and a text is counted by adding up its stretches' counts in polars, looked up by
hash, with no tokenizer call. Where the sum exceeds the budget the text is cut at the last clean
place within it: the pieces `split_spans` makes, for the same reason as `_segment_spans`. Over
120,000 such texts this took 0.78-0.88 of `split_spans`' CPU (three runs, each alternating the
two a slice at a time, 2026-12-07, AMD EPYC); a 1M first night's chunk stage, 39.2 s of CPU
against 45.7 s before, the same hour, and the whole night 73.5 s against a floor of 64.6 s.

Words that do not repeat (identifiers, base64, text in scripts without spaces) make counting
them one by one dearer than the tokenizer's pass over whole texts: a slice where over a tenth of
its words are new turns this off for the rest of the stage (`_MOST_NEW`), and `split_spans`
cuts every text.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import polars as pl

from lowtide.splitting import EDGE_TOKENS, LONGEST_CLEAN_GAP
from lowtide.tokens import SLICE_CHARS, counter

_SLICE_TEXTS = 5_000
"""Texts split into words at a time: their ~2.3 million words (~100 MB with what is computed
from them) are held for one slice. Over 100,000 long texts, 5,000 a slice touched 218,000-
243,000 fresh pages, 10,000 a slice 300,000-331,000 and 20,000 615,000, for about the same
CPU outside the kernel (2026-12-07, AMD EPYC)."""

_MOST_NEW = 0.10
"""Above this share of new distinct stretches among a slice's words, the slice and the rest of
the stage go to `split_spans`. Counting a new stretch costs ~1.2 µs; a slice of 5,000 long texts
(2.3 million words) took ~0.4 s of CPU beside that, and `split_spans` ~0.5-0.65 s. In the
generated data's first slices 5.5%, 2.7%, 2.0%, 1.6% ... 0.6% of the words were new; at a
steady 10% this would cost ~1.2x `split_spans`, and words that never repeat (100%) ~5x."""

_MOST_WORDS = 2_000_000
"""Distinct stretches kept (~60 MB); past this, new ones are still counted but not kept."""

SPAN_COLUMNS = {"i": pl.UInt32, "starts": pl.Int32, "lengths": pl.Int32, "tokens": pl.Int32}
"""A piece of text `i`, as `split_spans` gives it, one row each."""


class WordCounts:
    """Token counts of the words met so far under one encoding, for one stage."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._count: Callable[[str], int] = counter(encoding)
        # the tokens of " " + a stretch's text (looked up by its hash): every stretch but a
        # text's first follows a clean place
        self._known = pl.DataFrame(schema={"h": pl.UInt64, "known": pl.String, "n": pl.UInt32})
        self.off = False

    def spans(self, texts: pl.Series, max_tokens: int) -> tuple[pl.DataFrame, list[int]]:
        """The pieces `split_spans(text, max_tokens, 0, encoding)` makes of each text, as rows
        (i: the text's index, starts, lengths, tokens), and the indices of the texts left to
        `split_spans` itself (over the tokenizer's slice length, with a long stretch without a
        clean place, no clean place near the budget, or all of them once this is off)."""
        frames: list[pl.DataFrame] = []
        left: list[int] = []
        for offset in range(0, texts.len(), _SLICE_TEXTS):
            part = texts.slice(offset, _SLICE_TEXTS)
            if self.off:
                left.extend(range(offset, offset + part.len()))
                continue
            spans, part_left = self._slice_spans(part, max_tokens)
            frames.append(spans.with_columns(pl.col("i") + offset))
            left.extend(i + offset for i in part_left)
        spans = pl.concat(frames) if frames else pl.DataFrame(schema=SPAN_COLUMNS)
        return spans, left

    def _slice_spans(self, texts: pl.Series, max_tokens: int) -> tuple[pl.DataFrame, list[int]]:
        frame = pl.DataFrame({"t": texts}).with_row_index("i")
        frame = frame.with_columns(pl.col("t").str.len_chars().alias("chars"))
        fits = pl.col("chars") <= SLICE_CHARS
        left = frame.filter(~fits)["i"].to_list()
        frame = frame.filter(fits)
        words = _words(frame)
        tokens = self._word_tokens(words)
        if tokens is None:
            self.off = True
            return pl.DataFrame(schema=SPAN_COLUMNS), list(range(texts.len()))
        words = words.with_columns(tokens.alias("n"))
        ends = frame.select("i", "chars").join(
            words.group_by("i").agg(pl.col("n").sum().alias("tokens")), on="i"
        )
        whole = (
            ends.filter(pl.col("tokens") <= max_tokens)
            .select("i", pl.lit(0).alias("starts"), pl.col("chars").alias("lengths"), "tokens")
            .cast(SPAN_COLUMNS)  # type: ignore[arg-type]
        )
        over = ends.filter(pl.col("tokens") > max_tokens).sort("i")  # `_cut` searches it
        cut, cut_left = _cut(words.filter(pl.col("i").is_in(over["i"].implode())), over, max_tokens)
        return pl.concat([whole, cut]), sorted(left + cut_left)

    def _word_tokens(self, words: pl.DataFrame) -> pl.Series | None:
        """The tokens of each stretch between clean places, on its first word's row (0 on the
        others), or None where too many words are new (see `_MOST_NEW`)."""
        # a word with clean places on both sides is looked up in place
        tokens = words.select(pl.when("alone").then(self._look_up(words["p"])).alias("n"))["n"]
        # a stretch of several words holds a space after whitespace or a non-ASCII character:
        # it is looked up whole, as a word is (both follow a space), but a text's first has no
        # space before it, and is counted as it is
        stretches = (
            words.with_row_index("k")
            .filter(~pl.col("alone"))
            .group_by("r", maintain_order=True)
            .agg(pl.col("k", "f").first(), pl.col("p").str.join(" "))
        )
        inner = stretches.filter(~pl.col("f")).select("k", "p")
        inner = inner.with_columns(self._look_up(inner["p"]))
        unknown = pl.concat(
            [
                words.with_row_index("k")
                .filter(pl.col("alone") & tokens.is_null())
                .select("k", "p"),
                inner.filter(pl.col("n").is_null()).select("k", "p"),
            ]
        )
        new = unknown["p"].unique()
        if new.len() > _MOST_NEW * max(words.height, 1):
            return None
        counted = _counted(new.to_frame(), self._count, space=True)
        if self._known.height < _MOST_WORDS:
            # one word per hash kept: another word of a hash kept already is counted each time
            kept = counted.select(pl.col("p").hash().alias("h"), pl.col("p").alias("known"), "n")
            kept = kept.unique(subset="h", keep="first").join(self._known, on="h", how="anti")
            self._known = pl.concat([self._known, kept], rechunk=False)
        fills = pl.concat(
            [
                inner.filter(pl.col("n").is_not_null()).select("k", "n"),
                unknown.join(counted, on="p").select("k", "n"),
                _counted(stretches.filter("f"), self._count, space=False).select("k", "n"),
            ]
        )
        return tokens.fill_null(0).scatter(fills["k"], fills["n"])

    def _look_up(self, texts: pl.Series) -> pl.Series:
        """`n`: the tokens of " " + each text where they are known, else null, in order; by the
        text's hash (a join on 64 bits costs half of one on the texts), then the text."""
        looked = texts.to_frame("p").with_columns(pl.col("p").hash().alias("h"))
        looked = looked.join(self._known, on="h", how="left", maintain_order="left")
        return looked.select(pl.when(pl.col("p") == pl.col("known")).then("n").alias("n"))["n"]


def _counted(rows: pl.DataFrame, count: Callable[[str], int], *, space: bool) -> pl.DataFrame:
    """`rows` with `n`: the tokens of each one's text `p`, after a space where `space`."""
    before = " " if space else ""
    tokens = [count(before + text) for text in rows["p"].to_list()]
    return rows.with_columns(pl.Series("n", tokens, dtype=pl.UInt32))


def _words(frame: pl.DataFrame) -> pl.DataFrame:
    """The texts' words, one row each in order: i (text), p (the word, without the space
    before it), f (a text's first), c (a clean place before it, or a text's start), alone
    (clean places on both sides: looked up), r (its stretch's number)."""
    first = pl.col("i") != pl.col("i").shift(1)
    after_printable = pl.col("p").shift(1).str.slice(-1).is_between(pl.lit("!"), pl.lit("~"))
    words = (
        frame.select("i", pl.col("t").str.split(" ").alias("p"))
        .explode("p")
        .with_columns(first.fill_null(True).alias("f"))
        .with_columns((pl.col("f") | after_printable.fill_null(False)).alias("c"))
    )
    return words.with_columns(
        (pl.col("c") & pl.col("c").shift(-1).fill_null(True) & ~pl.col("f")).alias("alone"),
        pl.col("c").cum_sum().alias("r"),
    )


def _cut(
    words: pl.DataFrame, ends: pl.DataFrame, max_tokens: int
) -> tuple[pl.DataFrame, list[int]]:
    """Pieces of the texts over the budget (`ends`: i, chars, tokens, sorted by i; `words`:
    theirs, in order, with `n`), each ending at the last clean place within it, as `splitting._segment_spans` cuts,
    all texts a piece at a time; the texts it would leave to `_encoded_spans` are left."""
    if not words.height:
        return pl.DataFrame(schema=SPAN_COLUMNS), []
    # a word's characters and the space before it (a text's first has none): a clean place
    # is that space, so it starts the piece after the cut
    width = (pl.col("p").str.len_chars() + (~pl.col("f")).cast(pl.UInt32)).cast(pl.Int64)
    clean = (
        words.select("i", "f", "c", pl.col("n").cast(pl.Int64), width.alias("w"))
        .with_columns(_within_text(pl.col("n")).alias("before"), _within_text(pl.col("w")))
        .filter("c")
    )
    texts = ends["i"].to_numpy()
    owner = np.searchsorted(texts, clean["i"].to_numpy())  # each place's text, 0..len(ends)
    before, at = clean["before"].to_numpy(), clean["w"].to_numpy()
    n, chars = ends["tokens"].to_numpy().astype(np.int64), ends["chars"].to_numpy()
    # `_segment_starts` finds no segment where clean places lie further apart than this
    following = np.where(owner[1:] == owner[:-1], at[1:], chars[owner[:-1]])
    gaps = np.append(following, chars[owner[-1]]) - at
    firsts = np.flatnonzero(np.diff(owner, prepend=-1))
    far = np.maximum.reduceat(gaps, firsts) > LONGEST_CLEAN_GAP
    window = max(1, max_tokens - EDGE_TOKENS)
    reach = max(8, window // 8)
    keys = owner * _KEY_SPAN + before  # sorted: by text, then tokens before
    start_tok = np.zeros(len(texts), np.int64)
    start_char = np.zeros(len(texts), np.int64)
    left = far.copy()
    pieces = []
    todo = np.flatnonzero(~far & (n > window))
    while todo.size:
        k = np.searchsorted(keys, todo * _KEY_SPAN + start_tok[todo] + window, "right") - 1
        cut_tok, cut_char = before[k], at[k]
        made = cut_tok - start_tok[todo]
        give_up = (made <= 0) | (made < window - reach)
        left[todo[give_up]] = True
        todo, k, cut_tok, cut_char, made = (x[~give_up] for x in (todo, k, cut_tok, cut_char, made))
        pieces.append((todo, start_char[todo], cut_char - start_char[todo], made))
        start_tok[todo], start_char[todo] = cut_tok, cut_char
        todo = todo[start_tok[todo] + window < n[todo]]
    done = np.flatnonzero(~left)
    pieces.append(
        (done, start_char[done], chars[done] - start_char[done], n[done] - start_tok[done])
    )
    at_text, starts, lengths, tokens = (np.concatenate(part) for part in zip(*pieces, strict=True))
    kept = ~left[at_text]  # a text given up after its first pieces keeps none of them
    spans = pl.DataFrame(
        {
            "i": texts[at_text[kept]],
            "starts": starts[kept],
            "lengths": lengths[kept],
            "tokens": tokens[kept],
        },
        schema=SPAN_COLUMNS,
    )
    return spans.sort("i", "starts"), texts[left].tolist()


_KEY_SPAN = 1 << 32
"""A text's clean places are numbered from its index times this, so that one search over all
texts finds each one's cut (a text holds fewer tokens than this)."""


def _within_text(column: pl.Expr) -> pl.Expr:
    """The running sum of `column` before each word, from its text's first word."""
    before = column.cum_sum() - column
    return before - pl.when(pl.col("f")).then(before).forward_fill()
