"""The run context: everything a run needs to know about where it lives and how to reach its
engine, resolved once by the flow and handed to every task as plain, frozen values.

Tasks never read the environment or compare backend names: they ask the context for the store,
the backend's capabilities and its clients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from lowtide.backends import BackendEntry, Connection, backend_entry
from lowtide.backends.base import Backend, Capabilities
from lowtide.backends.keys import secret_from_block
from lowtide.jobspec import JobSpec
from lowtide.pricing import Price, load_price
from lowtide.quota import QueueLimits, limits_from
from lowtide.settings import Settings
from lowtide.store import Store

# The in-process emulator's clock: a one-minute simulated batch passes in 0.1 s.
IN_PROCESS_TIME_SCALE = 600.0


@dataclass(frozen=True)
class RunContext:
    job: JobSpec
    backend: str
    connection: Connection
    price: Price
    state_path: str
    db_path: str
    work_root: str
    lock_timeout_s: float
    poll_max_interval_s: float
    shard_max_requests: int | None
    keep_work_dir: bool = False
    pool: Any = None
    """The resolved `PoolConfig` for a streaming backend (None otherwise)."""

    @property
    def entry(self) -> BackendEntry:
        return backend_entry(self.backend)

    @property
    def answer_family(self) -> str:
        """Whose answers this run's engine gives (`BackendEntry.answer_family`): part of every
        request key, and the engine recorded with each answer that does not carry the
        emulator's fingerprint."""
        return self.entry.answer_family(self.job.model.name)

    @cached_property
    def capabilities(self) -> Capabilities:
        return self.entry.capabilities()

    @property
    def max_requests(self) -> int:
        """Requests per batch: the backend's limit, or the configured cap below it."""
        caps = self.capabilities.max_requests
        return min(caps, self.shard_max_requests or caps)

    @cached_property
    def store(self) -> Store:
        """One store per run context, so the file's schema is checked once, not per call."""
        return Store(self.state_path, self.lock_timeout_s)

    def work_dir(self, run_id: str) -> Path:
        path = Path(self.work_root) / run_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    def queue_limits(self) -> QueueLimits:
        """The provider account's limits for this run's model: the job file's, else what the
        provider taught an earlier batch (the state file), else the engine's own settings
        (lowtide's emulator says its limits); None where unknown."""
        values = {
            **self._account_limits,
            **self.store.provider_limits(self.backend, self.job.model.name),
        }
        configured = self.job.limits.get(self.backend)
        if configured is not None:
            values |= configured.model_dump(exclude_none=True)
        return limits_from(values)

    @cached_property
    def _account_limits(self) -> dict[str, float]:
        return self.entry.account_limits(self.connection)

    def batch_client(self) -> Backend:
        """The run's provider-batch client, built once: an SDK client costs ~50 ms of CPU to
        build (its TLS context), and every submit, poll and download of the run asks for it."""
        return self._batch_client

    @cached_property
    def _batch_client(self) -> Backend:
        return self.entry.batch_client(self.connection)

    def realtime_client(self) -> Any:
        return self.entry.realtime_client(self.connection)


def price_for(job: JobSpec, entry: BackendEntry) -> Price:
    """The dated price of the job's model on this backend (a pool is priced by GPU time when its
    shards run, so its token price is zero)."""
    if entry.pricing == "gpu_hour":
        return Price(entry.name, job.model.name, "gpu-hour", 0.0, 0.0, 0.0, 1.0)
    provider = entry.capabilities().price_provider
    return load_price(job.resolve(job.cost.price_table), provider, job.model.name)


def _pool_config(job: JobSpec, settings: Settings) -> Any:
    from lowtide.backends.vllm_pool import PoolConfig

    key = settings.vllm_api_key.get_secret_value() if settings.vllm_api_key else None
    if key is None and job.pool.api_key_block:
        key = secret_from_block(job.pool.api_key_block, "vllm", "LOWTIDE_VLLM_API_KEY")
    return PoolConfig.from_spec(job.pool, env_urls=settings.vllm_urls, env_api_key=key)


@contextlib.contextmanager
def run_context(
    settings: Settings, job: JobSpec, emulator_url: str | None = None
) -> Iterator[RunContext]:
    """The context for running `job`; for the `emulator` backend without a URL (given, or
    LOWTIDE_EMULATOR_URL) an emulator is started in-process for the duration, keeping its state
    in `<work_dir>/emulator` so that the next run resumes with it."""
    entry = backend_entry(job.model.backend)
    price = price_for(job, entry)
    pool = _pool_config(job, settings) if entry.mode == "stream" else None
    url = emulator_url or settings.emulator_url
    with contextlib.ExitStack() as stack:
        if entry.name == "emulator" and not url:
            from lowtide.emulator.config import EmulatorConfig
            from lowtide.emulator.server import Emulator

            # its files and batches live in the work dir, so a rerun after a crash finds them
            config = EmulatorConfig(
                time_scale=IN_PROCESS_TIME_SCALE, state_dir=str(settings.work_dir / "emulator")
            )
            url = stack.enter_context(Emulator(config)).base_url
        yield RunContext(
            job=job,
            backend=entry.name,
            connection=Connection(
                emulator_url=url,
                api_key_block=job.model.api_key_block,
                keep_files=job.provider.keep_files,
            ),
            price=price,
            state_path=str(settings.state),
            db_path=str(settings.db),
            work_root=str(settings.work_dir),
            lock_timeout_s=settings.lock_timeout_s,
            poll_max_interval_s=settings.poll_max_interval_s,
            shard_max_requests=settings.shard_max_requests,
            keep_work_dir=settings.keep_work_dir,
            pool=pool,
        )
