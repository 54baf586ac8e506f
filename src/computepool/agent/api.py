"""The agent's side of the control-plane HTTP API: join, heartbeat, assignments, reports, logs.

Public API: `AgentApi`, `ApiError`, `Unreachable`, `Credential`, `load_credential`,
`save_credential`.

Every connection starts at the agent (NAT-friendly: the server never dials a node). Failures
come in two kinds the loop treats differently: `Unreachable` (network, timeouts, 5xx — retry
with backoff, workloads carry on) and `ApiError` (a 4xx: the server understood and refused).

The control plane may be several replicas (`--server` repeated, and those its answers name): a
call moves to the next one when a replica refuses the connection or answers 503, and stays with
the one that answers (core/servers.py). A call that went out unanswered is not resent here; the
loop's next try goes to the next replica (every call the loop repeats is safe to repeat).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import ssl
import stat
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from computepool.core.servers import ServerList, retry_after, split_servers
from computepool.core.tls import (
    TlsError,
    client_context,
    describe_tls_failure,
    fetch_certificate,
    fingerprint,
    split_pin,
)

log = logging.getLogger("computepool.agent")
API = "/api/v1"
CREDENTIAL_FILE = "node.json"


class Unreachable(Exception):
    """The control plane did not answer usefully (connection, timeout, 5xx): try again later."""


class ApiError(Exception):
    """The control plane refused the call (4xx); `message` is its `error` text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{message} (HTTP {status})")
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Credential:
    """What a joined node keeps in its data dir: enough to talk to the server without a join token."""

    server: str
    name: str
    credential: str
    heartbeat_interval_s: float = 5.0
    simulate: str | None = None  # the simulated devices it joined with: a restart must offer the same


def load_credential(data_dir: Path) -> Credential | None:
    path = data_dir / CREDENTIAL_FILE
    try:
        data = json.loads(path.read_text())
        return Credential(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"{path}: unreadable node credential ({e}); remove it to join again") from None


def save_credential(data_dir: Path, cred: Credential) -> Path:
    """Written 0600 through a temp file and rename: a crash never leaves half a credential."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    # nobody else may list or read it; a sandboxing agent leaves others only the right to pass (0711)
    os.chmod(data_dir, stat.S_IMODE(os.stat(data_dir).st_mode) & 0o711)
    path = data_dir / CREDENTIAL_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(cred), f)
    os.replace(tmp, path)
    return path


def _error_text(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text.strip()[:300] or r.reason_phrase
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return r.text.strip()[:300]


SERVER_CERT_FILE = "server-ca.pem"


def server_verify(
    server: str, data_dir: Path, ca: Path | None, join_token: str | None
) -> ssl.SSLContext | bool:
    """How this agent checks the control plane's certificate, in order of precedence:

    `--ca FILE`; else the certificate it pinned at its first join (DATA_DIR/server-ca.pem); else,
    on a first join with a token that carries a pin, the certificate the server presents — kept
    only if its SHA-256 matches the pin, refused (TlsError) otherwise; else the system's CAs.
    """
    if ca is not None:
        return client_context(ca)
    server = split_servers(server)[0]  # the replicas of one pool present one certificate
    saved = data_dir / SERVER_CERT_FILE
    if saved.exists():
        return client_context(saved, pinned=True)
    pin = split_pin(join_token)[1] if join_token else None
    if pin is None or not server.startswith("https://"):
        return True
    pem = fetch_certificate(server)
    got = fingerprint(pem)
    if not hmac.compare_digest(got, pin):
        raise TlsError(
            f"{server} presented a certificate with SHA-256 {got[:16]}…, but the join token pins "
            f"{pin[:16]}…: not joining (another server, or a token for another pool)"
        )
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(saved, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(pem)
    return client_context(saved, pinned=True)


class AgentApi:
    """One node's calls to the control plane. Thread-safe: httpx.Client may be shared by threads."""

    def __init__(
        self,
        server: str,
        *,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        verify: ssl.SSLContext | bool = True,
    ):
        """`server`: the control plane's URL, or several comma-separated (its replicas)."""
        self.servers = ServerList(split_servers(server))
        self.timeout_s = timeout_s
        self._http = httpx.Client(timeout=timeout_s, transport=transport, verify=verify)
        self._headers: dict[str, str] = {}
        self.name = ""

    @property
    def server(self) -> str:
        """The replica in use now."""
        return self.servers.current

    def use(self, cred: Credential) -> None:
        self.name = cred.name
        self._headers = {"Authorization": f"Bearer {cred.credential}"}

    def close(self) -> None:
        self._http.close()

    def learn(self, answer: dict[str, Any]) -> None:
        """Keep the replicas a join or heartbeat answer names (absent: a server that names none)."""
        urls = answer.get("servers")
        if isinstance(urls, list) and self.servers.learn(str(u) for u in urls):
            log.info("control plane replicas: %s", ", ".join(self.servers.urls))

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One request on the first replica that takes it: a refused connection or a 503 moves on
        to the next (a 503's replica is left alone for its Retry-After); anything else ends here."""
        tried: list[str] = []
        for base in self.servers.order():
            if self.servers.wait_s(base) > 0:
                tried.append(f"{base}: unavailable (Retry-After)")
                continue
            try:
                r = self._http.request(method, base + path, **kw)
            except httpx.HTTPError as e:
                self.servers.failed(base)
                tls = describe_tls_failure(e)
                tried.append(f"{base}: {tls or f'{type(e).__name__}: {e}'.rstrip(': ')}")
                if tls is None and isinstance(
                    e, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout
                ):
                    continue  # it never went out: another replica may take it
                raise Unreachable("; ".join(tried)) from None
            if r.status_code == 503:
                self.servers.failed(base, retry_after(r.headers.get("Retry-After"), 0))
                tried.append(f"{base}: HTTP 503: {_error_text(r)}")
                continue
            if r.status_code >= 500:
                self.servers.failed(base)
                raise Unreachable(f"{base}: HTTP {r.status_code}: {_error_text(r)}")
            self.servers.worked(base)
            return r
        raise Unreachable("; ".join(tried))

    def _call(
        self, method: str, path: str, *, auth: bool = True, timeout: float | None = None, **kw: Any
    ) -> Any:
        r = self._send(
            method,
            path,
            headers=self._headers if auth else None,
            timeout=timeout if timeout is not None else self.timeout_s,
            **kw,
        )
        if r.status_code >= 400:
            raise ApiError(r.status_code, _error_text(r))
        try:
            return r.json() if r.content else {}
        except ValueError:
            raise Unreachable(f"{self.server}: answer is not JSON: {r.text[:200]!r}") from None

    # ---- the calls ---------------------------------------------------------------------------

    def join(self, body: dict[str, Any]) -> dict[str, Any]:
        """`POST /nodes/join` → {node, credential, heartbeat_interval_s, servers}."""
        out = dict(self._call("POST", f"{API}/nodes/join", auth=False, json=body))
        self.learn(out)
        return out

    def heartbeat(
        self,
        devices_usage: list[dict[str, Any]],
        address: str | None = None,
        pythons: list[str] | None = None,
        progress: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """`address` (once after a start): where peers reach the node; "" = where the call comes from.
        `pythons` (once after a start): the Python versions jobs can run here (installed since the join?).
        `progress`: running jobs' steps/s since the last heartbeat (agent/progress.py)."""
        body: dict[str, Any] = {"devices_usage": devices_usage}
        if progress:
            body["progress"] = progress
        if address is not None:
            body["address"] = address
        if pythons is not None:
            body["pythons"] = pythons
        out = dict(self._call("POST", f"{API}/nodes/{self.name}/heartbeat", json=body))
        self.learn(out)
        return out

    def assignments(self, since: int | None, wait_s: float) -> dict[str, Any]:
        """Long-poll: answers at once when the list changed after `since`, else after about `wait_s`."""
        params: dict[str, Any] = {"wait": wait_s}
        if since is not None:
            params["since"] = since
        return dict(
            self._call(
                "GET", f"{API}/nodes/{self.name}/assignments", params=params, timeout=wait_s + self.timeout_s
            )
        )

    def report(self, reports: list[dict[str, Any]]) -> dict[str, Any]:
        return dict(self._call("POST", f"{API}/nodes/{self.name}/reports", json={"reports": reports}))

    def logs(
        self, allocation_id: int | str, attempt: int, stream: str, offset: int, data: str
    ) -> dict[str, Any]:
        body = {"attempt": attempt, "stream": stream, "offset": offset, "data": data}
        return dict(self._call("POST", f"{API}/allocations/{allocation_id}/logs", json=body))

    # ---- blobs and file requests (agent/blobs.py) ----------------------------------------------

    def _raw(self, method: str, path: str, **kw: Any) -> httpx.Response:
        r = self._send(method, API + path, headers=self._headers, **kw)
        if r.status_code >= 400:
            raise ApiError(r.status_code, _error_text(r))
        return r

    def get_bytes(self, path: str) -> bytes:
        """A raw GET under /api/v1 (a blob), with a generous timeout for large ones."""
        return self._raw("GET", path, timeout=max(self.timeout_s, 600.0)).content

    def put_file(self, path: str, body: BinaryIO) -> dict[str, Any]:
        """A raw PUT of a file's bytes, streamed (the packed files of a request)."""
        chunks = iter(lambda: body.read(1 << 20), b"")
        return dict(self._raw("PUT", path, content=chunks, timeout=max(self.timeout_s, 600.0)).json())

    def discovery_key(self) -> dict[str, Any]:
        """The pool's discovery key (a secret: the caller must never log it)."""
        return dict(self._call("GET", f"{API}/discovery/key"))

    def report_peers(self, name: str, peers: list[dict[str, Any]]) -> dict[str, Any]:
        sent = {"sent_at": datetime.now(UTC).isoformat()}  # the server corrects last_seen by our clock's skew
        return dict(self._call("PUT", f"{API}/nodes/{name}/peers", json={"peers": peers}, params=sent))

    def relays(self, since: int, wait_s: float) -> dict[str, Any]:
        """Long-poll: the shells and tunnels this node should dial back to (agent/relay.py)."""
        params = {"since": since, "wait": wait_s}
        path = f"{API}/nodes/{self.name}/relays"
        return dict(self._call("GET", path, params=params, timeout=wait_s + self.timeout_s))

    def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self._call("POST", f"{API}{path}", json=body))
