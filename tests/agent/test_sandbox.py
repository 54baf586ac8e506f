"""The process sandbox with real Unix users, real namespaces and real child processes (needs root)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from computepool.agent.devices.simulated import SimulatedBackend
from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec, SandboxConfig
from computepool.agent.localstate import JobState
from computepool.agent.tenants import (
    TenantUserError,
    ensure_tenant_user,
    parse_uid_range,
    remove_tenant_user,
    user_name,
)
from computepool.core.errors import InvalidInput

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and namespaces need root")

PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"  # a python every user may run
RANGE = (61000, 61999)


@pytest.fixture
def tenants() -> Iterator[list[str]]:
    """Two fresh tenant names, whose users are removed afterwards."""
    names = [f"t{uuid.uuid4().hex[:8]}", f"t{uuid.uuid4().hex[:8]}"]
    yield names
    for n in names:
        remove_tenant_user(n, RANGE)


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """Outside /tmp, so that what keeps a job out is file modes, not its private /tmp."""
    d = Path("/var/tmp") / f"cpool-sandbox-{uuid.uuid4().hex[:8]}"
    d.mkdir(mode=0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sandboxed(data_dir: Path) -> Iterator[Executor]:
    ex = Executor(
        data_dir / "agent", cgroup_base=None, kill_grace_s=2.0, sandbox=SandboxConfig(uid_range=RANGE)
    )
    yield ex
    for rec in ex.running():
        ex.kill(rec.key, "test teardown", grace_s=0)
    ex.state.close()


def _out(rec_run_dir: str) -> str:
    return (Path(rec_run_dir) / STDOUT_LOG).read_text()


def test_tenant_users_are_made_once_and_kept_apart(tenants: list[str]) -> None:
    a = ensure_tenant_user(tenants[0], RANGE)
    assert a.pw_name == f"cpool-{tenants[0]}" and RANGE[0] <= a.pw_uid <= RANGE[1]
    assert a.pw_gid == a.pw_uid and a.pw_shell == "/usr/sbin/nologin"
    assert ensure_tenant_user(tenants[0], RANGE) == a  # reused, not made again
    b = ensure_tenant_user(tenants[1], RANGE)
    assert b.pw_uid != a.pw_uid and b.pw_gid != a.pw_gid
    with pytest.raises(TenantUserError, match="not the pool's user"):
        ensure_tenant_user(tenants[0], (RANGE[1] + 1, RANGE[1] + 10))  # its uid lies outside that range
    assert remove_tenant_user(tenants[1], RANGE)
    with pytest.raises(KeyError):
        pwd.getpwnam(f"cpool-{tenants[1]}")


def test_a_host_user_with_the_pool_name_is_refused() -> None:
    tenant = "root-clash"
    os.system(f"useradd --system --no-create-home --shell /usr/sbin/nologin cpool-{tenant} 2>/dev/null")
    try:
        with pytest.raises(TenantUserError, match="not the pool's user"):
            ensure_tenant_user(tenant, RANGE)
    finally:
        os.system(f"userdel cpool-{tenant} 2>/dev/null")


def test_user_names_fit_and_ranges_are_checked() -> None:
    assert user_name("team-a") == "cpool-team-a"
    long = user_name("a.very.long.tenant.name.that.does-not-fit")
    assert len(long) <= 32 and long.startswith("cpool-a_very")
    assert user_name("a.b") != user_name("a_b")  # no two tenants share a user
    assert parse_uid_range("61000-61999") == (61000, 61999)
    for bad in ("61999-61000", "x-1", "61000", "10-20"):
        with pytest.raises(InvalidInput, match="uid-range"):
            parse_uid_range(bad)


def test_a_job_runs_as_its_tenant_with_nothing_of_the_agent(
    sandboxed: Executor, tenants: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CPOOL_AGENT_SECRET", "do-not-leak")
    code = (
        "import json, os, sys\n"
        "st = {k.split(':')[0]: k.split(':')[1].strip() for k in open('/proc/self/status') if ':' in k}\n"
        "print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'groups': os.getgroups(),\n"
        "  'env': dict(os.environ), 'cwd': os.getcwd(), 'pid': os.getpid(),\n"
        "  'caps': [st['CapEff'], st['CapPrm'], st['CapBnd'], st['CapAmb']], 'nnp': st['NoNewPrivs'],\n"
        "  'procs': sorted(int(p) for p in os.listdir('/proc') if p.isdigit()),\n"
        "  'tmp': os.listdir('/tmp'), 'agent_dir': os.listdir(sys.argv[1])}))\n"
    )
    argv = [PY, "-c", code, str(sandboxed.data_dir)]
    rec = sandboxed.start(JobSpec("who", 1, argv, env={"SLICE_VAR": "v"}, tenant=tenants[0]))
    done = sandboxed.wait(rec.key, 20)
    assert done.state is JobState.SUCCEEDED, (done.reason, _out(done.run_dir))
    seen = json.loads(_out(done.run_dir))
    user = pwd.getpwnam(f"cpool-{tenants[0]}")
    work = Path(done.run_dir) / "work"
    assert (seen["uid"], seen["gid"], seen["groups"]) == (user.pw_uid, user.pw_gid, [])
    assert seen["caps"] == ["0000000000000000"] * 4 and seen["nnp"] == "1"
    assert seen["env"]["SLICE_VAR"] == "v" and "CPOOL_AGENT_SECRET" not in seen["env"]
    assert seen["env"]["HOME"] == seen["env"]["CPOOL_RUN_DIR"] == seen["cwd"] == str(work)
    assert seen["env"]["USER"] == user.pw_name and seen["env"]["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert set(seen["env"]) <= {"PATH", "LANG", "SLICE_VAR", "HOME", "USER", "LOGNAME", "CPOOL_RUN_DIR",
                                "TMPDIR", "PWD", "LC_CTYPE"}  # fmt: skip
    # its own PID namespace: only its processes (the init's few steps before it took the first pids)
    assert seen["pid"] < 32 and max(seen["procs"]) < 32
    assert seen["tmp"] == []  # a private /tmp
    assert seen["agent_dir"] == ["runs"]  # the agent's files are hidden: only the way to its own dir
    assert "own PID, mount, IPC and UTS namespaces" in done.limits and f"user {user.pw_name}" in done.limits
    assert "seccomp: no user namespaces" in done.limits  # syscall_filter.py: the attacks test it
    # the layout: the job's dir is its own; the agent's files around it are root's
    assert (work.stat().st_uid, stat.S_IMODE(work.stat().st_mode)) == (user.pw_uid, 0o700)
    for p in (Path(done.run_dir), Path(done.run_dir).parent, Path(done.run_dir).parent.parent):
        assert (p.stat().st_uid, stat.S_IMODE(p.stat().st_mode)) == (0, 0o711)
    for name in ("exit_code", "stdout.log", "stderr.log"):
        f = Path(done.run_dir) / name
        assert (f.stat().st_uid, stat.S_IMODE(f.stat().st_mode)) == (0, 0o600), name
    assert stat.S_IMODE(sandboxed.data_dir.stat().st_mode) == 0o711
    assert stat.S_IMODE(sandboxed.state.path.stat().st_mode) == 0o600


def test_a_job_cannot_reach_another_tenants_job_or_the_agent(sandboxed: Executor, tenants: list[str]) -> None:
    """uid separation alone (no namespaces): B's files, environ, signals all refused to A."""
    plain = Executor(
        sandboxed.data_dir, sandboxed.state, cgroup_base=None,
        sandbox=SandboxConfig(uid_range=RANGE, namespaces=False),
    )  # fmt: skip
    victim = plain.start(
        JobSpec(
            "b",
            1,
            [PY, "-c", "import time; open('secret', 'w').write('b'); time.sleep(60)"],
            env={"B_SECRET": "hush"},
            tenant=tenants[1],
        )  # fmt: skip
    )
    b_work = Path(victim.run_dir) / "work"
    deadline = time.monotonic() + 10
    while not (b_work / "secret").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    b_pid = max(plain.job_pids(victim.key))
    targets = {
        "b_work": str(b_work / "secret"),
        "b_log": str(Path(victim.run_dir) / "stdout.log"),
        "b_environ": f"/proc/{b_pid}/environ",
        "state_db": str(plain.state.path),
    }
    code = (
        "import json, os, signal, sys\n"
        "targets, b_pid, agent_pid = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])\n"
        "out = {}\n"
        "for name, path in targets.items():\n"
        "    try:\n"
        "        open(path, 'rb').read(); out[name] = 'read'\n"
        "    except OSError as e:\n"
        "        out[name] = type(e).__name__\n"
        "for name, pid in (('kill_b', b_pid), ('kill_agent', agent_pid)):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGTERM); out[name] = 'sent'\n"
        "    except OSError as e:\n"
        "        out[name] = type(e).__name__\n"
        "try:\n"
        "    os.listdir(os.path.dirname(targets['b_work'])); out['list_b'] = 'listed'\n"
        "except OSError as e:\n"
        "    out['list_b'] = type(e).__name__\n"
        "print(json.dumps(out))\n"
    )
    argv = [PY, "-c", code, json.dumps(targets), str(b_pid), str(os.getpid())]
    attacker = plain.start(JobSpec("a", 1, argv, tenant=tenants[0]))
    done = plain.wait(attacker.key, 20)
    assert done.state is JobState.SUCCEEDED, (done.reason, (Path(done.run_dir) / "stderr.log").read_text())
    outcome = json.loads(_out(done.run_dir))
    assert outcome == {
        "b_work": "PermissionError", "b_log": "PermissionError", "b_environ": "PermissionError",
        "state_db": "PermissionError", "kill_b": "PermissionError", "kill_agent": "PermissionError",
        "list_b": "PermissionError",
    }  # fmt: skip
    assert plain.get(victim.key).state is JobState.RUNNING  # type: ignore[union-attr]
    assert "no namespaces: namespaces turned off" in done.limits
    plain.kill(victim.key, "done", grace_s=0)


def test_sandboxed_jobs_stop_gracefully_and_leave_nothing(sandboxed: Executor, tenants: list[str]) -> None:
    """The job is not PID 1 of its namespace, so SIGTERM reaches it; its leftovers die with it."""
    code = (
        "import signal, subprocess, sys, time\n"
        "subprocess.Popen(['sleep', '60'])\n"
        "signal.signal(signal.SIGTERM, lambda *_: (print('saved', flush=True), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    rec = sandboxed.start(JobSpec("graceful", 1, [PY, "-c", code], tenant=tenants[0]))
    deadline = time.monotonic() + 10
    while "ready" not in _out(rec.run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    members = sandboxed.job_pids(rec.key)
    assert len(members) >= 4  # wrapper, unshare, namespace init, the job and its sleep
    done = sandboxed.kill(rec.key, "drain", grace_s=5)
    assert (done.state, done.exit_code, done.reason) == (JobState.KILLED, 0, "drain")
    assert _out(done.run_dir).split() == ["ready", "saved"]
    time.sleep(0.2)
    assert not [p for p in members if Path(f"/proc/{p}").exists() and "Z" not in _state(p)]
    plain_sleep = sandboxed.start(JobSpec("plain", 1, ["sleep", "60"], tenant=tenants[0]))
    done = sandboxed.kill(plain_sleep.key, "stop", grace_s=5)
    assert done.exit_code is not None and done.exit_code != 0 and done.state is JobState.KILLED


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_exit_codes_missing_commands_and_no_tenant(sandboxed: Executor, tenants: list[str]) -> None:
    rec = sandboxed.start(JobSpec("rc", 1, ["sh", "-c", "exit 7"], tenant=tenants[0]))
    assert sandboxed.wait(rec.key, 10).reason == "exit code 7"
    nf = sandboxed.start(JobSpec("nf", 1, ["no-such-command-xyz"], tenant=tenants[0]))
    nf = sandboxed.wait(nf.key, 10)  # looked up as the tenant, in the sandbox: never by root
    missing = "command not found: no-such-command-xyz"
    assert (nf.state, nf.exit_code, nf.reason) == (JobState.FAILED, 127, missing)
    anon = sandboxed.start(JobSpec("anon", 1, ["true"]))
    assert (anon.state, anon.reason) == (
        JobState.FAILED,
        "no tenant: a sandboxed job runs as its tenant's user",
    )


def test_a_job_under_tmp_keeps_its_dir_behind_the_private_tmp(tmp_path: Path, tenants: list[str]) -> None:
    os.chmod(tmp_path, 0o755)
    ex = Executor(tmp_path / "agent", cgroup_base=None, sandbox=SandboxConfig(uid_range=RANGE))
    try:
        rec = ex.start(JobSpec("tmpjob", 1, ["sh", "-c", 'echo hi > "$HOME/f"; cat "$HOME/f"; ls /tmp'],
                               tenant=tenants[0]))  # fmt: skip
        done = ex.wait(rec.key, 10)
        assert done.state is JobState.SUCCEEDED, done.reason
        assert _out(done.run_dir).split() == ["hi", tmp_path.parts[2]]  # only the way to its own dir
    finally:
        ex.state.close()


def test_an_agent_that_is_not_root_serves_one_tenant_unless_single_tenant(data_dir: Path) -> None:
    """What a non-root agent does with a second tenant (the host's probe says "not root")."""
    for single, expect in ((False, JobState.FAILED), (True, JobState.SUCCEEDED)):
        ex = Executor(data_dir / f"agent-{single}", cgroup_base=None,
                      sandbox=SandboxConfig(single_tenant=single, namespaces=False))  # fmt: skip
        assert ex.launcher.host is not None
        ex.launcher.host = replace(ex.launcher.host, root=False)
        first = ex.start(JobSpec("one", 1, ["true"], tenant="acme"))
        assert ex.wait(first.key, 10).state is JobState.SUCCEEDED
        again = ex.start(JobSpec("two", 1, ["true"], tenant="acme"))
        assert ex.wait(again.key, 10).state is JobState.SUCCEEDED  # the same tenant: fine
        other = ex.wait(ex.start(JobSpec("three", 1, ["true"], tenant="globex")).key, 10)
        assert other.state is expect, other.reason
        if not single:
            assert other.reason.startswith("refused: this agent is not root and already runs tenant 'acme'")
            assert "--single-tenant" in other.reason
        ex.state.close()


def test_a_directory_the_slice_needs_stays_reachable_behind_the_hidden_data_dir(
    sandboxed: Executor, tenants: list[str]
) -> None:
    """An mps slice's pipe dir lives in the agent's data dir: the job keeps it, and only it."""
    pipes = sandboxed.data_dir / "mps" / "GPU-x" / "pipe"
    pipes.mkdir(parents=True)
    for d in (sandboxed.data_dir / "mps", pipes.parent, pipes):
        os.chmod(d, 0o755)
    (pipes / "control").write_text("")
    code = 'ls "$CUDA_MPS_PIPE_DIRECTORY"; ls "$1"'
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipes)}
    rec = sandboxed.start(
        JobSpec("mpsdir", 1, ["sh", "-c", code, "sh", str(sandboxed.data_dir)], env=env, tenant=tenants[0])
    )
    done = sandboxed.wait(rec.key, 10)
    assert done.state is JobState.SUCCEEDED, (done.reason, (Path(done.run_dir) / "stderr.log").read_text())
    assert _out(done.run_dir).split() == ["control", "mps", "runs"]  # no node.json, no state db
    assert "(the host's IPC: MPS)" in done.limits  # its MPS server's IPC namespace


def test_a_memory_file_made_a_fifo_or_a_link_cannot_stall_or_feed_the_agent(tmp_path: Path) -> None:
    """The simulated driver reads a file the job writes: a FIFO must not block it, a link not lead it."""
    backend = SimulatedBackend("1xA100-80GB", seed="fifo")
    fifo, link, good = tmp_path / "fifo", tmp_path / "link", tmp_path / "good"
    os.mkfifo(fifo)
    secret = tmp_path / "secret"
    secret.write_text("31337")
    link.symlink_to(secret)
    good.write_text("2048")
    results = {}
    for name, path in (("fifo", fifo), ("link", link), ("good", good)):
        backend.attach(os.getpid(), 0, 4096, 500, memory_file=path)
        # a read that blocked on the FIFO would never return: the deadline is far past any real read
        reader = threading.Thread(
            target=lambda n=name: results.update({n: backend.usage()[0].memory_used_mib})
        )
        reader.start()
        reader.join(60)
        assert not reader.is_alive(), f"reading the {name} blocked"
        backend.detach(os.getpid())
    assert results == {"fifo": 4096, "link": 4096, "good": 2048}


def test_a_command_the_tenant_could_not_reach_is_not_run(sandboxed: Executor, tenants: list[str]) -> None:
    """The command is looked up with the tenant's rights: a program in a root-only dir stays out."""
    hidden = Path("/var/cache") / f"cpool-root-only-{uuid.uuid4().hex[:8]}"  # the job has its own /var/tmp
    hidden.mkdir(mode=0o700)
    try:
        shutil.copy("/bin/true", hidden / "tool")
        rec = sandboxed.start(JobSpec("hidden", 1, [str(hidden / "tool")], tenant=tenants[0]))
        done = sandboxed.wait(rec.key, 10)
        assert (done.state, done.exit_code) == (JobState.FAILED, 126), done.reason
        assert "Permission denied" in (Path(done.run_dir) / "stderr.log").read_text()
    finally:
        shutil.rmtree(hidden, ignore_errors=True)


def test_jobs_start_while_the_node_adds_and_removes_users(sandboxed: Executor, tenants: list[str]) -> None:
    """useradd and groupadd (the agent's own, for a new tenant's first job) replace /etc/passwd and
    /etc/group by rename: a job whose sandbox bound its filtered copy over the old file at that
    instant failed to start (exit 126, ENOENT). 120 jobs start while groups come and go."""
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            name = f"zc{uuid.uuid4().hex[:8]}"
            subprocess.run(["groupadd", name], capture_output=True, check=False)
            subprocess.run(["groupdel", name], capture_output=True, check=False)

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        started = [sandboxed.start(JobSpec(f"c{n}", 1, ["/bin/true"], tenant=tenants[0])) for n in range(120)]
        ended = [sandboxed.wait(r.key, 120) for r in started]
    finally:
        stop.set()
        churner.join()
    failed = [
        (e.reason, Path(e.run_dir, "stderr.log").read_text()[-200:])
        for e in ended
        if e.state is not JobState.SUCCEEDED
    ]
    assert failed == [], failed[:3]


def test_a_sandbox_that_cannot_be_set_up_is_reported_as_such_not_as_the_commands_exit(
    tmp_path: Path,
) -> None:
    """The init's own failures exit 126, as a command that cannot be executed does: its line on the
    job's stderr tells them apart, so the reason names the step, not "not executable by user"."""
    from computepool.agent import sandbox
    from computepool.agent.localstate import JobRecord
    from computepool.agent.outcome import explain_exit

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    init = ["sh", "-c", sandbox._NS_INIT, "cpool-init", str(tmp_path / "gone"), *[""] * 9, "true"]
    with open(run_dir / "stderr.log", "wb") as err:
        rc = subprocess.run(init, stderr=err, check=False).returncode
    assert rc == 126
    rec = JobRecord("a1", 1, ["/opt/x/train"], str(run_dir), extra={"user": "cpool-t1"})
    assert explain_exit(rec, rc) == (
        "exit code 126: the node could not set up the job's sandbox: open the job directory"
    )
    (run_dir / "stderr.log").write_text("sh: 1: /opt/x/train: Permission denied\n")  # the command's own
    assert explain_exit(rec, rc) == "exit code 126: /opt/x/train is not executable by user cpool-t1"
