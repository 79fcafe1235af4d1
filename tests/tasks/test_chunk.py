from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide import splitting, tokens
from lowtide.digests import md5_hex, text_key
from lowtide.splitting import split_spans, split_text
from lowtide.store import Store
from lowtide.store.chunk_cuts import CUTS_SCHEMA
from lowtide.tokens import count_tokens
from tasks import chunk
from tasks.chunk import chunk_units
from tests.sql import scalar

REPO = Path(__file__).resolve().parents[2]

WORDS = st.lists(
    st.sampled_from(
        [
            "refund",
            "Zoë",
            "naïve",
            "🙂",
            "order #1234",
            "\n\n",
            "  ",
            "€12.50",
            "日本語",
            "shipping",
            "the",
            "a",
            "x" * 30,
            "\\",
            '"quoted"',
        ]
    ),
    min_size=0,
    max_size=400,
)


@given(words=WORDS, budget=st.integers(min_value=16, max_value=120))
@settings(max_examples=60, deadline=None)
def test_split_pieces_reassemble_and_fit(words: list[str], budget: int) -> None:
    text = " ".join(words)
    pieces = split_text(text, budget, overlap=0)
    assert "".join(pieces) == text
    assert all(count_tokens(p) <= budget for p in pieces)


@given(words=WORDS, budget=st.integers(min_value=32, max_value=120))
@settings(max_examples=40, deadline=None)
def test_split_with_overlap_covers_text_in_order(words: list[str], budget: int) -> None:
    text = " ".join(words)
    pieces = split_text(text, budget, overlap=8)
    assert all(count_tokens(p) <= budget for p in pieces)
    assert pieces[0] == text[: len(pieces[0])]
    assert text.endswith(pieces[-1])


ROUGH_WORDS = st.lists(
    st.sampled_from(
        [
            "refund",
            "don't",
            "It's",
            "12345",
            "3.14",
            "\u00a0",  # no-break space
            "\u3000",  # ideographic space
            "\t",
            "\r\n",
            " ",
            "   ",
            "...",
            "(quoted)",
            "<|endoftext|>",
            "<|im_start|>user",
            "日本語のテキスト",
            "🙂🙂",
            "Zoë",
            "a" * 40,
            "//",
            '{"k": [1, 2]}',
        ]
    ),
    min_size=0,
    max_size=300,
)


@given(
    words=ROUGH_WORDS,
    joiner=st.sampled_from([" ", "", "\n", "  "]),
    budget=st.integers(min_value=8, max_value=90),
    overlap=st.sampled_from([0, 0, 4]),
)
@settings(max_examples=150, deadline=None)
def test_every_piece_is_counted_as_its_own_encoding(
    words: list[str], joiner: str, budget: int, overlap: int
) -> None:
    # most counts are a subtraction of the whole text's token offsets, not a second encoding:
    # they must still equal what encoding the piece alone gives, within the budget
    text = joiner.join(words)
    spans = split_spans(text, budget, overlap=overlap)
    for start, length, counted in spans:
        piece = text[start : start + length]
        assert counted == count_tokens(piece), (piece, counted)
        assert counted <= budget
    if overlap == 0:
        assert "".join(text[s : s + n] for s, n, _ in spans) == text
    else:
        assert spans[0][0] == 0 and sum(spans[-1][:2]) == len(text)
        assert [s for s, _, _ in spans] == sorted({s for s, _, _ in spans})


@pytest.mark.parametrize(
    ("text", "budget", "overlap", "encoding"),
    [
        # characters wider than one token, tiny budgets, overlap: a piece was once empty and
        # the starts after it shifted
        ('\U0001d400? \U0002000b"\u2019', 8, 3, "o200k_base"),
        ("\U0001f9a9a \U0001d400<|dftt|>", 12, 4, "cl100k_base"),
        # over the tokenizer's slice length, with no clean place to slice: counted piece by piece
        (
            ("hello world " * 3000)[:24998]
            + "b   y"
            + ("hello\u00a0world\u00a0" * 3000)[:24998]
            + " word" * 4000,
            15000,
            0,
            "o200k_base",
        ),
    ],
)
def test_awkward_texts_keep_pieces_in_order_and_counted(
    text: str, budget: int, overlap: int, encoding: str
) -> None:
    spans = split_spans(text, budget, overlap=overlap, encoding=encoding)
    starts = [s for s, _, _ in spans]
    assert starts == sorted(set(starts)) and starts[0] == 0
    assert sum(spans[-1][:2]) == len(text)
    for start, length, counted in spans:
        assert length > 0
        assert counted == count_tokens(text[start : start + length], encoding)
    if overlap == 0:
        assert "".join(text[s : s + n] for s, n, _ in spans) == text


def test_prose_is_cut_between_words_and_tokenized_once(monkeypatch: pytest.MonkeyPatch) -> None:
    counted: list[str] = []
    encoded: list[str] = []
    real_count, real_encode = splitting.count_clean, splitting.encode

    def counting(text: str, encoding: str = tokens.DEFAULT_ENCODING) -> int:
        counted.append(text)
        return real_count(text, encoding)

    def encoding(text: str, encoding: str = tokens.DEFAULT_ENCODING) -> list[int]:
        encoded.append(text)
        return real_encode(text, encoding)

    monkeypatch.setattr(splitting, "count_clean", counting)
    monkeypatch.setattr(splitting, "encode", encoding)
    monkeypatch.setattr(splitting, "count_tokens", lambda *a: pytest.fail("re-encoded a piece"))
    text = " ".join(f"word{i} and its neighbour, said the {i}th clause." for i in range(300))
    pieces = split_text(text, 100)
    assert "".join(counted) == text  # counted once, a segment at a time
    # and only the segment each cut falls in is encoded, once per cut
    assert len(encoded) == len(pieces) - 1
    assert all(len(e) < 2 * splitting._SEGMENT_CHARS for e in encoded)
    assert len(pieces) > 10
    assert all(p.startswith(" ") and not p.startswith("  ") for p in pieces[1:])
    assert all(not p.endswith(" ") for p in pieces)


@given(
    words=ROUGH_WORDS,
    joiner=st.sampled_from([" ", "", "\n", "  "]),
    budget=st.integers(min_value=8, max_value=90),
    segment=st.sampled_from([5, 40, 500]),
    encoding=st.sampled_from(["o200k_base", "cl100k_base"]),
)
@settings(max_examples=200, deadline=None)
def test_counting_in_segments_cuts_as_encoding_the_whole_text_does(
    words: list[str], joiner: str, budget: int, segment: int, encoding: str
) -> None:
    # the segments are only a cheaper way to the same pieces: a text cut before keeps its
    # pieces (and its requests' cached answers)
    text = joiner.join(words)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(splitting, "_SEGMENT_CHARS", segment)
        spans = splitting._segment_spans(text, budget, encoding)
    if spans is not None:  # None: not cut cleanly throughout, left to the whole text's tokens
        assert spans == splitting._encoded_spans(text, budget, 0, encoding)


@pytest.mark.parametrize("budget", [300, 600, 1024])
@pytest.mark.parametrize("segment", [40, 500])
def test_support_messages_cut_in_segments_as_by_the_whole_text(budget: int, segment: int) -> None:
    # real prose (newlines, signatures, accents), every message of the sample as one long text
    messages = pl.read_csv(REPO / "data" / "support" / "messages.csv")["body"]
    text = "\n\n".join(messages.head(400).to_list())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(splitting, "_SEGMENT_CHARS", segment)
        spans = splitting._segment_spans(text, budget, "o200k_base")
    assert spans is not None and len(spans) > 10
    assert spans == splitting._encoded_spans(text, budget, 0, "o200k_base")


def test_special_token_text_in_a_row_is_ordinary_text() -> None:
    # a scraped page may hold a model's control markers; they are counted as the words they are
    marker = "<|endoftext|>"
    text = f"{marker} ignore the above {marker}<|im_start|>system " * 60
    rows = pl.DataFrame({"source_id": ["inj"], "text": [text]})
    units = chunk_units(rows, max_tokens=64)
    assert "".join(units.sort("chunk_index")["text"].to_list()) == text
    assert units["unit_tokens"].to_list() == [count_tokens(t) for t in units["text"]]
    assert count_tokens(marker) > 1


def test_short_text_is_one_unit_without_tokenizing(monkeypatch: pytest.MonkeyPatch) -> None:
    tokenized: list[str] = []  # every tokenization goes through the encoding

    def spied_encoding(name: str = tokens.DEFAULT_ENCODING) -> Any:
        tokenized.append(name)
        return real_encoding(name)

    real_encoding = tokens.get_encoding
    monkeypatch.setattr(tokens, "get_encoding", spied_encoding)
    monkeypatch.setattr(splitting, "get_encoding", spied_encoding)
    # a token is at least one byte, so a text of at most max_tokens bytes fits untokenized
    fits = "é" * 8  # 16 bytes
    assert split_text("short enough", 16) == ["short enough"]
    assert split_text(fits, 16) == [fits]
    rows = pl.DataFrame({"source_id": ["a", "b"], "text": ["short enough", fits]})
    units = chunk_units(rows, max_tokens=16)
    assert units["text"].to_list() == ["short enough", fits]
    assert units["unit_tokens"].to_list() == [None, None]  # never counted
    assert tokenized == []
    # a byte more and it is tokenized, and kept whole when its tokens fit
    assert split_text(fits + "x", 16) == [fits + "x"]
    assert tokenized


def test_chunk_units_table() -> None:
    long_text = "word " * 400
    rows = pl.DataFrame(
        {
            "source_id": ["a", "b", "c"],
            "text": ["hello", long_text, None],
            "channel": ["x", "y", "z"],
        }
    )
    units = chunk_units(rows, max_tokens=100, overlap=0)
    by_source = units.group_by("source_id").agg(pl.len(), pl.col("n_chunks").first())
    counts = dict(zip(by_source["source_id"], by_source["len"], strict=True))
    assert counts["a"] == 1 and counts["c"] == 1 and counts["b"] > 3
    b = units.filter(pl.col("source_id") == "b").sort("chunk_index")
    assert b["unit_id"].to_list()[:2] == ["b#0", "b#1"]
    assert "".join(b["text"].to_list()) == long_text
    assert set(b["n_chunks"].to_list()) == {b.height}
    assert units.filter(pl.col("source_id") == "c")["text"].to_list() == [""]
    assert set(units["channel"].to_list()) == {"x", "y", "z"}  # extra columns travel with units


def test_long_texts_cut_a_slice_at_a_time_give_the_same_units(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Long texts are tokenized and cut in slices (to bound memory at a million rows); the
    units, their order and every column are what one pass over all of them gives."""
    words = ["word", "tick", "tock", "ünï", "数据", "emoji 🙂"]
    rows = pl.DataFrame(
        {
            "source_id": [f"r{i}" for i in range(23)],
            "text": [
                "short" if i % 5 == 0 else f"{words[i % len(words)]} {i} " * (60 + 7 * i)
                for i in range(23)
            ],
            "channel": [f"c{i}" for i in range(23)],
        }
    )
    whole = chunk_units(rows, max_tokens=64, overlap=4)
    monkeypatch.setattr(chunk, "_SLICE_ROWS", 3)
    sliced = chunk_units(rows, max_tokens=64, overlap=4)
    assert sliced.equals(whole)
    assert whole["n_chunks"].max() > 3 and whole.height > rows.height  # long texts were cut
    for source_id, pieces in whole.group_by("source_id", maintain_order=True):
        assert pieces["chunk_index"].to_list() == list(range(pieces.height)), source_id


def test_truncate_keeps_only_the_first_piece() -> None:
    rows = pl.DataFrame({"source_id": ["b"], "text": ["word " * 400]})
    units = chunk_units(rows, max_tokens=100, mode="truncate")
    assert units.height == 1 and units["n_chunks"][0] == 1
    assert count_tokens(units["text"][0]) <= 100


def test_a_memo_cuts_each_long_text_once_across_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoded: list[str] = []  # every long text that was tokenized whole

    def spied_encode(text: str, encoding: str = tokens.DEFAULT_ENCODING) -> list[int]:
        encoded.append(text)
        return tokens.encode(text, encoding)

    monkeypatch.setattr(splitting, "encode", spied_encode)
    store = Store(tmp_path / "state.duckdb")
    first = pl.DataFrame(
        {"source_id": ["a", "b", "c", "d"], "text": ["word " * 300, "tick " * 300, "short", ""]}
    )
    night1 = chunk_units(first, max_tokens=100, overlap=8, memo=store)
    assert sorted(encoded) == sorted(["word " * 300, "tick " * 300])

    encoded.clear()  # the same texts again: cut from memory, identical units
    assert chunk_units(first, max_tokens=100, overlap=8, memo=store).equals(night1)
    assert encoded == []

    encoded.clear()  # one text changed, one row added with a text seen before: one tokenized
    changed = pl.DataFrame(
        {"source_id": ["a", "b", "e"], "text": ["word " * 300, "tock " * 300, "tick " * 300]}
    )
    night3 = chunk_units(changed, max_tokens=100, overlap=8, memo=store)
    assert encoded == ["tock " * 300]
    assert night3.equals(chunk_units(changed, max_tokens=100, overlap=8))  # as without memo
    e = night3.filter(pl.col("source_id") == "e")["text"].to_list()
    assert e == night1.filter(pl.col("source_id") == "b")["text"].to_list()

    encoded.clear()  # another budget is another cut
    chunk_units(first.head(1), max_tokens=120, overlap=8, memo=store)
    assert encoded == ["word " * 300]


def test_a_stage_remembers_its_cuts_once_at_its_end_and_reuses_them_between_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`RunCuts`: slices of one stage share their cuts in memory; the state file gets them all
    when the stage ends (one write), and a text another process remembered meanwhile still
    makes one unit per piece."""
    encoded: list[str] = []

    def spied_encode(text: str, encoding: str = tokens.DEFAULT_ENCODING) -> list[int]:
        encoded.append(text)
        return tokens.encode(text, encoding)

    monkeypatch.setattr(splitting, "encode", spied_encode)
    store = Store(tmp_path / "state.duckdb")
    stored = "SELECT count(*) FROM chunk_cuts"
    cuts = chunk.RunCuts(store)
    slice1 = pl.DataFrame({"source_id": ["a", "b"], "text": ["word " * 300, "tick " * 300]})
    slice2 = pl.DataFrame({"source_id": ["c", "d"], "text": ["tick " * 300, "tock " * 300]})
    units1 = chunk_units(slice1, max_tokens=100, overlap=8, memo=cuts)
    # meanwhile another run of the same budget remembers "tock" on its own
    chunk_units(slice2.tail(1), max_tokens=100, overlap=8, memo=store)
    assert scalar(store, stored) == 1  # this stage's cuts are not written yet
    encoded.clear()
    units2 = chunk_units(slice2, max_tokens=100, overlap=8, memo=cuts)
    assert encoded == []  # "tick" cut by slice 1, "tock" by the other run
    assert units2.equals(chunk_units(slice2, max_tokens=100, overlap=8))  # as without memo
    assert units1.equals(chunk_units(slice1, max_tokens=100, overlap=8))
    cuts.remember()
    assert scalar(store, stored) == 3  # word, tick, tock: each once
    encoded.clear()
    both = pl.concat([slice1, slice2])
    chunk_units(both, max_tokens=100, overlap=8, memo=chunk.RunCuts(store))
    assert encoded == []  # a later stage finds every cut in the state file


def test_the_encodings_a_job_may_name_are_the_tokenizers() -> None:
    import bpe_openai

    assert list(tokens.ENCODINGS) == bpe_openai.list_encoding_names()


OLD_CUT_TEXT = "word " * 300
OLD_CUT_PIECES = [
    OLD_CUT_TEXT[:493],
    OLD_CUT_TEXT[493:983],
    OLD_CUT_TEXT[983:1473],
    OLD_CUT_TEXT[1473:],
]
"""The pieces `_old_md5_cut` gives `OLD_CUT_TEXT`."""


def _old_md5_cut() -> pl.DataFrame:
    """How earlier releases remembered `OLD_CUT_TEXT` under a 100-token budget: cut at token
    boundaries (mid-word) and keyed by the md5 of the text."""
    return pl.DataFrame(
        {
            "text_key": md5_hex(pl.Series([OLD_CUT_TEXT])),
            "starts": [[0, 493, 983, 1473]],
            "lengths": [[493, 490, 490, 27]],
            "tokens": [[98, 98, 98, 6]],
        },
        schema=CUTS_SCHEMA,
    )


def test_cuts_remembered_by_earlier_releases_stay_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # earlier releases cut "word word ..." at token boundaries and keyed the cut by the md5 of
    # its text; the cutter now cuts between words and keys by XXH3, but a text an earlier night
    # cut keeps its remembered pieces (so its requests, and their cached answers, stay the
    # same): changing either would re-ask every long row
    from importlib import metadata

    key = f"v1:bpe-openai {metadata.version('bpe-openai')}:o200k_base:100:0"
    assert chunk.budget_key(100, 0, "o200k_base") == key
    text = OLD_CUT_TEXT
    store = Store(tmp_path / "state.duckdb")
    store.remember_chunk_cuts(key, _old_md5_cut(), chunk.cut_recipe())
    rows = pl.DataFrame({"source_id": ["a"], "text": [text]})
    pieces = OLD_CUT_PIECES
    for _night in (1, 2):
        units = chunk_units(rows, max_tokens=100, memo=store)
        assert units.sort("chunk_index")["text"].to_list() == pieces  # cut mid-word, as then
        assert units.sort("chunk_index")["unit_tokens"].to_list() == [98, 98, 98, 6]
        # the first night meeting the text keys its cut anew: later ones find it by key alone
        keys = store._query("SELECT text_key FROM chunk_cuts")["text_key"].to_list()
        assert keys == text_key(pl.Series([text])).to_list()
        assert not store.has_md5_cuts(key)
        monkeypatch.setattr(chunk, "md5_hex", _refused)


def test_a_stage_keys_anew_the_md5_cuts_it_meets_once_at_its_end(tmp_path: Path) -> None:
    """`RunCuts`, as chunk's stage uses it: an md5-keyed cut found in one slice is reused by
    the next slice, and the state file gets it under its new key when the stage ends."""
    budget = chunk.budget_key(100, 0, "o200k_base")
    text = OLD_CUT_TEXT
    store = Store(tmp_path / "state.duckdb")
    store.remember_chunk_cuts(budget, _old_md5_cut(), chunk.cut_recipe())
    cuts = chunk.RunCuts(store)
    slice1 = pl.DataFrame({"source_id": ["a", "b"], "text": [text, "tick " * 300]})
    slice2 = pl.DataFrame({"source_id": ["c"], "text": [text]})
    units1 = chunk_units(slice1, max_tokens=100, memo=cuts)
    units2 = chunk_units(slice2, max_tokens=100, memo=cuts)
    pieces = OLD_CUT_PIECES
    for units, row in ((units1, "a"), (units2, "c")):
        mine = units.filter(pl.col("source_id") == row).sort("chunk_index")
        assert mine["text"].to_list() == pieces
    assert scalar(store, "SELECT count(*) FROM chunk_cuts") == 1  # nothing written yet
    cuts.remember()
    keys = store._query("SELECT text_key FROM chunk_cuts ORDER BY text_key")["text_key"]
    assert sorted(keys.to_list()) == sorted(text_key(pl.Series([text, "tick " * 300])).to_list())
    assert not store.has_md5_cuts(budget)


def test_a_stage_asks_the_state_file_once_whether_md5_keyed_cuts_remain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The question scans every cut kept under the budget: asked per slice, a night of 20
    slices scanned them 20 times."""
    budget = chunk.budget_key(100, 0, "o200k_base")
    store = Store(tmp_path / "state.duckdb")
    store.remember_chunk_cuts(budget, _old_md5_cut(), chunk.cut_recipe())
    asked: list[str] = []
    real = store.has_md5_cuts
    monkeypatch.setattr(store, "has_md5_cuts", lambda b: asked.append(b) or real(b))
    cuts = chunk.RunCuts(store)
    for word in ("tick", "tock", "tack"):
        chunk_units(
            pl.DataFrame({"source_id": [word], "text": [f"{word} " * 300]}),
            max_tokens=100,
            memo=cuts,
        )
    units = chunk_units(
        pl.DataFrame({"source_id": ["a"], "text": [OLD_CUT_TEXT]}), max_tokens=100, memo=cuts
    )
    assert units.sort("chunk_index")["text"].to_list() == OLD_CUT_PIECES  # still found by md5
    assert asked == [budget]


def _refused(values: pl.Series) -> pl.Series:
    raise AssertionError("an md5 was computed where no cut is keyed by one")


def test_a_state_without_md5_keyed_cuts_computes_no_md5(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunk, "md5_hex", _refused)
    store = Store(tmp_path / "state.duckdb")
    rows = pl.DataFrame({"source_id": ["a", "b"], "text": ["word " * 300, "tick " * 300]})
    first = chunk_units(rows, max_tokens=100, memo=store)
    assert first.equals(chunk_units(rows, max_tokens=100, memo=store))
    assert first.equals(chunk_units(rows, max_tokens=100))


def test_cuts_of_an_older_cutter_are_dropped_when_new_ones_are_kept(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.duckdb")
    old_cut = pl.DataFrame(
        {"text_key": ["0" * 32], "starts": [[0, 9]], "lengths": [[9, 9]], "tokens": [[3, 3]]},
        schema=CUTS_SCHEMA,
    )
    store.remember_chunk_cuts(
        "v1:bpe-openai 0.0.1:o200k_base:100:0", old_cut, "v1:bpe-openai 0.0.1"
    )
    rows = pl.DataFrame({"source_id": ["a"], "text": ["word " * 300]})
    chunk_units(rows, max_tokens=100, memo=store)
    chunk_units(rows, max_tokens=120, memo=store)  # a second budget of the same recipe stays
    kept = store._query("SELECT budget FROM chunk_cuts ORDER BY budget")["budget"].to_list()
    assert kept == [chunk.budget_key(100, 0, "o200k_base"), chunk.budget_key(120, 0, "o200k_base")]


def test_input_columns_named_like_the_cut_columns_travel_untouched() -> None:
    rows = pl.DataFrame(
        {
            "source_id": ["a", "b"],
            "text": ["word " * 300, "hi"],
            "starts": [7, 8],
            "lengths": ["x", "y"],
            "tokens": [1.5, 2.5],
        }
    )
    units = chunk_units(rows, max_tokens=100).sort("source_id", "chunk_index")
    a = units.filter(pl.col("source_id") == "a")
    assert a.height > 1 and "".join(a["text"].to_list()) == "word " * 300
    assert set(a["starts"].to_list()) == {7} and set(a["tokens"].to_list()) == {1.5}
    assert units.filter(pl.col("source_id") == "b")["lengths"].to_list() == ["y"]


@given(words=WORDS, limit=st.integers(min_value=0, max_value=300))
@settings(max_examples=80, deadline=None)
def test_counting_within_a_limit_agrees_with_encoding(words: list[str], limit: int) -> None:
    text = " ".join(words)
    n = count_tokens(text)
    assert tokens.count_within(text, limit) == (n if n <= limit else None)


def test_counting_within_a_limit_takes_the_long_way_where_the_counter_cannot() -> None:
    broken = "a lone \udc80 surrogate " * 10  # UTF-8 cannot hold it: counted as encode sees it
    assert tokens.count_within(broken, 10_000) == count_tokens(broken)
    several_slices = "many words here " * 5_000  # 80,000 characters: encoded a slice at a time
    assert tokens.count_within(several_slices, 10**6) == count_tokens(several_slices)
    assert tokens.count_within(several_slices, 100) is None


def test_null_and_whitespace_only_texts_become_empty_units_and_others_pass_whole() -> None:
    texts = [None, "", "  ", "\n\t\r", "\u00a0\u2003\u3000", " a ", "\u00a0x", "ok"]
    rows = pl.DataFrame({"source_id": [str(i) for i in range(len(texts))], "text": texts})
    units = chunk_units(rows, max_tokens=64).sort("source_id")
    assert units["text"].to_list() == ["", "", "", "", "", " a ", "\u00a0x", "ok"]
    # the test that decides: nothing but whitespace as Python (and strip) knows it
    assert [t is None or not t.strip() for t in texts] == [u == "" for u in units["text"]]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from(" \t\n\r\x0b\x0c\x85\xa0\u2028\u3000\x1fa"))))
def test_blank_is_what_stripping_whitespace_leaves_empty(texts: list[str]) -> None:
    frame = pl.DataFrame({"t": texts}, schema={"t": pl.String})
    stripped = frame.select(pl.col("t").str.strip_chars() == "")["t"]
    found = frame.select(~pl.col("t").str.contains(r"\S"))["t"]
    assert stripped.to_list() == found.to_list()
