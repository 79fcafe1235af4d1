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
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lowtide.backends import REGISTRY
from lowtide.errors import JobFileError

_JOB_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputSpec(_Strict):
    path: str
    id_column: str
    text_column: str
    columns: list[str] = Field(default_factory=list)
    database: str | None = None  # for path = "duckdb:TABLE"
    priority_column: str | None = None  # truthy rows skip the batch and go realtime at once


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
        if "{text}" not in v:
            raise ValueError("user_template must contain {text}")
        return v

    def template_fields(self) -> list[str]:
        return [f for _, f, _, _ in string.Formatter().parse(self.user_template) if f]


class OutputSpec(_Strict):
    name: str = "output"
    schema_file: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ModelSpec(_Strict):
    backend: str = "emulator"
    name: str
    names: dict[str, str] = Field(default_factory=dict)
    """Per-backend model names, e.g. {anthropic = "claude-haiku-4-5"}; `name` is the default."""
    temperature: float = 0.0
    max_tokens: int = Field(256, ge=1)
    extra_body: dict[str, Any] = Field(default_factory=dict)
    api_key_block: str | None = Field(None, min_length=1)
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


class PoolSpec(_Strict):
    """A pool of OpenAI-compatible servers (vLLM, SGLang, ...) for backend 'vllm'."""

    urls: list[str] = Field(default_factory=list)  # base URLs ending in /v1; or LOWTIDE_VLLM_URLS
    api_key: str | None = None  # sent as a Bearer token when the servers require one
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

    # filled by load_job, not by the file
    source_path: str = ""
    output_schema: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not _JOB_NAME.match(v):
            raise ValueError(
                "name must be lowercase letters, digits, '-' or '_', starting with a letter"
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

    def enum_fields(self) -> dict[str, list[str]]:
        props = self.output_schema.get("properties", {})
        return {k: list(v["enum"]) for k, v in props.items() if isinstance(v, dict) and "enum" in v}


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key (see docs/job-file.md for the keys a job file accepts)"
        elif e["type"] == "missing":
            msg = "required key is missing"
        parts.append(f"[{where}] {msg}")
    return "; ".join(parts)


def load_job(path: str | Path, backend: str | None = None) -> JobSpec:
    """Read, validate and resolve a job file. `backend` overrides `[model] backend`."""
    path = Path(path)
    if not path.is_file():
        raise JobFileError(path, "job file not found")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise JobFileError(path, f"not valid TOML: {e}") from e
    try:
        job = JobSpec.model_validate(raw)
    except ValidationError as e:
        raise JobFileError(path, _describe(e)) from e
    job.source_path = str(path.resolve())
    if backend:
        job.model.backend = backend
    job.model.name = job.model.names.get(job.model.backend, job.model.name)
    if job.model.backend not in REGISTRY:
        raise JobFileError(
            path,
            f"[model] backend: unknown backend {job.model.backend!r}; known: {', '.join(REGISTRY)}",
        )
    job.output_schema = _read_schema(job, path)
    fields = set(job.prompt.template_fields()) - {"text"}
    missing = fields - set(job.input.columns)
    if missing:
        raise JobFileError(
            path,
            f"[prompt.user_template] uses {sorted(missing)} which are not in [input] columns; "
            "add them to columns",
        )
    return job


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
    if schema.get("type") != "object" or not isinstance(schema.get("properties"), dict):
        raise JobFileError(path, "[output] schema must be an object schema with properties")
    return schema
