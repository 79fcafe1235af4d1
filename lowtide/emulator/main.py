"""Run the emulator in the foreground (what `lowtide emulator` calls)."""

from __future__ import annotations

import uvicorn

from lowtide.emulator.config import EmulatorConfig, FaultRule, apply_fault_spec


def serve(
    port: int = 8765,
    host: str = "127.0.0.1",
    faults: str = "",
    time_scale: float = 1.0,
    seed: int = 0,
    error_rate: float = 0.01,
    malformed_rate: float = 0.0,
    model_version: int = 1,
    state_dir: str | None = None,
) -> None:
    """Serve the OpenAI + Anthropic emulator on host:port until interrupted (Ctrl-C).

    Prints the base URLs and the environment variables that point the SDKs at it first.
    `faults` uses the grammar in docs/emulator.md. With `state_dir`, files, batches, the ledger
    and the clock are kept in that folder and a restarted emulator resumes from them.
    """
    from lowtide.emulator.app import create_app
    from lowtide.emulator.server import NoDelayH11Protocol

    config = EmulatorConfig(
        seed=seed,
        time_scale=time_scale,
        error_rate=error_rate,
        malformed_rate=malformed_rate,
        model_version=model_version,
        state_dir=state_dir,
    )
    config.faults = apply_fault_spec(config, faults)
    app = create_app(config)
    print(banner(host, port, config), flush=True)
    try:
        uvicorn.run(
            app,
            host=host,
            port=port,
            http=NoDelayH11Protocol,
            log_level="warning",
            access_log=False,
        )
    finally:
        app.state.emulator.close()


def banner(host: str, port: int, config: EmulatorConfig) -> str:
    base = f"http://{host}:{port}"
    lines = [
        f"lowtide emulator on {base} (time x{config.time_scale:g}, seed {config.seed}, "
        f"error rate {config.error_rate:g}, malformed rate {config.malformed_rate:g}, "
        f"model v{config.model_version})",
        f"  OpenAI:    {base}/v1",
        f"  Anthropic: {base}",
        f"  Admin:     {base}/_emulator/ledger",
    ]
    if config.state_dir:
        lines.append(f"  State:     {config.state_dir} (kept across restarts)")
    if config.faults:
        lines.append("  Faults:    " + ", ".join(_describe(r) for r in config.faults))
    lines += [
        "Export:",
        f"  export OPENAI_BASE_URL={base}/v1",
        "  export OPENAI_API_KEY=emulator",
        f"  export ANTHROPIC_BASE_URL={base}",
        "  export ANTHROPIC_API_KEY=emulator",
    ]
    return "\n".join(lines)


def _describe(rule: FaultRule) -> str:
    if rule.kind == "slow_finalizing":
        return f"slow_finalizing +{rule.seconds:g}s"
    times = "*" if rule.count is None else rule.count
    return f"{rule.kind} on {rule.method} {rule.path} x{times}"
