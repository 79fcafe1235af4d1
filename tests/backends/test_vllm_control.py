"""Table tests for the vLLM pool's control law (`lowtide.backends.vllm_pool.control`).

Every function here is pure: readings, times and random draws go in as arguments, so each
row of a table is one decision, checked without a server, a clock or a sleep.
"""

from __future__ import annotations

import polars as pl
import pytest

from lowtide.backends.vllm_pool import PoolConfig
from lowtide.backends.vllm_pool.control import (
    CapControl,
    EngineLoad,
    Verdict,
    assign_groups,
    backoff_delay,
    headroom,
    next_cap,
    on_metrics,
    on_overload,
    parse_metrics,
    poll_interval,
    prefix_key,
    request_weights,
    send_order,
    verdict,
)


def load(running: float, waiting: float, kv: float | None = 0.2) -> EngineLoad:
    return EngineLoad(running=running, waiting=waiting, kv_usage=kv)


def config(**changes: object) -> PoolConfig:
    values: dict = {
        "urls": ("http://gpu-0:8000",),
        "min_inflight": 2,
        "max_inflight": 128,
        "initial_inflight": 8,
        "metrics_interval_s": 1.0,
    }
    values.update(changes)
    return PoolConfig(**values)


# -- next_cap: one reading → one step of the cap -------------------------------------------------


@pytest.mark.parametrize(
    ("cap", "now", "previous", "slow", "kv_below", "expected"),
    [
        # server holds what we sent, nothing waits, KV has room: x2 in slow start
        (8, load(8, 0), None, True, 0.9, (16, True)),
        (32, load(31, 1), None, True, 0.9, (64, True)),
        # after the first shrink: x1.125, but always at least one more
        (40, load(40, 0), None, False, 0.9, (45, False)),
        (3, load(3, 0), None, False, 0.9, (4, False)),
        # a queue up to the headroom (max(2, 10% of running)) still counts as "small"
        (100, load(95, 9), None, False, 0.9, (112.5, False)),
        (20, load(18, 2), None, False, 0.9, (22.5, False)),
        # no KV gauge on the page: treated as empty
        (16, load(16, 0, kv=None), None, True, 0.9, (32, True)),
        # KV at or above the threshold: hold; the threshold is the caller's
        (64, load(64, 0, kv=0.9), None, False, 0.9, (64, False)),
        (64, load(64, 0, kv=0.9), None, False, 0.95, (72, False)),
        # requests we sent have not reached the server yet: hold
        (64, load(40, 0), None, True, 0.9, (64, True)),
        # a queue above the headroom at one reading only: hold, still in slow start
        (32, load(20, 12), None, True, 0.9, (32, True)),
        # a previous reading handed in, but it had no queue to speak of: hold
        (32, load(20, 12), load(20, 1), True, 0.9, (32, True)),
        # sustained: shrink by the smaller of the two excesses, slow start ends
        (64, load(40, 15), load(40, 25), True, 0.9, (53, False)),
        (64, load(40, 25), load(40, 15), True, 0.9, (53, False)),
        # ... never below what runs plus its headroom
        (64, load(60, 30), load(60, 30), False, 0.9, (66, False)),
        # ... nor by more than half
        (120, load(10, 100), load(10, 100), False, 0.9, (60, False)),
        # clamped into [lo, hi] = [2, 128]
        (100, load(100, 0), None, True, 0.9, (128, True)),
        (3, load(0, 50), load(0, 50), False, 0.9, (2, False)),
        (200, load(0, 0), None, False, 0.9, (128, False)),
    ],
)
def test_next_cap(cap, now, previous, slow, kv_below, expected):
    new, still_slow = next_cap(
        cap, now, lo=2, hi=128, slow_start=slow, kv_grow_below=kv_below, previous=previous
    )
    assert (round(new, 3), still_slow) == expected


@pytest.mark.parametrize(
    ("running", "expected"), [(0, 2.0), (10, 2.0), (20, 2.0), (30, 3.0), (250, 25.0)]
)
def test_headroom_is_a_tenth_of_running_and_at_least_two(running, expected):
    assert headroom(running) == expected


# -- on_metrics: the controller over a sequence of readings --------------------------------------

# (seconds, reading, our requests in flight) → (cap, still in slow start, congested since)
SEQUENCE = [
    # slow start: doubles while the server holds all we send
    (0.00, load(8, 0), 8, (16, True, None)),
    (0.25, load(16, 0), 16, (32, True, None)),
    # a queue appears: hold and remember when
    (0.50, load(20, 12), 32, (32, True, 0.50)),
    # still there, but not yet for 0.9 of the interval: hold
    (0.75, load(20, 12), 32, (32, True, 0.50)),
    # lasted a full interval: shrink by the smaller excess (min(10 - 2.4, 12 - 2) = 7.6),
    # but to no less than running + headroom = 26.4; slow start is over
    (1.50, load(24, 10), 32, (26.4, False, None)),
    # calm and full: x1.125
    (2.50, load(26, 0), 26, (29.7, False, None)),
    # the server has room, but we do not fill the cap we have: no growth
    (3.50, load(29, 0), 20, (29.7, False, None)),
    # a queue that clears before the interval is up is forgotten, never shrinks the cap
    (4.50, load(29, 9), 29, (29.7, False, 4.50)),
    (5.00, load(29, 1), 29, (33.413, False, None)),
    (6.00, load(29, 9), 33, (33.413, False, 6.00)),
]


def test_on_metrics_over_a_sequence_of_readings():
    cfg = config()
    control = CapControl(float(cfg.start_cap))
    for now, reading, inflight, (cap, slow, since) in SEQUENCE:
        control = on_metrics(control, reading, now=now, inflight=inflight, config=cfg)
        congested_since = control.congested[0] if control.congested else None
        assert control.cap == pytest.approx(cap, abs=1e-3)
        assert (control.slow_start, congested_since) == (slow, since)


@pytest.mark.parametrize(
    ("cap", "slow", "lo", "expected"),
    [(64, True, 2, 32), (64, False, 2, 32), (5, True, 2, 2.5), (3, False, 2, 2), (1, True, 1, 1)],
)
def test_a_503_halves_the_cap_and_ends_slow_start(cap, slow, lo, expected):
    control = on_overload(CapControl(float(cap), slow_start=slow), lo)
    assert (control.cap, control.slow_start) == (expected, False)


@pytest.mark.parametrize(
    ("cap", "expected"), [(0.0, 1), (0.7, 1), (1.0, 1), (7.9, 7), (8.0, 8), (33.4, 33)]
)
def test_cap_int_is_the_whole_requests_and_at_least_one(cap, expected):
    assert CapControl(cap).cap_int == expected


@pytest.mark.parametrize(("slow", "expected"), [(True, 0.125), (False, 0.5)])
def test_poll_interval_is_four_times_faster_in_slow_start(slow, expected):
    assert poll_interval(CapControl(8.0, slow_start=slow), 0.5) == expected


# -- parse_metrics --------------------------------------------------------------------------------

V1_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 27.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 31.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.41
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.63
# HELP vllm:num_requests_waiting_by_reason Waiting requests by reason.
vllm:num_requests_waiting_by_reason{reason="capacity"} 99.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 1200.0
vllm:e2e_request_latency_seconds_count{model_name="m"} 1200.0
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
process_cpu_seconds_total 912.4
"""

V0_PAGE = """\
vllm:num_requests_running{model_name="m"} 12.0 1718000000000
vllm:num_requests_waiting{model_name="m"} 1.5e+01 1718000000000
vllm:gpu_cache_usage_perc{model_name="m"} 0.875 1718000000000
"""


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        # data-parallel ranks: running and waiting add up, KV is the fullest rank
        (V1_PAGE, EngineLoad(58.0, 3.0, 0.63)),
        # vLLM before V1: the old KV gauge name, timestamps after the value, exponent notation
        (V0_PAGE, EngineLoad(12.0, 15.0, 0.875)),
        # unlabelled gauges
        ("vllm:num_requests_running 4\nvllm:num_requests_waiting 0\n", EngineLoad(4, 0, None)),
        # no KV gauge: None, not 0
        ('vllm:num_requests_running{a="b"} 5.0\n', EngineLoad(5.0, 0.0, None)),
        # waiting alone is enough to be a vLLM page
        ("vllm:num_requests_waiting 7\n", EngineLoad(0.0, 7.0, None)),
        # a label value with spaces and braces does not confuse the parser
        ('vllm:num_requests_running{model_name="my model {v2}"} 6.0\n', EngineLoad(6, 0, None)),
        # an unreadable sample is skipped, the others still count
        (
            'vllm:num_requests_running{a="1"} x\nvllm:num_requests_running 2\n',
            EngineLoad(2, 0, None),
        ),
        # KV alone (no running, no waiting): not enough
        ("vllm:kv_cache_usage_perc 0.3\n", None),
        # not a vLLM server (SGLang, a proxy's page) or an empty page
        ("# HELP sglang:num_running_reqs x\nsglang:num_running_reqs 4\n", None),
        ("", None),
    ],
)
def test_parse_metrics(page, expected):
    assert parse_metrics(page) == expected


# -- backoff_delay ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "retry_after", "draw", "expected"),
    [
        # the server's Retry-After wins over the schedule, capped at 30 s, never negative
        (1, 2.5, 0.9, 2.5),
        (4, 0.0, 0.9, 0.0),
        (1, 120.0, 0.9, 30.0),
        (1, -3.0, 0.9, 0.0),
        # else exponential from 0.5 s, doubling per attempt, jitter over the upper half
        (1, None, 0.0, 0.25),
        (1, None, 0.5, 0.375),
        (2, None, 0.0, 0.5),
        (3, None, 0.5, 1.5),
        (0, None, 0.0, 0.25),  # before any send: as the first
        # ... and the ceiling is capped too
        (7, None, 0.0, 15.0),
        (40, None, 0.5, 22.5),
    ],
)
def test_backoff_delay(attempt, retry_after, draw, expected):
    delay = backoff_delay(attempt, 0.5, 30.0, retry_after, rand=lambda: draw)
    assert delay == pytest.approx(expected)


# -- ordering and placement ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "bucketing", "expected"),
    [
        ([5, 9, 5, 1, 9], True, [1, 4, 0, 2, 3]),  # longest first, ties in input order
        ([5, 9, 5, 1, 9], False, [0, 1, 2, 3, 4]),
        ([1, 2, 3], True, [2, 1, 0]),
        ([7], True, [0]),
        ([], True, []),
    ],
)
def test_send_order(weights, bucketing, expected):
    assert send_order(weights, bucketing) == expected


@pytest.mark.parametrize(
    ("keys", "weights", "n", "bucketing", "expected"),
    [
        # singletons: the heaviest first onto the emptiest endpoint, then always the least loaded
        (list("abcdefgh"), [5, 1, 1, 1, 1, 1, 1, 1], 2, False, [[0, 6], [1, 2, 3, 4, 5, 7]]),
        # a group no heavier than a quarter of an endpoint's share (16 / 8 = 2) stays whole
        (
            ["a", "a", *"bcdefghijklmno"],
            [1] * 16,
            2,
            False,
            [[0, 1, 4, 6, 8, 10, 12, 14], [2, 3, 5, 7, 9, 11, 13, 15]],
        ),
        # one group of everything is cut into pieces of at most that quarter, spread evenly
        (["same"] * 8, [1] * 8, 2, False, [[0, 2, 4, 6], [1, 3, 5, 7]]),
        (
            ["same"] * 16,
            [1] * 16,
            2,
            False,
            [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]],
        ),
        # bucketing: pieces by their longest request, and longest first within a piece
        (list("abcdabcd"), [1, 2, 3, 2, 3, 2, 1, 2], 1, True, [[2, 6, 4, 0, 1, 5, 3, 7]]),
        # without: pieces in input order of their first request, members in input order
        (list("abcdabcd"), [1, 2, 3, 2, 3, 2, 1, 2], 1, False, [[0, 4, 1, 5, 2, 6, 3, 7]]),
        # more endpoints than pieces: the rest get nothing
        (["x", "x"], [1, 1], 3, False, [[0], [1], []]),
    ],
)
def test_assign_groups(keys, weights, n, bucketing, expected):
    assert assign_groups(keys, weights, n, bucketing) == expected


def chat(*messages: tuple[str, object], model: str = "m") -> dict:
    return {"model": model, "messages": [{"role": r, "content": c} for r, c in messages]}


SYSTEM = ("system", "You label support tickets.")


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        # the tail of the last user message beyond prefix_chars does not matter
        (
            chat(SYSTEM, ("user", "ctx " * 10 + "one")),
            chat(SYSTEM, ("user", "ctx " * 10 + "two")),
            True,
        ),
        # its head does
        (
            chat(SYSTEM, ("user", "one " + "ctx" * 10)),
            chat(SYSTEM, ("user", "two " + "ctx" * 10)),
            False,
        ),
        # everything before it does, and so does the model
        (
            chat(("system", "A"), ("user", "x" * 40)),
            chat(("system", "B"), ("user", "x" * 40)),
            False,
        ),
        (chat(SYSTEM, ("user", "x" * 40)), chat(SYSTEM, ("user", "x" * 40), model="n"), False),
        # text parts are read like a plain string
        (
            chat(SYSTEM, ("user", [{"type": "text", "text": "x" * 40}])),
            chat(SYSTEM, ("user", "x" * 40)),
            True,
        ),
        # a trailing assistant turn: the last *user* message is the one cut
        (
            chat(SYSTEM, ("user", "x" * 40 + "a"), ("assistant", "{")),
            chat(SYSTEM, ("user", "x" * 40 + "b"), ("assistant", "{")),
            True,
        ),
    ],
)
def test_prefix_key(a, b, same):
    assert (prefix_key(a, 32) == prefix_key(b, 32)) is same


@pytest.mark.parametrize("body", [{}, {"messages": []}, {"messages": "not a list"}])
def test_prefix_key_of_a_body_without_messages_is_empty(body):
    assert prefix_key(body, 32) == ""


@pytest.mark.parametrize(
    ("columns", "expected"),
    [
        ({"line": ["x" * 40, "y" * 8]}, [10, 2]),  # bytes / 4
        ({"line": ["x" * 40, "y" * 8], "est_input_tokens": [300, None]}, [300, 2]),
        ({"line": ["é" * 4]}, [2]),  # bytes, not characters
    ],
)
def test_request_weights(columns, expected):
    assert request_weights(pl.DataFrame(columns)) == expected


# -- what an answer means --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (200, Verdict.ANSWERED),
        (401, Verdict.KEY_REFUSED),
        (403, Verdict.KEY_REFUSED),
        (408, Verdict.RETRY),
        (409, Verdict.RETRY),
        (429, Verdict.RETRY),
        (500, Verdict.RETRY),
        (503, Verdict.RETRY),
        (529, Verdict.RETRY),
        (400, Verdict.FAILED),
        (404, Verdict.FAILED),
        (413, Verdict.FAILED),
        (422, Verdict.FAILED),
        (201, Verdict.FAILED),  # a chat completion is 200; anything else is not an answer
    ],
)
def test_verdict(status, expected):
    assert verdict(status) is expected
