"""An emulated `vllm run-batch` (vLLM 0.33's offline batch runner, provider-apis.md §3.2).

`run_batch(input_path, output_path)` reads an OpenAI-style batch input file and writes the one
output file the real tool writes, with the emulator's deterministic model as the "model":

- The whole input is parsed before anything runs. A line that is not JSON, lacks the
  `custom_id`/`method`/`url`/`body` strings and object, or whose body is not a chat request
  (no `messages` list of role-bearing messages, e.g. a completions-style `prompt` body) aborts
  the run with `RunBatchInputError("Invalid request on line N: …")`; no output file is written.
- Every parsed line then gets exactly one output line, **in input order**, successes and
  failures together. Ids are `vllm-<hex>`, `response.request_id` is `vllm-batch-<hex>`.
- A chat body sent to a `url` run-batch does not serve (e.g. `/v1/completions`) is a 400 line
  whose `error` is a plain string; so is a request to a non-chat endpoint run-batch does serve
  (embeddings, score, rerank, audio), since the emulated model only generates text.
- A request the chat handler refuses (unknown model → 404 `NotFoundError`; empty `messages`,
  bad `max_tokens`, `stream`, `n > 1` → 400 `BadRequestError`) is a line whose `error` is
  vLLM's envelope `{"error": {message, type, param, code}}` with `response.body` null.
- `method` and the uniqueness of `custom_id` are not checked, as in vLLM.
- A success carries a `chat.completion` body from `lowtide.emulator.model.answer` (schema-valid
  JSON for `response_format` json_schema or `structured_outputs.json`), with `usage`
  prompt/completion/total tokens and `prompt_tokens_details: null`.

Not emulated: http(s) URLs for `-i`/`-o`, the metrics endpoint, engine timing, and the context
length check (there is no engine config here).

A fault for tests: `crash_after=N` (`--crash-after N`) dies as a killed pod would, once N output
lines are written: it writes the first half of the next line, without its newline, and stops
(`run_batch` raises `RunBatchCrashed`; the command exits 137, as after SIGKILL). With N at or
past the request count it runs to the end.

From a shell: `python -m lowtide.emulator.run_batch -i in.jsonl -o out.jsonl --model NAME`.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from lowtide.emulator import model as emulated_model
from lowtide.emulator.vllm_chat import chat_completion, parse_chat

CHAT_URL = "/v1/chat/completions"
# The endpoints vLLM's run-batch dispatches; only chat is answered by the emulated model.
_OTHER_URLS = ("/v1/embeddings", "/v1/audio/transcriptions", "/v1/audio/translations")
_OTHER_SUFFIXES = ("/score", "/rerank")
SUPPORTED_ENDPOINTS = "/v1/chat/completions, /v1/embeddings, /score, /rerank, " + ", ".join(
    _OTHER_URLS[1:]
)


class RunBatchInputError(ValueError):
    """An input line run-batch cannot parse; the whole run is aborted before any output."""


class RunBatchCrashed(RuntimeError):
    """The emulated run stopped midway (`crash_after`), leaving a partial output file."""

    def __init__(self, written: int, requests: int):
        self.written = written
        self.requests = requests
        super().__init__(f"killed after {written} of {requests} requests (emulated crash)")


KILLED_EXIT = 137


@dataclass(frozen=True)
class _Request:
    custom_id: str
    url: str
    body: dict[str, Any]


def run_batch(
    input_path: str | Path,
    output_path: str | Path,
    *,
    served_model_name: str = "emulated-model",
    model_version: int = 1,
    malformed_rate: float = 0.0,
    seed: int = 0,
    crash_after: int | None = None,
) -> dict[str, Any]:
    """Run every request of `input_path` and write the results to `output_path`, in input order.

    Raises `RunBatchInputError` (naming the line) before writing anything when a line does not
    parse, and `RunBatchCrashed` after `crash_after` lines (the output then ends in half a
    line). Returns a summary: request, success and failure counts and token totals."""
    requests = parse_input(Path(input_path).read_bytes())
    summary: dict[str, Any] = {
        "requests": len(requests),
        "succeeded": 0,
        "failed": 0,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "output_path": str(output_path),
    }
    with open(output_path, "wb") as out:
        for written, request in enumerate(requests):
            line = _run_one(request, served_model_name, model_version, malformed_rate, seed)
            if crash_after is not None and written >= crash_after:
                cut = orjson.dumps(line)
                out.write(cut[: len(cut) // 2])
                raise RunBatchCrashed(written, len(requests))
            if line["error"] is None:
                summary["succeeded"] += 1
                usage = line["response"]["body"]["usage"]
                summary["prompt_tokens"] += usage["prompt_tokens"]
                summary["completion_tokens"] += usage["completion_tokens"]
            else:
                summary["failed"] += 1
            out.write(orjson.dumps(line) + b"\n")
    return summary


def parse_input(content: bytes) -> list[_Request]:
    """Every request of an input file, or `RunBatchInputError` for the first bad line.

    Line numbers count every physical line from 1; blank lines are skipped."""
    requests: list[_Request] = []
    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        problem = _line_problem(raw)
        if isinstance(problem, str):
            raise RunBatchInputError(f"Invalid request on line {number}: {problem}")
        requests.append(problem)
    return requests


def _line_problem(raw: bytes) -> _Request | str:
    """The parsed request, or why the line does not parse."""
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return f"not valid JSON ({exc})"
    if not isinstance(line, dict):
        return "a line must be a JSON object"
    for field in ("custom_id", "method", "url"):
        if not isinstance(line.get(field), str):
            return f"'{field}' must be a string"
    body = line.get("body")
    if not isinstance(body, dict):
        return "'body' must be an object"
    url = line["url"]
    if _is_other_endpoint(url):
        return _Request(line["custom_id"], url, body)
    # A chat URL, or one run-batch does not serve: the body is read as a chat request either
    # way, so a completions-style body fails here and aborts the run.
    messages = body.get("messages")
    if not isinstance(messages, list):
        return "body is not a chat completion request ('messages' is missing or not a list)"
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"body.messages[{index}] needs a string 'role'"
    return _Request(line["custom_id"], url, body)


def _is_other_endpoint(url: str) -> bool:
    return url in _OTHER_URLS or url.endswith(_OTHER_SUFFIXES)


def _run_one(
    request: _Request, served: str, model_version: int, malformed_rate: float, seed: int
) -> dict[str, Any]:
    if request.url != CHAT_URL:
        if _is_other_endpoint(request.url):
            message = (
                f"The lowtide emulator's model does not support the {request.url} endpoint; "
                "only /v1/chat/completions is answered"
            )
        else:
            message = (
                f"URL {request.url} is not a supported endpoint. "
                f"Supported endpoints: {SUPPORTED_ENDPOINTS}"
            )
        return _line(request.custom_id, 400, None, message)
    parsed = parse_chat(request.body, served)
    if not isinstance(parsed, tuple):  # the handler's error response, vLLM's envelope
        return _line(request.custom_id, parsed.status_code, None, orjson.loads(parsed.body))
    messages, schema, max_tokens = parsed
    answer = emulated_model.answer(
        messages,
        schema=schema,
        max_tokens=max_tokens,
        model=served,
        model_version=model_version,
        malformed_rate=malformed_rate,
        seed=seed,
    )
    return _line(request.custom_id, 200, _completion(answer, served), None)


def _line(custom_id: str, status: int, body: dict[str, Any] | None, error: Any) -> dict[str, Any]:
    return {
        "id": f"vllm-{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            "request_id": f"vllm-batch-{uuid.uuid4().hex}",
            "body": body,
        },
        "error": error,
    }


def _completion(answer: emulated_model.ModelAnswer, served: str) -> dict[str, Any]:
    return chat_completion(
        served, answer.text, answer.finish_reason, answer.prompt_tokens, answer.completion_tokens
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Emulated `vllm run-batch` (no GPU, no model).")
    p.add_argument("-i", "--input-file", required=True, help="batch input JSONL (local path)")
    p.add_argument("-o", "--output-file", required=True, help="results JSONL (local path)")
    p.add_argument("--model", "--served-model-name", dest="model", default="emulated-model")
    p.add_argument("--model-version", type=int, default=1)
    p.add_argument("--malformed-rate", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--crash-after",
        type=int,
        default=None,
        metavar="N",
        help="die after N output lines, leaving half of the next one (a killed pod)",
    )
    args = p.parse_args(argv)
    try:
        summary = run_batch(
            args.input_file,
            args.output_file,
            served_model_name=args.model,
            model_version=args.model_version,
            malformed_rate=args.malformed_rate,
            seed=args.seed,
            crash_after=args.crash_after,
        )
    except RunBatchInputError as exc:
        print(f"run-batch: {exc}", file=sys.stderr)
        return 1
    except RunBatchCrashed as exc:
        print(f"run-batch: {exc}", file=sys.stderr)
        return KILLED_EXIT
    print(
        f"run-batch: {summary['requests']} requests, {summary['succeeded']} succeeded, "
        f"{summary['failed']} failed -> {summary['output_path']}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
