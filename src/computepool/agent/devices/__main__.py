"""`python3 -m computepool.agent.devices [--simulate SPEC] [--usage]`: what the agent would find on
this machine, as JSON: each device (vendor, model, memory, uuid, indices, link group, device
nodes, cores), the variable naming it to a job, its usage when asked, and why each vendor that
found nothing found nothing. The check a node's operator runs before joining it to a pool."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from computepool.agent.devices import discover_all
from computepool.agent.isolation import visible_env
from computepool.core.errors import InvalidInput


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m computepool.agent.devices", description=__doc__)
    p.add_argument("--simulate", help="a simulated device spec instead of the real devices")
    p.add_argument("--usage", action="store_true", help="also each device's usage now")
    args = p.parse_args(argv)
    try:
        inv = discover_all(args.simulate, seed="print-devices")
    except InvalidInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    devices = []
    for d in inv.devices:
        row = asdict(d)
        row["dev_nodes"] = list(d.dev_nodes)
        row["env"] = {k: v for k, v in visible_env([d]).items() if v}
        devices.append(row)
    out: dict[str, object] = {
        "backend": inv.backend.name if inv.backend is not None else None,
        "devices": devices,
        "notes": inv.notes,
    }
    if args.usage and inv.backend is not None:
        out["usage"] = [asdict(u) for u in inv.backend.usage()]
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
