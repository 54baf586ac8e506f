"""What `cpool exec` takes from a job: its environment, also from a process that has not yet
applied the sandbox's handover (a job that just started)."""

from __future__ import annotations

from computepool.agent.jobexec import handed_over
from computepool.agent.sandbox import root_side_env


def test_the_handed_over_environment_is_the_jobs() -> None:
    env = {"A": "x y'z\n2 export B=3", "PATH": "/p", "CPOOL_RUN_DIR": "/w", "E": "export", "F": ""}
    assert handed_over(root_side_env(env)) == env


def test_an_environment_without_a_handover_is_kept() -> None:
    assert handed_over({"HOME": "/w", "PATH": "/bin"}) == {"HOME": "/w", "PATH": "/bin"}
