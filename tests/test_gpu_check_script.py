"""scripts/gpu_check.py keeps working where CI runs: no GPU, so simulated devices (`--dry-run`).

The script is what a lent GPU machine runs once, unattended; these runs catch an API change that
would break it before such a machine is spent on it. The container part needs root and podman
(CI has both); without them the script must say SKIP, never fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def run_check(out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, dict[str, str]]]:
    env = {**os.environ, "OUT": str(out)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, env=env
    )
    results = json.loads((out / "gpu-check.json").read_text())
    return done, {r["check"]: r for r in results}


def podman_usable() -> bool:
    return os.geteuid() == 0 and shutil.which("podman") is not None


def test_dry_run_places_mig_and_runs_containers_on_simulated_slices(tmp_path: Path) -> None:
    done, results = run_check(tmp_path, "--dry-run")
    failed = {k: r["detail"] for k, r in results.items() if r["status"] == "FAIL"}
    assert done.returncode == 0 and not failed, (failed, done.stdout[-2000:], done.stderr[-2000:])
    for name in (
        "mig: --mig 3g.40gb placed on an instance of that profile",
        "mig: --isolation mig takes the smallest instance",
        "mig: a whole-GPU request never lands on an instance",
        "mig: a timeslice request never lands on an instance",
        "mig: an instance holds one allocation",
        "mig: job env names the instance",
    ):
        assert results[name]["status"] == "PASS", results.get(name)
    assert results["mig: torch sees the instance's memory"]["status"] == "SKIP"
    if not podman_usable():
        assert results["container path"]["status"] == "SKIP"
        return
    for name in (
        "container on #0 A100: job ran",
        "container on #0 A100: tenant uid, no privileges",
        "container on #0 A100: no network",
        "container on #0 A100: cpu limit",
        "container on #0 A100: CUDA_VISIBLE_DEVICES",
        "container on #0 A100: only the slice's device nodes",
        "container: memory limit enforced",
        "container on MIG A100-MIG-3g.40gb: CUDA_VISIBLE_DEVICES",
    ):
        assert results[name]["status"] == "PASS", results.get(name)
    assert "MIG-" in results["container on MIG A100-MIG-3g.40gb: CUDA_VISIBLE_DEVICES"]["detail"]


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None or Path("/dev/nvidiactl").exists(), reason="a GPU is here"
)
def test_without_a_gpu_every_gpu_check_is_skipped_with_its_reason(tmp_path: Path) -> None:
    done, results = run_check(tmp_path)
    assert done.returncode == 0, done.stdout[-2000:]
    assert results["nvml discovery"]["status"] == "SKIP" and "NVML" in results["nvml discovery"]["detail"]
    assert {r["status"] for r in results.values()} <= {"SKIP", "INFO"}
    assert "0 fail" in done.stdout
