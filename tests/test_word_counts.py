"""Counting long texts by their words must cut exactly as `split_spans` does, text by text."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide import word_counts
from lowtide.splitting import split_spans
from lowtide.tokens import count_tokens
from lowtide.word_counts import WordCounts

REPO = Path(__file__).resolve().parents[1]


def word_spans(
    texts: list[str], max_tokens: int, encoding: str, words: WordCounts | None = None
) -> list[list[tuple[int, int, int]]]:
    """What `long_text_cuts` makes of `WordCounts.spans`, per text as `split_spans` gives it:
    the texts it counted, then those it left, cut by `split_spans` (a fresh `WordCounts`
    unless one is given)."""
    counts = words or WordCounts(encoding)
    spans, left = counts.spans(pl.Series(texts, dtype=pl.String), max_tokens)
    out: list[list[tuple[int, int, int]]] = [[] for _ in texts]
    for i, start, length, tokens in spans.sort("i", "starts").iter_rows():
        out[i].append((start, length, tokens))
    for i in left:
        out[i] = split_spans(texts[i], max_tokens, 0, encoding)
    return out


PIECES = st.sampled_from(
    [
        "refund",
        "don't",
        "It's",
        "12345",
        "3.14",
        "Zoë",
        "naïve",
        "日本語のテキスト",
        "🙂",
        "\u00a0",  # no-break space
        "\t",
        "\r\n",
        "\n\n",
        "",
        " ",
        "  ",
        "...",
        "(quoted)",
        "<|endoftext|>",
        "a" * 40,
        '{"k": [1, 2]}',
    ]
)
TEXTS = st.lists(
    st.tuples(st.lists(PIECES, max_size=120), st.sampled_from([" ", " ", "", "\n", "  "])).map(
        lambda words_joiner: words_joiner[1].join(words_joiner[0])
    ),
    min_size=1,
    max_size=12,
)


@given(
    texts=TEXTS,
    budget=st.integers(min_value=8, max_value=90),
    encoding=st.sampled_from(["o200k_base", "cl100k_base"]),
)
@settings(max_examples=200, deadline=None)
def test_word_counts_cut_as_split_spans_does(texts: list[str], budget: int, encoding: str) -> None:
    # leading, trailing and doubled spaces, spaces after whitespace and after non-ASCII
    # characters (stretches of several words), texts that fit and texts cut many times
    counts = WordCounts(encoding)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(word_counts, "_MOST_NEW", 1.0)  # a few short texts: most words are new
        spans = word_spans(texts, budget, encoding, counts)
    assert not counts.off
    assert spans == [split_spans(t, budget, 0, encoding) for t in texts]


def test_words_met_in_earlier_slices_are_not_counted_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    messages = pl.read_csv(REPO / "data" / "support" / "messages.csv")["body"].str.strip_chars()
    # overlapping words; no text starts with a space, so only words are counted after one
    texts = [" ".join(messages[i : i + 12]) for i in range(0, 360, 3)]
    monkeypatch.setattr(word_counts, "_SLICE_TEXTS", 20)
    monkeypatch.setattr(word_counts, "_MOST_NEW", 1.0)  # a small sample's words are mostly new
    counts = WordCounts("o200k_base")
    counted: list[str] = []
    real = counts._count

    def count(text: str) -> int:
        counted.append(text)
        return real(text)

    counts._count = count
    spans = word_spans(texts, 200, "o200k_base", counts)
    assert spans == [split_spans(t, 200, 0, "o200k_base") for t in texts]
    assert sum(len(s) for s in spans) > 2 * len(texts)  # cut, not only counted
    assert not counts.off
    after_space = [c for c in counted if c.startswith(" ")]  # words and stretches
    assert len(after_space) == len(set(after_space))
    words = sum(len(t.split(" ")) for t in texts)
    assert len(counted) < words / 5


def test_a_word_whose_hash_is_kept_for_another_is_counted_as_itself() -> None:
    counts = WordCounts("o200k_base")
    text = "please refund my order " * 40
    # another word kept under "refund"'s hash, with a count that would be wrong for it
    counts._known = pl.DataFrame(
        {"h": pl.Series(["refund"]).hash(), "known": ["elsewhere"], "n": [99]},
        schema=counts._known.schema,
    )
    assert word_spans([text], 50, "o200k_base", counts) == [split_spans(text, 50)]
    assert counts._known.filter(pl.col("known") == "refund").height == 0  # its hash is taken


def test_texts_of_words_that_never_repeat_go_to_the_tokenizer() -> None:
    # identifiers, base64: counting each word once costs more than tokenizing the texts
    texts = [" ".join(f"{i:06x}{j:06x}" for j in range(300)) for i in range(40)]
    counts = WordCounts("o200k_base")
    assert word_spans(texts, 300, "o200k_base", counts) == [
        split_spans(t, 300, 0, "o200k_base") for t in texts
    ]
    assert counts.off and counts._known.height == 0


@pytest.mark.parametrize(
    "text",
    [
        # over the tokenizer's slice length: cut by `split_spans` itself
        "refund my order " * 4000,
        # no clean place for longer than a segment may run: `_encoded_spans`' way
        "word " * 300 + "日本語のテキスト" * 2000 + " word" * 300,
        # no clean place near the budget: cut mid-word
        "ok " + "x" * 3000 + " ok",
    ],
)
def test_texts_left_to_split_spans_are_cut_by_it(text: str) -> None:
    counts = WordCounts("o200k_base")
    spans = word_spans([text, "a short one " * 30], 400, "o200k_base", counts)
    assert not counts.off
    assert spans == [split_spans(t, 400, 0, "o200k_base") for t in (text, "a short one " * 30)]
    assert all(tokens == count_tokens(text[s : s + n]) for s, n, tokens in spans[0])
