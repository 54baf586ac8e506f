"""The agent's side of the control-plane HTTP API: join, heartbeat, assignments, reports, logs.

Public API: `AgentApi`, `ApiError`, `Unreachable`, `Credential`, `load_credential`,
`save_credential`.

Every connection starts at the agent (NAT-friendly: the server never dials a node). Failures
come in two kinds the loop treats differently: `Unreachable` (network, timeouts, 5xx — retry
with backoff, workloads carry on) and `ApiError` (a 4xx: the server understood and refused).
"""

from __future__ import annotations

import hmac
import json
import os
import ssl
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from computepool.core.tls import (
    TlsError,
    client_context,
    describe_tls_failure,
    fetch_certificate,
    fingerprint,
    split_pin,
)

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
        self.server = server.rstrip("/")
        self.timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.server, timeout=timeout_s, transport=transport, verify=verify)
        self._headers: dict[str, str] = {}
        self.name = ""

    def use(self, cred: Credential) -> None:
        self.name = cred.name
        self._headers = {"Authorization": f"Bearer {cred.credential}"}

    def close(self) -> None:
        self._http.close()

    def _call(
        self, method: str, path: str, *, auth: bool = True, timeout: float | None = None, **kw: Any
    ) -> Any:
        try:
            r = self._http.request(
                method,
                path,
                headers=self._headers if auth else None,
                timeout=timeout if timeout is not None else self.timeout_s,
                **kw,
            )
        except httpx.HTTPError as e:
            tls = describe_tls_failure(e)
            if tls is not None:  # retried like an outage (jobs carry on), but said plainly
                raise Unreachable(f"{self.server}: {tls}") from None
            raise Unreachable(f"{self.server}: {type(e).__name__}: {e}".rstrip(": ")) from None
        if r.status_code >= 500:
            raise Unreachable(f"{self.server}: HTTP {r.status_code}: {_error_text(r)}")
        if r.status_code >= 400:
            raise ApiError(r.status_code, _error_text(r))
        try:
            return r.json() if r.content else {}
        except ValueError:
            raise Unreachable(f"{self.server}: answer is not JSON: {r.text[:200]!r}") from None

    # ---- the calls ---------------------------------------------------------------------------

    def join(self, body: dict[str, Any]) -> dict[str, Any]:
        """`POST /nodes/join` → {node, credential, heartbeat_interval_s}."""
        return dict(self._call("POST", f"{API}/nodes/join", auth=False, json=body))

    def heartbeat(
        self,
        devices_usage: list[dict[str, Any]],
        address: str | None = None,
        pythons: list[str] | None = None,
    ) -> dict[str, Any]:
        """`address` (once after a start): where peers reach the node; "" = where the call comes from.
        `pythons` (once after a start): the Python versions jobs can run here (installed since the join?)."""
        body: dict[str, Any] = {"devices_usage": devices_usage}
        if address is not None:
            body["address"] = address
        if pythons is not None:
            body["pythons"] = pythons
        return dict(self._call("POST", f"{API}/nodes/{self.name}/heartbeat", json=body))

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
        try:
            r = self._http.request(method, API + path, headers=self._headers, **kw)
        except httpx.HTTPError as e:
            raise Unreachable(f"{self.server}: {type(e).__name__}: {e}".rstrip(": ")) from None
        if r.status_code >= 500:
            raise Unreachable(f"{self.server}: HTTP {r.status_code}: {_error_text(r)}")
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
        return dict(self._call("PUT", f"{API}/nodes/{name}/peers", json={"peers": peers}))

    def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self._call("POST", f"{API}{path}", json=body))
