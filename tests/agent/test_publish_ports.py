"""Which ports a container job may publish, as the agent checks where it runs: its `--publish-ports`
range, never a privileged port, a replica's own port aside (the server checks its range first)."""

from __future__ import annotations

import pytest

from computepool.agent.assignment import Assignment
from computepool.agent.jobstart import check_published
from computepool.core.errors import InvalidInput


def assignment(*ports: int, service_port: int | None = None) -> Assignment:
    return Assignment.parse(
        {"allocation_id": 7, "attempt": 1, "command": ["true"], "image": "localhost/pybase:1",
         "ports": list(ports), "service_port": service_port}
    )  # fmt: skip


def test_ports_of_the_range_and_the_replicas_own_pass() -> None:
    check_published(assignment(20000, 20500), "n1", (20000, 20999))
    check_published(assignment(20080, 31005, service_port=31005), "n1", (20000, 20999))
    check_published(assignment(), "n1", (20000, 20999))


@pytest.mark.parametrize("port", [81, 1023, 19999, 21000, 31005, 29500])
def test_a_port_outside_the_range_fails_the_job_naming_ports(port: int) -> None:
    with pytest.raises(
        InvalidInput,
        match=f"^ports: {port} cannot be published on node n1: containers publish 20000-20999 only$",
    ):
        check_published(assignment(20080, port), "n1", (20000, 20999))


def test_a_privileged_port_never_passes_whatever_the_range() -> None:
    with pytest.raises(InvalidInput, match="^ports: 80 cannot be published"):
        check_published(assignment(80), "n1", (1, 65535))
