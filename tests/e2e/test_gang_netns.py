"""Two hosts as one compute domain, for real: a control plane and two agents in two network namespaces
joined by a veth pair (netns.py), a 2-node gang from `cpool run --nodes 2` whose members run
torch.distributed over gloo across the veth, and a member killed mid-run that ends the gang.

The jobs run as the tenant's user with the PyTorch CPU build of scripts/torch-venv.sh (env
CPOOL_TEST_TORCH_VENV, default /opt/computepool-test/torch-venv): missing, these tests skip, and
fail in CI (CI=true), where .ci/run builds it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import alive, wait_for
from netns import Cluster, HostsUnavailable, two_hosts

TORCH_VENV = Path(os.environ.get("CPOOL_TEST_TORCH_VENV") or "/opt/computepool-test/torch-venv")


# Each member joins the gang's rendezvous at MASTER_ADDR:MASTER_PORT (env://), sums rank + 1 over
# both, and prints what it saw as one JSON line, with which members' addresses are its own.
ALLREDUCE = """
import datetime, json, os, socket
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=40))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
peers = os.environ["CPOOL_PEERS"].split(",")
node_rank = int(os.environ["NODE_RANK"])
def here(addr):
    with socket.socket() as s:
        try:
            s.bind((addr, 0))
            return True
        except OSError:
            return False
print("RESULT " + json.dumps({
    "local": [here(p) for p in peers],
    "rank": dist.get_rank(), "node_rank": node_rank, "world": dist.get_world_size(),
    "master_addr": os.environ["MASTER_ADDR"], "peers": peers, "me": peers[node_rank], "sum": t.item(),
}), flush=True)
dist.barrier()
dist.destroy_process_group()
"""

# After one all_reduce both members only sleep: rank 0 must end because the gang ends, not because
# its peer's socket closed under it.
REDUCE_THEN_SLEEP = """
import datetime, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=40))
t = torch.tensor([1.0])
dist.all_reduce(t)
print("reduced", t.item(), flush=True)
time.sleep(150)
"""


def torch_python() -> str:
    """The venv's python, checked to import torch with gloo as any user may; else skip (fail in CI)."""
    py = TORCH_VENV / "bin" / "python"
    why = ""
    if not py.exists():
        why = "it does not exist"
    elif not all(os.stat(d).st_mode & 0o001 for d in py.parents):
        why = "a tenant's user cannot enter it"
    else:
        r = subprocess.run(
            [str(py), "-c", "import torch.distributed as d; assert d.is_gloo_available()"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        if r.returncode != 0:
            why = f"torch with gloo does not import: {r.stderr.strip()[-300:]}"
    if why:
        msg = (
            f"the torch venv {TORCH_VENV} is not usable ({why}): build it with "
            f"`scripts/torch-venv.sh {TORCH_VENV}` or point CPOOL_TEST_TORCH_VENV at one"
        )
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    return str(py)


@pytest.fixture(scope="module")
def venv_python() -> str:
    return torch_python()


@pytest.fixture(scope="module")
def cluster(venv_python: str) -> Iterator[Cluster]:
    root = Path("/var/tmp") / f"cpt-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    root.mkdir(mode=0o755)
    try:
        with contextlib.ExitStack() as stack:
            try:
                hosts = stack.enter_context(two_hosts())
            except HostsUnavailable as e:
                pytest.skip(f"two hosts cannot be made on this machine: {e}")
            if hosts.a.netns:
                print(f"\n{hosts.note}")
            else:  # said in the run's summary, not only when a test fails
                warnings.warn(hosts.note, stacklevel=1)
            c = Cluster(hosts, root)
            try:
                c.start()
                yield c
            finally:
                c.close()
            left = hosts.leftover_pids()
            assert not left, f"processes left in the namespaces after the pool stopped: {left}"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def job_id(stderr: str) -> int:
    m = re.search(r"\bjob (\d+)\b", stderr)
    assert m, f"no job id in cpool run's output: {stderr!r}"
    return int(m.group(1))


def member_stdout(c: Cluster, alloc_id: int, rank: int) -> str:
    r = c.pool.http.get(f"/api/v1/allocations/{alloc_id}/logs", params={"rank": rank})
    assert r.status_code == 200, r.text
    return str(r.json()["stdout"]["data"])


def result_line(text: str, prefix: str = "") -> dict[str, Any] | None:
    for line in text.splitlines():
        if line.startswith(prefix + "RESULT "):
            return dict(json.loads(line.removeprefix(prefix + "RESULT ")))
    return None


def test_two_node_gang_all_reduces_across_hosts(cluster: Cluster, venv_python: str) -> None:
    c, hosts = cluster, cluster.hosts
    r = c.cli("run", "--nodes", "2", "--gpus-per-node", "0", "--cpus", "1", "--time-limit", "2m",
              "--", venv_python, "-c", ALLREDUCE, timeout=150)  # fmt: skip
    alloc_id = job_id(r.stderr)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n{c.logs()}"

    job = c.pool.get(alloc_id)
    assert job["state"] == "released" and job["exit_code"] == 0, job
    members = job["members"]
    assert [m["rank"] for m in members] == [0, 1] and [m["node"] for m in members] == job["nodes"]
    by_node = {hosts.a.name: hosts.a.address, hosts.b.name: hosts.b.address}
    assert {m["node"]: m["address"] for m in members} == by_node, members
    assert all(m["state"] == "exited" and m["exit_code"] == 0 for m in members), members

    # `cpool run` printed every member's output, each line prefixed; `cpool logs --rank 1` one's
    out0 = result_line(r.stdout, "[rank 0] ")
    assert result_line(r.stdout, "[rank 1] ") is not None, r.stdout
    logs1 = c.cli("logs", str(alloc_id), "--rank", "1", timeout=60)
    assert logs1.returncode == 0, logs1.stderr
    out1 = result_line(logs1.stdout)
    assert out0 is not None and out1 is not None, f"{r.stdout}\n---\n{logs1.stdout}\n{logs1.stderr}"
    assert result_line(member_stdout(c, alloc_id, 1)) == out1

    master = members[0]["address"]
    peers = [m["address"] for m in members]
    for rank, out in enumerate((out0, out1)):
        assert out["rank"] == out["node_rank"] == rank and out["world"] == 2, out
        assert out["sum"] == 3.0, out
        assert out["master_addr"] == master and out["peers"] == peers, out
        assert out["me"] == peers[rank], out
    assert out1["me"] != out1["master_addr"]
    print(f"rank 0 saw {out0}\nrank 1 saw {out1}")
    if hosts.a.netns:  # two hosts indeed: each member holds its own address and not the other's
        assert out0["local"] == [True, False] and out1["local"] == [False, True], (out0, out1)
    assert {n["name"]: n["address"] for n in c.pool.nodes()} == by_node
    assert not c.job_processes(alloc_id, 0, venv_python) and not c.job_processes(alloc_id, 1, venv_python)


def test_a_member_killed_mid_run_ends_the_gang(cluster: Cluster, venv_python: str, tmp_path: Path) -> None:
    c, hosts = cluster, cluster.hosts
    out = tmp_path / "run.out"
    run = c.cli_popen("run", "--nodes", "2", "--cpus", "1", "--time-limit", "3m",
                      "--", venv_python, "-c", REDUCE_THEN_SLEEP, out=out)  # fmt: skip
    try:
        alloc_id = wait_for("the job's id", lambda: job_id(out.read_text()) if "job " in out.read_text()
                            else None, 60, lambda: out.read_text() + c.logs())  # fmt: skip
        wait_for("both members to reduce", lambda: all(
            "reduced 2.0" in member_stdout(c, alloc_id, rank) for rank in (0, 1)), 60,
            lambda: out.read_text() + c.logs())  # fmt: skip
        job = c.pool.get(alloc_id)
        rank1_node = job["members"][1]["node"]
        victims, survivors = (c.job_processes(alloc_id, rank, venv_python) for rank in (1, 0))
        assert len(victims) == len(survivors) == 1, (victims, survivors)
        victim, survivor = victims[0], survivors[0]

        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for("the gang to fail", lambda: c.pool.state(alloc_id) == "failed", 20, c.logs)
        wait_for("rank 0's process to stop", lambda: not alive(survivor.pid), 15, c.logs)
        stopped_after = time.monotonic() - killed_at

        job = c.pool.get(alloc_id)
        assert "rank 1" in job["reason"] and rank1_node in job["reason"], job["reason"]
        m0, m1 = job["members"]
        assert m1["state"] in ("exited", "failed") and m1["exit_code"] != 0, m1
        assert m0["state"] == "stopped" and "rank 1" in m0["reason"], m0
        assert run.wait(30) != 0
        text = out.read_text()
        assert "rank 1" in text and "Traceback" not in text, text
        print(f"rank 0 stopped {stopped_after:.1f} s after rank 1 was killed on {rank1_node}")
        assert not c.job_processes(alloc_id, 0, venv_python) and not c.job_processes(alloc_id, 1, venv_python)
        assert {hosts.a.name, hosts.b.name} == set(job["nodes"])
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGTERM)  # `cpool run` cancels its job on SIGTERM
            run.wait(30)
