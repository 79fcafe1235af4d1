"""Where lowtide keeps things and how it reaches engines, resolved once at the edge.

Precedence: CLI flag / flow parameter, then environment (`LOWTIDE_*`), then `.env`, then defaults.
Job-file settings (what to run) live in `lowtide.jobspec`; this object says where and with what.
This module is the only place that reads the process environment (`lowtide.allocators` only sets
two native libraries' defaults before they load).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from lowtide.errors import SettingsError


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="LOWTIDE_", env_file=".env", extra="ignore", frozen=True
    )

    state: Path = Field(
        Path(".lowtide/state.duckdb"),
        description="Private state file; only the flow's process writes it, in short transactions.",
    )
    db: Path = Field(
        Path("lowtide.duckdb"),
        description="Published file for analysts, replaced atomically when a run completes.",
    )
    work_dir: Path = Field(
        Path(".lowtide/work"),
        description="Per-run intermediate files (parquet); a run's folder is removed when it "
        "finishes, unless keep_work_dir.",
    )
    keep_work_dir: bool = Field(
        False, description="Keep a finished run's intermediate files (for debugging)."
    )
    lock_timeout_s: float = Field(
        30.0, description="How long to wait for another lowtide process holding the state file."
    )
    poll_max_interval_s: float = Field(30.0, description="Upper bound of the polling backoff.")
    shard_max_requests: int | None = Field(
        None, description="Cap on requests per batch below the backend's own limit."
    )
    emulator_url: str | None = Field(
        None,
        description="Use an emulator started with `lowtide emulator` (its base URL) instead of "
        "an in-process one.",
    )
    vllm_urls: str | None = Field(
        None,
        description="Comma-separated OpenAI base URLs of the vLLM pool; overrides [pool] urls.",
    )
    vllm_api_key: SecretStr | None = Field(
        None, description="Bearer key for the vLLM pool; overrides [pool] api_key."
    )
    prefect_server: Literal["auto", "temporary"] = Field(
        "auto",
        description="Where a CLI run reports to when no Prefect server is configured: `auto` "
        "runs the flow in this process without Prefect (no UI would show the run; `lowtide "
        "status` does), `temporary` starts Prefect's temporary server for it as before (runs "
        "land in PREFECT_HOME's database). With a configured server (PREFECT_API_URL or a "
        "profile), every run goes through it.",
    )
    stage_timings: Path | None = Field(
        None,
        description="A JSON-lines file that gets each stage's seconds of a run the CLI runs "
        "without Prefect (what Prefect's task runs would show).",
    )
    crash_at: str | None = Field(
        None,
        description="Test only: the named crash point at which the process kills itself "
        "(lowtide.crashpoints).",
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise SettingsError(_describe(e, values)) from e

    @field_validator("state", "db")
    @classmethod
    def _a_file(cls, v: Path) -> Path:
        if v.is_dir():
            raise ValueError(f"{v} is a directory; give a file path (e.g. {v / 'lowtide.duckdb'})")
        return v

    @field_validator("work_dir")
    @classmethod
    def _a_folder(cls, v: Path) -> Path:
        if v.exists() and not v.is_dir():
            raise ValueError(f"{v} is a file; give a folder path")
        return v

    def with_overrides(self, **kw: object) -> Settings:
        """These settings with CLI flags / flow parameters on top, checked like the rest."""
        updates = {k: v for k, v in kw.items() if v is not None}
        if not updates:
            return self
        return Settings(**{**self.model_dump(), **updates})


def _describe(err: ValidationError, given: dict[str, object]) -> str:
    """One line per bad setting, named as the user set it: the flag's value or the variable."""
    parts = []
    for e in err.errors():
        field = str(e["loc"][0]) if e["loc"] else ""
        where = f"setting {field}" if field in given else f"LOWTIDE_{field.upper()}"
        shown = f"={e['input']!r}" if isinstance(e.get("input"), str | Path) else ""
        parts.append(f"{where}{shown}: {e['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def state_memory_mb() -> int | None:
    """LOWTIDE_STATE_MEMORY_MB: the memory (MiB) DuckDB may keep for a state file; unset, the
    store sizes it (lowtide.store.memory); 0, DuckDB's own default. Read from the environment
    alone, when the store starts a file's DuckDB instance: every process that opens a state file
    gets there, and a bad value of an unrelated setting must not stop it."""
    raw = os.environ.get("LOWTIDE_STATE_MEMORY_MB", "").strip()
    if not raw:
        return None
    try:
        mb = int(raw)
    except ValueError:
        mb = -1
    if not 0 <= mb <= 2**30:  # 2**30 MiB: a PiB, past any machine
        raise SettingsError(
            f"LOWTIDE_STATE_MEMORY_MB={raw!r}: give a whole number of MiB (0 for DuckDB's default)"
        )
    return mb


def provider_key(variable: str) -> str | None:
    """A provider's API key from its SDK's own variable (OPENAI_API_KEY, ANTHROPIC_API_KEY; no
    LOWTIDE_ prefix), read when a client is built so that a worker's key set after start-up
    counts; None when unset or empty. Only `lowtide.backends.keys` asks, and passes it on to
    the client alone."""
    return os.environ.get(variable) or None


def crash_point_armed() -> str | None:
    """The armed crash point, read fresh (a test arms it in a subprocess's environment)."""
    return os.environ.get("LOWTIDE_CRASH_AT")


def prefect_defaults(home: Path) -> None:
    """Keep Prefect offline and inside the working directory unless the user chose otherwise.
    Prefect reads these from the environment when it starts, so they are set there."""
    os.environ.setdefault("PREFECT_HOME", str(home.resolve()))
    # Prefect's SQLite cannot create the folder itself ("unable to open database file")
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # The terminal gets lowtide's own one-line errors; full tracebacks still reach the Prefect
    # UI through its API log handler.
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")


def cache_dir() -> Path:
    """Where lowtide keeps what any run on this machine may reuse (a migrated Prefect database):
    LOWTIDE_CACHE_DIR, else lowtide/ in the user's cache folder (XDG_CACHE_HOME, ~/.cache)."""
    chosen = os.environ.get("LOWTIDE_CACHE_DIR")
    if chosen:
        return Path(chosen).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "lowtide"


def point_prefect_at(api_url: str) -> None:
    """Make Prefect, once imported, talk to this API (lowtide's own temporary server)."""
    os.environ["PREFECT_API_URL"] = api_url


def prefect_startup_timeout_s() -> float:
    return float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") or 90)


def temporary_server_environment() -> dict[str, str]:
    """The environment Prefect gives its temporary server: API only, no UI."""
    env = {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    env.pop("PREFECT_API_URL", None)  # the server is not a client of itself
    return env


def prefect_database_path() -> Path | None:
    """The SQLite file a temporary server will use (None for another database), read from the
    environment as Prefect would, without importing it."""
    url = (
        os.environ.get("PREFECT_SERVER_DATABASE_CONNECTION_URL")
        or os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL")
        or ""
    )
    if not url:
        return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser() / "prefect.db"
    if not url.startswith("sqlite") or ":///" not in url:
        return None
    return Path(url.split(":///", 1)[1].split("?", 1)[0])  # without `?timeout=30` and such


def prefect_server_configured(home: Path) -> bool:
    """Whether Prefect would report to a configured server (PREFECT_API_URL in the environment,
    the active profile, ./prefect.toml, ./.env or ./pyproject.toml's [tool.prefect]), read without
    importing Prefect (~3 s). Unsure (a file that does not parse) counts as configured: the
    caller then goes through Prefect."""
    if os.environ.get("PREFECT_API_URL"):
        return True
    prefect_home = Path(os.environ.get("PREFECT_HOME") or home).expanduser()
    profiles = Path(os.environ.get("PREFECT_PROFILES_PATH") or prefect_home / "profiles.toml")
    try:
        if profiles.is_file():
            doc = tomllib.loads(profiles.read_text(encoding="utf-8"))
            active = os.environ.get("PREFECT_PROFILE") or doc.get("active") or "ephemeral"
            if doc.get("profiles", {}).get(active, {}).get("PREFECT_API_URL"):
                return True
        local = Path("prefect.toml")
        if local.is_file() and tomllib.loads(local.read_text(encoding="utf-8")).get("api", {}).get(
            "url"
        ):
            return True
        # Prefect also reads ./.env and [tool.prefect] in ./pyproject.toml: either naming a
        # server counts (loosely: unsure also means "go through Prefect")
        dotenv = Path(".env")
        if dotenv.is_file() and "PREFECT_API_URL" in dotenv.read_text(encoding="utf-8"):
            return True
        project = Path("pyproject.toml")
        if project.is_file() and tomllib.loads(project.read_text(encoding="utf-8")).get(
            "tool", {}
        ).get("prefect"):
            return True
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return True
    return False
