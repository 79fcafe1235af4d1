"""What a run left at the emulated provider, asked as a user would: through the official SDKs
over HTTP. After a provider scenario, nothing of its runs should be left there unless the job
keeps it (`[provider] keep_files`)."""

from __future__ import annotations

from typing import Any

from tests.sql import query


def left_at_emulator(base_url: str, state: Any, run_id: str | None = None) -> list[str]:
    """Ids of what the emulator at `base_url` still keeps of the run's batches (every run's in
    `state` when `run_id` is None): OpenAI files recorded for them, named `<batch_id>.jsonl`, or
    written by an OpenAI batch tagged with their id, and Anthropic batches recorded for them."""
    import anthropic
    import openai

    batches = query(
        state,
        "SELECT batch_id, provider_batch_id, input_file_id, output_file_id, error_file_id "
        "FROM batches WHERE ? IS NULL OR run_id = ?",
        [run_id, run_id],
    )
    ours = set(batches["batch_id"].to_list())
    file_ids = {
        fid
        for column in ("input_file_id", "output_file_id", "error_file_id")
        for fid in batches[column].to_list()
        if fid
    }
    names = {f"{batch_id}.jsonl" for batch_id in ours}
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x")
    for b in client.batches.list(limit=100):
        if (b.metadata or {}).get("lowtide_batch_id") in ours:
            file_ids |= {f for f in (b.input_file_id, b.output_file_id, b.error_file_id) if f}
    files = [f.id for f in client.files.list() if f.id in file_ids or f.filename in names]
    message_batches = set(batches["provider_batch_id"].drop_nulls().to_list())
    anthropic_client = anthropic.Anthropic(base_url=base_url, api_key="x")
    kept = [b.id for b in anthropic_client.messages.batches.list(limit=100)]
    return sorted(files + [b for b in kept if b in message_batches])


def assert_nothing_left(base_url: str, state: Any, run_id: str | None = None) -> None:
    """Nothing of the run (every run, when None) is left at the emulator at `base_url`."""
    left = left_at_emulator(base_url, state, run_id)
    assert not left, f"left at the provider after the run: {left}"
