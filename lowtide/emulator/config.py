"""Emulator knobs and the fault-rule grammar.

A fault spec is a comma-separated list of rules:

    KIND:METHOD PATH[:COUNT]     e.g. 429:POST /v1/batches:2, drop:GET /v1/files/*/content:1
    slow_finalizing:SECONDS      e.g. slow_finalizing:600
    error_rate:FRACTION          e.g. error_rate:0.05   (sets the config field)
    malformed_rate:FRACTION      e.g. malformed_rate:0.1 (sets the config field)

KIND is an HTTP status (429, 500, 502, 503, 529) or `drop` (cut the response body halfway and
close the connection). PATH is a glob (`*` matches any characters, `/` included). COUNT is how
many matching calls are hit; `*` or omitted-with-`*` means every call; omitted means 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

HTTP_FAULT_KINDS = frozenset({"429", "500", "502", "503", "529", "drop"})
CONFIG_FAULT_KINDS = frozenset({"error_rate", "malformed_rate"})


@dataclass
class FaultRule:
    """One injected fault.

    `count` is how many matching calls it hits (None = unlimited). For `slow_finalizing`,
    `seconds` is the extra simulated finalizing time given to batches created while it is set.
    """

    kind: str
    method: str | None = None
    path: str | None = None
    count: int | None = 1
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class EmulatorConfig:
    """Everything that shapes the emulator's behaviour; times are simulated seconds."""

    seed: int = 0
    # Simulated seconds per real second; 0 freezes the clock (tests then advance it by hand).
    time_scale: float = 1.0
    validating_s: float = 5.0
    batch_seconds_per_request: float = 0.05
    finalizing_s: float = 5.0
    completion_window_s: float = 86400.0
    # How long a cancel takes to drain (OpenAI says up to 10 minutes).
    cancel_drain_s: float = 5.0
    error_rate: float = 0.01
    malformed_rate: float = 0.0
    model_version: int = 1
    shuffle_results: bool = True
    omit_empty_files: bool = True
    # Retry hint sent with injected 429/5xx responses.
    retry_after_s: float = 1.0
    # Provider limits, lowered in tests to exercise the checks without huge payloads.
    max_upload_bytes: int = 512 * 1024 * 1024
    max_batch_file_bytes: int = 200 * 1024 * 1024
    max_batch_lines: int = 50_000
    # Account limits; None = unlimited (lowtide.emulator.limits). OpenAI: prompt tokens
    # enqueued per model in admitted, unfinished batches; batch creates per sliding hour (2,000
    # documented); bytes of live files. Anthropic: requests of in_progress batches, all models.
    enqueued_token_limit: int | None = None
    batch_creates_per_hour: int | None = None
    file_storage_limit_bytes: int | None = None
    anthropic_queue_limit: int | None = None
    anthropic_max_requests: int = 100_000
    anthropic_max_body_bytes: int = 256 * 1024 * 1024
    # Prompt caching: shortest cacheable prefix and how long an entry lives.
    anthropic_cache_min_tokens: int = 512
    openai_cache_min_tokens: int = 1024
    cache_ttl_s: float = 300.0
    archive_after_s: float = 29 * 86400.0
    file_retention_s: float = 30 * 86400.0
    faults: list[FaultRule] = field(default_factory=list)
    # A folder the emulator keeps its files, batches, attempt counters, ledger and clock in,
    # so a restarted process resumes like a provider would (lowtide.emulator.persist); None
    # keeps everything in memory.
    state_dir: str | None = None

    @classmethod
    def from_spec(cls, spec: str, **overrides: Any) -> EmulatorConfig:
        """A config whose faults (and rate overrides) come from a fault spec string."""
        config = cls(**overrides)
        config.faults = apply_fault_spec(config, spec)
        return config

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EmulatorConfig:
        """Read `LOWTIDE_EMULATOR_<FIELD>` variables (e.g. LOWTIDE_EMULATOR_TIME_SCALE=3600,
        LOWTIDE_EMULATOR_FAULTS="429:POST /v1/batches:2") from a mapping the caller passes (an
        environment it was given; lowtide itself reads the process environment only in
        `lowtide.settings`)."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "faults":
                continue
            raw = env.get(f"LOWTIDE_EMULATOR_{f.name.upper()}")
            if raw is not None:
                values[f.name] = raw
        config = cls()
        config.update(values)
        config.faults = apply_fault_spec(config, env.get("LOWTIDE_EMULATOR_FAULTS", ""))
        return config

    def update(self, patch: Mapping[str, Any]) -> None:
        """Set fields from a mapping, coercing strings to the field's type; unknown keys raise."""
        types = {f.name: f.type for f in dataclasses.fields(self)}
        for key, value in patch.items():
            if key not in types or key == "faults":
                known = ", ".join(sorted(k for k in types if k != "faults"))
                raise ValueError(f"Unknown emulator config field {key!r}; known: {known}")
            setattr(self, key, _coerce(str(types[key]), value, key))


def _coerce(type_name: str, value: Any, key: str) -> Any:
    if value is None:
        if "None" in type_name:
            return None
        raise ValueError(f"Config field {key!r} cannot be null")
    if (
        isinstance(value, str)
        and value.strip().lower() in {"", "none", "null"}
        and "None" in type_name
    ):
        return None
    try:
        if type_name.startswith("bool"):
            if isinstance(value, str):
                return value.strip().lower() in {"1", "true", "yes", "on"}
            return bool(value)
        if type_name.startswith("int"):
            return int(value)
        if type_name.startswith("float"):
            return float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Config field {key!r} expects {type_name}, got {value!r}") from exc
    return value


def parse_faults(spec: str) -> list[FaultRule]:
    """Parse the HTTP/slow-finalizing rules of a fault spec (rate settings are rejected here;
    use `apply_fault_spec` to accept them)."""
    rules: list[FaultRule] = []
    for item in _split(spec):
        kind = item.split(":", 1)[0].strip()
        if kind in CONFIG_FAULT_KINDS:
            raise ValueError(f"{kind!r} sets a config field; use apply_fault_spec for it")
        rules.append(_parse_rule(item))
    return rules


def apply_fault_spec(config: EmulatorConfig, spec: str) -> list[FaultRule]:
    """Parse `spec`, set any rate fields on `config`, and return the fault rules."""
    rules: list[FaultRule] = []
    for item in _split(spec):
        kind, _, rest = item.partition(":")
        kind = kind.strip()
        if kind in CONFIG_FAULT_KINDS:
            config.update({kind: rest.strip()})
        else:
            rules.append(_parse_rule(item))
    return rules


def _split(spec: str) -> list[str]:
    return [part.strip() for part in (spec or "").split(",") if part.strip()]


def _parse_rule(item: str) -> FaultRule:
    kind, _, rest = item.partition(":")
    kind = kind.strip()
    if kind == "slow_finalizing":
        try:
            return FaultRule(kind=kind, count=None, seconds=float(rest))
        except ValueError as exc:
            raise ValueError(f"Bad fault {item!r}: expected slow_finalizing:SECONDS") from exc
    if kind not in HTTP_FAULT_KINDS:
        known = ", ".join(sorted(HTTP_FAULT_KINDS | CONFIG_FAULT_KINDS | {"slow_finalizing"}))
        raise ValueError(f"Unknown fault kind {kind!r} in {item!r}; known: {known}")
    # Paths never contain ':', so a colon after the route introduces COUNT.
    route, sep, count_text = rest.rpartition(":")
    if not sep:
        route, count_text = rest, "1"
    method, _, path = route.strip().partition(" ")
    if not method or not path.strip():
        raise ValueError(f"Bad fault {item!r}: expected KIND:METHOD PATH[:COUNT]")
    count_text = count_text.strip()
    if count_text == "*":
        count: int | None = None
    else:
        try:
            count = int(count_text)
        except ValueError as exc:
            raise ValueError(f"Bad fault {item!r}: COUNT must be an integer or '*'") from exc
    return FaultRule(kind=kind, method=method.strip().upper(), path=path.strip(), count=count)
