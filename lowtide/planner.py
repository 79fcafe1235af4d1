"""Capacity planner for a vLLM pool: how many sequences fit, what to set, and what it costs.

The memory rule is vLLM's own: the server takes `gpu_memory_utilization` of each GPU, loads the
weights, reserves room for activations, CUDA graphs and other non-KV allocations
(`overhead_gb`), and the rest becomes the KV cache. A request holds KV for its prompt and its
output, so

    concurrent sequences = (memory x utilization - weights - overhead) / KV per request

with KV per request = (mean prompt + mean output tokens) x KV bytes per token, counted at the
request's largest (its last token), and a prompt prefix shared by every request
(`shared_prefix_tokens`, with prefix caching on) held once rather than per request.

KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per KV element (2 for
fp16/bf16, 1 for an fp8 KV cache). Give `layers`, `kv_heads` and `head_dim` (or `hidden_size`
and `attention_heads`; `kv_heads` defaults to `attention_heads`, no grouped-query attention)
for an exact figure. Without them the planner uses a rule of thumb for current grouped-query
models (Llama 3, Qwen 2.5, Mistral: 8 KV heads of 128 dims) with layers = 16 x cbrt(params in
billions): 32 layers at 8B (exact for Llama 3.1 8B), 66 at 70B (80 real), 118 at 405B (126
real), so it slightly under-counts KV for the largest models. Models without grouped-query
attention (Llama 2) use 4x or more; pass their architecture.

Units: "GB" here is GiB (2^30 bytes), as vLLM's logs and nvidia-smi count; weights are params x
`bytes_per_param` (2 for bf16, 1 for fp8/int8, ~0.55 for 4-bit).

Suggestions:
- `max_num_seqs`: the sequences that fit, rounded down to a multiple of 8, at most 1024.
- `max_num_batched_tokens` (the per-step token budget): a step decodes one token for each of
  `max_num_seqs` sequences and, to keep that many running, prefills as many new prompts as
  finish, so it needs about max_num_seqs x (1 + prompt / output) tokens; suggested is the next
  power of two of that, at least 8192 (vLLM's default on large GPUs), at most 65536.
- Cost: at `gpu_hour_usd` per GPU and a measured throughput `tokens_per_s` (output tokens per
  second per server, e.g. `PoolStats.output_tokens_per_s` from a pilot run divided by the
  servers), the all-in cost per million output tokens is gpu_hour_usd x GPUs / 3600 /
  tokens_per_s x 1e6 (prompt processing is inside that time). The batch APIs' figure on the
  same basis is (prompt / output x input price + output price) x batch discount, from the
  price table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from lowtide.errors import PlanError

GIB = 2**30
DEFAULT_PRICES = Path(__file__).resolve().parents[1] / "data" / "prices.csv"
DEFAULT_OVERHEAD_GB = 2.0
MAX_SEQS_CAP = 1024
MIN_BATCHED_TOKENS = 8192
MAX_BATCHED_TOKENS = 65536
DEFAULT_TOKENS_PER_S = 2500.0
"""Output tokens per second of one server assumed when nothing measured is given (`lowtide
estimate` without `[pool] tokens_per_s`): the figure docs/vllm.md plans an 8B model on one 80 GB
GPU with. Measure yours with a pilot run (`PoolStats.output_tokens_per_s` / servers)."""


@dataclass(frozen=True)
class ApiPrice:
    provider: str
    model: str
    usd_per_mtok_output: float  # all-in: the prompt tokens that come with each output token


@dataclass(frozen=True)
class Plan:
    weights_gb: float  # per GPU (weights split over tensor_parallel GPUs)
    kv_budget_gb: float  # KV cache over all GPUs of one server
    kv_bytes_per_token: float
    kv_source: str  # "given", "architecture" or "rule of thumb"
    kv_cache_tokens: int  # tokens the KV cache holds
    tokens_per_request: float  # KV held per request at its largest
    concurrent_seqs: int  # the sequences that fit
    max_concurrency_at_context: float  # requests of context_tokens each that fit (vLLM's log line)
    suggested_max_num_seqs: int
    suggested_max_num_batched_tokens: int
    gpus: int
    gpu_usd_per_mtok_output: float | None
    api_prices: list[ApiPrice] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def rule_of_thumb_layers(model_params_b: float) -> int:
    return max(1, round(16 * model_params_b ** (1 / 3)))


def kv_bytes_per_token_for(
    *,
    model_params_b: float,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    hidden_size: int | None = None,
    attention_heads: int | None = None,
    kv_dtype_bytes: float = 2.0,
) -> tuple[float, str]:
    """KV bytes per token and where the figure came from ("architecture" or "rule of thumb")."""
    if layers is not None:
        if head_dim is None:
            if hidden_size is None or attention_heads is None:
                raise PlanError(
                    "with layers given, also give head_dim, or hidden_size and attention_heads"
                )
            head_dim = hidden_size // attention_heads
        heads = kv_heads if kv_heads is not None else attention_heads
        if heads is None:
            raise PlanError("with layers given, also give kv_heads (or attention_heads)")
        return 2.0 * layers * heads * head_dim * kv_dtype_bytes, "architecture"
    return 2.0 * rule_of_thumb_layers(model_params_b) * 8 * 128 * kv_dtype_bytes, "rule of thumb"


def _next_power_of_two(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1.0))))


def load_api_prices(
    table: str | Path | None, mean_prompt_tokens: float, mean_output_tokens: float
) -> list[ApiPrice]:
    """All-in batch price per million output tokens for every provider model in the table (the
    newest row of each; the emulator's rows are skipped)."""
    path = Path(table) if table is not None else DEFAULT_PRICES
    if not path.is_file():
        return []
    import polars as pl  # only here: every CLI command imports this module to register `plan`

    prices = pl.read_csv(path, schema_overrides={"effective_date": pl.String})
    latest = (
        prices.filter(pl.col("provider") != "emulator")
        .sort("effective_date")
        .group_by("provider", "model", maintain_order=True)
        .last()
    )
    ratio = mean_prompt_tokens / max(mean_output_tokens, 1e-9)
    out = []
    for r in latest.iter_rows(named=True):
        all_in = (ratio * r["input_usd_per_mtok"] + r["output_usd_per_mtok"]) * r["batch_discount"]
        out.append(ApiPrice(r["provider"], r["model"], all_in))
    return sorted(out, key=lambda p: p.usd_per_mtok_output)


def plan(
    *,
    model_params_b: float,
    gpu_memory_gb: float,
    context_tokens: int,
    mean_prompt_tokens: float,
    mean_output_tokens: float,
    gpu_memory_utilization: float = 0.92,
    bytes_per_param: float = 2.0,
    kv_bytes_per_token: float | None = None,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    hidden_size: int | None = None,
    attention_heads: int | None = None,
    kv_dtype_bytes: float = 2.0,
    overhead_gb: float = DEFAULT_OVERHEAD_GB,
    tensor_parallel: int = 1,
    shared_prefix_tokens: float = 0.0,
    gpu_hour_usd: float | None = None,
    tokens_per_s: float | None = None,
    price_table: str | Path | None = None,
) -> Plan:
    """Plan one vLLM server of `tensor_parallel` GPUs of `gpu_memory_gb` each (see the module
    docstring for every rule). Raises PlanError when the weights and overhead leave no KV cache
    or a single request of `context_tokens` does not fit (vLLM refuses to start then)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise PlanError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    for name, value in (
        ("model_params_b", model_params_b),
        ("gpu_memory_gb", gpu_memory_gb),
        ("context_tokens", context_tokens),
        ("mean_output_tokens", mean_output_tokens),
        ("tensor_parallel", tensor_parallel),
    ):
        if value <= 0:
            raise PlanError(f"{name} must be positive, got {value}")
    if mean_prompt_tokens < 0 or shared_prefix_tokens < 0:
        raise PlanError("mean_prompt_tokens and shared_prefix_tokens must not be negative")
    warnings: list[str] = []
    tp = tensor_parallel
    weights_gb = model_params_b * 1e9 * bytes_per_param / GIB / tp
    usable_gb = gpu_memory_gb * gpu_memory_utilization
    kv_per_gpu_gb = usable_gb - weights_gb - overhead_gb
    if kv_per_gpu_gb <= 0:
        raise PlanError(
            f"no room for a KV cache: {gpu_memory_gb:g} GB x {gpu_memory_utilization:g} = "
            f"{usable_gb:.1f} GB per GPU, weights {weights_gb:.1f} GB, overhead {overhead_gb:g} GB"
            "; use more GPUs (tensor_parallel), a smaller or quantized model (bytes_per_param), "
            "or a higher gpu_memory_utilization"
        )
    kv_budget_gb = kv_per_gpu_gb * tp
    if kv_bytes_per_token is not None:
        if kv_bytes_per_token <= 0:
            raise PlanError("kv_bytes_per_token must be positive")
        kv_bytes, source = float(kv_bytes_per_token), "given"
    else:
        kv_bytes, source = kv_bytes_per_token_for(
            model_params_b=model_params_b,
            layers=layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=hidden_size,
            attention_heads=attention_heads,
            kv_dtype_bytes=kv_dtype_bytes,
        )
    if source == "rule of thumb":
        warnings.append(
            "KV bytes per token from the rule of thumb (grouped-query attention, 8 KV heads of "
            "128 dims); give layers / kv_heads / head_dim for an exact figure"
        )
    kv_tokens = int(kv_budget_gb * GIB // kv_bytes)
    if kv_tokens < context_tokens:
        raise PlanError(
            f"the KV cache holds {kv_tokens} tokens, less than one request of context_tokens="
            f"{context_tokens} (vLLM refuses to start): lower max_model_len, raise "
            "gpu_memory_utilization, or add GPUs"
        )
    shared = min(shared_prefix_tokens, mean_prompt_tokens)
    per_request = mean_prompt_tokens - shared + mean_output_tokens
    if mean_prompt_tokens + mean_output_tokens > context_tokens:
        warnings.append(
            f"mean prompt + output ({mean_prompt_tokens + mean_output_tokens:g} tokens) exceeds "
            f"context_tokens={context_tokens}"
        )
    fits = int((kv_tokens - shared) // max(per_request, 1.0))
    if fits < 1:
        raise PlanError("not even one request of the mean size fits the KV cache")
    seqs = min(MAX_SEQS_CAP, max(8, fits // 8 * 8)) if fits >= 8 else fits
    if fits > MAX_SEQS_CAP:
        warnings.append(
            f"{fits} sequences fit; max_num_seqs is capped at {MAX_SEQS_CAP} (more rarely adds "
            "throughput: compute, not memory, is then the limit)"
        )
    per_step = seqs * (1 + mean_prompt_tokens / mean_output_tokens)
    batched = min(MAX_BATCHED_TOKENS, max(MIN_BATCHED_TOKENS, _next_power_of_two(per_step)))
    if per_step > MAX_BATCHED_TOKENS:
        warnings.append(
            f"keeping {seqs} sequences fed needs ~{per_step:.0f} prompt+decode tokens per step, "
            f"more than {MAX_BATCHED_TOKENS}: prefill will limit throughput before the slots do"
        )
    gpu_cost = None
    if gpu_hour_usd is not None and tokens_per_s:
        gpu_cost = gpu_hour_usd * tp / 3600.0 / tokens_per_s * 1e6
    return Plan(
        weights_gb=weights_gb,
        kv_budget_gb=kv_budget_gb,
        kv_bytes_per_token=kv_bytes,
        kv_source=source,
        kv_cache_tokens=kv_tokens,
        tokens_per_request=per_request,
        concurrent_seqs=fits,
        max_concurrency_at_context=kv_tokens / context_tokens,
        suggested_max_num_seqs=seqs,
        suggested_max_num_batched_tokens=batched,
        gpus=tp,
        gpu_usd_per_mtok_output=gpu_cost,
        api_prices=load_api_prices(price_table, mean_prompt_tokens, mean_output_tokens),
        warnings=warnings,
    )


def plan_command(
    model_params_b: Annotated[
        float, typer.Option("--model-params-b", help="Model size in billions of parameters.")
    ],
    gpu_memory_gb: Annotated[
        float, typer.Option("--gpu-memory-gb", help="Memory per GPU, GiB.")
    ] = 80.0,
    context_tokens: Annotated[
        int, typer.Option("--context-tokens", help="max_model_len the servers run with.")
    ] = 8192,
    mean_prompt_tokens: Annotated[
        float, typer.Option("--mean-prompt-tokens", help="The job's mean prompt tokens.")
    ] = 1000.0,
    mean_output_tokens: Annotated[
        float, typer.Option("--mean-output-tokens", help="The job's mean output tokens.")
    ] = 200.0,
    gpu_memory_utilization: Annotated[
        float, typer.Option("--gpu-memory-utilization", help="vLLM's --gpu-memory-utilization.")
    ] = 0.92,
    bytes_per_param: Annotated[
        float, typer.Option("--bytes-per-param", help="2 bf16, 1 fp8/int8, ~0.55 4-bit.")
    ] = 2.0,
    kv_bytes_per_token: Annotated[
        float | None,
        typer.Option("--kv-bytes-per-token", help="Exact KV bytes per token, if known."),
    ] = None,
    layers: Annotated[int | None, typer.Option("--layers", help="Transformer layers.")] = None,
    kv_heads: Annotated[int | None, typer.Option("--kv-heads", help="KV heads (GQA).")] = None,
    head_dim: Annotated[int | None, typer.Option("--head-dim", help="Dimensions per head.")] = None,
    kv_dtype_bytes: Annotated[
        float, typer.Option("--kv-dtype-bytes", help="2 for a bf16 KV cache, 1 for fp8.")
    ] = 2.0,
    overhead_gb: Annotated[
        float,
        typer.Option("--overhead-gb", help="Activations, CUDA graphs, other non-KV memory, GiB."),
    ] = DEFAULT_OVERHEAD_GB,
    tensor_parallel: Annotated[
        int, typer.Option("--tensor-parallel", help="GPUs per server (--tensor-parallel-size).")
    ] = 1,
    shared_prefix_tokens: Annotated[
        float, typer.Option("--shared-prefix-tokens", help="Prompt prefix every request shares.")
    ] = 0.0,
    gpu_hour_usd: Annotated[
        float | None, typer.Option("--gpu-hour-usd", help="Price of one GPU-hour.")
    ] = None,
    tokens_per_s: Annotated[
        float | None,
        typer.Option("--tokens-per-s", help="Measured output tokens/s of one server (pilot run)."),
    ] = None,
    price_table: Annotated[
        Path | None, typer.Option("--price-table", help="Price CSV (default data/prices.csv).")
    ] = None,
) -> None:
    """Estimate how many sequences fit a vLLM server, suggest its settings, and compare the
    cost per million output tokens with the batch APIs."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    try:
        p = plan(
            model_params_b=model_params_b,
            gpu_memory_gb=gpu_memory_gb,
            context_tokens=context_tokens,
            mean_prompt_tokens=mean_prompt_tokens,
            mean_output_tokens=mean_output_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
            bytes_per_param=bytes_per_param,
            kv_bytes_per_token=kv_bytes_per_token,
            layers=layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            kv_dtype_bytes=kv_dtype_bytes,
            overhead_gb=overhead_gb,
            tensor_parallel=tensor_parallel,
            shared_prefix_tokens=shared_prefix_tokens,
            gpu_hour_usd=gpu_hour_usd,
            tokens_per_s=tokens_per_s,
            price_table=price_table,
        )
    except PlanError as exc:
        from lowtide import render

        raise typer.Exit(render.error(exc)) from exc  # one line on stderr, exit 2
    table = Table(
        title=f"vLLM server: {model_params_b:g}B on {tensor_parallel} x {gpu_memory_gb:g} GiB"
    )
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [
        ("weights per GPU", f"{p.weights_gb:.1f} GiB"),
        ("KV cache (all GPUs)", f"{p.kv_budget_gb:.1f} GiB"),
        ("KV per token", f"{p.kv_bytes_per_token / 1024:.0f} KiB ({p.kv_source})"),
        ("KV cache holds", f"{p.kv_cache_tokens:,} tokens"),
        ("KV per request", f"{p.tokens_per_request:,.0f} tokens"),
        ("concurrent sequences that fit", f"{p.concurrent_seqs:,}"),
        (f"requests of {context_tokens} tokens that fit", f"{p.max_concurrency_at_context:.1f}"),
        ("--max-num-seqs", str(p.suggested_max_num_seqs)),
        ("--max-num-batched-tokens", str(p.suggested_max_num_batched_tokens)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    costs = Table(title="All-in USD per million output tokens (prompt tokens included)")
    costs.add_column("engine")
    costs.add_column("USD / M output tokens", justify="right")
    if p.gpu_usd_per_mtok_output is not None:
        costs.add_row(
            f"vLLM at ${gpu_hour_usd:g}/GPU-h, {tokens_per_s:g} tok/s",
            f"{p.gpu_usd_per_mtok_output:.3f}",
        )
    else:
        costs.add_row("vLLM", "give --gpu-hour-usd and --tokens-per-s")
    for api in p.api_prices:
        costs.add_row(f"{api.provider} {api.model} (batch)", f"{api.usd_per_mtok_output:.3f}")
    console.print(costs)
    for warning in p.warnings:
        console.print(f"[yellow]note:[/] {warning}")
