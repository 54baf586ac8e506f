"""`cpool bench coop`: bad options and a missing engine end in one line; a short real run (its own
server, two root agents with discovery, an impostor, llama.cpp split over two nodes) prints the
figures the checks read, with the impostor rejected and the split decoding what one node decodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from poolkit import SRC


def _cpool(*args: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CPOOL_")}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))
    base["CPOOL_CGROUP_BASE"] = "none"  # the agents leave the host's cgroups alone
    argv = [sys.executable, "-m", "computepool.cli.main", *args]
    return subprocess.run(argv, capture_output=True, text=True, env={**base, **(env or {})}, timeout=timeout)


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode != 0, r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.parametrize(("option", "value"), [("--tokens", "0"), ("--tokens", "500"), ("--runs", "0")])
def test_bad_options_end_in_one_line_naming_the_option(option: str, value: str) -> None:
    assert option in _one_line(_cpool("bench", "coop", option, value, timeout=60))


def test_a_missing_engine_says_how_to_build_one(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    line = _one_line(_cpool("bench", "coop", "--engine-python", str(missing), timeout=60))
    assert str(missing) in line and "scripts/llama-venv.sh" in line
    # the variable names the default too
    line = _one_line(_cpool("bench", "coop", timeout=60, env={"CPOOL_LLAMA_PYTHON": str(missing)}))
    assert str(missing) in line


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the bench's agents create tenant users: root only")
def test_a_short_run_finds_the_peers_rejects_the_impostor_and_splits_exactly(llama_python: str) -> None:
    before = {p.name for p in Path("/var/cache").glob("cpool-bench-coop-*")}
    r = _cpool(
        "bench", "coop", "--json", "--tokens", "24", "--runs", "3", "--engine-python", llama_python,
        timeout=1500,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout)

    assert isinstance(out["peers_found"], int) and out["peers_found"] >= 2  # each agent, seen by the other
    assert isinstance(out["peers_rejected"], int) and out["peers_rejected"] >= 1  # the impostor
    assert out["peers"]["rejected"] and all(out["peers"]["rejected"].values())  # each with a reason
    assert out["split_equals_single"] is True
    assert out["chosen_equals_single"] is True
    assert len(out["text"]) == out["tokens"] == 24  # byte vocabulary, never EOS: one character a token
    seen = out["discovery"]["seen_after_s"]
    assert len(seen) == 2 and all(isinstance(v, float) and v >= 0 for v in seen.values()), seen

    rates = [out[k] for k in ("single_tokens_per_s", "split_tokens_per_s", "chosen_tokens_per_s")]
    assert all(isinstance(v, float) and v > 0 for v in rates), rates
    # the pool's pick is never much slower than the slower of the two arms it chose between
    single, split, chosen = rates
    assert chosen >= 0.9 * min(single, split), rates

    # what was forced is what ran: one node, then two
    assert len({sh["node"] for sh in out["single"]["shards"]}) == 1, out["single"]
    assert len({sh["node"] for sh in out["split"]["shards"]}) == 2, out["split"]
    assert out["chosen"], out["plan"]
    for sh in out["chosen"]:
        assert isinstance(sh["node"], str) and isinstance(sh["device"], str)
        assert isinstance(sh["first_layer"], int) and isinstance(sh["layers"], int) and sh["layers"] >= 1
    # the chosen shards cover the model's layers once each, in order
    layers = sorted((sh["first_layer"], sh["layers"]) for sh in out["chosen"])
    start = 0
    for first, n in layers:
        assert first == start, layers
        start += n
    assert out["chosen_reason"]

    # it cleaned up after itself
    assert {p.name for p in Path("/var/cache").glob("cpool-bench-coop-*")} == before
