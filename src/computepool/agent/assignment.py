"""One attempt the control plane wants on this node, as the agent reads it and keeps it on disk.

The assignment is saved in the attempt's run dir (without the user's environment, which may hold
secrets) so that an agent restarted while the job runs can re-attach its slices.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from computepool.agent.gang import Gang
from computepool.agent.localstate import job_key

ASSIGNMENT_FILE = "assignment.json"


@dataclass(frozen=True)
class Assignment:
    """One attempt the control plane wants on this node (a row of GET …/assignments)."""

    allocation_id: str
    attempt: int
    term: int
    tenant: str
    slices: list[dict[str, Any]]
    command: list[str]
    env: dict[str, str]
    isolation: str
    cpu_milli: int
    memory_mib: int
    pids_max: int = 0  # processes the job may run at once (0: the agent's own limit)
    restartable: bool = False
    image: str | None = None
    image_digest: str | None = None  # the image id to run (pinned at admission)
    ports: tuple[int, ...] = ()
    gang: Gang | None = None  # a member of a gang over several nodes (agent/gang.py)
    code: str | None = None  # sha256 of a tar.gz unpacked into the work dir before the start
    stdin: str | None = None  # sha256 of the blob fed to the job's stdin
    service_port: int | None = None  # a service replica's port: the agent reports who listens on it
    private_network: bool = False  # a coop RPC server: may make its own user + network namespace

    @property
    def key(self) -> str:
        return job_key(self.allocation_id, self.attempt)

    @classmethod
    def parse(cls, d: Mapping[str, Any]) -> Assignment:
        return cls(
            allocation_id=str(d["allocation_id"]),
            attempt=int(d["attempt"]),
            term=int(d.get("term") or 0),
            tenant=str(d.get("tenant") or ""),
            slices=[dict(s) for s in d.get("slices") or []],
            command=[str(c) for c in d.get("command") or []],
            env={str(k): str(v) for k, v in (d.get("env") or {}).items()},
            isolation=str(d.get("isolation") or ""),
            cpu_milli=int(d.get("cpu_milli") or 0),
            memory_mib=int(d.get("memory_mib") or 0),
            pids_max=int(d.get("pids_max") or 0),
            restartable=bool(d.get("restartable", False)),
            image=str(d["image"]) if d.get("image") else None,
            image_digest=str(d["image_digest"]) if d.get("image_digest") else None,
            ports=tuple(int(p) for p in d.get("ports") or ()),
            gang=Gang.parse(d.get("gang")),
            code=str(d["code"]) if d.get("code") else None,
            stdin=str(d["stdin"]) if d.get("stdin") else None,
            service_port=int(d["service_port"]) if d.get("service_port") else None,
            private_network=bool(d.get("private_network", False)),
        )


def wire_id(allocation_id: str) -> int | str:
    """Allocation ids are integers on the wire; locally they are strings (run dir and job key)."""
    return int(allocation_id) if allocation_id.isdigit() else allocation_id


def assignment_json(a: Assignment) -> dict[str, Any]:
    """The assignment as kept in its run dir (the form `Assignment.parse` reads back)."""
    return {
        "allocation_id": a.allocation_id,
        "attempt": a.attempt,
        "term": a.term,
        "tenant": a.tenant,
        "slices": a.slices,
        "command": a.command,
        "env": {},  # the user's variables may hold secrets: not kept on disk
        "isolation": a.isolation,
        "cpu_milli": a.cpu_milli,
        "memory_mib": a.memory_mib,
        "pids_max": a.pids_max,
        "restartable": a.restartable,
        "image": a.image,
        "image_digest": a.image_digest,
        "ports": list(a.ports),
        "gang": a.gang.to_json() if a.gang is not None else None,
        "code": a.code,
        "stdin": a.stdin,
        "service_port": a.service_port,
        "private_network": a.private_network,
    }


def saved_assignment(run_dir: Path) -> Assignment | None:
    """The assignment kept in a run dir at start (None if unreadable): a re-adopted job's slices."""
    try:
        return Assignment.parse(json.loads((run_dir / ASSIGNMENT_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def refusal(
    answer: Mapping[str, Any],
    sent: float,
    now: float,
    fence_s: float | None,
    rejoined: float | None,
    overdue: bool,
) -> str | None:
    """Why an assignments answer must not be acted on (None: it may); times on the agent's clock.

    An answer can sit in the node's socket while the node is frozen, and the pool may meanwhile
    have failed or moved what it lists. The server says how long it held the poll before reading
    the assignments (`held_s`, measured on its own monotonic clock): the answer was read no
    earlier than `sent + held_s` here (`sent`: when the agent sent the poll), whatever the two
    clocks say, so its age is at most `now - sent - held_s`. Refused: an answer that may be older
    than the fence, one asked for before contact was lost and regained, any while contact is
    overdue. The agent then polls again and gets the pool's current view."""
    if overdue:
        return "no confirmed contact with the control plane within the fence time"
    if rejoined is not None and sent < rejoined:
        return "asked for before this node lost and regained contact with the control plane"
    held = answer.get("held_s")
    if held is None:
        return None  # a server that does not say: only the checks above apply
    age = now - sent - float(held)
    if fence_s is not None and age > fence_s:
        return f"it may be {age:.1f} s old, more than the fence time ({fence_s:g} s)"
    return None
