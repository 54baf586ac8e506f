"""A gang member's environment, the rank-0 master port check, and the one rule for node addresses."""

from __future__ import annotations

import contextlib
import socket

import pytest

from computepool.agent.assignment import Assignment, assignment_json
from computepool.agent.gang import Gang, port_free
from computepool.core.address import check_address
from computepool.core.errors import InvalidInput


def test_env_counts_one_slot_per_gpu_of_each_node() -> None:
    g = Gang.parse(
        {"rank": 1, "size": 3, "master_addr": "10.0.0.1", "master_port": 29501,
         "peers": ["10.0.0.1", "10.0.0.2", "10.0.0.3"], "nproc_per_node": 4}
    )  # fmt: skip
    assert g is not None
    assert g.env() == {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29501",
        "NNODES": "3",
        "NODE_RANK": "1",
        "NPROC_PER_NODE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "WORLD_SIZE": "12",
        "RANK": "4",
        "LOCAL_RANK": "0",
        "CPOOL_RANK": "1",
        "CPOOL_PEERS": "10.0.0.1,10.0.0.2,10.0.0.3",
    }
    assert Gang.parse(None) is None


def test_the_gang_survives_the_saved_assignment() -> None:
    item = {
        "allocation_id": 7, "attempt": 2, "command": ["true"],
        "gang": {"rank": 0, "size": 2, "master_addr": "h0", "master_port": 29500, "peers": ["h0", "h1"],
                 "master_ports": [29500, 29999]},
    }  # fmt: skip
    a = Assignment.parse(item)
    assert a.gang is not None and a.gang.nproc_per_node == 1 and a.gang.master_ports == (29500, 29999)
    assert Assignment.parse(assignment_json(a)).gang == a.gang
    assert Assignment.parse({"allocation_id": 8, "attempt": 1}).gang is None


def hold(port: int, family: socket.AddressFamily = socket.AF_INET) -> socket.socket:
    """A listener of this test's own on `port` (IPv6 ones IPv6-only, as a squatter would make them)."""
    s = socket.socket(family)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind(("::" if family == socket.AF_INET6 else "127.0.0.1", port))
    s.listen()
    return s


def have_ipv6() -> bool:
    try:
        socket.socket(socket.AF_INET6).close()
    except OSError:
        return False
    return True


def test_rank_0_offers_another_master_port_when_the_reserved_one_is_held() -> None:
    """Held on any address or family, the reserved port is replaced by the next free one of the
    range; a whole range held, by one the kernel finds free. Other ranks keep what they were told."""
    families = [socket.AF_INET, *([socket.AF_INET6] if have_ipv6() else [])]
    for family in families:
        with hold(0, family) as busy:
            port = busy.getsockname()[1]
            g = Gang(rank=0, size=2, master_addr="127.0.0.1", master_port=port, peers=("a", "b"))
            offered = g.offer_port()
            assert offered != port and port_free(offered) and not port_free(port), family
            assert (
                Gang(rank=1, size=2, master_addr="a", master_port=port, peers=("a", "b")).offer_port() == port
            )
        assert g.offer_port() == port  # free again: the reserved one
    with hold(0) as a:
        lo = a.getsockname()[1]
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(hold(lo + 1))
            except OSError:
                pytest.skip(f"port {lo + 1} is taken on this machine")
            ranged = Gang(
                rank=0, size=2, master_addr="h", master_port=lo, peers=("a", "b"), master_ports=(lo, lo + 1)
            )
            offered = ranged.offer_port()  # every port of the range held: one outside it
            assert offered not in (lo, lo + 1) and port_free(offered)


@pytest.mark.parametrize(
    ("given", "stored"),
    [("10.0.0.1", "10.0.0.1"), ("[fd00::1]", "fd00::1"), ("Node-1.Example.org.", "node-1.example.org")],
)
def test_addresses(given: str, stored: str) -> None:
    assert check_address(given) == stored


@pytest.mark.parametrize("bad", ["", "a b", "10.0.0.300", "-x.example", "x_y", "a" * 64 + ".org"])
def test_bad_addresses_name_the_field(bad: str) -> None:
    with pytest.raises(InvalidInput, match="^--address: expected an IP address or a host name"):
        check_address(bad, "--address")


def test_collectives_are_told_the_interface_holding_the_members_address() -> None:
    gang = Gang(rank=1, size=2, master_addr="10.9.9.9", master_port=29500, peers=("10.9.9.9", "127.0.0.1"))
    assert gang.interface_env({}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    # the user's own choice wins; an address no interface holds names nothing
    assert gang.interface_env({"GLOO_SOCKET_IFNAME": "eth7"}) == {"NCCL_SOCKET_IFNAME": "lo"}
    elsewhere = Gang(rank=0, size=2, master_addr="10.9.9.9", master_port=29500, peers=("10.9.9.9", "x"))
    assert elsewhere.interface_env({}) == {}
