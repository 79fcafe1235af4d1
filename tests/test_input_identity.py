"""The input's digest: the bytes decide it, one process reads them once per file version, and a
digest recorded by the recipe before is still recognised."""

from __future__ import annotations

import hashlib
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
    monkeypatch.setattr(
        input_identity, "_read_digest", lambda j, a: reads.append("read") or real(j, a)
    )
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


def _digest_of_files(job: object, make: object) -> str:
    """An input's digest computed here, independently: each file's bytes and a NUL, in turn."""
    digest = make()  # type: ignore[operator]
    for path in input_identity.input_files(job):  # type: ignore[arg-type]
        digest.update(Path(path).read_bytes() + b"\x00")
    return str(digest.hexdigest())


def test_a_digest_recorded_before_sha256_still_says_the_input_is_the_same(
    tmp_path: Path,
) -> None:
    job = load_job(write_job(tmp_path, rows=10, eval_rows=2), None)
    digest = input_identity.input_digest(job)
    assert digest == "sha256:" + _digest_of_files(job, hashlib.sha256)
    legacy = _digest_of_files(job, lambda: hashlib.blake2b(digest_size=20))
    assert input_identity.same_input(digest, job)
    assert input_identity.same_input(legacy, job)  # a run recorded before the change
    assert not input_identity.same_input(None, job)
    messages = tmp_path / "messages.csv"
    text, changed_before = messages.read_text(), messages.stat().st_ctime_ns
    while messages.stat().st_ctime_ns == changed_before:  # the clock's tick may be coarse
        time.sleep(0.005)
        messages.write_text(text.replace("m000001", "m999999"))
    assert not input_identity.same_input(digest, job)
    assert not input_identity.same_input(legacy, job)
