"""OCI container jobs through rootful podman: the argv that runs one, and the housekeeping around it.

The executor runs `run_argv(...)` in the foreground under its gated wrapper, exactly like a
process job, so the exit status, the logs (the container's stdout/stderr go to podman's) and
re-adoption after an agent restart work the same way for both. What differs is the sandbox:

- podman reads its settings from a `containers.conf` in the agent's data dir (runc, ulimits a
  VM's hybrid cgroup v1 accepts) and sees nothing else of the agent's environment (`env -i`);
- the job's variables reach podman in a root-only env file in the run dir (`--env-file`), not on
  its command line, which every user of the node can read;
- the container runs as the tenant's uid with no capabilities, `no-new-privileges`, the process
  jobs' syscall refusals on top of podman's default profile (container_seccomp.py), no network
  unless the job publishes ports (then its tenant's own isolated network: container_net.py),
  only the job directory mounted (at /work), and only the slice's devices;
- the memory limit sits on a parent cgroup the agent makes for the job, below one its tenant's
  containers share, whose pids.max is the tenant's share of the node (container_cgroups.py).

Containers are named and labelled per agent data dir, so several agents sharing one podman store
(tests, a laptop) never take each other's containers for their own.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from computepool.agent.cgroups import Cgroups, jobs_pids_budget, tenant_pids_budget
from computepool.agent.container_cgroups import ContainerCgroups
from computepool.agent.container_env import ENV_FILE, EnvFileError, write_env_file
from computepool.agent.container_net import NetworkError, TenantNetworks
from computepool.agent.container_seccomp import PROFILE_FILE, write_profile
from computepool.agent.container_tcp import write_hook
from computepool.agent.devfiles import NVIDIA_COMMON_NODES, nvidia_nodes
from computepool.agent.identity import agent_id
from computepool.agent.sandbox import tmpfs_mib
from computepool.core.errors import InvalidInput
from computepool.core.images import parse_image

if TYPE_CHECKING:
    from computepool.agent.jobspec import JobSpec

CONF_FILE = "containers.conf"
LABEL = "computepool"
WORKDIR = "/work"
CGROUP_ROOT = Path("/sys/fs/cgroup")
CDI_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
_INIT_PATHS = ("/usr/libexec/podman/catatonit", "/usr/bin/catatonit", "/usr/libexec/catatonit/catatonit")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_NAME_BAD = re.compile(r"[^A-Za-z0-9_.-]+")
_IMAGE_OK_TTL_S = 60.0
_IMAGE_ID = re.compile(r"^sha256:[a-f0-9]{64}$")

# Lower ulimits than podman's defaults (which a container VM's hard limits refuse) and runc: crun
# refuses cgroup v1 in hybrid mode. Written to the agent's data dir; /etc/containers stays as it is.
_CONF = """\
# Written by the computepool agent for the podman it runs; not read by anything else.
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
hooks_dir = [{hooks}]
{runtime}
"""


class ContainerError(Exception):
    """A container job cannot start; the message is the job's reason, as the user will read it."""


class Podman:
    """The agent's podman: builds `podman run` argvs and finds, inspects and removes its containers."""

    def __init__(
        self,
        data_dir: Path,
        *,
        binary: str = "podman",
        node_name: str = "",
        pull: bool = True,
        pull_timeout_s: float = 300.0,
        pids_limit: int = 4096,
        publish_host: str | None = "",
        cgroup_root: Path = CGROUP_ROOT,
        cdi_dirs: tuple[Path, ...] = CDI_DIRS,
        tenant_pids: int = 0,
        job_cgroups: Cgroups | None = None,
    ) -> None:
        """`tenant_pids`: one tenant's processes together (cgroups.tenant_pids_budget); `job_cgroups`:
        the agent's, whose tenants' directories hold the containers' parents (container_cgroups.py)."""
        self.data_dir = data_dir
        self.binary = binary
        self.node_name = node_name or os.uname().nodename
        self.pull = pull
        self.pull_timeout_s = pull_timeout_s
        self.pids_limit = pids_limit
        # where published ports are bound: the node's address (the agent sets it once the pool said
        # it); "" all interfaces (embedding, tests); None not known yet, so nothing is published
        self.publish_host = publish_host
        self.cgroup_root = cgroup_root
        self.cdi_dirs = cdi_dirs
        self.agent_id = agent_id(data_dir)  # the same digits as its job cgroups' directory
        self.cgroups = ContainerCgroups(
            cgroup_root, self.agent_id, tenant_pids_budget(jobs_pids_budget(), tenant_pids), job_cgroups
        )
        self.conf_path = data_dir / CONF_FILE
        self._seccomp_path: Path | None = None  # container_seccomp.py's profile, once written
        self._available: tuple[bool, str] | None = None
        self.networks = TenantNetworks(self._podman)  # a tenant's own, for containers given ports
        self._images_ok: dict[str, tuple[float, str]] = {}  # name or pinned id: (seen at, id)
        self._layers: dict[str, Path] = {}  # container name: its writable layer (writable_layer)

    # ---- setup ------------------------------------------------------------------------------

    def available(self) -> tuple[bool, str]:
        """(True, "") when container jobs can run here, else (False, why) for the job's reason."""
        if self._available is None:
            self._available = self._check()
        return self._available

    def _check(self) -> tuple[bool, str]:
        if shutil.which(self.binary, path=_PATH) is None and not os.path.isfile(self.binary):
            return False, f"podman is not installed on node {self.node_name} ({self.binary} not found)"
        if os.geteuid() != 0:
            return False, "container jobs need a root agent (rootful podman runs them as the tenant's uid)"
        self.write_conf()
        try:
            done = self._podman(["version", "--format", "{{.Client.Version}}"], timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, f"podman does not answer: {e}"
        if done.returncode != 0:
            return False, f"podman does not work here: {_last_line(done.stderr)}"
        return True, ""

    def write_conf(self) -> Path:
        """The containers.conf podman gets from the agent (mode 0600, rewritten at every start)."""
        runtime = 'runtime = "runc"' if shutil.which("runc", path=_PATH) else ""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        hooks = write_hook(self.data_dir, self.cgroup_root / "memory")  # v1: a TCP limit (container_tcp.py)
        text = _CONF.format(runtime=runtime, hooks=json.dumps(str(hooks)))
        tmp = self.conf_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, self.conf_path)
        return self.conf_path

    def seccomp_profile(self) -> Path:
        """The containers' seccomp profile (container_seccomp.py), written once per start."""
        if self._seccomp_path is None:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._seccomp_path = write_profile(self.data_dir / PROFILE_FILE)
        return self._seccomp_path

    def _env_prefix(self) -> list[str]:
        return ["/usr/bin/env", "-i", f"CONTAINERS_CONF={self.conf_path}", f"PATH={_PATH}", self.binary]

    def command(self, args: list[str]) -> list[str]:
        """argv of `podman ARGS` as the agent runs it (its containers.conf, a fixed PATH, no env)."""
        return [*self._env_prefix(), *args]

    def _podman(self, args: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self._env_prefix(), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    # ---- images -----------------------------------------------------------------------------

    def image_known(self, image: str, digest: str | None = None) -> bool:
        """The image was seen on the node lately: `ensure_image` returns at once (no podman call)."""
        seen = self._images_ok.get(digest or image)
        return seen is not None and time.monotonic() - seen[0] < _IMAGE_OK_TTL_S

    def ensure_image(self, image: str, digest: str | None = None) -> str:
        """The id of the image the job runs, on the node (pulled now if need be); else ContainerError.

        With `digest` (pinned by the pool) that image id and nothing else: when the node lacks it, the
        name is pulled from its registry and must give that id. Without (an allowed registry's
        image), the id the name has on the node, else the one a pull gives. Either way the job runs
        the id, so retagging the name later changes nothing it runs. Images are pulled as
        `docker://NAME`: no name is ever read as a file, a directory or another local store.
        """
        key = digest or image
        if self.image_known(image, digest):
            return self._images_ok[key][1]
        local = self._image_id(image if digest is None else digest.removeprefix("sha256:"))
        if local is not None and local == (digest or local):
            self._images_ok[key] = (time.monotonic(), local)
            return local
        if not self.pull:
            shown = f"{image} ({digest[:19]}…)" if digest else image
            raise ContainerError(f"image {shown} not found on node {self.node_name} (pulling is off)")
        try:
            done = self._podman(["pull", "-q", f"docker://{image}"], timeout=self.pull_timeout_s)
        except subprocess.TimeoutExpired:
            raise ContainerError(
                f"image {image} not found on node {self.node_name} and could not be pulled: "
                f"no answer in {self.pull_timeout_s:.0f} s"
            ) from None
        if done.returncode != 0:
            raise ContainerError(
                f"image {image} not found on node {self.node_name} and could not be pulled: "
                f"{_last_line(done.stderr)}"
            )
        lines = done.stdout.strip().splitlines()
        got = "sha256:" + lines[-1].strip().removeprefix("sha256:") if lines else ""
        if not _IMAGE_ID.match(got):
            raise ContainerError(f"image {image}: the pull on node {self.node_name} named no image id")
        if digest is not None and got != digest:
            raise ContainerError(
                f"image {image} from its registry is {got[:19]}…, not the {digest[:19]}… published for it "
                "(an admin publishes it again to run the new one)"
            )
        self._images_ok[key] = (time.monotonic(), got)
        return got

    def _image_id(self, ref: str) -> str | None:
        """The full id (sha256:…) of the local image `ref` names (an id or a name), or None."""
        done = self._podman(["image", "inspect", "--format", "{{.Id}}", ref], timeout=30)
        got = "sha256:" + done.stdout.strip().removeprefix("sha256:") if done.returncode == 0 else ""
        return got if _IMAGE_ID.match(got) else None

    # ---- running ----------------------------------------------------------------------------

    def name(self, key: str) -> str:
        """The container's name for a job key (`alloc#attempt`), unique per agent data dir."""
        return f"cpool-{self.agent_id}-{_NAME_BAD.sub('_', key.replace('#', '.'))}"[:250]

    def prepare(self, spec: JobSpec) -> str:
        """Check the job and get its image onto the node (a pull may take minutes); ContainerError if not.

        The executor calls this before it takes its lock, so that a slow pull holds up nothing else;
        `run_argv` then finds the image in the cache of recent checks. Returns the image id to run.
        """
        image = self._check_spec(spec)
        return self.ensure_image(image, spec.image_digest)

    def _check_spec(self, spec: JobSpec) -> str:
        ok, why = self.available()
        if not ok:
            raise ContainerError(why)
        image = spec.image or ""
        try:  # a registry name, never a transport, a path or an option to podman
            parse_image(image)
        except InvalidInput as e:
            raise ContainerError(e.message) from None
        if spec.image_digest is not None and not _IMAGE_ID.match(spec.image_digest):
            raise ContainerError(f"not an image id: {spec.image_digest[:80]!r}")
        bad = [p for p in spec.ports if not 0 < p < 65536]
        if bad:
            raise ContainerError(f"not a port: {bad[0]}")
        low = [p for p in spec.ports if p < 1024]
        if low:  # podman binds as root: a tenant never gets a privileged port of the node
            raise ContainerError(f"ports: {low[0]} is a privileged port, which a container never publishes")
        return image

    def _publish_prefix(self) -> str:
        """`ADDRESS:` for --publish: the node's address as an IP (a name resolved), never every
        interface unless this engine was made so ("")."""
        if self.publish_host == "":
            return ""
        if self.publish_host is None:
            raise ContainerError("cannot publish ports yet: the pool has not told this node its address")
        host = self.publish_host.strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            try:
                ip = ipaddress.ip_address(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
            except (OSError, ValueError, IndexError) as e:
                raise ContainerError(f"cannot publish ports on this node's address {host!r}: {e}") from None
        return f"[{ip}]:" if ip.version == 6 else f"{ip}:"

    def run_argv(self, spec: JobSpec, run_dir: Path, uid: int, gid: int) -> list[str]:
        """A foreground `podman run` for the job; raises ContainerError when it cannot start.

        Side effects: checks the image (at once after `prepare`; else it pulls, which blocks for as
        long) and makes the job's parent cgroup with its memory limit, so that nothing runs
        unlimited; `remove(key)` drops it.
        """
        image_id = self.prepare(spec)
        key = spec.key
        # no --rm: remove(key) removes it, once the agent has read how it ended
        argv = [
            *self._env_prefix(),
            "run",
            "--pull=never",
            f"--name={self.name(key)}",
            f"--label={LABEL}.agent={self.agent_id}",
            f"--label={LABEL}.key={key}",
            f"--label={LABEL}.allocation={spec.allocation_id}",
            f"--label={LABEL}.attempt={spec.attempt}",
            f"--label={LABEL}.tenant={spec.tenant}",
            f"--user={uid}:{gid}",
            "--cap-drop=all",
            "--security-opt=no-new-privileges",
            f"--security-opt=seccomp={self.seccomp_profile()}",  # no user namespaces, keyrings, …
            f"--pids-limit={spec.pids_max or self.pids_limit}",
            "--log-driver=none",
            f"--volume={run_dir}:{WORKDIR}:rw,nosuid,nodev",
            # an image's VOLUMEs: tmpfs (charged to the container's memory, gone with it), not
            # anonymous volumes on the node's disk, which no disk guard counted and `rm` left behind
            "--image-volume=tmpfs",
            # an image's HEALTHCHECK would be run by systemd through `podman healthcheck run`: an exec
            # from outside the agent, so outside the container's Landlock domain
            "--no-healthcheck",
            f"--workdir={WORKDIR}",
        ]
        if self._init_path():
            argv.append("--init")  # pid 1 that forwards SIGTERM: a bare pid 1 ignores it
        if spec.cpu_milli > 0:
            argv.append(f"--cpus={spec.cpu_milli / 1000:g}")
        argv += self.cgroups.parent_args(self.name(key), spec.memory_mib, spec.tenant)
        tmp = tmpfs_mib(spec.memory_mib)
        if tmp:  # sized /tmp, /var/tmp and /dev/shm, as a process job has them: their pages are the
            # job's memory; else the image's world-writable dirs fill the node's disk (the overlay's)
            argv += [f"--shm-size={tmp}m", f"--tmpfs=/tmp:rw,nosuid,nodev,mode=1777,size={tmp}m",
                     f"--tmpfs=/var/tmp:rw,nosuid,nodev,mode=1777,size={tmp}m"]  # fmt: skip
        argv.append("--tmpfs=/run/lock:rw,nosuid,nodev,mode=1777,size=1m")
        if spec.stdin:
            argv.append("--interactive")  # the run's stdin (the wrapper's) reaches the command
        if spec.ports:
            host = self._publish_prefix()
            try:
                argv.append(f"--network={self.networks.ensure(uid)}")
            except (NetworkError, OSError, subprocess.TimeoutExpired) as e:
                raise ContainerError(str(e)) from None
            argv += [f"--publish={host}{p}:{p}" for p in spec.ports]
        elif spec.container_host_network:
            # a function's worker calls the control plane back at the agent's own URL (CPOOL_SERVER),
            # loopback included: the host's network, as a process job has it (and, like it, in a
            # Landlock domain scoped for abstract sockets: launch.py)
            argv.append("--network=host")
        else:
            argv.append("--network=none")
        argv += self.device_args(spec.device_uuids, spec.device_nodes)
        env = {"HOME": WORKDIR, "CPOOL_RUN_DIR": WORKDIR, **dict(spec.env)}
        # paths into the job dir (the isolation shim, the simulated devices' memory file) as seen inside
        env = {k: _inside(v, run_dir) for k, v in env.items()}
        mps = env.get("CUDA_MPS_PIPE_DIRECTORY", "")
        if mps.startswith("/") and not mps.startswith(WORKDIR) and os.path.isdir(mps):
            argv.append(f"--volume={mps}:{mps}:rw,nosuid,nodev")  # the GPU's MPS daemon, for MPS slices
        cache = env.get("CPOOL_CACHE_DIR", "")
        if cache.startswith("/") and os.path.isdir(cache):
            argv.append(f"--volume={cache}:{cache}:rw,nosuid,nodev")  # the tenant's cache, same path
        # through a file, never `--env=K=V`: podman's command line is readable by every user of the
        # node (`ps`), and the environment holds secrets (the replica's key, a worker's token, the user's)
        try:
            argv.append(f"--env-file={write_env_file(run_dir.parent / ENV_FILE, env)}")
        except EnvFileError as e:
            raise ContainerError(str(e)) from None
        argv += [image_id.removeprefix("sha256:"), *spec.command]  # the id: what a name means may change
        return argv

    def _init_path(self) -> str:
        return next((p for p in _INIT_PATHS if os.path.exists(p)), "")

    # ---- memory and processes: parent cgroups the agent owns (container_cgroups.py) -------

    def _memory_dir(self, key: str, tenant: str = "") -> Path:
        return self.cgroups.memory_dir(self.name(key), tenant)

    def out_of_memory(self, key: str, exit_code: int | None, tenant: str = "") -> bool:
        """Did the kernel kill the job for memory? Ask before `remove(key)` takes the cgroup away."""
        return self.cgroups.out_of_memory(self.name(key), exit_code, tenant)

    # ---- devices ----------------------------------------------------------------------------

    def device_args(
        self, uuids: tuple[str, ...] | list[str], device_nodes: tuple[str, ...] | list[str] = ()
    ) -> list[str]:
        """The slice's devices only: for NVIDIA, CDI names where a CDI spec lists them, else the
        device nodes NVML names; for the other vendors, the nodes their backends found (AMD's
        /dev/kfd and render node, Intel's render and card nodes, Ascend's davinci nodes:
        devices/nodes.py), those that still exist.

        Simulated and CPU slices get none (the job still reads its visible-devices variable).
        """
        nodes: list[str] = [n for n in device_nodes if os.path.exists(n)]
        real = [u for u in uuids if u.startswith(("GPU-", "MIG-"))]
        if not real:
            return [f"--device={n}" for n in dict.fromkeys(nodes)]
        cdi = _cdi_names(self.cdi_dirs)
        for u in real:
            if u in cdi:
                nodes.append(f"nvidia.com/gpu={u}")
                continue
            found = nvidia_nodes(u)
            if found:
                nodes += [*found, *(n for n in NVIDIA_COMMON_NODES if os.path.exists(n))]
        return [f"--device={n}" for n in dict.fromkeys(nodes)]

    # ---- finding and removing ---------------------------------------------------------------

    def running_keys(self) -> set[str]:
        """Job keys of this agent's containers that are running now."""
        return self._keys(all_states=False)

    def writable_layer(self, key: str) -> Path | None:
        """The job's container's writable layer on the node (what it changed or added to its image's
        files: a world-writable dir of the image fills the node's disk there), or None. Asked of
        podman once per container (the disk guard asks on each of its passes)."""
        name = self.name(key)
        if name in self._layers:
            return self._layers[name]
        try:
            done = self._podman(["inspect", "--format", "{{.GraphDriver.Data.UpperDir}}", name], 30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        path = done.stdout.strip()
        if done.returncode != 0 or not path.startswith("/"):
            return None
        if len(self._layers) > 4096:  # containers removed by another way than remove(): forget them
            self._layers.clear()
        self._layers[name] = Path(path)
        return self._layers[name]

    def all_keys(self) -> set[str]:
        """Job keys of all this agent's containers, running or ended but not removed yet."""
        return self._keys(all_states=True)

    def _keys(self, all_states: bool) -> set[str]:
        args = [
            "ps",
            f"--filter=label={LABEL}.agent={self.agent_id}",
            f'--format={{{{index .Labels "{LABEL}.key"}}}}',
        ]
        if all_states:
            args.insert(1, "--all")
        try:
            done = self._podman(args, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return set()
        return (
            {line.strip() for line in done.stdout.splitlines() if line.strip()}
            if done.returncode == 0
            else set()
        )

    def sweep(self, keep: set[str]) -> list[str]:
        """Remove this agent's containers whose jobs it does not hold (after a crash); returns their keys."""
        gone = sorted(self.all_keys() - keep)
        for key in gone:
            self.remove(key)
        return gone

    def remove(self, key: str) -> None:
        """Kill and remove the job's container and its cgroup; quiet and idempotent."""
        self._layers.pop(self.name(key), None)
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self._podman(["rm", "--force", "--ignore", "--time=0", self.name(key)], timeout=60)
        self.cgroups.remove(self.name(key))

    @staticmethod
    def explain(rc: int) -> str:
        """podman's own exit statuses, in words (others are the command's)."""
        return {
            125: "podman could not run the container (see the job's stderr)",
            126: "the command in the image cannot be run",
            127: "the command was not found in the image",
        }.get(rc, "")


def _inside(value: str, run_dir: Path) -> str:
    """A host path under the job dir, rewritten to where the container sees it."""
    host = str(run_dir)
    return value.replace(host + "/", WORKDIR + "/") if value != host else WORKDIR


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1].removeprefix("Error: ") if lines else "no reason given"


def _cdi_names(dirs: tuple[Path, ...]) -> set[str]:
    """Device names (GPU/MIG uuids) in the node's NVIDIA CDI specs, e.g. from `nvidia-ctk cdi generate`."""
    names: set[str] = set()
    for d in dirs:
        for f in sorted(d.glob("*")) if d.is_dir() else []:
            with contextlib.suppress(OSError, UnicodeDecodeError):
                text = f.read_text()
                if "nvidia.com/gpu" in text:
                    names.update(re.findall(r"""name:\s*["']?((?:GPU|MIG)-[0-9a-fA-F-]+)""", text))
                    names.update(re.findall(r'"name":\s*"((?:GPU|MIG)-[0-9a-fA-F-]+)"', text))
    return names
