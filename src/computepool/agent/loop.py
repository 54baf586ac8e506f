"""The node agent: join, heartbeat, run what the control plane assigns, report, ship logs.

Public API: `AgentConfig`, `AgentFatal`, `Agent`, `Assignment`, `connect`, `run_agent`,
`default_node_name`, `EXIT_FATAL`, `EXIT_CREDENTIAL_REFUSED`.

The agent starts every connection (NAT-friendly). Three threads share one `Agent`:

- heartbeat: every interval, with device usage;
- assignments: a long poll for the attempts this node should run (the desired state);
- the control loop (main thread): reaps ended jobs, starts new attempts, stops those no longer
  assigned, ships log chunks and reports state changes.

The control plane may vanish at any time: workloads go on, every end is written to the local
state first (LocalState) and reported when the server answers again. A restarted agent re-adopts
the jobs that still run instead of starting them again. See docs/agent.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from computepool.agent import fencing
from computepool.agent.api import (
    CREDENTIAL_FILE,
    AgentApi,
    ApiError,
    Credential,
    Unreachable,
    load_credential,
    save_credential,
    server_verify,
)
from computepool.agent.devices import DeviceInfo, NodeInventory, SimulatedBackend, discover_all
from computepool.agent.devices.simulated import SIM_MEMORY_FILE_ENV, SIM_MEMORY_FILE_NAME
from computepool.agent.executor import (
    DEFAULT_CGROUP_BASE,
    STDERR_LOG,
    STDOUT_LOG,
    Executor,
    JobSpec,
    SandboxConfig,
)
from computepool.agent.isolation import (
    IsolationUnavailable,
    MemoryWatchdog,
    MpsDaemon,
    SliceAssignment,
    resolve_slices,
    slice_env,
)
from computepool.agent.localstate import JobRecord, JobState, job_key
from computepool.core.allocation import Isolation, Slice
from computepool.core.errors import InvalidInput
from computepool.core.tls import TlsError

log = logging.getLogger("computepool.agent")

EXIT_FATAL = 2
EXIT_CREDENTIAL_REFUSED = 3  # `cpool up` answers this one with a fresh join token
ASSIGNMENT_FILE = "assignment.json"
LOG_OFFSETS_FILE = "log-offsets.json"
STREAMS = (("stdout", STDOUT_LOG), ("stderr", STDERR_LOG))
_NAME_BAD = re.compile(r"[^a-z0-9_.-]+")


class AgentFatal(Exception):
    """Something only the operator can fix; the CLI prints it as one line and exits non-zero."""

    def __init__(self, message: str, code: int = EXIT_FATAL) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class AgentConfig:
    server: str
    data_dir: Path
    join_token: str | None = None
    ca: Path | None = None  # the control plane's CA (PEM); else a pinned or the system's (api.server_verify)
    name: str | None = None
    simulate: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    cgroup_base: Path | None = DEFAULT_CGROUP_BASE
    kill_grace_s: float = 10.0
    poll_wait_s: float = 20.0
    tick_s: float = 0.5
    max_backoff_s: float = 5.0
    log_chunk_bytes: int = 256 * 1024
    watchdog_interval_s: float = 2.0
    fence_s: float | None = None  # None: as long as the control plane's lost-node timeout allows
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # users, namespaces (sandbox.py)


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
    restartable: bool = False
    image: str | None = None
    ports: tuple[int, ...] = ()

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
            restartable=bool(d.get("restartable", False)),
            image=str(d["image"]) if d.get("image") else None,
            ports=tuple(int(p) for p in d.get("ports") or ()),
        )


class Backoff:
    """Exponential backoff with jitter, so nodes that lost the server do not return in lockstep."""

    def __init__(self, first_s: float = 0.5, max_s: float = 10.0) -> None:
        self.first_s, self.max_s = first_s, max_s
        self.failures = 0

    def next(self) -> float:
        self.failures += 1
        delay = min(self.max_s, self.first_s * 2.0 ** (self.failures - 1))
        return delay * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self.failures = 0


def default_node_name() -> str:
    """The host name, made into a valid node name (lower case, [a-z0-9_.-], at most 63)."""
    name = _NAME_BAD.sub("-", socket.gethostname().lower()).strip("-._")
    return (name or "node")[:63]


def _iso(ts: float | None) -> str | None:
    return None if not ts else datetime.fromtimestamp(ts, UTC).isoformat()


def _device_body(d: DeviceInfo) -> dict[str, Any]:
    return {
        "index": d.index,
        "vendor": d.vendor,
        "model": d.model,
        "memory_mib": d.memory_mib,
        "uuid": d.uuid,
        "compute_milli": d.compute_milli,
        "link_group": d.link_group,
        "mig_parent_uuid": d.mig_parent_uuid,
    }


def connect(config: AgentConfig, inventory: NodeInventory, api: AgentApi) -> Credential:
    """The node's credential: the one in the data dir, else a join with the join token.

    The join token is only needed once; afterwards the stored credential (mode 0600) is used and
    the token can have expired or been used up.
    """
    cred = load_credential(config.data_dir)
    if cred is not None:
        if config.name and config.name != cred.name:
            raise AgentFatal(
                f"{config.data_dir} holds the credential of node '{cred.name}', not '{config.name}' "
                "(use another --data-dir, or leave out --name)"
            )
        if config.simulate and config.simulate != cred.simulate:
            raise AgentFatal(
                f"node '{cred.name}' joined with {_devices_said(cred.simulate)}, not --simulate "
                f"{config.simulate}: the devices of a node are fixed at its join (remove the node and "
                f"{config.data_dir / CREDENTIAL_FILE} to join again)"
            )
        if cred.server.rstrip("/") != config.server.rstrip("/"):
            cred = replace(cred, server=config.server)
            save_credential(config.data_dir, cred)
        api.use(cred)
        return cred
    return join(config, inventory, api)


def _devices_said(simulate: str | None) -> str:
    return f"--simulate {simulate}" if simulate else "its real devices"


def join(config: AgentConfig, inventory: NodeInventory, api: AgentApi, name: str | None = None) -> Credential:
    if not config.join_token:
        raise AgentFatal(
            f"no node credential in {config.data_dir} and no join token: "
            "pass --join-token (an admin creates one with POST /api/v1/join-tokens)"
        )
    name = name or config.name or default_node_name()
    labels = dict(config.labels)
    if config.simulate:
        labels.setdefault("simulated", "true")
    body = {
        "join_token": config.join_token,
        "name": name,
        "cpu_milli": inventory.cpu.cpu_milli,
        "memory_mib": inventory.cpu.memory_mib,
        "labels": labels,
        "devices": [_device_body(d) for d in inventory.devices],
    }
    try:
        answer = api.join(body)
    except Unreachable as e:
        raise AgentFatal(f"cannot reach the control plane to join: {e}") from None
    except ApiError as e:
        raise AgentFatal(f"join refused by {config.server}: {e.message}") from None
    cred = Credential(
        config.server,
        name,
        str(answer["credential"]),
        float(answer.get("heartbeat_interval_s") or 5.0),
        config.simulate,
    )
    path = save_credential(config.data_dir, cred)
    log.info("joined the pool at %s as node '%s' with %d device(s); credential in %s",
             config.server, name, len(inventory.devices), path)  # fmt: skip
    api.use(cred)
    return cred


@dataclass
class _LogTail:
    """Where the shipping of one attempt's stdout/stderr stands; persisted in its run dir.

    Per stream: the byte position read up to in the log file, and the stream offset the control
    plane counts in (UTF-8 bytes of the text sent). They differ only where the output was not valid
    UTF-8 and a replacement character went out instead.
    """

    allocation_id: str
    attempt: int
    run_dir: Path
    read_pos: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    sent: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    done: bool = False

    @classmethod
    def load(cls, rec: JobRecord) -> _LogTail:
        tail = cls(rec.allocation_id, rec.attempt, Path(rec.run_dir))
        with contextlib.suppress(OSError, ValueError, TypeError):
            data = json.loads((tail.run_dir / LOG_OFFSETS_FILE).read_text())
            tail.read_pos = {s: int(data[s][0]) for s, _ in STREAMS}
            tail.sent = {s: int(data[s][1]) for s, _ in STREAMS}
            tail.done = bool(data.get("done", False))
        return tail

    def save(self) -> None:
        path = self.run_dir / LOG_OFFSETS_FILE
        tmp = path.with_suffix(".tmp")
        data: dict[str, Any] = {s: [self.read_pos[s], self.sent[s]] for s, _ in STREAMS}
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps({**data, "done": self.done}))
            os.replace(tmp, path)


def _utf8_chunk(raw: bytes, final: bool) -> tuple[bytes, str]:
    """Cut `raw` at a character boundary (unless it is the last of the file) and decode it."""
    try:
        return raw, raw.decode()
    except UnicodeDecodeError as e:
        if not final and e.reason == "unexpected end of data" and e.start > 0:
            raw = raw[: e.start]
        return raw, raw.decode(errors="replace")


class Agent:
    """One node's agent; `run()` blocks until `stop()` (or a fatal refusal) and leaves jobs running."""

    def __init__(
        self, config: AgentConfig, inventory: NodeInventory, api: AgentApi, cred: Credential
    ) -> None:
        self.config = config
        self.inventory = inventory
        self.api = api
        self.cred = cred
        self.name = cred.name
        self.executor = Executor(
            config.data_dir,
            cgroup_base=config.cgroup_base,
            kill_grace_s=config.kill_grace_s,
            sandbox=config.sandbox,
        )
        if os.geteuid() != 0:
            log.warning(
                "the agent is not root: jobs run as its own user, with no isolation between them; %s",
                "it accepts every tenant (--single-tenant)"
                if config.sandbox.single_tenant
                else "it refuses the jobs of a second tenant (start it with --single-tenant to allow them)",
            )
        self.state = self.executor.state
        backend = inventory.backend
        self.watchdog = (
            MemoryWatchdog(backend, self.executor, interval_s=config.watchdog_interval_s)
            if backend is not None
            else None
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._desired: dict[str, Assignment] | None = None  # None until the first answer
        self._stale: set[str] = set()
        self._term = 0
        self._version: int | None = None
        self._running_unreported: set[str] = set()
        self._tails: dict[str, _LogTail] = {}
        self._mps: dict[str, MpsDaemon] = {}
        self._fatal: AgentFatal | None = None
        self._call_backoff = Backoff(max_s=config.max_backoff_s)
        self._next_call = 0.0
        self._outage: dict[str, bool] = {}
        self.contact = fencing.Contact(config.data_dir, config.kill_grace_s, config.fence_s)
        self._supervisors: dict[str, subprocess.Popen[bytes]] = {}

    # ---- lifecycle ---------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        """Adopt what still runs, then loop until stopped. Raises AgentFatal on a refused credential."""
        self._adopt()
        threads = [
            threading.Thread(target=self._heartbeat_loop, name="cpool-heartbeat", daemon=True),
            threading.Thread(target=self._assignments_loop, name="cpool-assignments", daemon=True),
        ]
        for t in threads:
            t.start()
        if self.watchdog is not None:
            self.watchdog.start()
        try:
            while not self._stop.is_set():
                self._step()
                self._wake.wait(self.config.tick_s)
                self._wake.clear()
            # one last pass so that ends seen now are on disk and, if the server answers, reported
            with contextlib.suppress(Exception):
                self._step(final=True)
        finally:
            if self.watchdog is not None:
                self.watchdog.close()
            for t in threads:
                t.join(timeout=1.0)
            self.state.close()
        if self._fatal is not None:
            raise self._fatal

    def _adopt(self) -> None:
        found = self.executor.adopt()
        for rec in found.adopted:
            self._running_unreported.add(rec.key)
            self._track_logs(rec)
            a = self._saved_assignment(Path(rec.run_dir))
            if a is not None:
                with contextlib.suppress(Exception):
                    self._attach(rec, self._resolve(a), Path(rec.run_dir))
        for rec in found.adopted:
            if rec.extra.get("restartable") == "1" and not rec.stop_reason:
                self._supervise(rec)
        for rec in found.ended:
            self._fenced(rec)
            log.info("%s ended while the agent was away: %s", rec.key, rec.reason or rec.state.value)
        for rec in self.state.jobs():
            if rec.key not in self._tails:
                tail = _LogTail.load(rec)
                if not tail.done:
                    self._tails[rec.key] = tail
        if found.adopted:
            log.info("re-adopted %d running job(s): %s", len(found.adopted),
                     ", ".join(f"{r.key} (pid {r.pid})" for r in found.adopted))  # fmt: skip

    def _fail_fatal(self, err: AgentFatal) -> None:
        if self._fatal is None:
            self._fatal = err
        self.stop()

    def _note_outage(self, what: str, err: Exception | None) -> None:
        """Log the first failure and the recovery of each kind of call, not every retry."""
        was_down = self._outage.get(what, False)
        if err is not None and not was_down:
            log.warning("%s: control plane unreachable (%s); retrying, workloads keep running", what, err)
        elif err is None and was_down:
            log.info("%s: control plane reachable again", what)
        self._outage[what] = err is not None

    def _refused(self, what: str, e: ApiError) -> None:
        if e.status == 401:
            self._fail_fatal(
                AgentFatal(
                    f"the control plane refused this node's credential ({e.message}); the node was "
                    f"removed or its credential revoked: delete {self.config.data_dir / 'node.json'} "
                    "and join again with a join token",
                    EXIT_CREDENTIAL_REFUSED,
                )
            )
        else:
            log.error("%s refused: %s", what, e)

    # ---- heartbeat ---------------------------------------------------------------------------

    def _usage(self) -> list[dict[str, Any]]:
        backend = self.inventory.backend
        if backend is None:
            return []
        try:
            return [
                {"index": u.index, "used_memory_mib": u.memory_used_mib, "utilization_pct": u.utilization_pct}
                for u in backend.usage()
            ]
        except Exception as e:  # a driver hiccup must not stop the heartbeat
            log.debug("device usage unavailable: %s", e)
            return []

    def _heartbeat_loop(self) -> None:
        backoff = Backoff(max_s=self.config.max_backoff_s)
        while not self._stop.is_set():
            interval = self.cred.heartbeat_interval_s
            try:
                sent = fencing.now_s()
                answer = self.api.heartbeat(self._usage())
                interval = float(answer.get("heartbeat_interval_s") or interval)
                self._contact(sent, answer)
                self._note_outage("heartbeat", None)
                backoff.reset()
            except Unreachable as e:
                self._note_outage("heartbeat", e)
                interval = min(interval, backoff.next())
            except ApiError as e:
                self._refused("heartbeat", e)
            self._stop.wait(interval)

    def _contact(self, sent: float, answer: Mapping[str, Any]) -> None:
        """A heartbeat was answered: the fence's deadline moves on (see agent/fencing.py)."""
        try:
            self.contact.learn(answer.get("lost_after_s"), answer.get("heartbeat_interval_s"))
        except fencing.FenceConfigError as e:
            self._fail_fatal(AgentFatal(str(e)))
            return
        self.contact.touch(sent)

    # ---- fencing: one copy of a job, ever ----------------------------------------------------

    def _fence(self) -> None:
        """Out of contact for the fence time: stop restartable work before the pool restarts it
        elsewhere (the per-job supervisors do the same should this agent be dead)."""
        for key, proc in list(self._supervisors.items()):
            if proc.poll() is not None:
                del self._supervisors[key]
        if not self.contact.overdue():
            return
        for rec in self.executor.running():
            if rec.extra.get("restartable") == "1" and not rec.stop_reason:
                reason = self.contact.reason()
                fencing.mark_fenced(self.config.data_dir, rec.key, reason)
                log.warning("%s %s", rec.key, reason)
                self.executor.stop(rec.key, reason, self.contact.grace_s)

    def _supervise(self, rec: JobRecord) -> None:
        """Start the fence supervisor of a restartable job (once per attempt while it runs)."""
        if rec.key in self._supervisors or fencing.supervised(self.config.data_dir, rec.key):
            return
        target = fencing.target_of(rec, self.executor.launcher.container_engine)
        try:
            self._supervisors[rec.key] = fencing.spawn(self.config.data_dir, target, self.contact.grace_s)
        except OSError as e:
            log.error("%s: no fence supervisor (%s); only this agent fences it", rec.key, e)

    # ---- assignments -------------------------------------------------------------------------

    def _assignments_loop(self) -> None:
        backoff = Backoff(max_s=self.config.max_backoff_s)
        while not self._stop.is_set():
            try:
                answer = self.api.assignments(self._version, self.config.poll_wait_s)
            except Unreachable as e:
                self._note_outage("assignments", e)
                self._stop.wait(backoff.next())
                continue
            except ApiError as e:
                if e.status == 404 and "node" not in e.message.lower():
                    log.warning(
                        "the control plane has no assignments endpoint yet (%s); asking again later", e
                    )
                    self._stop.wait(30.0)
                else:
                    self._refused("assignments", e)
                    self._stop.wait(backoff.next())
                continue
            self._note_outage("assignments", None)
            backoff.reset()
            self._take_assignments(answer)

    def _take_assignments(self, answer: Mapping[str, Any]) -> None:
        term = int(answer.get("term") or 0)
        with self._lock:
            if term < self._term:  # fencing: a deposed leader's view must not stop or start anything
                log.warning("ignoring assignments from term %d (already saw term %d)", term, self._term)
                return
            self._term = term
            version = answer.get("version")
            self._version = int(version) if version is not None else None
            desired: dict[str, Assignment] = {}
            for item in answer.get("assignments") or []:
                try:
                    a = Assignment.parse(item)
                except (KeyError, TypeError, ValueError) as e:
                    log.error("unreadable assignment %r: %s", item, e)
                    continue
                desired[a.key] = a
            self._desired = desired
        self._wake.set()

    # ---- the control loop --------------------------------------------------------------------

    def _step(self, final: bool = False) -> None:
        for rec in self.executor.poll():
            self._ended(rec)
        if not final:
            self._fence()
            self._reconcile()
        if time.monotonic() < self._next_call:
            return
        try:
            self._ship_logs()  # output first: an end is reported once its output is all there
            self._send_reports()
        except Unreachable as e:
            self._note_outage("reports and logs", e)
            self._next_call = time.monotonic() + self._call_backoff.next()
            return
        self._note_outage("reports and logs", None)
        self._call_backoff.reset()

    def _ended(self, rec: JobRecord) -> None:
        self._running_unreported.discard(rec.key)
        self._fenced(rec)
        if self.watchdog is not None:
            self.watchdog.unwatch(rec.key)
        backend = self.inventory.backend
        if isinstance(backend, SimulatedBackend) and rec.pid:
            backend.detach(rec.pid)
        log.info("%s ended: %s%s", rec.key, rec.state.value, f" ({rec.reason})" if rec.reason else "")

    def _fenced(self, rec: JobRecord) -> None:
        """A fenced attempt is reported `lost` with the fence as its reason: the pool requeues it."""
        reason = fencing.fenced_reason(self.config.data_dir, rec.key)
        fencing.forget(self.config.data_dir, rec.key)
        if reason is not None and rec.state is not JobState.SUCCEEDED:
            rec.state, rec.reason = JobState.LOST, reason
            self.state.put(rec)
        fencing.forget_marker(self.config.data_dir, rec.key)

    def _reconcile(self) -> None:
        """Make what runs match what is assigned: start the new attempts, stop the unassigned."""
        with self._lock:
            desired = None if self._desired is None else dict(self._desired)
            stale, self._stale = self._stale, set()
        if desired is None:
            return  # never stop anything before the control plane has said what it wants
        live = {rec.key: rec for rec in self.executor.running()}
        for key, rec in live.items():
            if rec.stop_reason:
                continue
            if key in stale:
                self.executor.stop(key, "stopped: the control plane no longer assigns this attempt (stale)")
            elif key not in desired:
                self.executor.stop(key, "stopped: no longer assigned to this node by the control plane")
        overdue = self.contact.overdue()
        for key, a in desired.items():
            if key in live or key in stale or self.state.get(key) is not None:
                continue  # running, or already ran here: an attempt is never started twice
            if overdue and a.restartable:
                continue  # the pool may have moved it already: never start a second copy
            self._start(a)

    def _resolve(self, a: Assignment) -> list[SliceAssignment]:
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
                daemon = self._mps.setdefault(uuid, MpsDaemon(uuid, self.config.data_dir / "mps"))
                daemon.start()
        return self._mps

    def _start(self, a: Assignment) -> None:
        run_dir = self.executor.run_dir(a.allocation_id, a.attempt)
        try:
            resolved = self._resolve(a)
            run_dir.mkdir(parents=True, exist_ok=True)
            work_dir = self.executor.work_dir(a.allocation_id, a.attempt)  # the job's; run_dir is ours
            work_dir.mkdir(parents=True, exist_ok=True)
            env = slice_env(
                a.allocation_id, a.attempt, resolved, work_dir, mps=self._mps_daemons(resolved),
                user_env=a.env,
            )  # fmt: skip
            if isinstance(self.inventory.backend, SimulatedBackend):
                env[SIM_MEMORY_FILE_ENV] = str(work_dir / SIM_MEMORY_FILE_NAME)
            (run_dir / ASSIGNMENT_FILE).write_text(json.dumps(_assignment_json(a)))
            spec = JobSpec(
                a.allocation_id,
                a.attempt,
                a.command,
                env=env,
                cpu_milli=a.cpu_milli,
                memory_mib=a.memory_mib,
                uses_gpu=bool(resolved),
                tenant=a.tenant,
                image=a.image,
                ports=a.ports,
                device_uuids=tuple(s.device.uuid for s in resolved),
            )
            rec = self.executor.start(spec)
        except (InvalidInput, IsolationUnavailable, OSError, ValueError, KeyError) as e:
            self._record_start_failure(a, run_dir, str(e))
            return
        self._track_logs(rec)
        if rec.state is JobState.RUNNING:
            self._running_unreported.add(rec.key)
            if a.restartable:
                rec.extra["restartable"] = "1"
                self.state.put(rec)
                self._supervise(rec)
            self._attach(rec, resolved, run_dir)
            log.info("%s started (pid %d) on %s", rec.key, rec.pid,
                     ", ".join(f"GPU {s.device.index}" for s in resolved) or "CPU")  # fmt: skip
        else:
            log.warning("%s could not start: %s", rec.key, rec.reason)

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

    def _attach(self, rec: JobRecord, resolved: list[SliceAssignment], run_dir: Path) -> None:
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

    def _saved_assignment(self, run_dir: Path) -> Assignment | None:
        try:
            return Assignment.parse(json.loads((run_dir / ASSIGNMENT_FILE).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    # ---- reports -----------------------------------------------------------------------------

    def _pending_reports(self) -> Iterator[tuple[str, dict[str, Any], JobRecord]]:
        for key in sorted(self._running_unreported):
            rec = self.executor.get(key)
            if rec is not None and rec.state is JobState.RUNNING:
                yield key, _report(rec), rec
        for rec in self.state.unreported():
            yield rec.key, _report(rec), rec

    def _send_reports(self) -> None:
        """Report starts and ends (raises Unreachable); an end waits until its output is all sent."""
        pending = [
            p for p in self._pending_reports() if p[2].state is JobState.RUNNING or p[0] not in self._tails
        ]
        if not pending:
            return
        try:
            answer = self.api.report([body for _, body, _ in pending])
        except ApiError as e:
            if e.status == 401:
                self._refused("reports", e)
                return
            answer = self._report_one_by_one(pending)
        for key, _, rec in pending:
            self._acknowledged(key, rec)
        self._take_stale(answer)

    def _report_one_by_one(self, pending: list[tuple[str, dict[str, Any], JobRecord]]) -> dict[str, Any]:
        """A refused batch: send each alone so that one bad report cannot block the others forever."""
        stale: list[Any] = []
        for _key, body, _rec in pending:
            try:
                stale += self.api.report([body]).get("stale") or []
            except ApiError as e:
                log.warning("report %s #%s refused, dropped: %s", body["allocation_id"], body["attempt"], e)
        return {"stale": stale}

    def _acknowledged(self, key: str, rec: JobRecord) -> None:
        if rec.state is JobState.RUNNING:
            self._running_unreported.discard(key)
        else:
            self.state.mark_reported(key)

    def _take_stale(self, answer: Mapping[str, Any]) -> None:
        stale = {job_key(str(s["allocation_id"]), int(s["attempt"])) for s in answer.get("stale") or []}
        if stale:
            with self._lock:
                self._stale |= stale
            self._wake.set()

    # ---- logs --------------------------------------------------------------------------------

    def _track_logs(self, rec: JobRecord) -> None:
        if rec.key not in self._tails:
            self._tails[rec.key] = _LogTail.load(rec)

    def _ship_logs(self) -> None:
        """Send what the jobs wrote since the last offset (raises Unreachable); a tail is done once
        its job ended and all its output is sent."""
        for key, tail in list(self._tails.items()):
            rec = self.executor.get(key)
            ended = rec is None or rec.state.ended
            try:
                complete = self._ship_tail(tail, final=ended)
            except ApiError as e:
                if e.status == 401:
                    self._refused("logs", e)
                    return
                # another attempt is current, or the allocation is not ours: this output has no home
                log.warning("logs of %s refused, no longer sent: %s", key, e)
                complete = ended = True
            if complete and ended:
                tail.done = True
                tail.save()
                del self._tails[key]

    def _ship_tail(self, tail: _LogTail, final: bool) -> bool:
        """Send new output of both streams (a few chunks per tick at most); True when all is sent.

        A chunk resent after a crash (offset below the server's end) is trimmed by the server.
        """
        complete = True
        for stream, filename in STREAMS:
            path = tail.run_dir / filename
            for _ in range(4):
                pos = tail.read_pos[stream]
                try:
                    with open(path, "rb") as f:
                        f.seek(pos)
                        raw = f.read(self.config.log_chunk_bytes)
                        at_eof = not f.read(1)
                except FileNotFoundError:
                    break
                raw, text = _utf8_chunk(raw, final and at_eof)
                if not raw:
                    break
                self.api.logs(wire_id(tail.allocation_id), tail.attempt, stream, tail.sent[stream], text)
                tail.read_pos[stream] = pos + len(raw)
                tail.sent[stream] += len(text.encode())
                tail.save()
                if at_eof:
                    break
            else:
                complete = False
        return complete


def wire_id(allocation_id: str) -> int | str:
    """Allocation ids are integers on the wire; locally they are strings (run dir and job key)."""
    return int(allocation_id) if allocation_id.isdigit() else allocation_id


def _report(rec: JobRecord) -> dict[str, Any]:
    """The control plane's words: `exited` with the exit code when the process ended by itself,
    `failed` when it could not start or was stopped (reason says why), `lost` when unknown."""
    exited = rec.state is JobState.SUCCEEDED or (
        rec.state is JobState.FAILED and rec.exit_code is not None and rec.reason.startswith("exit code")
    )
    if rec.state is JobState.RUNNING:
        state = "running"
    elif rec.state is JobState.LOST:
        state = "lost"
    else:
        state = "exited" if exited else "failed"
    body: dict[str, Any] = {
        "allocation_id": wire_id(rec.allocation_id),
        "attempt": rec.attempt,
        "state": state,
    }
    if rec.started_at:
        body["started_at"] = _iso(rec.started_at)
    if rec.state.ended:
        body["ended_at"] = _iso(rec.ended_at or time.time())
        body["reason"] = (rec.reason or f"exit code {rec.exit_code}")[:1000]
        if rec.exit_code is not None:
            body["exit_code"] = rec.exit_code
    return body


def _assignment_json(a: Assignment) -> dict[str, Any]:
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
        "restartable": a.restartable,
        "image": a.image,
        "ports": list(a.ports),
    }


def check_credential(
    config: AgentConfig, inventory: NodeInventory, api: AgentApi, cred: Credential
) -> Credential:
    """One heartbeat before starting: a refused credential is replaced by a new join when a join
    token was given (the pool was reset, the node removed), else it is fatal. An unreachable
    server is no reason to wait: the jobs this node runs carry on and the loop retries."""
    try:
        answer = api.heartbeat([])
        contact = fencing.Contact(config.data_dir, config.kill_grace_s, config.fence_s)
        contact.learn(answer.get("lost_after_s"), answer.get("heartbeat_interval_s"))
        return cred
    except fencing.FenceConfigError as e:
        raise AgentFatal(str(e)) from None
    except Unreachable as e:
        log.warning("control plane unreachable at start (%s); running on, retrying", e)
        return cred
    except ApiError as e:
        if e.status not in (401, 404):
            raise AgentFatal(f"heartbeat refused by {config.server}: {e.message}") from None
        if not config.join_token:
            raise AgentFatal(
                f"the control plane refused node '{cred.name}' ({e.message}): delete "
                f"{config.data_dir / 'node.json'} and join again with --join-token",
                EXIT_CREDENTIAL_REFUSED,
            ) from None
        log.warning(
            "credential of node '%s' refused (%s); joining again with the join token", cred.name, e.message
        )
        return join(config, inventory, api, name=cred.name)


def run_agent(config: AgentConfig, *, api: AgentApi | None = None) -> None:
    """Discover, join (or reuse the credential), run until SIGTERM/SIGINT. Raises AgentFatal.

    On SIGTERM/SIGINT the agent stops polling and exits; workloads keep running and are
    re-adopted by the next start (an agent upgrade or restart must not cost running jobs).
    """
    stored = load_credential(config.data_dir)
    if stored is not None and config.simulate is None and stored.simulate:
        config = replace(config, simulate=stored.simulate)  # the devices it joined with
    name = stored.name if stored is not None else (config.name or default_node_name())
    inventory = discover_all(config.simulate, seed=name)  # simulated uuids differ from node to node
    for note in inventory.notes:
        log.info("%s", note)
    if api is None:
        try:
            verify = server_verify(config.server, config.data_dir, config.ca, config.join_token)
        except TlsError as e:
            raise AgentFatal(str(e)) from None
        api = AgentApi(config.server, verify=verify)
    previous: dict[signal.Signals, Any] = {}
    try:
        cred = check_credential(config, inventory, api, connect(config, inventory, api))
        agent = Agent(config, inventory, api, cred)

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            log.info("%s: stopping the agent; workloads keep running", signal.Signals(signum).name)
            agent.stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
        log.info("agent of node '%s' talking to %s; data in %s", cred.name, config.server, config.data_dir)
        agent.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        api.close()
