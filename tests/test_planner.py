"""The capacity planner against figures worked out by hand (GiB = 2^30 bytes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from lowtide.planner import (
    PlanError,
    kv_bytes_per_token_for,
    load_api_prices,
    plan,
    plan_command,
    rule_of_thumb_layers,
)

# Llama 3.1 8B: 32 layers, 8 KV heads of 128 dims; bf16 weights and KV.
LLAMA_8B = {"model_params_b": 8.0, "layers": 32, "kv_heads": 8, "head_dim": 128}


def test_llama_8b_on_one_80gb_gpu():
    p = plan(
        **LLAMA_8B,
        gpu_memory_gb=80,
        context_tokens=8192,
        mean_prompt_tokens=1000,
        mean_output_tokens=200,
    )
    # weights 8e9 x 2 B = 14.901 GiB; KV = 80 x 0.92 - 14.901 - 2 = 56.699 GiB
    assert p.weights_gb == pytest.approx(14.9012, abs=1e-3)
    assert p.kv_budget_gb == pytest.approx(56.6988, abs=1e-3)
    # 2 x 32 x 8 x 128 x 2 B = 131,072 B (128 KiB) per token -> 56.699 x 8192 = 464,476 tokens
    assert p.kv_bytes_per_token == 131_072
    assert p.kv_source == "architecture"
    assert p.kv_cache_tokens == 464_476
    # 1,200 tokens per request -> 387 sequences; max_num_seqs rounded down to a multiple of 8
    assert p.tokens_per_request == 1200
    assert p.concurrent_seqs == 387
    assert p.suggested_max_num_seqs == 384
    # 384 x (1 + 1000/200) = 2,304 tokens per step -> the 8,192 floor
    assert p.suggested_max_num_batched_tokens == 8192
    assert p.max_concurrency_at_context == pytest.approx(464_476 / 8192)
    assert p.gpu_usd_per_mtok_output is None
    assert p.warnings == []


def test_cost_per_million_output_tokens_against_the_batch_apis():
    p = plan(
        **LLAMA_8B,
        gpu_memory_gb=80,
        context_tokens=8192,
        mean_prompt_tokens=1000,
        mean_output_tokens=200,
        gpu_hour_usd=2.5,
        tokens_per_s=2500,
    )
    # $2.50 per hour / 3600 s / 2,500 tok/s x 1e6 = $0.2778 per million output tokens
    assert p.gpu_usd_per_mtok_output == pytest.approx(0.27778, abs=1e-5)
    by_model = {(a.provider, a.model): a.usd_per_mtok_output for a in p.api_prices}
    # gpt-4o-mini batch: (5 prompt tokens per output token x $0.15 + $0.60) x 0.5 = $0.675
    assert by_model[("openai", "gpt-4o-mini")] == pytest.approx(0.675)
    # claude-haiku-4-5 batch: (5 x $1.00 + $5.00) x 0.5 = $5.00
    assert by_model[("anthropic", "claude-haiku-4-5")] == pytest.approx(5.0)
    assert not any(a.provider == "emulator" for a in p.api_prices)
    assert [a.usd_per_mtok_output for a in p.api_prices] == sorted(
        a.usd_per_mtok_output for a in p.api_prices
    )


def test_gpu_cost_counts_every_gpu_of_a_tensor_parallel_server():
    p = plan(
        model_params_b=70,
        gpu_memory_gb=80,
        tensor_parallel=2,
        context_tokens=8192,
        mean_prompt_tokens=500,
        mean_output_tokens=100,
        layers=80,
        kv_heads=8,
        head_dim=128,
        gpu_hour_usd=2.0,
        tokens_per_s=1000,
    )
    # weights 70e9 x 2 B / 2 GPUs = 65.193 GiB each; KV (73.6 - 65.193 - 2) x 2 = 12.815 GiB
    assert p.weights_gb == pytest.approx(65.1926, abs=1e-3)
    assert p.kv_budget_gb == pytest.approx(12.8148, abs=1e-3)
    # 2 x 80 x 8 x 128 x 2 = 327,680 B per token -> 12.815 GiB / 320 KiB = 41,991 tokens
    assert p.kv_cache_tokens == 41_991
    assert p.concurrent_seqs == 69  # 41,991 // 600
    # 2 GPUs x $2 / 3600 / 1000 tok/s x 1e6 = $1.111
    assert p.gpu_usd_per_mtok_output == pytest.approx(1.1111, abs=1e-4)


def test_rule_of_thumb_follows_the_llama_3_shape():
    # layers = 16 x cbrt(params): 32 at 8B, 66 at 70B
    assert rule_of_thumb_layers(8) == 32
    assert rule_of_thumb_layers(70) == 66
    assert kv_bytes_per_token_for(model_params_b=8) == (131_072, "rule of thumb")
    assert kv_bytes_per_token_for(model_params_b=70)[0] == 2 * 66 * 8 * 128 * 2
    p = plan(
        model_params_b=8,
        gpu_memory_gb=80,
        context_tokens=8192,
        mean_prompt_tokens=1000,
        mean_output_tokens=200,
    )
    assert p.kv_source == "rule of thumb"
    assert p.concurrent_seqs == 387  # same as the exact Llama 3.1 8B figure
    assert any("rule of thumb" in w for w in p.warnings)


def test_head_dim_from_hidden_size_and_mha_without_kv_heads():
    # Llama 2 7B: 32 layers, 32 heads, hidden 4096 -> head dim 128, no GQA: 512 KiB per token
    kv, source = kv_bytes_per_token_for(
        model_params_b=7, layers=32, hidden_size=4096, attention_heads=32
    )
    assert (kv, source) == (2 * 32 * 32 * 128 * 2, "architecture")
    with pytest.raises(PlanError, match="head_dim"):
        kv_bytes_per_token_for(model_params_b=7, layers=32, kv_heads=8)


def test_fp8_kv_cache_holds_twice_the_tokens():
    common = dict(
        LLAMA_8B,
        gpu_memory_gb=80,
        context_tokens=8192,
        mean_prompt_tokens=1000,
        mean_output_tokens=200,
    )
    bf16 = plan(**common)
    fp8 = plan(**common, kv_dtype_bytes=1)
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token / 2
    assert fp8.kv_cache_tokens == 928_953  # 56.699 GiB / 64 KiB
    assert fp8.concurrent_seqs == 774
    assert fp8.suggested_max_num_seqs == 768


def test_shared_prefix_is_held_once():
    p = plan(
        **LLAMA_8B,
        gpu_memory_gb=80,
        context_tokens=8192,
        mean_prompt_tokens=1000,
        mean_output_tokens=200,
        shared_prefix_tokens=800,
    )
    # per request: 1000 - 800 + 200 = 400 tokens; (464,476 - 800) // 400 = 1,159 -> capped 1024
    assert p.tokens_per_request == 400
    assert p.concurrent_seqs == 1159
    assert p.suggested_max_num_seqs == 1024
    assert any("capped" in w for w in p.warnings)


def test_batched_tokens_grow_with_long_prompts_and_short_answers():
    p = plan(
        **LLAMA_8B,
        gpu_memory_gb=80,
        context_tokens=16384,
        mean_prompt_tokens=4000,
        mean_output_tokens=50,
        kv_bytes_per_token=131_072 * 4,  # force fewer sequences: 116,119 tokens
    )
    # 116,119 // 4,050 = 28 sequences -> 24; 24 x (1 + 80) = 1,944 -> floor 8192
    assert p.concurrent_seqs == 28
    assert p.suggested_max_num_seqs == 24
    assert p.suggested_max_num_batched_tokens == 8192
    q = plan(
        **LLAMA_8B,
        gpu_memory_gb=80,
        context_tokens=16384,
        mean_prompt_tokens=1000,
        mean_output_tokens=50,
    )
    # 464,476 // 1,050 = 442 -> 440; 440 x 21 = 9,240 -> next power of two 16,384
    assert q.suggested_max_num_seqs == 440
    assert q.suggested_max_num_batched_tokens == 16384


def test_errors_say_what_to_change():
    with pytest.raises(PlanError, match="no room for a KV cache.*tensor_parallel"):
        plan(
            model_params_b=70,
            gpu_memory_gb=80,
            context_tokens=8192,
            mean_prompt_tokens=500,
            mean_output_tokens=100,
        )
    with pytest.raises(PlanError, match="less than one request of context_tokens"):
        plan(
            **LLAMA_8B,
            gpu_memory_gb=24,
            gpu_memory_utilization=0.8,
            context_tokens=131072,
            mean_prompt_tokens=500,
            mean_output_tokens=100,
        )
    with pytest.raises(PlanError, match="gpu_memory_utilization"):
        plan(
            **LLAMA_8B,
            gpu_memory_gb=80,
            gpu_memory_utilization=1.5,
            context_tokens=8192,
            mean_prompt_tokens=1,
            mean_output_tokens=1,
        )


def test_price_table_path_and_missing_table(tmp_path: Path):
    table = tmp_path / "prices.csv"
    table.write_text(
        "provider,model,effective_date,input_usd_per_mtok,cached_input_usd_per_mtok,"
        "output_usd_per_mtok,batch_discount,source\n"
        "openai,m,2025-01-01,1.0,0.5,4.0,0.5,old\n"
        "openai,m,2026-01-01,2.0,1.0,8.0,0.5,new\n"
    )
    (only,) = load_api_prices(table, mean_prompt_tokens=300, mean_output_tokens=100)
    assert only.usd_per_mtok_output == pytest.approx((3 * 2.0 + 8.0) * 0.5)  # newest row
    assert load_api_prices(tmp_path / "none.csv", 1, 1) == []


def test_plan_command_prints_the_table_through_typer():
    app = typer.Typer()
    app.command("plan")(plan_command)
    app.command("other")(lambda: None)  # more than one command, as in lowtide's CLI
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "--model-params-b",
            "8",
            "--layers",
            "32",
            "--kv-heads",
            "8",
            "--head-dim",
            "128",
            "--gpu-hour-usd",
            "2.5",
            "--tokens-per-s",
            "2500",
        ],
        env={"COLUMNS": "160"},
    )
    assert result.exit_code == 0, result.output
    assert "--max-num-seqs" in result.output and "384" in result.output
    assert "0.278" in result.output and "gpt-4o-mini" in result.output
    failed = CliRunner().invoke(app, ["plan", "--model-params-b", "400"])
    assert failed.exit_code == 2
    assert "no room for a KV cache" in failed.output
