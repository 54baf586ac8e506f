"""One copy of a job, ever: restartable work on a node stops itself before the pool can requeue it.

The control plane declares a node lost when its heartbeats have been missing for `lost_after_s`
and then starts the node's restartable work again elsewhere. A node cut off from the control
plane (or whose agent died) must therefore have ended those jobs *before* that moment, or two
copies of one job run at once. Three parts make that so:

- `Contact`: the agent writes, after every successful heartbeat, the deadline until which it
  may keep restartable work running — the time the heartbeat was *sent* plus the fence time — to
  a root-owned file in its data dir (0600, in a 0700 directory: no job can read or change it).
  Times are on CLOCK_BOOTTIME, which is shared by every process of the host and keeps counting
  through a suspend, as the control plane's clock does.
- `Timeouts`: the fence time, checked at start against the control plane's lost-node timeout:
  fence + the kill grace + a margin must end before the node can be declared lost.
- the supervisor (`python -m computepool.agent.fencing …`): one small process per restartable
  job, in its own session, so it outlives an agent that is killed. It watches the contact file
  and, once the deadline has passed, marks the attempt fenced, sends SIGTERM to the job's process
  group, and SIGKILL at deadline + grace (its cgroup's processes and its container too). It
  exits when the job ends. The agent, while alive, applies the same deadline itself.

SIGKILL is due at deadline + grace whatever the time now: a node that was frozen (SIGSTOP, a
paused VM) and thawed past that moment kills at once, with no SIGTERM the job could handle while
the pool already runs its next attempt elsewhere, and waits until the job's processes are gone.
A deadline that passed without contact is kept in the contact file as `lapsed`: every job that
ran through it is fenced even when a heartbeat answered after the thaw moves the deadline on.

A fenced attempt is reported as `lost` with the fence as its reason, which the control plane
answers by requeueing the work (as attempt + 1). Work that is not restartable is never fenced:
it keeps running through an outage, as before.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from computepool.agent.localstate import JobRecord

CONTACT_FILE = "contact.json"
FENCE_DIR = "fence"
FENCED_PREFIX = "fenced:"
POLL_S = 0.2


def now_s() -> float:
    """Seconds on CLOCK_BOOTTIME: one clock for the agent and every supervisor of this host."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class FenceConfigError(ValueError):
    """The fence cannot end work before the control plane's lost-node timeout; says what to change."""


@dataclass(frozen=True)
class Timeouts:
    """The fence time and what it must fit in; `check()` refuses combinations that allow two copies."""

    lost_after_s: float
    heartbeat_interval_s: float
    kill_grace_s: float
    fence_s: float | None = None  # None: as long as the lost-node timeout allows

    @property
    def margin_s(self) -> float:
        """Room for the supervisors' polling and a slow kill."""
        return max(2 * POLL_S + 0.1, 0.05 * self.lost_after_s)

    @property
    def grace_s(self) -> float:
        """SIGTERM → SIGKILL for fenced work: the agent's kill grace, at most a quarter of the timeout."""
        return min(self.kill_grace_s, 0.25 * self.lost_after_s)

    @property
    def effective_fence_s(self) -> float:
        if self.fence_s is not None:
            return self.fence_s
        return self.lost_after_s - self.grace_s - self.margin_s

    def check(self) -> None:
        fence = self.effective_fence_s
        ends = fence + self.grace_s + self.margin_s
        if ends > self.lost_after_s + 1e-9:
            raise FenceConfigError(
                f"fence {fence:g} s + kill grace {self.grace_s:g} s + margin {self.margin_s:g} s is not "
                f"below the control plane's lost-node timeout {self.lost_after_s:g} s: restartable work "
                "could run twice (lower --fence-s or --kill-grace-s, or raise the server's --lost-s)"
            )
        if fence < 2 * self.heartbeat_interval_s:
            raise FenceConfigError(
                f"fence {fence:g} s is shorter than two heartbeats ({self.heartbeat_interval_s:g} s each): "
                "one late heartbeat would stop restartable work (raise the server's --lost-s or --fence-s)"
            )


class Contact:
    """The node's last contact with the control plane, shared with the supervisors through a file.

    Also remembers the control plane's timeouts, so that an agent restarted while the server is
    away still knows its fence.
    """

    def __init__(self, data_dir: Path, kill_grace_s: float, fence_s: float | None = None) -> None:
        self.path = data_dir / CONTACT_FILE
        self.kill_grace_s = kill_grace_s
        self.fence_s = fence_s
        self.timeouts: Timeouts | None = None  # None until the control plane has said its timeouts
        self.contact: float | None = None
        self.lapsed: float | None = None  # the last deadline that passed before contact came back
        self.rejoined: float | None = None  # when contact came back after that (this process only)
        saved = _read_json(self.path)
        if saved is not None:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                self.lapsed = float(saved["lapsed"]) if saved.get("lapsed") is not None else None
            with contextlib.suppress(KeyError, TypeError, ValueError):
                self.contact = float(saved["contact"])
                self.timeouts = self._timeouts(float(saved["lost_after_s"]), float(saved["heartbeat_s"]))

    def _timeouts(self, lost_after_s: float, heartbeat_s: float) -> Timeouts:
        return Timeouts(lost_after_s, heartbeat_s, self.kill_grace_s, self.fence_s)

    def learn(self, lost_after_s: float | None, heartbeat_s: float | None) -> Timeouts | None:
        """Take the control plane's timeouts from an answer; raises FenceConfigError if they clash."""
        if not lost_after_s:
            return self.timeouts
        t = self._timeouts(float(lost_after_s), float(heartbeat_s or 0.0))
        t.check()
        if t != self.timeouts:
            self.timeouts = t
            if self.contact is not None:
                self._save()
        return t

    @property
    def fence(self) -> float | None:
        """The fence in force: from the control plane's timeouts, else the one given, else none yet."""
        return self.timeouts.effective_fence_s if self.timeouts is not None else self.fence_s

    @property
    def grace_s(self) -> float:
        return self.timeouts.grace_s if self.timeouts is not None else self.kill_grace_s

    def touch(self, sent_at: float, now: float | None = None) -> None:
        """A heartbeat sent at `sent_at` was answered: move the deadline on (never back).

        If the deadline in force passed before this answer came, the node was out of contact long
        enough for the pool to move its work: that deadline is kept as `lapsed` (every job that ran
        through it is fenced) and `rejoined` says from when the pool's answers can be trusted again."""
        now = now_s() if now is None else now
        if self.contact is not None and sent_at <= self.contact:
            return
        d = self.deadline()
        if d is not None and now >= d:
            self.lapsed, self.rejoined = d, now
        self.contact = sent_at
        self._save()

    def deadline(self) -> float | None:
        fence = self.fence
        return None if self.contact is None or fence is None else self.contact + fence

    def overdue(self, now: float | None = None) -> bool:
        d = self.deadline()
        return d is not None and (now_s() if now is None else now) >= d

    def reason(self) -> str:
        return fence_reason(self.fence or 0.0)

    def kill_at(self, started: float) -> float | None:
        """When a restartable job that started at `started` (CLOCK_BOOTTIME) must be dead: the
        deadline in force + grace once it has passed, or a lapsed deadline it ran through + grace;
        None while it may run on."""
        return fence_kill_at(self.deadline(), self.lapsed, started, self.grace_s, now_s())

    def _save(self) -> None:
        t = self.timeouts
        data: dict[str, Any] = {"contact": self.contact, "deadline": self.deadline(), "fence_s": self.fence}
        data["lapsed"] = self.lapsed
        if t is not None:
            data.update(lost_after_s=t.lost_after_s, heartbeat_s=t.heartbeat_interval_s)
        _write_private(self.path, json.dumps(data))


def fence_reason(fence_s: float) -> str:
    return (
        f"{FENCED_PREFIX} no contact with the control plane for {fence_s:g} s; stopped before the "
        "pool could start this restartable work elsewhere"
    )


def fence_kill_at(
    deadline: float | None, lapsed: float | None, started: float, grace_s: float, now: float
) -> float | None:
    """SIGKILL time of a job started at `started` (all on CLOCK_BOOTTIME), None if it may run on."""
    if deadline is not None and now >= deadline:
        return deadline + grace_s
    if lapsed is not None and started < lapsed:
        return lapsed + grace_s  # it ran through a lapse: the pool may have started it elsewhere
    return None


def boot_time_of(create_time: float) -> float:
    """A process's start (psutil's create_time, wall clock) on CLOCK_BOOTTIME."""
    return now_s() - max(0.0, time.time() - create_time)


def read_deadline(path: Path) -> float | None:
    return _read_float(path, "deadline")


def read_lapsed(path: Path) -> float | None:
    return _read_float(path, "lapsed")


def _read_float(path: Path, field: str) -> float | None:
    data = _read_json(path)
    if data is None or data.get(field) is None:
        return None
    try:
        return float(data[field])
    except (TypeError, ValueError):
        return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_private(path: Path, text: str) -> None:
    """0600 through a temp file and rename: a reader sees the old or the new deadline, never half."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ---- markers: which attempts were fenced (agent-owned, never in the job's own directory) -----


def _stem(key: str) -> str:
    return key.replace("#", ".")


def fence_dir(data_dir: Path) -> Path:
    d = data_dir / FENCE_DIR
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def mark_fenced(data_dir: Path, key: str, reason: str) -> None:
    path = fence_dir(data_dir) / f"{_stem(key)}.fenced"
    if not path.exists():
        _write_private(path, json.dumps({"reason": reason, "at": datetime.now(UTC).isoformat()}))


def fenced_reason(data_dir: Path, key: str) -> str | None:
    """The fence's reason when this attempt was fenced (by the agent or its supervisor)."""
    data = _read_json(data_dir / FENCE_DIR / f"{_stem(key)}.fenced")
    return None if data is None else str(data.get("reason") or fence_reason(0))


# ---- the supervisor ------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """The job a supervisor watches: its leader (pid + start time, so a reused pid is never hit),
    process group, cgroup and container, whichever it has."""

    key: str
    pid: int
    create_time: float
    pgid: int
    cgroups: tuple[str, ...] = ()  # one directory on cgroup v2, one per controller on v1
    container: str = ""  # the podman container's name
    podman_conf: str = ""  # the containers.conf the agent runs podman with

    def args(self) -> list[str]:
        out = ["--key", self.key, "--pid", str(self.pid), "--create-time", repr(self.create_time)]
        out += ["--pgid", str(self.pgid)]
        for path in self.cgroups:
            out += ["--cgroup", path]
        if self.container:
            out += ["--container", self.container, "--podman-conf", self.podman_conf]
        return out


def target_of(rec: JobRecord, container_engine: Callable[[], Any] | None = None) -> Target:
    """The supervisor's view of a started job; `container_engine` names its container (podman)."""
    container = conf = ""
    if rec.extra.get("container") and container_engine is not None:
        engine = container_engine()
        container, conf = engine.name(rec.extra["container"]), str(engine.conf_path)
    cgroups = tuple((rec.extra.get("cgroup_paths") or rec.cgroup).splitlines())
    return Target(rec.key, rec.pid, rec.create_time, rec.pgid, cgroups, container, conf)


def alive(pid: int, create_time: float) -> bool:
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 0.05 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _members(t: Target) -> set[int]:
    """The job's live processes (zombies are dead already): its group (born after the leader, so
    no reused group id) and cgroup."""
    pids: set[int] = set()
    for p in psutil.process_iter(["pid", "create_time", "status"]):
        with contextlib.suppress(OSError, psutil.Error):
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(p.pid) == t.pgid and p.info["create_time"] >= t.create_time - 0.05:
                pids.add(p.pid)
    for path in t.cgroups:
        with contextlib.suppress(OSError, ValueError):
            for pid in (int(x) for x in (Path(path) / "cgroup.procs").read_text().split()):
                with contextlib.suppress(psutil.Error):
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        pids.add(pid)
    return pids - {os.getpid()}


def _podman(t: Target, *args: str) -> None:
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    if t.podman_conf:
        env["CONTAINERS_CONF"] = t.podman_conf
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(["podman", *args], env=env, capture_output=True, timeout=60, check=False)


def kill_job(t: Target, grace_s: float, kill_at: float | None = None, confirm_s: float = 60.0) -> bool:
    """SIGTERM to everything of the job, SIGKILL to what is left at `kill_at` (CLOCK_BOOTTIME;
    default: `grace_s` from now). Past `kill_at` already (a thawed node): SIGKILL at once, no
    SIGTERM. Returns whether the job's processes were seen gone within `confirm_s` after SIGKILL."""
    kill_at = now_s() + grace_s if kill_at is None else kill_at
    if now_s() < kill_at:
        if t.container:
            _podman(t, "kill", "--signal", "TERM", t.container)
        for pid in _members(t):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        while now_s() < kill_at and _members(t):
            time.sleep(0.05)
    end = time.monotonic() + confirm_s
    _sigkill(t)
    if t.container:  # SIGKILL to its processes, then the container itself goes
        _podman(t, "kill", "--signal", "KILL", t.container)
        _podman(t, "rm", "--force", "--ignore", "--time=0", t.container)
    while _members(t) or alive(t.pid, t.create_time):  # confirmed dead, not just signalled
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
        _sigkill(t)
    return True


def _sigkill(t: Target) -> None:
    """SIGKILL to the job's processes: its group first (one call), its cgroup, each member."""
    if alive(t.pid, t.create_time):  # the leader is ours, so is its group id
        with contextlib.suppress(OSError):
            os.killpg(t.pgid, signal.SIGKILL)
    for path in t.cgroups:
        with contextlib.suppress(OSError):
            (Path(path) / "cgroup.kill").write_text("1")  # cgroup v2: every member, forks included
    for pid in _members(t):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def supervise(data_dir: Path, t: Target, grace_s: float, poll_s: float = POLL_S) -> str:
    """Watch until the job ends ('ended') or the deadline passes ('fenced', after killing it)."""
    contact = data_dir / CONTACT_FILE
    started = boot_time_of(t.create_time)
    last = read_deadline(contact)
    while alive(t.pid, t.create_time):
        deadline = read_deadline(contact)
        last = deadline if deadline is not None else last
        kill_at = fence_kill_at(last, read_lapsed(contact), started, grace_s, now_s())
        if kill_at is not None:
            saved = _read_json(contact) or {}
            mark_fenced(data_dir, t.key, fence_reason(float(saved.get("fence_s") or 0.0)))
            kill_job(t, grace_s, kill_at)
            return "fenced"
        time.sleep(poll_s)
    return "ended"


def spawn(data_dir: Path, t: Target, grace_s: float) -> subprocess.Popen[bytes]:
    """Start the supervisor of one job, in its own session so that it outlives the agent."""
    cmd = [sys.executable, "-m", "computepool.agent.fencing", "--data-dir", str(data_dir)]
    cmd += [*t.args(), "--grace-s", repr(grace_s)]
    log = fence_dir(data_dir) / f"{_stem(t.key)}.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True, close_fds=True
        )
    finally:
        os.close(fd)
    _write_private(fence_dir(data_dir) / f"{_stem(t.key)}.pid", json.dumps(_identity(proc.pid)))
    return proc


def _identity(pid: int) -> dict[str, float]:
    try:
        return {"pid": pid, "create_time": psutil.Process(pid).create_time()}
    except psutil.Error:
        return {"pid": pid, "create_time": 0.0}


def supervised(data_dir: Path, key: str) -> bool:
    """Whether the supervisor of this attempt still runs (an adopting agent starts one if not)."""
    data = _read_json(data_dir / FENCE_DIR / f"{_stem(key)}.pid")
    if data is None:
        return False
    with contextlib.suppress(KeyError, TypeError, ValueError):
        return alive(int(data["pid"]), float(data["create_time"]))
    return False


def forget(data_dir: Path, key: str) -> None:
    """Drop an ended attempt's supervisor files (its fenced marker stays until reported)."""
    for suffix in (".pid", ".log"):
        with contextlib.suppress(OSError):
            (data_dir / FENCE_DIR / f"{_stem(key)}{suffix}").unlink()


def forget_marker(data_dir: Path, key: str) -> None:
    with contextlib.suppress(OSError):
        (data_dir / FENCE_DIR / f"{_stem(key)}.fenced").unlink()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="computepool.agent.fencing", description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--create-time", type=float, required=True)
    p.add_argument("--pgid", type=int, required=True)
    p.add_argument("--cgroup", action="append", default=[])
    p.add_argument("--container", default="")
    p.add_argument("--podman-conf", default="")
    p.add_argument("--grace-s", type=float, default=10.0)
    p.add_argument("--poll-s", type=float, default=POLL_S)
    a = p.parse_args(argv)
    t = Target(a.key, a.pid, a.create_time, a.pgid, tuple(a.cgroup), a.container, a.podman_conf)
    outcome = supervise(a.data_dir, t, a.grace_s, a.poll_s)
    if outcome == "fenced":
        print(f"{datetime.now(UTC).isoformat()} {a.key}: fenced (no contact with the control plane)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
