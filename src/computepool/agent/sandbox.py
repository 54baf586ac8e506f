"""The process sandbox: how a job's command is wrapped so that it runs as its tenant's user, with no
privileges, in its own PID, mount, IPC and UTS namespaces, and in a directory no other tenant can enter.

Everything here uses Debian's util-linux: `unshare` makes the namespaces (a private `/proc` that
shows the job's processes only; a private `/tmp`, `/var/tmp`, `/dev/shm` and `/run/lock`; SysV IPC
objects and POSIX message queues of the job's own, gone with it), `setpriv` drops to the tenant's
uid and gid with no supplementary groups, an empty capability bounding set and `no_new_privs`.
Where the host refuses namespaces (a container without CAP_SYS_ADMIN), the job still runs as its
user with `setpriv`, and the job's `limits` says that namespaces were not applied. The job's first
step (the syscall filter's loader, syscall_filter.py) also gives it a network namespace of its own
unless it must keep the node's (jobnet.py), and a Landlock domain scoped for abstract unix sockets
and signals (landlock.py).

Layout of one attempt, under the agent's data dir (0711: others may pass through, never list):

    runs/                  root 0711
      <alloc>/             root 0711
        <attempt>/         root 0711   the agent's own files: exit status, logs, assignment
          work/            tenant 0700 the job's directory: cwd, HOME, CPOOL_RUN_DIR
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from computepool.agent import host_limits, jobnet, landlock, syscall_filter
from computepool.agent.cgroups import DEFAULT_PIDS_MAX
from computepool.agent.devfiles import DEV
from computepool.agent.tenants import DEFAULT_UID_RANGE, USER_PREFIX

log = logging.getLogger("computepool.agent")
WORK_DIR = "work"
FIXED_PATH = "/usr/local/bin:/usr/bin:/bin"
ROOT_ENV = {"PATH": FIXED_PATH, "LANG": "C.UTF-8"}  # all a step that runs as root gets of the job's
# The job's environment, as shell `export`s, carried past the steps that run as root (see
# `root_side_env`) in HANDOVER_0, HANDOVER_1, … (the kernel takes at most 128 KiB per variable) and
# applied by the first step that runs as the tenant.
HANDOVER = "CPOOL_JOB_ENVIRONMENT_"
_HANDOVER_CHUNK = 64 * 1024
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TAIL_HANDOVER = (
    f'_i=0; _s=; while eval "[ -n \\"\\${{{HANDOVER}$_i+x}}\\" ]"; do '
    f'eval "_s=\\$_s\\${HANDOVER}$_i"; unset {HANDOVER}$_i; _i=$((_i + 1)); done; '
    'eval "$_s"; unset _i _s; exec "$@"'
)
DEFAULT_CACHE_ROOT = Path("/var/cache/computepool")
# A job's namespaces: its processes, its mounts, its SysV IPC objects and POSIX message queues (no
# other tenant's job can open them by key or name, and they die with it), its host name.
_NAMESPACES = ("--pid", "--fork", "--mount-proc", "--mount", "--ipc", "--uts")
DEFAULT_MPS_ROOT = Path("/run/computepool/mps")
# Terminals a process job may hold at once. The host's ptys (kernel.pty.max, 4096 by default) are
# one count: a job that opened /dev/ptmx 4096 times left none to `cpool exec -t`, to the other
# tenants' jobs or to the node's sshd. Each job has a devpts instance of its own (its ptys alone in
# /dev/pts) with this many; all such instances together are held below the host's reserve
# (kernel.pty.reserve), which the node's own terminals keep (host_limits.py raises the total).
JOB_PTYS = 1024

# Runs as root inside the new namespaces, then starts the command as the tenant (the "$@").
# $1 is the job's directory, $2 a directory to hide under an empty tmpfs (the agent's data dir, or
# the highest ancestor of the job's directory the tenant could not pass), $3 another directory the
# job must keep (its MPS daemon's pipes) or "". Where the job's own directory or that one was
# hidden by the tmpfs or by the private /tmp, it is bound back in at the same path (through a
# descriptor opened before, since the path itself leads elsewhere by then). $4 is the tenant's cache
# dir (CPOOL_CACHE_DIR) or "", kept the same way. $5 is the size of the private /tmp, /var/tmp and
# /dev/shm (each; "" for the kernel's default): their pages count in the job's memory, the writer's.
# $6 lists device files (space-separated, devfiles.py) of devices the job's slice does not hold: an
# empty file of root's with mode 0 is bound over each, so opening one fails (EACCES) as it would
# under a device cgroup; the file is unlinked at once (the binds keep it), the job cannot unmount.
# $9: the most ptys the job may hold (JOB_PTYS), in a devpts instance of its own, its /dev/ptmx.
# $7 is the prefix of tenants' users and $8 the job's own: /etc/passwd and /etc/group are bound over
# by copies without the other tenants' users and groups, and the tenants' caches' root ($4's parent)
# is covered like $2, so that a job learns no other tenant's name from the node. useradd and
# groupadd (the agent's own, for a new tenant) replace those files by rename: a bind that looked up
# the old file fails (ENOENT), so it is read and bound again, up to 20 times.
# Nothing written there outlives the job, nor do its SysV IPC objects and POSIX message queues (the
# IPC namespace's; /dev/mqueue, where the host mounts it, shows the job's own).
# It stays PID 1 of the namespace: the kernel ignores signals PID 1 has no handler for, so this
# shell traps them (the command, in the same process group, gets the agent's signals itself) and
# waits; when it exits the kernel kills whatever the job left in its namespace. The command keeps
# this shell's stdin through a copy (fd 6): sh gives a background command /dev/null otherwise.
# A step that fails ends it with 126 and a line on the job's stderr (SANDBOX_FAILED) saying so.
# Its last root step writes the job's CPU quota where the agent left it to (CPOOL_INIT_CPU_FILE and
# _MAX, from the gate line): the launcher's steps ran unthrottled, the command never does.
_NS_INIT = """\
_cpool_w=$1
_cpool_hide=$2
_cpool_keep=$3
_cpool_cache=$4
_cpool_tmpfs=mode=1777,nosuid,nodev${5:+,size=$5}
_cpool_nodev_files=$6
_cpool_users=$7
_cpool_me=$8
_cpool_ptys=$9
_cpool_mps=${10}
shift 10
_cpool_fail() { echo "@FAILED@: $1" >&2; exit 126; }
command exec 3<"$_cpool_w" || _cpool_fail "open the job directory"
if [ -n "$_cpool_keep" ]; then command exec 4<"$_cpool_keep" || _cpool_fail "open the kept directory"; fi
if [ -n "$_cpool_cache" ]; then command exec 5<"$_cpool_cache" || _cpool_fail "open the cache directory"; fi
mount -t tmpfs -o "$_cpool_tmpfs" cpool-tmp /tmp || _cpool_fail "a private /tmp"
if [ -d /var/tmp ]; then
    mount -t tmpfs -o "$_cpool_tmpfs" cpool-vartmp /var/tmp || _cpool_fail "a private /var/tmp"
fi
if [ -d /dev/shm ]; then
    mount -t tmpfs -o "$_cpool_tmpfs" cpool-shm /dev/shm || _cpool_fail "a private /dev/shm"
fi
if [ -d /run/lock ]; then
    mount -t tmpfs -o mode=1777,nosuid,nodev,size=1m cpool-lk /run/lock || _cpool_fail "a private /run/lock"
fi
if [ -d /dev/mqueue ]; then
    mount -t mqueue -o nosuid,nodev,noexec cpool-mqueue /dev/mqueue || _cpool_fail "a private /dev/mqueue"
fi
if [ -d /dev/pts ] && [ -e /dev/ptmx ]; then
    mount -t devpts -o "newinstance,ptmxmode=0666,mode=0620,max=$_cpool_ptys" cpool-pts /dev/pts \\
        || _cpool_fail "a private /dev/pts"
    mount --no-canonicalize --bind /dev/pts/ptmx /dev/ptmx || _cpool_fail "a private /dev/ptmx"
fi
if [ -n "$_cpool_nodev_files" ]; then
    _cpool_nodev=/tmp/.cpool-no-device
    (umask 0777 && : > "$_cpool_nodev") || _cpool_fail "hide other devices"
    for _cpool_d in $_cpool_nodev_files; do
        if [ -e "$_cpool_d" ]; then
            mount --no-canonicalize --bind "$_cpool_nodev" "$_cpool_d" || _cpool_fail "hide other devices"
        fi
    done
    rm -f "$_cpool_nodev"
fi
if [ -n "$_cpool_users" ]; then
    for _cpool_f in passwd group; do
        [ -f "/etc/$_cpool_f" ] || continue
        _cpool_t=/tmp/.cpool-$_cpool_f
        _cpool_n=1
        while :; do
            (umask 022 && awk -F: -v p="$_cpool_users" -v me="$_cpool_me" 'index($1, p) != 1 || $1 == me' \
                "/etc/$_cpool_f" > "$_cpool_t") || _cpool_fail "filter /etc/$_cpool_f"
            if [ "$_cpool_n" -ge 20 ]; then
                mount --no-canonicalize --bind "$_cpool_t" "/etc/$_cpool_f" \\
                    || _cpool_fail "bind /etc/$_cpool_f"
                break
            fi
            mount --no-canonicalize --bind "$_cpool_t" "/etc/$_cpool_f" 2>/dev/null && break
            _cpool_n=$((_cpool_n + 1))
        done
        rm -f "$_cpool_t"
    done
fi
if [ -n "$_cpool_hide" ] && [ -d "$_cpool_hide" ]; then
    mount -t tmpfs -o mode=0755,nosuid,nodev,size=1m cpool-hidden "$_cpool_hide" \\
        || _cpool_fail "hide the agent data dir"
fi
if [ -n "$_cpool_mps" ] && [ -d "$_cpool_mps" ]; then
    mount -t tmpfs -o mode=0755,nosuid,nodev,size=1m cpool-mps "$_cpool_mps" \\
        || _cpool_fail "hide the MPS daemons"
fi
if [ -n "$_cpool_cache" ] && [ -d "${_cpool_cache%/*}" ] && [ -n "${_cpool_cache%/*}" ]; then
    mount -t tmpfs -o mode=0711,nosuid,nodev,size=1m cpool-caches "${_cpool_cache%/*}" \\
        || _cpool_fail "hide the other caches"
fi
_cpool_rebind() {
    if ! [ "$1" -ef "$2" ]; then
        (umask 022 && mkdir -p "$1") || _cpool_fail "make $1"
        mount --no-canonicalize --bind "$2" "$1" || _cpool_fail "bind $1"
    fi
}
_cpool_rebind "$_cpool_w" /proc/self/fd/3
if [ -n "$_cpool_keep" ]; then _cpool_rebind "$_cpool_keep" /proc/self/fd/4; fi
if [ -n "$_cpool_cache" ]; then _cpool_rebind "$_cpool_cache" /proc/self/fd/5; fi
exec 3<&- 4<&- 5<&-
if [ -n "${CPOOL_INIT_CPU_FILE:-}" ]; then
    _cpool_v=$CPOOL_INIT_CPU_MAX
    case $_cpool_v in *,*) _cpool_v="${_cpool_v%,*} ${_cpool_v#*,}" ;; esac
    printf '%s\n' "$_cpool_v" > "$CPOOL_INIT_CPU_FILE" || _cpool_fail "set the CPU quota"
fi
unset CPOOL_INIT_CPU_FILE CPOOL_INIT_CPU_MAX
trap : TERM INT HUP
exec 6<&0
"$@" <&6 6<&- &
_cpool_p=$!
exec 6<&-
while :; do
    wait "$_cpool_p"
    _cpool_rc=$?
    kill -0 "$_cpool_p" 2>/dev/null || break
done
exit "$_cpool_rc"
""".replace("@FAILED@", jobnet.SANDBOX_FAILED)


@dataclass(frozen=True)
class SandboxConfig:
    """How the agent isolates process jobs. `single_tenant` is for an agent that is not root."""

    uid_range: tuple[int, int] = DEFAULT_UID_RANGE
    user_prefix: str = USER_PREFIX  # tenants' users are <prefix><tenant>: a pool's own on a shared host
    single_tenant: bool = False
    namespaces: bool = True
    pids_max: int = DEFAULT_PIDS_MAX
    tenant_pids_max: int = 0  # one tenant's jobs on the node together; 0: half the agent's jobs' budget
    cache_root: Path | None = None  # per-tenant caches (CPOOL_CACHE_DIR); `cpool agent`: DEFAULT_CACHE_ROOT
    # MPS daemons' pipes: the MPS server runs as the client's uid and must reach them, which the
    # agent's data dir (0700) forbids; `cpool agent`: DEFAULT_MPS_ROOT. None: DATA_DIR/mps.
    mps_root: Path | None = None
    dev: Path = DEV  # where the node's device files are (devfiles.py; tests lay out their own)


@dataclass(frozen=True)
class HostSupport:
    """What this host lets the agent use, probed once at start."""

    root: bool
    setpriv: str | None
    unshare: str | None
    namespaces: bool
    why_not: list[str] = field(default_factory=list)
    filter_loader: tuple[str, ...] = ()  # runs the rest under the syscall filter (syscall_filter.py)
    filter_why_not: str = ""
    scope_why_not: str = "not probed"  # "": jobs get Landlock scopes (landlock.py)
    slirp: str | None = None  # slirp4netns: a job's own network gets outbound traffic (jobnet.py)
    filter_program: bytes = b""  # the filter as compiled once here; each job's loader loads it as is


def probe(config: SandboxConfig) -> HostSupport:
    """Try the tools once, so a job says what was applied instead of failing at start."""
    root = os.geteuid() == 0
    if root:  # host-wide counts no job's namespace or cgroup holds apart (host_limits.py)
        for done, what in host_limits.raise_counts():
            log.log(logging.INFO if done else logging.WARNING, "%s", what)
    setpriv, unshare = shutil.which("setpriv"), shutil.which("unshare")
    why: list[str] = []
    if setpriv is None:
        why.append("setpriv (util-linux) not installed")
    ns = False
    if not config.namespaces:
        why.append("namespaces turned off")
    elif not root:
        why.append("namespaces need a root agent")
    elif unshare is None:
        why.append("unshare (util-linux) not installed")
    else:
        try:
            r = subprocess.run(
                [unshare, *_NAMESPACES, "--", "/bin/sh", "-c", "mount -t tmpfs cpool-probe /tmp"],
                capture_output=True, text=True, timeout=20, check=False,
            )  # fmt: skip
            ns = r.returncode == 0
            if not ns:
                why.append(f"the host refuses PID/mount/IPC/UTS namespaces: {r.stderr.strip()[:200]}")
        except (OSError, subprocess.TimeoutExpired) as e:
            why.append(f"unshare failed: {e}")
    loader, filter_why, program = syscall_filter.probe()
    scope_why = landlock.probe()
    slirp = shutil.which("slirp4netns")
    if scope_why:
        log.warning("process jobs get no Landlock scopes (abstract unix sockets, signals): %s", scope_why)
    if ns and slirp is None:
        log.warning("slirp4netns is not installed: process jobs keep the node's network (and loopback)")
    return HostSupport(root, setpriv, unshare, ns, why, loader, filter_why, scope_why, slirp, program)


def prepare_dirs(run_dir: Path, uid: int, gid: int) -> Path:
    """The attempt's dirs: run_dir and its parents passable by the job, `work/` the job's alone.

    Whatever the agent put in `work/` before the start (the timeslice shim, …) becomes the job's.
    The tree also holds the tenant's code, unpacked as the tenant into its own dir, which another
    process of the tenant's may change meanwhile (a job where namespaces are refused: the data dir
    is not covered), swapping a directory for a link to one of root's: each name is changed
    relative to a descriptor of the directory that was listed (os.fwalk checks that each one it
    enters is the directory it listed), never by a path through a link.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    for d in (run_dir.parent.parent, run_dir.parent, run_dir):
        os.chmod(d, 0o711)
    work = run_dir / WORK_DIR
    work.mkdir(mode=0o700, exist_ok=True)
    for _, dirs, files, at in os.fwalk(work, follow_symlinks=False):
        for name in (*dirs, *files):
            with contextlib.suppress(FileNotFoundError):  # renamed away meanwhile: not there to hand
                os.chown(name, uid, gid, dir_fd=at, follow_symlinks=False)
    os.chown(work, uid, gid)
    os.chmod(work, 0o700)
    return work


def prepare_cache(root: Path, tenant: str, uid: int, gid: int) -> Path:
    """The tenant's cache dir `<root>/<tenant>` (pip environments and the like, kept between jobs):
    the tenant's own (0700) under a root dir others may pass but not list (0711), both root's.

    A root another user owns, or a root-owned dir where the tenant's cache should be, is not
    taken over (OSError): that is another pool's cache root nested in this one's, or this one's
    in another's, and handing it over would give one pool's tenant the other's caches."""
    root.mkdir(parents=True, exist_ok=True)
    if root.is_symlink() or root.lstat().st_uid != 0:
        raise OSError(f"{root} is not root's: it is no cache root of the pool's (another pool's cache?)")
    os.chown(root, 0, 0, follow_symlinks=False)
    os.chmod(root, 0o711)
    cache = root / tenant
    try:
        cache.mkdir(mode=0o700)
        made = True
    except FileExistsError:
        made = False
    st = cache.lstat()
    if not cache.is_dir() or cache.is_symlink():
        raise OSError(f"{cache} is not a directory")
    if not made and st.st_uid == 0 and uid != 0:
        raise OSError(f"{cache} is root's, not a tenant's cache (another pool's cache root?): kept")
    if (st.st_uid, st.st_gid) != (uid, gid):
        os.chown(cache, uid, gid, follow_symlinks=False)
    os.chmod(cache, 0o700)
    return cache


def job_env(slice_env: dict[str, str], user: pwd.struct_passwd, work: Path) -> dict[str, str]:
    """The job's environment from scratch: the slice's and user's variables, a fixed PATH, who it is.

    Nothing of the agent's own environment reaches the job.
    """
    env = {"PATH": FIXED_PATH, "LANG": "C.UTF-8"}
    env.update(slice_env)
    env.update(
        HOME=str(work), USER=user.pw_name, LOGNAME=user.pw_name, CPOOL_RUN_DIR=str(work), TMPDIR="/tmp"
    )
    return env


def hidden_dir(work: Path, data_dir: Path) -> Path:
    """What a job's mount namespace covers: the highest ancestor of its dir that others may not pass
    (nothing of it was reachable anyway), else the agent's data dir (its files are the pool's)."""
    for parent in reversed(work.parents):
        if parent != Path("/") and not parent.stat().st_mode & 0o001:
            return parent
    return data_dir


def tmpfs_mib(memory_mib: int) -> int:
    """The size of a job's private /tmp, /var/tmp and /dev/shm, each: half its memory limit (0: the
    kernel's default, for a job without one). What is written there counts in the job's memory
    (its cgroup's), so together they can never take more than it has; past its size a write fails
    (ENOSPC)."""
    return max(1, memory_mib // 2) if memory_mib > 0 else 0


def hands_over(host: HostSupport) -> bool:
    """Whether the sandbox's first steps run as root, to drop to the tenant's user at setpriv."""
    return host.root and host.setpriv is not None


def root_side_env(job_env: Mapping[str, str]) -> dict[str, str]:
    """The environment of the steps that run as root before setpriv drops to the tenant's user
    (the syscall filter's loader, unshare, the namespaces' init shell, setpriv itself).

    None of the job's variables may reach them as such: the dynamic loader would load a tenant's
    LD_PRELOAD or LD_AUDIT library into a root process, and the init shell would find `mount` in a
    tenant's PATH. So they run with a fixed PATH and locale alone, and the job's variables travel
    as one inert value (`export NAME='value'` lines) that the first step running as the tenant
    evaluates before it execs the command: the job gets exactly its own environment.
    """
    lines = ["unset PATH LANG"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in job_env.items() if _ENV_NAME.match(k)]
    script = "\n".join(lines)
    chunks = [script[i : i + _HANDOVER_CHUNK] for i in range(0, len(script), _HANDOVER_CHUNK)]
    return ROOT_ENV | {f"{HANDOVER}{i}": c for i, c in enumerate(chunks)}


def wrap(
    command: Sequence[str],
    user: pwd.struct_passwd,
    work: Path,
    host: HostSupport,
    hide: Path | None = None,
    keep: Path | None = None,
    cache: Path | None = None,
    tmp_mib: int = 0,
    private_network: bool = False,
    own_network: bool = False,
    no_device: Sequence[str] = (),
    user_prefix: str = "",
    mps_root: Path | None = None,
) -> tuple[list[str], list[str]]:
    """argv that runs `command` as `user` in the sandbox, and what it applies, in words.

    `private_network` (a cooperative service's RPC server): its syscall filter is loaded inside the
    namespaces, just before setpriv, and lets it make its own user + network namespace and no other.
    `own_network`: a network namespace of the job's own, outbound through slirp4netns (jobnet.py);
    where slirp4netns is missing the job keeps the node's network. Every job gets the Landlock
    scopes where the kernel has them (landlock.py).

    `hide` is covered by an empty tmpfs in the job's mount namespace; `work`, `keep` and `cache`
    stay; the private /tmp, /var/tmp and /dev/shm hold `tmp_mib` MiB each (0: the kernel's default).
    `no_device`: device files (devfiles.py) the job cannot open: covered in its mount namespace.
    `user_prefix`: the tenants' users' (tenants.py); the job's /etc/passwd and /etc/group show none
    but its own, and its cache's parent (the tenants' caches) is covered.
    `mps_root`: the MPS daemons' dirs (their control pipes, every device's), covered; an MPS client
    gets its own daemon's pipes (`keep`) bound back, never another device's.
    Where the first steps run as root (`hands_over`), the argv expects `root_side_env`'s
    environment and restores the job's own after setpriv.
    """
    applied: list[str] = []
    argv = list(command)
    if host.setpriv is not None:
        drop = [host.setpriv]
        if host.root:
            drop += ["--reuid", str(user.pw_uid), "--regid", str(user.pw_gid), "--clear-groups",
                     "--inh-caps=-all", "--bounding-set=-all"]  # fmt: skip
            applied.append(f"user {user.pw_name} (uid {user.pw_uid}), no capabilities")
        drop.append("--no-new-privs")
        applied.append("no_new_privs")
        # setpriv still holds root's capabilities while it execs: a shell (a public path) takes
        # that exec, so the command itself is looked up and run with the tenant's rights alone
        tail = _TAIL_HANDOVER if hands_over(host) else 'exec "$@"'
        argv = [*drop, "--", "/bin/sh", "-c", tail, "cpool-job", *argv]
    inner = private_network and host.filter_loader and host.namespaces and host.unshare is not None
    if inner:
        argv = [*syscall_filter.private_network_loader_argv(host.filter_loader[0]), *argv]
        applied.append(syscall_filter.SUMMARY_PRIVATE_NETWORK)
    if host.namespaces and host.unshare is not None:
        # the MPS daemons' root: an MPS client keeps its own daemon's pipes alone (`keep`, bound back)
        cover = str(mps_root) if mps_root is not None else ""
        init = ["/bin/sh", "-c", _NS_INIT, "cpool-init", str(work), str(hide or ""), str(keep or ""),
                str(cache or ""), f"{tmp_mib}m" if tmp_mib > 0 else "", " ".join(no_device), user_prefix,
                user.pw_name, str(JOB_PTYS), cover]  # fmt: skip
        # an MPS client (`keep`: its daemon's pipes) stays in the host's IPC namespace, its server's
        spaces = _NAMESPACES if keep is None else tuple(n for n in _NAMESPACES if n != "--ipc")
        argv = [host.unshare, *spaces, "--", *init, *argv]
        sized = f" ({tmp_mib} MiB each)" if tmp_mib > 0 else ""
        named = "PID, mount, IPC and UTS" if keep is None else "PID, mount and UTS (the host's IPC: MPS)"
        applied.append(f"own {named} namespaces, private /tmp, /var/tmp and /dev/shm{sized}")
        applied.append(f"own ptys (at most {JOB_PTYS})")
        if hide is not None:
            applied.append(f"{hide} hidden")
        if user_prefix:
            applied.append("no other tenant's user or cache in view")
        if no_device:
            applied.append(f"{len(no_device)} device files of devices not its slice's closed")
    elif host.why_not:
        applied.append("no namespaces: " + "; ".join(host.why_not))
    own = own_network and host.namespaces and host.unshare is not None and host.slirp is not None
    if own:
        applied.append(jobnet.SUMMARY)
    elif own_network and host.namespaces and host.unshare is not None:
        applied.append("the node's network: slirp4netns is not installed")
    scope = not host.scope_why_not
    applied.append(landlock.SUMMARY if scope else f"no landlock scopes: {host.scope_why_not}")
    # slirp4netns in the tenant's group: the host firewall counts its flows as the tenant's
    opts = jobnet.options(host.slirp, own, scope, user.pw_gid if host.root else None)
    if host.filter_loader and not inner:  # outermost: the namespaces' init and setpriv run under it too
        argv = [*syscall_filter.loader_argv(host.filter_loader[0], opts, host.filter_program), *argv]
        applied.append(syscall_filter.SUMMARY)
    else:
        if opts:  # the network and scopes come first, from outside the namespaces
            python = host.filter_loader[0] if host.filter_loader else sys.executable
            argv = [*jobnet.launcher_argv(opts, python), *argv]
        if host.filter_why_not:
            applied.append(f"no syscall filter: {host.filter_why_not}")
    return argv, applied
