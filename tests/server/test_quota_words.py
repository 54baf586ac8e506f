"""Quota refusals speak in the units users type (GPUs, CPUs, GiB), not in the pool's milli and MiB."""

from __future__ import annotations

from collections import Counter

from computepool.core.quantities import format_amount, resource_name
from computepool.server.scheduling.quota import Usage, over_limit


def test_quota_reasons_in_user_units() -> None:
    quota = {
        ("", "gpu_milli"): (0, 1000),
        ("", "memory_mib"): (0, 8192),
        ("", "cpu_milli"): (0, 4000),
        ("A100", "gpu_milli"): (0, 2000),
    }
    used: Usage = Counter({("", "gpu_milli"): 1000, ("", "memory_mib"): 6144, ("", "cpu_milli"): 3500})
    gpu = over_limit(used, Counter({("", "gpu_milli"): 500}), quota)
    assert gpu == "quota: GPU limit 1 (using 1, asks 0.5)"
    assert (
        over_limit(used, Counter({("", "memory_mib"): 4096}), quota)
        == "quota: memory limit 8GiB (using 6GiB, asks 4GiB)"
    )
    cpu = over_limit(used, Counter({("", "cpu_milli"): 1000}), quota)
    assert cpu == "quota: CPU limit 4 (using 3.5, asks 1)"
    assert (
        over_limit(Counter(), Counter({("A100", "gpu_milli"): 3000}), quota)
        == "quota: A100 GPU limit 2 (using 0, asks 3)"
    )
    assert over_limit(used, Counter({("", "cpu_milli"): 500}), quota) is None


def test_amounts_and_names() -> None:
    assert [format_amount("gpu_milli", v) for v in (250, 1000, 1500)] == ["0.25", "1", "1.5"]
    mem = [format_amount("memory_mib", v) for v in (0, 512, 16384, 1536)]
    assert mem == ["0", "512MiB", "16GiB", "1.5GiB"]
    assert format_amount("gpu_memory_mib", None) == "-"
    assert resource_name("gpu_memory_mib", "H100") == "H100 GPU memory"
