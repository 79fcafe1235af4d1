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


def test_stores_of_one_file_share_it_across_threads_and_many_files_do_not_pile_up(
    tmp_path: Path,
) -> None:
    """Every Store of one file in a process uses the one attached copy (a second copy of a
    file DuckDB already has open is refused), threads each get a cursor of their own, and a
    process that works on more state files than it keeps attached closes the idle ones."""
    from concurrent.futures import ThreadPoolExecutor

    state = tmp_path / "state.duckdb"
    first, second = Store(state), Store(state)
    with first.held(), ThreadPoolExecutor(4) as pool:
        calls = [pool.submit(s.in_flight_runs) for s in (first, second) * 8]
        assert [c.result() for c in calls] == [[]] * 16
    assert _other_process_opens(state) == "opened"

    others = [Store(tmp_path / f"other-{i}.duckdb") for i in range(8)]
    for store in others:
        assert store.in_flight_runs() == []
    assert Store(state).in_flight_runs() == [] and others[0].in_flight_runs() == []
    assert all(_other_process_opens(tmp_path / f"other-{i}.duckdb") == "opened" for i in (0, 7))


HOLD_UNTIL_STDIN_CLOSES = """
import sys, duckdb
con = duckdb.connect(sys.argv[1])
print("holding", flush=True)
sys.stdin.read()
con.close()
"""


def test_a_wait_for_another_process_does_not_stall_the_process_s_other_files(
    tmp_path: Path,
) -> None:
    """While one thread waits for a state file another process holds, the same process keeps
    working on its other state files; the waiting call goes through once the holder lets go."""
    import threading

    held, free = tmp_path / "held.duckdb", tmp_path / "free.duckdb"
    Store(held).in_flight_runs()  # created and migrated
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_UNTIL_STDIN_CLOSES, str(held)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdin is not None
    assert holder.stdout.readline().strip() == "holding"
    waited: list[object] = []
    waiter = threading.Thread(
        target=lambda: waited.append(Store(held, lock_timeout_s=600).in_flight_runs())
    )
    waiter.start()
    try:
        assert Store(free).in_flight_runs() == []  # not queued behind the waiting thread
        assert waiter.is_alive() and waited == []  # still waiting for the holder
    finally:
        holder.stdin.close()
        holder.wait()
    waiter.join()
    assert waited == [[]]
