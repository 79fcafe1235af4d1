"""A local server that speaks the OpenAI Files/Batches/Chat and Anthropic Message Batches/
Messages wire protocols, with a deterministic model, a simulated clock, injectable faults and a
billing ledger. See docs/emulator.md.

`Emulator`, `create_app` and `run_in_thread` are imported lazily so that reading the config
does not pull in FastAPI and uvicorn.
"""

from __future__ import annotations

from typing import Any

from lowtide.emulator.config import EmulatorConfig, FaultRule

__all__ = ["Emulator", "EmulatorConfig", "FaultRule", "create_app", "run_in_thread"]


def __getattr__(name: str) -> Any:
    if name in ("Emulator", "run_in_thread"):
        from lowtide.emulator import server

        return getattr(server, name)
    if name == "create_app":
        from lowtide.emulator.app import create_app

        return create_app
    raise AttributeError(f"module 'lowtide.emulator' has no attribute {name!r}")
