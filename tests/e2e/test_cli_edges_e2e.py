"""The CLI against a real `cpool up`: no exports needed after it, --priority/--tenant on run, Ctrl-C on
alloc withdraws the request, and a wrong token is reported before any code is packed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_helpers import Pool, child_env, cpool, free_port, stop, wait_for


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Pool]]:
    """A `cpool up` pool and the environment of a user who only ran it: no CPOOL_SERVER/TOKEN/CA."""
    tmp = tmp_path_factory.mktemp("edges")
    data, port, log = tmp / "pool", free_port(), tmp / "up.log"
    env = {**child_env(), "CPOOL_CONFIG": str(tmp / "cfg" / "config.json")}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cpool("up", "--simulate", "1xA100-80GB", "--data-dir", str(data), "--port", str(port)),
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    pool: Pool | None = None
    try:
        wait_for("cpool up", lambda: "ComputePool is up" in log.read_text(), 60, log.read_text)
        pool = Pool(f"https://127.0.0.1:{port}", data)
        wait_for("the local node", lambda: [n["state"] for n in pool.nodes()] == ["ready"], 30)
        yield env, pool
    finally:
        if pool is not None:
            pool.close()
        stop(proc, signal.SIGINT, timeout=40)


def _cpool(env: dict[str, str], *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cpool(*args), env=env, capture_output=True, text=True, timeout=60, cwd=cwd)


def test_up_logs_the_cli_in_over_https(up: tuple[dict[str, str], Pool]) -> None:
    env, pool = up
    saved = json.loads(Path(env["CPOOL_CONFIG"]).read_text())
    assert saved["server"] == pool.url and saved["server"].startswith("https://"), saved
    r = _cpool(env, "ps", "--json")
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout), list)


def test_run_takes_priority_and_tenant(up: tuple[dict[str, str], Pool]) -> None:
    env, pool = up
    r = _cpool(env, "run", "--detach", "--no-code", "--no-stdin", "--priority", "7", "--", "true")
    assert r.returncode == 0, r.stderr
    job_id = int(re.search(r"job (\d+) submitted", r.stderr).group(1))  # type: ignore[union-attr]
    assert pool.get(job_id)["request"]["priority"] == 7
    r = _cpool(env, "run", "--no-code", "--no-stdin", "--tenant", "no-such-tenant-x", "--", "true")
    assert r.returncode == 1 and "no-such-tenant-x" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_ctrl_c_on_alloc_withdraws_the_request(up: tuple[dict[str, str], Pool], tmp_path: Path) -> None:
    env, pool = up
    holder = pool.http.post("/api/v1/allocations", json={"gpus": 1, "exclusive": True})
    assert holder.status_code == 201, holder.text
    holder_id = int(holder.json()["id"])
    err = tmp_path / "alloc.err"
    proc: subprocess.Popen[bytes] | None = None
    try:
        wait_for("the whole device held", lambda: pool.state(holder_id) == "bound", 30)
        with err.open("wb") as out:
            # as from a terminal: a harness that starts the tests in the background hands them
            # SIGINT ignored, which Python (and so cpool) keeps ignored
            proc = subprocess.Popen(
                cpool("alloc", "--gpus", "1"), env=env, stdout=subprocess.PIPE, stderr=out,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )  # fmt: skip
        found = wait_for("alloc waiting", lambda: re.search(r"allocation (\d+) pending", err.read_text()), 30)
        alloc_id = int(found.group(1))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 130, err.read_text()  # a busy host answers the cancel late
        assert pool.state(alloc_id) == "cancelled"
        assert f"cancelled allocation {alloc_id}" in err.read_text() and "Traceback" not in err.read_text()
    finally:
        if proc is not None:
            stop(proc, signal.SIGINT)
        with contextlib.suppress(httpx.HTTPError):
            pool.http.post(f"/api/v1/allocations/{holder_id}/release")


def test_a_wrong_token_is_reported_before_the_code_is_packed(
    up: tuple[dict[str, str], Pool], tmp_path: Path
) -> None:
    """The code dir is far too big to ship (a sparse file): the token's error must come first."""
    code = tmp_path / "code"
    code.mkdir()
    with (code / "big.bin").open("wb") as f:
        f.truncate(4 << 30)
    env = {**up[0], "CPOOL_TOKEN": "cpool_wrong_token"}
    r = _cpool(env, "run", "--no-stdin", "--workdir", str(code), "--", "true")
    assert r.returncode == 1, r.stderr
    assert "to ship" not in r.stderr and "code:" not in r.stderr, r.stderr
    assert re.search(r"token|unauthori[sz]ed|401", r.stderr, re.IGNORECASE), r.stderr
    assert os.path.getsize(code / "big.bin") == 4 << 30


def test_plain_http_to_the_https_pool_says_so(up: tuple[dict[str, str], Pool], tmp_path: Path) -> None:
    """No saved login and the pool's address typed with http://: the error names the fix."""
    env = {**up[0], "CPOOL_CONFIG": str(tmp_path / "none.json")}
    r = _cpool(env, "ps", "--server", up[1].url.replace("https://", "http://"))
    assert r.returncode == 1, r.stderr
    assert "use https:// and --ca" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
