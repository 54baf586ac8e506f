"""A container's TCP buffers charged to its memory on cgroup v1 (an OCI hook podman hands runc).

The kernel keeps one TCP memory budget for the whole host (net.ipv4.tcp_mem), every network
namespace's sockets together: past it no TCP socket of the node gets memory. cgroup v1 charges a
socket's buffers to its creator's memory cgroup only where that very cgroup has a TCP limit
(`memory.kmem.tcp.limit_in_bytes`; a parent's does not turn a child's on), and apart from its
memory (`memory.kmem.tcp.usage_in_bytes`). A process job's cgroup gets one (cgroups.py); a
container's own cgroup is runc's, made as it starts, so a 64 MiB container held 300 MiB of the
host's budget from its own loopback. podman cannot ask runc for one, so the agent's podman runs a
hook at runc's `createRuntime` stage (the cgroup is made, the command not started): it gives the
container's memory cgroup a TCP limit of its parent's memory limit (the job's, set by the agent).
Where it cannot, the hook fails and so does the container's start; with no v1 memory controller
(cgroup v2 charges sockets to the memory anyway) it does nothing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HOOKS_DIR = "hooks"  # in the agent's data dir, named in its containers.conf (`hooks_dir`)
HOOK_FILE = "cpool-tcp-limit.json"

# Run as `python -I -S -c HOOK MEMORY_ROOT` by runc (root) with the container's state on stdin.
HOOK = """\
import json, os, sys
pid = int(json.load(sys.stdin)["pid"])
with open(f"/proc/{pid}/cgroup") as f:
    lines = [line.rstrip("\\n").split(":", 2) for line in f]
paths = [p for _, ctl, p in lines if "memory" in ctl.split(",")]
if not paths:
    sys.exit(0)
own = sys.argv[1] + paths[0]
tcp = own + "/memory.kmem.tcp.limit_in_bytes"
if not os.path.exists(tcp):
    sys.exit(0)
with open(os.path.dirname(own) + "/memory.limit_in_bytes") as f:
    limit = f.read().strip()
with open(tcp, "w") as f:
    f.write(limit)
"""


def write_hook(data_dir: Path, memory_root: Path, python: str = sys.executable) -> Path:
    """The hooks dir (its one hook, rewritten at every start) for containers.conf's `hooks_dir`."""
    hooks = data_dir / HOOKS_DIR
    hooks.mkdir(parents=True, exist_ok=True, mode=0o700)
    spec = {
        "version": "1.0.0",
        "hook": {"path": python, "args": [python, "-I", "-S", "-c", HOOK, str(memory_root)]},
        "when": {"always": True},
        "stages": ["createRuntime"],
    }
    tmp = hooks / f".{HOOK_FILE}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(spec, f)
    os.replace(tmp, hooks / HOOK_FILE)
    return hooks
