"""The request-body cap, at the ASGI level: oversized bodies are refused before anything parses them."""

from __future__ import annotations

import json

from starlette.types import Message, Receive, Scope, Send

from computepool.server.errors import error_body


async def capped_receive(scope: Scope, receive: Receive, limit: int) -> Receive | None:
    """`receive` for a body within `limit` bytes; None when it is larger (answer 413 unread).

    A declared Content-Length is judged from the header alone. A chunked body (no length) is read
    here, up to the limit, and replayed to the app: nothing oversized is ever parsed or kept whole.
    """
    length: bytes | None = None
    chunked = False
    for k, v in scope["headers"]:
        if k == b"content-length":
            length = v
        elif k == b"transfer-encoding":
            chunked = b"chunked" in v.lower()
    if length is not None:
        return receive if not length.strip().isdigit() or int(length) <= limit else None
    if not chunked:
        return receive
    held: list[Message] = []
    size = 0
    while True:
        message = await receive()
        held.append(message)
        if message["type"] != "http.request":
            break
        size += len(message.get("body", b""))
        if size > limit:
            return None
        if not message.get("more_body", False):
            break

    async def replay() -> Message:
        return held.pop(0) if held else await receive()

    return replay


async def too_large(send: Send, limit: int) -> None:
    body = json.dumps(
        error_body(f"request body too large: more than {limit} bytes (the server's --max-body-bytes)", "body")
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
