"""Other vendors' devices through the whole pool: `cpool up` with a simulated AMD GPU and Ascend
NPU, each job given the variable of its device's vendor by the real agent."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest
from e2e_helpers import Pool, cpool, simulated_up

SPEC = "1xMI300X,1xAscend910B,1xA100-80GB"
SHOW = (
    'echo "seen hip=$HIP_VISIBLE_DEVICES rocr=$ROCR_VISIBLE_DEVICES'
    ' npu=$ASCEND_RT_VISIBLE_DEVICES cuda=$CUDA_VISIBLE_DEVICES"'
)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pool, dict[str, str]]]:
    with simulated_up(tmp_path_factory.mktemp("vendors"), SPEC) as up:
        yield up


def seen(env: dict[str, str], model: str, *how: str) -> str:
    r = subprocess.run(
        cpool("run", "--gpus", "1", *(how or ("--model", model)), "--", "sh", "-c", SHOW),
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("seen ")), None)
    assert line is not None, r.stdout + r.stderr
    return line.removeprefix("seen ")


def test_the_node_reports_each_vendors_device(pool: tuple[Pool, dict[str, str]]) -> None:
    p, _ = pool
    (node,) = p.nodes()
    got = [(d["vendor"], d["model"], d["memory_mib"]) for d in node["devices"]]
    assert got == [("amd", "MI300X", 196608), ("ascend", "Ascend910B", 65536), ("nvidia", "A100", 81920)]
    # only NVIDIA's (real ones') uuids look like NVIDIA's: the agent gives those device nodes
    assert [d["uuid"].startswith(("GPU-", "MIG-")) for d in node["devices"]] == [False, False, True]


def test_each_job_sees_its_device_by_its_vendors_variable(pool: tuple[Pool, dict[str, str]]) -> None:
    _, env = pool
    assert seen(env, "MI300X") == "hip=0 rocr=0 npu= cuda="
    assert seen(env, "Ascend910B") == "hip= rocr= npu=0 cuda="


def test_a_request_by_vendor_or_size_gets_such_a_device(pool: tuple[Pool, dict[str, str]]) -> None:
    _, env = pool
    assert seen(env, "", "--vendor", "amd") == "hip=0 rocr=0 npu= cuda="
    assert seen(env, "", "--accelerator", "ascend") == "hip= rocr= npu=0 cuda="
    nvidia = seen(env, "", "--vendor", "nvidia")
    assert nvidia.startswith("hip= rocr= npu= cuda=") and nvidia != "hip= rocr= npu= cuda=", nvidia
    # only the MI300X holds 100 GiB
    assert seen(env, "", "--min-gpu-mem", "100GiB", "--accelerator", "any") == "hip=0 rocr=0 npu= cuda="


def test_what_no_device_can_give_is_refused_naming_it(pool: tuple[Pool, dict[str, str]]) -> None:
    _, env = pool
    cases = [  # (options, words of the reason)
        (["--vendor", "intel"], "1 no Intel device"),
        (["--vendor", "ascend", "--isolation", "mps"], "Huawei Ascend devices cannot enforce mps"),
        (["--min-gpu-mem", "300GiB"], "no device with 300GiB GPU memory"),
    ]
    for options, words in cases:
        r = subprocess.run(
            cpool("alloc", "--gpus", "1", *options, "--no-wait"), env=env, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert r.returncode != 0 and words in r.stderr and "defaults" not in r.stderr, (options, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run(
        cpool("alloc", "--vendor", "nvdia", "--gpus", "1"), env=env, capture_output=True, text=True
    )
    assert r.returncode != 0 and "unknown vendor 'nvdia'" in r.stderr and "--vendor" in r.stderr, r.stderr
