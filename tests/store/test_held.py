"""`Store.held()`: one open state file across back-to-back calls, released at the end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lowtide.store import Store

OPEN_IN_ANOTHER_PROCESS = """
import sys, duckdb
try:
    duckdb.connect(sys.argv[1]).close()
    print("opened")
except duckdb.IOException as e:
    print("locked" if "lock" in str(e).lower() else f"other: {e}")
"""


def _other_process_opens(path: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", OPEN_IN_ANOTHER_PROCESS, str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_held_keeps_the_file_for_its_stretch_and_lets_go_after(tmp_path: Path) -> None:
    state = tmp_path / "state.duckdb"
    store = Store(state)
    with store.held():
        with store.held():  # nested stretches share the outer one
            assert store.in_flight_runs() == []
        assert store.in_flight_runs() == []
        # while held, another process (a scheduled collect) waits: hold store work only
        assert _other_process_opens(state) == "locked"
    assert _other_process_opens(state) == "opened"
    assert store.in_flight_runs() == []  # and calls after it open their own connection
