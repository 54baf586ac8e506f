"""Shared fixtures: the real Alibaba trace (read once per session), tiny CSV files, and the container
tests' image."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from computepool.agent.container import Podman
from computepool.core import Node
from computepool.sim.alibaba import Pod, load_nodes, load_pods
from computepool.sim.csvread import traces_dir


def pytest_configure(config: pytest.Config) -> None:
    """A harness that starts the tests in the background hands them SIGINT ignored, and every
    command they start would keep it ignored (so Ctrl-C tests could never pass): give this process
    Python's own handler, which its children's exec resets to the default, as on a terminal."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Hypothesis on a machine shared with other work: no per-example deadline and no "too slow" health
# check, for every property test (a busy core stretches any example; a test that needs a bound on
# time has it in its own terms). Tests still set how many examples they are worth.
settings.register_profile("shared-machine", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("shared-machine")

NODE_HEADER = "sn,cpu_milli,memory_mib,gpu,model"
POD_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,"
    "qos,pod_phase,creation_time,deletion_time,scheduled_time"
)


@pytest.fixture(autouse=True)
def _umask_kept() -> Iterator[None]:
    """Each test ends with the umask it began with: a command run in-process that narrows it (the
    agent's and `cpool up`'s 077) would make every later test's directories closed to tenants."""
    umask = os.umask(0o022)
    os.umask(umask)
    yield
    os.umask(umask)


@pytest.fixture(scope="session")
def alibaba_dir() -> Path:
    d = traces_dir() / "alibaba-v2023"
    if not (d / "openb_node_list_gpu_node.csv").exists():
        pytest.skip(f"Alibaba trace not found under {d} (set CPOOL_TRACES)")
    return d


@pytest.fixture(scope="session")
def gpu_nodes(alibaba_dir: Path) -> list[Node]:
    return load_nodes(alibaba_dir / "openb_node_list_gpu_node.csv")


@pytest.fixture(scope="session")
def default_pods(alibaba_dir: Path) -> list[Pod]:
    return load_pods(alibaba_dir / "openb_pod_list_default.csv")


def pod_row(
    name: str, cpu: int = 1000, mem: int = 1024, num_gpu: int = 1, milli: int = 500, spec: str = ""
) -> str:
    return f"{name},{cpu},{mem},{num_gpu},{milli},{spec},LS,Running,0,10,0"


@pytest.fixture
def tiny_csvs(tmp_path: Path) -> tuple[Path, Path]:
    """A 3-node cluster (2 GPUs each, two models) and a dozen mixed pods."""
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(
        "\n".join(
            [
                NODE_HEADER,
                "node-a,32000,131072,2,T4",
                "node-b,32000,131072,2,T4",
                "node-c,64000,262144,2,V100M32",
            ]
        )
        + "\n"
    )
    pods = tmp_path / "pods.csv"
    rows = [
        pod_row("p00", milli=500),
        pod_row("p01", milli=500),
        pod_row("p02", milli=250),
        pod_row("p03", milli=810),
        pod_row("p04", milli=1000),
        pod_row("p05", num_gpu=2, milli=1000, cpu=8000),
        pod_row("p06", num_gpu=0, milli=0, cpu=4000),
        pod_row("p07", milli=300, spec="V100M32"),
        pod_row("p08", milli=100),
        pod_row("p09", milli=700, spec="T4|V100M32"),
        pod_row("p10", milli=1000, spec="T4"),
        pod_row("p11", milli=200),
    ]
    pods.write_text("\n".join([POD_HEADER, *rows]) + "\n")
    return nodes, pods


TEST_IMAGE = "localhost/pybase:1"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The container tests' image, built or loaded once by scripts/build-test-image.sh (cached)."""
    if os.geteuid() != 0 or shutil.which("podman") is None:
        pytest.skip("container jobs need root and podman")
    ok, why = Podman(tmp_path_factory.mktemp("podman-probe")).available()
    if not ok:
        pytest.skip(f"podman unusable here: {why}")
    done = subprocess.run(
        [str(ROOT / "scripts" / "build-test-image.sh"), TEST_IMAGE],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"test image {TEST_IMAGE} could not be built or loaded: {done.stderr.strip()[-300:]}")
    return TEST_IMAGE


LLAMA_VENV_DEFAULT = Path("/opt/computepool-test/llama-venv")


@pytest.fixture(scope="session")
def llama_python() -> str:
    """The python of the llama.cpp venv (scripts/llama-venv.sh), checked to import llama_cpp's server as
    any user may. Skipped only when CPOOL_TEST_LLAMA_VENV is unset (and the default venv unusable)
    outside CI; where that variable is set, or in CI, an unusable venv fails the test."""
    named = os.environ.get("CPOOL_TEST_LLAMA_VENV")
    venv = Path(named) if named else LLAMA_VENV_DEFAULT
    py = venv / "bin" / "python"
    why = ""
    if not py.exists():
        why = "it does not exist"
    elif not all(os.stat(d).st_mode & 0o001 for d in py.parents):
        why = "a tenant's user cannot enter it"
    else:
        r = subprocess.run(
            [str(py), "-c", "import llama_cpp, llama_cpp.server.app"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        if r.returncode != 0:
            why = f"llama_cpp does not import: {r.stderr.strip()[-300:]}"
    if why:
        msg = (
            f"the llama.cpp venv {venv} is not usable ({why}): build it with "
            f"`scripts/llama-venv.sh {venv}` or point CPOOL_TEST_LLAMA_VENV at one"
        )
        if named or os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    return str(py)
