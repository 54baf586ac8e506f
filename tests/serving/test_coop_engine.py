"""The cooperative engine's programs run for real: llama.cpp's RPC server, the head serving the OpenAI
API over local and remote layers, and the speed probe, each started exactly as the pool starts them
(`scripts.command`, the llama venv's python) on loopback, with the tiny GGUF model.

The RPC server refuses any address that is not private; llama.cpp's RPC listens only inside the RPC
server's own network namespace, and its relay carries only clients proving the plan's secret (and
the head's relay only connections of the head itself); the greedy output of the model split between
the head's CPU and an RPC server equals the single-process output token for token; killing the RPC
server mid-generation fails the request and ends the head with a line naming the lost peer.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest

from computepool.serving.coop import scripts
from computepool.serving.coop.engine.rpc_server import refusal
from computepool.serving.coop.planner import Candidate, Link, ModelShape, layer_params, plan

KEY = "test-service-key"
SECRET = "5e" * 32
COOP = {"CPOOL_COOP_SECRET": SECRET}
AUTH = {"Authorization": f"Bearer {KEY}"}
Completed = subprocess.CompletedProcess[str]
PROMPTS = ["The pool serves", "Split across two nodes:"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A started engine program; its stdout and stderr lines are collected as they come."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, **(env or {})})  # fmt: skip
        self.lines: list[str] = []
        self.errors: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.popen.stdout, self.lines), daemon=True),
            threading.Thread(target=self._read, args=(self.popen.stderr, self.errors), daemon=True),
        ]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream: IO[str] | None, into: list[str]) -> None:
        assert stream is not None
        for line in stream:
            into.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines[-20:] + ["--- stderr"] + self.errors[-40:])

    def wait_line(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if line.startswith(prefix):
                    return line
            if self.popen.poll() is not None:
                self._readers[0].join(5)
                break
            time.sleep(0.05)
        raise AssertionError(
            f"no line {prefix!r} within {timeout} s (exit {self.popen.poll()}):\n{self.output()}"
        )

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(20)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    try:
        yield started
    finally:
        for p in reversed(started):
            p.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("gguf", reason="writing the model needs the `serve` extra (gguf)")
    from computepool.serving.tinymodel import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("coop") / "tiny.gguf", seed=7)


def rpc_server(procs: list[Proc], py: str) -> str:
    port = free_port()
    p = Proc(scripts.command(py, "rpc_server", ["--host", "127.0.0.1", "--port", str(port)]), env=COOP)
    procs.append(p)
    assert p.wait_line("CPOOL-RPC ready", 120) == f"CPOOL-RPC ready 127.0.0.1:{port}"
    return f"127.0.0.1:{port}"


def head(procs: list[Proc], py: str, model: Path, *extra: str) -> tuple[Proc, str]:
    port = free_port()
    args = [
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ctx",
        "512",
        "--alias",
        "tiny",
    ]
    p = Proc(scripts.command(py, "head", [*args, *extra]), env={"CPOOL_SERVICE_KEY": KEY, **COOP})
    procs.append(p)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and p.popen.poll() is None:
        try:
            if httpx.get(f"{url}/v1/models", headers=AUTH, timeout=5).is_success:
                return p, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the head never answered (exit {p.popen.poll()}):\n{p.output()}")


def complete(url: str, prompt: str, max_tokens: int = 48) -> dict[str, object]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "repeat_penalty": 1.0}
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60, json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    return {"text": got["choices"][0]["text"], "tokens": got["usage"]["completion_tokens"]}


def run(
    argv: list[str], secret: str | None = SECRET, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CPOOL_COOP_SECRET"}
    if secret is not None:
        env["CPOOL_COOP_SECRET"] = secret
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, env=env)


def probe_argv(py: str, model: Path, *extra: str) -> list[str]:
    return scripts.command(py, "probe", ["--model", str(model), "--tokens", "48", "--ctx", "512", *extra])


def probe(py: str, model: Path, *extra: str) -> dict[str, object]:
    r = run(probe_argv(py, model, *extra))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith("CPOOL-PROBE ")]
    assert len(lines) == 1, r.stdout
    return dict(json.loads(lines[0].removeprefix("CPOOL-PROBE ")))


def test_programs_fit_an_allocation_and_need_only_stdlib_and_llama_cpp() -> None:
    relay = scripts.source(scripts.SHARED)
    for program in scripts.PROGRAMS:
        text = scripts.source(program)
        assert (
            len(text.encode()) <= scripts.MAX_SOURCE_BYTES and len(relay.encode()) <= scripts.MAX_SOURCE_BYTES
        )
        argv = scripts.command("/opt/py/bin/python", program, ["--x", "1"])
        assert argv[:3] == ["/opt/py/bin/python", "-c", scripts.LOADER]
        assert argv[3:] == [relay, text, "--x", "1"]
        assert "TYPE_CHECKING:" not in text  # the checkers' imports do not travel
    for program in (*scripts.PROGRAMS, scripts.SHARED):
        text = scripts.source(program)
        tree = ast.parse(text)
        roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        roots |= {
            n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
        }
        roots |= {  # importlib.import_module("…") by name
            n.args[0].value.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "import_module"
            and isinstance(n.args[0], ast.Constant)
        }  # fmt: skip
        assert roots - set(sys.stdlib_module_names) <= {"llama_cpp", "uvicorn"}, (program, roots)
        assert "computepool" not in text
    with pytest.raises(ValueError, match="unknown engine program"):
        scripts.source("shell")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("host", "ok"),
    [("127.0.0.1", True), ("10.1.2.3", True), ("172.20.0.9", True), ("192.168.1.5", True),
     ("100.64.0.7", True), ("169.254.3.4", True), ("0.0.0.0", False), ("8.8.8.8", False),
     ("172.32.0.1", False), ("100.128.0.1", False), ("::", False), ("2001:db8::1", False),
     ("localhost", False), ("fd00::1", False), ("::ffff:10.0.0.1", False)],
)  # fmt: skip
def test_only_private_addresses_may_carry_llama_cpp_rpc(host: str, ok: bool) -> None:
    why = refusal(host)
    assert (why is None) == ok, why
    if host == "fd00::1":  # private, but llama.cpp's RPC server listens on IPv4 only
        assert why is not None and "IPv4" in why


@pytest.mark.parametrize("host", ["0.0.0.0", "8.8.8.8"])
def test_rpc_server_refuses_an_open_address(llama_python: str, host: str) -> None:
    argv = scripts.command(llama_python, "rpc_server", ["--host", host, "--port", str(free_port())])
    r = run(argv, timeout=60)
    assert r.returncode == 2
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert host in r.stderr and "no authentication" in r.stderr


@pytest.mark.parametrize("secret", [None, "", "5e" * 16, "not hex"])
def test_the_engine_refuses_to_run_rpc_without_the_plans_secret(
    llama_python: str, model: Path, secret: str | None
) -> None:
    server = scripts.command(llama_python, "rpc_server", ["--host", "127.0.0.1", "--port", str(free_port())])
    peer = f"127.0.0.1:{free_port()}"
    head = ["--model", str(model), "--host", "127.0.0.1", "--port", str(free_port()), "--rpc", peer]
    for argv in (
        server,
        scripts.command(llama_python, "head", head),
        probe_argv(llama_python, model, "--rpc", peer),
    ):
        r = run(argv, secret, timeout=60)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "CPOOL_COOP_SECRET" in lines[0], lines
        assert secret is None or not secret or secret not in r.stderr


def test_rpc_server_serves_and_stops_cleanly(llama_python: str, procs: list[Proc]) -> None:
    endpoint = rpc_server(procs, llama_python)
    host, port = endpoint.split(":")
    socket.create_connection((host, int(port)), timeout=5).close()
    taken = run(scripts.command(llama_python, "rpc_server", ["--host", host, "--port", port]), timeout=60)
    assert taken.returncode == 1 and "cannot listen" in taken.stderr
    procs[0].popen.send_signal(signal.SIGTERM)
    assert procs[0].popen.wait(30) == 0


def test_probe_reports_speed_shape_and_the_same_text_through_rpc(
    llama_python: str, model: Path, procs: list[Proc]
) -> None:
    local = probe(llama_python, model)
    assert local["n_layer"] == 2 and local["n_embd"] == 64 and local["n_vocab"] == 259
    assert isinstance(local["tokens_per_s"], float) and local["tokens_per_s"] > 0
    assert 0 < int(local["model_bytes"]) <= model.stat().st_size  # type: ignore[call-overload]
    assert int(local["layer_bytes"]) * 2 + int(local["embd_bytes"]) <= int(local["model_bytes"])  # type: ignore[call-overload]
    text = local["text"]
    assert isinstance(text, str) and len(text) == local["tokens"] == 48 and text.isprintable()
    endpoint = rpc_server(procs, llama_python)
    remote = probe(llama_python, model, "--rpc", endpoint, "--n-gpu-layers", "-1")
    assert remote["rpc"] == [endpoint] and remote["text"] == text


def test_split_over_an_rpc_server_answers_token_for_token_like_one_process(
    llama_python: str, model: Path, procs: list[Proc]
) -> None:
    _, single = head(procs, llama_python, model)
    expected = [complete(single, p) for p in PROMPTS]
    procs.pop().stop()

    endpoint = rpc_server(procs, llama_python)
    shape = ModelShape(n_layers=2, model_bytes=231_424, layer_bytes=82_468, embd_bytes=66_488)
    cands = [Candidate("a", "cpu", 1024, 1000.0), Candidate("b", "cpu", 1024, 1000.0)]
    forced = plan(shape, cands, [Link("a", "b", 0.1, 1000.0)], max_nodes=2, min_gain=1.1, force_split=2)
    assert forced.chosen is not None and [s.layers for s in forced.chosen.shards] == [1, 1]
    n_gpu_layers, split = layer_params(forced.chosen.shards)
    assert (n_gpu_layers, split) == (2, [2.0])  # layer 1 and the output layer on the RPC server
    _, url = head(procs, llama_python, model, "--rpc", endpoint, "--n-gpu-layers", str(n_gpu_layers),
                  "--tensor-split", ",".join(f"{x:g}" for x in split))  # fmt: skip
    assert [complete(url, p) for p in PROMPTS] == expected
    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401  # the service key is required


def test_head_without_its_rpc_server_exits_with_one_clear_line(llama_python: str, model: Path) -> None:
    gone = f"127.0.0.1:{free_port()}"
    args = ["--model", str(model), "--host", "127.0.0.1", "--port", str(free_port()), "--rpc", gone]
    argv = scripts.command(llama_python, "head", [*args, "--n-gpu-layers", "2"])
    r = run(argv, timeout=120)
    assert r.returncode == 3
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("head: ") and gone in lines[0] and "connect" in lines[0]


def test_killing_the_rpc_server_mid_generation_fails_the_request_and_ends_the_head(
    llama_python: str, model: Path, procs: list[Proc]
) -> None:
    endpoint = rpc_server(procs, llama_python)
    server = procs[-1]
    # far more tokens than the stream's buffers hold: generation waits for the reader, so the RPC
    # server dies while the answer is being generated however fast this machine is
    h, url = head(procs, llama_python, model, "--rpc", endpoint, "--n-gpu-layers", "2", "--ctx", "4096")
    events, done = 0, False
    body = {"prompt": "x", "max_tokens": 4000, "temperature": 0.0, "stream": True}
    with (  # the stream breaks while being read
        pytest.raises(httpx.HTTPError),
        httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, json=body, timeout=60) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                events += 1
                done = done or line.strip() == "data: [DONE]"
            if events == 2:  # generating, and held back by the unread stream
                server.popen.kill()
    assert not done and events >= 2
    assert h.popen.wait(60) == 3
    h._readers[1].join(10)
    lost = [x for x in h.errors if x.startswith("head: lost the RPC server")]
    assert lost and endpoint in lost[0], h.output()


def test_an_idle_head_notices_its_rpc_server_gone_and_exits(
    llama_python: str, model: Path, procs: list[Proc]
) -> None:
    endpoint = rpc_server(procs, llama_python)
    h, url = head(procs, llama_python, model, "--rpc", endpoint, "--n-gpu-layers", "2")
    assert complete(url, "ready?", 4)["tokens"] == 4
    procs[0].popen.kill()
    assert h.popen.wait(60) == 3  # without a request: the next one finds no replica rather than a hang
    h._readers[1].join(10)
    assert f"head: lost the RPC server {endpoint}: connection closed or timed out; exiting" in h.errors


def tcp_rows(table: str) -> list[list[str]]:
    """The rows of a /proc/.../net/tcp table, split in columns: those of three reads, since a read
    can miss a row while other sockets of the host come and go."""
    rows = {line for _ in range(3) for line in Path(table).read_text().splitlines()[1:]}
    return [line.split() for line in rows]


def socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(link[8:-1])
    return found


def listening_ports(table: str, inodes: set[str] | None = None) -> set[int]:
    """Ports listened on in a /proc/.../net/tcp table (state 0A), by the sockets `inodes` if given."""
    return {
        int(c[1].split(":")[1], 16)
        for c in tcp_rows(table)
        if c[3] == "0A" and (inodes is None or c[9] in inodes)
    }


def test_llama_cpp_listens_only_inside_the_rpc_servers_own_network_namespace(
    llama_python: str, procs: list[Proc]
) -> None:
    endpoint = rpc_server(procs, llama_python)
    pid, port = procs[0].popen.pid, int(endpoint.split(":")[1])
    # in this (the host's) namespace, the process listens on its relay port and nothing else
    assert listening_ports("/proc/self/net/tcp", socket_inodes(pid)) == {port}
    # llama.cpp's own listener lives in the process's private namespace
    inner = listening_ports(f"/proc/{pid}/net/tcp")
    assert len(inner) == 1 and port not in inner
    assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    (inner_port,) = inner
    if inner_port not in listening_ports("/proc/self/net/tcp"):  # else another program happens to use it
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", inner_port), timeout=5)
    assert accepted(procs[0]) == 1  # llama.cpp saw only the server's own readiness check


def accepted(server: Proc) -> int:
    """How many connections llama.cpp accepted (it says so on stderr)."""
    return sum(line.startswith("Accepted client connection") for line in server.errors)


def drain(sock: socket.socket) -> bytes:
    """All the peer sends until it closes the connection (a reset counts as closing)."""
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def hello() -> bytes:
    """llama.cpp's RPC HELLO command as a client sends it first: command byte, then a 0 payload size."""
    return bytes([14]) + (0).to_bytes(8, "little")


def test_a_client_without_the_secret_gets_nothing_from_the_rpc_server(
    llama_python: str, model: Path, procs: list[Proc]
) -> None:
    endpoint = rpc_server(procs, llama_python)
    host, port = endpoint.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as plain:
        plain.sendall(hello() + b"\0" * 64)  # speaking llama.cpp's protocol straight away
        got = drain(plain)
    assert len(got) == 16  # the challenge, then the connection closes: no answer from llama.cpp
    wrong = run(probe_argv(llama_python, model, "--rpc", endpoint), secret="a7" * 32)
    assert wrong.returncode == 1
    lines = wrong.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"probe: cannot connect to the RPC server {endpoint}: ")
    assert "secret" in lines[0] and "a7" * 32 not in wrong.stderr
    # nothing of that reached llama.cpp, whose one client slot is still free for the plan's own head
    assert accepted(procs[0]) == 1  # the server's own readiness check only
    assert probe(llama_python, model, "--rpc", endpoint)["rpc"] == [endpoint]


def test_the_head_does_not_talk_to_an_rpc_server_that_cannot_prove_the_secret(
    llama_python: str, model: Path
) -> None:
    with socket.socket() as impostor:
        impostor.bind(("127.0.0.1", 0))
        impostor.listen(4)
        endpoint = f"127.0.0.1:{impostor.getsockname()[1]}"
        heard: list[bytes] = []

        def pose() -> None:  # challenges like the real relay, then answers with a made-up proof
            conn, _ = impostor.accept()
            with conn:
                conn.sendall(os.urandom(16))
                heard.append(conn.recv(48))
                conn.sendall(os.urandom(32))
                conn.settimeout(30)
                heard.append(conn.recv(4096))

        t = threading.Thread(target=pose, daemon=True)
        t.start()
        r = run(probe_argv(llama_python, model, "--rpc", endpoint))
        t.join(30)
    assert r.returncode == 1
    assert f"cannot connect to the RPC server {endpoint}: it could not prove" in r.stderr
    assert len(heard) == 2 and len(heard[0]) == 48 and heard[1] == b""  # nothing of llama.cpp's


def test_only_the_head_itself_may_use_its_local_relay(
    llama_python: str, model: Path, procs: list[Proc]
) -> None:
    endpoint = rpc_server(procs, llama_python)
    h, url = head(procs, llama_python, model, "--rpc", endpoint, "--n-gpu-layers", "2")
    api = int(url.rsplit(":", 1)[1])
    relays = listening_ports("/proc/self/net/tcp", socket_inodes(h.popen.pid)) - {api}
    assert len(relays) == 1
    (relay,) = relays
    with socket.create_connection(("127.0.0.1", relay), timeout=30) as other:
        other.sendall(hello())
        assert drain(other) == b""  # closed at once, nothing relayed
    assert complete(url, "still served", 8)["tokens"] == 8
    assert h.popen.poll() is None
