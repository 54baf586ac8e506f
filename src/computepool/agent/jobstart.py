"""Turning an assignment into a started job: the slices resolved on this node's devices (uuids
checked), MPS daemons up, the job's environment and JobSpec built, the assignment kept on disk.
Its code, stdin and image were fetched beforehand off the loop thread (preparing.py), and its code
unpacked there too (`unpack`, on the preparer's thread): here they are found in place.

Kept apart from the loop (loop.py), which decides *what* starts and stops; this holds *how*.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

from computepool.agent.assignment import ASSIGNMENT_FILE, Assignment, assignment_json
from computepool.agent.blobs import BlobCache, CodeUnavailable
from computepool.agent.config import DEFAULT_PUBLISH_PORTS
from computepool.agent.devices import NodeInventory, SimulatedBackend
from computepool.agent.devices.simulated import SIM_MEMORY_FILE_ENV, SIM_MEMORY_FILE_NAME
from computepool.agent.executor import Executor
from computepool.agent.isolation import (
    IsolationUnavailable,
    MemoryWatchdog,
    MpsDaemon,
    SliceAssignment,
    resolve_slices,
    slice_env,
)
from computepool.agent.jobfiles import write_job_file
from computepool.agent.jobnet import needs_host_network
from computepool.agent.jobspec import JobSpec
from computepool.agent.localstate import JobRecord, JobState
from computepool.agent.port_guard import LISTEN_PORTS_EXTRA, ports_text
from computepool.core.allocation import RPC_PORT_ENV, Isolation, Slice
from computepool.core.errors import InvalidInput
from computepool.core.progress import PROGRESS_ENV, PROGRESS_FILE
from computepool.core.servers import ServerList, join_servers, split_servers

log = logging.getLogger("computepool.agent")
WORKER_CA_FILE = ".cpool-ca.pem"  # in the job's work dir: the control plane's CA, for function workers
CODE_MARKER = ".code-unpacked"  # in the run dir (root's): the sha of the code unpacked in work/


def check_published(a: Assignment, node: str, allowed: tuple[int, int]) -> None:
    """A container publishes only ports of the agent's `--publish-ports` range (rootful podman binds
    them as root: never a privileged one, nor one the pool gives out), its replica's own port
    aside (the control plane adds it). Raises InvalidInput naming `ports`."""
    lo, hi = allowed
    bad = sorted(p for p in a.ports if p != a.service_port and not (lo <= p <= hi and p >= 1024))
    if bad:
        why = f"{bad[0]} cannot be published on node {node}: containers publish {lo}-{hi} only"
        raise InvalidInput("ports", why)


def progress_path(a: Assignment, work_dir: Path) -> str:
    """Where the job writes its progress (core/progress.py): in its work dir, as the job sees it
    (a container has the work dir at its own path)."""
    if a.image:
        from computepool.agent.container import WORKDIR  # noqa: PLC0415 - only for container jobs

        return f"{WORKDIR}/{PROGRESS_FILE}"
    return str(work_dir / PROGRESS_FILE)


class JobStarter:
    """Starts the attempts the loop asks for on this node, and re-attaches adopted ones."""

    def __init__(
        self,
        name: str,
        inventory: NodeInventory,
        executor: Executor,
        data_dir: Path,
        watchdog: MemoryWatchdog | None,
        server: str | None = None,
        ca: Path | None = None,
        mps_root: Path | None = None,
    ) -> None:
        """`server` and `ca`: how a function's worker reaches the control plane (`worker_env`);
        `mps_root`: where MPS daemons keep their pipes (DATA_DIR/mps when None)."""
        self.mps_root = mps_root or data_dir / "mps"
        self.name = name
        self.blobs: BlobCache | None = None  # set by the agent: fetches code and stdin (agent/blobs.py)
        self.server = server
        self.replicas: ServerList | None = None  # the agent's replicas, learnt ones too (set by the agent)
        self.ca = ca
        self.inventory = inventory
        self.executor = executor
        self.state = executor.state
        self.data_dir = data_dir
        self.watchdog = watchdog
        self._mps: dict[str, MpsDaemon] = {}
        self.publish_ports = DEFAULT_PUBLISH_PORTS  # the agent's --publish-ports

    def resolve(self, a: Assignment) -> list[SliceAssignment]:
        mine = [s for s in a.slices if s.get("node") in (None, self.name)]
        slices = [
            Slice(
                node=self.name,
                device_index=int(s["device_index"]),
                compute_milli=int(s.get("compute_milli") or 0),
                memory_mib=int(s.get("memory_mib") or 0),
                isolation=Isolation(s.get("isolation") or a.isolation or Isolation.EXCLUSIVE),
            )
            for s in mine
        ]
        resolved = resolve_slices(slices, self.inventory.devices)
        for i, (s, r) in enumerate(zip(mine, resolved, strict=True)):
            want = s.get("device_uuid")
            if want and want != r.device.uuid:
                raise InvalidInput(
                    f"slices[{i}]", f"device {r.device.index} is {r.device.uuid} here, not {want}"
                )
        return resolved

    def _mps_daemons(self, resolved: list[SliceAssignment]) -> dict[str, MpsDaemon]:
        for s in resolved:
            if s.isolation is Isolation.MPS:
                uuid = s.device.uuid
                daemon = self._mps.setdefault(uuid, MpsDaemon(uuid, self.mps_root))
                daemon.start()
        return self._mps

    def start(self, a: Assignment) -> tuple[JobRecord, list[SliceAssignment]] | None:
        """Start one attempt; None when it could not (recorded in LocalState as failed)."""
        run_dir = self.executor.run_dir(a.allocation_id, a.attempt)
        try:
            resolved = self.resolve(a)
            run_dir, work_dir = self.dirs(a)
            stdin = self._shipped(a, run_dir, work_dir)  # the run's code unpacked, its stdin in place
            env = slice_env(
                a.allocation_id, a.attempt, resolved, work_dir, mps=self._mps_daemons(resolved),
                user_env=a.env,
            )  # fmt: skip
            self.check_ports(a)
            gang = a.gang
            if gang is not None:  # one member of a gang: its rank, peers and rendezvous
                told = gang.master_port
                gang = replace(gang, master_port=gang.offer_port())  # rank 0: one nobody else holds
                if gang.master_port != told:
                    log.warning(
                        "%s: master port %d is held by another process; rank 0 offers %d",
                        a.key, told, gang.master_port,
                    )  # fmt: skip
                env |= gang.env() | gang.interface_env(a.env)
            if isinstance(self.inventory.backend, SimulatedBackend):
                env[SIM_MEMORY_FILE_ENV] = str(work_dir / SIM_MEMORY_FILE_NAME)
            env |= self.worker_env(env, work_dir)
            env[PROGRESS_ENV] = progress_path(a, work_dir)
            (run_dir / ASSIGNMENT_FILE).write_text(json.dumps(assignment_json(a)))
            spec = JobSpec(
                a.allocation_id,
                a.attempt,
                a.command,
                env=env,
                cpu_milli=a.cpu_milli,
                memory_mib=a.memory_mib,
                pids_max=a.pids_max,
                uses_gpu=bool(resolved),
                tenant=a.tenant,
                image=a.image,
                image_digest=a.image_digest,
                private_network=a.private_network,
                host_network=needs_host_network(
                    (a.service_port, *a.ports, a.env.get(RPC_PORT_ENV)),
                    a.gang is not None,
                    env,
                    a.private_network,
                ),  # fmt: skip
                ports=a.ports,
                device_uuids=tuple(s.device.uuid for s in resolved),
                device_nodes=tuple(n for s in resolved for n in s.device.dev_nodes),
                stdin=stdin,
            )
            rec = self.executor.start(spec)
            if gang is not None and gang.rank == 0:  # reported with `running`: the others dial it
                rec.extra["master_port"] = str(gang.master_port)
            rank0_port = gang.master_port if gang is not None and gang.rank == 0 else None
            rpc_port = a.env.get(RPC_PORT_ENV, "")
            given = [a.service_port, rank0_port, int(rpc_port) if rpc_port.isdigit() else None, *a.ports]
            if any(given):  # the pool's reserved ports this job may listen on (agent/port_guard.py)
                rec.extra[LISTEN_PORTS_EXTRA] = ports_text(given)
                self.state.put(rec)
        except (InvalidInput, IsolationUnavailable, OSError, ValueError, KeyError) as e:
            self._record_start_failure(a, run_dir, str(e))
            return None
        return rec, resolved

    def check_ports(self, a: Assignment) -> None:
        """Raises InvalidInput naming `ports` (the job's reason) for a port this agent publishes not."""
        check_published(a, self.name, self.publish_ports)

    def dirs(self, a: Assignment) -> tuple[Path, Path]:
        """The attempt's run dir (ours) and work dir (the job's), made if missing."""
        run_dir = self.executor.run_dir(a.allocation_id, a.attempt)
        run_dir.mkdir(parents=True, exist_ok=True)
        work_dir = self.executor.work_dir(a.allocation_id, a.attempt)
        work_dir.mkdir(parents=True, exist_ok=True)
        return run_dir, work_dir

    def unpack(self, a: Assignment) -> None:
        """Put the attempt's code in its work dir, off the loop (the preparer's thread): a big archive
        takes seconds to check and unpack. Raises CodeUnavailable or OSError (the job's reason)."""
        if self.blobs is None:
            raise CodeUnavailable("this agent cannot fetch blobs (no control plane connection)")
        run_dir, work_dir = self.dirs(a)
        self._unpack_once(a, run_dir, work_dir)

    def _unpack_once(self, a: Assignment, run_dir: Path, work_dir: Path) -> None:
        """Unpack unless the marker says this code is already there (a restarted agent, or `unpack`
        done); without it (cut short) tar unpacks again over what is there."""
        code, marker = a.code or "", run_dir / CODE_MARKER
        if not code or self.blobs is None:
            return
        with contextlib.suppress(OSError):
            if marker.read_text() == code:
                return
        self.blobs.unpack_code(code, work_dir, a.tenant)  # as the tenant's user, never root
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(code)

    def _shipped(self, a: Assignment, run_dir: Path, work_dir: Path) -> str | None:
        """The assignment's code in the work dir (unpacked now unless `unpack` did); its stdin file.
        Raises CodeUnavailable."""
        if (a.code or a.stdin) and self.blobs is None:
            raise CodeUnavailable("this agent cannot fetch blobs (no control plane connection)")
        if a.code and self.blobs is not None:
            self._unpack_once(a, run_dir, work_dir)
        if a.stdin and self.blobs is not None:
            return str(self.blobs.stdin_file(a.stdin, run_dir))
        return None

    def worker_env(self, env: dict[str, str], work_dir: Path) -> dict[str, str]:
        """A function's worker (its env holds CPOOL_WORKER_TOKEN) calls the control plane back: it
        gets every replica the agent knows now (those it was given and those it learnt since, the
        one answering first), so it carries on through a replica that dies; and, when the agent
        pins a CA, a copy the job can read."""
        if "CPOOL_WORKER_TOKEN" not in env or not self.server:
            return {}
        urls = self.replicas.order() if self.replicas is not None else split_servers(self.server)
        out = {"CPOOL_SERVER": join_servers(urls)}
        if self.ca is not None and self.ca.is_file():
            copy = write_job_file(work_dir, WORKER_CA_FILE, self.ca.read_bytes())  # never through a link
            out["CPOOL_CA"] = str(copy)
        return out

    def fail(self, a: Assignment, reason: str) -> None:
        """The attempt cannot start (its inputs could not be prepared): recorded as failed."""
        self._record_start_failure(a, self.executor.run_dir(a.allocation_id, a.attempt), reason)

    def _record_start_failure(self, a: Assignment, run_dir: Path, reason: str) -> None:
        now = time.time()
        rec = JobRecord(
            allocation_id=a.allocation_id,
            attempt=a.attempt,
            command=list(a.command),
            run_dir=str(run_dir),
            state=JobState.FAILED,
            reason=f"could not start: {reason}",
            started_at=now,
            ended_at=now,
        )
        self.state.put(rec)
        log.warning("%s could not start: %s", rec.key, reason)

    def attach(self, rec: JobRecord, resolved: list[SliceAssignment]) -> None:
        """Let the simulated devices see the job, and the watchdog hold timeslice slices."""
        backend = self.inventory.backend
        if isinstance(backend, SimulatedBackend):
            for s in resolved:
                backend.attach(
                    rec.pid,
                    s.device.index,
                    s.memory_mib,
                    s.compute_milli,
                    memory_file=self.executor.work_dir(rec.allocation_id, rec.attempt) / SIM_MEMORY_FILE_NAME,
                )
        if self.watchdog is not None and resolved and resolved[0].isolation is Isolation.TIMESLICE:
            self.watchdog.watch_slices(rec.key, resolved)
