"""Run a job's command as a child process group, hold it to its CPU and host memory, and stop it.

Each job runs under a tiny `/bin/sh` wrapper that (1) waits on a pipe until the agent has put it
in its cgroup or set its rlimits, so not one instruction of the workload runs unlimited, and
(2) writes the command's exit status into the run dir, so an agent that restarted can still
tell how a job ended while it was away. The wrapper is the process group leader: signalling the
group reaches the workload and everything it forked.

With a `SandboxConfig` (the agent always gives one) the wrapper stays root and outside the job:
the command itself runs in the sandbox (`sandbox.py`) as its tenant's user (`tenants.py`), or in
a podman container when the request names an image (`container.py`). The run dir, its exit
status and its logs are root's; the job only ever writes its logs through the descriptors it was
given, and its own files in `work/`.

What to run is a `JobSpec` (jobspec.py); telling whether a job's processes are still its own and
how it ended is outcome.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import psutil

from computepool.agent import cgroups
from computepool.agent.cgroups import CgroupV1, CgroupV2
from computepool.agent.exits import ExitWatch
from computepool.agent.identity import node_key
from computepool.agent.jobspec import (
    DEFAULT_CGROUP_BASE,
    EXIT_FILE,
    STDERR_LOG,
    STDOUT_LOG,
    AdoptReport,
    JobSpec,
)
from computepool.agent.launch import Launcher, default_env, which
from computepool.agent.localstate import JobRecord, JobState, LocalState
from computepool.agent.outcome import (
    alive,
    child_exited,
    explain_exit,
    kill_leftovers,
    read_exit,
    shell_status,
    signal_job,
    still_dying,
)
from computepool.agent.removal import Remover
from computepool.agent.sandbox import SandboxConfig
from computepool.core.errors import InvalidInput

if TYPE_CHECKING:
    from computepool.agent.container import Podman

__all__ = [
    "DEFAULT_CGROUP_BASE",
    "STDERR_LOG",
    "STDOUT_LOG",
    "AdoptReport",
    "CgroupV1",
    "CgroupV2",
    "Executor",
    "JobSpec",
    "SandboxConfig",
]

MIB = 1024 * 1024
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")

# $1 is the exit file, $2 the job's stdin (a file, or /dev/null); the rest is the command. stdin is
# the gate pipe until the agent says go (followed, where the sandbox's init writes the CPU quota, by
# its value, commas for spaces, and its file, which reach that init through the root side's env).
# The wrapper outlives SIGTERM (a trap, which the command does not inherit) so that the command
# gets its whole grace period and its exit status is still written.
_WRAPPER = """\
read -r _cpool_go _cpool_cpu_max _cpool_cpu_file || exit 125
if [ -n "$_cpool_cpu_file" ]; then
    export CPOOL_INIT_CPU_FILE="$_cpool_cpu_file" CPOOL_INIT_CPU_MAX="$_cpool_cpu_max"
fi
exec <"$2" || exit 125
trap : TERM
_cpool_exit_file=$1
shift 2
"$@"
_cpool_rc=$?
(umask 077 && echo "$_cpool_rc" > "$_cpool_exit_file")
exit "$_cpool_rc"
"""


log = logging.getLogger("computepool.agent")


@dataclass
class _Live:
    rec: JobRecord
    popen: subprocess.Popen[bytes] | None  # None for a job adopted after a restart
    stop_deadline: float | None = None
    rss_limit_mib: int = 0  # host memory watched by RSS (GPU jobs without a cgroup)
    cpus: tuple[int, ...] = ()
    reaped_at: float | None = None  # its leader ended and was reaped; the rest may still be dying
    rc: int | None = None  # the leader's status, once reaped
    oom: int = 0  # OOM kills read before its cgroup and container went


class Executor:
    """Starts, watches and stops the node's jobs; every change is written to the local state first.

    `poll()` is meant to be called from the agent's control loop: it notices ended jobs, turns a
    stop whose grace period ran out into SIGKILL, and returns the jobs that ended since the last
    call; `on_exit`, when given, is called (from another thread) the moment a job's leader ends,
    so that the loop polls at once (exits.py). Safe to call from several threads (the memory
    watchdog calls `stop`).
    """

    def __init__(
        self,
        data_dir: Path,
        state: LocalState | None = None,
        *,
        cgroup_base: Path | None = DEFAULT_CGROUP_BASE,
        node: str = "",
        kill_grace_s: float = 10.0,
        base_env: Mapping[str, str] | None = None,
        sandbox: SandboxConfig | None = None,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        """`sandbox=None` runs jobs as plain children of the agent's own user (embedding, tests).

        Job cgroups go to `<cgroup_base>/<node key>/` (identity.py): this executor's own, whatever
        else uses the base on this host."""
        self.data_dir = data_dir
        self.state = state if state is not None else LocalState(data_dir)
        self.cgroup_dir = cgroup_base / node_key(data_dir, node) if cgroup_base is not None else None
        tenant_pids = sandbox.tenant_pids_max if sandbox is not None else 0
        self.cgroups = cgroups.detect(self.cgroup_dir, tenant_pids) if self.cgroup_dir is not None else None
        self.kill_grace_s = kill_grace_s
        self.launcher = Launcher(
            data_dir, self.state, sandbox, dict(base_env) if base_env is not None else default_env()
        )
        self.launcher.job_cgroups = self.cgroups
        host = self.launcher.host
        # jobs pass through the data dir to their own `work/`; nothing in it is theirs to list or read
        os.chmod(data_dir, 0o711 if host is not None and host.root else 0o700)
        self._live: dict[str, _Live] = {}
        self._ended: list[JobRecord] = []
        self._lock = threading.RLock()
        self._remover = Remover(self._remove_now)  # `podman rm` runs off the lock (removal.py)
        self.exits = ExitWatch(on_exit) if on_exit is not None else None

    # ---- starting -------------------------------------------------------------------------

    def run_dir(self, allocation_id: str, attempt: int) -> Path:
        return self.data_dir / "runs" / allocation_id / str(attempt)

    def work_dir(self, allocation_id: str, attempt: int) -> Path:
        """The job's own directory (cwd, HOME, CPOOL_RUN_DIR): `work/` in the run dir when sandboxed."""
        return self.launcher.work_dir(self.run_dir(allocation_id, attempt))

    def start(self, spec: JobSpec) -> JobRecord:
        """Start one attempt; idempotent while it runs. Failures are recorded, never raised."""
        if not _SAFE_ID.match(spec.allocation_id):
            raise InvalidInput("allocation_id", f"{spec.allocation_id!r} is not a safe name")
        if spec.attempt < 1:
            raise InvalidInput("attempt", f"must be 1 or more, got {spec.attempt}")
        with self._lock:
            live = self._live.get(spec.key)
            if live is not None:
                return live.rec
        self._remover.wait_gone(spec.key)  # the same key again: its old container goes first
        why = ""
        try:
            self.launcher.prepare(spec)  # outside the lock: a pull may take minutes
        except Exception as e:
            why = f"could not start: {e}"
        with self._lock:
            live = self._live.get(spec.key)
            if live is not None:
                return live.rec
            run_dir = self.run_dir(spec.allocation_id, spec.attempt)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / EXIT_FILE).unlink(missing_ok=True)
            rec = JobRecord(
                allocation_id=spec.allocation_id,
                attempt=spec.attempt,
                command=list(spec.command),
                run_dir=str(run_dir),
                started_at=time.time(),
                memory_mib=spec.memory_mib,
            )
            if spec.tenant:
                rec.extra["tenant"] = spec.tenant
            if why:
                return self._fail(rec, why, None)
            try:
                return self._start(spec, rec, run_dir)
            except Exception as e:  # the agent must survive whatever a bad job does
                return self._fail(rec, f"could not start: {e}", None)

    def _fail(self, rec: JobRecord, reason: str, exit_code: int | None) -> JobRecord:
        rec.state, rec.reason, rec.exit_code = JobState.FAILED, reason, exit_code
        rec.ended_at = time.time()
        self.state.put(rec)
        self._ended.append(rec)
        return rec

    def _container_engine(self) -> Podman:
        return self.launcher.container_engine()

    def _start(self, spec: JobSpec, rec: JobRecord, run_dir: Path) -> JobRecord:
        if not spec.command:
            return self._fail(rec, "empty command", None)
        launch = self.launcher.launch(spec, rec, run_dir)
        if isinstance(launch, str):
            return self._fail(rec, launch, None)
        path = launch.path if launch.path is not None else launch.env.get("PATH", "")
        if not spec.image and launch.agent_looks_up and which(spec.command[0], path) is None:
            return self._fail(rec, f"command not found: {spec.command[0]}", 127)
        user = launch.user
        as_user = user is not None and os.geteuid() == 0

        stdin = spec.stdin or "/dev/null"
        wrapper = ["/bin/sh", "-c", _WRAPPER, "cpool-job", str(run_dir / EXIT_FILE), stdin]
        gate_r, gate_w = os.pipe()
        try:
            with _log(run_dir / STDOUT_LOG) as out, _log(run_dir / STDERR_LOG) as err:
                popen = subprocess.Popen(
                    [*wrapper, *launch.argv],
                    stdin=gate_r,
                    stdout=out,
                    stderr=err,
                    env=launch.env,
                    cwd=spec.cwd or str(launch.cwd),
                    start_new_session=True,
                    user=user.pw_uid if as_user and user is not None else None,
                    group=user.pw_gid if as_user and user is not None else None,
                    extra_groups=[] if as_user else None,
                )
        except BaseException:
            os.close(gate_w)
            raise
        finally:
            os.close(gate_r)

        rec.pid = rec.pgid = popen.pid
        live = _Live(rec, popen)
        try:
            rec.create_time = psutil.Process(popen.pid).create_time()
            go = "go"
            if spec.image:
                rec.limits = f"{launch.applied} (podman applies cpu, memory, devices and the user)"
            else:
                cpu_limit = self._limit(spec, live, defer_cpu=launch.writes_cpu_limit)
                if cpu_limit is not None:
                    go = f"go {cpu_limit[1].replace(' ', ',')} {cpu_limit[0]}"  # the path last: spaces
                if launch.applied:
                    rec.limits += f"; sandbox: {launch.applied}"
            self.state.put(rec)  # recorded before the workload runs: a crash now cannot orphan it
            os.write(gate_w, go.encode() + b"\n")
        except Exception as e:
            os.close(gate_w)  # the wrapper reads EOF and exits without running the command
            popen.wait()
            self._drop_cgroup(rec)
            return self._fail(rec, f"could not start: {e}", None)
        os.close(gate_w)
        self._live[rec.key] = live
        if self.exits is not None:
            self.exits.watch(rec.key, rec.pid)
        return rec

    def _limit(self, spec: JobSpec, live: _Live, defer_cpu: bool = False) -> tuple[Path, str] | None:
        """Holds the job in its limits; returns the CPU quota left for the sandbox to write, if any."""
        sandbox = self.launcher.sandbox
        held = cgroups.hold(
            self.cgroups,
            f"{spec.allocation_id}.{spec.attempt}",
            live.rec.pid,
            cpu_milli=spec.cpu_milli,
            memory_mib=spec.memory_mib,
            pids_max=spec.pids_max or (sandbox.pids_max if sandbox is not None else 0),
            uses_gpu=spec.uses_gpu,
            busy_cpus=[c for other in self._live.values() for c in other.cpus],
            defer_cpu=defer_cpu,
            group=cgroups.tenant_group(spec.tenant),
        )
        live.rec.limits, live.rss_limit_mib, live.cpus = held.limits, held.rss_limit_mib, held.cpus
        if held.cgroup is None:
            return None
        live.rec.cgroup = str(held.cgroup.path)
        live.rec.extra["cgroup_paths"] = "\n".join(str(p) for p in held.cgroup.paths)
        return held.cgroup.cpu_limit

    # ---- watching -------------------------------------------------------------------------

    def get(self, key: str) -> JobRecord | None:
        with self._lock:
            live = self._live.get(key)
            return live.rec if live is not None else self.state.get(key)

    def running(self) -> list[JobRecord]:
        with self._lock:
            return [live.rec for live in self._live.values()]

    def poll(self) -> list[JobRecord]:
        """Jobs that ended since the last call, each returned once (start failures included)."""
        with self._lock:
            for key in list(self._live):
                self._refresh(key)
            ended, self._ended = self._ended, []
            return ended

    def wait(self, key: str, timeout: float | None = None) -> JobRecord:
        """Block until the job ends and its container is gone (or the timeout passes); its record anyway."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.005
        while True:
            with self._lock:
                if key in self._live:
                    self._refresh(key)
                live = self._live.get(key)
                if live is None:
                    rec = self.state.get(key)
                    if rec is None:
                        raise KeyError(key)
                    break
            if deadline is not None and time.monotonic() >= deadline:
                return live.rec
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        container = rec.extra.get("container")
        if container:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._remover.wait_gone(container, left)
        return rec

    def job_pids(self, key: str) -> set[int]:
        """Every live process of the job: its cgroup, else the leader and all its descendants."""
        with self._lock:
            live = self._live.get(key)
            if live is None:
                return set()
            rec = live.rec
        pids = cgroups.pids(Path(rec.cgroup)) if rec.cgroup else set()
        try:
            leader = psutil.Process(rec.pid)
            if abs(leader.create_time() - rec.create_time) < 0.05:
                pids.add(rec.pid)
                pids.update(c.pid for c in leader.children(recursive=True))
        except psutil.Error:
            pass
        return pids

    def _refresh(self, key: str) -> None:
        live = self._live[key]
        rec = live.rec
        if live.reaped_at is not None:  # ended: its devices are free once what it left has exited
            if not self._dying(live):
                self._record_end(live)
            return
        rc = None
        if live.popen is not None:
            ended = child_exited(live.popen)  # still unreaped: its pid and group id stay the job's
        else:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(rec.pid, os.WNOHANG)  # reap it if it happens to be our child
            ended = not alive(rec)
            rc = read_exit(Path(rec.run_dir)) if ended else None
        if ended:
            self._finish(live, rc)
            return
        self._escalate(live)
        self._check_rss(live)

    def _escalate(self, live: _Live) -> None:
        if live.stop_deadline is not None and time.monotonic() >= live.stop_deadline:
            self._signal_group(live.rec, signal.SIGKILL)
            live.stop_deadline = None

    def _check_rss(self, live: _Live) -> None:
        if live.rss_limit_mib <= 0 or live.rec.stop_reason:
            return
        total = 0
        for pid in self.job_pids(live.rec.key):
            with contextlib.suppress(psutil.Error):
                total += psutil.Process(pid).memory_info().rss
        if total // MIB > live.rss_limit_mib:
            reason = (
                f"out of memory: host memory {total // MIB} MiB over limit {live.rss_limit_mib} MiB (RSS)"
            )
            self._stop(live, reason, 0.0)

    def _finish(self, live: _Live, rc: int | None) -> None:
        """The leader ended: kill and reap, then record the end, or (while a process the job left is
        still exiting, or its container is being removed) leave that to a later pass: the job stays
        live, so the loop starts nothing else on its devices meanwhile."""
        rec = live.rec
        kill_leftovers(rec)  # before the leader is reaped: its group id cannot be anyone else's yet
        if live.popen is not None:
            rc = live.popen.wait()
        live.reaped_at = time.time()
        live.rc = rc = shell_status(rc)
        if self.exits is not None:
            self.exits.unwatch(rec.key)
        live.oom = cgroups.oom_kills(Path(rec.cgroup)) if rec.cgroup else 0
        if not live.oom and rec.extra.get("container"):  # asked before removal takes its cgroup away
            with contextlib.suppress(Exception):
                engine, tenant = self._container_engine(), rec.extra.get("tenant", "")
                live.oom = int(engine.out_of_memory(rec.extra["container"], rc, tenant))
        self._remove_container(rec)
        if self._dying(live):
            log.info("%s: its leader ended; waiting for the rest of its processes to exit", rec.key)
            return
        self._record_end(live)

    def _dying(self, live: _Live) -> bool:
        """A container whose `podman run` was stopped or killed may outlive it until removed; one
        whose command exited on its own has no process left (its removal is only tidying)."""
        container = live.rec.extra.get("container")
        killed = bool(live.rec.stop_reason) or live.rc is None or live.rc >= 128
        if container and killed and self._remover.pending(container):
            return True
        return still_dying(live.rec, live.reaped_at if live.popen is not None else None)

    def _record_end(self, live: _Live) -> None:
        rec, rc, oom = live.rec, live.rc, live.oom
        rec.exit_code = rc
        rec.ended_at = time.time()
        self._drop_cgroup(rec)
        if rec.stop_reason:
            rec.state, rec.reason = JobState.KILLED, rec.stop_reason
        elif oom > 0:
            rec.state = JobState.FAILED
            rec.reason = f"out of memory (cgroup memory limit {rec.memory_mib} MiB)"
        elif rc is None:
            rec.state, rec.reason = JobState.LOST, "ended while the agent was away; exit status unknown"
        elif rc == 0:
            rec.state, rec.reason = JobState.SUCCEEDED, ""
        else:
            rec.state, rec.reason = JobState.FAILED, explain_exit(rec, rc)
        self.state.put(rec)
        self._ended.append(rec)
        del self._live[rec.key]

    def _drop_cgroup(self, rec: JobRecord) -> None:
        if rec.cgroup:
            paths = rec.extra.get("cgroup_paths") or rec.cgroup
            cgroups.remove([Path(p) for p in paths.splitlines()])

    def _remove_container(self, rec: JobRecord) -> None:
        """A container outlives its `podman run` client when that is killed: remove it by key, soon and
        off the lock (removal.py). How it ended (OOM included) is read before this is asked."""
        if rec.extra.get("container"):
            self._remover.submit(rec.extra["container"])

    def _remove_now(self, key: str) -> None:
        self._container_engine().remove(key)

    def close(self) -> None:
        """Finish the container removals still queued (the agent calls this when it stops)."""
        if self.exits is not None:
            self.exits.close()
        self._remover.close()

    # ---- stopping -------------------------------------------------------------------------

    def stop(self, key: str, reason: str, grace_s: float | None = None) -> None:
        """SIGTERM to the job's group now; `poll` sends SIGKILL once the grace period is over."""
        with self._lock:
            live = self._live.get(key)
            if live is not None:
                self._stop(live, reason, self.kill_grace_s if grace_s is None else grace_s)

    def _stop(self, live: _Live, reason: str, grace_s: float) -> None:
        rec = live.rec
        if not rec.stop_reason:
            rec.stop_reason = reason
            self.state.put(rec)
        if grace_s <= 0:
            self._signal_group(rec, signal.SIGKILL)
            live.stop_deadline = None
            return
        self._signal_group(rec, signal.SIGTERM)
        live.stop_deadline = time.monotonic() + grace_s

    def kill(self, key: str, reason: str, grace_s: float | None = None) -> JobRecord:
        """Stop and wait until the whole group is gone."""
        grace = self.kill_grace_s if grace_s is None else grace_s
        self.stop(key, reason, grace)
        return self.wait(key, timeout=grace + 10)

    def _signal_group(self, rec: JobRecord, sig: signal.Signals) -> None:
        leader = alive(rec, zombie_ok=True)  # else gone, or its pid reused: only what is provably ours
        if sig == signal.SIGKILL:
            kill_leftovers(rec)  # its group while the id is the job's, and its cgroup (cgroup.kill)
            if leader:
                self._remove_container(rec)
        elif leader:
            signal_job(rec, sig)  # its group by number only while that number is provably the job's

    # ---- restart --------------------------------------------------------------------------

    def adopt(self) -> AdoptReport:
        """Take back the jobs the local state says are running: still alive → adopted, else ended."""
        adopted, ended = [], []
        with self._lock:
            for rec in self.state.running():
                if rec.key in self._live:
                    continue
                live = _Live(rec, None)
                if alive(rec):
                    with contextlib.suppress(psutil.Error, OSError):
                        live.cpus = tuple(psutil.Process(rec.pid).cpu_affinity() or ())
                    self._live[rec.key] = live
                    adopted.append(rec)
                    if self.exits is not None:  # a pid reused meanwhile only delays the wake to a pass
                        self.exits.watch(rec.key, rec.pid)
                    if rec.stop_reason:  # a stop was under way when the agent went down
                        self._stop(live, rec.stop_reason, self.kill_grace_s)
                else:
                    self._live[rec.key] = live
                    self._finish(live, read_exit(Path(rec.run_dir)))
                    ended.append(rec)
            self._ended = [r for r in self._ended if r not in ended]
            if self.cgroups is not None:  # empty job cgroups a crash left, under this agent's own dir
                self.cgroups.sweep({f"{v.rec.allocation_id}.{v.rec.attempt}" for v in self._live.values()})
            engine = self._container_engine()
            if engine.conf_path.exists():  # podman was used here: containers a crash left behind
                with contextlib.suppress(Exception):
                    engine.sweep(keep=set(self._live))
        return AdoptReport(adopted, ended)


@contextlib.contextmanager
def _log(path: Path) -> Iterator[BinaryIO]:
    """A log the agent owns (0600): the job writes through the descriptor, never by the path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "ab") as f:
        yield f
