"""A slow code fetch holds up nothing else on the node: real `cpool server`, a root `cpool agent`, and
between them a small HTTP relay that passes every call through but holds the agent's GET of a chosen
blob until the test lets it go (or answers it with other bytes).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import socket
import subprocess
import tarfile
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import JOB_PYTHON, child_env, cpool, free_port, stop, wait_for

from computepool.agent.tenants import remove_tenant_user

pytestmark = pytest.mark.skipif(
    shutil.which("unshare") is None or os.geteuid() != 0,
    reason="a root agent runs jobs as tenant users",
)
HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class Relay:
    """Passes HTTP through to the control plane; GET /api/v1/blobs/SHA waits while SHA is held."""

    def __init__(self, upstream: str) -> None:
        self.upstream = httpx.Client(base_url=upstream, timeout=120)
        self.held: dict[str, threading.Event] = {}
        self.corrupt: set[str] = set()
        self.gets: Counter[str] = Counter()
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: Any) -> None:
                pass

            def _relay(self) -> None:
                sha = self.path.split("?")[0].rsplit("/", 1)[-1] if "/api/v1/blobs/" in self.path else ""
                if sha and self.command == "GET":
                    relay.gets[sha] += 1
                    held = relay.held.get(sha)
                    if held is not None:
                        held.wait(120)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                r = relay.upstream.request(self.command, self.path, content=body, headers=headers)
                data = r.content
                if sha in relay.corrupt and self.command == "GET":
                    data = b"not the blob"
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in HOP | {"content-encoding"}:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        for ev in self.held.values():
            ev.set()
        self.server.shutdown()
        self.upstream.close()


class Node:
    """`cpool server`, the relay, and a root `cpool agent` that reaches the server through it."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.agent_dir = root / "agent"
        self.procs: list[subprocess.Popen[bytes]] = []
        with (root / "server.log").open("ab") as out:
            cmd = cpool("server", "--data-dir", str(root / "srv"), "--port", str(self.port))
            self.server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())
        wait_for("the server", lambda: httpx.get(f"{self.url}/readyz").is_success, 60, self.logs)
        token = (root / "srv" / "admin-token").read_text().strip()
        self.admin = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        self.relay = Relay(self.url)
        self.agent: subprocess.Popen[bytes] | None = None
        self.start_agent(self.admin.post("/api/v1/join-tokens", json={}).json()["token"])
        self.tenant = f"pr{uuid.uuid4().hex[:6]}"
        assert self.admin.post("/api/v1/tenants", json={"name": self.tenant}).status_code == 201
        user = {"name": f"u-{self.tenant}", "tenant": self.tenant, "role": "member"}
        assert self.admin.post("/api/v1/users", json=user).status_code == 201
        tok = self.admin.post("/api/v1/tokens", json={"user": user["name"]}).json()["token"]
        self.http = httpx.Client(base_url=f"{self.url}/api/v1", headers={"Authorization": f"Bearer {tok}"})

    def start_agent(self, join_token: str | None = None) -> None:
        cmd = cpool("agent", "--server", self.relay.url, "--data-dir", str(self.agent_dir), "--name", "box")
        cmd += ["--kill-grace-s", "1", *(["--join-token", join_token] if join_token else [])]
        with (self.root / "agent.log").open("ab") as out:
            self.agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())
        wait_for("the node", lambda: [n["state"] for n in self.admin.get("/api/v1/nodes").json()["items"]]
                 == ["ready"], 60, self.logs)  # fmt: skip

    def logs(self) -> str:
        return "\n".join(
            (self.root / f).read_text() for f in ("server.log", "agent.log") if (self.root / f).exists()
        )

    def blob(self, text: str) -> str:
        """A code archive holding `hello.txt` with `text`, stored on the pool; its sha256."""
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w:gz") as tar:
            data = text.encode()
            info = tarfile.TarInfo("hello.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        body = raw.getvalue()
        sha = hashlib.sha256(body).hexdigest()
        assert self.http.put(f"/blobs/{sha}", content=body).status_code in (200, 201)
        return sha

    def job(self, code: str, sha: str | None = None) -> int:
        body: dict[str, Any] = {"command": [JOB_PYTHON, "-c", code], "cpu_milli": 100, "memory_mib": 64}
        if sha:
            body["code"] = sha
        r = self.http.post("/allocations", json=body)
        assert r.status_code == 201, r.text
        return int(r.json()["id"])

    def get(self, alloc: int) -> dict[str, Any]:
        return dict(self.http.get(f"/allocations/{alloc}").json())

    def ended(self, alloc: int, timeout: float = 60) -> dict[str, Any]:
        ends = ("released", "failed", "cancelled", "preempted")

        def end() -> dict[str, Any] | None:
            a = self.get(alloc)
            return a if a["state"] in ends else None

        return dict(wait_for(f"allocation {alloc} to end", end, timeout, self.logs))

    def stdout(self, alloc: int) -> str:
        return str(self.http.get(f"/allocations/{alloc}/logs").json()["stdout"]["data"])

    def close(self) -> None:
        if self.agent is not None:
            stop(self.agent)
        self.relay.close()
        stop(self.server)
        remove_tenant_user(self.tenant)


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    root = Path("/var/tmp") / f"cpool-prep-{uuid.uuid4().hex[:8]}"  # tenants' users pass through it
    root.mkdir(mode=0o755)
    n = Node(root)
    try:
        yield n
    finally:
        n.close()
        shutil.rmtree(root, ignore_errors=True)


READ = "print(open('hello.txt').read(), flush=True)"


def test_slow_fetch_holds_up_no_other_start_nor_a_cancel(node: Node) -> None:
    slow = node.blob("shipped slowly")
    node.relay.held[slow] = threading.Event()
    first, twin = node.job(READ, slow), node.job(READ, slow)
    wait_for("the agent to fetch the slow blob", lambda: node.relay.gets[slow] >= 1, 30, node.logs)
    # the fetch is held: a job with nothing to fetch starts and ends all the same
    quick = node.job("print('quick ran', flush=True)")
    done = node.ended(quick)
    assert done["state"] == "released" and done["exit_code"] == 0, done
    assert "quick ran" in node.stdout(quick)
    assert node.get(first)["state"] == node.get(twin)["state"] == "bound"
    # cancelled while its code is on the way: dropped, never started
    assert node.http.post(f"/allocations/{first}/cancel").status_code < 300
    assert node.ended(first, 20)["state"] == "cancelled"
    wait_for("the agent to drop it", lambda: "withdrawn while preparing" in node.logs(), 20, node.logs)
    node.relay.held[slow].set()
    done = node.ended(twin)
    assert done["state"] == "released", done
    assert "shipped slowly" in node.stdout(twin)
    assert node.relay.gets[slow] == 1  # both jobs waited for one fetch
    assert not (node.agent_dir / "runs" / str(first)).exists()  # the cancelled one never started
    assert f"{first}#1 started" not in node.logs()


def test_a_failed_fetch_fails_the_start_with_its_reason(node: Node) -> None:
    bad = node.blob("arrives mangled")
    node.relay.corrupt.add(bad)
    alloc = node.job(READ, bad)
    done = node.ended(alloc)
    assert done["state"] == "failed", done
    assert "could not start: code: blob" in done["reason"] and "arrived with other bytes" in done["reason"]
    # the agent goes on: the next job with the same code fetches again and runs once the bytes are right
    node.relay.corrupt.discard(bad)
    again = node.job(READ, bad)
    assert node.ended(again)["state"] == "released"
    assert "arrives mangled" in node.stdout(again)


def test_a_restarted_agent_prepares_again_and_starts_once(node: Node) -> None:
    slow = node.blob("after a restart")
    node.relay.held[slow] = threading.Event()
    alloc = node.job(READ, slow)
    wait_for("the fetch", lambda: node.relay.gets[slow] >= 1, 30, node.logs)
    assert node.agent is not None
    assert stop(node.agent, timeout=15) == 0  # a fetch in flight does not keep the agent from stopping
    assert not (node.agent_dir / "runs" / str(alloc)).exists()
    node.start_agent()
    node.relay.held[slow].set()
    done = node.ended(alloc)
    assert done["state"] == "released" and done["attempt"] == 1, done
    assert node.stdout(alloc).count("after a restart") == 1


class SilentRegistry:
    """A TCP port that accepts and never answers: a `podman pull` from it hangs until `close`, then
    fails (connection refused) — a real slow pull, ended when the test says."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(50)
        self.port = int(self.sock.getsockname()[1])
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.conns.append(self.sock.accept()[0])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.skipif(shutil.which("podman") is None, reason="container jobs need podman")
def test_a_slow_image_pull_holds_up_nothing_and_is_pulled_once(node: Node) -> None:
    registry = SilentRegistry()
    try:
        image = f"127.0.0.1:{registry.port}/slow/img:1"
        # published (pinned to an id the node lacks): the node pulls it from its registry
        published = {"name": image, "digest": "sha256:" + "0" * 64}
        assert node.admin.post("/api/v1/images", json=published).status_code == 200
        body: dict[str, Any] = {"command": ["true"], "image": image, "cpu_milli": 100, "memory_mib": 64}
        first, twin = (int(node.http.post("/allocations", json=body).json()["id"]) for _ in range(2))
        wait_for("the pull to reach the registry", lambda: registry.conns, 60, node.logs)
        quick = node.job("print('ran beside a pull', flush=True)")
        assert node.ended(quick)["state"] == "released"
        assert node.get(first)["state"] == node.get(twin)["state"] == "bound"
        assert node.http.post(f"/allocations/{first}/cancel").status_code < 300
        wait_for("the agent to drop it", lambda: f"{first}#1 withdrawn while preparing" in node.logs(), 20)
    finally:
        registry.close()
    done = node.ended(twin, 120)
    assert done["state"] == "failed", done
    assert f"could not start: image {image} not found on node" in done["reason"], done
    assert "could not be pulled" in done["reason"]
    assert node.logs().count(f"preparing image {image} failed") == 1  # one pull for both jobs
    assert not (node.agent_dir / "runs" / str(first)).exists()


def zeros_blob(node: Node, mib: int) -> str:
    """A code archive of `hello.txt` and four files of zeros (`mib` MiB in all, a few MiB packed):
    seconds to check and unpack. Stored on the pool; its sha256."""

    class Zeros(io.RawIOBase):
        def __init__(self, n: int) -> None:
            self.n = n

        def readable(self) -> bool:
            return True

        def readinto(self, b: Any) -> int:
            k = min(len(b), self.n)
            b[:k] = bytes(k)
            self.n -= k
            return k

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz", compresslevel=1) as tar:
        hello = tarfile.TarInfo("hello.txt")
        hello.size = len(b"unpacked off the loop")
        tar.addfile(hello, io.BytesIO(b"unpacked off the loop"))
        for i in range(4):
            info = tarfile.TarInfo(f"zeros{i}.bin")
            info.size = (mib << 20) // 4
            tar.addfile(info, io.BufferedReader(Zeros(info.size)))
    body = raw.getvalue()
    sha = hashlib.sha256(body).hexdigest()
    assert node.http.put(f"/blobs/{sha}", content=body).status_code in (200, 201)
    return sha


def test_a_slow_unpack_holds_up_no_other_start_nor_a_stop(node: Node) -> None:
    sleeper = node.job("import time; print('asleep', flush=True); time.sleep(300)")
    wait_for("the sleeper to run", lambda: "asleep" in node.stdout(sleeper), 60, node.logs)
    big = zeros_blob(node, 1536)
    sizes = (
        "import os; print(open('hello.txt').read(), sum(os.path.getsize(f'zeros{i}.bin') for i in range(4)))"
    )
    slow = node.job(sizes, big)
    wait_for(
        "the unpack to begin", lambda: f"{slow}#1 preparing: unpack {slow}#1" in node.logs(), 60, node.logs
    )
    # while the archive is checked and unpacked: a job with no code starts and ends, a cancel stops a job
    quick = node.job("print('quick ran', flush=True)")
    assert node.http.post(f"/allocations/{sleeper}/cancel").status_code < 300
    done = node.ended(quick)
    assert done["state"] == "released" and "quick ran" in node.stdout(quick), done
    wait_for("the sleeper to be stopped", lambda: f"{sleeper}#1 ended:" in node.logs(), 30, node.logs)
    logs = node.logs()
    assert f"{slow}#1 started" not in logs, "the unpack ended before the others: too fast to show anything"
    assert node.get(slow)["state"] == "bound"
    done = node.ended(slow, 120)
    assert done["state"] == "released", done
    assert node.stdout(slow).split() == ["unpacked", "off", "the", "loop", str(1536 << 20)]
    logs = node.logs()
    assert logs.index(f"{quick}#1 started") < logs.index(f"{slow}#1 started")
    marker = node.agent_dir / "runs" / str(slow) / "1" / ".code-unpacked"
    assert marker.read_text() == big and marker.stat().st_uid == 0 and marker.stat().st_mode & 0o077 == 0
    shutil.rmtree(node.agent_dir / "runs" / str(slow), ignore_errors=True)  # 1.5 GiB of zeros
