"""The syscall filter of process jobs: seccomp, built by libseccomp (through pyseccomp, its ctypes
binding) and loaded before the sandbox's namespaces are made; it holds for everything after, the
job's user and all its children.

A job already runs with no capabilities and no_new_privs; what it may still reach is kernel code
that unprivileged users are allowed to call, and that is where local exploits live. Refused
(EPERM, so programs see an ordinary refusal): a new user namespace (clone or unshare with
CLONE_NEWUSER: inside one a job would hold every capability again, over a fresh mount and network
stack), joining namespaces (setns), the kernel keyrings (add_key, request_key, keyctl: shared by uid
across jobs), bpf, perf_event_open, userfaultfd, kexec, kernel modules, umount2 and pivot_root,
swap, reboot, acct, open_by_handle_at, io_uring, and setting a personality (reading it stays
allowed). clone3 and the new mount API answer ENOSYS, so that the C library and libmount fall back
to the calls a filter can judge: clone's flags are an argument (clone3's lie in memory no filter
reads), and mount(2) is left to the capabilities, since the sandbox's own init mounts the job's
/proc and /tmp under the filter, and a job has no CAP_SYS_ADMIN and no way to a user namespace
that would give it one. ptrace stays allowed: a job can only trace its own processes (its user,
its PID namespace), and debuggers and profilers need it.

`python -I -m computepool.agent.syscall_filter -- ARGV` loads the filter and execs ARGV; `-I`
keeps a job's PYTHONPATH (this runs as root) from choosing what it imports (the agent starts it
without `site`, pystart.py). Given jobnet's options
before `--` (`--own-network SLIRP`, `--scope`), the same process first gives the job its own
network and its Landlock scopes (jobnet.py, landlock.py): one Python start for all three.

One kind of job, a cooperative service's RPC server (made by the pool, never asked for by a
request), gets `--private-network`: unshare may then make one new user namespace together with a
new network namespace (CLONE_NEWUSER|CLONE_NEWNET), which is how it keeps llama.cpp's
unauthenticated RPC where no other process can connect. That filter is loaded inside the sandbox's
namespaces (just before setpriv), so it can refuse every other namespace outright: clone with any
namespace flag, unshare with any but those two, and a user namespace without a network one. Inside
its own user namespace such a job holds capabilities over its private network stack alone (no
mount namespace of its own, no setns).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # loaded where the filter is built: the agent starts without libseccomp too
    import pyseccomp as seccomp

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWTIME = 0x08000000, 0x20000000, 0x00000080
OTHER_NAMESPACES = (CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWTIME)
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
PERSONALITY_QUERY = 0xFFFFFFFF  # personality(0xffffffff) reads the current one and changes nothing
REFUSED = (
    "setns", "add_key", "request_key", "keyctl", "bpf", "perf_event_open", "userfaultfd",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "umount2", "pivot_root", "swapon", "swapoff", "reboot", "acct", "open_by_handle_at",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)  # fmt: skip
ABSENT = ("clone3", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr")
SUMMARY_PRIVATE_NETWORK = (
    "seccomp: one user + network namespace of its own (llama.cpp's RPC kept off the node), no other "
    "namespaces, setns, keyrings, bpf, perf events, userfaultfd, umount, modules, kexec, io_uring"
)
SUMMARY = (
    "seccomp: no user namespaces, setns, keyrings, bpf, perf events, userfaultfd, umount, modules, "
    "kexec, io_uring, personality changes"
)


def job_filter(private_network: bool = False) -> seccomp.SyscallFilter:
    """The filter: everything allowed but the calls above (`private_network`: see the module)."""
    import pyseccomp as seccomp  # noqa: PLC0415 - see the TYPE_CHECKING import

    f = seccomp.SyscallFilter(seccomp.ALLOW)
    # the 32-bit ABIs of a 64-bit host run the same rules (else their calls would be killed outright)
    compat = {
        seccomp.Arch.X86_64: (seccomp.Arch.X86, seccomp.Arch.X32),
        seccomp.Arch.AARCH64: (seccomp.Arch.ARM,),
    }
    for arch in compat.get(seccomp.system_arch(), ()):
        f.add_arch(arch)
    eperm = seccomp.ERRNO(errno.EPERM)
    for name in REFUSED:
        f.add_rule(eperm, name)
    # the flags are the first argument of both (x86, arm)
    f.add_rule(eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    if not private_network:
        f.add_rule(eperm, "unshare", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER))
    else:  # one user namespace with one network namespace; no other namespace at all
        both = CLONE_NEWUSER | CLONE_NEWNET
        f.add_rule(eperm, "unshare", seccomp.Arg(0, seccomp.MASKED_EQ, both, CLONE_NEWUSER))
        for other in (*OTHER_NAMESPACES, CLONE_NEWNET):
            rule = seccomp.Arg(0, seccomp.MASKED_EQ, other, other)
            f.add_rule(eperm, "clone", rule)
            if other != CLONE_NEWNET:
                f.add_rule(eperm, "unshare", rule)
    for name in ABSENT:
        f.add_rule(seccomp.ERRNO(errno.ENOSYS), name)
    f.add_rule(eperm, "personality", seccomp.Arg(0, seccomp.NE, PERSONALITY_QUERY))
    return f


def compiled() -> bytes:
    """The job filter as the kernel loads it (a classic BPF program), compiled by libseccomp."""
    import tempfile  # noqa: PLC0415 - the agent's side

    with tempfile.TemporaryFile() as f:
        job_filter().export_bpf(f)
        f.seek(0)
        return f.read()


def loader_argv(python: str = sys.executable, opts: Sequence[str] = (), program: bytes = b"") -> list[str]:
    """What goes before ARGV to run it under the filter; `opts`, the job's network and Landlock
    scopes (jobnet.options), are applied by the same process just before the filter. `program`
    (`compiled()`, made once by the agent) is loaded as it is, so the launcher of each job neither
    imports libseccomp's binding (which runs `ldconfig` twice to find its libraries) nor compiles."""
    from computepool.agent.pystart import module_argv  # the agent's side: this file also runs as -c source

    bpf = ["--bpf", program.hex()] if program else []
    return [*module_argv("computepool.agent.syscall_filter", python), *bpf, *opts, "--"]


def load_program(program: bytes) -> None:
    """Load a compiled filter (seccomp(2) through prctl), with no_new_privs first as libseccomp's
    own load sets it: the same filter, the same attributes, without the binding."""
    import ctypes  # noqa: PLC0415 - the launcher's side alone

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    if not program or len(program) % 8:
        raise OSError(errno.EINVAL, "not a BPF program")
    libc = ctypes.CDLL(None, use_errno=True)
    code = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.cast(code, ctypes.c_void_p))
    steps = ((PR_SET_NO_NEW_PRIVS, 1), (PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog)))
    for step in steps:
        args = (*step, 0, 0, 0)[:5]
        if libc.prctl(*(ctypes.c_ulong(a) for a in args)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))


def private_network_loader_argv(python: str = sys.executable) -> list[str]:
    """What goes before ARGV to run it under the private-network filter, from inside the sandbox's
    namespaces: this module's own source on the command line (it needs the standard library and
    pyseccomp alone), since where the package lives (a checkout under /tmp, say) may be hidden
    there. The source is code, not a secret: `ps` may show it."""
    return [python, "-I", "-c", Path(__file__).read_text(), "--private-network", "--"]


def probe() -> tuple[tuple[str, ...], str, bytes]:
    """(the loader's argv, "", the compiled filter) where it runs a command here; ((), why, b"")
    where it does not."""
    try:
        program = compiled()
    except (OSError, ImportError, RuntimeError):  # no libseccomp: the loader says why below
        program = b""
    argv = loader_argv(program=program)
    try:
        r = subprocess.run([*argv, "/bin/true"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return (), f"the filter's loader failed: {e}", b""
    if r.returncode != 0:
        said = r.stderr.strip().splitlines() or [f"the filter's loader exited {r.returncode}"]
        return (), said[-1][:200], b""
    return tuple(argv), "", program


def main(argv: Sequence[str]) -> int:
    private_network = bool(argv) and argv[0] == "--private-network"
    argv = argv[1:] if private_network else argv
    program = b""
    if len(argv) > 1 and argv[0] == "--bpf" and not private_network:
        try:
            program = bytes.fromhex(argv[1])
        except ValueError:
            program = b"?"  # refused below, with the job never run
        argv = argv[2:]
    net = None
    if argv and argv[0] != "--" and not private_network:  # the job's network and scopes first
        from computepool.agent import jobnet  # noqa: PLC0415 - the inner loader (-c) never gets them

        net = jobnet.parse(argv)
        argv = ["--", *net[4]] if net is not None else argv
    if len(argv) < 2 or argv[0] != "--":
        print(
            "usage: python -I -m computepool.agent.syscall_filter [--private-network | "
            "[--bpf HEX] [--own-network SLIRP|- [--slirp-group GID]] [--scope]] -- COMMAND [ARG...]",
            file=sys.stderr,
        )
        return 2
    if net is not None:
        try:
            jobnet.prepare(*net[:4])
        except OSError as e:
            print(f"cpool: cannot isolate the job's network: {e}", file=sys.stderr)
            return 126
    try:
        load_program(program) if program else job_filter(private_network).load()
    except (OSError, ImportError, RuntimeError) as e:  # the job never runs unfiltered (no libseccomp)
        print(f"cpool: cannot load the job's syscall filter: {e}", file=sys.stderr)
        return 126
    try:
        os.execvp(argv[1], list(argv[1:]))
    except OSError as e:
        print(f"cpool: cannot run {argv[1]}: {e.strerror or e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
