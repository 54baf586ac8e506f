"""`cpool up`: the whole pool on this machine — control plane and a local agent, supervised.

Both run as child processes (`cpool server`, `cpool agent`) with their logs in DATA_DIR/logs;
`up` restarts a crashed child with backoff and stops both on Ctrl-C / SIGTERM. Everything lives
in DATA_DIR, so running it again reuses the database, the admin token and the node credential; while
it runs DATA_DIR is locked (core/dirlock.py), so a second `up`, server or agent on it stops at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Annotated

import httpx
import typer

from computepool.cli.common import fail
from computepool.core.tls import client_context, generate_self_signed

EXIT_FATAL = 2  # the agent's "only the operator can fix this" (computepool.agent.config.EXIT_FATAL)
EXIT_CREDENTIAL_REFUSED = 3  # the agent's credential was refused: it needs a fresh join token
READY_TIMEOUT_S = 60.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 30.0  # a child that ran this long is healthy again: its backoff starts over


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if `cpool up` itself is killed, so no control plane is orphaned."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


@dataclass
class Child:
    """One supervised process: its command, log file and restart backoff."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    pass_fds: tuple[int, ...] = ()  # the data dir's lock, for the control plane (core/dirlock.py)
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    failures: int = 0
    next_start: float = 0.0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,  # Ctrl-C reaches `up` alone; it stops the children in order
                pass_fds=self.pass_fds,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self.started_at = time.monotonic()

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def schedule_restart(self) -> float:
        if time.monotonic() - self.started_at > STABLE_AFTER_S:
            self.failures = 0
        self.failures += 1
        delay = min(MAX_BACKOFF_S, 2.0 ** (self.failures - 1))
        self.next_start = time.monotonic() + delay
        self.proc = None
        return delay

    def stop(self, timeout_s: float, nudge_after_s: float | None = None) -> None:
        """SIGTERM; then SIGINT after `nudge_after_s` (uvicorn's "force quit": it stops waiting for
        open long polls); SIGKILL once `timeout_s` has passed."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        if nudge_after_s is not None:
            try:
                self.proc.wait(timeout=min(nudge_after_s, timeout_s))
                return
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _given(*options: tuple[str, str | None]) -> list[str]:
    """The options that were given, as arguments for a child: `--name value` each."""
    return [arg for name, value in options if value is not None for arg in (name, value)]


def _cpool(*args: str) -> list[str]:
    return [sys.executable, "-m", "computepool.cli.main", *args]


def _wait_ready(server: Child, url: str, token_file: Path, verify: ssl.SSLContext | bool = True) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        rc = server.exited()
        if rc is not None:
            raise fail(f"the control plane did not start (exit code {rc}): {_last_line(server.log_path)}", 1)
        try:
            ready = httpx.get(f"{url}/readyz", timeout=2, verify=verify).status_code == 200
            if ready and token_file.exists():
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop(10)
            raise fail(f"the control plane was not ready after {READY_TIMEOUT_S:.0f} s: "
                       f"{_last_line(server.log_path)}", 1)  # fmt: skip
        time.sleep(0.2)


def _join_token(url: str, token_file: Path, verify: ssl.SSLContext | bool = True) -> str:
    admin = token_file.read_text().strip()
    r = httpx.post(
        f"{url}/api/v1/join-tokens",
        json={"expires_in_s": 600, "single_use": True},
        headers={"Authorization": f"Bearer {admin}"},
        timeout=10,
        verify=verify,
    )
    if r.status_code != 201:
        raise RuntimeError(
            f"could not create a join token for the local agent: HTTP {r.status_code} {r.text}"
        )
    return str(r.json()["token"])


def _agent_env(
    agent: Child,
    url: str,
    token_file: Path,
    agent_dir: Path,
    *,
    refused: bool = False,
    verify: ssl.SSLContext | bool = True,
) -> None:
    """A fresh join token only when the agent needs one: no credential yet, or its credential refused."""
    if refused or not (agent_dir / "node.json").exists():
        agent.env["CPOOL_JOIN_TOKEN"] = _join_token(url, token_file, verify)
    else:
        agent.env.pop("CPOOL_JOIN_TOKEN", None)


def _ensure_certificate(cert: Path, key: Path, host: str) -> bool:
    """Make the self-signed pair on first start (True); later starts reuse it, so clients keep trusting it."""
    if cert.exists() and key.exists():
        return False
    hosts = ["localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()]
    if host not in ("0.0.0.0", "", "::"):
        hosts.append(host)
    generate_self_signed(cert, key, hosts)
    return True


def _save_login(url: str, token_file: Path, ca: Path | None) -> str:
    """Log the CLI in to this pool as `cpool login` would, unless a login to another pool is saved."""
    from computepool.client.config import ClientConfig, config_path, load_config, save_config

    ca_env = f" CPOOL_CA={ca}" if ca else ""
    export = f"  export CPOOL_SERVER={url}{ca_env} CPOOL_TOKEN=$(cat {token_file})"
    path = config_path()
    try:
        saved = load_config(path).get("server")
        if saved in (None, url):
            save_config(ClientConfig(url, token_file.read_text().strip(), str(ca) if ca else None))
            return (
                f"logged the CLI in as admin (saved {path}): `cpool ps` needs no exports; for scripts "
                f"and other tools:\n{export}"
            )
    except (OSError, ValueError) as e:
        return f"saved no login ({e}); for this pool:\n{export}"
    return f"kept the saved login to {saved}; for this pool:\n{export}"


def register(app: typer.Typer) -> None:
    @app.command("up")
    def up(
        data_dir: Annotated[
            Path,
            typer.Option(
                "--data-dir", envvar="CPOOL_DATA_DIR", help="Database, admin token, agent state, logs."
            ),
        ] = Path("~/.computepool"),
        port: Annotated[int, typer.Option("--port", min=1, max=65535, help="API port.")] = 8470,
        host: Annotated[str, typer.Option("--host", help="Address the API listens on.")] = "127.0.0.1",
        simulate: Annotated[
            str | None,
            typer.Option(
                "--simulate",
                help="Simulated devices instead of real ones, e.g. 2xA100-80GB or "
                "1xA100-80GB:mig=3g.40gb+2g.20gb+2g.20gb (a GPU split into MIG instances).",
            ),
        ] = None,
        tls: Annotated[
            bool,
            typer.Option(
                "--tls/--no-tls",
                help="Serve HTTPS with a self-signed certificate made on first start (DATA_DIR/tls/cert.pem; "
                "clients give it with --ca or CPOOL_CA).",
            ),
        ] = True,
        blob_max_mib: Annotated[
            int, typer.Option("--blob-max-mib", min=1, help="Largest upload (code, stdin, job files), MiB.")
        ] = 256,
        tenant_blob_max_mib: Annotated[
            int, typer.Option("--tenant-blob-max-mib", min=1, help="Blob MiB one tenant may hold in all.")
        ] = 2048,
        ledger_interval: Annotated[
            float,
            typer.Option("--ledger-interval", min=0.1, help="Seconds between bookings of the usage ledger."),
        ] = 10.0,
        cgroup_base: Annotated[
            str | None,
            typer.Option(
                "--cgroup-base",
                envvar="CPOOL_CGROUP_BASE",
                help="The agent's --cgroup-base: its jobs' cgroups go below BASE/<node name>-<8 hex of "
                "its data dir's path>/ (default /sys/fs/cgroup/computepool); 'none': rlimits only.",
            ),
        ] = None,
        gang_ports: Annotated[
            str | None,
            typer.Option("--gang-ports", help="The server's --gang-ports FIRST-LAST (default 29500-29999)."),
        ] = None,
        service_ports: Annotated[
            str | None,
            typer.Option(
                "--service-ports", help="The server's --service-ports FIRST-LAST (default 31000-31999)."
            ),
        ] = None,
        rpc_ports: Annotated[
            str | None,
            typer.Option("--rpc-ports", help="The server's --rpc-ports FIRST-LAST (default 32000-32999)."),
        ] = None,
        publish_ports: Annotated[
            str | None,
            typer.Option(
                "--publish-ports", help="The server's and the agent's --publish-ports (default 20000-28999)."
            ),
        ] = None,
        allowed_registries: Annotated[
            str | None,
            typer.Option(
                "--allowed-registries",
                help="The server's --allowed-registries (default none: only images an admin publishes).",
            ),
        ] = None,
        default_cpus: Annotated[
            str | None, typer.Option("--default-cpus", help="The server's --default-cpus (default 1).")
        ] = None,
        default_mem: Annotated[
            str | None, typer.Option("--default-mem", help="The server's --default-mem (default 1GiB).")
        ] = None,
        user_prefix: Annotated[
            str | None,
            typer.Option(
                "--tenant-user-prefix",
                help="The agent's --tenant-user-prefix (default cpool-): a second pool on this host "
                "takes its own, so its tenants share no uid or cache with this one's.",
            ),
        ] = None,
        default_pids: Annotated[
            str | None, typer.Option("--default-pids", help="The server's --default-pids (default 1024).")
        ] = None,
    ) -> None:
        """Start the control plane and a local agent; stay in the foreground until Ctrl-C."""
        from computepool.agent.devices import parse_spec
        from computepool.core.errors import InvalidInput

        os.umask(0o077)  # its logs, keys and the children's files are readable by the pool alone

        if simulate is not None:
            try:
                parse_spec(simulate)
            except InvalidInput as e:
                raise fail(str(e)) from None
        data_dir = data_dir.expanduser().absolute()
        from computepool.core.dirlock import LOCK_FD_ENV, DataDirBusy, lock_data_dir

        try:
            held = lock_data_dir(data_dir, "cpool up")  # for as long as `up` runs; its server shares it
        except DataDirBusy as e:
            raise fail(str(e)) from None
        except OSError as e:
            raise fail(f"--data-dir: cannot create {data_dir}: {e.strerror or e}") from None
        if not _port_free(host, port):
            raise fail(f"port {port} on {host} is already in use (another cpool server?): choose --port")
        cert, key = data_dir / "tls" / "cert.pem", data_dir / "tls" / "key.pem"
        verify: ssl.SSLContext | bool = True
        if tls:
            made = _ensure_certificate(cert, key, host)
            if made:
                print(f"made a self-signed TLS certificate: {cert} (key {key}, mode 0600)", flush=True)
            verify = client_context(cert)
        local = "127.0.0.1" if host in ("0.0.0.0", "") else host
        url = f"{'https' if tls else 'http'}://{f'[{local}]' if ':' in local else local}:{port}"
        token_file = data_dir / "admin-token"
        agent_dir = data_dir / "agent"
        logs = data_dir / "logs"

        stop = threading.Event()

        def on_signal(_signum: int, _frame: FrameType | None) -> None:
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

        server = Child(
            "control plane",
            _cpool("server", "--data-dir", str(data_dir), "--host", host, "--port", str(port))
            + (["--tls-cert", str(cert), "--tls-key", str(key)] if tls else [])
            + ["--blob-max-mib", str(blob_max_mib), "--tenant-blob-max-mib", str(tenant_blob_max_mib)]
            + ["--ledger-interval", f"{ledger_interval:g}"]
            + _given(
                ("--gang-ports", gang_ports),
                ("--service-ports", service_ports),
                ("--rpc-ports", rpc_ports),
                ("--publish-ports", publish_ports),
                ("--allowed-registries", allowed_registries),
                ("--default-cpus", default_cpus),
                ("--default-mem", default_mem),
                ("--default-pids", default_pids),
            ),  # fmt: skip
            logs / "server.log",
            env={LOCK_FD_ENV: str(held.fd)},
            pass_fds=(held.fd,),
        )
        agent_argv = _cpool("agent", "--server", url, "--data-dir", str(agent_dir))
        if cgroup_base is not None:
            agent_argv += ["--cgroup-base", cgroup_base]
        agent_argv += _given(("--publish-ports", publish_ports), ("--tenant-user-prefix", user_prefix))
        if tls:
            agent_argv += ["--ca", str(cert)]
        if simulate:
            agent_argv += ["--simulate", simulate]
        agent = Child("agent", agent_argv, logs / "agent.log")
        server.start()
        try:
            _wait_ready(server, url, token_file, verify)
            _agent_env(agent, url, token_file, agent_dir, verify=verify)
            agent.start()
        except (RuntimeError, OSError, httpx.HTTPError) as e:
            server.stop(15)
            raise fail(str(e), 1) from None

        print(f"ComputePool is up: API {url}", flush=True)
        print(f"admin token in {token_file}", flush=True)
        print(f"dashboard {url}/ (sign in with that token)", flush=True)
        print(_save_login(url, token_file, cert if tls else None), flush=True)
        print(f"logs in {logs}/ (server.log, agent.log); Ctrl-C stops both (running jobs keep running "
              "and are re-adopted by the next `cpool up`)", flush=True)  # fmt: skip

        code = _supervise(stop, server, agent, url, token_file, agent_dir, verify)
        agent.stop(15)
        server.stop(20, nudge_after_s=3)
        print("ComputePool stopped", flush=True)
        if code:
            raise typer.Exit(code)


def _supervise(
    stop: threading.Event,
    server: Child,
    agent: Child,
    url: str,
    token_file: Path,
    agent_dir: Path,
    verify: ssl.SSLContext | bool = True,
) -> int:
    """Restart what crashed, with backoff; 0 on a requested stop, non-zero on a fatal agent error."""
    refused = False
    while not stop.wait(0.5):
        for child in (server, agent):
            if child.proc is None:
                if time.monotonic() >= child.next_start:
                    if child is agent:
                        try:
                            _agent_env(agent, url, token_file, agent_dir, refused=refused, verify=verify)
                        except (RuntimeError, OSError, httpx.HTTPError) as e:
                            delay = agent.schedule_restart()
                            print(f"agent not restarted yet ({e}); trying again in {delay:.0f} s", flush=True)
                            continue
                        refused = False
                    child.start()
                    print(f"{child.name} restarted (pid {child.proc.pid if child.proc else '?'})", flush=True)
                continue
            rc = child.exited()
            if rc is None:
                continue
            last = _last_line(child.log_path)
            if child is agent and rc == EXIT_FATAL:
                print(f"error: the agent stopped: {last}", file=sys.stderr, flush=True)
                return 1
            refused = refused or (child is agent and rc == EXIT_CREDENTIAL_REFUSED)
            delay = child.schedule_restart()
            how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited (code {rc}): {last}"
            print(f"{child.name} {how}; restarting in {delay:.0f} s", flush=True)
    return 0
