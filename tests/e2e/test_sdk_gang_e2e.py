"""Functions over several nodes for real: `cpool server` and two root `cpool agent`s on loopback as two
hosts (their own names, data dirs, caches and addresses 127.0.0.2 / 127.0.0.3); a tenant's member
token; each call one gang whose members run as the tenant's Unix user with the node's python3.11."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import child_env, cpool, free_port, stop, wait_for

from computepool.sdk import Pool, RemoteError, RemoteTraceback

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent"),
    pytest.mark.skipif(not os.access("/usr/bin/python3.11", os.X_OK), reason="members need python3.11"),
    pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the caller must match the node's 3.11"),
]

ADDRESSES = {"sdkgang-a": "127.0.0.2", "sdkgang-b": "127.0.0.3"}


class Hosts:
    """A server, two agents as two hosts, and one tenant with a member token."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"http://127.0.0.1:{free_port()}"
        self.tenant = f"sg{uuid.uuid4().hex[:6]}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        port = self.url.rsplit(":", 1)[1]
        with (self.root / "server.log").open("ab") as out:
            self.procs.append(
                subprocess.Popen(cpool("server", "--data-dir", str(self.root / "srv"), "--port", port),
                                 stdout=out, stderr=subprocess.STDOUT, env=child_env())
            )  # fmt: skip
        wait_for("the server", lambda: httpx.get(f"{self.url}/readyz").is_success, 60, self.logs)
        token = (self.root / "srv" / "admin-token").read_text().strip()
        self.admin = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        join = self.admin.post("/api/v1/join-tokens", json={"single_use": False}).json()["token"]
        for name, address in ADDRESSES.items():
            cmd = cpool("agent", "--server", self.url, "--join-token", join, "--name", name)
            cmd += ["--data-dir", str(self.root / name), "--cache-dir", str(self.root / f"{name}-cache")]
            cmd += ["--address", address, "--kill-grace-s", "1"]
            with (self.root / f"{name}.log").open("ab") as out:
                self.procs.append(
                    subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())
                )
            wait_for(f"node {name} ready", partial(self.ready, name), 60, self.logs)
        assert self.admin.post("/api/v1/tenants", json={"name": self.tenant}).status_code == 201
        user = {"name": f"m-{self.tenant}", "tenant": self.tenant, "role": "member"}
        assert self.admin.post("/api/v1/users", json=user).status_code == 201
        r = self.admin.post("/api/v1/tokens", json={"user": user["name"]})
        assert r.status_code == 201, r.text
        self.token = str(r.json()["token"])

    def ready(self, name: str) -> bool:
        nodes = self.admin.get("/api/v1/nodes").json()["items"]
        return any(n["name"] == name and n["state"] == "ready" and "3.11" in n["pythons"] for n in nodes)

    def allocation(self, alloc_id: int) -> dict[str, Any]:
        return dict(self.admin.get(f"/api/v1/allocations/{alloc_id}").json())

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(self.root.glob("*.log")))

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    root = Path("/var/tmp") / f"cpool-sdkgang-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)  # hidden from tenants: the agent hands the job dirs to their tar as descriptors
    h = Hosts(root)
    try:
        h.start()
        yield h
    finally:
        h.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pool(hosts: Hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pool]:
    monkeypatch.chdir(tmp_path)  # the caller's working dir: nothing of this checkout ships
    with Pool(server=hosts.url, token=hosts.token) as p:
        yield p


def test_a_call_runs_on_both_nodes_and_answers_rank_0s_value(
    pool: Pool, hosts: Hosts, capsys: pytest.CaptureFixture[str]
) -> None:
    @pool.function(nodes=2, cpus=0.2, name="where")
    def where() -> tuple[str, str, str]:
        rank = os.environ["RANK"]
        print(f"rank {rank} says hello", flush=True)
        print(f"rank {rank} warns", file=sys.stderr, flush=True)
        return rank, os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]

    h = where.spawn()
    rank, world, master = h.result(timeout=180)
    assert (rank, world) == ("0", "2") and master in ADDRESSES.values(), hosts.logs()
    out = capsys.readouterr()
    # rank 0's output streams to the caller: its stdout on ours, its stderr on ours
    assert "rank 0 says hello" in out.out and "warns" not in out.out
    assert "rank 0 warns" in out.err and "hello" not in out.err
    alloc = hosts.allocation(h.id)
    assert alloc["state"] == "released" and len(alloc["nodes"]) == 2 and alloc["name"] == "fn-where"
    assert master == ADDRESSES[alloc["nodes"][0]]
    assert alloc["request"]["node_selector"] == {"cpool.io/python-3.11": "yes"}

    @pool.function(nodes=2, cpus=0.2, all_ranks=True, name="everyone")
    def everyone(tag: str) -> tuple[str, str, str, str]:
        import pwd

        user = pwd.getpwuid(os.getuid()).pw_name
        return tag, os.environ["NODE_RANK"], os.environ["CPOOL_PEERS"], user

    got = everyone.remote("t")
    peers = got[0][2]
    assert [g[:2] for g in got] == [("t", "0"), ("t", "1")] and set(peers.split(",")) == set(
        ADDRESSES.values()
    )
    assert all(g[2] == peers and g[3] == f"cpool-{hosts.tenant}" for g in got), got
    assert [[g[:2] for g in item] for item in everyone.map(["a", "b"])] == [
        [("a", "0"), ("a", "1")],
        [("b", "0"), ("b", "1")],
    ]


def test_a_map_runs_one_gang_per_item_in_order(pool: Pool) -> None:
    @pool.function(nodes=2, cpus=0.2, name="square")
    def square(x: int) -> tuple[int, str]:
        return x * x, os.environ["WORLD_SIZE"]

    assert list(square.map([3, 4])) == [(9, "2"), (16, "2")]


def test_an_exception_on_rank_1_is_raised_here_naming_its_rank(pool: Pool, hosts: Hosts) -> None:
    @pool.function(nodes=2, cpus=0.2, name="rank1fails")
    def fails(n: int) -> str:
        if os.environ["NODE_RANK"] == "1":
            raise ValueError(f"rank 1 refuses {n}")
        return "rank 0 is fine"

    h = fails.spawn(5)
    with pytest.raises(ValueError, match="rank 1 refuses 5") as info:
        h.result(timeout=180)
    assert any(f"allocation {h.id}, rank 1 of 2" in n for n in info.value.__notes__), info.value.__notes__
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback) and cause.text.rstrip().endswith("ValueError: rank 1 refuses 5")
    assert f'File "{__file__}"' in cause.text  # the caller's own file and line
    assert hosts.allocation(h.id)["state"] == "failed"


def test_a_member_killed_mid_run_fails_the_call_with_the_gangs_reason(pool: Pool, hosts: Hosts) -> None:
    @pool.function(nodes=2, cpus=0.2, name="killed")
    def killed() -> None:
        import time

        if os.environ["NODE_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)  # rank 0 waits, as in a collective, until the gang ends it

    h = killed.spawn()
    with pytest.raises(
        RemoteError, match=r"failed: rank 1 on node sdkgang-\w .*\(no outcome from ranks 0, 1\)"
    ):
        h.result(timeout=180)
    members = hosts.allocation(h.id)["members"]
    assert [(m["state"], m["exit_code"]) for m in members] == [("stopped", None), ("failed", 137)], members
    assert "killed by signal 9" in members[1]["reason"]


def test_pip_builds_each_members_environment(pool: Pool, hosts: Hosts) -> None:
    @pool.function(nodes=2, cpus=0.2, pip=["six"], all_ranks=True, name="gangpip")
    def with_six() -> tuple[str, str]:
        import six  # type: ignore[import-untyped]

        return six.__version__, sys.prefix

    got = with_six.remote()
    assert all(version for version, _ in got) and len(got) == 2
    caches = sorted(str(hosts.root / f"{n}-cache" / hosts.tenant / "envs") for n in ADDRESSES)
    assert sorted(prefix.rsplit("/", 1)[0] for _, prefix in got) == caches  # one env per node, its own
