"""`lowtide emulator`: the local stand-in for the providers and for a vLLM pool."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from lowtide import render

console = render.console


def fail(message: str, code: int = 2) -> typer.Exit:
    render.error_line(message)
    return typer.Exit(code)


def emulator(
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port for the OpenAI/Anthropic emulator (0: any).")
    ] = 8765,
    faults: Annotated[str, typer.Option(help="Fault rules, see docs/emulator.md.")] = "",
    time_scale: Annotated[float, typer.Option(help="Simulated seconds per real second.")] = 60.0,
    engines: Annotated[int, typer.Option(help="Also start N emulated vLLM engines.")] = 0,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAME",
            help="Model names the vLLM engines answer to, as vLLM's flag of that name (repeat it "
            "or separate with commas; default: emulated-model and qwen2.5-7b-instruct, the "
            "sample job's vLLM model). Other names get vLLM's 404.",
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed for shuffling, errors and broken answers.")] = 0,
    malformed_rate: Annotated[float, typer.Option(help="Share of broken answers.")] = 0.0,
    error_rate: Annotated[float, typer.Option(help="Share of per-request provider errors.")] = 0.01,
    model_version: Annotated[
        int, typer.Option(help="Model version (2 answers a few % differently).")
    ] = 1,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            help="Keep files, batches, the ledger and the clock in this folder, so a restarted "
            "emulator resumes like a provider (docs/emulator.md)."
        ),
    ] = None,
) -> None:
    """Start the local emulator in the foreground and print the variables to export."""
    from lowtide.emulator.main import serve

    if port == 0:  # any free port
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    from lowtide.emulator.vllm import DEFAULT_SERVED_MODEL_NAMES, served_model_names

    if served_model_name and not engines:
        raise fail("--served-model-name names what the vLLM engines serve; add --engines N")
    try:
        names = served_model_names(served_model_name or DEFAULT_SERVED_MODEL_NAMES)
    except ValueError as e:
        raise fail(f"--served-model-name: {e}") from e
    pool = None
    if engines:
        from lowtide.emulator.vllm_pool import start_engines

        pool = start_engines(engines, served_model_name=names)
        console.print(
            f"{engines} emulated vLLM engine(s) serving {escape(', '.join(names))}:",
            soft_wrap=True,
        )
        console.print(f"  export LOWTIDE_VLLM_URLS={','.join(pool.urls)}", soft_wrap=True)
    from lowtide.emulator.config import EmulatorConfig
    from lowtide.emulator.main import apply_fault_spec

    try:
        apply_fault_spec(EmulatorConfig(), faults)  # a bad spec is one line, before any port opens
    except ValueError as e:
        raise fail(f"--faults: {e}") from e
    try:
        serve(
            port=port,
            faults=faults,
            time_scale=time_scale,
            seed=seed,
            malformed_rate=malformed_rate,
            error_rate=error_rate,
            model_version=model_version,
            state_dir=str(state_dir) if state_dir else None,
        )
    except OSError as e:
        raise fail(f"cannot serve on port {port}: {e.strerror or e}") from e
    finally:
        if pool is not None:
            pool.close()
