"""The SDK for real: `cpool server` and a root `cpool agent` on loopback, a tenant's member token,
functions whose workers run as the tenant's Unix user with the node's /usr/bin/python3.

The pool's dirs live under a 0700 dir in /var/tmp, so the job's sandbox hides them all and must bind
back the job's own dir and the tenant's cache (CPOOL_CACHE_DIR) for the worker to run at all.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import child_env, cpool, free_port, publish_image, stop, wait_for

import computepool.sdk.pool as sdk_pool
from computepool.core.tls import client_context, generate_self_signed
from computepool.sdk import CallCancelled, IncompatiblePython, Pool, RemoteError, RemoteTraceback

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent"),
    pytest.mark.skipif(not os.access("/usr/bin/python3.11", os.X_OK), reason="workers need python3.11"),
    pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the caller must match the node's 3.11"),
]


class Cluster:
    """A server and a root agent with their own data dirs, and one tenant with a member token."""

    def __init__(self, root: Path, tls: bool = False) -> None:
        self.root = root
        self.cert: Path | None = None
        if tls:  # the agent pins the certificate from its join token; its workers get a copy
            self.cert = root / "tls" / "cert.pem"
            generate_self_signed(self.cert, root / "tls" / "key.pem", ["localhost", "127.0.0.1"])
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{free_port()}"
        self.srv_dir, self.agent_dir, self.cache = root / "srv", root / "agent", root / "cache"
        self.tenant = f"sdk{uuid.uuid4().hex[:6]}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        env = child_env()
        port = self.url.rsplit(":", 1)[1]
        tls = (
            ["--tls-cert", str(self.cert), "--tls-key", str(self.root / "tls" / "key.pem")]
            if self.cert
            else []
        )
        with (self.root / "server.log").open("ab") as out:
            self.procs.append(
                subprocess.Popen(cpool("server", "--data-dir", str(self.srv_dir), "--port", port, *tls),
                                 stdout=out, stderr=subprocess.STDOUT, env=env)
            )  # fmt: skip
        verify = client_context(self.cert)
        wait_for(
            "the server", lambda: httpx.get(f"{self.url}/readyz", verify=verify).is_success, 60, self.logs
        )
        token = (self.srv_dir / "admin-token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        self.admin = httpx.Client(base_url=self.url, headers=headers, timeout=10, verify=verify)
        join = self.admin.post("/api/v1/join-tokens", json={}).json()["token"]
        with (self.root / "agent.log").open("ab") as out:
            self.procs.append(
                subprocess.Popen(
                    cpool(
                        "agent",
                        "--server",
                        self.url,
                        "--join-token",
                        join,
                        "--data-dir",
                        str(self.agent_dir),
                        "--name",
                        "sdknode",
                        "--kill-grace-s",
                        "1",
                        "--cache-dir",
                        str(self.cache),
                    ),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                )  # fmt: skip
            )
        wait_for("the node", lambda: self.node().get("state") == "ready", 60, self.logs)
        assert self.admin.post("/api/v1/tenants", json={"name": self.tenant}).status_code == 201
        user = {"name": f"m-{self.tenant}", "tenant": self.tenant, "role": "member"}
        assert self.admin.post("/api/v1/users", json=user).status_code == 201
        r = self.admin.post("/api/v1/tokens", json={"user": user["name"]})
        assert r.status_code == 201, r.text
        self.token = str(r.json()["token"])

    def node(self) -> dict[str, Any]:
        items = self.admin.get("/api/v1/nodes").json()["items"]
        return dict(items[0]) if items else {}

    def allocations(self) -> list[dict[str, Any]]:
        r = self.admin.get("/api/v1/allocations", params={"tenant": self.tenant})
        return list(r.json()["items"])

    def logs(self) -> str:
        return "\n".join(
            (self.root / f).read_text()[-6000:]
            for f in ("server.log", "agent.log")
            if (self.root / f).exists()
        )

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    root = Path("/var/tmp") / f"cpool-sdk-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    c = Cluster(root)
    try:
        c.start()
        yield c
    finally:
        c.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pool(cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pool]:
    """The caller: a project dir as the working dir, with a helper module of its own imported."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "shiphelp.py").write_text("def scale(x):\n    return x * 11\n")
    monkeypatch.chdir(project)
    monkeypatch.syspath_prepend(str(project))
    sys.modules.pop("shiphelp", None)
    with Pool(server=cluster.url, token=cluster.token) as p:
        yield p
    sys.modules.pop("shiphelp", None)


def test_the_node_reports_its_pythons(cluster: Cluster) -> None:
    assert "3.11" in cluster.node()["pythons"]


def test_remote_returns_the_value_and_print_streams(pool: Pool, capsys: pytest.CaptureFixture[str]) -> None:
    @pool.function(cpus=0.1, name="hello")
    def hello(x: int) -> dict[str, Any]:
        import pwd

        print(f"hello {x} from the pool", flush=True)
        return {"twice": 2 * x, "user": pwd.getpwuid(os.getuid()).pw_name, "python": sys.version_info[:2]}

    out = hello.remote(21)
    assert out["twice"] == 42 and out["user"].startswith("cpool-sdk") and tuple(out["python"]) == (3, 11)
    assert "hello 21 from the pool" in capsys.readouterr().out

    @pool.function(cpus=0.1, name="slowprint")
    def slow() -> str:
        print("first line, early", flush=True)
        time.sleep(4)
        return "end"

    h = slow.spawn()
    deadline = time.monotonic() + 120
    while "first line, early" not in capsys.readouterr().out:
        assert not h.ended, "the output came only with the result"
        assert time.monotonic() < deadline, "no output streamed"
        slow.poll([h], 0.5)
    assert h.result(timeout=120) == "end"


def test_stderr_reaches_the_callers_stderr_only(pool: Pool, capsys: pytest.CaptureFixture[str]) -> None:
    @pool.function(cpus=0.1, name="twostreams")
    def two() -> int:
        print("to stdout", flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        sys.stderr.write("more on stderr\n")
        return 1

    assert two.remote() == 1
    out = capsys.readouterr()
    assert "to stdout" in out.out and "stderr" not in out.out
    assert "to stderr\nmore on stderr\n" in out.err and "to stdout" not in out.err


def test_a_remote_exception_is_raised_as_itself_with_the_remote_traceback(pool: Pool) -> None:
    @pool.function(cpus=0.1, name="fails")
    def fails(n: int) -> None:
        raise ValueError(f"bad input {n}")

    with pytest.raises(ValueError, match="bad input 7") as info:
        fails.remote(7)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert cause.text.rstrip().endswith("ValueError: bad input 7")
    # the frame of code that went by value names the caller's file and line, with its source
    assert f'File "{__file__}"' in cause.text and 'raise ValueError(f"bad input {n}")' in cause.text


def test_spawn_result_timeout_and_cancel(pool: Pool, cluster: Cluster) -> None:
    @pool.function(cpus=0.1, name="sleeper")
    def sleeper(s: float) -> float:
        print("started", flush=True)  # (the results long-poll answers for output: the state shows)
        time.sleep(s)
        return s

    h = sleeper.spawn(600)
    with pytest.raises(TimeoutError):
        h.result(timeout=1)
    wait_for("the call running", lambda: sleeper.poll([h], 1) or h.state == "running", 120, cluster.logs)
    workers = [a for a in cluster.allocations() if a.get("name", "").startswith("fn-sleeper")]
    h.cancel()
    with pytest.raises(CallCancelled):
        h.result(timeout=60)
    ended = ("released", "failed", "cancelled")
    wait_for("its worker ended", lambda: all(
        a["state"] in ended for a in cluster.allocations() if a["id"] in {w["id"] for w in workers}
    ), 60, cluster.logs)  # fmt: skip
    assert sleeper.spawn(0.1).result(timeout=120) == 0.1


CALLER = """
import signal, sys, time
from computepool import Pool

# Ctrl-C as at a terminal, even where this test runs in the background (a shell's `cmd &` starts
# its children with SIGINT ignored, and Python keeps an ignored SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)

pool = Pool(server=sys.argv[1], token=sys.argv[2])

@pool.function(cpus=0.1, name="ctrlc")
def long():
    print("running on the pool", flush=True)
    time.sleep(300)

long.remote()
"""


def test_ctrl_c_on_the_caller_cancels_its_call(cluster: Cluster, tmp_path: Path) -> None:
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    proc = subprocess.Popen(
        [sys.executable, str(script), cluster.url, cluster.token],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env(), cwd=tmp_path, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the remote print, streamed: the call runs
        assert "running on the pool" in line, line + proc.stdout.read()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) != 0
    finally:
        stop(proc)
    ended = ("released", "failed", "cancelled")
    workers = lambda: [a for a in cluster.allocations() if a.get("name", "").startswith("fn-ctrlc")]  # noqa: E731
    wait_for("the worker cancelled", lambda: workers() and all(a["state"] in ended for a in workers()),
             60, cluster.logs)  # fmt: skip


def test_map_is_ordered_and_a_failing_item_raises_when_reached(pool: Pool) -> None:
    @pool.function(cpus=0.1, keep_warm=10, max_workers=3, name="inverse")
    def inverse(x: int) -> float:
        return 1 / (x - 3)

    got = list(inverse.map(range(7), return_exceptions=True))
    assert [g for i, g in enumerate(got) if i != 3] == [1 / (x - 3) for x in range(7) if x != 3]
    assert isinstance(got[3], ZeroDivisionError)
    seen = []
    with pytest.raises(ZeroDivisionError):
        for value in inverse.map(range(7)):
            seen.append(value)
    assert seen == [1 / (x - 3) for x in range(3)]


def test_results_that_cannot_come_back_fail_the_call_naming_why(pool: Pool) -> None:
    @pool.function(cpus=0.1, keep_warm=5, name="unsendable")
    def unsendable(kind: str) -> object:
        import threading

        return threading.Lock() if kind == "lock" else b"x" * (65 << 20)

    with pytest.raises(TypeError, match="_thread.lock.*could not be pickled"):
        unsendable.remote("lock")
    with pytest.raises(RuntimeError, match="could not be handed to the control plane: HTTP 4"):
        unsendable.remote("huge")  # over the pool's cap on a result


def test_a_worker_that_dies_fails_its_call_with_the_pools_reason(pool: Pool) -> None:
    @pool.function(cpus=0.1, name="dies")
    def dies() -> None:
        import signal as sig

        os.kill(os.getpid(), sig.SIGKILL)

    with pytest.raises(RemoteError, match="worker ended"):
        dies.spawn().result(timeout=120)


def test_a_map_comes_back_in_order_and_a_dying_worker_fails_only_the_batch_it_held(pool: Pool) -> None:
    @pool.function(cpus=0.1, keep_warm=10, max_workers=2, name="batched")
    def where(x: int) -> tuple[int, int]:
        import signal as sig

        if x == 150:  # the worker running it dies, with the calls it claimed alongside
            os.kill(os.getpid(), sig.SIGKILL)
        return x, os.getpid()

    got = list(where.map(range(300), return_exceptions=True))
    failed = [i for i, g in enumerate(got) if isinstance(g, BaseException)]
    assert 150 in failed and all(abs(i - 150) < 32 for i in failed), failed  # one batch at most
    assert all(isinstance(got[i], RemoteError) and "worker ended" in str(got[i]) for i in failed)
    assert [g[0] for i, g in enumerate(got) if i not in failed] == [i for i in range(300) if i not in failed]


def test_a_local_helper_module_ships_and_imports_remotely(pool: Pool) -> None:
    import shiphelp  # type: ignore[import-not-found]  # the project's own module (see the fixture)

    @pool.function(cpus=0.1, name="usehelper")
    def use(x: int) -> tuple[int, str]:
        return shiphelp.scale(x), os.path.basename(shiphelp.__file__)

    assert use.remote(3) == (33, "shiphelp.py")


def test_pip_environment_is_built_once_and_reused(pool: Pool, cluster: Cluster) -> None:
    @pool.function(cpus=0.1, pip=["six"], name="pipone")
    def first() -> tuple[str, str]:
        import six  # type: ignore[import-untyped]

        return six.__version__, sys.prefix

    @pool.function(cpus=0.1, pip=["six"], name="piptwo")
    def second() -> str:
        import six  # type: ignore[import-untyped]

        return sys.prefix if six.PY3 else ""  # (no `assert` here: pytest rewrites those)

    version, prefix = first.remote()
    assert version and prefix.startswith(str(cluster.cache / cluster.tenant / "envs"))
    built = os.stat(prefix)
    assert second.remote() == prefix
    assert os.stat(prefix).st_ino == built.st_ino and os.stat(prefix).st_mtime == built.st_mtime
    envs = [p for p in (cluster.cache / cluster.tenant / "envs").iterdir() if p.is_dir()]
    assert envs == [Path(prefix)]
    assert os.stat(cluster.cache / cluster.tenant).st_mode & 0o777 == 0o700


def test_a_failed_pip_build_fails_the_call_with_pips_words(pool: Pool) -> None:
    @pool.function(cpus=0.1, pip=["cpool-no-such-package-xyz==1.0"], name="badpip")
    def never() -> int:
        return 1

    with pytest.raises(RuntimeError, match=r"pip install cpool-no-such-package-xyz==1\.0 failed") as info:
        never.remote()
    assert "No matching distribution" in str(info.value) or "Could not find" in str(info.value)


def test_keep_warm_reuses_one_worker_then_releases_its_slice(pool: Pool, cluster: Cluster) -> None:
    @pool.function(cpus=0.1, keep_warm=3, name="warmpid")
    def pid() -> int:
        return os.getpid()

    pids = {pid.remote() for _ in range(4)}
    assert len(pids) == 1
    fid = pid.register()
    assert pool.client.request("GET", f"/functions/{fid}")["workers_live"] == 1
    wait_for(
        "the idle worker to end",
        lambda: pool.client.request("GET", f"/functions/{fid}")["workers_live"] == 0,
        60,
        cluster.logs,
    )
    workers = [a for a in cluster.allocations() if (a.get("name") or "").startswith("fn-warmpid")]
    assert len(workers) == 1 and workers[0]["state"] in ("released", "failed"), workers


def test_a_python_no_node_has_is_refused_naming_both(
    pool: Pool, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = len(cluster.allocations())
    # the one seam: the caller claims another Python; the refusal is the real server's
    monkeypatch.setattr(sdk_pool, "python_version", lambda: "3.99")

    @pool.function(cpus=0.1, name="newpython")
    def f() -> int:
        return 1

    with pytest.raises(IncompatiblePython, match=r"3\.99.*3\.11"):
        f.remote()
    assert len(cluster.allocations()) == before


def test_a_function_runs_in_a_container_image(pool: Pool, cluster: Cluster, image: str) -> None:
    publish_image(cluster.admin, image)

    @pool.function(cpus=0.1, image=image, name="incontainer")
    def inside() -> tuple[str, bool, int]:
        cache = os.environ["CPOOL_CACHE_DIR"]
        with open(os.path.join(cache, "from-container"), "w") as f:
            f.write("x")
        return os.getcwd(), os.path.exists("/run/.containerenv"), os.getuid()

    cwd, in_container, uid = inside.remote()
    assert cwd == "/work" and in_container and uid != 0
    assert (cluster.cache / cluster.tenant / "from-container").exists()  # the same cache, mounted


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[Cluster]:
    root = Path("/var/tmp") / f"cpool-sdk-tls-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    c = Cluster(root, tls=True)
    try:
        c.start()
        yield c
    finally:
        c.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_worker_reaches_an_https_control_plane_with_the_agents_ca(
    tls_cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert (tls_cluster.agent_dir / "server-ca.pem").exists()  # pinned at the join, no --ca
    with Pool(server=tls_cluster.url, token=tls_cluster.token, ca=str(tls_cluster.cert)) as pool:

        @pool.function(cpus=0.1, name="overtls")
        def where() -> tuple[str, str]:
            return os.environ["CPOOL_SERVER"], open(os.environ["CPOOL_CA"]).read()

        server, ca = where.remote()
    assert server == tls_cluster.url and tls_cluster.cert is not None
    assert ca == tls_cluster.cert.read_text()
