"""The seccomp profile of container jobs: podman's default, less what a process job is refused.

Podman's default profile lets a container with no capabilities make a user namespace (unshare or
clone with CLONE_NEWUSER): inside it the job holds every capability again, over a network stack
(nf_tables) and mounts of its own, which is where local kernel exploits live; it also lets it use
the kernel keyrings. A process job is refused all of these by its filter (syscall_filter.py), so a
tenant could reach, by asking for an image, the kernel code the pool closes to its processes. The
agent gives podman a profile of its own (`--security-opt seccomp=…`, a root-only file in its data
dir): the host's default profile with the process jobs' refusals added, clone and unshare allowed
only without CLONE_NEWUSER. Without a default profile on the host, everything else is allowed, as
for process jobs.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from computepool.agent.syscall_filter import ABSENT, CLONE_NEWUSER, REFUSED

# where podman's packages put their default profile (the first that exists is taken)
DEFAULT_PROFILES = (Path("/etc/containers/seccomp.json"), Path("/usr/share/containers/seccomp.json"))
PROFILE_FILE = "container-seccomp.json"
_NAMESPACE_CALLS = ("clone", "unshare")
_ALLOW = "SCMP_ACT_ALLOW"


def _refuse(names: tuple[str, ...], err: int, args: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "names": list(names),
        "action": "SCMP_ACT_ERRNO",
        "errnoRet": err,
        "args": args or [],
        "comment": "computepool: as for process jobs (agent/syscall_filter.py)",
    }


def _user_ns(value: int) -> list[dict[str, Any]]:
    """The rule's condition: the flags (argument 0) hold CLONE_NEWUSER (`value` = it) or not (0)."""
    return [{"index": 0, "value": CLONE_NEWUSER, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}]


def profile(base: dict[str, Any] | None) -> dict[str, Any]:
    """`base` (podman's default profile; None: allow everything) with the process jobs' refusals."""
    out: dict[str, Any] = dict(base) if base is not None else {"defaultAction": _ALLOW, "syscalls": []}
    taken = set(REFUSED) | set(ABSENT) | set(_NAMESPACE_CALLS)
    rules: list[dict[str, Any]] = []
    for rule in out.get("syscalls") or []:
        if rule.get("action") == _ALLOW:
            names = [n for n in rule.get("names", []) if n not in taken]
            if not names:
                continue
            rule = {**rule, "names": names}
        rules.append(rule)
    rules += [
        {"names": list(_NAMESPACE_CALLS), "action": _ALLOW, "args": _user_ns(0)},
        _refuse(_NAMESPACE_CALLS, errno.EPERM, _user_ns(CLONE_NEWUSER)),
        _refuse(REFUSED, errno.EPERM),
        _refuse(ABSENT, errno.ENOSYS),  # the C library falls back to calls a filter can judge
    ]
    out["syscalls"] = rules
    return out


def write_profile(path: Path, defaults: tuple[Path, ...] = DEFAULT_PROFILES) -> Path:
    """The profile at `path` (root's, 0600), made from the first default profile that parses."""
    base: dict[str, Any] | None = None
    for source in defaults:
        try:
            loaded = json.loads(source.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(loaded, dict) and isinstance(loaded.get("syscalls"), list):
            base = loaded
            break
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(profile(base), f)
    os.replace(tmp, path)
    return path
