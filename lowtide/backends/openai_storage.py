"""What lowtide keeps in an OpenAI organisation's file storage, found and deleted.

Every batch leaves up to three files: the uploaded input (named `<batch_id>.jsonl` by lowtide),
and the output and error files OpenAI writes. Batches themselves cannot be deleted (they hold
no data of their own) but carry lowtide's batch id in their metadata, which is how a file
whose id a crash kept from the state file is still found. Files of other users and other jobs
are never touched: only ids recorded for, named after or written by the given batches count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import openai
from openai.types import FileObject

from lowtide.backends.base import BatchRefs, ItemRole, ProviderItem

EXPIRES_AFTER_S = 7 * 86_400
"""The backstop on every upload and every batch's output and error files, should lowtide's own
delete never come (a failed call, a run abandoned mid-way): a week. A batch needs its input for
at most its 24 h window after the create (an input gone before its create is simply uploaded
again, `submit_batch`), and its results until `collect` downloads them, which a schedule every
few minutes does within the hour; a week leaves room for a weekend with collect down while
keeping data a quarter as long as OpenAI's default of 30 days. OpenAI accepts 1 h to 30 days."""


def expiry(seconds: int = EXPIRES_AFTER_S) -> dict[str, object]:
    """The `expires_after` / `output_expires_after` value for `seconds` after creation."""
    return {"anchor": "created_at", "seconds": seconds}


def kept_files(client: openai.OpenAI, batch: BatchRefs) -> list[ProviderItem]:
    """The batch's recorded files that OpenAI still keeps, with their sizes."""
    items = []
    for role, file_id in batch.file_ids():
        found = _retrieve(client, file_id)
        if found is not None:
            items.append(ProviderItem(file_id, role, batch.batch_id, found.bytes))
    return items


def _retrieve(client: openai.OpenAI, file_id: str) -> FileObject | None:
    try:
        return client.files.retrieve(file_id)
    except openai.NotFoundError:
        return None


def delete_file(client: openai.OpenAI, file_id: str) -> None:
    """Delete the file; one already gone (expired, deleted by hand) counts as deleted."""
    try:
        client.files.delete(file_id)
    except openai.NotFoundError:
        return


def tagged_files(
    client: openai.OpenAI,
    batches: Sequence[BatchRefs],
    since: float,
    metadata_key: str,
    ended: Callable[[str], bool],
) -> list[ProviderItem]:
    """Every file OpenAI keeps of these batches: recorded in the state file, named
    `<batch_id>.jsonl`, or named by an OpenAI batch tagged (`metadata_key`) with one of their
    ids. A file of a batch OpenAI still works on (`ended` says of its status) is `busy`. Lists
    (newest first) back to `since` only."""
    owner: dict[str, tuple[str, ItemRole]] = {
        fid: (b.batch_id, role) for b in batches for role, fid in b.file_ids()
    }
    wanted = {b.batch_id for b in batches}
    busy: set[str] = set()
    for found in client.batches.list(limit=100):
        if found.created_at < since:
            break
        batch_id = (found.metadata or {}).get(metadata_key)
        if batch_id not in wanted:
            continue
        files = (
            (ItemRole.INPUT, found.input_file_id),
            (ItemRole.OUTPUT, found.output_file_id),
            (ItemRole.ERROR, found.error_file_id),
        )
        for role, fid in files:
            if fid:
                owner.setdefault(fid, (batch_id, role))
                if not ended(found.status):
                    busy.add(fid)
    named = {f"{batch_id}.jsonl": batch_id for batch_id in wanted}
    items = []
    for f in client.files.list(order="desc"):
        if f.created_at < since:
            break
        hit = owner.get(f.id)
        if hit is None and f.filename in named:
            hit = (named[f.filename], ItemRole.INPUT)
        if hit is not None:
            items.append(ProviderItem(f.id, hit[1], hit[0], f.bytes, busy=f.id in busy))
    return items
