"""The podman side of container jobs, against real rootful podman and the real test image.

Each test runs the argv `Podman.run_argv` builds, as the executor does, and checks from inside
the container what the job can see and do. The image is built (once per machine, then cached) by
scripts/build-test-image.sh.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent import cgroups
from computepool.agent.container import ContainerError, Podman
from computepool.agent.devfiles import mig_cap_nodes
from computepool.agent.executor import JobSpec

IMAGE = "localhost/pybase:1"
UID = 61990  # any uid: the container needs no passwd entry for it


@pytest.fixture
def podman(tmp_path: Path, image: str) -> Iterator[Podman]:
    p = Podman(tmp_path / "agent", node_name="test-node")
    yield p
    for key in p.all_keys():
        p.remove(key)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    d = tmp_path / "run" / "work"
    d.mkdir(parents=True)
    os.chown(d, UID, UID)
    d.chmod(0o700)
    return d


def spec(command: list[str], *, attempt: int = 1, **kw: object) -> JobSpec:
    return JobSpec("a7", attempt, command, tenant="acme", image=IMAGE, **kw)  # type: ignore[arg-type]


def run(podman: Podman, s: JobSpec, work: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    argv = podman.run_argv(s, work, UID, UID)
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env={}, check=False, cwd=work
    )


def py(code: str) -> list[str]:
    return ["python3", "-c", code]


def test_job_runs_as_tenant_uid_without_privileges_in_its_workdir(podman: Podman, work: Path) -> None:
    code = (
        "import os\n"
        "print(os.getuid(), os.getgid(), os.getgroups(), os.getcwd())\n"
        "lines = open('/proc/self/status').read().splitlines()\n"
        "st = dict(l.split(':\\t', 1) for l in lines if ':\\t' in l)\n"
        "print(st['CapEff'], st['CapBnd'], st['NoNewPrivs'])\n"
        "open('/work/out.txt', 'w').write('hello')\n"
    )
    done = run(podman, spec(py(code)), work)
    assert done.returncode == 0, done.stderr
    ids, caps = done.stdout.splitlines()
    assert ids in (f"{UID} {UID} [] /work", f"{UID} {UID} [{UID}] /work")  # no group but its own
    assert caps == "0000000000000000 0000000000000000 1"
    assert (work / "out.txt").read_text() == "hello"
    assert (work / "out.txt").stat().st_uid == UID


def test_only_the_job_dir_comes_from_the_host(podman: Podman, work: Path, tmp_path: Path) -> None:
    """Every bind mount is the job dir or a file podman made for this container (hosts, hostname…)."""
    (tmp_path / "run" / "secret").write_text("agent's")  # beside the job dir: must stay out of reach
    code = (
        "for line in open('/proc/self/mountinfo'):\n"
        "    f = line.split()\n"
        "    if f[3] != '/': print(f[3], f[4])\n"
    )
    done = run(podman, spec(py(code)), work)
    assert done.returncode == 0, done.stderr
    binds = [line.split() for line in done.stdout.splitlines()]
    assert [w for w in binds if w[1] == "/work"] == [[str(work), "/work"]]
    podman_dirs = ("/var/lib/containers/", "/run/containers/", "/run/libpod/", "/var/run/containers/")
    foreign = [b for b in binds if b[1] != "/work" and not b[0].startswith(podman_dirs)]
    # besides: the init binary podman runs as pid 1, and /proc, /sys, /dev entries it masks
    assert all(b[1] == "/run/podman-init" or b[1].startswith(("/proc", "/sys", "/dev")) for b in foreign), (
        foreign
    )
    assert "secret" not in done.stdout


def test_environment_is_only_the_jobs(podman: Podman, work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPOOL_AGENT_SECRET", "do-not-leak")
    done = run(podman, spec(py("import os; print(sorted(os.environ.items()))"), env={"A": "1"}), work)
    assert done.returncode == 0, done.stderr
    env = dict(eval(done.stdout))  # noqa: S307 - our own repr of a list of pairs
    assert env["A"] == "1" and env["HOME"] == "/work" and env["CPOOL_RUN_DIR"] == "/work"
    assert "CPOOL_AGENT_SECRET" not in env
    assert "CONTAINERS_CONF" not in env


def test_paths_into_the_job_dir_are_rewritten_to_work(podman: Podman, work: Path) -> None:
    """The isolation shim's PYTHONPATH names the host's job dir: inside, it must name /work."""
    shim = work / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import os; os.environ['SHIM_LOADED'] = '1'\n")
    for p in (shim, shim / "sitecustomize.py"):
        os.chown(p, UID, UID)
    env = {"PYTHONPATH": str(shim), "MEM_FILE": f"{work}/mem", "OTHER": "/opt/x"}
    code = (
        "import os; print(*(os.environ.get(k) for k in ('PYTHONPATH', 'MEM_FILE', 'OTHER', 'SHIM_LOADED')))"
    )
    done = run(podman, spec(py(code), env=env), work)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["/work/shim", "/work/mem", "/opt/x", "1"]


def test_no_network_without_ports(podman: Podman, work: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    code = (
        "import socket\n"
        f"for host in ('127.0.0.1', 'deb.debian.org'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {port} if host[0] == '1' else 80), timeout=3)\n"
        "        print(host, 'reached')\n"
        "    except OSError as e:\n"
        "        print(host, 'blocked', type(e).__name__)\n"
        "import os; print(sorted(os.listdir('/sys/class/net')))\n"
    )
    try:
        done = run(podman, spec(py(code)), work)
    finally:
        listener.close()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("127.0.0.1 blocked"), lines
    assert lines[1].startswith("deb.debian.org blocked"), lines
    assert lines[2] == "['lo']"


def test_published_port_reaches_the_container(podman: Podman, work: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import http.server, socketserver\n"
        f"socketserver.TCPServer(('', {port}), http.server.SimpleHTTPRequestHandler).handle_request()\n"
    )
    (work / "hello.txt").write_text("from the container")
    os.chown(work / "hello.txt", UID, UID)
    proc = subprocess.Popen(podman.run_argv(spec(py(code), ports=(port,)), work, UID, UID), env={}, cwd=work)
    try:
        body = b""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not body:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
                    c.sendall(b"GET /hello.txt HTTP/1.0\r\n\r\n")
                    body = c.makefile("rb").read()
            except OSError:
                time.sleep(0.2)
        assert body.endswith(b"from the container"), body[-200:]
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


def test_ports_are_published_on_the_node_address_alone(podman: Podman, work: Path) -> None:
    """The agent publishes on the address the pool knows the node by, never on every interface:
    reachable there, not on another address of the host; a privileged port or an address not yet
    known refuses the job."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    podman.publish_host = "127.0.0.1"
    code = (
        "import socket\n"
        f"srv = socket.create_server(('', {port}))\n"
        "for _ in range(2):\n"
        "    c, _ = srv.accept(); c.sendall(b'hello'); c.close()\n"
    )
    argv = podman.run_argv(spec(py(code), ports=(port,)), work, UID, UID)
    assert f"--publish=127.0.0.1:{port}:{port}" in argv
    proc = subprocess.Popen(argv, env={}, cwd=work)
    try:
        got = b""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not got:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
                    got = c.recv(16)
            except OSError:
                time.sleep(0.2)
        assert got == b"hello"
        with pytest.raises(OSError), socket.create_connection(("127.0.0.2", port), timeout=2) as c:
            if not c.recv(16):
                raise ConnectionResetError("nothing behind it")
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(ContainerError, match="^ports: 81 is a privileged port"):
        podman.run_argv(spec(py("pass"), ports=(81,), attempt=2), work, UID, UID)
    podman.publish_host = None
    with pytest.raises(ContainerError, match="not told this node its address"):
        podman.run_argv(spec(py("pass"), ports=(port,), attempt=3), work, UID, UID)
    podman.publish_host = "::1"
    argv = podman.run_argv(spec(py("pass"), ports=(port,), attempt=4), work, UID, UID)
    assert f"--publish=[::1]:{port}:{port}" in argv


def test_cpu_limit_is_visible_inside(podman: Podman, work: Path) -> None:
    code = (
        "import os\n"
        "if os.path.exists('/sys/fs/cgroup/cpu.max'): print(open('/sys/fs/cgroup/cpu.max').read().split())\n"
        "else: print([open(f'/sys/fs/cgroup/cpu/cpu.cfs_{n}_us').read() for n in ('quota', 'period')])\n"
    )
    done = run(podman, spec(py(code), cpu_milli=500), work)
    assert done.returncode == 0, done.stderr
    quota, period = (int(x) for x in eval(done.stdout))  # noqa: S307
    assert quota * 1000 // period == 500


def test_memory_limit_kills_and_is_reported(podman: Podman, work: Path) -> None:
    hog = spec(py("x = bytearray(400 * 1024 * 1024); print('survived')"), memory_mib=96)
    done = run(podman, hog, work)
    assert "survived" not in done.stdout
    assert done.returncode == 137
    assert podman.out_of_memory(hog.key, done.returncode)
    podman.remove(hog.key)

    fits = spec(py("x = bytearray(16 * 1024 * 1024); print('fine')"), memory_mib=96, attempt=2)
    done = run(podman, fits, work)
    assert (done.returncode, done.stdout.strip()) == (0, "fine"), done.stderr
    assert not podman.out_of_memory(fits.key, done.returncode)


def test_one_tenants_containers_together_stop_at_its_share_of_the_nodes_pids(
    tmp_path: Path, image: str
) -> None:
    """A tenant's container stops at its tenant's share (30), far below its own limit; while it holds
    that, another tenant's container still starts 20 threads."""
    podman = Podman(tmp_path / "agent", node_name="test-node", tenant_pids=30)
    fill = (
        "import threading, time, sys\nheld = []\n"
        "try:\n    while len(held) < 500:\n"
        "        t = threading.Thread(target=time.sleep, args=(60,), daemon=True)\n"
        "        t.start(); held.append(t)\n"
        "except RuntimeError:\n    pass\n"
        "open(sys.argv[1], 'w').write(str(len(held)))\ntime.sleep(60)\n"
    )
    twenty = (
        "import threading, time\nts = [threading.Thread(target=time.sleep, args=(0.2,)) for _ in range(20)]\n"
    )
    twenty += "[t.start() for t in ts]\n[t.join() for t in ts]\nprint('ok')"
    procs = []
    try:
        d = tmp_path / "run1" / "work"
        d.mkdir(parents=True)
        os.chown(d, UID, UID)
        s = spec(["python3", "-c", fill, "/work/held"], attempt=1, memory_mib=256)
        argv = podman.run_argv(s, d, UID, UID)
        assert any(a.startswith("--cgroup-parent=/computepool-containers/") for a in argv), argv
        procs.append(subprocess.Popen(argv, env={}, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        deadline = time.monotonic() + 120
        while not ((d / "held").exists() and (d / "held").read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert 0 < int((d / "held").read_text()) < 30  # its own --pids-limit is 4096
        other = JobSpec("b7", 1, ["python3", "-c", twenty], tenant="beta", image=IMAGE, memory_mib=256)
        d2 = tmp_path / "run2" / "work"
        d2.mkdir(parents=True)
        os.chown(d2, UID + 1, UID + 1)
        argv = podman.run_argv(other, d2, UID + 1, UID + 1)
        done = subprocess.run(argv, env={}, cwd=d2, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    finally:
        for key in podman.all_keys():
            podman.remove(key)
        for p in procs:
            p.kill()
            p.wait()
    assert not list(Path("/sys/fs/cgroup").glob(f"*/computepool-containers/*/{podman.name('a7#1')}"))


def test_a_tenants_containers_and_process_jobs_share_one_cap_within_the_agents_budget(
    tmp_path: Path, image: str
) -> None:
    """Beside the agent's job cgroups a container's parent is in its tenant's directory there: what
    a process job of the tenant holds of its 30 the tenant's container cannot have (a tree of the
    containers' own gave it 30 more), and the agent's whole budget holds both."""
    base = Path(f"/sys/fs/cgroup/computepool-test-{uuid.uuid4().hex[:8]}")
    jobs = cgroups.detect(base / "node", tenant_pids=30)
    if not isinstance(jobs, cgroups.CgroupV1) or not jobs.usable()[0]:
        pytest.skip("needs a writable cgroup v1 hierarchy (this host's kind)")
    podman = Podman(tmp_path / "agent", node_name="test-node", tenant_pids=30, job_cgroups=jobs)
    hold = (
        "import sys, threading, time\nsys.stdin.readline()\n"
        "ts = [threading.Thread(target=time.sleep, args=(60,), daemon=True) for _ in range(8)]\n"
        "[t.start() for t in ts]\nprint('held', flush=True)\ntime.sleep(60)\n"
    )
    fill = (
        "import threading, time, sys\nheld = []\n"
        "try:\n    while len(held) < 500:\n"
        "        t = threading.Thread(target=time.sleep, args=(60,), daemon=True)\n"
        "        t.start(); held.append(t)\n"
        "except RuntimeError:\n    pass\n"
        "open(sys.argv[1], 'w').write(str(len(held)))\ntime.sleep(60)\n"
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        job = jobs.create("a6.1", 0, 0, group=cgroups.tenant_group("acme"))
        proc = subprocess.Popen(
            ["python3", "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        procs.append(proc)
        for d in job.paths:
            (d / "cgroup.procs").write_text(str(proc.pid))
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == b"held"
        tenant_dir = jobs.root / "pids" / jobs.base_name / cgroups.tenant_group("acme")
        used = int((tenant_dir / "pids.current").read_text())  # the process job's
        assert used >= 9
        d = tmp_path / "run1" / "work"
        d.mkdir(parents=True)
        os.chown(d, UID, UID)
        argv = podman.run_argv(spec(["python3", "-c", fill, "/work/held"], memory_mib=256), d, UID, UID)
        parent = f"--cgroup-parent=/{base.name}/node/{cgroups.tenant_group('acme')}/{podman.name('a7#1')}.ctr"
        assert parent in argv, argv
        procs.append(subprocess.Popen(argv, env={}, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        deadline = time.monotonic() + 120
        while not ((d / "held").exists() and (d / "held").read_text()) and time.monotonic() < deadline:
            assert procs[-1].poll() is None, procs[-1].communicate()[1][-2000:]
            time.sleep(0.1)
        assert 0 < int((d / "held").read_text()) < 30 - used  # the tenant's 30, less the process job's
    finally:
        for key in podman.all_keys():
            podman.remove(key)
        for p in procs:
            p.kill()
            p.wait()
        for c in ("memory", "cpu", "pids", "cpuacct", "blkio", "devices", "freezer", "cpuset", "net_cls"):
            top = Path("/sys/fs/cgroup") / c / base.name
            below = (
                sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
                if top.is_dir()
                else []
            )
            cgroups.remove([*below, top] if top.is_dir() else [])
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{base.name}/node/t-*/{podman.name('a7#1')}.ctr"))


def test_no_job_can_list_the_containers_cgroups(podman: Podman, work: Path) -> None:
    """The containers' parent cgroups (allocation ids, tenants' digests, memory use) are root's."""
    done = run(podman, spec(py("print('hi')"), memory_mib=64, attempt=8), work)
    assert done.returncode == 0, done.stderr
    tops = list(Path("/sys/fs/cgroup").glob("*/computepool-containers")) or [
        Path("/sys/fs/cgroup/computepool-containers")
    ]
    assert tops and all((t.stat().st_mode & 0o777) == 0o700 for t in tops), [
        oct(t.stat().st_mode) for t in tops
    ]
    look = subprocess.run(
        ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "ls", str(tops[0])],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert look.returncode != 0 and "Permission denied" in look.stderr, look


def test_the_writable_layer_holds_what_the_container_wrote_into_its_image(podman: Podman, work: Path) -> None:
    """The disk guard counts it as the job's (a container filling /opt fills the node's disk)."""
    s = spec(py("open('/opt/filled.bin', 'wb').write(b'x' * 4096)"), attempt=7)
    argv = podman.run_argv(s, work, 0, 0)  # uid 0 inside: the image's /opt is root's
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={}, check=False, cwd=work)
    assert done.returncode == 0, done.stderr
    layer = podman.writable_layer(s.key)
    assert layer is not None and (layer / "opt" / "filled.bin").stat().st_size == 4096
    podman.remove(s.key)
    assert podman.writable_layer(s.key) is None


def test_sigterm_reaches_the_job_through_podman(podman: Podman, work: Path) -> None:
    """The executor stops a job by signalling its `podman run`: the workload must get the SIGTERM."""
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('got TERM', flush=True), sys.exit(3)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    s = spec(py(code))
    proc = subprocess.Popen(
        podman.run_argv(s, work, UID, UID), stdout=subprocess.PIPE, text=True, env={}, cwd=work
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 3
        assert "got TERM" in proc.stdout.read()
    finally:
        proc.kill()


def test_running_keys_and_remove(podman: Podman, work: Path, tmp_path: Path) -> None:
    s = spec(["sleep", "300"], memory_mib=64)
    proc = subprocess.Popen(podman.run_argv(s, work, UID, UID), env={}, cwd=work)
    try:
        deadline = time.monotonic() + 30
        while s.key not in podman.running_keys() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert podman.running_keys() == {s.key}
        other = Podman(tmp_path / "other-agent")
        assert other.running_keys() == set()  # another agent's containers are not its own
        cgroup = podman._memory_dir(s.key)
        assert cgroup.is_dir()

        podman.remove(s.key)
        assert proc.wait(timeout=30) != 0
        assert podman.running_keys() == set() and podman.all_keys() == set()
        assert not cgroup.exists()
        podman.remove(s.key)  # idempotent
    finally:
        proc.kill()


def test_ended_container_stays_until_removed(podman: Podman, work: Path) -> None:
    s = spec(["true"])
    assert run(podman, s, work).returncode == 0
    assert podman.running_keys() == set()
    assert podman.all_keys() == {s.key}
    podman.remove(s.key)
    assert podman.all_keys() == set()


def test_exit_code_is_the_commands(podman: Podman, work: Path) -> None:
    assert run(podman, spec(py("raise SystemExit(7)")), work).returncode == 7
    missing = run(podman, spec(["no-such-command"], attempt=2), work)
    assert missing.returncode != 0
    assert "No such file or directory" in missing.stderr


def test_missing_image_fails_fast_with_reason(podman: Podman, work: Path) -> None:
    with pytest.raises(ContainerError) as err:
        podman.run_argv(JobSpec("a7", 1, ["true"], tenant="acme", image="localhost/nope:1"), work, UID, UID)
    msg = str(err.value)
    assert msg.startswith("image localhost/nope:1 not found on node test-node and could not be pulled: ")
    for image in ("--privileged", "a b"):  # an image is never taken for an option of podman
        with pytest.raises(ContainerError, match="not a registry image reference"):
            podman.run_argv(JobSpec("a7", 1, ["true"], tenant="acme", image=image), work, UID, UID)
    no_pull = Podman(podman.data_dir, node_name="test-node", pull=False)
    with pytest.raises(ContainerError, match="not found on node test-node"):
        no_pull.ensure_image("localhost/nope:1")


def test_conf_is_private_and_sets_runtime_and_ulimits(podman: Podman) -> None:
    assert podman.available() == (True, "")
    assert podman.conf_path.stat().st_mode & 0o777 == 0o600
    text = podman.conf_path.read_text()
    assert "nofile=20000:20000" in text and "nproc=32768:32768" in text


def test_devices_only_the_slices(tmp_path: Path) -> None:
    """No device for simulated or CPU slices; CDI names where a CDI spec lists the GPU."""
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    gpu = "GPU-0b1c2d3e-0000-1111-2222-333344445555"
    (cdi / "nvidia.yaml").write_text(
        f"cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: {gpu}\n  containerEdits: {{}}\n"
    )
    p = Podman(tmp_path / "agent", cdi_dirs=(cdi,))
    assert p.device_args(()) == []
    assert p.device_args(("cpu",)) == []
    assert p.device_args((gpu,)) == [f"--device=nvidia.com/gpu={gpu}"]
    # a GPU uuid no CDI spec and no driver knows (a simulated device): nothing is passed
    assert (
        Podman(tmp_path / "agent", cdi_dirs=()).device_args(("GPU-00000000-dead-beef-0000-000000000000",))
        == []
    )


def test_sweep_removes_containers_of_jobs_the_agent_does_not_hold(podman: Podman, work: Path) -> None:
    kept, stray = spec(["sleep", "300"]), spec(["sleep", "300"], attempt=2)
    procs = [subprocess.Popen(podman.run_argv(s, work, UID, UID), env={}, cwd=work) for s in (kept, stray)]
    try:
        deadline = time.monotonic() + 30
        while len(podman.running_keys()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert podman.sweep(keep={kept.key}) == [stray.key]
        assert podman.running_keys() == {kept.key}
    finally:
        podman.remove(kept.key)
        for p in procs:
            p.kill()


def test_mig_instance_capability_nodes(tmp_path: Path) -> None:
    """A MIG instance opens through two capability nodes, named in the driver's proc files."""
    gi = tmp_path / "gpu1" / "mig" / "gi3"
    (gi / "ci0").mkdir(parents=True)
    (gi / "access").write_text("DeviceFileMinor: 30\nDeviceFileMode: 292\n")
    (gi / "ci0" / "access").write_text("DeviceFileMinor: 31\nDeviceFileMode: 292\n")
    assert mig_cap_nodes(1, 3, 0, tmp_path) == [
        "/dev/nvidia-caps/nvidia-cap30",
        "/dev/nvidia-caps/nvidia-cap31",
    ]
    assert mig_cap_nodes(1, 4, 0, tmp_path) == []  # an instance the driver does not list
