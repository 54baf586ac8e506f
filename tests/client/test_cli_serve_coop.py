"""`cpool serve NAME --cooperative --model FILE.gguf` and `cpool services explain` against a real
`cpool server`: bad input is one line before anything is sent; the spec the server stores is read
back; explain shows the plan the coop controller keeps (here still measuring: the module's server
has no node that could run a probe), and 404s like the service API for one that is not cooperative."""

from __future__ import annotations

import json

from poolkit import Cli, one_error_line


def test_cooperative_flags_errors_are_one_line(cli: Cli) -> None:
    for args, words in (
        (["big", "--cooperative"], "--model: a cooperative service needs one model file"),
        (["big", "--cooperative", "--model", "tiny.gguf"], "'tiny.gguf' is not an absolute path"),
        (["big", "--cooperative", "--model", "/a.gguf", "--model", "/b.gguf"], "needs one model file"),
        (["big", "--cooperative", "--model", "/m.gguf", "--command", "x"], "--command: a cooperative"),
        (["big", "--cooperative", "--model", "/m.gguf", "--engine-python", "python3"], "--engine-python"),
        (["big", "--command", "x", "--force-split", "2"], "--force-split: only with --cooperative"),
        (["big", "--cooperative", "--model", "/m.gguf", "--min-gain", "fast"], "--min-gain"),
    ):
        line = one_error_line(cli("serve", *args))
        assert words in line, (args, line)


def test_serve_cooperative_then_explain(cli: Cli) -> None:
    r = cli("serve", "coopbig", "--cooperative", "--model", "/var/tmp/m/tiny.gguf", "--engine-python",
            "/opt/llama/bin/python", "--ctx", "256", "--max-nodes", "2", "--min-gain", "1.5",
            "--force-split", "2", "--cpus", "1", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    spec = json.loads(r.stdout)["spec"]
    assert spec["cooperative"] == {
        "model": "/var/tmp/m/tiny.gguf", "model_key": None, "engine_python": "/opt/llama/bin/python",
        "ctx": 256, "max_nodes": 2, "min_gain": 1.5, "force_split": 2, "probe_tokens": 32,
    }  # fmt: skip
    assert spec["min_replicas"] == spec["max_replicas"] == 1
    assert spec["health_path"] == "/health"
    assert spec["request"]["cpu_milli"] == 1000 and spec["request"].get("command") is None
    shown = cli("services", "explain", "coopbig", "--json")
    assert shown.exit_code == 0, shown.output
    plan = json.loads(shown.stdout)
    assert plan["service"] == "coopbig" and plan["status"] in ("measuring", "failed")
    text = cli("services", "explain", "coopbig")
    assert text.exit_code == 0 and "coopbig" in text.stdout and "reason:" in text.stdout, text.output
    # a service that is not cooperative has no plan: 404, one line
    assert cli("serve", "plainsvc", "--command", "python3 -m http.server", "--no-code").exit_code == 0
    line = one_error_line(cli("services", "explain", "plainsvc"))
    assert "service 'plainsvc' not found" in line
    assert cli("serve", "coopbig", "--delete").exit_code == 0
    assert cli("serve", "plainsvc", "--delete").exit_code == 0
