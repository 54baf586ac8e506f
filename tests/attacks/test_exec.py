"""`cpool exec` and `cpool forward` against a real server and root agent, and the ways to abuse them.

A command exec'd into a job runs as the job's tenant, in the job's PID and network namespaces (it
sees neither another tenant's processes nor the node's loopback); a forwarded port is the job's
own loopback's, never the node's. Only the job's tenant may open a session (another tenant's id
reads exactly like a missing one), only the job's node may answer it, and each secret works once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import pwd
import select
import shutil
import signal
import socket
import sqlite3
import struct
import subprocess
import termios
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from e2e_helpers import JOB_PYTHON, cpool, free_port, publish_image, stop, wait_for
from job_node import Node, job_node
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from computepool.agent.tenants import user_name

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and namespaces need a root agent"),
    pytest.mark.skipif(shutil.which("slirp4netns") is None, reason="a job's own network needs slirp4netns"),
]

# The job: a marker in its command line, a listener on its own 127.0.0.1 that greets and closes.
SERVE = r"""
import socket, sys, time
t = socket.socket()
t.bind(("127.0.0.1", int(sys.argv[2])))
t.listen()
end = time.time() + 300
while time.time() < end:
    c = t.accept()[0]
    c.settimeout(10)  # an earlier try given up by the client never holds up the next one
    try:
        c.sendall(b"hello from " + sys.argv[1].encode() + b" " + c.recv(100))
    except OSError:
        pass
    c.close()
"""


@dataclass
class Setup:
    node: Node
    a: httpx.Client
    b: httpx.Client
    tenant_a: str
    job_a: int
    job_b: int
    marker_a: str
    marker_b: str
    job_port: int
    host_port: int  # a listener on the node's own loopback (the pool's services live there)


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    with job_node() as node:
        tenant_a, a = node.member("xa")
        _tenant_b, b = node.member("xb")
        marker_a, marker_b = f"mark-{uuid.uuid4().hex[:8]}", f"mark-{uuid.uuid4().hex[:8]}"
        job_port = free_port()
        job_a = node.submit(a, [JOB_PYTHON, "-c", SERVE, marker_a, str(job_port)])
        job_b = node.submit(b, [JOB_PYTHON, "-c", SERVE, marker_b, str(free_port())])
        for client, alloc in ((a, job_a), (b, job_b)):
            wait_for(
                f"job {alloc}",
                lambda c=client, i=alloc: c.get(f"/api/v1/allocations/{i}").json()["state"] == "active",
                60,
                node.logs,
            )
        host = socket.create_server(("127.0.0.1", 0))
        try:
            yield Setup(
                node, a, b, tenant_a, job_a, job_b, marker_a, marker_b, job_port, host.getsockname()[1]
            )
        finally:
            host.close()
            a.close()
            b.close()


def _sigint_as_on_a_terminal() -> None:
    """A harness that starts the tests in the background hands them SIGINT ignored, which Python
    (and so cpool) keeps: the command gets the default a terminal would give it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(
    s: Setup, *args: str, stdin: bytes = b"", tenant: str | None = None
) -> subprocess.CompletedProcess[bytes]:
    env = s.node.cli_env(tenant or s.tenant_a)
    return subprocess.run(cpool(*args), input=stdin, capture_output=True, env=env, timeout=60)


def test_exec_runs_as_the_tenant_inside_the_job(setup: Setup) -> None:
    s = setup
    script = (
        "id -u; cat; echo to-stderr >&2; grep -E '^Max (address space|processes)' /proc/self/limits; "
        "grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status; "
        "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done; "
        f"{JOB_PYTHON} -c \"import socket; socket.create_connection(('127.0.0.1', {s.host_port}), 3)\" "
        "2>/dev/null && echo reached-$((6*7)); exit 7"
    )
    r = run_cli(s, "exec", str(s.job_a), "--", "sh", "-c", script, stdin=b"piped-in\n")
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 7, (r.returncode, out, err, s.node.logs())
    lines = out.splitlines()
    assert int(lines[0]) == pwd.getpwnam(user_name(s.tenant_a)).pw_uid != 0
    assert lines[1] == "piped-in"
    assert err.strip() == "to-stderr"
    job = next(p for p in psutil.process_iter(["cmdline"]) if s.marker_a in (p.info["cmdline"] or []))
    held = [x for x in Path(f"/proc/{job.pid}/limits").read_text().splitlines() if x.startswith("Max ")]
    assert lines[2:4] == [x for x in held if "address space" in x or "processes" in x]  # as the job is
    status = dict(x.split(":\t") for x in lines[4:8])
    assert status == {"CapEff": "0" * 16, "CapBnd": "0" * 16, "NoNewPrivs": "1", "Seccomp": "2"}, status
    assert s.marker_a in out  # the job's own processes are there ...
    assert s.marker_b not in out  # ... and nobody else's
    assert "computepool.cli.main agent" not in out  # the node's own processes are not
    assert "reached-42" not in out  # nor is the node's loopback


def test_exec_reports_a_signal_as_128_plus_n(setup: Setup) -> None:
    r = run_cli(setup, "exec", str(setup.job_a), "--", "sh", "-c", "kill -TERM $$")
    assert r.returncode == 128 + signal.SIGTERM, r.stderr


class Terminal:
    """`cpool ARGS` on a pseudo-terminal of `rows` x `cols`, driven as a user at a keyboard would."""

    def __init__(self, env: dict[str, str], args: list[str], rows: int = 24, cols: int = 80) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        # a session of its own with this terminal as its controlling one: resizes reach it (SIGWINCH)
        self.proc = subprocess.Popen(
            ["setsid", "--ctty", "--wait", *cpool(*args)], stdin=slave, stdout=slave, stderr=slave, env=env
        )
        os.close(slave)
        self.seen = bytearray()

    def expect(self, text: str, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while text.encode() not in self.seen:
            left = end - time.monotonic()
            assert left > 0, f"no {text!r} in {bytes(self.seen)!r}"
            if select.select([self.master], [], [], left)[0]:
                try:
                    self.seen.extend(os.read(self.master, 4096))
                except OSError:
                    break
        assert text.encode() in self.seen, bytes(self.seen)

    def resize(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def exit_status(self) -> int:
        rc = self.proc.wait(20)
        with contextlib.suppress(OSError):
            while select.select([self.master], [], [], 0.5)[0]:
                self.seen.extend(os.read(self.master, 4096))
        return rc

    def close(self) -> None:
        stop(self.proc)
        os.close(self.master)


def test_exec_json_collects_the_output(setup: Setup) -> None:
    r = run_cli(setup, "exec", "--json", str(setup.job_a), "--", "sh", "-c", "echo out; echo err >&2; exit 2")
    assert r.returncode == 2, r.stderr
    assert json.loads(r.stdout) == {"exit_code": 2, "stdout": "out\n", "stderr": "err\n"}


def test_exec_with_a_terminal(setup: Setup) -> None:
    s = setup
    t = Terminal(s.node.cli_env(s.tenant_a), ["exec", "-t", str(s.job_a), "--", "sh"], 33, 101)
    try:
        t.expect("$ ")  # the job's shell's prompt
        t.type(b"stty size; tty\n")
        t.expect("33 101")
        t.expect("/dev/pts/")
        t.resize(40, 120)
        time.sleep(0.3)
        t.type(b"stty size\n")
        t.expect("40 120")
        t.type(b"sleep 60\n")
        time.sleep(0.5)
        t.type(b"\x03")  # Ctrl-C: a byte to the job's terminal, which interrupts the sleep
        t.type(b"echo done-$((6*7))\n")
        t.expect("done-42")
        t.type(b"exit 3\n")
        assert t.exit_status() == 3, bytes(t.seen)
    finally:
        t.close()


def test_run_with_a_terminal(setup: Setup) -> None:
    s = setup
    t = Terminal(s.node.cli_env(s.tenant_a), ["run", "--no-code", "--cpus", "0.1", "--pty", "--", "sh"])
    try:
        t.expect("$ ")
        t.type(b"echo in-job-$((2*3)) $CPOOL_RUN_DIR; id -u\n")
        t.expect("in-job-6 /")
        t.expect(str(pwd.getpwnam(user_name(s.tenant_a)).pw_uid))
        t.type(b"exit 4\n")
        assert t.exit_status() == 4, bytes(t.seen)
    finally:
        t.close()
    jobs = s.a.get("/api/v1/allocations").json()["items"]
    mine = max(jobs, key=lambda j: j["id"])
    assert mine["command"] == ["sleep", "infinity"] and mine["state"] == "cancelled", mine


def test_forward_reaches_the_jobs_own_loopback_only(setup: Setup) -> None:
    s = setup
    env = s.node.cli_env(s.tenant_a)
    procs = [
        subprocess.Popen(
            cpool("forward", str(s.job_a), f"0:{port}", *opts),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            preexec_fn=_sigint_as_on_a_terminal,
        )  # fmt: skip
        for port, opts in ((s.job_port, ()), (s.host_port, ("--json",)))
    ]
    try:
        assert procs[0].stdout is not None and procs[1].stdout is not None
        line = procs[0].stdout.readline().decode()
        assert line.startswith("Forwarding 127.0.0.1:"), line
        said = json.loads(procs[1].stdout.readline())
        assert said["port"] == s.host_port and said["allocation"] == s.job_a, said
        local = [int(line.split()[1].split(":")[1]), said["local"]]
        with socket.create_connection(("127.0.0.1", local[0]), timeout=20) as c:
            c.sendall(b"laptop")
            got = b""
            while chunk := c.recv(100):  # to the end: the job closing its side closes this one
                got += chunk
        assert got == f"hello from {s.marker_a} laptop".encode()
        with socket.create_connection(("127.0.0.1", local[1]), timeout=20) as c:
            c.settimeout(20)
            assert c.recv(100) == b""  # the node's own 127.0.0.1 is not the job's
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
            p.wait(10)
    assert procs[1].stderr is not None
    assert "nothing listens on port" in procs[1].stderr.read().decode()


def test_bad_input_is_one_line(setup: Setup) -> None:
    s = setup
    cases = [
        (("exec", "999999", "--", "true"), "allocation '999999' not found"),
        (("exec", str(s.job_b), "--", "true"), f"allocation '{s.job_b}' not found"),  # B's job, as A
        (("exec", "--rank", "3", str(s.job_a), "--", "true"), "rank: 3 is past the last member"),
        (("exec", str(s.job_a)), "give the command to run"),
        (("forward", str(s.job_a), "70000"), "not a TCP port"),
    ]
    for args, said in cases:
        r = run_cli(s, *args)
        err = r.stderr.decode()
        assert r.returncode != 0 and said in err and "Traceback" not in err, (args, err)
        assert len(err.strip().splitlines()) == 1, err


def _node_credential(s: Setup) -> tuple[str, str]:
    doc = json.loads((s.node.agent_dir / "node.json").read_text())
    return doc["name"], doc["credential"]


def _dial(s: Setup, sid: int, side: str, token: str, secret: str) -> dict[str, Any] | None:
    """The refusal the socket answers with, or None when it was let in."""
    url = f"ws://127.0.0.1:{s.node.port}/api/v1/relays/{sid}/{side}"
    headers = {"Authorization": f"Bearer {token}", "X-Cpool-Relay-Secret": secret}
    with connect(url, additional_headers=headers, open_timeout=10) as ws:
        try:
            frame = ws.recv(timeout=1)
        except (TimeoutError, ConnectionClosed):
            return None
        return json.loads(frame) if isinstance(frame, str) and "error" in frame else None


def test_sessions_open_once_for_their_own_user_and_node(setup: Setup) -> None:
    s = setup
    name, cred = _node_credential(s)
    join = s.node.admin.post("/api/v1/join-tokens", json={}).json()["token"]
    body = {"join_token": join, "name": f"o{uuid.uuid4().hex[:6]}", "cpu_milli": 0, "memory_mib": 0}
    other = httpx.post(f"{s.node.url}/api/v1/nodes/join", json=body)
    assert other.status_code in (200, 201), other.text
    other_cred = other.json()["credential"]
    os.kill(s.node.agent.pid, signal.SIGSTOP)  # the agent answers nothing while the test plays the node
    try:
        r = s.a.post(f"/api/v1/allocations/{s.job_a}/relays", json={"kind": "exec", "command": ["true"]})
        assert r.status_code == 201, r.text
        sid, client_secret = r.json()["id"], r.json()["secret"]
        polled = httpx.get(
            f"{s.node.url}/api/v1/nodes/{name}/relays", headers={"Authorization": f"Bearer {cred}"}
        ).json()["items"]
        node_secret = next(i["secret"] for i in polled if i["id"] == sid)
        # another node can neither list this node's sessions nor answer one, even with its secret
        assert httpx.get(
            f"{s.node.url}/api/v1/nodes/{name}/relays", headers={"Authorization": f"Bearer {other_cred}"}
        ).status_code in (403, 404)
        assert (_dial(s, sid, "node", other_cred, node_secret) or {}).get("status") == 404
        # a tenant's token cannot pose as the node, nor another tenant's as the user
        assert (_dial(s, sid, "node", s.node.tokens[s.tenant_a], node_secret) or {}).get("status") == 404
        b_token = next(t for n, t in s.node.tokens.items() if n != s.tenant_a)
        assert (_dial(s, sid, "client", b_token, client_secret) or {}).get("status") == 404
        assert (_dial(s, sid, "node", cred, "guessed") or {}).get("status") == 404
        assert (_dial(s, sid, "client", "x.not-a-token", client_secret) or {}).get("status") == 401
        assert (_dial(s, 2**70, "client", s.node.tokens[s.tenant_a], client_secret) or {}).get(
            "status"
        ) == 404
        # the right node's secret works once: the first dial is let in, the second refused
        assert _dial(s, sid, "node", cred, node_secret) is None
        assert (_dial(s, sid, "node", cred, node_secret) or {}).get("status") == 404
        # an expired session opens for nobody
        r = s.a.post(f"/api/v1/allocations/{s.job_a}/relays", json={"kind": "exec", "command": ["true"]})
        sid2, secret2 = r.json()["id"], r.json()["secret"]
        with sqlite3.connect(s.node.srv_dir / "pool.db") as db:
            db.execute("UPDATE relay_sessions SET expires_at = created_at WHERE id = ?", (sid2,))
        refused = _dial(s, sid2, "client", s.node.tokens[s.tenant_a], secret2) or {}
        assert refused.get("status") == 409 and "expired" in refused["error"]
    finally:
        os.kill(s.node.agent.pid, signal.SIGCONT)


def test_a_container_job(setup: Setup, image: str) -> None:
    s = setup
    publish_image(s.node.admin, image, [s.tenant_a])
    marker, port = f"mark-{uuid.uuid4().hex[:8]}", free_port()
    alloc = s.node.submit(s.a, ["python3", "-c", SERVE, marker, str(port)], image=image)
    wait_for(
        f"container job {alloc}",
        lambda: s.a.get(f"/api/v1/allocations/{alloc}").json()["state"] == "active",
        60,
        s.node.logs,
    )
    try:
        r = run_cli(s, "exec", str(alloc), "--", "sh", "-c", "id -u; tr '\\0' ' ' < /proc/1/cmdline; exit 5")
        out = r.stdout.decode()
        assert r.returncode == 5, (r.stderr.decode(), s.node.logs())
        assert int(out.splitlines()[0]) == pwd.getpwnam(user_name(s.tenant_a)).pw_uid
        assert marker in out  # the container's own processes
        fwd = subprocess.Popen(
            cpool("forward", str(alloc), f"0:{port}"),
            stdout=subprocess.PIPE,
            env=s.node.cli_env(s.tenant_a),
            preexec_fn=_sigint_as_on_a_terminal,
        )
        try:
            assert fwd.stdout is not None
            local = int(fwd.stdout.readline().decode().split()[1].split(":")[1])
            wait_for(f"the container's port {port}", lambda: _greeting(local, marker), 60, s.node.logs)
        finally:
            fwd.send_signal(signal.SIGINT)
            fwd.wait(10)
    finally:
        s.a.post(f"/api/v1/allocations/{alloc}/cancel")


def _greeting(local: int, marker: str) -> bool:
    with socket.create_connection(("127.0.0.1", local), timeout=10) as c:
        c.sendall(b"laptop")
        got = b""
        while chunk := c.recv(100):
            got += chunk
    return got == f"hello from {marker} laptop".encode()
