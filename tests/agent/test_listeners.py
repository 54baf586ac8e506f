"""Who listens on a replica's port, found in the real /proc: a job of the executor listening on
its port is "own", a process outside the job holding the port is "other", a free port "none";
over IPv4 and, where the machine has ::1, IPv6. The watcher reports changes (the e2e test
tests/e2e/test_replica_listener_e2e.py follows them to the control plane)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from computepool.agent.executor import Executor, JobSpec
from computepool.agent.listeners import IP, ListenerWatch, Replica, classify, listening, node_ip, reaching

LISTEN = """
import socket, sys, time
family = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
s = socket.socket(family, socket.SOCK_STREAM)
if family == socket.AF_INET6 and sys.argv[3:] == ["v6only"]:
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("listening", flush=True)
time.sleep(600)
"""


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def have_ipv6() -> bool:
    try:
        free_port("::1")
    except OSError:
        return False
    return True


def wait_listening(port: int) -> None:
    deadline = time.monotonic() + 20
    while port not in listening():
        assert time.monotonic() < deadline, f"nothing came to listen on port {port}"
        time.sleep(0.05)


@pytest.fixture
def stranger() -> Iterator[Any]:
    """Start a process that is not the job's (a child of the test, not of the executor)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(host: str, port: int, *flags: str) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(
            [sys.executable, "-c", LISTEN, host, str(port), *flags], stdout=subprocess.DEVNULL
        )
        procs.append(p)
        wait_listening(port)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def job(executor: Executor, alloc: str, host: str, port: int) -> str:
    """The job listening on `port` is run by the executor (a wrapper, the command its child)."""
    rec = executor.start(JobSpec(alloc, 1, [sys.executable, "-c", LISTEN, host, str(port)]))
    assert rec.state.value == "running", rec.reason
    wait_listening(port)
    return rec.key


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_own_other_and_none(executor: Executor, stranger: Any, host: str) -> None:
    if host == "::1" and not have_ipv6():
        pytest.skip("this machine has no ::1")
    mine, theirs, free = free_port(host), free_port(host), free_port(host)
    key = job(executor, "1", host, mine)
    intruder = stranger(host, theirs)
    pids = frozenset(executor.job_pids(key))
    assert intruder.pid not in pids
    sockets = listening()

    assert classify(Replica(key, mine, pids), sockets) == ("own", set())
    status, foreign = classify(Replica(key, theirs, pids), sockets)
    assert status == "other" and foreign == set(sockets[theirs])
    assert classify(Replica(key, free, pids), sockets) == ("none", set())
    # the port of another job of the same node is "other" too: only this job's processes count
    other_job = job(executor, "2", host, free)
    assert (
        classify(Replica(other_job, mine, frozenset(executor.job_pids(other_job))), listening())[0] == "other"
    )


def test_another_family_beside_the_replica_is_not_its_listener(executor: Executor, stranger: Any) -> None:
    """An IPv6-only listener on `[::]:P` beside the replica's `0.0.0.0:P` takes none of the
    connections to the node's IPv4 address: the replica stays "own", whatever the node's address
    (an unknown one included); for an IPv6 node address the stranger would take them: "other"."""
    if not have_ipv6():
        pytest.skip("this machine has no IPv6")
    port = free_port("::")
    intruder = stranger("::", port, "v6only")
    key = job(executor, "3", "0.0.0.0", port)
    deadline = time.monotonic() + 60
    while len(listening().get(port, {})) < 2:  # the stranger's and the job's
        assert time.monotonic() < deadline, listening().get(port)
        time.sleep(0.05)
    sockets = listening()
    pids = frozenset(executor.job_pids(key))  # once it listens: the process that does is among them
    for address in ("127.0.0.1", "10.0.0.5", None, "node-1.example.org", "::ffff:127.0.0.1"):
        assert classify(Replica(key, port, pids, address=address), sockets) == ("own", set()), address
    status, foreign = classify(Replica(key, port, pids, address="::1"), sockets)
    assert status == "other" and len(foreign) == 1
    assert intruder.pid not in pids


def ip(address: str) -> IP:
    found = node_ip(address)
    assert found is not None, address
    return found


def test_the_kernel_picks_the_listener_of_the_address_first() -> None:
    """Which socket takes a connection to an address: the one bound to it, else its family's
    wildcard, else a dual-stack ::."""
    sockets = {1: ip("127.0.0.1"), 2: ip("0.0.0.0"), 3: ip("::"), 4: ip("10.0.0.5")}
    assert reaching(sockets, ip("127.0.0.1")) == {1}
    assert reaching(sockets, ip("10.0.0.6")) == {2}
    assert reaching({3: sockets[3]}, ip("10.0.0.6")) == {3}
    assert reaching({2: sockets[2]}, ip("fd00::1")) == set()
    assert reaching(sockets, ip("[::ffff:10.0.0.5]")) == {4}
    assert node_ip("node-1.example.org") is None and node_ip(None) is None


def test_a_squatter_then_the_job(executor: Executor, stranger: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The watcher sees the port taken by another process, then by the job once it is free again;
    each change wakes the agent, and the intruder is named in the agent's log only."""
    port = free_port()
    intruder = stranger("127.0.0.1", port)
    retry = "\n".join(
        [
            "import socket, sys, time",
            "while True:",
            "    try:",
            "        s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); break",
            "    except OSError:",
            "        s.close(); time.sleep(0.1)",
            "time.sleep(600)",
        ]
    )
    rec = executor.start(JobSpec("7", 1, [sys.executable, "-c", retry, str(port)]))
    changes: list[dict[str, str]] = []
    replicas = [Replica(rec.key, port, frozenset())]
    watch = ListenerWatch(lambda: replicas, lambda: changes.append(watch.found()), every_s=0.1)

    def scan() -> str:
        replicas[0] = Replica(rec.key, port, frozenset(executor.job_pids(rec.key)))
        return watch.scan()[rec.key]

    with caplog.at_level("WARNING", logger="computepool.agent"):
        assert scan() == "other"
        assert scan() == "other"  # the same finding: no change, no second warning
    assert changes == [{rec.key: "other"}]
    [warning] = [r.getMessage() for r in caplog.records if "held by another process" in r.getMessage()]
    assert f"pid {intruder.pid}" in warning and f"port {port}" in warning

    intruder.kill()
    intruder.wait()
    deadline = time.monotonic() + 20
    while scan() != "own":
        assert time.monotonic() < deadline, "the job never came to listen"
        time.sleep(0.1)
    assert changes[-1] == {rec.key: "own"}
