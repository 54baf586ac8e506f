"""Usage counting: requests, failures and tokens per (tenant, user, token, service, hour).

Counts gather in memory and are added to `gateway_usage` every couple of seconds as increments,
so gateways never overwrite each other. Tokens come from the engine's `usage` object; a stream
without one counts its chunks that carry text as completion tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from computepool.store.gateway import UsageCount, UsageKey

MAX_LINE = 1 << 20  # an SSE line longer than this is not parsed (its bytes still pass through)
MAX_TOKENS = 10**8  # one answer's count above this is taken as this (the engine is the tenant's own)
MAX_SUM = 10**15  # a count gathered in memory stops here (far inside the database's 64-bit columns)


@dataclass(frozen=True)
class Tokens:
    prompt: int = 0
    completion: int = 0


def _int(value: Any) -> int:
    """A token count from an engine's answer, bounded: not a whole number or negative → 0."""
    if not isinstance(value, int) or isinstance(value, bool):
        return 0
    return min(max(value, 0), MAX_TOKENS)


def tokens_of(usage: Any) -> Tokens:
    if not isinstance(usage, dict):
        return Tokens()
    return Tokens(_int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")))


def tokens_in_body(body: bytes) -> Tokens:
    """The `usage` of a JSON answer (zero when there is none or it is not JSON)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to parse
        return Tokens()
    return tokens_of(obj.get("usage")) if isinstance(obj, dict) else Tokens()


def _has_text(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict) and delta.get("content"):
        return True
    return bool(choice.get("text"))


class StreamUsage:
    """Reads the `data:` lines of an SSE stream as its bytes pass."""

    def __init__(self) -> None:
        self._buf = b""
        self.usage: Tokens | None = None
        self.content_chunks = 0

    def feed(self, data: bytes) -> None:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        if len(self._buf) > MAX_LINE:
            self._buf = b""
        for line in lines:
            self._line(line.rstrip(b"\r"))

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]" or len(payload) > MAX_LINE:
            return
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError):
            return
        if not isinstance(obj, dict):
            return
        if isinstance(obj.get("usage"), dict):
            self.usage = tokens_of(obj["usage"])
        choices = obj.get("choices")
        if isinstance(choices, list) and any(_has_text(c) for c in choices):
            self.content_chunks += 1

    def tokens(self) -> Tokens:
        if self._buf:
            self._line(self._buf.rstrip(b"\r"))
            self._buf = b""
        if self.usage is not None:
            return self.usage
        return Tokens(0, self.content_chunks)


class UsageBook:
    """Counts since the last flush."""

    def __init__(self) -> None:
        self._counts: dict[UsageKey, UsageCount] = {}

    def record(
        self, tenant_id: int, user: str, token_id: str, service: str, failed: bool, tokens: Tokens
    ) -> None:
        hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        key = (tenant_id, user, token_id, service, hour)
        c = self._counts.get(key)
        if c is None:
            c = self._counts[key] = UsageCount()
        _add(c, UsageCount(1, int(failed), _int(tokens.prompt), _int(tokens.completion)))

    def take(self) -> dict[UsageKey, UsageCount]:
        counts, self._counts = self._counts, {}
        return counts

    def put_back(self, counts: dict[UsageKey, UsageCount]) -> None:
        """A flush that failed: its counts go out with the next one."""
        for key, c in counts.items():
            _add(self._counts.setdefault(key, UsageCount()), c)


def _add(to: UsageCount, c: UsageCount) -> None:
    to.requests = min(to.requests + c.requests, MAX_SUM)
    to.failed = min(to.failed + c.failed, MAX_SUM)
    to.prompt_tokens = min(to.prompt_tokens + c.prompt_tokens, MAX_SUM)
    to.completion_tokens = min(to.completion_tokens + c.completion_tokens, MAX_SUM)
