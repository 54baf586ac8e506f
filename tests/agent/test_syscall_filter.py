"""The process jobs' syscall filter as the sandbox runs it: its loader, then the command under it.

What a job can no longer do is shown for real in tests/attacks/test_job_syscalls.py; here, the
loader itself: it runs any command under the filter, and says why when it cannot.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from computepool.agent import syscall_filter

PROBE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
r = libc.unshare(0x10000000)
print(status["Seccomp"].strip(), r, os.strerror(ctypes.get_errno()), sys.flags.isolated)
"""


def test_the_loader_runs_the_command_under_the_filter() -> None:
    """Loaded as the agent compiled it once (--bpf) or compiled by the loader itself: the same."""
    loader, why, program = syscall_filter.probe()
    assert why == "" and program and list(loader) == syscall_filter.loader_argv(program=program)
    assert "-S" in loader  # no site: the launcher imports from the paths it was given
    for argv in (list(loader), syscall_filter.loader_argv()):
        r = subprocess.run([*argv, sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["2", "-1", "Operation", "not", "permitted", "0"]  # mode 2: a filter


def test_a_program_that_is_not_bpf_never_runs_the_command(tmp_path: Path) -> None:
    mark = tmp_path / "ran"
    for bad in (b"\x01\x02\x03", b""):
        argv = syscall_filter.loader_argv()
        argv[argv.index("--"):argv.index("--")] = ["--bpf", bad.hex() or "zz"]  # fmt: skip
        r = subprocess.run([*argv, "/usr/bin/touch", str(mark)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 126 and "cannot load the job's syscall filter" in r.stderr, r.stderr
        assert not mark.exists()


def test_the_loader_says_why_it_cannot_run_a_command() -> None:
    r = subprocess.run([*syscall_filter.loader_argv(), "/nonexistent/cmd"], capture_output=True, text=True)
    assert r.returncode == 127 and "cannot run /nonexistent/cmd" in r.stderr, r.stderr
    r = subprocess.run(syscall_filter.loader_argv()[:-1], capture_output=True, text=True)
    assert r.returncode == 2 and "usage:" in r.stderr, r.stderr


NAMESPACES = """
import ctypes, os, json
libc = ctypes.CDLL(None, use_errno=True)
def unshare(flags):
    return "ok" if libc.unshare(flags) == 0 else os.strerror(ctypes.get_errno())
NEWUSER, NEWNET, NEWNS, NEWPID, NEWUTS = 0x10000000, 0x40000000, 0x20000, 0x20000000, 0x04000000
out = {
    "user alone": unshare(NEWUSER),
    "user+mount": unshare(NEWUSER | NEWNS),
    "user+net+uts": unshare(NEWUSER | NEWNET | NEWUTS),
    "user+net": unshare(NEWUSER | NEWNET),
}
# inside its own user namespace: no other namespace (a mount namespace would let it mount)
out["then mount"] = unshare(NEWNS)
out["then pid"] = unshare(NEWPID)
out["then user"] = unshare(NEWUSER | NEWNET)
print(json.dumps(out))
"""


def test_a_private_network_job_makes_its_user_and_network_namespace_and_no_other() -> None:
    """The filter of a cooperative service's RPC server (loaded inside the sandbox's namespaces)."""
    loader = syscall_filter.loader_argv()
    argv = [*syscall_filter.private_network_loader_argv(), sys.executable, "-c", NAMESPACES]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    refused = "Operation not permitted"
    assert json.loads(r.stdout) == {
        "user alone": refused,
        "user+mount": refused,
        "user+net+uts": refused,
        "user+net": "ok",
        "then mount": refused,
        "then pid": refused,
        "then user": refused,
    }
    # the same under the ordinary filter: no user namespace at all
    plain = [*loader, sys.executable, "-c", NAMESPACES]
    r = subprocess.run(plain, capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout)["user+net"] == refused
