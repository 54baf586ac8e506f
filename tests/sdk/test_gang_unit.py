"""Functions over several nodes, the parts that need no pool: the worker's one-shot mode run for real
with the system Python (as a member runs it), and how the members' outcomes become the caller's
value or exception."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from computepool.client.archive import pack
from computepool.sdk import CallCancelled, Pool, RemoteError, RemoteTraceback
from computepool.sdk import worker as worker_mod
from computepool.sdk.gang import OUTCOME_PATH, GangHandle, _read_outcome
from computepool.sdk.packing import pack_call, pack_shipment, shipment

JOB_PYTHON = "/usr/bin/python3"


def _member(work: Path, fn: Any, args: tuple[Any, ...], rank: int) -> tuple[int, dict[str, Any], str]:
    """Run `fn` as rank `rank` of a gang would: the shipped archive unpacked, the call on stdin."""
    with tarfile.open(fileobj=io.BytesIO(pack_shipment(shipment(fn, work))), mode="r:gz") as tar:
        tar.extractall(work, filter="data")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "CPOOL_RANK": str(rank), "WORLD_SIZE": "2"}
    done = subprocess.run(
        [JOB_PYTHON, "-u", "__cpool__/worker.py", "--once"],
        input=pack_call(args, {}),
        capture_output=True,
        env=env,
        cwd=work,
        timeout=120,
    )
    outcome = json.loads((work / OUTCOME_PATH).read_text())
    return done.returncode, outcome, done.stdout.decode() + done.stderr.decode()


@pytest.mark.skipif(not os.access(JOB_PYTHON, os.X_OK), reason="needs the system python3")
def test_the_one_shot_worker_writes_the_outcome_and_exits_by_it(tmp_path: Path) -> None:
    def job(x: int) -> tuple[int, str]:
        import os
        import sys

        print("out of the member", flush=True)
        print("err of the member", file=sys.stderr, flush=True)
        if x < 0:
            raise ValueError(f"negative {x}")
        return x * 2, os.environ["WORLD_SIZE"]

    (tmp_path / "ok").mkdir()
    rc, outcome, printed = _member(tmp_path / "ok", job, (21,), rank=1)
    assert rc == 0 and outcome["ok"] is True and outcome["rank"] == 1, printed
    assert cloudpickle.loads(base64.b64decode(outcome["result"])) == (42, "2")
    assert "out of the member" in printed and "err of the member" in printed  # the job's own streams

    (tmp_path / "raises").mkdir()
    rc, outcome, printed = _member(tmp_path / "raises", job, (-1,), rank=0)
    assert rc == 1 and outcome["ok"] is False, printed  # a member that raised fails the gang
    err = cloudpickle.loads(base64.b64decode(outcome["result"]))
    assert isinstance(err, ValueError) and str(err) == "negative -1"
    assert outcome["traceback"].rstrip().endswith("ValueError: negative -1")


def _outcome(value: Any, ok: bool, rank: int, tb: str | None = None) -> dict[str, Any]:
    ok, result, tb = worker_mod.dump(value, ok, tb)
    return {"rank": rank, "ok": ok, "result": result, "traceback": tb}


def test_outcomes_become_rank_0s_value_all_ranks_or_the_lowest_failing_ranks_exception() -> None:
    pool = Pool(server="http://127.0.0.1:9", token="t")  # never reached: the outcomes are given
    fn = pool.function(lambda: 0, nodes=2, name="gangfn")
    everyone = pool.function(lambda: 0, nodes=2, all_ranks=True)
    ended = {"state": "released", "reason": "exited 0 on all 2 nodes", "nodes": ["a", "b"]}

    def handle(f: Any, **alloc: Any) -> GangHandle[Any]:
        h: GangHandle[Any] = GangHandle(f, 7, 2)
        h.allocation = ended | alloc
        return h

    both = {0: _outcome("zero", True, 0), 1: _outcome("one", True, 1)}
    assert handle(fn)._settle_gang(both) == "zero"
    assert handle(everyone)._settle_gang(both) == ["zero", "one"]

    tb = "Traceback (most recent call last):\nKeyError: 'k'\n"
    raised = {0: _outcome("zero", True, 0), 1: _outcome(KeyError("k"), False, 1, tb)}
    with pytest.raises(KeyError) as info:
        handle(fn, state="failed")._settle_gang(raised)
    assert isinstance(info.value.__cause__, RemoteTraceback) and "KeyError: 'k'" in str(info.value.__cause__)
    assert any("allocation 7, rank 1 of 2" in n for n in info.value.__notes__), info.value.__notes__
    two = {0: _outcome(ValueError("first"), False, 0), 1: _outcome(KeyError("second"), False, 1)}
    with pytest.raises(ValueError, match="first"):  # the lowest failing rank
        handle(fn, state="failed")._settle_gang(two)

    killed = {"state": "failed", "reason": "rank 1 on node b was killed by signal 9"}
    with pytest.raises(
        RemoteError, match=r"allocation 7 failed: rank 1 .*signal 9 \(no outcome from rank 1\)"
    ):
        handle(fn, **killed)._settle_gang({0: _outcome("zero", True, 0)})
    with pytest.raises(CallCancelled, match="cancelled"):
        handle(fn, state="cancelled", reason="cancelled by user:u")._settle_gang({})
    unreadable = {0: both[0] | {"result": base64.b64encode(b"not a pickle").decode()}, 1: both[1]}
    with pytest.raises(RemoteError, match="rank 0: its result could not be read here"):
        handle(fn)._settle_gang(unreadable)
    pool.close()


def test_the_outcome_is_read_out_of_the_files_answer() -> None:
    body = json.dumps(_outcome(5, True, 0)).encode()
    assert _read_outcome(pack(None, extra_files={OUTCOME_PATH: body}))["ok"] is True  # type: ignore[index]
    assert _read_outcome(pack(None, extra_files={"__cpool__/other": body})) is None
    assert _read_outcome(b"not a tar") is None
