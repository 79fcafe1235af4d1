"""The emulator's deterministic "model".

It reads the last user message and answers with JSON valid against the requested schema, so
pipelines can be tested end to end without a real model. Everything is derived from sha256 of
the inputs (never Python's `hash()`, which is salted per process), so the same request gets
the same answer in every process and on every run.

Enum fields use a keyword heuristic the sample data is built around: each enum value is split
into keywords on `_`, `-` and spaces (keywords shorter than 3 letters dropped); a keyword
matches a message word when the word starts with the keyword's first five letters (or the whole
keyword if shorter). The value with the most (keyword, word) matches wins; ties, including the
all-zero tie, are settled by sha256(message text + field name). With `model_version >= 2`
about 4% of inputs get the runner-up instead, so an eval gate has a regression to catch.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from lowtide.tokens import count_tokens, decode, encode

FinishReason = Literal["stop", "length"]
BREAKAGES = ("fences", "trailing_comma", "single_quotes", "truncated")
# Rough chat-format overhead: role markers per message and the assistant reply primer.
_PER_MESSAGE_TOKENS = 4
_REPLY_PRIMER_TOKENS = 3
_MAX_DEPTH = 12
_WORD_RE = re.compile(r"[^\W\d_]+")
_PHRASE_RE = re.compile(r"\w+")
_KEYWORD_SPLIT_RE = re.compile(r"[_\-\s]+")


@dataclass(frozen=True)
class ModelAnswer:
    """One generated answer.

    `text` is what the provider would put in the message; `data` is the schema value it was
    built from (None without a schema), before any deliberate breakage or truncation.
    """

    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    broken: str | None = None
    data: Any = None


def answer(
    messages: list[dict],
    *,
    schema: dict | None,
    max_tokens: int | None,
    model: str,
    model_version: int = 1,
    malformed_rate: float = 0.0,
    seed: int = 0,
    system: str | None = None,
) -> ModelAnswer:
    """Answer a chat request deterministically.

    With a `schema` the text is compact JSON valid against it unless a breakage was applied
    (share `malformed_rate`, chosen by a hash of messages + seed) or the answer was cut at
    `max_tokens` (then `finish_reason` is "length"). `model` does not change the answer, so a
    job moved between backends gets the same labels.
    """
    del model  # same answer on every backend; kept in the signature for callers' clarity
    text_in = last_user_text(messages)
    prompt_tokens = prompt_token_count(messages, system)
    data: Any = None
    if schema is not None:
        data = _Generator(schema, text_in, model_version).value(schema, "", 0)
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    else:
        text = _plain_text(text_in)

    broken: str | None = None
    finish: FinishReason = "stop"
    if schema is not None and malformed_rate > 0:
        digest = _sha(f"broken|{seed}|{system or ''}|{_canonical(messages)}")
        if _unit(digest) < malformed_rate:
            broken = BREAKAGES[int(digest[:8], 16) % len(BREAKAGES)]
            text, finish = _break(text, broken)

    tokens = encode(text)
    if max_tokens is not None and len(tokens) > max_tokens:
        text = _decode_prefix(tokens, max(max_tokens, 0))
        return ModelAnswer(text, "length", prompt_tokens, max(max_tokens, 0), broken, data)
    return ModelAnswer(text, finish, prompt_tokens, len(tokens), broken, data)


def message_text(content: Any) -> str:
    """Text of a message's content: a string, or the text parts of a content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif isinstance(part.get("content"), str | list):
                    parts.append(message_text(part["content"]))
        return "".join(parts)
    return str(content)


def last_user_text(messages: list[dict]) -> str:
    """Content of the last user message (the last message if none is from the user)."""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return message_text(message.get("content"))
    if messages and isinstance(messages[-1], dict):
        return message_text(messages[-1].get("content"))
    return ""


def prompt_token_count(messages: list[dict], system: str | None = None) -> int:
    """Prompt tokens: system + every message's text, plus a small per-message overhead."""
    total = _count_cached(system) + _PER_MESSAGE_TOKENS if system else 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else message
        total += _count_cached(message_text(content)) + _PER_MESSAGE_TOKENS
    return total + _REPLY_PRIMER_TOKENS


def prefix_token_count(messages: list[dict], system: str | None = None) -> int:
    """Tokens of a prompt's prefix (system + `messages`), counted as `prompt_token_count`
    counts the whole prompt but without the reply primer: what a prompt cache can hold, so
    that the prompt's tokens less its cached prefix are exactly the rest of the prompt."""
    return prompt_token_count(messages, system) - _REPLY_PRIMER_TOKENS


def choose_enum(values: list[Any], text: str, field_name: str, model_version: int = 1) -> Any:
    """Pick an enum value for `text` with the keyword heuristic (see the module docstring)."""
    return _rank_enum(values, text, field_name, model_version, count=1)[0]


def _rank_enum(
    values: list[Any], text: str, field_name: str, model_version: int, count: int
) -> list[Any]:
    """The `count` best values, best first (distinct while values last)."""
    if not values:
        raise ValueError(f"Enum for field {field_name!r} has no values")
    words = _WORD_RE.findall(text.lower())
    scores = [_enum_score(value, words) for value in values]
    tie_key = int(_sha(text + field_name), 16)
    order: list[int] = []
    remaining = list(range(len(values)))
    while remaining:
        best = max(scores[i] for i in remaining)
        tied = [i for i in remaining if scores[i] == best]
        pick = tied[tie_key % len(tied)]
        order.append(pick)
        remaining.remove(pick)
    if model_version >= 2 and len(order) > 1 and int(_sha(f"regress|{text}")[:8], 16) % 100 < 4:
        order[0], order[1] = order[1], order[0]
    picked = [values[i] for i in order[:count]]
    while len(picked) < count:
        picked.append(picked[len(picked) % len(order)])
    return picked


def _enum_score(value: Any, words: list[str]) -> int:
    if value is None:
        return 0
    keywords = [k for k in _KEYWORD_SPLIT_RE.split(str(value).lower()) if len(k) >= 3]
    score = 0
    for keyword in keywords:
        prefix = keyword[: min(5, len(keyword))]
        score += sum(1 for word in words if word.startswith(prefix))
    return score


class _Generator:
    """Builds a value for a JSON schema; `root` resolves local `$ref`s."""

    def __init__(self, root: dict, text: str, model_version: int) -> None:
        self.root = root
        self.text = text
        self.model_version = model_version
        self.phrase_words = _PHRASE_RE.findall(text)

    def value(self, node: Any, name: str, depth: int) -> Any:
        if not isinstance(node, dict):
            return self.string({}, name)  # `true` / missing schema: anything goes
        if "$ref" in node:
            return self.value(self.resolve(node["$ref"]), name, depth + 1)
        if "const" in node:
            return node["const"]
        if "enum" in node:
            return choose_enum(list(node["enum"]), self.text, name, self.model_version)
        for key in ("anyOf", "oneOf"):
            if key in node:
                options = [o for o in node[key] if not _is_null_schema(self.deref(o))]
                return self.value(options[0], name, depth + 1) if options else None
        if "allOf" in node:
            merged: dict[str, Any] = {}
            for part in node["allOf"]:
                merged.update(self.deref(part))
            merged.update({k: v for k, v in node.items() if k != "allOf"})
            return self.value(merged, name, depth + 1)

        kind = _main_type(node)
        if kind == "null":
            return None
        if kind == "object":
            return self.object(node, name, depth)
        if kind == "array":
            return self.array(node, name, depth)
        if kind == "integer":
            return self.integer(node, name)
        if kind == "number":
            return self.number(node, name)
        if kind == "boolean":
            return int(_sha(f"bool|{self.text}|{name}")[:8], 16) % 2 == 0
        return self.string(node, name)

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            raise ValueError(f"Only local $ref is supported, got {ref!r}")
        node: Any = self.root
        for part in ref.lstrip("#").strip("/").split("/"):
            if not part:
                continue
            node = node[part.replace("~1", "/").replace("~0", "~")]
        return node

    def deref(self, node: Any) -> Any:
        while isinstance(node, dict) and "$ref" in node:
            node = self.resolve(node["$ref"])
        return node

    def object(self, node: dict, name: str, depth: int) -> dict[str, Any]:
        props = node.get("properties") or {}
        if depth >= _MAX_DEPTH:
            props = {k: v for k, v in props.items() if k in set(node.get("required") or [])}
        if not props and node.get("additionalProperties", True) is not False:
            return {"answer": self.string({}, "answer")}
        return {key: self.value(sub, key, depth + 1) for key, sub in props.items()}

    def array(self, node: dict, name: str, depth: int) -> list[Any]:
        low = int(node.get("minItems", 0))
        high = node.get("maxItems")
        count = max(low, 1) if depth < _MAX_DEPTH else low
        if high is not None:
            count = min(count, int(high))
        items = self.deref(node.get("items", {}))
        if isinstance(items, dict) and "enum" in items:
            return _rank_enum(list(items["enum"]), self.text, name, self.model_version, count)
        return [self.value(items, name, depth + 1) for _ in range(count)]

    def _bounds(self, node: dict, step: float) -> tuple[float, float]:
        low = node.get("minimum")
        if "exclusiveMinimum" in node and not isinstance(node["exclusiveMinimum"], bool):
            low = node["exclusiveMinimum"] + step
        high = node.get("maximum")
        if "exclusiveMaximum" in node and not isinstance(node["exclusiveMaximum"], bool):
            high = node["exclusiveMaximum"] - step
        if low is None:
            low = min(0, high - 10) if high is not None else 0
        if high is None:
            high = low + 10
        return low, max(low, high)

    def integer(self, node: dict, name: str) -> int:
        low, high = self._bounds(node, 1)
        low, high = int(-(-low // 1)), int(high // 1)
        if high < low:
            return low
        return low + int(_sha(f"int|{self.text}|{name}")[:12], 16) % (high - low + 1)

    def number(self, node: dict, name: str) -> float:
        low, high = self._bounds(node, 1e-3)
        fraction = int(_sha(f"num|{self.text}|{name}")[:8], 16) % 1000 / 1000
        return round(low + (high - low) * fraction, 3)

    def string(self, node: dict, name: str) -> str:
        fmt = node.get("format")
        if fmt in _FORMAT_SAMPLES:
            return _FORMAT_SAMPLES[fmt]
        words = self.phrase_words[:6] or [name or "empty"]
        phrase = " ".join(words)
        min_len = int(node.get("minLength", 0))
        while len(phrase) < min_len:
            phrase = f"{phrase} {phrase}" if phrase else "x"
        max_len = node.get("maxLength")
        if max_len is not None:
            phrase = phrase[: int(max_len)].rstrip() or phrase[: int(max_len)]
        return phrase


_FORMAT_SAMPLES = {
    "date": "2024-01-01",
    "date-time": "2024-01-01T00:00:00Z",
    "time": "00:00:00Z",
    "email": "user@example.com",
    "uri": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
}


def _main_type(node: dict) -> str:
    kind = node.get("type")
    if isinstance(kind, list):
        non_null = [k for k in kind if k != "null"]
        return non_null[0] if non_null else "null"
    if isinstance(kind, str):
        return kind
    if "properties" in node:
        return "object"
    if "items" in node:
        return "array"
    return "string"


def _is_null_schema(node: Any) -> bool:
    return isinstance(node, dict) and node.get("type") == "null"


def _plain_text(text: str) -> str:
    words = _PHRASE_RE.findall(text)[:12]
    return "Answer: " + (" ".join(words) if words else "(empty message)")


def _break(text: str, kind: str) -> tuple[str, FinishReason]:
    if kind == "trailing_comma" and text[-1:] in "}]" and len(text) > 2:
        return f"{text[:-1]},{text[-1]}", "stop"
    if kind == "single_quotes" and '"' in text:
        return text.replace('"', "'"), "stop"
    if kind == "truncated":
        tokens = encode(text)
        if len(tokens) > 1:
            return _decode_prefix(tokens, max(1, len(tokens) // 2)), "length"
    return f"```json\n{text}\n```", "stop"


def _decode_prefix(tokens: list[int], n: int) -> str:
    # A cut can split a multi-byte character; drop the replacement character it leaves.
    return decode(tokens[:n]).rstrip("\ufffd")


@lru_cache(maxsize=4096)
def _count_cached(text: str) -> int:
    # System prompts repeat across every request of a job; counting them once matters.
    return count_tokens(text)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _unit(digest: str) -> float:
    """A hex digest mapped to [0, 1)."""
    return int(digest[:13], 16) / 16**13
