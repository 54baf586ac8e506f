"""core/: quantity parsing at the edge, Request validation, model lists — errors name the field."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from computepool.core import InvalidInput, Request, Sharing, parse_models
from computepool.core.quantities import format_mib, parse_cpu_milli, parse_gpu_milli, parse_memory_mib

# --- quantities --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        ("10GiB", 10240),
        ("10Gi", 10240),
        ("10gib", 10240),
        (" 10 GiB ", 10240),
        ("512Mi", 512),
        ("512MiB", 512),
        ("1.5GiB", 1536),
        ("1TiB", 1024 * 1024),
        ("1Ki", 1),  # rounded up to a whole MiB
        ("1G", 954),  # 10^9 bytes = 953.67 MiB, rounded up
        ("1000MB", 954),
        ("1048576", 1),  # a bare number is bytes
        ("0", 0),
        ("0GiB", 0),
        (1048576 * 3, 3),
    ],
)
def test_parse_memory_mib(text, mib):
    assert parse_memory_mib(text) == mib


@pytest.mark.parametrize("text", ["10XB", "10 gigs", "10GiBs", "ten", "", "-1GiB", "-5", "1.2.3Gi", "Gi"])
def test_parse_memory_rejects(text):
    with pytest.raises(InvalidInput) as e:
        parse_memory_mib(text, field="spec.memory")
    assert e.value.where == "spec.memory"
    assert str(e.value).startswith("spec.memory: ")


@pytest.mark.parametrize("value", [-1, -0.5, float("nan"), float("inf"), True])
def test_parse_memory_rejects_numbers(value):
    with pytest.raises(InvalidInput) as e:
        parse_memory_mib(value)
    assert e.value.where == "memory"


def test_parse_memory_unknown_unit_message_names_unit():
    with pytest.raises(InvalidInput, match="unknown memory unit 'XB'") as e:
        parse_memory_mib("10XB")
    assert e.value.where == "memory"
    assert "10XB" in e.value.message


@pytest.mark.parametrize(
    ("text", "milli"),
    [("500m", 500), ("2", 2000), ("0.5", 500), ("0.25", 250), ("1m", 1), (3, 3000), (0.1, 100), ("0", 0)],
)
def test_parse_cpu_milli(text, milli):
    assert parse_cpu_milli(text) == milli


@pytest.mark.parametrize("text", ["2 cores", "500M", "500mi", "-1", "-500m", "x", "", "1Gi"])
def test_parse_cpu_rejects(text):
    with pytest.raises(InvalidInput) as e:
        parse_cpu_milli(text, field="cpu")
    assert e.value.where == "cpu"


def test_parse_cpu_rejects_negative_number():
    with pytest.raises(InvalidInput) as e:
        parse_cpu_milli(-2, field="resources.cpu")
    assert e.value.where == "resources.cpu"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.5", (1, 500)),
        (0.5, (1, 500)),
        ("0.25", (1, 250)),
        ("250m", (1, 250)),
        ("1", (1, 1000)),
        ("1000m", (1, 1000)),
        ("2", (2, 1000)),
        (8, (8, 1000)),
        ("0", (0, 0)),
        ("0.001", (1, 1)),
    ],
)
def test_parse_gpu_milli(text, expected):
    assert parse_gpu_milli(text) == expected


@pytest.mark.parametrize("text", ["1.5", 1.5, "2.5", "1500m", "0.0001", "1Gi", "-0.5", "-1", -1, "half", ""])
def test_parse_gpu_rejects(text):
    with pytest.raises(InvalidInput) as e:
        parse_gpu_milli(text, field="gpus")
    assert e.value.where == "gpus"


def test_parse_gpu_fraction_above_one_message():
    with pytest.raises(InvalidInput, match="whole number of devices"):
        parse_gpu_milli("1.5")


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=64))
def test_parse_gpu_whole_counts(k):
    assert parse_gpu_milli(str(k)) == (k, 1000)
    assert parse_gpu_milli(k) == (k, 1000)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=999))
def test_parse_gpu_milli_roundtrip(m):
    assert parse_gpu_milli(f"{m}m") == (1, m)
    assert parse_gpu_milli(f"{m / 1000}") == (1, m)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=10**7))
def test_parse_memory_and_cpu_units_roundtrip(n):
    assert parse_memory_mib(f"{n}Mi") == n
    assert parse_memory_mib(f"{n}GiB") == n * 1024
    assert parse_memory_mib(n * 1024 * 1024) == n
    assert parse_cpu_milli(f"{n}m") == n
    assert parse_cpu_milli(str(n)) == n * 1000


def test_format_mib():
    assert format_mib(10240) == "10GiB"
    assert format_mib(1536) == "1.5GiB"
    assert format_mib(512) == "512MiB"


def test_invalid_input_is_value_error():
    e = InvalidInput("field", "bad")
    assert isinstance(e, ValueError)
    assert str(e) == "field: bad"
    assert (e.where, e.message) == ("field", "bad")


# --- Request validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "where"),
    [
        ({"gpu_count": -1}, "gpu_count"),
        ({"gpu_count": 1, "gpu_milli": -500}, "gpu_milli"),
        ({"cpu_milli": -1}, "cpu_milli"),
        ({"memory_mib": -1}, "memory_mib"),
        ({"gang_nodes": -1}, "gang_nodes"),
        ({"gang_nodes": 0}, "gang_nodes"),
        ({"gpu_count": True, "gpu_milli": 1000}, "gpu_count"),
        ({"cpu_milli": 1.5}, "cpu_milli"),
        ({"gpu_count": 1, "gpu_milli": 1000, "gpu_memory_mib": -1}, "gpu_memory_mib"),
        ({"gpu_count": 2, "gpu_milli": 500}, "gpu_milli"),  # fractional multi-device
        ({"gpu_count": 1, "gpu_milli": 1001}, "gpu_milli"),
        ({"gpu_count": 1, "gpu_milli": 0}, "gpu_milli"),
        ({"gpu_count": 0, "gpu_milli": 500}, "gpu_milli"),
        ({"gpu_count": 65, "gpu_milli": 1000}, "gpu_count"),
        ({"gpu_count": 1, "gpu_milli": 500, "sharing": Sharing.EXCLUSIVE}, "sharing"),  # exclusive + fraction
        ({"sharing": Sharing.EXCLUSIVE, "cpu_milli": 1000}, "sharing"),  # exclusive without devices
        ({"gpu_count": 1, "gpu_milli": 500, "gang_nodes": 2}, "gpu_milli"),  # gang + fraction
        ({"gpu_count": 1, "gpu_milli": 1000, "gang_nodes": 5000}, "gang_nodes"),
        ({"gpu_count": 1, "gpu_milli": 1000, "models": frozenset({"A", "B C"})}, "models"),
        ({"gpu_count": 1, "gpu_milli": 1000, "models": frozenset({""})}, "models"),
    ],
)
def test_request_rejects(kwargs, where):
    with pytest.raises(InvalidInput) as e:
        Request(**kwargs)
    assert e.value.where == where, str(e.value)
    assert str(e.value).startswith(f"{where}: ")


def test_request_fraction_multi_device_message():
    with pytest.raises(InvalidInput, match="only allowed for a single device"):
        Request(gpu_count=2, gpu_milli=500)


def test_request_valid_shapes():
    frac = Request(gpu_count=1, gpu_milli=500, cpu_milli=2000)
    assert frac.fractional
    assert frac.total_gpu_milli == 500
    whole = Request(gpu_count=4, gpu_milli=1000, gang_nodes=3)
    assert not whole.fractional
    assert whole.total_gpu_milli == 12000
    excl = Request(gpu_count=2, gpu_milli=1000, sharing=Sharing.EXCLUSIVE)
    assert excl.sharing == Sharing.EXCLUSIVE
    cpu = Request(cpu_milli=500, memory_mib=1024)
    assert not cpu.fractional and cpu.total_gpu_milli == 0
    assert (
        Request(gpu_count=1, gpu_milli=500, name="a").kind_key()
        == Request(gpu_count=1, gpu_milli=500, name="b", tenant="t").kind_key()
    )
    assert (
        frac.kind_key()
        != Request(
            gpu_count=1, gpu_milli=500, cpu_milli=2000, sharing="shared", models=frozenset({"T4"})
        ).kind_key()
    )


# --- model lists -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["A||B", "V100 M16", "|A", "A|", "A|B C", "T4,V100", "A/B", "-A"])
def test_parse_models_rejects(text):
    with pytest.raises(InvalidInput) as e:
        parse_models(text, field="gpu_spec")
    assert e.value.where == "gpu_spec"
    assert repr(text.strip()) in e.value.message


def test_parse_models_default_field():
    with pytest.raises(InvalidInput) as e:
        parse_models("A||B")
    assert e.value.where == "models"


@pytest.mark.parametrize(
    ("text", "models"),
    [
        ("V100M16|V100M32", frozenset({"V100M16", "V100M32"})),
        (" A | B ", frozenset({"A", "B"})),
        ("T4", frozenset({"T4"})),
        ("A100-80GB|H100_sxm.5", frozenset({"A100-80GB", "H100_sxm.5"})),
        ("", None),
        ("   ", None),
        (None, None),
    ],
)
def test_parse_models_accepts(text, models):
    assert parse_models(text) == models


def test_nan_quantities_never_pass():
    for parse in (parse_memory_mib, parse_cpu_milli, parse_gpu_milli):
        with pytest.raises(InvalidInput):
            parse(math.nan)
        with pytest.raises(InvalidInput):
            parse("nan")
