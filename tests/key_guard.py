"""A provider that wants one key: an ASGI wrapper around the emulator's app that answers every
provider call (`/v1/...`) without exactly that key as a real provider answers a wrong one
(401, or 403), optionally echoing the key it was sent, as some providers' messages do."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class RequireKey:
    """Serve `app` only to calls carrying `key`; `accepted` and `refused` count the calls.
    `status` is the refusal's HTTP status; with `echo`, its message quotes the key sent."""

    def __init__(self, app: Any, key: str, status: int = 401, echo: bool = False) -> None:
        self.app = app
        self.key = key.encode()
        self.status = status
        self.echo = echo
        self.accepted = 0
        self.refused = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            sent = headers.get(b"x-api-key") or _bearer(headers) or b""
            if sent != self.key:
                self.refused += 1
                said = f": {sent.decode(errors='replace')}" if self.echo else ""
                body = {"error": {"message": f"Incorrect API key provided{said}", "type": "auth"}}
                await send(
                    {
                        "type": "http.response.start",
                        "status": self.status,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send({"type": "http.response.body", "body": json.dumps(body).encode()})
                return
            self.accepted += 1
        await self.app(scope, receive, send)


def _bearer(headers: dict[bytes, bytes]) -> bytes | None:
    value = headers.get(b"authorization", b"")
    return value[7:] if value.lower().startswith(b"bearer ") else None
