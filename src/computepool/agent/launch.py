"""What one attempt runs, as whom, where and with which environment: the executor's dispatch.

Three ways, chosen per job: a plain child of the agent's user (no `SandboxConfig`: embedding and
tests), a process in the sandbox as its tenant's user (`sandbox.py`), or a podman container when
the request names an image (`container.py`, imported only when a container job comes).
"""

from __future__ import annotations

import os
import pwd
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from computepool.agent import jobnet, landlock
from computepool.agent.devfiles import hidden_files
from computepool.agent.localstate import JobRecord, LocalState
from computepool.agent.sandbox import (
    ROOT_ENV,
    WORK_DIR,
    HostSupport,
    SandboxConfig,
    hands_over,
    hidden_dir,
    job_env,
    prepare_cache,
    prepare_dirs,
    probe,
    root_side_env,
    tmpfs_mib,
    wrap,
)
from computepool.agent.tenants import TenantUserError, ensure_tenant_user

if TYPE_CHECKING:
    from computepool.agent.cgroups import Cgroups
    from computepool.agent.container import Podman
    from computepool.agent.jobspec import JobSpec

_PASSED_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "LD_LIBRARY_PATH")


@dataclass(frozen=True)
class Launch:
    """How one attempt starts: the argv the gated wrapper runs, and under what."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    user: pwd.struct_passwd | None  # the wrapper's own user (unsandboxed jobs only)
    applied: str  # the sandbox, in words
    path: str | None = None  # where the command is looked up (the job's PATH); None: env's
    # the sandbox's init (root, in the job's namespaces) writes the CPU quota just before the command:
    # the pool's launcher steps ahead of it run unthrottled (a 0.1-CPU job's start took 10x longer)
    writes_cpu_limit: bool = False
    # whether the agent may look the command up before the start: not as root for a tenant's job
    # (root finds files the tenant cannot: a file in another tenant's 0700 work dir started the
    # sandbox, a missing one failed at once), whose sandbox says 127 itself
    agent_looks_up: bool = True


class Launcher:
    """Turns a JobSpec into a Launch; `sandbox=None` means plain children of the agent's user."""

    def __init__(
        self, data_dir: Path, state: LocalState, sandbox: SandboxConfig | None, base_env: dict[str, str]
    ) -> None:
        self.data_dir = data_dir
        self.state = state
        self.sandbox = sandbox
        self.host: HostSupport | None = probe(sandbox) if sandbox is not None else None
        self.base_env = base_env
        self._podman: Podman | None = None
        self.publish_host: str | None = None  # the node's address: containers publish there alone
        self.job_cgroups: Cgroups | None = None  # the executor's: containers' parents go beside its jobs

    def work_dir(self, run_dir: Path) -> Path:
        return run_dir / WORK_DIR if self.sandbox is not None else run_dir

    def launch(self, spec: JobSpec, rec: JobRecord, run_dir: Path) -> Launch | str:
        """The attempt's Launch, or why it cannot start (the job's reason)."""
        if self.sandbox is None or self.host is None:
            return self._plain(spec, run_dir)
        if not spec.tenant:
            return "no tenant: a sandboxed job runs as its tenant's user"
        if self.host.root:
            try:
                user = ensure_tenant_user(spec.tenant, self.sandbox.uid_range, self.sandbox.user_prefix)
            except TenantUserError as e:
                return str(e)
            work = prepare_dirs(run_dir, user.pw_uid, user.pw_gid)
        else:
            why = self._other_tenant(spec.tenant)
            if why:
                return why
            user = pwd.getpwuid(os.geteuid())
            work = run_dir / WORK_DIR
            work.mkdir(mode=0o700, exist_ok=True)
        rec.extra["user"] = user.pw_name
        env = job_env(dict(spec.env), user, work)
        try:
            cache = self._cache_dir(spec.tenant, user)
        except OSError as e:
            return f"cannot prepare the tenant's cache dir: {e}"
        if cache is not None:
            env["CPOOL_CACHE_DIR"] = str(cache)
        if spec.image:
            podman = self.container_engine()
            ok, why = podman.available()
            if not ok:
                return f"containers unavailable on this node: {why}"
            rec.extra["container"] = spec.key
            if cache is not None:  # mounted at the same path (container.py)
                spec = replace(spec, env={**spec.env, "CPOOL_CACHE_DIR": str(cache)})
            spec = replace(spec, pids_max=spec.pids_max or self.sandbox.pids_max)
            if spec.image_digest is None:  # an allowed registry's image: the id this node runs, reported
                rec.extra["image_id"] = podman.prepare(spec)
            argv = podman.run_argv(spec, work, user.pw_uid, user.pw_gid)
            how = f"container {spec.image} through podman"
            if spec.container_host_network and not self.host.scope_why_not:
                # on the host's network its abstract unix sockets are the node's (other tenants' jobs
                # on it, the node's daemons): podman, and what it starts, in a scoped Landlock domain
                python = self.host.filter_loader[0] if self.host.filter_loader else sys.executable
                argv = [*jobnet.launcher_argv(jobnet.options(None, False, True), python), *argv]
                how += f", {landlock.SUMMARY}"
            # podman (and conmon, which may drop files such as `oom` in its working directory) runs
            # as root: it starts in the root-owned run dir, never in the tenant's writable `work/`,
            # and the wrapper and podman with a fixed environment: the job's own (LD_PRELOAD, PATH,
            # GLIBC_TUNABLES, …) reaches the container through its env file alone
            return Launch(argv, dict(ROOT_ENV), run_dir, None, how)
        keep = self._mps_pipes(spec.env.get("CUDA_MPS_PIPE_DIRECTORY", ""))  # an MPS slice's daemon
        hide = hidden_dir(work, self.data_dir)
        tmp = tmpfs_mib(spec.memory_mib)  # /tmp and /dev/shm: sized, and in the job's memory
        no_device, open_why = hidden_files(spec.device_uuids, spec.device_nodes, self.sandbox.dev)
        argv, applied = wrap(
            spec.command, user, work, self.host, hide, keep, cache, tmp, private_network=spec.private_network,
            own_network=not spec.host_network, no_device=no_device, user_prefix=self.sandbox.user_prefix,
            mps_root=self.sandbox.mps_root or self.data_dir / "mps",
        )  # fmt: skip
        if open_why:
            applied.append(open_why)
        if hands_over(self.host):  # root runs the first steps: none of the job's variables reach them
            init = self.host.namespaces and self.host.unshare is not None
            return Launch(
                argv, root_side_env(env), work, None, ", ".join(applied), env.get("PATH", ""), init,
                agent_looks_up=False,
            )  # fmt: skip
        return Launch(argv, env, work, None, ", ".join(applied))

    def cache_of(self, tenant: str) -> Path | None:
        """Where `_cache_dir` keeps `tenant`'s cache (None: nowhere), without making it."""
        root = self.caches_root()
        return root / tenant if tenant and root is not None else None

    def caches_root(self) -> Path | None:
        """The dir holding every tenant's cache (None: tenants have none)."""
        if self.sandbox is None or self.sandbox.cache_root is None or self.host is None:
            return None
        return self.sandbox.cache_root if self.host.root else self.data_dir / "cache"

    def _cache_dir(self, tenant: str, user: pwd.struct_passwd) -> Path | None:
        """The tenant's cache (CPOOL_CACHE_DIR), kept between jobs: under `--cache-dir` for a root
        agent; a non-root agent, which cannot hand dirs to other users, keeps it in its data dir."""
        if self.sandbox is None or self.sandbox.cache_root is None or self.host is None:
            return None
        if self.host.root:
            return prepare_cache(self.sandbox.cache_root, tenant, user.pw_uid, user.pw_gid)
        cache = self.data_dir / "cache" / tenant
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        return cache

    def _mps_pipes(self, named: str) -> Path | None:
        """The pipe dir of an MPS daemon of this agent's (under its MPS root) that the job names,
        which it keeps with the host's IPC namespace; None for any other path. Every job names
        one (`<work>/no-mps` unless it holds an mps slice), and its code, unpacked into `<work>`
        first, could hold a `no-mps/` dir: that put the job in the host's IPC namespace."""
        if not named.startswith("/") or self.sandbox is None:
            return None
        root = self.sandbox.mps_root or self.data_dir / "mps"
        path = Path(os.path.normpath(named))
        if root not in path.parents or path.is_symlink() or not path.is_dir():
            return None
        return path

    def prepare(self, spec: JobSpec) -> None:
        """A container job's image on the node before the executor takes its lock (a pull may take
        minutes); raises ContainerError with the job's reason. Everything else is `launch`'s to say."""
        if self.sandbox is None or self.host is None or not spec.image or not spec.tenant or not spec.command:
            return
        podman = self.container_engine()
        if podman.available()[0]:  # else launch() says why containers cannot run here
            podman.prepare(spec)

    def _plain(self, spec: JobSpec, run_dir: Path) -> Launch | str:
        user, why = resolve_user(spec.user)
        if why:
            return why
        env = dict(self.base_env)
        if user is not None:
            env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
        env["CPOOL_RUN_DIR"] = str(run_dir)
        cache = self.data_dir / "cache" / (spec.tenant or "default")
        cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        env["CPOOL_CACHE_DIR"] = str(cache)
        env.update(spec.env)
        if user is not None and os.geteuid() == 0:
            for p in (run_dir, *run_dir.iterdir()):
                os.chown(p, user.pw_uid, user.pw_gid)
        return Launch(list(spec.command), env, run_dir, user, "")

    def _other_tenant(self, tenant: str) -> str:
        """A non-root agent cannot keep tenants apart: it serves one, unless told it is single-tenant."""
        if self.sandbox is None or self.sandbox.single_tenant:
            return ""
        others = self.state.tenants() - {tenant, ""}
        if others:
            return (
                f"refused: this agent is not root and already runs tenant {sorted(others)[0]!r}'s jobs; "
                "it cannot keep tenants apart (start it as root, or with --single-tenant to accept "
                "every tenant with no isolation between jobs)"
            )
        return ""

    def container_engine(self) -> Podman:
        if self._podman is None:
            from computepool.agent.container import Podman  # noqa: PLC0415 - optional until used

            asked = self.sandbox.tenant_pids_max if self.sandbox is not None else 0
            self._podman = Podman(self.data_dir, tenant_pids=asked, job_cgroups=self.job_cgroups)
        self._podman.publish_host = self.publish_host
        return self._podman


def default_env() -> dict[str, str]:
    """Only harmless variables pass from the agent to a plain child: its own may hold credentials."""
    env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    me = pwd.getpwuid(os.geteuid())
    env.update(HOME=me.pw_dir, USER=me.pw_name, LOGNAME=me.pw_name)
    return env


def resolve_user(name: str | None) -> tuple[pwd.struct_passwd | None, str]:
    if not name:
        return None, ""
    try:
        user = pwd.getpwnam(name)
    except KeyError:
        return None, f"unknown user: {name}"
    if os.geteuid() != 0 and user.pw_uid != os.geteuid():
        return None, f"cannot run as {name}: the agent is not root"
    return user, ""


def which(cmd: str, path: str) -> str | None:
    if "/" in cmd:
        return cmd if os.path.isfile(cmd) and os.access(cmd, os.X_OK) else None
    return shutil.which(cmd, path=path)
