"""The agent's side of `cpool exec` and `cpool forward`: it long-polls the control plane for the
sessions its node should answer, dials each one's WebSocket back (the replica that holds the
user's socket; the node's credential plus the session's one-time secret), and runs the command or
makes the connection in the job (jobexec.py), passing bytes until either end closes.

Frames are wire/relay.py's: binary with a stream byte first, JSON text for control.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import ssl
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from computepool.agent import jobexec
from computepool.agent.api import ApiError, Unreachable
from computepool.agent.executor import Executor
from computepool.agent.localstate import job_key
from computepool.agent.sandbox import FIXED_PATH
from computepool.wire.relay import CLIENT_SECRET_HEADER, DATA, STDERR, STDIN, STDOUT

log = logging.getLogger("computepool.agent")
POLL_WAIT_S = 25.0
CHUNK = 64 * 1024
SANDBOX_WAIT_S = 10.0  # a job that has just started gets this long to make its namespaces
DRAIN_S = 2.0  # output still read this long after the command ended (a background child holds it)
# Sessions one tenant may have served on this node at once: each holds about six of the agent's
# threads (and a process), which no job's limit counts; the control plane's cap is per job
# (64), so a tenant with many small jobs could otherwise take the host's last free pids.
MAX_SESSIONS_PER_TENANT = 64


@dataclass(frozen=True)
class Session:
    id: int
    allocation_id: int
    attempt: int
    tenant: str
    kind: str
    command: list[str]
    tty: bool
    rows: int
    cols: int
    port: int
    secret: str
    url: str | None

    @classmethod
    def parse(cls, item: dict[str, Any]) -> Session:
        return cls(
            id=int(item["id"]), allocation_id=int(item["allocation_id"]), attempt=int(item["attempt"]),
            tenant=str(item["tenant"]), kind=str(item["kind"]), command=[str(c) for c in item["command"]],
            tty=bool(item["tty"]), rows=int(item["rows"]), cols=int(item["cols"]), port=int(item["port"]),
            secret=str(item["secret"]), url=item.get("url") or None,
        )  # fmt: skip


def ws_url(http_url: str, sid: int) -> str:
    base = http_url.rstrip("/")
    base = "wss://" + base[8:] if base.startswith("https://") else "ws://" + base.removeprefix("http://")
    return f"{base}/api/v1/relays/{sid}/node"


class Relays:
    """Answers the node's relay sessions, each on a thread of its own, until `stop` is set."""

    def __init__(
        self,
        api: Any,
        credential: str,
        executor: Executor,
        user_of: Callable[[str], Any],
        verify: ssl.SSLContext | bool,
        stop: threading.Event,
    ) -> None:
        self.api, self.credential, self.executor = api, credential, executor
        self.user_of, self.verify, self.stop = user_of, verify, stop
        self._since = 0
        self._lock = threading.Lock()
        self._serving: dict[str, int] = {}  # sessions being served, per tenant

    def run(self) -> None:
        failures = 0
        while not self.stop.is_set():
            try:
                answer = self.api.relays(self._since, POLL_WAIT_S)
                failures = 0
            except (Unreachable, ApiError) as e:
                failures += 1
                if failures == 1:
                    log.warning("relay sessions: %s", e)
                wait = 30.0 if isinstance(e, ApiError) and e.status == 404 else min(10.0, 0.5 * 2**failures)
                self.stop.wait(wait)
                continue
            for item in answer.get("items") or []:
                try:
                    s = Session.parse(item)
                except (KeyError, TypeError, ValueError) as e:
                    log.error("unreadable relay session %r: %s", item, e)
                    continue
                self._since = max(self._since, s.id)
                threading.Thread(
                    target=self.serve, args=(s,), name=f"cpool-relay-{s.id}", daemon=True
                ).start()

    def serve(self, s: Session) -> None:
        with self._lock:
            held = self._serving.get(s.tenant, 0)
            self._serving[s.tenant] = held + 1
        try:
            self._serve(s, held)
        finally:
            with self._lock:
                self._serving[s.tenant] -= 1
                if not self._serving[s.tenant]:
                    del self._serving[s.tenant]

    def _serve(self, s: Session, held: int) -> None:
        """`held`: how many of its tenant's sessions this node served when this one came."""
        headers = {"Authorization": f"Bearer {self.credential}", CLIENT_SECRET_HEADER: s.secret}
        try:
            ws = connect(
                ws_url(s.url or self.api.server, s.id),
                additional_headers=headers,
                ssl=self.verify if isinstance(self.verify, ssl.SSLContext) else None,
                open_timeout=10,
                compression=None,
                max_size=4 * CHUNK,
            )
        except Exception as e:  # the user will hear the session timed out
            log.warning("relay session %d: cannot dial back: %s", s.id, e)
            return
        with ws:
            try:
                if held >= MAX_SESSIONS_PER_TENANT:
                    raise jobexec.ExecRefused(
                        f"tenant {s.tenant} has {held} shells and connections open on this node, the most "
                        f"a tenant may have ({MAX_SESSIONS_PER_TENANT}): close some first"
                    )
                view = self._view(s)
                if s.kind == "forward":
                    sock = jobexec.connect_in_job(view, s.port)
                    log.info("relay session %d: connected to port %d in %s", s.id, s.port, view.rec.key)
                    _Forward(ws, sock).run()
                else:
                    _Exec(ws, s, view, self.executor.launcher.host).run()
            except jobexec.ExecRefused as e:
                log.info("relay session %d refused: %s", s.id, e)
                with contextlib.suppress(ConnectionClosed):
                    ws.send(json.dumps({"error": str(e)}))
            except Exception as e:
                log.exception("relay session %d failed", s.id)
                with contextlib.suppress(ConnectionClosed):
                    ws.send(json.dumps({"error": f"the node could not run it: {e}"}))

    def _view(self, s: Session) -> jobexec.JobView:
        key = job_key(str(s.allocation_id), s.attempt)
        rec = next((r for r in self.executor.running() if r.key == key), None)
        if rec is None:
            raise jobexec.ExecRefused(f"allocation {s.allocation_id}'s job is not running on this node")
        work = self.executor.work_dir(rec.allocation_id, rec.attempt)
        if rec.extra.get("container"):
            engine = self.executor.launcher.container_engine()
            podman, name = tuple(engine.command([])), engine.name(rec.extra["container"])
            pid = jobexec.container_pid(podman, name)
            if pid is None:
                raise jobexec.ExecRefused(f"allocation {s.allocation_id}'s container is not running")
            return jobexec.JobView(rec, pid, work, None, podman, name)
        try:
            user = self.user_of(s.tenant)
        except ValueError as e:
            raise jobexec.ExecRefused(str(e)) from None
        init = jobexec.find_init(rec)
        host = self.executor.launcher.host
        if host is not None and host.namespaces and host.unshare is not None:
            deadline = time.monotonic() + SANDBOX_WAIT_S  # a job just started: its sandbox comes up
            while init is None and time.monotonic() < deadline and self.executor.get(rec.key) is not None:
                time.sleep(0.05)
                init = jobexec.find_init(rec)
            if init is None:  # never outside the job's namespaces
                raise jobexec.ExecRefused(f"allocation {s.allocation_id}'s sandbox is not up: try again")
        return jobexec.JobView(rec, init, work, user)


class _Sender:
    """Sends from several threads, one frame at a time."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws, self._lock = ws, threading.Lock()

    def send(self, frame: bytes | str) -> bool:
        with self._lock:
            try:
                self.ws.send(frame)
                return True
            except (ConnectionClosed, OSError):
                return False


class _Exec:
    def __init__(self, ws: ClientConnection, s: Session, view: jobexec.JobView, host: Any) -> None:
        self.ws, self.s, self.view, self.host = ws, s, view, host
        self.out = _Sender(ws)
        self._ended = threading.Event()  # the command's first process exited (not yet reaped)

    def run(self) -> None:
        held = None
        if self.view.init_pid is not None and not self.view.container:
            held = jobexec.hold_namespaces(self.view)  # never by pid: it may be another job's by now
        try:
            self._run(held)
        finally:
            if held is not None:
                held.close()

    def _run(self, held: jobexec.HeldNamespaces | None) -> None:
        env = {"PATH": FIXED_PATH}  # podman's; the command gets the container's own
        if self.view.container:
            argv = jobexec.container_exec_argv(self.view, self.s.command, self.s.tty, self.host)
        else:
            argv, env = jobexec.exec_argv(self.view, self.host, self.s.command, self.s.tty, held)
        log.info("relay session %d: exec in %s: %s", self.s.id, self.view.rec.key, jobexec.describe(argv))
        master = -1
        if self.s.tty:
            master, slave = jobexec.open_pty(held)  # the job's own ptys, where it has them
            _winsize(master, self.s.rows, self.s.cols)
            if self.view.user is not None and os.geteuid() == 0 and not self.view.container:
                os.fchown(slave, self.view.user.pw_uid, self.view.user.pw_gid)
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=slave,
                    stdout=slave,
                    stderr=slave,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                )
            finally:
                os.close(slave)
            readers = [_pump_out(master, STDOUT, self.out)]
        else:
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                start_new_session=True, close_fds=True,
            )  # fmt: skip
            assert proc.stdout is not None and proc.stderr is not None
            readers = [_pump_out(proc.stdout.fileno(), STDOUT, self.out),
                       _pump_out(proc.stderr.fileno(), STDERR, self.out)]  # fmt: skip
        threading.Thread(target=self._input, args=(proc, master), daemon=True).start()
        rc = _wait_unreaped(proc.pid)
        self._ended.set()
        for t in readers:
            t.join(DRAIN_S)
        code = 128 - rc if rc < 0 else rc
        self.out.send(json.dumps({"exit": code}))
        _kill_group(proc.pid)  # unreaped till now: the number is still this session's group's
        proc.wait()
        if master >= 0:
            with contextlib.suppress(OSError):
                os.close(master)

    def _input(self, proc: subprocess.Popen[bytes], master: int) -> None:
        """The user's keys and window sizes; the user gone ends the command."""
        try:
            while True:
                frame = self.ws.recv()
                if isinstance(frame, bytes):
                    if frame[:1] != bytes([STDIN]):
                        continue
                    if master >= 0:
                        _write_all(master, frame[1:])
                    elif proc.stdin is not None:
                        proc.stdin.write(frame[1:])
                        proc.stdin.flush()
                    continue
                msg = json.loads(frame)
                if "resize" in msg and master >= 0:
                    rows, cols = msg["resize"]
                    _winsize(master, int(rows), int(cols))
                elif msg.get("eof") and proc.stdin is not None:
                    proc.stdin.close()
        except (ConnectionClosed, OSError, ValueError, TypeError, KeyError):
            pass
        if not self._ended.is_set():  # the user left before it ended: a hangup, as a terminal closing
            _end_tree(proc)


class _Forward:
    def __init__(self, ws: ClientConnection, sock: socket.socket) -> None:
        self.ws, self.sock, self.out = ws, sock, _Sender(ws)

    def run(self) -> None:
        t = threading.Thread(target=self._from_user, daemon=True)
        t.start()
        with self.sock:
            while True:
                try:
                    data = self.sock.recv(CHUNK)
                except OSError:
                    break
                if not data or not self.out.send(bytes([DATA]) + data):
                    break

    def _from_user(self) -> None:
        try:
            while True:
                frame = self.ws.recv()
                if isinstance(frame, bytes):
                    if frame[:1] == bytes([DATA]):
                        self.sock.sendall(frame[1:])
                elif json.loads(frame).get("eof"):
                    self.sock.shutdown(socket.SHUT_WR)
        except (ConnectionClosed, OSError, ValueError, AttributeError):
            pass
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)


def _pump_out(fd: int, stream: int, out: _Sender) -> threading.Thread:
    def pump() -> None:
        while True:
            try:
                data = os.read(fd, CHUNK)
            except OSError:  # EIO: the pty's last holder closed it
                return
            if not data or not out.send(bytes([stream]) + data):
                return

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return t


def _winsize(fd: int, rows: int, cols: int) -> None:
    with contextlib.suppress(OSError):
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _end_tree(proc: subprocess.Popen[bytes], grace_s: float = 2.0) -> None:
    """SIGHUP to the command and all it started (its own sessions too), SIGKILL to what is left."""
    try:
        leader = psutil.Process(proc.pid)
        tree = [leader, *leader.children(recursive=True)]
    except psutil.Error:
        return
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGHUP)
    # not the first process: waiting for a child reaps it, which only the session's end may do
    _gone, alive = psutil.wait_procs(tree[1:], timeout=grace_s)
    if _running(proc.pid):
        alive.append(leader)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _wait_unreaped(pid: int) -> int:
    """The child's exit status (-N: killed by signal N), leaving it a zombie: while it is one, no
    other process can have its number, nor a process group of that number (Popen.poll reaps)."""
    while True:
        try:
            got = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except InterruptedError:
            continue
        if got is None:
            continue
        return -got.si_status if got.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else got.si_status


def _running(pid: int) -> bool:
    """Whether the child has not exited yet (it stays unreaped either way)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _kill_group(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
