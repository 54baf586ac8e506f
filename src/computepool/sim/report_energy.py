"""report.md's energy, cost and no-VC-worse-off sections (kept apart from report_markdown's studies)."""

from __future__ import annotations

from typing import Any

from computepool.sim.report_markdown import fmt, md_table

_ENERGY_ROWS = (
    ("devices", "devices"),
    ("served_gpu_hours", "GPU-hours the requests asked"),
    ("busy_kwh", "energy of devices doing work, kWh"),
    ("idle_held_kwh", "idle energy of devices held but unused, kWh"),
    ("idle_empty_kwh", "idle energy of empty devices, kWh"),
    ("energy_kwh", "energy, kWh"),
    ("cost_devices", "cost of the devices"),
    ("cost_energy", "cost of the energy"),
    ("cost", "cost"),
    ("kwh_per_served_gpu_hour", "kWh per served GPU-hour"),
    ("cost_per_served_gpu_hour", "cost per served GPU-hour"),
)


def _power_lines(model: dict[str, Any], prices: dict[str, Any]) -> list[str]:
    """The stated power model and prices under every energy table."""
    out = ["Power model (`computepool.core.power`):", ""]
    for name, m in model["models"].items():
        out.append(f"- {name}: idle {fmt(m['idle_w'])} W, peak {fmt(m['peak_w'])} W — {m['source']}")
    per = ", ".join(f"{k} {fmt(v)}" for k, v in prices["gpu_hour"].items())
    out += [
        f"- utilization: {model['utilization']}",
        f"- devices holding nothing: {model['empty_devices']}",
        f"- cost: {model['cost']}; prices per GPU-hour {per} and {fmt(prices['kwh'])} per kWh "
        "(placeholders in an abstract unit, not quotes: set your own with `--gpu-price` and `--kwh-price`)",
        "",
    ]
    return out


def sharing_energy_section(sharing: dict[str, Any]) -> list[str]:
    """Static against pooled on the fill-up protocol: energy and cost per hour of each placement."""
    st, po = sharing["static"]["energy"], sharing["pooled"]["energy"]
    headers = ["figure", "static at 100%", "pooled at 100%", "static at the end", "pooled at the end"]
    cols = [st["at_100"], po["at_100"], st["at_end"], po["at_end"]]
    rows = [[label, *(fmt(c[k], 3) for c in cols)] for k, label in _ENERGY_ROWS]

    def saved(at: str, key: str) -> str:
        a, b = float(st[at][key]), float(po[at][key])
        return f"{100.0 * (a - b) / a:.1f}%" if a else "–"

    return [
        "### Energy and cost of each placement, per hour",
        "",
        "Pods never leave in this protocol, so a placement is a steady state: each figure is one hour "
        "of it. A static device held whole for a 300-milli request works at 30%.",
        "",
        md_table(headers, rows, right=range(1, 5)),
        "",
        f"Per GPU-hour the requests asked, the pool uses {saved('at_100', 'kwh_per_served_gpu_hour')} less "
        f"energy and costs {saved('at_100', 'cost_per_served_gpu_hour')} less than static at arrived = 100% "
        f"({saved('at_end', 'kwh_per_served_gpu_hour')} and {saved('at_end', 'cost_per_served_gpu_hour')} "
        "at the end): the same devices serve more requests. The cluster's total draw is higher when pooled "
        "because more of it works; with empty devices powered off (`--empty-off`) only working devices draw.",
        "",
        *_power_lines(st["power_model"], st["prices"]),
    ]


def fair_section(ph: dict[str, Any]) -> list[str]:
    """Guaranteed-share at the smallest pool where no VC is worse off."""
    fp = ph.get("fair_parity")
    if not fp:
        return []
    out = [
        "### No VC worse off: the `guaranteed-share` policy",
        "",
        "At the average parity above most VCs wait longer than alone, because their guarantees shrink "
        "with the pool. Under `guaranteed-share` every VC keeps its whole static size as its guarantee, "
        "however small the pool (guarantees may sum to more than it): a VC below its share is served "
        "before any borrower and takes back GPUs held above another VC's share by preemption; a VC is "
        "never preempted below its own share. The criterion: " + fp["criterion"] + ".",
        "",
    ]
    if fp["nodes"] is None:
        return [*out, "No pooled size up to static's meets it.", ""]
    pooled = fp["pooled"]
    out += [
        f"Smallest such pool: **{fp['nodes']} nodes ({fp['nodes'] * 8:,} GPUs) instead of "
        f"{fp['static_nodes']} ({fp['static_nodes'] * 8:,}), {fp['gpus_saved_pct']:.1f}% fewer GPUs**, "
        f"with every VC waiting no longer than alone; average queueing {fmt(pooled['avg_queue_s'])} s "
        f"against static's {fmt(ph['calibrated']['static']['avg_queue_s'])} s, "
        f"{fmt(pooled['preemptions'])} preemptions, lost work {fmt(pooled['lost_work_pct'])}%. Search probes "
        "(nodes: VCs worse off): "
        + ", ".join(f"{p['nodes']}: {p['vcs_worse_off']}" for p in fp["probes"])
        + ".",
        "",
    ]
    rows = [
        [
            v["partition"],
            fmt(v["static_avg_queue_s"]),
            fmt(v["pooled_avg_queue_s"]),
            fmt(v["static_p95_queue_s"]),
            fmt(v["pooled_p95_queue_s"]),
            "worse off" if v["worse_off"] else "no worse",
        ]
        for v in fp["per_vc"]
    ]
    out += [
        md_table(
            ["VC", "static mean queue s", "pooled mean queue s", "static p95 s", "pooled p95 s", ""],
            rows,
            right=range(1, 5),
        ),
        "",
    ]
    losers = fp.get("proportional_at_same_nodes_worse_off")
    prop = fp["proportional_nodes"]
    line = "With guarantees scaled down to the pool (`proportional`) instead, "
    if losers is not None:
        names = ", ".join(losers) or "none"
        line += f"{len(losers)} VC(s) are worse off on the same {fp['nodes']} nodes ({names}), "
    if prop is None:
        line += "and no pooled size up to static's leaves every VC no worse."
    else:
        line += (
            f"and the smallest pool leaving every VC no worse is {prop} nodes "
            f"({fp['proportional_gpus_saved_pct']:.1f}% fewer GPUs)."
        )
    return [*out, line, ""]


def philly_energy_section(ph: dict[str, Any]) -> list[str]:
    """Energy and cost of the Philly replays over one horizon."""
    en = ph.get("energy")
    if not en:
        return []
    runs = [k for k, v in en.items() if isinstance(v, dict) and "energy_kwh" in v]
    rows = [
        [label, *(fmt(en[r][k], 3) for r in runs)]
        for k, label in (*_ENERGY_ROWS, ("lost_kwh", "energy of lost (preempted) runs, kWh"))
    ]
    out = [
        "### Energy and cost of the Philly replays",
        "",
        f"At the calibrated load, over one horizon of {fmt(en['horizon_hours'])} h (first submit to the last "
        "finish of any run compared: a cluster that finishes earlier still idles until then). A running "
        "job keeps its GPUs at full utilization; a gang's spare GPUs on its last node idle.",
        "",
        md_table(["figure", *runs], rows, right=range(1, len(runs) + 1)),
        "",
    ]
    for k, v in en.items():
        if "_vs_" in k:
            name = k.split("_vs_")[0]
            out.append(
                f"- {name} against static: {fmt(v['energy_saved_kwh'])} kWh ({fmt(v['energy_saved_pct'])}%) "
                f"and {fmt(v['cost_saved'])} ({fmt(v['cost_saved_pct'])}%) saved."
            )
    return [*out, "", *_power_lines(en["power_model"], en["prices"])]
