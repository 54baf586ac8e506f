"""The async HTTP calls the benchmarks make, on aiohttp.

The benchmarks drive hundreds of concurrent requests from the same small machine as the
server; httpx's async client spent a whole core on ~250 requests/s there, so the load it
generated measured the client, not the server. aiohttp's client costs several times less per
request. Errors are the same as `PoolClient`'s: `PoolError` for an HTTP error answer,
`ServerUnreachable` for no answer; several URLs are used as `PoolClient` uses them
(core/servers.py: on to the next on a refused connection or a 503, never resending what may have
been carried out unless it is safe to repeat).
"""

from __future__ import annotations

import json as jsonlib
import os
import ssl
from pathlib import Path
from typing import Any

import aiohttp

from computepool.client.config import ENV_CA
from computepool.client.errors import ServerUnreachable
from computepool.client.http import API, error_from_parts
from computepool.core.servers import ServerList, may_resend, retry_after, split_servers
from computepool.core.tls import client_context, describe_tls_failure


class AioApi:
    """One aiohttp session against `server` with a bearer token; `call` returns parsed JSON."""

    def __init__(
        self, server: str, token: str, connections: int, timeout_s: float, ca: str | None = None
    ) -> None:
        """`server`: a URL or several, comma-separated; `ca`: the PEM file an https server's
        certificate must chain to (default: $CPOOL_CA)."""
        self.servers = ServerList(split_servers(server))
        self.timeout_s = timeout_s
        ca = ca or os.environ.get(ENV_CA)
        self._ssl: ssl.SSLContext | bool = client_context(Path(ca)) if ca else True
        self._headers = {"Authorization": f"Bearer {token}", "User-Agent": "cpool-bench"}
        self._connections = connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AioApi:
        self._session = aiohttp.ClientSession(
            headers=self._headers,
            connector=aiohttp.TCPConnector(
                limit=self._connections, limit_per_host=self._connections, ssl=self._ssl
            ),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(
        self,
        method: str,
        path: str,
        json: object = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        assert self._session is not None, "use `async with AioApi(...)`"
        tried: list[str] = []
        for base in self.servers.order():
            if self.servers.wait_s(base) > 0 and tried:
                continue  # inside its Retry-After, and another was tried
            try:
                async with self._session.request(
                    method, base + API + path, json=json, headers=headers, params=params
                ) as r:
                    text = await r.text()
                    if r.status == 503 and len(self.servers) > 1:
                        self.servers.failed(base, retry_after(r.headers.get("Retry-After"), 0))
                        tried.append(f"{base}: HTTP 503")
                        continue
                    if r.status >= 400:
                        raise error_from_parts(r.status, r.reason, text)
            except TimeoutError:
                self.servers.failed(base)
                raise ServerUnreachable(base, f"no answer within {self.timeout_s:g} s") from None
            except aiohttp.ClientConnectionError as e:
                self.servers.failed(base)
                tls = describe_tls_failure(e)
                if tls is not None:
                    raise ServerUnreachable(base, tls, tls=True) from None
                cause = f"connection failed: {e}" if str(e) else "connection refused"
                unsent = isinstance(e, aiohttp.ClientConnectorError)  # no connection: nothing went out
                if may_resend(method, headers, sent=not unsent):
                    tried.append(f"{base}: {cause}")
                    continue
                raise ServerUnreachable(base, cause) from None
            self.servers.worked(base)
            return jsonlib.loads(text) if text else None
        raise ServerUnreachable(self.servers.describe(), "; ".join(tried) or "no server to try")

    @property
    def server(self) -> str:
        """The URL in use now."""
        return self.servers.current
