"""Several control-plane URLs for one pool: which to call now, and when to move to the next.

One policy for every caller (the CLI and SDK's `PoolClient`, the benchmarks' `AioApi`, the node
agent's `AgentApi`): stick to the URL that last answered; move on when one refuses the connection
or answers 503, and come back to a URL that said Retry-After only once that time has passed. The
callers decide what may be sent again (see `may_resend`): a request the server may already have
acted on goes to no second server unless it carries an idempotency key the server honours.
"""

from __future__ import annotations

import email.utils
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime

from computepool.core.errors import InvalidInput

#: a server setting as the user gives it: one URL, a comma-separated list, or repeated flags
ServerArg = str | Sequence[str] | None
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
IDEMPOTENCY_HEADER = "Idempotency-Key"
MAX_RETRY_WAIT_S = 10.0


def normalise_server(server: str) -> str:
    """Accept `host:port` as well as a URL; refuse anything that is not http(s)."""
    s = server.strip().rstrip("/")
    if "://" not in s:
        s = f"http://{s}"
    if not s.startswith(("http://", "https://")) or len(s.split("://", 1)[1]) == 0:
        raise InvalidInput("server", f"expected an http:// or https:// URL, got {server!r}")
    return s


def split_servers(value: ServerArg) -> tuple[str, ...]:
    """`https://a,https://b`, or ["https://a", "https://b,https://c"] → each URL once, in order."""
    if value is None:
        return ()
    parts = [value] if isinstance(value, str) else list(value)
    out: list[str] = []
    for part in parts:
        for item in part.split(","):
            if item.strip():
                url = normalise_server(item)
                if url not in out:
                    out.append(url)
    return tuple(out)


def join_servers(urls: Iterable[str]) -> str:
    """The list as one `CPOOL_SERVER` value."""
    return ",".join(urls)


def retry_after(value: str | None, attempt: int) -> float:
    """Seconds a 503 or 429 asks to wait: its Retry-After (seconds or an HTTP date), else a backoff
    by `attempt`; bounded (at least 50 ms, at most 10 s)."""
    text = (value or "").strip()
    wait: float | None = None
    if text:
        try:
            wait = float(text)
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(text)
            except (TypeError, ValueError):
                when = None
            if when is not None:
                wait = (when - datetime.now(when.tzinfo)).total_seconds()
    if wait is None:
        wait = 0.5 * 2**attempt
    return min(max(wait, 0.05), MAX_RETRY_WAIT_S)


def may_resend(method: str, headers: dict[str, str] | None, sent: bool) -> bool:
    """Whether a request whose first try failed may go again (to this or another server).

    Not sent at all (the connection was refused or never opened): always. Sent but unanswered: only
    methods that mean the same done twice, or a POST with an Idempotency-Key (the server answers a
    repeated key with the first result instead of acting again)."""
    if not sent:
        return True
    return method.upper() in SAFE_METHODS or IDEMPOTENCY_HEADER in (headers or {})


class ServerList:
    """The URLs of one pool's control plane and which one is in use. Thread-safe."""

    def __init__(self, urls: Sequence[str], clock: Callable[[], float] = time.monotonic) -> None:
        if not urls:
            raise InvalidInput("server", "no control plane URL given")
        self._urls = list(urls)
        self._given = len(self._urls)  # the first URLs: given by the user, never forgotten
        self._current = 0
        self._not_before: dict[str, float] = {}
        self._clock = clock
        self._lock = threading.Lock()

    @property
    def urls(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._urls)

    @property
    def current(self) -> str:
        with self._lock:
            return self._urls[self._current]

    def __len__(self) -> int:
        with self._lock:
            return len(self._urls)

    def describe(self) -> str:
        """For messages: the one URL, or all of them."""
        urls = self.urls
        return urls[0] if len(urls) == 1 else " and ".join([", ".join(urls[:-1]), urls[-1]])

    def worked(self, url: str) -> None:
        """`url` answered: stay with it."""
        with self._lock:
            self._not_before.pop(url, None)
            if url in self._urls:
                self._current = self._urls.index(url)

    def failed(self, url: str, retry_after_s: float = 0.0) -> None:
        """`url` gave no useful answer: the next call starts at the next URL; with `retry_after_s`
        (a 503's Retry-After) `url` is skipped until then while another URL can be tried."""
        with self._lock:
            if retry_after_s > 0:
                self._not_before[url] = self._clock() + retry_after_s
            if url in self._urls and self._urls[self._current] == url:
                self._current = (self._current + 1) % len(self._urls)

    def order(self) -> list[str]:
        """Every URL once, in the order to try them: the current one first, those still inside a
        Retry-After last."""
        with self._lock:
            now = self._clock()
            n = len(self._urls)
            ring = [self._urls[(self._current + i) % n] for i in range(n)]
            ready = [u for u in ring if self._not_before.get(u, 0.0) <= now]
            return ready + [u for u in ring if u not in ready]

    def wait_s(self, url: str) -> float:
        """Seconds until `url`'s Retry-After has passed (0: callable now)."""
        with self._lock:
            return max(0.0, self._not_before.get(url, 0.0) - self._clock())

    def learn(self, urls: Iterable[str]) -> bool:
        """The replicas the control plane names now: the URLs given at the start stay first and are
        never dropped; learnt ones replace those learnt before. Where a given URL is https, a learnt
        http one is ignored (no downgrade). True if the list changed."""
        with self._lock:
            given = self._urls[: self._given]
            https = any(u.startswith("https://") for u in given)
            learnt: list[str] = []
            for u in urls:
                try:
                    url = normalise_server(u)
                except InvalidInput:
                    continue  # a replica's bad advertisement is no reason to stop
                if url not in given and url not in learnt and (url.startswith("https://") or not https):
                    learnt.append(url)
            new = given + learnt
            if new == self._urls:
                return False
            current = self._urls[self._current]
            self._urls = new
            self._current = new.index(current) if current in new else 0
            return True
