"""Every timestamp in the state file is UTC, whatever the host's zone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROBE = """
import sys
from datetime import UTC, datetime
from lowtide.store import Store

store = Store(sys.argv[1])
duck = store._scalar("SELECT now()::TIMESTAMP")
python = datetime.now(UTC).replace(tzinfo=None)
print(abs((python - duck).total_seconds()))
"""


def test_state_timestamps_are_utc_on_a_host_in_another_zone(tmp_path: Path) -> None:
    env = {**os.environ, "TZ": "Asia/Tokyo"}  # UTC+9 all year: a local now() is 9 h off
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "state.duckdb")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert float(out.stdout) < 3600, "DuckDB's now() is the host's local time, not UTC"
