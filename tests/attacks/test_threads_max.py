"""One tenant's jobs fork until the host's every fork fails.

The agent caps its jobs' processes and threads together at three quarters of pid_max, a tenant's
at half of that (cgroup pids.max). systemd sets pid_max to 4194304, while the kernel sizes
threads-max from memory (1048576 at 128 GiB): a tenant's share, 1.57 M, lay past threads-max, and
past threads-max every fork and thread of the host fails, root's too (no capability exempts it):
one job of about a fifth of the node's memory (each thread's kernel stack is charged to it) would
have stopped the agent, the other tenants' jobs and the operator's shell from starting anything.
The budget is now taken from the lower of the two.
"""

from __future__ import annotations

from pathlib import Path

from computepool.agent import cgroups


def test_a_tenants_share_of_the_nodes_pids_stays_below_threads_max(tmp_path: Path) -> None:
    pid_max, threads_max = tmp_path / "pid_max", tmp_path / "threads-max"
    pid_max.write_text("4194304\n")  # systemd's
    threads_max.write_text("1048576\n")  # the kernel's at 128 GiB
    budget = cgroups.jobs_pids_budget(pid_max, threads_max)
    assert budget == 786432  # three quarters of threads-max: the host keeps a quarter
    assert cgroups.tenant_pids_budget(budget) < 1048576
    threads_max.write_text("99999999\n")  # a large host: pid_max is the lower again
    assert cgroups.jobs_pids_budget(pid_max, threads_max) == 3145728
