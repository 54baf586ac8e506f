"""A process job's network and Landlock scopes, with real tenant users, namespaces, slirp4netns and
child processes (needs root): jobnet.py and landlock.py through the executor.

The cross-tenant attacks through a real pool are in tests/attacks/test_network.py; here, what a job
sees, the jobs that keep the node's network (still scoped), and what a host without the kernel's
or the tools' support gets instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from computepool.agent import jobnet, landlock
from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec, SandboxConfig
from computepool.agent.localstate import JobState
from computepool.agent.sandbox import HostSupport, probe, wrap
from computepool.agent.tenants import remove_tenant_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and namespaces need root")

PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
RANGE = (62000, 62999)

# What the job sees of its network: its interfaces and their MTUs, and the abstract socket it dials.
SEE = r"""
import fcntl, json, socket, struct, sys
names = sorted(n for _, n in socket.if_nameindex())
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as d:
    mtu = {n: struct.unpack("16si20x", fcntl.ioctl(d, 0x8921, struct.pack("16si20x", n.encode(), 0)))[1]
           for n in names}
out = {"ifaces": names, "mtu": mtu}
s = socket.socket(socket.AF_UNIX)
try:
    s.connect("\0" + sys.argv[1]); out["abstract"] = s.recv(16).decode()
except OSError as e:
    out["abstract"] = type(e).__name__
print(json.dumps(out), flush=True)
"""
SERVE = r"""
import socket, sys, time
u = socket.socket(socket.AF_UNIX)
u.bind("\0" + sys.argv[1]); u.listen()
print("ready", flush=True)
end = time.time() + 60
while time.time() < end:
    c = u.accept()[0]; c.sendall(b"SECRET"); c.close()
"""


@pytest.fixture(scope="module")
def tenants() -> Iterator[list[str]]:
    names = [f"n{uuid.uuid4().hex[:8]}", f"n{uuid.uuid4().hex[:8]}"]
    yield names
    for n in names:
        remove_tenant_user(n, RANGE)


@pytest.fixture(scope="module")
def sandboxed() -> Iterator[Executor]:
    d = Path("/var/tmp") / f"cpool-jobnet-{uuid.uuid4().hex[:8]}"
    d.mkdir(mode=0o755)
    ex = Executor(d / "agent", cgroup_base=None, kill_grace_s=2.0, sandbox=SandboxConfig(uid_range=RANGE))
    yield ex
    for rec in ex.running():
        ex.kill(rec.key, "test teardown", grace_s=0)
    ex.state.close()
    shutil.rmtree(d, ignore_errors=True)


def _out(run_dir: str) -> str:
    return (Path(run_dir) / STDOUT_LOG).read_text()


def _serve(ex: Executor, tenant: str, name: str, key: str) -> str:
    rec = ex.start(JobSpec(key, 1, [PY, "-c", SERVE, name], tenant=tenant, host_network=True))
    deadline = time.monotonic() + 20
    while "ready" not in _out(rec.run_dir):
        assert time.monotonic() < deadline and ex.get(rec.key).state is JobState.RUNNING  # type: ignore[union-attr]
        time.sleep(0.05)
    return rec.key


def _see(ex: Executor, spec: JobSpec) -> tuple[dict[str, object], str]:
    done = ex.wait(ex.start(spec).key, 30)
    assert done.state is JobState.SUCCEEDED, (done.reason, (Path(done.run_dir) / "stderr.log").read_text())
    return json.loads(_out(done.run_dir)), done.limits


@pytest.mark.skipif(landlock.probe() != "", reason="this kernel has no Landlock scopes")
def test_jobs_on_the_nodes_network_are_still_scoped(sandboxed: Executor, tenants: list[str]) -> None:
    """A gang member's or a replica's job keeps the node's network: another tenant's job there
    cannot connect to its abstract socket (Landlock), while the agent's side still can."""
    name = f"cpool-jn-{uuid.uuid4().hex[:8]}"
    victim = _serve(sandboxed, tenants[0], name, f"v{uuid.uuid4().hex[:6]}")
    try:
        seen, limits = _see(
            sandboxed,
            JobSpec(
                f"a{uuid.uuid4().hex[:6]}", 1, [PY, "-c", SEE, name], tenant=tenants[1], host_network=True
            ),
        )
        assert seen["abstract"] == "PermissionError", seen
        assert landlock.SUMMARY in limits and jobnet.SUMMARY not in limits
        assert "tap0" not in seen["ifaces"] and len(seen["ifaces"]) > 1  # the node's interfaces
        import socket  # noqa: PLC0415 - the node's side: outside every job's domain

        with socket.socket(socket.AF_UNIX) as s:
            s.connect("\0" + name)
            assert s.recv(16) == b"SECRET"
    finally:
        sandboxed.kill(victim, "done", grace_s=0)


@pytest.mark.skipif(shutil.which("slirp4netns") is None, reason="no slirp4netns")
def test_a_job_gets_its_own_network_and_its_slirp4netns_ends_with_it(
    sandboxed: Executor, tenants: list[str]
) -> None:
    name = f"cpool-jn-{uuid.uuid4().hex[:8]}"
    victim = _serve(sandboxed, tenants[0], name, f"v{uuid.uuid4().hex[:6]}")
    try:
        with _named_netns() as named:
            spec = JobSpec(f"o{uuid.uuid4().hex[:6]}", 1, [PY, "-c", SEE, name], tenant=tenants[0])
            seen, limits = _see(sandboxed, spec)
            # the node's named namespaces (`ip netns`, podman's) are still there: slirp4netns's
            # sandbox unmounted them all through /run/netns's shared mount before it got its own
            r = subprocess.run(["ip", "netns", "exec", named, "true"], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
    finally:
        sandboxed.kill(victim, "done", grace_s=0)
    # even its own tenant's abstract socket on the node is out of reach: another namespace
    assert seen == {
        "ifaces": ["lo", "tap0"],
        "mtu": {"lo": 65536, "tap0": jobnet.MTU},
        "abstract": "ConnectionRefusedError",
    }
    assert jobnet.SUMMARY in limits
    # no slirp4netns outlives the job it served (its argv names the job's first pid)
    deadline = time.monotonic() + 10
    while _orphaned_slirps() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _orphaned_slirps()


@contextlib.contextmanager
def _named_netns() -> Iterator[str]:
    if shutil.which("ip") is None:
        pytest.skip("no `ip` (iproute2)")
    name = f"cpool-jn-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def _orphaned_slirps() -> list[str]:
    """Live slirp4netns processes whose job's first process is gone."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if (
            argv[0].endswith(b"slirp4netns")
            and state != "Z"
            and not Path(f"/proc/{argv[-3].decode()}").exists()
        ):
            out.append(pid)
    return out


def test_without_the_kernels_or_the_tools_support_a_job_says_what_it_lacks() -> None:
    host = probe(SandboxConfig(uid_range=RANGE))
    bare = replace(host, scope_why_not="this kernel has no Landlock", slirp=None)
    user = pwd.getpwuid(0)
    argv, applied = wrap(["true"], user, Path("/nonexistent"), bare, own_network=True)
    assert "no landlock scopes: this kernel has no Landlock" in applied
    assert "the node's network: slirp4netns is not installed" in applied
    assert "--scope" not in argv and "--own-network" not in argv
    argv, applied = wrap(["true"], user, Path("/nonexistent"), host, own_network=True)
    if host.slirp and not host.scope_why_not:
        i = argv.index("--own-network")
        assert argv[i + 1] == host.slirp and "--scope" in argv and argv.index("--") > i
    none = HostSupport(root=False, setpriv=None, unshare=None, namespaces=False)
    argv, applied = wrap(["true"], user, Path("/nonexistent"), none, own_network=True)
    assert argv == ["true"] and applied == ["no landlock scopes: not probed"]


def test_the_launcher_refuses_what_it_cannot_read() -> None:
    assert jobnet.parse(["--own-network"]) is None and jobnet.parse(["--bogus", "--", "x"]) is None
    assert jobnet.parse(["--scope", "--"]) is None
    assert jobnet.parse(["--own-network", "-", "--scope", "--", "x"]) == (None, True, True, None, ["x"])
    opts = jobnet.options("/s", True, True, 61000)
    assert jobnet.parse([*opts, "--", "x"]) == ("/s", True, True, 61000, ["x"])
    assert jobnet.parse(["--slirp-group", "x", "--", "y"]) is None
    assert jobnet.main(["--nope"]) == 2


def test_a_job_on_a_node_with_a_loopback_resolver_asks_slirp4netns(tmp_path: Path) -> None:
    """systemd-resolved's 127.0.0.53 is not on the job's loopback: its resolv.conf names
    slirp4netns's DNS address, which forwards there; the node's own file stays as it was."""
    assert jobnet.job_resolv("nameserver 10.1.2.3\n") is None
    node = "search corp.internal\nnameserver 127.0.0.53\nnameserver ::1\noptions edns0 trust-ad\n"
    assert jobnet.job_resolv(node) == "search corp.internal\nnameserver 10.0.2.3\noptions edns0 trust-ad\n"
    if shutil.which("slirp4netns") is None:
        pytest.skip("no slirp4netns")
    fake = tmp_path / "resolv.conf"
    fake.write_text(node)
    launch = shlex.join(
        [
            *jobnet.launcher_argv(jobnet.options(shutil.which("slirp4netns"), True, False)),
            "cat",
            jobnet.RESOLV,
        ]
    )
    script = f'mount --bind "$1" {jobnet.RESOLV} && exec {launch}'  # the node's file, in a mount ns
    r = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script, "sh", str(fake)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0 and r.stdout == jobnet.job_resolv(node), r.stderr
    assert Path(jobnet.RESOLV).read_text() != r.stdout
