"""Container jobs on a GPU: the agent's real executor path (Executor + sandbox + Podman) runs a probe
in a container and the check reads what the container saw.

The image must work offline. On a GPU machine it is built on the spot from the host: the Python
interpreter and its standard library (no site-packages), the NVIDIA driver's user-space libraries
(`libcuda.so.1`, `libnvidia-ml.so.1`) and `nvidia-smi`, each with the shared libraries `ldd`
lists, plus `/etc/ld.so.cache` — a few tens of MB, imported with `podman import` in seconds. The
probe talks to the driver through `ctypes` (no PyTorch inside), so it needs nothing else. With
`--dry-run` (no GPU) the project's test image `localhost/pybase:1` is used instead.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_check_common import last_json, record, tail

from computepool.agent.container import Podman
from computepool.agent.devices import DeviceInfo
from computepool.agent.executor import STDERR_LOG, STDOUT_LOG, Executor, JobSpec
from computepool.agent.isolation import SliceAssignment, slice_env
from computepool.agent.localstate import JobRecord, JobState
from computepool.agent.sandbox import SandboxConfig
from computepool.agent.tenants import user_name
from computepool.core import Isolation

TENANT = "gpucheck"
HOST_IMAGE = "localhost/cpool-gpucheck:1"
TEST_IMAGE = "localhost/pybase:1"
CPU_MILLI = 1500
MEMORY_MIB = 2048  # a CUDA context holds a few hundred MiB of host memory
HOG_LIMIT_MIB = 256
IMAGE_BUDGET_S = 60
_ROOT = Path(__file__).resolve().parents[1]
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_LDD_PATH = re.compile(r"(/\S+)")
_SKIP_STDLIB: tuple[str, ...] = ("site-packages", "dist-packages", "test", "tests", "__pycache__")
_SKIP_STDLIB += ("idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "config-3*")

# Runs inside the container as `python3 -I -c PROBE [LIBCUDA]`: what the job can see, as JSON.
PROBE = r"""
import ctypes, json, os, shutil, subprocess, sys
def rd(p):
    try:
        return open(p).read().strip()
    except OSError:
        return None
st = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
out = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "cwd": os.getcwd(),
       "cap_eff": st.get("CapEff", "").strip(), "no_new_privs": st.get("NoNewPrivs", "").strip(),
       "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"), "isolation": os.environ.get("CPOOL_ISOLATION"),
       "dev": sorted(n for n in os.listdir("/dev") if n.startswith("nvidia")),
       "dev_caps": sorted(os.listdir("/dev/nvidia-caps")) if os.path.isdir("/dev/nvidia-caps") else [],
       "net": sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else None}
if os.path.exists("/sys/fs/cgroup/cpu.max"):
    q, p = rd("/sys/fs/cgroup/cpu.max").split()
    out["cpus"] = None if q == "max" else int(q) / int(p)
    out["memory_limit"] = rd("/sys/fs/cgroup/memory.max")
else:
    d = next((x for x in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct") if os.path.isdir(x)), "")
    q, p = rd(d + "/cpu.cfs_quota_us"), rd(d + "/cpu.cfs_period_us")
    out["cpus"] = int(q) / int(p) if q and p and int(q) > 0 else None
    stat = rd("/sys/fs/cgroup/memory/memory.stat") or ""
    lim = [l.split()[1] for l in stat.splitlines() if l.startswith("hierarchical_memory_limit ")]
    out["memory_limit"] = lim[0] if lim else None
if len(sys.argv) > 1 and sys.argv[1]:
    try:
        cu = ctypes.CDLL(sys.argv[1])
        out["cu_init"] = cu.cuInit(0)
        n = ctypes.c_int()
        if out["cu_init"] == 0 and cu.cuDeviceGetCount(ctypes.byref(n)) == 0:
            out["cuda_count"], devs = n.value, []
            try:
                get_uuid = cu.cuDeviceGetUuid_v2
            except AttributeError:
                get_uuid = cu.cuDeviceGetUuid
            for i in range(n.value):
                d, u, mem = ctypes.c_int(), (ctypes.c_ubyte * 16)(), ctypes.c_size_t()
                cu.cuDeviceGet(ctypes.byref(d), i)
                get_uuid(u, d)
                cu.cuDeviceTotalMem_v2(ctypes.byref(mem), d)
                ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
                rc = cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, d)
                if rc == 0:
                    rc = cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(64 << 20))
                    if rc == 0:
                        cu.cuMemFree_v2(ptr)
                    cu.cuCtxDestroy_v2(ctx)
                devs.append({"uuid_hex": bytes(u).hex(), "memory_mib": mem.value >> 20, "alloc_rc": rc})
            out["cuda_devices"] = devs
    except OSError as e:
        out["cuda_error"] = str(e)[:200]
smi = shutil.which("nvidia-smi") or ("/usr/bin/nvidia-smi" if os.path.exists("/usr/bin/nvidia-smi") else "")
if smi:
    r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    out["smi"] = [l.strip() for l in (r.stdout or r.stderr).splitlines() if l.strip()][:8]
print(json.dumps(out), flush=True)
"""

HOG = "x = bytearray({mib} * 1024 * 1024); print('survived', len(x), flush=True)"


@dataclass
class ContainerRunner:
    """Starts container jobs through a sandboxed Executor, as the agent does for `--image`."""

    executor: Executor
    image: str
    python: str  # the interpreter's path inside the image
    libcuda: str  # the driver library's path inside the image ("" with no GPU)
    attempts: int = 0

    def run(
        self,
        name: str,
        device: DeviceInfo | None,
        command: list[str],
        timeout: float = 120,
        memory_mib: int = MEMORY_MIB,
    ) -> JobRecord:
        """One container job on `device` (None: no GPU); waits for its end."""
        self.attempts += 1
        alloc = f"c{self.attempts}-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:40]
        slices = []
        if device is not None:
            tier = Isolation.MIG if device.is_mig else Isolation.EXCLUSIVE
            slices = [SliceAssignment(device, device.compute_milli, device.memory_mib, tier)]
        env = slice_env(alloc, 1, slices, self.executor.work_dir(alloc, 1))
        spec = JobSpec(
            alloc,
            1,
            command,
            env=env,
            cpu_milli=CPU_MILLI,
            memory_mib=memory_mib,
            uses_gpu=device is not None,
            tenant=TENANT,
            image=self.image,
            device_uuids=(device.uuid,) if device is not None else (),
        )
        rec = self.executor.start(spec)
        if rec.state is not JobState.RUNNING:
            return rec
        done = self.executor.wait(rec.key, timeout)
        if done.state is JobState.RUNNING:
            done = self.executor.kill(rec.key, "check timed out", grace_s=2)
        self.executor.poll()
        return done

    def probe(self, name: str, device: DeviceInfo | None) -> tuple[JobRecord, dict[str, object]]:
        rec = self.run(name, device, [self.python, "-I", "-c", PROBE, self.libcuda])
        return rec, last_json(Path(rec.run_dir) / STDOUT_LOG)


def _ldconfig_lib(name: str) -> str:
    """Where the host's loader finds a library (`libcuda.so.1`), from `ldconfig -p`; "" if nowhere."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        text = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    for line in text.splitlines():
        left, _, path = line.partition("=>")
        if left.strip().startswith(name + " ") and "x86-64" in left and os.path.exists(path.strip()):
            return path.strip()
    return ""


def _ldd(paths: list[str]) -> set[str]:
    """The shared libraries (and the loader) the given binaries need, as absolute host paths."""
    out: set[str] = set()
    for chunk in range(0, len(paths), 64):
        done = subprocess.run(["ldd", *paths[chunk : chunk + 64]], capture_output=True, text=True, timeout=60)
        for line in done.stdout.splitlines():
            if line.endswith(":"):
                continue
            m = _LDD_PATH.search(line.split("=>")[-1])
            if m and os.path.exists(m.group(1)):
                out.add(m.group(1))
    return out


def build_host_image(podman: Podman, tag: str = HOST_IMAGE) -> tuple[str, str, str]:
    """A GPU probe image from the host's own files: (python, libcuda) paths inside it, and a summary."""
    started = time.monotonic()
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    libcuda, libnvml = _ldconfig_lib("libcuda.so.1"), _ldconfig_lib("libnvidia-ml.so.1")
    smi = shutil.which("nvidia-smi") or ""
    paths = sysconfig.get_paths()
    stdlibs = sorted({paths["stdlib"], paths["platstdlib"]})
    dynload = [str(p) for d in stdlibs for p in Path(d, "lib-dynload").glob("*.so")]
    binaries = [b for b in (python, libcuda, libnvml, smi) if b]
    files = set(binaries) | _ldd([*binaries, *dynload]) | {"/etc/ld.so.cache"}
    stage = Path(tempfile.mkdtemp(prefix="cpool-gpucheck-image-", dir="/var/tmp"))
    try:
        for f in sorted(files):
            dest = stage / f.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest)  # follows links: `libcuda.so.1` holds the library itself
        for d in stdlibs:
            shutil.copytree(
                d,
                stage / d.lstrip("/"),
                symlinks=True,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns(*_SKIP_STDLIB),
            )
        (stage / "tmp").mkdir(mode=0o1777, exist_ok=True)
        os.chmod(stage / "tmp", 0o1777)
        for root, dirs, names in os.walk(stage):  # readable by the tenant's uid (a /root prefix is 0700)
            for d in dirs:
                if d != "tmp" or root != str(stage):
                    os.chmod(os.path.join(root, d), 0o755)
            for n in names:
                p = os.path.join(root, n)
                if not os.path.islink(p):
                    os.chmod(p, 0o755 if os.access(p, os.X_OK) else 0o644)
        size = sum(p.stat().st_size for p in stage.rglob("*") if p.is_file() and not p.is_symlink())
        podman_cmd(podman, ["rmi", "--force", tag], timeout=120)  # left by an interrupted run
        tar = subprocess.Popen(
            ["tar", "-C", str(stage), "--numeric-owner", "--owner=0", "--group=0", "-c", "."],
            stdout=subprocess.PIPE,
        )
        done = podman_cmd(podman, ["import", "-q", "-", tag], stdin=tar.stdout, timeout=IMAGE_BUDGET_S)
        if tar.stdout is not None:
            tar.stdout.close()
        tar.wait(timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"podman import failed: {done.stderr.strip()[-300:]}")
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    what = f"python {python}, libcuda {libcuda or 'missing'}, libnvidia-ml {libnvml or 'missing'}, "
    what += f"nvidia-smi {smi or 'missing'}"
    return python, libcuda, f"{tag}: {size / 2**20:.0f} MiB ({what}) in {time.monotonic() - started:.1f} s"


def make_runner(work: Path, test_image: bool) -> ContainerRunner | None:
    """A runner when podman works here (recording the image it built), else None with a SKIP."""
    data_dir = work / "container-agent"
    executor = Executor(data_dir, cgroup_base=None, kill_grace_s=3, sandbox=SandboxConfig())
    podman = executor.launcher.container_engine()
    ok, why = podman.available()
    if not ok:
        record("container path", "SKIP", why)
        return None
    if test_image:
        if not podman_image_exists(podman, TEST_IMAGE):
            done = subprocess.run(
                [str(_ROOT / "scripts" / "build-test-image.sh"), TEST_IMAGE],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if done.returncode != 0:
                record("container path", "SKIP", f"no {TEST_IMAGE}: {done.stderr.strip()[-200:]}")
                return None
        record("container image", "INFO", f"{TEST_IMAGE} (the project's test image: no CUDA inside)")
        return ContainerRunner(executor, TEST_IMAGE, "python3", "")
    try:
        python, libcuda, summary = build_host_image(podman)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        record("container image", "FAIL", f"could not build {HOST_IMAGE} from the host: {e}")
        return None
    record("container image", "INFO", summary)
    if libcuda and not Path("/dev/nvidia-uvm").exists():
        # the driver makes /dev/nvidia-uvm at the first CUDA start on the host; a container cannot
        cmd = [sys.executable, "-I", "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1]).cuInit(0)", libcuda]
        subprocess.run(cmd, capture_output=True, timeout=60)
        record("nvidia-uvm", "INFO", f"made by a cuInit on the host: {Path('/dev/nvidia-uvm').exists()}")
    return ContainerRunner(executor, HOST_IMAGE, python, libcuda)


def podman_cmd(podman: Podman, args: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    """podman as the agent runs it: its containers.conf and nothing else of this environment."""
    env = {"PATH": _PATH, "CONTAINERS_CONF": str(podman.write_conf())}
    kw.setdefault("capture_output", True)
    return subprocess.run([podman.binary, *args], env=env, text=True, **kw)  # type: ignore[call-overload]


def podman_image_exists(podman: Podman, image: str) -> bool:
    return podman_cmd(podman, ["image", "exists", image], timeout=60).returncode == 0


def host_nvidia_nodes() -> set[str]:
    return {n for n in os.listdir("/dev") if n.startswith("nvidia")} if os.path.isdir("/dev") else set()


def uuid_hex(uuid: str) -> str:
    """`GPU-1a2b…`/`MIG-…` → the 32 hex digits CUDA reports for the same device."""
    return re.sub(r"^(GPU|MIG)-", "", uuid).replace("-", "").lower()


def check_probe(runner: ContainerRunner, device: DeviceInfo | None, label: str) -> None:
    """One probe container on `device`: user, privileges, devices, limits, network, CUDA."""
    started = time.monotonic()
    rec, rep = runner.probe(label, device)
    took = time.monotonic() - started
    name = f"container {label}"
    if rec.state is not JobState.SUCCEEDED or "uid" not in rep:
        why = f"{rec.state} {rec.reason}; {tail(Path(rec.run_dir) / STDERR_LOG)} {rep}"
        record(f"{name}: job ran", "FAIL", why)
        return
    record(f"{name}: job ran", "PASS", f"succeeded in {took:.1f} s ({rec.limits})")
    uid = pwd.getpwnam(user_name(TENANT)).pw_uid
    ok = rep["uid"] == uid and rep["cap_eff"] == "0000000000000000" and rep["no_new_privs"] == "1"
    record(
        f"{name}: tenant uid, no privileges",
        "PASS" if ok else "FAIL",
        f"uid {rep['uid']} (tenant {uid}), CapEff {rep['cap_eff']}, NoNewPrivs {rep['no_new_privs']}",
    )
    net = rep.get("net")
    record(f"{name}: no network", "PASS" if net in (["lo"], []) else "FAIL", f"interfaces {net}")
    cpus = rep.get("cpus")
    ok = isinstance(cpus, float) and abs(cpus - CPU_MILLI / 1000) < 0.01
    record(f"{name}: cpu limit", "PASS" if ok else "FAIL", f"{cpus} CPUs seen (asked {CPU_MILLI / 1000})")
    limit = str(rep.get("memory_limit"))
    status = "PASS" if limit == str(MEMORY_MIB * 2**20) else "INFO" if not limit.isdigit() else "FAIL"
    # cgroup v2 shows only the container's own cgroup ("max"): the limit is on its parent
    record(f"{name}: memory limit seen inside", status, f"{limit} (asked {MEMORY_MIB} MiB)")
    want_cvd = device.uuid if device is not None else ""
    record(
        f"{name}: CUDA_VISIBLE_DEVICES",
        "PASS" if rep.get("cvd") == want_cvd else "FAIL",
        f"{rep.get('cvd')!r} (slice {want_cvd!r}, tier {rep.get('isolation')})",
    )
    check_device_nodes(runner, device, rep, name)
    check_cuda(runner, device, rep, name)


def check_device_nodes(runner: ContainerRunner, device: DeviceInfo | None, rep: dict, name: str) -> None:
    """Only the slice's /dev nodes inside: its GPU (and MIG capability nodes), none of the others."""
    args = runner.executor.launcher.container_engine().device_args((device.uuid,) if device else ())
    paths = [a.removeprefix("--device=") for a in args]
    cdi = any(not p.startswith("/dev/") for p in paths)  # a CDI name: the spec lists the nodes
    allowed = {p.removeprefix("/dev/") for p in paths if p.startswith("/dev/nvidia") and "/" not in p[5:]}
    allowed_caps = {Path(p).name for p in paths if p.startswith("/dev/nvidia-caps/")}
    seen, caps = set(rep.get("dev") or []) - {"nvidia-caps"}, set(rep.get("dev_caps") or [])
    host_gpus = {n for n in host_nvidia_nodes() if re.fullmatch(r"nvidia\d+", n)}
    others = host_gpus - allowed
    # without CDI every node inside must have been passed; with CDI, at least no other GPU's node
    extra = seen & others if cdi else (seen - allowed) | (caps - allowed_caps)
    ok = not extra and not seen & others
    record(
        f"{name}: only the slice's device nodes",
        "PASS" if ok else "FAIL",
        f"inside {sorted(seen)} caps {sorted(caps)}; passed {paths or 'none'}; "
        f"host GPUs {sorted(host_gpus)}; seen but not passed {sorted(extra)}",
    )


def check_cuda(runner: ContainerRunner, device: DeviceInfo | None, rep: dict, name: str) -> None:
    """CUDA inside sees exactly one device: the slice's, with its memory, and can allocate on it."""
    if not runner.libcuda or device is None:
        record(f"{name}: CUDA sees only the slice", "SKIP", "no GPU driver library (dry run or CPU node)")
        return
    devs = rep.get("cuda_devices")
    if not isinstance(devs, list):
        why = rep.get("cuda_error") or f"cuInit returned {rep.get('cu_init')}"
        record(f"{name}: CUDA sees only the slice", "FAIL", str(why))
        return
    one = len(devs) == 1
    same = one and devs[0]["uuid_hex"] == uuid_hex(device.uuid)
    mem_ok = one and abs(devs[0]["memory_mib"] - device.memory_mib) <= max(512, device.memory_mib // 50)
    alloc_ok = one and devs[0]["alloc_rc"] == 0
    record(
        f"{name}: CUDA sees only the slice",
        "PASS" if same and mem_ok and alloc_ok else "FAIL",
        f"{len(devs)} device(s) {devs} (slice {uuid_hex(device.uuid)}, {device.memory_mib} MiB)",
    )
    smi = rep.get("smi")
    if not isinstance(smi, list):
        record(f"{name}: nvidia-smi -L inside", "SKIP", "nvidia-smi is not in the image")
        return
    gpus = [line for line in smi if line.startswith("GPU ")]
    text = " ".join(smi)
    ok = len(gpus) == 1 and (device.uuid in text or (device.mig_parent_uuid or "-") in text)
    record(f"{name}: nvidia-smi -L inside", "PASS" if ok else "FAIL", f"{smi}")


def check_memory_enforced(runner: ContainerRunner) -> None:
    """A container job allocating past its memory limit is killed and reported out of memory."""
    command = [runner.python, "-I", "-c", HOG.format(mib=3 * HOG_LIMIT_MIB)]
    rec = runner.run("hog", None, command, timeout=90, memory_mib=HOG_LIMIT_MIB)
    ok = rec.state is JobState.FAILED and "out of memory" in rec.reason
    record(
        "container: memory limit enforced",
        "PASS" if ok else "FAIL",
        f"{3 * HOG_LIMIT_MIB} MiB asked under a {HOG_LIMIT_MIB} MiB limit: {rec.state} {rec.reason}",
    )


def run_container_checks(work: Path, devices: list[DeviceInfo], test_image: bool) -> ContainerRunner | None:
    """The container path on the first whole GPU (else the first device); returns the runner for more."""
    runner = make_runner(work, test_image)
    if runner is None:
        return None
    device = next((d for d in devices if not d.is_mig), devices[0] if devices else None)
    check_probe(runner, device, "on " + ("no GPU" if device is None else f"#{device.index} {device.model}"))
    check_memory_enforced(runner)
    return runner


def clean_up(runner: ContainerRunner | None) -> None:
    """Stop whatever still runs (the executor removes each container when its job ends), and drop
    the image built from the host: the next run builds it afresh from the host as it is then."""
    if runner is None:
        return
    for rec in runner.executor.running():
        runner.executor.kill(rec.key, "check finished", grace_s=1)
    if runner.image == HOST_IMAGE:
        podman_cmd(runner.executor.launcher.container_engine(), ["rmi", "--force", HOST_IMAGE], timeout=120)
