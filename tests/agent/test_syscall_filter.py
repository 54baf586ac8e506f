"""The process jobs' syscall filter as the sandbox runs it: its loader, then the command under it.

What a job can no longer do is shown for real in tests/attacks/test_job_syscalls.py; here, the
loader itself: it runs any command under the filter, and says why when it cannot.
"""

from __future__ import annotations

import subprocess
import sys

from computepool.agent import syscall_filter

PROBE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
r = libc.unshare(0x10000000)
print(status["Seccomp"].strip(), r, os.strerror(ctypes.get_errno()), sys.flags.isolated)
"""


def test_the_loader_runs_the_command_under_the_filter() -> None:
    loader, why = syscall_filter.probe()
    assert why == "" and list(loader) == syscall_filter.loader_argv()
    r = subprocess.run([*loader, sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2", "-1", "Operation", "not", "permitted", "0"]  # mode 2: a filter


def test_the_loader_says_why_it_cannot_run_a_command() -> None:
    r = subprocess.run([*syscall_filter.loader_argv(), "/nonexistent/cmd"], capture_output=True, text=True)
    assert r.returncode == 127 and "cannot run /nonexistent/cmd" in r.stderr, r.stderr
    r = subprocess.run(syscall_filter.loader_argv()[:-1], capture_output=True, text=True)
    assert r.returncode == 2 and "usage:" in r.stderr, r.stderr
