"""The port guard on real sockets of this process: a listener on a reserved port its job was not
given stops the job on the second pass in a row; a given port, a port outside the ranges and one
the kernel may hand out by itself do not."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from computepool.agent.port_guard import (
    GuardedJob,
    PortGuard,
    PortRange,
    given_ports,
    kernel_may_pick,
    parse_ranges,
    port_list,
    ports_text,
)
from computepool.agent.sockets import bound_port


def low_listener() -> socket.socket:
    """A listening socket on a free port below the kernel's ephemeral range."""
    for _ in range(200):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", random.randrange(10000, 19999)))
        except OSError:
            s.close()
            continue
        s.listen()
        return s
    raise RuntimeError("no free low port")


def test_kernel_lists_and_ranges_parse() -> None:
    assert port_list("1000-1002,2000\n") == {1000, 1001, 1002, 2000}
    assert port_list("\n") == set()
    got = parse_ranges([{"name": "service", "min": 5, "max": 6}, {"min": "x"}, {"min": 9, "max": 1}, 3])
    assert got == (PortRange("service", 5, 6),)
    assert parse_ranges(None) == ()
    assert given_ports({"listen_ports": ports_text([31000, None, 29500, 31000])}) == {29500, 31000}


def test_kernel_may_pick_its_ephemeral_range_less_its_reserved_ports(tmp_path: Path) -> None:
    sysctl = tmp_path / "sys" / "net" / "ipv4"
    sysctl.mkdir(parents=True)
    (sysctl / "ip_local_port_range").write_text("40000\t40009\n")
    (sysctl / "ip_local_reserved_ports").write_text("40002-40003,40009\n")
    assert kernel_may_pick(tmp_path) == {40000, 40001, 40004, 40005, 40006, 40007, 40008}


def test_a_listener_on_a_reserved_port_not_given_stops_its_job_on_the_second_pass() -> None:
    with low_listener() as s:
        port = int(s.getsockname()[1])
        stopped: list[tuple[str, str]] = []
        given: set[int] = set()

        def jobs() -> list[GuardedJob]:
            return [GuardedJob("7.1", frozenset(given), frozenset({os.getpid()}))]

        guard = PortGuard(jobs, lambda key, why: stopped.append((key, why)))
        assert guard.scan() == []  # no ranges known yet: nothing policed
        guard.set_ranges((PortRange("service", port - 1, port + 1),))
        given.add(port)
        assert guard.scan() == [] and guard.scan() == []  # its own port
        given.clear()
        assert guard.scan() == []  # once: a job just started may not have its ports on record yet
        assert guard.scan() == [("7.1", port)]
        assert stopped == [
            ("7.1", f"listened on port {port}, which the pool reserves for its service range "
                    f"({port - 1}-{port + 1}) and did not give this job")
        ]  # fmt: skip
        assert guard.scan() == []  # stopped once


def test_ports_outside_the_ranges_or_the_kernels_to_give_are_not_policed() -> None:
    with low_listener() as s:
        port = int(s.getsockname()[1])
        stopped: list[str] = []
        guard = PortGuard(
            lambda: [GuardedJob("8.1", frozenset(), frozenset({os.getpid()}))],
            lambda key, why: stopped.append(key),
        )
        guard.set_ranges((PortRange("rpc", port + 1, port + 5),))
        guard.scan(), guard.scan()
        assert stopped == []
        ephemeral = PortGuard(  # as if the kernel could have given this job the port
            lambda: [GuardedJob("8.1", frozenset(), frozenset({os.getpid()}))],
            lambda key, why: stopped.append(key),
            kernel_picks={port},
        )
        ephemeral.set_ranges((PortRange("rpc", port, port),))
        ephemeral.scan(), ephemeral.scan()
        assert stopped == []
        guard.set_ranges((PortRange("rpc", port, port),))  # the same, policed: stopped
        guard.scan(), guard.scan()
        assert stopped == ["8.1"]


def test_a_socket_bound_on_a_reserved_port_without_listening_is_found_too() -> None:
    for _ in range(200):
        s = socket.socket()
        try:
            s.bind(("0.0.0.0", random.randrange(10000, 19999)))  # holds the port; no table lists it
            break
        except OSError:
            s.close()
    with s:
        port = int(s.getsockname()[1])
        assert bound_port(os.getpid(), s.fileno()) == port
        assert s.getsockname()[1] == port  # the job's socket is as it was
        stopped: list[tuple[str, str]] = []
        guard = PortGuard(
            lambda: [GuardedJob("9.1", frozenset(), frozenset({os.getpid()}))],
            lambda key, why: stopped.append((key, why)),
        )
        guard.set_ranges((PortRange("publish", port, port),))
        assert guard.scan() == []
        assert guard.scan() == [("9.1", port)]
        assert stopped[0][1].startswith(f"bound port {port}, which the pool reserves for its publish range")
    with socket.socket() as fresh:  # not bound: no port
        assert bound_port(os.getpid(), fresh.fileno()) is None


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")
def test_a_socket_in_a_jobs_own_network_namespace_holds_no_port_of_the_nodes() -> None:
    """A job with a network of its own may listen on any port there: nobody on the node is kept
    from it, and the guard leaves the job alone (its socket is in no table of ours either)."""
    port = random.randrange(10000, 19999)
    code = (
        "import socket, sys, time\n"
        f"s = socket.socket(); s.bind(('0.0.0.0', {port})); s.listen()\n"
        "b = socket.socket(); b.bind(('0.0.0.0', 0))\n"  # and one bound only
        "print('ready', flush=True); time.sleep(60)"
    )
    job = subprocess.Popen(["unshare", "-n", sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "ready"
        pids = frozenset({job.pid, *(c.pid for c in psutil.Process(job.pid).children(recursive=True))})
        stopped: list[tuple[str, str]] = []
        guard = PortGuard(lambda: [GuardedJob("7.1", frozenset(), pids)], lambda k, w: stopped.append((k, w)))
        guard.set_ranges((PortRange("service", 1024, 65535),))
        assert guard.scan() == [] and guard.scan() == [] and stopped == []
        with socket.socket() as mine:  # the node's port is free for anyone on the node
            mine.bind(("0.0.0.0", port))
    finally:
        job.kill()
        job.wait()
