"""One model split over two nodes by llama.cpp's RPC backend, as a pool service.

A `cpool server` and two root `cpool agent`s on loopback, each finding the other by unicast
discovery (mDNS off, to keep it quick); a tenant member runs `cpool serve big --cooperative
--force-split 2`. The coop controller measures the model on both nodes with probe allocations,
places an RPC server on the peer the head node verified, and writes the head's command: the
greedy completion through the gateway then equals llama_cpp run directly on the file, token for
token, and `cpool services explain` shows the split. Killing the RPC server's process while a long
streamed completion runs fails that request (it does not hang), and the plan re-plans onto the
remaining node (attempt 2), where the service answers again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from e2e_helpers import child_env, cpool, free_port, job_readable_dir, kill_jobs_under, stop, wait_for

from computepool.agent.tenants import remove_tenant_user

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent"),
]
gguf = pytest.importorskip("gguf", reason="writing the model needs the `serve` extra (gguf)")

from computepool.serving.tinymodel import write_tiny_llama  # noqa: E402

PROMPT = "The pool serves"
MAX_TOKENS = 24
CTX = 256
NODES = ("coopa", "coopb")

DIRECT = """
import json, sys
from llama_cpp import Llama
from llama_cpp.server.types import CreateCompletionRequest
m = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[4]), n_threads=1, verbose=False)
c = m.create_completion(sys.argv[2], max_tokens=int(sys.argv[3]), temperature=0.0,
                        repeat_penalty=CreateCompletionRequest.model_fields["repeat_penalty"].default)
print(json.dumps({"text": c["choices"][0]["text"], "usage": c["usage"]}))
"""


class Pool:
    """`cpool server` and two root agents that discover each other by unicast on loopback."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tenants: list[str] = []

    def start(self) -> None:
        env = child_env()
        with (self.root / "server.log").open("ab") as out:
            self.procs.append(subprocess.Popen(
                cpool("server", "--data-dir", str(self.root / "srv"), "--port", str(self.port)),
                stdout=out, stderr=subprocess.STDOUT, env=env,
            ))  # fmt: skip
        wait_for("the server", lambda: httpx.get(f"{self.url}/readyz").is_success, 60, self.logs)
        token = (self.root / "srv" / "admin-token").read_text().strip()
        self.admin = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        ports = {n: free_port() for n in NODES}
        for name in NODES:
            join = self.admin.post("/api/v1/join-tokens", json={}).json()["token"]
            other = next(n for n in NODES if n != name)
            with (self.root / f"{name}.log").open("ab") as out:
                self.procs.append(subprocess.Popen(
                    cpool("agent", "--server", self.url, "--join-token", join, "--data-dir",
                          str(self.root / name), "--name", name, "--kill-grace-s", "2",
                          "--discovery", "--discovery-address", "127.0.0.1",
                          "--discovery-port", str(ports[name]), "--peer", f"127.0.0.1:{ports[other]}",
                          "--no-discovery-mdns"),
                    stdout=out, stderr=subprocess.STDOUT, env=env,
                ))  # fmt: skip
        wait_for("two ready nodes", lambda: self.nodes() == ["ready", "ready"], 60, self.logs)

    def nodes(self) -> list[str]:
        return [n["state"] for n in self.admin.get("/api/v1/nodes").json()["items"]]

    def logs(self) -> str:
        return "\n".join(
            f"--- {f}\n" + (self.root / f).read_text()[-5000:]
            for f in ("server.log", *(f"{n}.log" for n in NODES))
            if (self.root / f).exists()
        )

    def member(self, tenant: str) -> str:
        assert self.admin.post("/api/v1/tenants", json={"name": tenant}).status_code == 201
        self.tenants.append(tenant)
        r = self.admin.post("/api/v1/users", json={"name": f"m-{tenant}", "tenant": tenant, "role": "member"})
        assert r.status_code == 201, r.text
        r = self.admin.post("/api/v1/tokens", json={"user": f"m-{tenant}"})
        assert r.status_code == 201, r.text
        return str(r.json()["token"])

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)
        for tenant in self.tenants:
            remove_tenant_user(tenant)


@pytest.fixture
def pool(llama_python: str) -> Iterator[Pool]:
    root = Path("/var/tmp") / f"cpool-coop-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o755)
    p = Pool(root)
    try:
        p.start()
        yield p
    finally:
        p.close()
        kill_jobs_under(root)
        shutil.rmtree(root, ignore_errors=True)


def cli(pool: Pool, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**child_env(), "CPOOL_SERVER": pool.url, "CPOOL_TOKEN": token}
    return subprocess.run(cpool(*args), capture_output=True, text=True, env=env, timeout=60, check=False)


def kill_rpc_server(port: int) -> int:
    """SIGKILL the llama.cpp RPC server listening on `port` (the job's own process); how many."""
    killed = 0
    for proc in psutil.process_iter(["cmdline"]):
        args = proc.info["cmdline"] or []
        if any("ggml_backend_rpc_start_server" in a for a in args) and str(port) in args:
            try:
                proc.send_signal(signal.SIGKILL)
                killed += 1
            except psutil.Error:
                continue
    return killed


def test_a_model_split_over_two_nodes_then_replanned_when_one_fails(
    pool: Pool, llama_python: str, request: pytest.FixtureRequest
) -> None:
    models = job_readable_dir() / f"models-{uuid.uuid4().hex[:8]}"  # the engines' jobs read it
    models.mkdir(mode=0o755)
    request.addfinalizer(lambda: shutil.rmtree(models, ignore_errors=True))
    model = write_tiny_llama(models / "tiny.gguf", seed=11)
    model.chmod(0o644)
    tenant = f"cp{uuid.uuid4().hex[:6]}"
    token = pool.member(tenant)
    user = httpx.Client(base_url=pool.url, headers={"Authorization": f"Bearer {token}"}, timeout=120)

    def plan() -> dict[str, Any]:
        r = user.get("/api/v1/services/big/plan")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def detail() -> str:
        return json.dumps(plan(), indent=1)[-4000:] + "\n" + pool.logs()

    # peers found and verified by both nodes' discovery (the controller's RPC candidates)
    def verified() -> bool:
        rows = pool.admin.get("/api/v1/peers").json()["items"]
        return {(r["observer"], r["node_id"]) for r in rows if r["status"] == "ok"} >= {
            ("coopa", "coopb"), ("coopb", "coopa"),
        }  # fmt: skip

    wait_for("both nodes to verify each other", verified, 60, pool.logs)
    relative = cli(pool, token, "serve", "big", "--cooperative", "--model", "tiny.gguf")
    assert relative.returncode != 0 and "absolute path" in relative.stderr, relative.stderr
    assert "Traceback" not in relative.stderr
    made = cli(pool, token, "serve", "big", "--cooperative", "--model", str(model), "--engine-python",
               llama_python, "--ctx", str(CTX), "--force-split", "2", "--cpus", "1", "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr + made.stdout
    assert json.loads(made.stdout)["spec"]["cooperative"]["force_split"] == 2
    try:
        first = wait_for(
            "the split plan running", lambda: (p := plan())["status"] == "running" and p, 300, detail
        )
        nodes = {s["node"] for s in first["shards"]}
        assert nodes == set(NODES), first
        assert [s["role"] for s in first["shards"]].count("rpc") == 1
        rpc = next(s for s in first["shards"] if s["role"] == "rpc")
        assert rpc["endpoint"] and rpc["endpoint"].startswith("127.0.0.1:")
        assert sum(s["layers"] for s in first["shards"]) == 2  # the tiny model's two layers
        # attempt 1 on a quiet machine; a later one where a start was too slow for its deadline
        assert first["attempt"] >= 1
        assert {c["node"] for c in first["candidates"] if c["tokens_per_s"]} == set(NODES)  # both probed

        direct = subprocess.run([llama_python, "-c", DIRECT, str(model), PROMPT, str(MAX_TOKENS), str(CTX)],
                                capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert direct.returncode == 0, direct.stderr[-2000:]
        want = json.loads(direct.stdout.strip().splitlines()[-1])
        body = {"model": "big", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        r = user.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want["text"]
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS

        shown = cli(pool, token, "services", "explain", "big")
        assert shown.returncode == 0, shown.stderr
        assert "running" in shown.stdout and "rpc" in shown.stdout and rpc["endpoint"] in shown.stdout
        assert all(n in shown.stdout for n in NODES)
        as_json = json.loads(cli(pool, token, "services", "explain", "big", "--json").stdout)
        assert as_json["shards"] == first["shards"] or as_json["attempt"] == first["attempt"]

        # the RPC server dies while a long completion streams: that request fails, and soon
        outcome: dict[str, Any] = {}
        started = threading.Event()

        def stream() -> None:
            events, done = 0, False
            try:
                long = {**body, "max_tokens": CTX - 16, "stream": True}
                with user.stream("POST", "/v1/completions", json=long, timeout=90) as s:
                    outcome["status"] = s.status_code
                    for line in s.iter_lines():
                        if line.startswith("data:"):
                            events += 1
                            started.set()
                            done = done or line.strip() == "data: [DONE]"
                            if '"error"' in line:
                                outcome["error"] = line
            except httpx.HTTPError as e:
                outcome["error"] = f"{type(e).__name__}: {e}"
            outcome["events"], outcome["done"] = events, done
            started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(60)
        port = int(rpc["endpoint"].rsplit(":", 1)[1])
        assert kill_rpc_server(port) >= 1
        t.join(120)
        assert not t.is_alive(), "the request hung after its RPC server died"
        # cut short, not hung, and told: the head exits at once (never a [DONE]) and the gateway ends
        # the stream with an error event
        assert outcome["events"] < CTX - 16 and not outcome["done"], outcome
        assert "error" in outcome, outcome

        again = wait_for(
            "the re-planned service running on the other node",
            lambda: (p := plan())["status"] == "running" and p["attempt"] > first["attempt"] and p,
            300,
            detail,
        )
        assert {s["node"] for s in again["shards"]} == {
            next(s["node"] for s in first["shards"] if s["role"] == "head")
        }
        assert all(s["role"] == "head" for s in again["shards"])
        lost = next(s["node"] for s in first["shards"] if s["role"] == "rpc")
        assert f"RPC server on {lost} failed" in next(
            c["note"] for c in again["candidates"] if c["node"] == lost
        )

        def answer() -> httpx.Response | None:
            x = user.post("/v1/completions", json=body)
            return x if x.status_code == 200 else None

        r = wait_for("an answer again", answer, 120, detail)
        assert r.json()["choices"][0]["text"] == want["text"]
    finally:
        cli(pool, token, "serve", "big", "--delete")

        def nothing_live() -> bool:
            items = pool.admin.get("/api/v1/allocations").json()["items"]
            return not [a for a in items if a["state"] in ("pending", "bound", "active")]

        try:
            wait_for("the service's allocations to end", nothing_live, 60, pool.logs)
        finally:
            user.close()
