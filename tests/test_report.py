"""`cpool sim report`: the quick report on the real trace, the option parsers, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from computepool.cli import main as cli_main
from computepool.core.errors import InvalidInput
from computepool.sim.csvread import traces_dir
from computepool.sim.report import (
    QUICK_POLICIES,
    QUICK_WORKLOADS,
    ReportConfig,
    Stat,
    md_table,
    parse_names,
    parse_seeds,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TRACES = traces_dir()
needs_trace = pytest.mark.skipif(
    not (TRACES / "alibaba-v2023" / "openb_pod_list_default.csv").is_file(),
    reason="Alibaba trace not available (set CPOOL_TRACES)",
)


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    if not any(c.name == "report" for c in cli_main.sim_app.registered_commands):
        cli_main._register()
    return CliRunner()


def invoke(runner: CliRunner, *args: str) -> Result:
    return runner.invoke(cli_main.app, ["sim", "report", *args])


@pytest.fixture(scope="module")
def quick_report(runner: CliRunner, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result]:
    out = tmp_path_factory.mktemp("report")
    res = invoke(runner, "--out", str(out), "--quick", "--no-replay", "--jobs", "2")
    return out, res


@needs_trace
@pytest.mark.slow
def test_quick_report_writes_markdown_plots_and_json(quick_report: tuple[Path, Result]) -> None:
    out, res = quick_report
    assert res.exit_code == 0, res.output
    assert str(out / "report.md") in res.output.replace("\n", "")
    md = (out / "report.md").read_text()
    for w in QUICK_WORKLOADS:
        assert f"`{w}`" in md
        assert w in res.output  # the summary table on the terminal
    for p in QUICK_POLICIES:
        assert f"| {p} |" in md
    assert "Static vs pooled" in md
    assert "Philly" not in md.split("## 2.")[1]  # --no-replay
    for w in QUICK_WORKLOADS:
        for kind in ("alloc", "frag"):
            png = out / f"{kind}_{w}.png"
            assert png.read_bytes()[:8] == PNG_MAGIC, png
            assert f"]({png.name})" in md
    assert not (out / "queue_cdf.png").exists()


@needs_trace
@pytest.mark.slow
def test_quick_report_results_json(quick_report: tuple[Path, Result]) -> None:
    out, _ = quick_report
    data = json.loads((out / "results.json").read_text())  # strict: NaN would be an error below
    json.dumps(data, allow_nan=False)
    runs = data["fill"]["runs"]
    assert {(r["workload"], r["policy"]) for r in runs} == {
        (w, p) for w in QUICK_WORKLOADS for p in QUICK_POLICIES
    }
    assert all(r["seed"] == 42 for r in runs)
    # offline references come from the default-policy runs only
    assert all((r["offline_ffd_unallocated_pct"] is not None) == (r["policy"] == "default") for r in runs)
    summary = {r["workload"]: r for r in data["summary"]}
    for w in QUICK_WORKLOADS:
        row = summary[w]
        assert row["published_fgd"] > 0 and row["ours_fgd"] > 0
        assert row["lower_bound"] <= row["offline_ffd"] <= row["ours_default"]
    sharing = data["static_vs_pooled"]
    assert sharing["pooled"]["pods_placed"] >= sharing["static"]["pods_placed"]
    assert data["philly"] is None


@pytest.mark.parametrize(
    ("text", "seeds"),
    [
        ("42-46", (42, 43, 44, 45, 46)),
        ("42", (42,)),
        ("42,44", (42, 44)),
        (" 42-43 , 50 ", (42, 43, 50)),
        ("43,42-44", (43, 42, 44)),
    ],
)
def test_parse_seeds(text: str, seeds: tuple[int, ...]) -> None:
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["", "a", "42-", "-3", "46-42", "42,,43", "1.5", "0-5000"])
def test_parse_seeds_rejects(text: str) -> None:
    with pytest.raises(InvalidInput, match="--seeds"):
        parse_seeds(text)


def test_parse_names() -> None:
    assert parse_names("b, a,b", ("a", "b"), "--x") == ("b", "a")
    with pytest.raises(InvalidInput, match=r"--x: unknown name 'c' \(choose from a, b\)"):
        parse_names("a,c", ("a", "b"), "--x")


@needs_trace
def test_quick_defaults_yield_to_explicit_options(tmp_path: Path) -> None:
    cfg = ReportConfig.from_options(tmp_path / "r", seeds="43", quick=True, replay=False)
    assert cfg.seeds == (43,)
    assert cfg.workloads == QUICK_WORKLOADS and cfg.policies == QUICK_POLICIES
    assert cfg.reference_policy == "default"
    cfg = ReportConfig.from_options(tmp_path / "r", policies="fgd,bestfit", replay=False)
    assert cfg.seeds == (42, 43, 44, 45, 46) and len(cfg.workloads) == 7
    assert cfg.reference_policy == "fgd"


def test_stat_and_table() -> None:
    s = Stat.of([1.0, 3.0, float("nan")])
    assert (s.mean, s.n) == (2.0, 2) and s.sd == pytest.approx(2**0.5)
    assert Stat.of([]).n == 0
    assert md_table(["a", "b"], [["x", "1"]], right=[1]) == "| a | b |\n| --- | ---: |\n| x | 1 |"


def _one_line_error(res: Result, *needles: str) -> None:
    assert res.exit_code != 0
    text = res.output
    assert "Traceback" not in text
    assert res.exception is None or isinstance(res.exception, SystemExit)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, text
    for n in needles:
        assert n in lines[0], text


@needs_trace
@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--workloads", "default,nope"], ("--workloads", "'nope'", "gpushare40")),
        (["--policies", "fgd,magic"], ("--policies", "'magic'", "bestfit")),
        (["--seeds", "42..46"], ("--seeds", "42..46")),
        (["--seeds", "46-42"], ("--seeds", "ends before it starts")),
    ],
)
def test_bad_input_is_one_line(
    runner: CliRunner, tmp_path: Path, args: list[str], needles: tuple[str]
) -> None:
    res = invoke(runner, "--out", str(tmp_path / "r"), "--no-replay", *args)
    _one_line_error(res, "error", *needles)
    assert not (tmp_path / "r" / "report.md").exists()


@needs_trace
def test_unwritable_out_is_one_line(runner: CliRunner, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    res = invoke(runner, "--out", str(blocker / "sub"), "--quick", "--no-replay")
    _one_line_error(res, "error", "--out", "cannot write")
