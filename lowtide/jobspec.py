"""The job file: what to run, validated once at the edge.

A job file is TOML (see docs/job-file.md). `load_job(path)` resolves relative paths against the
job file's folder, reads the output schema, and raises `JobFileError` with the file and the
offending key when anything is wrong, so a user never sees a pydantic trace.
"""

from __future__ import annotations

import hashlib
import re
import string
import tomllib
import warnings
from pathlib import Path
from typing import Any, Literal

import jsonschema_rs
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lowtide.backends import REGISTRY
from lowtide.discover_address import parse_discover
from lowtide.errors import JobFileError
from lowtide.output_fields import RULE_NEEDS, ReduceRule, default_reduce, json_type
from lowtide.routing import RouteSpec

_JOB_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


COLUMN_TYPES = ("string", "integer", "number", "boolean", "date", "timestamp")
"""Types an input column can be given in `[input] columns = {name = "type"}`."""

VIEW_COLUMNS = frozenset(
    {"run_id", "source_id", "status", "failure_reason", "n_chunks", "chunks_answered"}
    | {"chunk_index", "outcome", "answered_by"}
)
"""Columns lowtide adds to the job view and `<view>_chunks`: no input column or output field
may take these names (it would shadow them, and `WHERE status = 'succeeded'` would lie)."""


class InputSpec(_Strict):
    path: str
    id_column: str
    text_column: str
    columns: list[str] | dict[str, str] = Field(default_factory=list)
    """Extra columns to keep: a list of names (types as read), or a table name → type."""
    database: str | None = None  # for path = "duckdb:TABLE"
    priority_column: str | None = None  # truthy rows skip the batch and go realtime at once
    cursor_column: str | None = Field(None, min_length=1)
    """An increasing column (integer, number, date, timestamp or text): a run reads only the rows
    past the mark of the job's last completed run (checked against the input at load)."""

    @field_validator("columns")
    @classmethod
    def _known_types(cls, v: list[str] | dict[str, str]) -> list[str] | dict[str, str]:
        if isinstance(v, dict):
            bad = {k: t for k, t in v.items() if t not in COLUMN_TYPES}
            if bad:
                raise ValueError(f"unknown column type(s) {bad}; use one of {list(COLUMN_TYPES)}")
        return v

    @property
    def column_names(self) -> list[str]:
        return list(self.columns)

    @property
    def column_types(self) -> dict[str, str]:
        return dict(self.columns) if isinstance(self.columns, dict) else {}


class ChunkSpec(_Strict):
    mode: Literal["split", "truncate"] = "split"
    max_tokens: int = Field(1024, ge=16)
    overlap_tokens: int = Field(0, ge=0)
    encoding: str = "o200k_base"

    @model_validator(mode="after")
    def _overlap_below_budget(self) -> ChunkSpec:
        if self.overlap_tokens >= self.max_tokens // 2:
            raise ValueError("overlap_tokens must be less than half of max_tokens")
        return self


class Example(_Strict):
    user: str
    assistant: str


class PromptSpec(_Strict):
    system: str = ""
    user_template: str = "{text}"
    examples: list[Example] = Field(default_factory=list)

    @field_validator("user_template")
    @classmethod
    def _has_text(cls, v: str) -> str:
        try:
            list(string.Formatter().parse(v))
        except ValueError as e:
            raise ValueError(
                f"user_template is not a valid template ({e}); write a literal brace as {{{{ or }}}}"
            ) from e
        if "{text}" not in v:
            raise ValueError("user_template must contain {text}")
        return v

    def template_fields(self) -> list[str]:
        return [f for _, f, _, _ in string.Formatter().parse(self.user_template) if f]


class OutputSpec(_Strict):
    name: str = "output"
    schema_file: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    reduce: dict[str, ReduceRule] = Field(default_factory=dict)
    """Output field → rule; fields not named take their type's default (see `reduce_rules`)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


OWNED_BODY_KEYS = frozenset(
    {
        "model",
        "messages",
        "system",
        "response_format",
        "output_format",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "stream",
        "n",
    }
)
"""Request keys lowtide writes itself: `extra_body` may add to a request, never change these."""


class ModelSpec(_Strict):
    backend: str = "emulator"
    name: str
    names: dict[str, str] = Field(default_factory=dict)
    """Per-backend model names, e.g. {anthropic = "claude-haiku-4-5"}; `name` is the default."""
    temperature: float = 0.0
    max_tokens: int = Field(256, ge=1)
    extra_body: dict[str, Any] = Field(default_factory=dict)
    api_key_block: str | None = Field(None, min_length=1)

    @field_validator("extra_body")
    @classmethod
    def _no_owned_keys(cls, v: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(set(v) & OWNED_BODY_KEYS)
        if owned:
            raise ValueError(
                f"extra_body may not set {owned}: lowtide builds those from [model] name, "
                "temperature and max_tokens, the prompt and the output schema, and records and "
                "prices what it sent; set them there"
            )
        return v

    """A Prefect Secret block holding the provider key, read when the key's variable
    (OPENAI_API_KEY, ANTHROPIC_API_KEY) is unset; the block's name, never the key."""


class QaSpec(_Strict):
    sample_rate: float = Field(0.05, ge=0, le=1)
    seed: int = 0
    eval_set: str | None = None
    eval_id_column: str = "eval_id"
    eval_every_run: bool = True  # ask the eval set afresh each run (never from the cache)
    eval_max_drop: float = Field(0.02, ge=0, le=1)  # hold the run if a field's accuracy drops more
    eval_floor: float | None = Field(None, ge=0, le=1)  # hold the run if a field falls below this
    max_failed_share: float = 0.05  # hold the run if more of its rows than this failed

    @field_validator("max_failed_share", mode="before")
    @classmethod
    def _a_share(cls, v: object) -> float:
        # before pydantic's own checks: "5%", nan or 5 get one line saying what to write
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
            raise ValueError(
                f"max_failed_share must be a number from 0 to 1, the share of rows that may "
                f"fail before the run is held (0.05 is 5%), not {v!r}"
            )
        return float(v)


class CostSpec(_Strict):
    price_table: str | None = None
    budget_usd: float | None = Field(None, gt=0)


class RetrySpec(_Strict):
    """What happens to requests that did not come back answered."""

    max_attempts: int = Field(3, ge=1)  # batch attempts per request (errored, expired, cancelled)
    realtime_fallback: bool = True  # after the last batch attempt, try once through realtime
    deadline_hours: float | None = Field(None, gt=0)  # past this, stragglers go realtime at once
    reask: bool = True  # re-ask unparseable or cut-off answers once, with a larger max_tokens
    reask_via: Literal["batch", "realtime"] = "batch"
    reask_max_tokens_factor: float = Field(2.0, ge=1.0)
    realtime_concurrency: int = Field(8, ge=1)


class LimitsSpec(_Strict):
    """What a provider account allows, when the user knows it (`[limits.<backend>]`); unset
    limits are learned from the provider's own refusals and remembered in the state file."""

    enqueued_tokens: int | None = Field(None, gt=0)  # prompt tokens waiting, per model (OpenAI)
    queued_requests: int | None = Field(None, gt=0)  # requests waiting, all models (Anthropic)
    batches_per_hour: int | None = Field(None, gt=0)  # batch creates per hour (OpenAI: 2,000)


class PoolSpec(_Strict):
    """A pool of OpenAI-compatible servers (vLLM, SGLang, ...) for backend 'vllm'."""

    urls: list[str] = Field(default_factory=list)  # base URLs ending in /v1; or LOWTIDE_VLLM_URLS
    # dns:NAME:PORT: every address NAME resolves to is a server, re-resolved during the run
    discover: str | None = None
    api_key: str | None = None  # deprecated: a key in a job file ends up in version control
    api_key_block: str | None = Field(None, min_length=1)  # Prefect Secret block with the key
    min_inflight: int = Field(1, ge=1)  # per endpoint
    max_inflight: int = Field(256, ge=1)  # per endpoint
    initial_inflight: int = Field(8, ge=1)
    adaptive: bool = True  # grow/shrink the in-flight cap from each server's /metrics
    bucketing: bool = True  # longest requests first, so long ones do not straggle at the end
    prefix_grouping: bool = True  # requests sharing a prompt prefix go to the same server
    checkpoint_every: int = Field(200, ge=1)  # results committed to the store in groups this size
    request_timeout_s: float = Field(600.0, gt=0)
    gpu_hour_usd: float | None = None  # prices a pool run by GPU time
    gpus: int = Field(1, ge=1)  # GPUs behind the pool, for the GPU-hour price
    tokens_per_s: float | None = Field(None, gt=0)  # output tokens/s per server (estimate)

    @field_validator("discover")
    @classmethod
    def _discover_form(cls, v: str | None) -> str | None:
        if v is not None:
            parse_discover(v)
        return v

    @model_validator(mode="after")
    def _one_source(self) -> PoolSpec:
        if self.discover is not None and self.urls:
            raise ValueError(
                "urls and discover are both set; keep one (discover follows a DNS name, urls "
                "is a fixed list)"
            )
        return self


class ProviderSpec(_Strict):
    """What the run leaves at a batch provider once its results are stored (docs/job-file.md)."""

    keep_files: bool = False  # keep uploads, result files and ended batches (no expiry asked)


class JobSpec(_Strict):
    name: str
    description: str = ""
    input: InputSpec
    chunk: ChunkSpec = Field(default_factory=ChunkSpec)
    prompt: PromptSpec = Field(default_factory=PromptSpec)
    output: OutputSpec
    model: ModelSpec
    qa: QaSpec = Field(default_factory=QaSpec)
    cost: CostSpec = Field(default_factory=CostSpec)
    pool: PoolSpec = Field(default_factory=PoolSpec)
    retry: RetrySpec = Field(default_factory=RetrySpec)
    route: RouteSpec | None = None
    limits: dict[str, LimitsSpec] = Field(default_factory=dict)
    """The provider account's limits per backend name (`[limits.openai] enqueued_tokens = …`)."""
    provider: ProviderSpec = Field(default_factory=ProviderSpec)

    # filled by load_job, not by the file
    source_path: str = ""
    route_models: dict[str, str] = Field(default_factory=dict)
    """The model id each engine of `[route]` runs (`[model] names`, else `[model] name`)."""
    output_schema: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not _JOB_NAME.match(v):
            raise ValueError(
                "name must be lowercase letters, digits, '-' or '_', starting with a letter"
            )
        return v

    @field_validator("name")
    @classmethod
    def _view_is_free(cls, v: str) -> str:
        from lowtide.store.publish import PIPELINE_TABLES

        view = v.replace("-", "_")
        if view in PIPELINE_TABLES or view == "row_costs" or view.startswith("src_"):
            raise ValueError(
                f"a job named {v!r} would publish its view as {view!r}, which is one of "
                "lowtide's own tables; choose another name"
            )
        if view.endswith("_chunks"):
            raise ValueError(
                f"a job name may not end in _chunks ({view!r} is the chunk view of job "
                f"{view.removesuffix('_chunks')!r}); choose another name"
            )
        return v

    @property
    def view_name(self) -> str:
        """The per-job view in the published file: the job name with hyphens as underscores."""
        return self.name.replace("-", "_")

    def resolve(self, relative: str | None) -> str | None:
        """A path from the job file, resolved against the job file's folder."""
        if relative is None or relative.startswith("duckdb:"):
            return relative
        p = Path(relative)
        if not p.is_absolute():
            p = Path(self.source_path).parent / p
        return str(p)

    def prompt_fingerprint(self) -> str:
        """Hash of everything besides the unit text that shapes a request.

        Part of every request key: changing the prompt, examples, schema, model or parameters makes
        new keys (new requests); changing nothing keeps them (cache hits across runs).
        """
        material = {
            "system": self.prompt.system,
            "template": self.prompt.user_template,
            "examples": [e.model_dump() for e in self.prompt.examples],
            "schema": self.output_schema,
            "schema_name": self.output.name,
            "model": self.model.name,
            "temperature": self.model.temperature,
            "max_tokens": self.model.max_tokens,
            "extra_body": self.model.extra_body,
        }
        return hashlib.sha256(orjson.dumps(material, option=orjson.OPT_SORT_KEYS)).hexdigest()

    def reduce_rules(self) -> dict[str, str]:
        """Every output field's reduce rule: the job file's, else its type's default."""
        props = self.output_schema.get("properties", {})
        return {
            name: self.output.reduce.get(name)
            or default_reduce(spec if isinstance(spec, dict) else {})
            for name, spec in props.items()
        }

    def enum_fields(self) -> dict[str, list[str]]:
        props = self.output_schema.get("properties", {})
        return {k: list(v["enum"]) for k, v in props.items() if isinstance(v, dict) and "enum" in v}


def _check_reduce(job: JobSpec, path: Path) -> None:
    props = job.output_schema.get("properties", {})
    for name, rule in job.output.reduce.items():
        if name not in props:
            raise JobFileError(
                path, f"[output.reduce] {name!r} is not a field of the output schema {list(props)}"
            )
        spec = props[name] if isinstance(props[name], dict) else {}
        kind = "enum" if "enum" in spec and rule in ("max", "min") else json_type(spec)
        allowed = RULE_NEEDS.get(rule)
        if allowed and kind not in allowed:
            raise JobFileError(
                path,
                f"[output.reduce] {name} = {rule!r} needs a field of type {' or '.join(allowed)}; "
                f"{name} is {json_type(spec)}. Use first or majority, or another rule",
            )


def _check_names(job: JobSpec, path: Path) -> None:
    """Input columns and output fields must not shadow each other or lowtide's own columns."""
    spec = job.input
    inputs = [spec.id_column, spec.text_column, *spec.column_names]
    taken = sorted(set(inputs) & VIEW_COLUMNS)
    if taken:
        raise JobFileError(
            path,
            f"[input] column name(s) {taken} are lowtide's own view columns; rename the column "
            "in the input (or select it under another name)",
        )
    for name in job.output_schema.get("properties", {}):
        if not name.strip():
            raise JobFileError(path, "[output] schema has a property with an empty name")
        if name in VIEW_COLUMNS or name in inputs:
            raise JobFileError(
                path,
                f"[output] schema property {name!r} clashes with "
                + ("lowtide's own view column" if name in VIEW_COLUMNS else "an input column")
                + " of that name; rename the property",
            )


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (see docs/job-file.md for the keys a job file accepts)"
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif e["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        parts.append(f"[{where}] {msg}")
    return "; ".join(parts)


def load_job(path: str | Path, backend: str | None = None) -> JobSpec:
    """Read, validate and resolve a job file. `backend` overrides `[model] backend`."""
    path = Path(path)
    if not path.is_file():
        raise JobFileError(path, "job file not found")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise JobFileError(
            path, f"is not UTF-8 text (byte {e.start} cannot be read); save it as UTF-8"
        ) from e
    except tomllib.TOMLDecodeError as e:
        raise JobFileError(path, f"not valid TOML: {e}") from e
    except OSError as e:
        raise JobFileError(path, f"cannot be read: {e.strerror}") from e
    try:
        job = JobSpec.model_validate(raw)
    except ValidationError as e:
        raise JobFileError(path, _describe(e)) from e
    job.source_path = str(path.resolve())
    if job.pool.api_key is not None:
        warnings.warn(
            f"{path}: [pool] api_key keeps a secret in the job file, which is deprecated: set "
            "LOWTIDE_VLLM_API_KEY, or save the key in a Prefect Secret block and name it in "
            "[pool] api_key_block",
            FutureWarning,  # shown to users by default, unlike DeprecationWarning
            stacklevel=2,
        )
    if backend:
        job.model.backend = backend
    elif job.route is not None:
        job.model.backend = job.route.engines[0]  # a route starts on its first engine
    if job.route is not None:
        job.route_models = {e: job.model.names.get(e, job.model.name) for e in job.route.engines}
    job.model.name = job.model.names.get(job.model.backend, job.model.name)
    if job.model.backend not in REGISTRY:
        raise JobFileError(
            path,
            f"[model] backend: unknown backend {job.model.backend!r}; known: {', '.join(REGISTRY)}",
        )
    unknown_limits = sorted(set(job.limits) - set(REGISTRY))
    if unknown_limits:
        raise JobFileError(
            path,
            f"[limits.{unknown_limits[0]}]: unknown backend; limits are set per backend, one of: "
            f"{', '.join(REGISTRY)}",
        )
    job.output_schema = _read_schema(job, path)
    fields = set(job.prompt.template_fields()) - {"text"}
    missing = fields - set(job.input.column_names)
    if missing:
        raise JobFileError(
            path,
            f"[prompt.user_template] uses {sorted(missing)} which are not in [input] columns; "
            "add them to columns",
        )
    _check_names(job, path)
    _check_reduce(job, path)
    _check_encoding(job, path)
    return job


def _check_encoding(job: JobSpec, path: Path) -> None:
    from lowtide.tokens import ENCODINGS

    known = list(ENCODINGS)
    if job.chunk.encoding not in known:
        raise JobFileError(
            path, f"[chunk] encoding {job.chunk.encoding!r} is unknown; use one of {known}"
        )


def _read_schema(job: JobSpec, path: Path) -> dict[str, Any]:
    out = job.output
    if (out.schema_file is None) == (out.schema_ is None):
        raise JobFileError(path, "[output] needs exactly one of schema_file or schema")
    if out.schema_ is not None:
        schema = out.schema_
    else:
        schema_path = Path(job.resolve(out.schema_file) or "")
        if not schema_path.is_file():
            raise JobFileError(path, f"[output.schema_file] {schema_path} does not exist")
        try:
            schema = orjson.loads(schema_path.read_bytes())
        except orjson.JSONDecodeError as e:
            raise JobFileError(path, f"[output.schema_file] {schema_path} is not JSON: {e}") from e
    where = f"[output.schema_file] {out.schema_file}" if out.schema_file else "[output.schema]"
    if (
        not isinstance(schema, dict)
        or schema.get("type") != "object"
        or not isinstance(schema.get("properties"), dict)
    ):
        raise JobFileError(
            path, f"{where} must be a JSON object schema with properties (type = object)"
        )
    try:
        jsonschema_rs.validator_for(schema)
    except jsonschema_rs.ValidationError as e:
        first = str(e).strip().splitlines()[0]
        raise JobFileError(path, f"{where} is not a valid JSON Schema: {first}") from e
    return schema
