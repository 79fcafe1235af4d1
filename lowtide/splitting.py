"""Cutting one long text into pieces that each fit a token budget.

The text is tokenized about once. A piece is cut where the whole text's tokens can be split without
changing either side: before a token that starts with a space following a printable ASCII
character. No pre-token of the tokenizer's splitting patterns (o200k, cl100k, p50k, r50k, gpt2,
voyage3) holds a space after a non-space character, so such a position ends one pre-token and
starts the next, and a piece running from one such position to another encodes to exactly the
whole text's tokens between them: its count is a subtraction, not a second pass of the
tokenizer, and the cut falls between words. Text with no such position near the budget (long
runs without spaces, CJK) is cut at a token boundary moved back to a character start, and that
piece is re-counted.

Without overlap, the same pieces come from counting the text in segments cut at such positions
(their counts add up to the text's) and encoding only the segment each cut falls in
(`_segment_spans`); the whole text's ids are built only where that cannot cut cleanly.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache
from itertools import accumulate, pairwise

import numpy as np

from lowtide.tokens import (
    count_clean,
    count_tokens,
    count_within,
    encode,
    get_encoding,
    slices_are_clean,
)

EDGE_TOKENS = 2
"""Headroom below the budget: a piece cut mid-word is re-encoded, and can merge differently at
its edges."""

_SPACE = 0x20

_COUNT_FIRST_CHARS_PER_TOKEN = 4
"""A text of at most this many characters per token of the budget is counted first (the
tokenizer's counter costs two thirds of encoding) and encoded only if it does not fit; a longer
one rarely fits (English averages ~4.5 bytes a token), so it is encoded at once. Over the long
rows of a real input this took the tokenizer's CPU from 2.2 to 1.8 s; either way, every count
is exact."""


def _char_start(data: bytes, pos: int) -> int:
    while 0 < pos < len(data) and (data[pos] & 0xC0) == 0x80:
        pos -= 1
    return pos


@lru_cache(maxsize=8)
def _token_lengths(encoding: str) -> np.ndarray:
    """Bytes per token id: a token's end offset is a cumulative sum, not a decode per token."""
    values = get_encoding(encoding).token_byte_values()
    return np.fromiter((len(b) for b in values), dtype=np.int64, count=len(values))


def _token_offsets(data: bytes, ids: list[int], encoding: str) -> np.ndarray:
    """Byte offset of each token's start, and the text's length last (len(ids) + 1 entries)."""
    ends = np.cumsum(_token_lengths(encoding)[np.asarray(ids, dtype=np.int64)])
    return np.concatenate(([0], ends))


def _clean_cuts(data: bytes, offsets: np.ndarray) -> list[int]:
    """Token indices (0 < j < n) where the text splits without re-encoding either side: token j
    starts with a space and the byte before it is printable ASCII (so not whitespace)."""
    text = np.frombuffer(data, dtype=np.uint8)
    inner = offsets[1:-1]
    before = text[inner - 1]
    clean = (text[inner] == _SPACE) & (before > _SPACE) & (before < 0x7F)
    return (np.flatnonzero(clean) + 1).tolist()


def _last_clean(cuts: list[int], low: int, high: int) -> int | None:
    """The largest clean cut j with low < j <= high, if any."""
    i = bisect_right(cuts, high) - 1
    return cuts[i] if i >= 0 and cuts[i] > low else None


_SEGMENT_CHARS = 500
"""About how long the segments are that a long text is counted in (`_segment_spans`): each
piece encodes one segment to find its cut, so shorter segments encode less, and more of them
cost more calls (500 and 2,000 counted the long texts of a real input in the same time)."""

_LONGEST_SEGMENT = 16 * _SEGMENT_CHARS
"""A text with no clean cut for this long (no spaces, or none after ASCII: CJK, Cyrillic) is
cut by `_encoded_spans`, which handles cuts mid-word."""

LONGEST_CLEAN_GAP = _LONGEST_SEGMENT - _SEGMENT_CHARS
"""A text whose clean places all lie at most this far apart is always cut by `_segment_spans`
(a segment then ends within `_LONGEST_SEGMENT` of its start): `lowtide.word_counts` cuts only
such texts, the same way."""


def _segment_starts(text: str) -> list[int] | None:
    """Clean places (a space after a printable ASCII character) about `_SEGMENT_CHARS` apart,
    0 first and `len(text)` last; None where two lie more than `_LONGEST_SEGMENT` apart."""
    starts = [0]
    while True:
        at = text.find(" ", starts[-1] + _SEGMENT_CHARS)
        while at != -1 and not "!" <= text[at - 1] <= "~":
            at = text.find(" ", at + 1)
        end = len(text) if at == -1 else at
        if end - starts[-1] > _LONGEST_SEGMENT:
            return None
        starts.append(end)
        if at == -1:
            return starts


def _segment_spans(text: str, max_tokens: int, encoding: str) -> list[tuple[int, int, int]] | None:
    """`_encoded_spans` without overlap, for a text that is cut cleanly throughout: the same
    pieces, from counting the text in segments cut at clean places (a clean place splits the
    tokens, so the segments' counts add up to the text's) and encoding only the segment each
    cut falls in. At a million rows the whole text's ids, their offsets and every clean cut
    among them cost ~5 s of CPU over the encoding itself, and counting costs a fifth less than
    encoding. None where a piece would not be cut cleanly (the caller cuts it the long way)."""
    if not slices_are_clean(text):
        return None  # encoded in slices that change its tokens: cut as `_encoded_spans` does
    starts = _segment_starts(text)
    if starts is None:
        return None
    counts = (count_clean(text[a:b], encoding) for a, b in pairwise(starts))
    before = [0, *accumulate(counts)]  # tokens before each segment
    n = before[-1]
    if n <= max_tokens:
        return [(0, len(text), n)]
    window = max(1, max_tokens - EDGE_TOKENS)
    reach = max(8, window // 8)
    spans: list[tuple[int, int, int]] = []
    start_tok = start_char = 0
    while start_tok + window < n:
        end_tok = start_tok + window
        k = bisect_right(before, end_tok) - 1  # the segment holding the budget's end
        cut = _last_clean_in(text[starts[k] : starts[k + 1]], end_tok - before[k], encoding)
        if cut is not None:
            cut_tok, cut_char = before[k] + cut[0], starts[k] + cut[1]
        else:
            cut_tok, cut_char = before[k], starts[k]  # the segment's own start
        if cut_tok <= start_tok or cut_tok - start_tok < window - reach:
            return None  # no clean cut near the budget: cut mid-word the long way
        spans.append((start_char, cut_char - start_char, cut_tok - start_tok))
        start_tok, start_char = cut_tok, cut_char
    spans.append((start_char, len(text) - start_char, n - start_tok))
    return spans


def _last_clean_in(segment: str, most: int, encoding: str) -> tuple[int, int] | None:
    """(tokens, characters) before the last clean cut inside `segment` that leaves at most
    `most` of its tokens before it; None when there is none."""
    data = segment.encode("utf-8")
    offsets = _token_offsets(data, encode(segment, encoding), encoding)
    j = _last_clean(_clean_cuts(data, offsets), 0, most)
    if j is None:
        return None
    return j, len(data[: int(offsets[j])].decode("utf-8"))


def split_spans(
    text: str, max_tokens: int, overlap: int = 0, encoding: str = "o200k_base"
) -> list[tuple[int, int, int]]:
    """Cut `text` into pieces of at most `max_tokens` tokens, consecutive pieces sharing about
    `overlap` tokens: (first character, length in characters, token count) per piece. With
    overlap 0 the pieces concatenate to `text`. Each count is the piece's own encoding's."""
    if len(text) <= _COUNT_FIRST_CHARS_PER_TOKEN * max_tokens:
        fits = count_within(text, max_tokens, encoding)  # most such texts: counted, no ids
        if fits is not None:
            return [(0, len(text), fits)]
    if overlap == 0:
        spans = _segment_spans(text, max_tokens, encoding)
        if spans is not None:
            return spans
    return _encoded_spans(text, max_tokens, overlap, encoding)


def _encoded_spans(
    text: str, max_tokens: int, overlap: int, encoding: str
) -> list[tuple[int, int, int]]:
    """`split_spans` from the whole text's tokens: each piece ends at the last clean cut within
    the budget, or, with none near it, at a token boundary moved back to a character start
    (that piece then counted on its own)."""
    ids = encode(text, encoding)
    n = len(ids)
    if n <= max_tokens:
        return [(0, len(text), n)]
    data = text.encode("utf-8")
    offsets = _token_offsets(data, ids, encoding)
    # a text encoded in slices cut mid pre-token (no clean place to slice it) has tokens that
    # are not the whole text's there: every piece of it is then counted on its own
    exact = slices_are_clean(text)
    cuts = _clean_cuts(data, offsets) if exact else []
    window = max(1, max_tokens - EDGE_TOKENS)
    reach = max(8, window // 8)  # how far back from the budget to look for a clean cut
    spans: list[tuple[int, int, int]] = []
    start_tok, a, clean_start = 0, 0, exact
    prev_byte = prev_char = 0  # pieces start in order: count characters incrementally
    while True:
        end_tok = min(start_tok + window, n)
        clean_end: int | None = n if end_tok == n else _last_clean(cuts, start_tok, end_tok)
        if clean_end is not None and clean_end < n and clean_end - start_tok < window - reach:
            clean_end = None  # a clean cut that far back would leave a short piece
        if clean_end is not None:
            end_tok = clean_end
            b = int(offsets[end_tok])
        else:
            b = _char_start(data, int(offsets[end_tok]))
            while b <= a:  # a character wider than the piece's room: take it whole
                end_tok += 1
                b = _char_start(data, int(offsets[end_tok])) if end_tok < n else len(data)
        piece = data[a:b].decode("utf-8")
        if clean_start and clean_end is not None:
            tokens = end_tok - start_tok  # both ends clean: the piece's encoding is this slice
        else:
            tokens = count_tokens(piece, encoding)
            while tokens > max_tokens and end_tok - 1 > start_tok:
                shorter = _char_start(data, int(offsets[end_tok - 1]))
                if shorter <= a:
                    break
                end_tok, b = end_tok - 1, shorter  # whole tokens: the next piece starts here
                piece = data[a:b].decode("utf-8")
                tokens = count_tokens(piece, encoding)
        prev_char += len(data[prev_byte:a].decode("utf-8"))
        prev_byte = a
        spans.append((prev_char, len(piece), tokens))
        if b >= len(data):
            break
        # the next piece starts `overlap` tokens back (at a clean cut when one is close), or
        # where this one ended when going back would not move past this piece's start
        target = end_tok - overlap
        going_back = overlap > 0 and target > start_tok
        clean = _last_clean(cuts, start_tok, target) if going_back else None
        if clean is not None and target - clean <= reach:
            start_tok, a, clean_start = clean, int(offsets[clean]), True
        elif going_back and (back := _char_start(data, int(offsets[target]))) > a:
            start_tok, a, clean_start = target, back, False
        else:
            start_tok, a = end_tok, b
            clean_start = clean_end is not None and clean_end == end_tok
    return spans


def split_text(
    text: str, max_tokens: int, overlap: int = 0, encoding: str = "o200k_base"
) -> list[str]:
    """The pieces of `split_spans` as text."""
    if len(text.encode("utf-8")) <= max_tokens:
        return [text]
    return [text[s : s + n] for s, n, _ in split_spans(text, max_tokens, overlap, encoding)]
