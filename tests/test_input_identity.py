"""The input's digest: the bytes decide it, and one process reads them once per file version."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lowtide import input_identity
from lowtide.jobspec import load_job
from tests.integration.conftest import write_job


def test_the_digest_follows_the_bytes_and_is_read_once_per_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = load_job(write_job(tmp_path, rows=10, eval_rows=2), None)
    reads: list[str] = []
    real = input_identity._read_digest
    monkeypatch.setattr(input_identity, "_read_digest", lambda j: reads.append("read") or real(j))
    first = input_identity.input_digest(job)
    assert input_identity.input_digest(job) == first
    assert reads == ["read"]  # the flow's ask after the CLI's costs nothing
    messages = tmp_path / "messages.csv"
    text = messages.read_text()
    messages.write_text(text)  # same bytes, a new modification time
    os.utime(messages, ns=(1, 1))
    assert input_identity.input_digest(job) == first
    changed_before = messages.stat().st_ctime_ns
    while messages.stat().st_ctime_ns == changed_before:  # the clock's tick may be coarse
        time.sleep(0.005)
        messages.write_text(text.replace("m000001", "m999999"))  # other bytes, same size
        os.utime(messages, ns=(1, 1))  # and the modification time set back (cp -p, rsync -t)
    assert input_identity.input_digest(job) != first
    assert reads == ["read"] * 3
