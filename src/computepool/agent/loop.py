"""The node agent's loop: heartbeat, run what the control plane assigns, report, ship logs.

Public API: `Agent` (`run_agent` in start.py starts one; settings and errors in config.py, joining
in join.py).

The agent starts every connection (NAT-friendly). Three threads share one `Agent`:

- heartbeat: every interval, with device usage;
- assignments: a long poll for the attempts this node should run (the desired state);
- the control loop (main thread): reaps ended jobs, starts new attempts (jobstart.py), stops those
  no longer assigned, ships log chunks (logship.py) and reports state changes (reports.py).

The control plane may vanish at any time: workloads go on, every end is written to the local
state first (LocalState) and reported when the server answers again. A restarted agent re-adopts
the jobs that still run instead of starting them again. See docs/agent.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import random
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from computepool.agent import fencing
from computepool.agent.api import (
    SERVER_CERT_FILE,
    AgentApi,
    ApiError,
    Credential,
    Unreachable,
    server_verify,
)
from computepool.agent.assignment import Assignment, refusal, saved_assignment
from computepool.agent.blobs import BlobCache, FileAnswerer, tenant_user
from computepool.agent.config import EXIT_CREDENTIAL_REFUSED, AgentConfig, AgentFatal
from computepool.agent.devices import NodeInventory, SimulatedBackend
from computepool.agent.disk_guard import DiskGuard, DiskJob, running_jobs
from computepool.agent.executor import Executor
from computepool.agent.hostwall import HostWall, local_ports
from computepool.agent.identity import agent_id
from computepool.agent.isolation import MemoryWatchdog
from computepool.agent.jobstart import JobStarter
from computepool.agent.join import tenant_pythons
from computepool.agent.listeners import ListenerWatch, Replica
from computepool.agent.localstate import JobRecord, JobState, job_key
from computepool.agent.logship import LogShipper
from computepool.agent.port_guard import GuardedJob, PortGuard, given_ports, parse_ranges
from computepool.agent.preparing import Preparer
from computepool.agent.progress import ProgressReader, RunningJob
from computepool.agent.relay import Relays
from computepool.agent.reports import Reporter

log = logging.getLogger("computepool.agent")


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
        self._stop = threading.Event()
        self._wake = threading.Event()  # a pass now: an assignment came, a job ended, ...
        self.executor = Executor(
            config.data_dir,
            cgroup_base=config.cgroup_base,
            node=cred.name,
            kill_grace_s=config.kill_grace_s,
            sandbox=config.sandbox,
            on_exit=self._wake.set,  # a job's end is handled at once, not at the next tick
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
        pinned = config.data_dir / SERVER_CERT_FILE
        self.starter = JobStarter(
            self.name, inventory, self.executor, config.data_dir, self.watchdog, server=config.server,
            ca=config.ca or (pinned if pinned.exists() else None), mps_root=config.sandbox.mps_root,
        )  # fmt: skip
        self.starter.publish_ports = config.publish_ports
        self.starter.replicas = api.servers  # workers get the replicas learnt since the start too
        self.starter.blobs = BlobCache(  # a run's code and stdin, by hash; code unpacked as the tenant
            config.data_dir, api, sandbox=self.executor.launcher.sandbox, max_unpacked=config.code_max_bytes
        )
        self.files = FileAnswerer(api, config.data_dir, self.executor.work_dir, self._file_user)
        self.reports = Reporter(api, self.executor, self._refused)
        self.progress = ProgressReader()  # running jobs' steps/s, sent with each heartbeat
        self.logs = LogShipper(api, self.executor, config.log_chunk_bytes, self._refused)
        self._lock = threading.Lock()
        # where the node's replicas are dialled and its containers publish: as the pool stored it
        self.address: str | None = config.address
        self.executor.launcher.publish_host = config.address
        self.listeners = ListenerWatch(self._replicas, self._wake.set)  # who holds each replica's port
        self.reports.listeners = self.listeners.found
        self.port_guard = PortGuard(self._guarded_jobs, self._stop_squatter)  # the pool's port ranges
        self.disk_guard = DiskGuard(  # finished attempts' files, and a job that fills the disk
            self.executor.data_dir / "runs", job_key, self._kept_attempts, self._disk_jobs,
            self._stop_squatter, cache_root=self.executor.launcher.caches_root(),
        )  # fmt: skip
        # fetches and pulls run off this loop; an attempt waits "preparing" until its inputs are here
        self.preparing = Preparer(
            lambda: self.starter.blobs, self.executor.launcher, self._wake.set, unpack=self.starter.unpack
        )
        self._desired: dict[str, Assignment] | None = None  # None until the first answer
        self._desired_sent = 0.0  # when the poll that said it was sent (CLOCK_BOOTTIME)
        self._held: dict[str, set[int] | None] = {}  # devices of the jobs being stopped, by key
        self._waiting: set[str] = set()  # attempts held back until such a job is gone
        self._stale: set[str] = set()
        self._term = 0
        self._version: int | None = None
        self._fatal: AgentFatal | None = None
        self._call_backoff = Backoff(max_s=config.max_backoff_s)
        self._next_call = 0.0
        self._outage: dict[str, bool] = {}
        self.contact = fencing.Contact(config.data_dir, config.kill_grace_s, config.fence_s)
        self._supervisors: dict[str, subprocess.Popen[bytes]] = {}
        # a root agent's firewall for its tenants' sockets on the node's own network (hostwall.py)
        self.hostwall: HostWall | None = None
        if os.geteuid() == 0 and not config.sandbox.single_tenant:
            self.hostwall = HostWall(
                agent_id(config.data_dir), config.sandbox.uid_range, lambda: local_ports(api.servers.urls),
                config.protect_ports,
            )  # fmt: skip
        verify = server_verify(api.server, config.data_dir, config.ca, None)  # as the API client's
        self.relays = Relays(api, cred.credential, self.executor, self._file_user, verify, self._stop)

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
        # the firewall before any new job can start (the one a stopped agent left holds until then)
        if self.hostwall is not None:
            why = self.hostwall.install()
            if why:
                log.warning(
                    "no host firewall for jobs on the node's network (replicas, gang members, function "
                    "workers): %s; they can reach the metadata address and the node's loopback services",
                    why,
                )
                self.hostwall = None
            else:
                self.hostwall.start()
                engine = self.executor.launcher.container_engine()
                engine.networks.on_subnets = self.hostwall.add_container_subnets
                if engine.conf_path.exists():  # podman was used here: its tenants' networks already
                    with contextlib.suppress(Exception):
                        engine.networks.announce_existing()
        threads = [
            threading.Thread(target=self._heartbeat_loop, name="cpool-heartbeat", daemon=True),
            threading.Thread(target=self._assignments_loop, name="cpool-assignments", daemon=True),
            threading.Thread(target=self.relays.run, name="cpool-relays", daemon=True),  # cpool exec
        ]
        for t in threads:
            t.start()
        if self.watchdog is not None:
            self.watchdog.start()
        self.listeners.start()
        self.port_guard.start()
        self.disk_guard.start()
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
            self.listeners.close()
            self.port_guard.close()
            if self.hostwall is not None:  # the jobs left running stay held until the next agent's
                self.hostwall.close(keep=bool(self.executor.running()))
            self.disk_guard.close()
            for t in threads:
                t.join(timeout=1.0)
            self.preparing.close()
            self.executor.close()  # the container removals still queued
            self.files.close()
            self.state.close()
        if self._fatal is not None:
            raise self._fatal

    def _adopt(self) -> None:
        found = self.executor.adopt()
        for rec in found.adopted:
            self.reports.running_unreported.add(rec.key)
            self.logs.track(rec)
            a = saved_assignment(Path(rec.run_dir))
            if a is not None:
                with contextlib.suppress(Exception):
                    self.starter.attach(rec, self.starter.resolve(a))
        for rec in found.adopted:
            if rec.extra.get("restartable") == "1" and not rec.stop_reason:
                self._supervise(rec)
        for rec in found.ended:
            self._fenced(rec)
            log.info("%s ended while the agent was away: %s", rec.key, rec.reason or rec.state.value)
        self.logs.resume(self.state.open_jobs())  # an acknowledged end's output was all sent
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
                {
                    "index": u.index,
                    "used_memory_mib": u.memory_used_mib,
                    "utilization_pct": u.utilization_pct,
                    "power_w": u.power_w,
                    "energy_j": u.energy_j,
                    "health": u.health[:256],  # what the pool keeps of it
                }
                for u in backend.usage()
            ]
        except Exception as e:  # a driver hiccup must not stop the heartbeat
            log.debug("device usage unavailable: %s", e)
            return []

    def _progress(self) -> list[dict[str, Any]]:
        """Running jobs' steps/s since the last heartbeat, from their progress files."""
        jobs = [
            RunningJob(r.key, r.allocation_id, r.attempt, self.executor.work_dir(r.allocation_id, r.attempt))
            for r in self.executor.running()
            if not r.stop_reason
        ]
        try:
            return self.progress.rates(jobs)
        except Exception as e:  # a job's odd file must not stop the heartbeat
            log.debug("progress unavailable: %s", e)
            return []

    def _heartbeat_loop(self) -> None:
        backoff = Backoff(max_s=self.config.max_backoff_s)
        address: str | None = self.config.address or ""  # said until a heartbeat is answered
        pythons: list[str] | None = tenant_pythons()  # so is this: a restart sees a Python installed since
        while not self._stop.is_set():
            interval = self.cred.heartbeat_interval_s
            try:
                sent = fencing.now_s()
                answer = self.api.heartbeat(self._usage(), address, pythons, self._progress())
                address = pythons = None
                self._learn_address(answer.get("address"))
                self.port_guard.set_ranges(parse_ranges(answer.get("reserved_ports")))
                self.logs.learn_cap(answer.get("log_max_mib"))
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

    def _learn_address(self, address: Any) -> None:
        """The node's address as the pool stored it: its replicas' endpoints dial it (listeners.py)
        and its containers publish their ports on it alone."""
        if isinstance(address, str) and address:
            self.address = address
            self.executor.launcher.publish_host = address

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
        elsewhere (the per-job supervisors do the same should this agent be dead), and any job whose
        start the pool never acknowledged: to the pool it never ran, and it is requeued once the
        node is lost."""
        for key, proc in list(self._supervisors.items()):
            if proc.poll() is not None:
                del self._supervisors[key]
        if not self.contact.overdue() and self.contact.lapsed is None:
            return
        for rec in self.executor.running():
            if rec.extra.get("restartable") != "1" and rec.key not in self.reports.running_unreported:
                continue
            kill_at = self.contact.kill_at(fencing.boot_time_of(rec.create_time))
            if kill_at is None:
                continue
            left = kill_at - fencing.now_s()  # past deadline + grace (a thawed node): SIGKILL now
            if not rec.stop_reason:
                reason = self.contact.reason()
                fencing.mark_fenced(self.config.data_dir, rec.key, reason)
                log.warning("%s %s", rec.key, reason)
                self.executor.stop(rec.key, reason, max(0.0, left))
            elif left <= 0:
                self.executor.stop(rec.key, rec.stop_reason, 0.0)  # a stop under way: escalate

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
            sent = fencing.now_s()  # an answer's age is measured from here, on this node's clock
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
            c = self.contact
            why = refusal(answer, sent, fencing.now_s(), c.fence, c.rejoined, c.overdue())
            if why is not None:  # a stale answer: start nothing from it, ask again for the truth
                log.warning("refusing an assignments answer (%s); asking again", why)
                self._version = None
                self._stop.wait(min(1.0, self.cred.heartbeat_interval_s))
                continue
            self._take_assignments(answer, sent)

    def _take_assignments(self, answer: Mapping[str, Any], sent: float) -> None:
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
            self._desired, self._desired_sent = desired, sent
        self.files.submit(answer.get("files") or [])  # users' file requests: packed on their own thread
        self._wake.set()

    def _file_user(self, tenant: str) -> pwd.struct_passwd | None:
        """Who packs a job's files: its tenant's user where jobs run as one (a sandboxing root agent)."""
        sandbox = self.executor.launcher.sandbox
        return tenant_user(tenant, sandbox.user_prefix) if sandbox is not None else None

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
            self.logs.ship()  # output first: an end is reported once its output is all there
            self._send_reports()
        except Unreachable as e:
            self._note_outage("reports and logs", e)
            self._next_call = time.monotonic() + self._call_backoff.next()
            return
        self._note_outage("reports and logs", None)
        self._call_backoff.reset()

    def _ended(self, rec: JobRecord) -> None:
        self.reports.running_unreported.discard(rec.key)
        self._held.pop(rec.key, None)
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
            sent = self._desired_sent
            stale, self._stale = self._stale, set()
            rejoined = self.contact.rejoined
            if rejoined is not None and sent < rejoined:
                desired = None  # said before contact was lost: the pool may have moved on since
        live = {rec.key: rec for rec in self.executor.running()}
        for key, rec in live.items():
            if rec.stop_reason:
                continue
            if key in stale:  # the pool said so in a report's answer: stopped even without a list
                self.executor.stop(key, "stopped: the control plane no longer assigns this attempt (stale)")
            elif desired is not None and key not in desired:
                self.executor.stop(key, "stopped: no longer assigned to this node by the control plane")
        if desired is None:
            return  # never stop anything else before the control plane has said what it wants
        self.reports.forget_done(desired, sent)  # ends the pool is done with
        overdue = self.contact.overdue()
        self.preparing.forget(k for k in desired if k not in stale)  # withdrawn: never started
        # jobs this node no longer owns still hold their devices until they are seen dead
        leaving = [k for k, rec in live.items() if rec.stop_reason or k in stale or k not in desired]
        self._waiting &= set(desired)
        for key, a in desired.items():
            if key in live or key in stale or self.state.known(key):
                continue  # running, or already ran here: an attempt is never started twice
            if overdue:
                continue  # the pool may have failed or moved it already: start nothing now
            holder = self._holder(a, leaving, live)
            if holder is not None:  # started once the old job on its devices is gone (next passes)
                if key not in self._waiting:
                    self._waiting.add(key)
                    log.info("%s waits for %s to end: it still holds a device of this node", key, holder)
                continue
            self._waiting.discard(key)
            ready = self.preparing.check(a)  # its blobs and image fetched off this thread first
            if ready.failure:
                self.starter.fail(a, ready.failure)
            elif ready.ready:
                self._start(a)

    def _devices(self, a: Assignment) -> set[int]:
        return {int(s["device_index"]) for s in a.slices if s.get("node") in (None, self.name)}

    def _holder(self, a: Assignment, leaving: list[str], live: Mapping[str, JobRecord]) -> str | None:
        """A job being stopped (one this node no longer owns) that still holds a device of `a`:
        two tenants must never run on one device, not even for a stop's grace period."""
        wanted = self._devices(a)
        if not wanted:
            return None
        for key in leaving:
            old = self._held.get(key)
            if old is None:
                saved = saved_assignment(Path(live[key].run_dir))
                old = self._held[key] = self._devices(saved) if saved is not None else None
            if old is None or old & wanted:  # unknown: assume it holds them
                return key
        return None

    def _start(self, a: Assignment) -> None:
        started = self.starter.start(a)
        if started is None:
            return
        rec, resolved = started
        self.logs.track(rec)
        if rec.state is JobState.RUNNING:
            self.reports.running_unreported.add(rec.key)
            if a.service_port is not None:  # kept with the job: an agent restarted still watches it
                rec.extra["service_port"] = str(a.service_port)
                self.state.put(rec)
            if a.restartable:
                rec.extra["restartable"] = "1"
                self.state.put(rec)
                self._supervise(rec)
            self.starter.attach(rec, resolved)
            log.info("%s started (pid %d) on %s", rec.key, rec.pid,
                     ", ".join(f"GPU {s.device.index}" for s in resolved) or "CPU")  # fmt: skip
        else:
            log.warning("%s could not start: %s", rec.key, rec.reason)

    def _replicas(self) -> list[Replica]:
        """The running service replicas of this node, for the listener scan (off this loop)."""
        out = []
        for rec in self.executor.running():
            port = rec.extra.get("service_port")
            if port and port.isdigit() and not rec.stop_reason:
                pids = frozenset(self.executor.job_pids(rec.key))
                ctr = rec.extra.get("container")
                name = self.executor.launcher.container_engine().name(ctr) if ctr else None
                out.append(Replica(rec.key, int(port), pids, name, self.address))
        return out

    def _guarded_jobs(self) -> list[GuardedJob]:
        """The running jobs with the reserved ports each was given, for the port guard (off this loop)."""
        return [
            GuardedJob(rec.key, given_ports(rec.extra), frozenset(self.executor.job_pids(rec.key)))
            for rec in self.executor.running()
            if not rec.stop_reason
        ]

    def _kept_attempts(self) -> set[str] | None:
        """Attempts whose files the agent may still use: running or with an end not yet
        acknowledged, or assigned (maybe being prepared); None before the first answer."""
        with self._lock:
            desired = None if self._desired is None else set(self._desired)
        if desired is None:
            return None
        return desired | {r.key for r in self.state.open_jobs()}

    def _disk_jobs(self) -> list[DiskJob]:
        return running_jobs(self.executor)

    def _stop_squatter(self, key: str, reason: str) -> None:
        self.executor.stop(key, reason)
        self._wake.set()  # its end is reported with the reason

    def _send_reports(self) -> None:
        """Report starts and ends (raises Unreachable); stop the attempts the answer calls stale."""
        stale = self.reports.send(self.logs.tails)
        if stale:
            with self._lock:
                self._stale |= stale
            self._wake.set()
