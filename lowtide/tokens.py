"""Offline token counting.

tiktoken fetches its vocabulary on first use and fails without a network, so lowtide counts with
bpe-openai, which ships the same vocabularies inside the wheel and gives identical counts.
Counts are estimates for non-OpenAI models; provider-reported usage is the truth.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

DEFAULT_ENCODING = "o200k_base"
ENCODINGS = (
    "cl100k_base",
    "gpt2",
    "o200k_base",
    "p50k_base",
    "p50k_edit",
    "r50k_base",
    "voyage3_base",
)
"""What `[chunk] encoding` may name: bpe-openai's `list_encoding_names()` for the pinned version
(a test keeps them equal), known without importing it (about 1 s of CPU), so loading a job that
tokenizes nothing tonight does not pay for the tokenizer."""
# bpe-openai refuses one very long input; longer texts are encoded in slices, each cut before a
# space that follows a non-space character: no pre-token crosses such a position, so the slices'
# tokens are the whole text's (lowtide.splitting relies on it).
SLICE_CHARS = 50_000


@lru_cache(maxsize=8)
def get_encoding(name: str = DEFAULT_ENCODING):
    import bpe_openai

    return bpe_openai.get_encoding(name)


def _slices(text: str) -> list[str]:
    if len(text) <= SLICE_CHARS:
        return [text]
    out, start = [], 0
    while start < len(text):
        end = min(start + SLICE_CHARS, len(text))
        if end < len(text):
            low = start + SLICE_CHARS // 2
            cut = text.rfind(" ", low, end)
            while cut > 0 and text[cut - 1].isspace():
                cut = text.rfind(" ", low, cut)
            end = cut if cut > start else end  # none: cut mid pre-token (slices_are_clean)
        out.append(text[start:end])
        start = end
    return out


def slices_are_clean(text: str) -> bool:
    """Whether `encode` cut `text` only before a space that follows a non-space character, so
    that its tokens are exactly the whole text's (always, for a text of one slice)."""
    if len(text) <= SLICE_CHARS:
        return True
    at = 0
    for part in _slices(text)[:-1]:
        at += len(part)
        if text[at] != " " or text[at - 1].isspace():
            return False
    return True


def encode(text: str, encoding: str = DEFAULT_ENCODING) -> list[int]:
    """Token ids of `text`, every part of it ordinary text (a row holding `<|endoftext|>` is
    counted as the provider counts a user message, never refused); safe for arbitrarily long
    strings."""
    enc = get_encoding(encoding)
    ids: list[int] = []
    for part in _slices(text):
        ids.extend(enc.encode_ordinary(part))
    return ids


def decode(ids: list[int], encoding: str = DEFAULT_ENCODING) -> str:
    return get_encoding(encoding).decode(ids)


def _compiled(encoding: str, name: str) -> Callable[..., Any] | None:
    """bpe-openai's compiled tokenizer's method `name` (pinned); None where a version lacks it
    (the callers count the long way then)."""
    return getattr(getattr(get_encoding(encoding), "_backend", None), name, None)


def count_within(text: str, limit: int, encoding: str = DEFAULT_ENCODING) -> int | None:
    """The number of tokens in `text` when it is at most `limit`, else None. The tokenizer's
    own counter builds no list of ids: over the long texts of a real input it took two thirds
    of the CPU of counting `encode`'s ids (a test keeps the two counts equal). A text of
    several slices, or with characters UTF-8 cannot hold, is counted the long way."""
    within = _compiled(encoding, "count_till_limit") if len(text) <= SLICE_CHARS else None
    if within is not None:
        try:
            return within(text, limit)
        except UnicodeEncodeError:
            pass
    n = count_tokens(text, encoding)
    return n if n <= limit else None


def count_clean(text: str, encoding: str = DEFAULT_ENCODING) -> int:
    """The number of tokens in `text`, by the tokenizer's counter when it can (a text of one
    slice, all of it UTF-8): no list of ids is built (over the long texts of a real input,
    counting took four fifths of encoding's CPU)."""
    return counter(encoding)(text)


@lru_cache(maxsize=8)
def counter(encoding: str = DEFAULT_ENCODING) -> Callable[[str], int]:
    """`count_clean` for one encoding, the tokenizer looked up once: for callers that count
    many short texts (`lowtide.word_counts`), where looking it up cost as much as counting a
    word."""
    compiled = _compiled(encoding, "count")

    def count(text: str) -> int:
        if compiled is not None and len(text) <= SLICE_CHARS:
            try:
                return compiled(text)
            except UnicodeEncodeError:
                pass
        return count_tokens(text, encoding)

    return count


def count_tokens(text: str, encoding: str = DEFAULT_ENCODING) -> int:
    """Number of tokens in `text` (0 for the empty string)."""
    if not text:
        return 0
    return len(encode(text, encoding))
