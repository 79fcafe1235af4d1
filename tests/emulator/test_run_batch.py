"""The emulated `vllm run-batch` (provider-apis.md §3.2) and lowtide reading its output."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import orjson
import polars as pl
import pytest

from lowtide.backends.openai_batch import parse_result_lines
from lowtide.emulator.run_batch import RunBatchInputError, run_batch
from lowtide.jobspec import load_job
from tasks.assemble import openai_lines

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "data" / "jobs" / "support-intents.toml"
MODEL = "my-model"


def chat_line(custom_id: str, text: str, *, url: str = "/v1/chat/completions", **body) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], **body}
    line = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    return orjson.dumps(line)


def write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def read_lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def mixed_input(tmp_path: Path) -> Path:
    return write(
        tmp_path / "in.jsonl",
        [
            chat_line("doc-1", "where is my parcel"),
            chat_line("doc-2", "hello", model="other"),
            chat_line("doc-3", "hello", url="/v1/completions"),
            chat_line("doc-4", "my box arrived broken"),
        ],
    )


def test_lines_come_out_in_input_order_with_vllm_ids(tmp_path):
    lines = [chat_line(f"doc-{i:03d}", f"message number {i}") for i in range(40)]
    out = tmp_path / "out.jsonl"
    summary = run_batch(write(tmp_path / "in.jsonl", lines), out, served_model_name=MODEL)
    results = read_lines(out)
    assert [r["custom_id"] for r in results] == [f"doc-{i:03d}" for i in range(40)]
    assert summary["requests"] == summary["succeeded"] == 40 and summary["failed"] == 0
    for r in results:
        assert re.fullmatch(r"vllm-[0-9a-f]{32}", r["id"])
        assert re.fullmatch(r"vllm-batch-[0-9a-f]{32}", r["response"]["request_id"])
    assert len({r["id"] for r in results}) == 40


def test_success_string_error_and_envelope_shapes(tmp_path):
    out = tmp_path / "out.jsonl"
    run_batch(mixed_input(tmp_path), out, served_model_name=MODEL)
    ok, missing_model, bad_url, ok_again = read_lines(out)

    assert ok["error"] is None and ok_again["error"] is None
    assert ok["response"]["status_code"] == 200
    body = ok["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] is None

    assert set(missing_model["response"]) == {"status_code", "request_id", "body"}
    assert missing_model["response"]["status_code"] == 404
    assert missing_model["response"]["body"] is None
    # an error line still gets its own request id, in vLLM's format
    request_ids = [r["response"]["request_id"] for r in (ok, missing_model, bad_url, ok_again)]
    assert all(re.fullmatch(r"vllm-batch-[0-9a-f]{32}", rid) for rid in request_ids)
    assert len(set(request_ids)) == 4
    assert missing_model["error"] == {
        "error": {
            "message": f"The model `other` does not exist. Valid aliases: {MODEL}.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }

    assert bad_url["response"]["status_code"] == 400
    assert bad_url["response"]["body"] is None
    assert isinstance(bad_url["error"], str)
    assert bad_url["error"].startswith("URL /v1/completions is not a supported endpoint.")


def test_method_and_duplicate_custom_ids_are_not_checked(tmp_path):
    line = orjson.loads(chat_line("same", "hi"))
    lines = [orjson.dumps({**line, "method": "GET"}), chat_line("same", "hi again")]
    out = tmp_path / "out.jsonl"
    run_batch(write(tmp_path / "in.jsonl", lines), out, served_model_name=MODEL)
    assert [(r["custom_id"], r["response"]["status_code"]) for r in read_lines(out)] == [
        ("same", 200),
        ("same", 200),
    ]


@pytest.mark.parametrize(
    "bad",
    [
        b"{not json",
        orjson.dumps(
            {
                "custom_id": "x",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": "complete me"},
            }
        ),
        orjson.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions"}),
    ],
    ids=["bad_json", "completions_body", "no_body"],
)
def test_one_unparsable_line_aborts_the_run_and_writes_nothing(tmp_path, bad):
    lines = [chat_line("doc-1", "fine"), b"", bad, chat_line("doc-4", "fine too")]
    out = tmp_path / "out.jsonl"
    with pytest.raises(RunBatchInputError, match=r"^Invalid request on line 3\b"):
        run_batch(write(tmp_path / "in.jsonl", lines), out, served_model_name=MODEL)
    assert not out.exists()


def test_cli_writes_output_and_fails_on_a_bad_line(tmp_path):
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "lowtide.emulator.run_batch"]
    done = subprocess.run(
        [*cmd, "-i", str(mixed_input(tmp_path)), "-o", str(out), "--model", MODEL],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert [r["response"]["status_code"] for r in read_lines(out)] == [200, 404, 400, 200]

    bad_in = write(tmp_path / "bad.jsonl", [chat_line("doc-1", "fine"), b'{"custom_id": 1'])
    bad_out = tmp_path / "bad-out.jsonl"
    failed = subprocess.run(
        [*cmd, "-i", str(bad_in), "-o", str(bad_out), "--model", MODEL],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed.returncode != 0
    assert "Invalid request on line 2" in failed.stderr
    assert not bad_out.exists()


def job_input(tmp_path: Path, n: int) -> tuple[Path, object]:
    job = load_job(JOB)
    frame = pl.DataFrame(
        {
            "custom_id": [f"msg-{i:04d}" for i in range(n)],
            "user": [
                f"Order {i}: the parcel is late and the box arrived broken, please refund"
                for i in range(n)
            ],
        }
    )
    lines = [line.encode() for line in openai_lines(job, frame).to_list()]
    return write(tmp_path / "job.jsonl", lines), job


def test_structured_answers_are_valid_against_the_job_schema(tmp_path):
    path, job = job_input(tmp_path, 12)
    out = tmp_path / "out.jsonl"
    run_batch(path, out, served_model_name=job.model.name)
    results = read_lines(out)
    assert len(results) == 12
    for r in results:
        assert r["response"]["status_code"] == 200, r["error"]
        content = r["response"]["body"]["choices"][0]["message"]["content"]
        jsonschema.validate(orjson.loads(content), job.output_schema)


def test_round_trip_through_parse_result_lines(tmp_path):
    path, job = job_input(tmp_path, 10)
    extra = [
        chat_line("wrong-model", "hello", model="other"),
        chat_line("wrong-url", "hello", url="/v1/responses"),
    ]
    path.write_bytes(path.read_bytes() + b"\n".join(extra) + b"\n")
    out = tmp_path / "out.jsonl"
    run_batch(path, out, served_model_name=job.model.name)

    frame = parse_result_lines(out.read_bytes())
    assert frame["custom_id"].is_duplicated().sum() == 0
    rows = {r["custom_id"]: r for r in frame.iter_rows(named=True)}
    assert set(rows) == {f"msg-{i:04d}" for i in range(10)} | {"wrong-model", "wrong-url"}
    for i in range(10):
        row = rows[f"msg-{i:04d}"]
        assert row["status"] == "answered" and row["error"] is None
        assert row["input_tokens"] > 0 and row["output_tokens"] > 0
        assert row["cached_tokens"] is None
        jsonschema.validate(orjson.loads(row["raw_text"]), job.output_schema)
    assert rows["wrong-model"]["status"] == "provider_error"
    assert rows["wrong-model"]["error"].startswith("NotFoundError: The model `other`")
    assert rows["wrong-url"]["status"] == "provider_error"
    assert rows["wrong-url"]["error"].startswith("run_batch_error: URL /v1/responses")
