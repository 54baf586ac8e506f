"""A real engine behind the gateway: llama.cpp (llama-cpp-python's OpenAI-compatible server, from the
llama venv of scripts/llama-venv.sh) serving the tiny GGUF model as a pool service.

A `cpool server` and a root `cpool agent` on loopback; the service is created with `cpool serve` by a
member of one tenant, its replica runs as that tenant's Unix user, and everything then goes through
the gateway at <server>/v1 with pool tokens: the completions are llama.cpp's own, token for token
(compared with llama_cpp.Llama run directly on the same file), streamed or not, and the usage the
gateway records holds the engine's token counts. Another tenant's member gets 404, a wrong token 401.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
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
CHAT = [{"role": "user", "content": "Say something."}]

# llama_cpp.Llama on the same file with the server's own defaults for each request (at temperature 0
# only the penalties matter): what the gateway's answers must equal.
DIRECT = """
import json, sys
from llama_cpp import Llama
from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest
m = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=1, verbose=False)
prompt, max_tokens, chat = sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
c = m.create_completion(prompt, max_tokens=max_tokens, temperature=0.0,
                        repeat_penalty=CreateCompletionRequest.model_fields["repeat_penalty"].default)
h = m.create_chat_completion(chat, max_tokens=max_tokens, temperature=0.0,
                             repeat_penalty=CreateChatCompletionRequest.model_fields["repeat_penalty"].default)
print(json.dumps({"text": c["choices"][0]["text"], "usage": c["usage"],
                  "chat": h["choices"][0]["message"]["content"], "chat_usage": h["usage"]}))
"""


class Pool:
    """`cpool server` and a root `cpool agent`, with their data dirs and the model under ROOT."""

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
        join = self.admin.post("/api/v1/join-tokens", json={}).json()["token"]
        with (self.root / "agent.log").open("ab") as out:
            self.procs.append(subprocess.Popen(
                cpool("agent", "--server", self.url, "--join-token", join, "--data-dir",
                      str(self.root / "agent"), "--name", "llama", "--kill-grace-s", "2"),
                stdout=out, stderr=subprocess.STDOUT, env=env,
            ))  # fmt: skip
        wait_for("the node", lambda: self.nodes() == ["ready"], 60, self.logs)

    def nodes(self) -> list[str]:
        return [n["state"] for n in self.admin.get("/api/v1/nodes").json()["items"]]

    def logs(self) -> str:
        return "\n".join(
            f"--- {f}\n" + (self.root / f).read_text()[-6000:]
            for f in ("server.log", "agent.log")
            if (self.root / f).exists()
        )

    def member(self, tenant: str) -> str:
        """A new tenant with one member; that member's token."""
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
    root = job_readable_dir() / f"cpool-llama-{uuid.uuid4().hex[:8]}"  # the job reads the model here
    root.mkdir(mode=0o755)
    p = Pool(root)
    try:
        p.start()
        yield p
    finally:
        p.close()
        kill_jobs_under(root)
        shutil.rmtree(root, ignore_errors=True)


def as_user(pool: Pool, token: str) -> httpx.Client:
    return httpx.Client(base_url=pool.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def cli(pool: Pool, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**child_env(), "CPOOL_SERVER": pool.url, "CPOOL_TOKEN": token}
    return subprocess.run(cpool(*args), capture_output=True, text=True, env=env, timeout=60, check=False)


def service(client: httpx.Client, name: str) -> dict[str, Any]:
    r = client.get(f"/api/v1/services/{name}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def sse_texts(client: httpx.Client, path: str, body: dict[str, Any]) -> list[str]:
    """The text of each event of a streamed answer, in order, up to `data: [DONE]`."""
    texts: list[str] = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return texts
            choice = json.loads(data)["choices"][0]
            texts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    raise AssertionError(f"the stream ended without [DONE] after {len(texts)} events")


def test_llama_cpp_service_behind_the_gateway(pool: Pool, llama_python: str) -> None:
    models = pool.root / "models"
    models.mkdir(mode=0o755)
    model = write_tiny_llama(models / "tiny.gguf", seed=7)
    model.chmod(0o644)
    tenant, other = f"lm{uuid.uuid4().hex[:6]}", f"lo{uuid.uuid4().hex[:6]}"
    token, other_token = pool.member(tenant), pool.member(other)

    # the engine is started by a shell in the replica, which gives it the port the pool chose and
    # the replica's key: the engine then answers only the gateway (and the controller's checks)
    engine = (f"{llama_python} -m llama_cpp.server --model {model} --host 127.0.0.1 --n_ctx 256 --n_threads 1"
              " --interrupt_requests False")  # fmt: skip
    command = f"exec {engine} --port $PORT --api_key $CPOOL_SERVICE_KEY"
    made = cli(pool, token, "serve", "tiny", "--command", command,
               "--port-env", "PORT", "--cpus", "0.5", "--min", "1", "--max", "1", "--no-code",
               "--health-path", "/v1/models", "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr + made.stdout
    assert json.loads(made.stdout)["name"] == "tiny"

    user, stranger = as_user(pool, token), as_user(pool, other_token)
    try:
        wait_for("a ready replica", lambda: service(user, "tiny")["ready"] >= 1, 180,
                 lambda: json.dumps(service(user, "tiny"), indent=1) + "\n" + pool.logs())  # fmt: skip
        listed = cli(pool, token, "services", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [s["name"] for s in json.loads(listed.stdout)] == ["tiny"]

        r = user.get("/v1/models")
        assert r.status_code == 200, r.text
        assert [(m["id"], m["owned_by"]) for m in r.json()["data"]] == [("tiny", tenant)]
        # past the gateway, straight to the replica's port: the engine wants the replica's key,
        # on its health path too (the controller found it ready by showing the key)
        endpoint = service(user, "tiny")["replicas"][0]["endpoint"]
        for path in ("/v1/models", "/v1/completions"):
            r = httpx.request("GET" if path == "/v1/models" else "POST", endpoint + path,
                              json=None if path == "/v1/models" else {"prompt": "x", "max_tokens": 1},
                              headers={"Authorization": f"Bearer {token}"}, timeout=10)  # fmt: skip
            assert r.status_code == 401, (path, r.text)

        direct = subprocess.run(
            [llama_python, "-c", DIRECT, str(model), PROMPT, str(MAX_TOKENS), json.dumps(CHAT)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert direct.returncode == 0, direct.stderr[-2000:]
        want = json.loads(direct.stdout.strip().splitlines()[-1])

        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        r = user.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["choices"][0]["text"] == want["text"]
        assert got["usage"] == want["usage"]
        assert got["usage"]["completion_tokens"] == MAX_TOKENS  # the tiny model never ends early

        chunks = sse_texts(user, "/v1/completions", body)
        assert "".join(chunks) == want["text"]
        assert len([c for c in chunks if c]) == MAX_TOKENS  # one event per token, passed through

        chat = {"model": "tiny", "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
        r = user.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want["chat"]
        assert r.json()["usage"] == want["chat_usage"]

        # another tenant's member: no such model; a wrong token: not let in
        r = stranger.post("/v1/completions", json=body)
        assert r.status_code == 404, r.text
        assert "error" in r.json()
        assert stranger.get("/v1/models").json()["data"] == []
        r = httpx.post(f"{pool.url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401, r.text
        assert set(r.json()["error"]) >= {"message", "type", "code"}

        # what the gateway recorded: 3 answered requests of the member, with the engine's counts
        # (the stream's completion tokens are its events carrying text)
        def usage() -> dict[str, int] | None:
            rows = user.get("/api/v1/gateway/usage", params={"service": "tiny"}).json()["items"]
            total = {k: sum(int(row[k]) for row in rows) for k in ("requests", "failed", "completion_tokens")}
            total["prompt_tokens"] = sum(int(row["prompt_tokens"]) for row in rows)
            return total if total["requests"] >= 3 else None

        total = wait_for("usage recorded", usage, 20)
        assert total["requests"] == 3 and total["failed"] == 0, total
        assert total["completion_tokens"] == 2 * MAX_TOKENS + want["chat_usage"]["completion_tokens"], total
        assert total["prompt_tokens"] >= want["usage"]["prompt_tokens"] + want["chat_usage"]["prompt_tokens"]
        assert stranger.get("/api/v1/gateway/usage").json()["items"] == []

        # deleted: the replica goes, and so does the model
        gone = cli(pool, token, "serve", "tiny", "--delete")
        assert gone.returncode == 0, gone.stderr
        wait_for("the replica to end", lambda: not [
            a for a in pool.admin.get("/api/v1/allocations").json()["items"]
            if a["state"] in ("pending", "bound", "active")
        ], 60, pool.logs)  # fmt: skip
        assert user.get("/v1/models").json()["data"] == []
    finally:
        user.close()
        stranger.close()


def test_an_engine_that_never_listens_is_not_routed_to(pool: Pool, llama_python: str) -> None:
    """A replica whose engine cannot load its model never becomes ready: the gateway does not send
    it requests (the request waits, then times out with a clear error), and the service says why."""
    tenant = f"lb{uuid.uuid4().hex[:6]}"
    token = pool.member(tenant)
    engine = f"{llama_python} -m llama_cpp.server --model /nonexistent.gguf --host 127.0.0.1"
    made = cli(pool, token, "serve", "broken", "--command", f"exec {engine} --port $PORT",
               "--cpus", "0.5", "--min", "1", "--max", "1", "--no-code", "--queue-timeout", "3s")  # fmt: skip
    assert made.returncode == 0, made.stderr + made.stdout
    with as_user(pool, token) as user:
        start = time.monotonic()
        r = user.post("/v1/completions", json={"model": "broken", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert time.monotonic() - start >= 2.5  # it waited for a replica before it gave up
        assert "error" in r.json()
        assert service(user, "broken")["ready"] == 0
