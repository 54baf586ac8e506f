"""The SDK's parts that need no pool: what ships, how options are checked, how outcomes are read back,
and the worker's pip environments (built with the real pip, from the machine's package index)."""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import subprocess
import sys
import tarfile
import textwrap
import threading
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

from computepool.core.errors import InvalidInput
from computepool.sdk import Pool, RemoteTraceback
from computepool.sdk import worker as worker_mod
from computepool.sdk.errors import CallCancelled, RemoteError
from computepool.sdk.packing import FUNCTION_PATH, WORKER_PATH, local_modules, pack_shipment, shipment
from computepool.sdk.pool import Handle, default_name, localise


def _names(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A caller's project: a helper package and module imported from the working directory."""
    root = tmp_path / "proj"
    (root / "helperpkg").mkdir(parents=True)
    (root / "helperpkg" / "__init__.py").write_text("from helperpkg.inner import triple\n")
    (root / "helperpkg" / "inner.py").write_text("def triple(x):\n    return 3 * x\n")
    (root / "helpermod.py").write_text("SCALE = 7\n")
    (root / "data.txt").write_text("shipped with the code\n")
    (root / "ignored.log").write_text("left out\n")
    (root / ".gitignore").write_text("*.log\n")
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))
    for name in ("helperpkg", "helperpkg.inner", "helpermod"):
        sys.modules.pop(name, None)
    __import__("helperpkg")
    __import__("helpermod")
    yield root
    for name in ("helperpkg", "helperpkg.inner", "helpermod"):
        sys.modules.pop(name, None)


def test_local_modules_are_the_callers_own_files(project: Path) -> None:
    names = {m.name: m.root for m in local_modules(project)}
    assert names["helperpkg"] == project and names["helperpkg.inner"] == project
    assert names["helpermod"] == project
    assert not any(n.startswith(("computepool", "cloudpickle", "pytest", "json")) for n in names)


def test_shipment_holds_the_modules_the_worker_cloudpickle_and_the_function(project: Path) -> None:
    import helpermod  # type: ignore[import-not-found]
    from helperpkg import triple  # type: ignore[import-not-found]

    def job(x: int) -> int:
        return int(triple(x)) * helpermod.SCALE

    (project / ".ssh").mkdir()
    (project / ".ssh" / "id_rsa").write_text("a key\n")
    s = shipment(job, project)
    assert s.root is None  # the modules travel, never the directory they came from
    archive = pack_shipment(s)
    files = _names(archive)
    [prefix] = [p for p in s.sys_path if f"{p}/helpermod.py" in files]
    assert prefix.startswith("__cpool__/paths/") and f"{prefix}/helperpkg/inner.py" in files
    assert not any(n.endswith(("data.txt", "ignored.log", "id_rsa")) for n in files), sorted(files)
    assert files[WORKER_PATH] == (Path(worker_mod.__file__)).read_bytes()
    assert "__cpool__/lib/cloudpickle/__init__.py" in files
    assert not any("__pycache__" in n for n in files)
    assert cloudpickle.loads(files[FUNCTION_PATH])(2) == 42
    assert pack_shipment(shipment(job, project)) == archive  # content-addressed: same bytes again


def test_a_module_outside_the_working_dir_ships_under_cpool_paths(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "farmod.py").write_text("VALUE = 5\n")
    monkeypatch.syspath_prepend(str(elsewhere))
    sys.modules.pop("farmod", None)
    import farmod  # type: ignore[import-not-found]

    try:
        s = shipment(lambda: farmod.VALUE, project)
        files = _names(pack_shipment(s))
        (prefix,) = [p for p in s.sys_path if f"{p}/farmod.py" in files]
        assert prefix.startswith("__cpool__/paths/")
    finally:
        sys.modules.pop("farmod", None)


def test_nothing_local_imported_ships_no_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "big.bin").write_bytes(b"x" * 1000)
    monkeypatch.chdir(tmp_path)
    s = shipment(lambda x: x + 1, tmp_path)
    assert s.root is None and "." not in s.sys_path
    files = _names(pack_shipment(s))
    assert "big.bin" not in files and WORKER_PATH in files


def test_function_options_are_checked_and_named(tmp_path: Path) -> None:
    pool = Pool(server="http://127.0.0.1:9", token="t")
    with pytest.raises(InvalidInput, match="^gpus: "):
        pool.function(gpus="lots")
    with pytest.raises(InvalidInput, match="^mem: "):
        pool.function(mem="8 parsecs")
    with pytest.raises(InvalidInput, match="^gpu: not an option"):
        pool.function(gpu=1)
    with pytest.raises(InvalidInput, match="^keep_warm: "):
        pool.function(keep_warm=-1)
    with pytest.raises(InvalidInput, match="^max_workers: "):
        pool.function(max_workers=0)
    with pytest.raises(InvalidInput, match="^pip: "):
        pool.function(pip="numpy")
    with pytest.raises(InvalidInput, match="^nodes: "):
        pool.function(nodes=0)
    with pytest.raises(InvalidInput, match="^keep_warm: .*several nodes"):
        pool.function(nodes=2, keep_warm=10)
    with pytest.raises(InvalidInput, match="^all_ranks: "):
        pool.function(nodes=2, all_ranks="yes")
    gang = pool.function(lambda: 0, nodes=2, cpus=1)
    assert gang.spec.gang and gang.spec.request.gang_nodes == 2 and gang.spec.request.cpu_milli == 1000
    assert not pool.function(lambda: 0).spec.gang and pool.function(lambda: 0, all_ranks=True).spec.gang

    @pool.function(gpus=0.5, cpus=2, mem="8GiB", time_limit="1h", keep_warm=30)
    def add(a: int, b: int) -> int:
        return a + b

    assert add(2, 3) == 5  # still a local function
    assert add.spec.request.gpu_milli == 500 and add.spec.request.memory_mib == 8192
    assert add.spec.request.time_limit == 3600 and add.spec.keep_warm_s == 30
    plain = cloudpickle.loads(cloudpickle.dumps(add))  # on the node: the function, not the wrapper
    assert plain(1, 1) == 2 and not hasattr(plain, "spawn")
    with pytest.raises(TypeError, match="Pool holds a connection"):
        pickle.dumps(pool)
    pool.close()


def test_default_names_follow_the_name_rule() -> None:
    def Train_Model() -> None: ...

    assert default_name(Train_Model) == "test_default_names_follow_the_name_rule.local.train_model"[:60]
    assert default_name(lambda: 0).startswith("test_default_names_follow_the_name_rule.local.-lambda")


def _outcome(value: Any, ok: bool, tb: str | None = None, state: str = "done") -> dict[str, Any]:
    data = base64.b64encode(cloudpickle.dumps(value)).decode()
    return {"id": 9, "state": state, "ok": ok, "result": data, "traceback": tb, "error": None}


def test_a_remote_exception_is_raised_as_itself_with_the_remote_traceback() -> None:
    pool = Pool(server="http://127.0.0.1:9", token="t")
    fn = pool.function(lambda: 0)
    h = Handle(fn, 9)
    assert h._settle(_outcome({"a": 1}, True)) == {"a": 1}
    with pytest.raises(KeyError) as info:
        h._settle(_outcome(KeyError("missing"), False, "Traceback ...\nKeyError: 'missing'\n"))
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "KeyError: 'missing'" in str(info.value.__cause__)
    assert any("raised on the pool" in n for n in info.value.__notes__)
    failed = {"id": 9, "state": "failed", "ok": None, "result": None, "traceback": None,
              "error": "worker ended: exit code 137"}  # fmt: skip
    with pytest.raises(RemoteError, match="worker ended: exit code 137"):
        h._settle(failed)
    with pytest.raises(CallCancelled):
        h._settle(failed | {"state": "cancelled", "error": None})
    unreadable = _outcome(0, True) | {"result": base64.b64encode(b"not a pickle").decode()}
    with pytest.raises(RemoteError, match="could not be read here"):
        h._settle(unreadable)
    pool.close()


def test_importing_computepool_does_not_load_the_sdk() -> None:
    code = (
        "import computepool, sys; "
        "print(sorted(m for m in sys.modules if m.startswith(('computepool.sdk', 'httpx'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    code = "from computepool import Pool; print(Pool.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "computepool.sdk.pool"


def test_worker_results_that_cannot_be_pickled_name_their_type() -> None:
    ok, data, _ = worker_mod.dump(threading.Lock(), True, None)
    err = cloudpickle.loads(base64.b64decode(data))
    assert not ok and isinstance(err, TypeError) and "_thread.lock" in str(err)
    ok, data, tb = worker_mod.dump(ValueError(threading.Lock()), False, "tb")
    assert not ok and tb == "tb"


JOB_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(not os.access(JOB_PYTHON, os.X_OK), reason="needs the system python3")
def test_pip_environment_is_built_once_by_concurrent_workers(tmp_path: Path) -> None:
    """Two workers at once, real pip from the machine's index: one builds, the other waits and reuses."""
    script = textwrap.dedent(
        f"""
        import json, os, sys, time
        sys.path.insert(0, {str(Path(worker_mod.__file__).parent)!r})
        import worker
        t0 = time.monotonic()
        path = worker.build_env(["six"])
        print(json.dumps({{"path": path, "s": time.monotonic() - t0}}))
        """
    )
    env = {"PATH": "/usr/bin:/bin", "CPOOL_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    procs = [
        subprocess.Popen([JOB_PYTHON, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {json.loads(o)["path"] for o, _ in outs}
    assert len(paths) == 1
    (env_dir,) = paths
    envs = [p for p in (tmp_path / "cache" / "envs").iterdir() if p.is_dir()]
    assert envs == [Path(env_dir)]  # one environment, no half-built leftovers
    done = subprocess.run(
        [f"{env_dir}/bin/python", "-c", "import six; print(six.__version__)"], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip()
    # a failing requirement: pip's own words come back, nothing is left behind
    bad = script.replace('["six"]', '["cpool-no-such-package-xyz==1.0"]')
    fail = subprocess.run([JOB_PYTHON, "-c", bad], capture_output=True, text=True, env=env, timeout=300)
    assert fail.returncode != 0
    assert "pip install cpool-no-such-package-xyz==1.0 failed" in fail.stderr
    assert "No matching distribution" in fail.stderr or "Could not find" in fail.stderr
    assert len([p for p in (tmp_path / "cache" / "envs").iterdir() if p.is_dir()]) == 1


def test_remote_frames_of_code_sent_by_value_show_the_callers_file_and_source() -> None:
    def job() -> None:
        raise KeyError("k")  # the line the remote traceback points at

    line = job.__code__.co_firstlineno + 1
    remote = (
        "Traceback (most recent call last):\n"
        '  File "/x/__cpool__/worker.py", line 290, in run\n'
        "    value, ok = self.fn(*args, **kwargs), True\n"
        f'  File "<dynamic-code>", line {line}, in job\n'
        "KeyError: 'k'\n"
    )
    out = localise(remote, job)
    assert f'  File "{__file__}", line {line}, in job\n    raise KeyError("k")' in out
    assert out.startswith(remote.split("<dynamic-code>")[0].rsplit("\n", 1)[0])
    assert out.endswith("KeyError: 'k'\n")
    assert localise("", job) == "" and localise(remote, print) == remote  # nothing to say: as it came
