"""Bringing a replica's answer back: a whole body read within a size limit, or a stream relayed.

A stream holds a place on its replica and an open upstream response until it ends. Its cleanup
(free the place, close the response, count the usage) is idempotent and runs from two sides: the
relay's own `finally` and the response object's (`GuardedStream` in the router), because a
response whose body never starts (the caller gone before it) never runs the generator at all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import anyio
import httpx

from computepool.server.gateway.usage import StreamUsage, Tokens

MAX_ANSWER_BYTES = 64 << 20  # a non-streamed answer larger than this is refused (502)
STREAM_BROKEN = (
    b'\n\ndata: {"error": {"message": "the replica failed mid-answer: its connection broke", '
    b'"type": "server_error", "code": "replica_error"}}\n\n'
)


class AnswerTooLarge(Exception):
    """The replica's non-streamed answer passed the gateway's limit."""


async def read_capped(response: httpx.Response, limit: int) -> bytes:
    """The whole (decoded) body, refusing it as soon as it passes `limit` bytes."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise AnswerTooLarge()
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limit:
            raise AnswerTooLarge()
    return bytes(body)


async def close_shielded(response: httpx.Response) -> None:
    """Close the upstream response even inside a cancelled task (the caller went away)."""
    with anyio.CancelScope(shield=True):
        await response.aclose()


class Relay:
    """One streamed answer: its chunks as they come, and a cleanup that runs exactly once."""

    def __init__(
        self,
        response: httpx.Response,
        release: Callable[[], None],
        record: Callable[[bool, Tokens], None],
    ) -> None:
        self.response = response
        self._release, self._record = release, record
        self._seen = StreamUsage()
        self._failed = response.status_code >= 500
        self._closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """The upstream stream, chunk by chunk, counting tokens from its data lines."""
        try:
            async for chunk in self.response.aiter_raw():
                self._seen.feed(chunk)
                yield chunk
        except httpx.HTTPError:
            # the status line (200) has gone out: the client learns of the failure from an error
            # event in OpenAI's shape, never from a stream that merely stops
            self._failed = True
            yield STREAM_BROKEN
        finally:
            await self.close()

    async def close(self) -> None:
        """Free the replica's place, count the request, close the upstream response; once."""
        if self._closed:
            return
        self._closed = True
        try:
            self._release()
            self._record(self._failed, self._seen.tokens())
        finally:
            await close_shielded(self.response)
