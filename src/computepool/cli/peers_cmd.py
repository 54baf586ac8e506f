"""`cpool peers`: the LAN peers the nodes' discovery found, and why any was rejected."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from computepool.cli.common import print_json
from computepool.cli.pool_cmd import JsonOpt, ServerOpt, TokenOpt, open_client, pool_command, say, show, table
from computepool.client.peers import merge_peers


def _devices(devices: list[dict[str, Any]]) -> str:
    if not devices:
        return "-"
    return ", ".join(
        f"{d['kind']}{d['index'] if d['kind'] == 'gpu' else ''} {d['model']} {d['memory_mib'] / 1024:.0f} GiB"
        for d in devices
    )


def _link(seen: dict[str, Any]) -> str:
    """One observer and its measured link: `n1 0.4 ms 940 Mb/s (mdns)`."""
    parts = [seen["observer"]]
    if seen.get("rtt_ms") is not None:
        parts.append(f"{seen['rtt_ms']:.2f} ms")
    if seen.get("bandwidth_mbps") is not None:
        parts.append(f"{seen['bandwidth_mbps']:.0f} Mb/s")
    if seen.get("status") == "ok" and seen.get("rtt_ms") is None:
        parts.append("not measured yet")
    if seen.get("source"):
        parts.append(f"({seen['source']})")
    return " ".join(parts)


def show_peers(items: list[dict[str, Any]]) -> None:
    if not items:
        say("no peers reported (run agents with --discovery, or --peer HOST:PORT without multicast)")
        return
    t = table("LAN peers", "PEER", "ADDRESS", "DEVICES", "SEEN BY", "REJECTED")
    for p in items:
        address = f"{p['address']}:{p['port']}" if p.get("port") else (p.get("address") or "-")
        t.add_row(
            p["peer"],
            address,
            _devices(p["devices"]),
            "\n".join(_link(s) for s in p["seen_by"]),
            p["rejected"] or "-",
        )
    show(t)


def register(app: typer.Typer) -> None:
    @app.command("peers")
    @pool_command
    def peers(
        observer: Annotated[
            str | None, typer.Option("--observer", help="Only what this node's discovery found.")
        ] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """The LAN peers the nodes' discovery found: devices, the links measured, and why any was rejected."""
        with open_client(server, token) as pool:
            items = merge_peers(pool.list_peers(observer))
        if json_out:
            print_json({"items": items})
        else:
            show_peers(items)
