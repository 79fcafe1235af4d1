"""OpenAI Files: upload, list, retrieve, delete and download, as the official SDK sees them.

Files live in the emulator's state until deleted or past their `expires_at` on the simulated
clock; a batch input upload gets `file_retention_s` unless it asks for its own expiry. The
batch modules reuse `store_file` to write their output and error files and
`parse_expires_after` to read `output_expires_after`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.responses import Response

from lowtide.emulator.faults import ApiError
from lowtide.emulator.routes_common import emulator_state, json_response, openai_page

if TYPE_CHECKING:
    from lowtide.emulator.app import EmulatorState

router = APIRouter()

UPLOAD_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
_EXPIRY_BOUNDS = (3600, 2_592_000)


@dataclass
class StoredFile:
    id: str
    filename: str
    purpose: str
    content: bytes
    created_at: int
    expires_at: int | None
    seq: int
    deleted: bool = False

    def alive(self, now: float) -> bool:
        return not self.deleted and (self.expires_at is None or now < self.expires_at)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": len(self.content),
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


@router.post("/files")
async def create_file(request: Request) -> Response:
    state = emulator_state(request)
    length = int(request.headers.get("content-length") or 0)
    if length > state.config.max_upload_bytes + 64 * 1024:
        raise _too_large(state.config.max_upload_bytes)
    form = await request.form()
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise ApiError(400, "Missing required parameter: 'file'.", param="file")
    content = await upload.read()
    fields = {k: v for k, v in form.items() if isinstance(v, str)}
    return await run_in_threadpool(
        _create_file, state, content, upload.filename or "upload.jsonl", fields
    )


def _too_large(limit: int) -> ApiError:
    return ApiError(
        400, f"File is too large. The maximum size is {limit} bytes.", code="file_too_large"
    )


def _create_file(
    state: EmulatorState, content: bytes, filename: str, fields: dict[str, str]
) -> Response:
    purpose = fields.get("purpose")
    if purpose is None:
        raise ApiError(400, "Missing required parameter: 'purpose'.", param="purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise ApiError(
            400,
            f"Invalid value for 'purpose': {purpose!r}; expected one of {', '.join(UPLOAD_PURPOSES)}.",
            param="purpose",
            code="invalid_value",
        )
    if len(content) > state.config.max_upload_bytes:
        raise _too_large(state.config.max_upload_bytes)
    expires_s = parse_expires_after(
        fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]"), "expires_after"
    )
    with state.lock:
        now = state.tick()
        _check_storage(state, now, len(content))
        if expires_s is None and purpose == "batch":
            expires_s = state.config.file_retention_s
        stored = store_file(state, content, filename, purpose, now, expires_s)
        return json_response(stored.to_json())


def _check_storage(state: EmulatorState, now: float, size: int) -> None:
    """ApiError(400) when an upload of `size` bytes would take the live (unexpired, undeleted)
    files past `file_storage_limit_bytes`. Batch output files count; they are never refused.

    provider-apis.md gives the limit (2.5 TB per project) but not the refusal; the status,
    type and null code follow a user's report of the real 400 (bespokelabsai/curator#189),
    the message is ours."""
    limit = state.config.file_storage_limit_bytes
    if limit is None:
        return
    stored = sum(len(f.content) for f in state.files.values() if f.alive(now))
    if stored + size > limit:
        raise ApiError(
            400,
            f"File storage limit reached: the organization keeps {stored} bytes of files and "
            f"this upload of {size} bytes would pass its limit of {limit} bytes. Delete files "
            "you no longer need (or let them expire) and try again.",
        )


def parse_expires_after(anchor: Any, seconds: Any, param: str) -> float | None:
    """Seconds until expiry from an `expires_after`-style pair (None when both are absent);
    ApiError(400) names `param` when the anchor is not `created_at` or the seconds are out of
    range."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise ApiError(
            400, f"Invalid '{param}.anchor': only 'created_at' is supported.", param=param
        )
    try:
        value = int(seconds)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"Invalid '{param}.seconds': {seconds!r}.", param=param) from exc
    low, high = _EXPIRY_BOUNDS
    if not low <= value <= high:
        raise ApiError(400, f"'{param}.seconds' must be between {low} and {high}.", param=param)
    return float(value)


def store_file(
    state: EmulatorState,
    content: bytes,
    filename: str,
    purpose: str,
    created: float,
    expires_s: float | None,
) -> StoredFile:
    """Add a file to the state, created at simulated time `created`; it expires `expires_s`
    later, or never when that is None."""
    stored = StoredFile(
        id=state.new_id("file-"),
        filename=filename,
        purpose=purpose,
        content=content,
        created_at=int(created),
        expires_at=None if expires_s is None else int(created + expires_s),
        seq=state.next_seq(),
    )
    state.files[stored.id] = stored
    return stored


def _live_file(state: EmulatorState, file_id: str, now: float) -> StoredFile:
    stored = state.files.get(file_id)
    if stored is None or not stored.alive(now):
        raise ApiError(404, f"No such File object: {file_id}", param="id")
    return stored


@router.get("/files")
def list_files(
    request: Request,
    purpose: str | None = None,
    limit: int = 10_000,
    order: str = "desc",
    after: str | None = None,
) -> Response:
    state = emulator_state(request)
    if not 1 <= limit <= 10_000:
        raise ApiError(400, "'limit' must be between 1 and 10000.", param="limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, "'order' must be 'asc' or 'desc'.", param="order")
    with state.lock:
        now = state.tick()
        files = sorted(
            (f for f in state.files.values() if f.alive(now)),
            key=lambda f: f.seq,
            reverse=order == "desc",
        )
        if purpose is not None:
            files = [f for f in files if f.purpose == purpose]
        return json_response(openai_page([f.to_json() for f in files], after, limit))


@router.get("/files/{file_id}")
def retrieve_file(request: Request, file_id: str) -> Response:
    state = emulator_state(request)
    with state.lock:
        now = state.tick()
        return json_response(_live_file(state, file_id, now).to_json())


@router.delete("/files/{file_id}")
def delete_file(request: Request, file_id: str) -> Response:
    state = emulator_state(request)
    with state.lock:
        now = state.tick()
        stored = _live_file(state, file_id, now)
        stored.deleted = True
        return json_response({"id": stored.id, "object": "file", "deleted": True})


@router.get("/files/{file_id}/content")
def file_content(request: Request, file_id: str) -> Response:
    state = emulator_state(request)
    with state.lock:
        now = state.tick()
        content = _live_file(state, file_id, now).content
    # Raw bytes whatever the Accept header says (the SDK asks for application/binary).
    return Response(content, media_type="application/octet-stream")
