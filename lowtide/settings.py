"""Where lowtide keeps things and how it reaches engines, resolved once at the edge.

Precedence: CLI flag / flow parameter, then environment (`LOWTIDE_*`), then `.env`, then defaults.
Job-file settings (what to run) live in `lowtide.jobspec`; this object says where and with what.
"""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOWTIDE_", env_file=".env", extra="ignore")

    state: Path = Path(".lowtide/state.duckdb")
    """Private state file; only the flow's process writes it."""
    db: Path = Path("lowtide.duckdb")
    """Published file for analysts, replaced atomically when a run completes."""
    work_dir: Path = Path(".lowtide/work")
    """Per-run intermediate files (parquet, batch JSONL)."""
    lock_timeout_s: float = 30.0
    """How long to wait for another lowtide process holding the state file."""
    poll_max_interval_s: float = 30.0
    """Upper bound of the polling backoff."""
    shard_max_requests: int | None = None
    """Cap on requests per batch below the backend's own limit (useful for tests and small runs)."""

    def with_overrides(self, **kw: object) -> Settings:
        return self.model_copy(update={k: v for k, v in kw.items() if v is not None})
