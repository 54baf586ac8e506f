"""The dashboard in a real browser (Debian's Chromium driven by Playwright) against `cpool up`.

One pool (HTTPS, two simulated A100s) and one browser for the module; each test has its own
browser context (its own cookies). With CPOOL_SCREENSHOTS=1 the pages are saved to docs/img/.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
from e2e_helpers import JOB_PYTHON, Pool, local_pool, sleeper, wait_for  # noqa: E402
from webkit import make_user  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium package", pytrace=False)
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)", allow_module_level=True)

from playwright.sync_api import Browser, BrowserContext, Page, expect, sync_playwright  # noqa: E402

DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
ENDED = re.compile(r"^(released|failed|cancelled|preempted)$")
WAIT_MS = 30_000


class Kit:
    def __init__(self, pool: Pool, browser: Browser, tokens: dict[str, str]) -> None:
        self.pool, self.browser, self.tokens = pool, browser, tokens

    def context(self, script: bool = True) -> BrowserContext:
        # cpool up's certificate is its own (self-signed): trusted for this test's browser only
        return self.browser.new_context(
            ignore_https_errors=True, viewport={"width": 1360, "height": 900}, java_script_enabled=script
        )

    def sign_in(self, who: str, script: bool = True) -> tuple[BrowserContext, Page]:
        ctx = self.context(script)
        page = ctx.new_page()
        page.goto(self.pool.url + "/")
        page.fill("#token", self.tokens[who])
        page.click("#sign-in")
        expect(page.locator("#who")).to_contain_text(who)
        return ctx, page

    def job(self, who: str, code: str, **kw: Any) -> int:
        body = {"command": [JOB_PYTHON, "-c", code], "cpu_milli": 100, **kw}
        r = self.pool.http.post(
            "/api/v1/allocations", json=body, headers={"Authorization": f"Bearer {self.tokens[who]}"}
        )
        assert r.status_code == 201, r.text
        return int(r.json()["id"])


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kit]:
    # the ledger books every second, so the usage page has figures by the time it is shown
    with local_pool(
        tmp_path_factory.mktemp("web"), simulate="2xA100-80GB", extra=("--ledger-interval", "1")
    ) as (_, pool):
        tokens = {
            "admin": str(pool.http.headers["Authorization"]).split(" ", 1)[1],
            "alice": make_user(pool.http, "alice", "alpha", "member"),
            "bob": make_user(pool.http, "bob", "beta", "member"),
        }
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM,
                args=["--disable-background-networking", "--disable-component-update", "--no-sandbox"],
            )
            try:
                yield Kit(pool, browser, tokens)
            finally:
                browser.close()


def shoot(page: Page, name: str) -> None:
    if os.environ.get("CPOOL_SCREENSHOTS") == "1":
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(DOCS_IMG / f"dashboard-{name}.png"), full_page=True)


def test_a_wrong_token_is_refused(kit: Kit) -> None:
    ctx = kit.context()
    page = ctx.new_page()
    page.goto(kit.pool.url + "/")
    page.fill("#token", "0123456789ab.not-a-real-secret")
    page.click("#sign-in")
    expect(page.locator("#page-error")).to_contain_text("token refused")
    assert ctx.cookies() == []
    ctx.close()


def test_sign_in_then_a_job_appears_runs_and_ends(kit: Kit) -> None:
    ctx, page = kit.sign_in("admin")
    cookies = {c["name"]: c for c in ctx.cookies()}
    session = cookies["cpool_session"]
    assert session["httpOnly"] and session["secure"] and session["sameSite"] == "Strict"
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)
    page.goto(kit.pool.url + "/ui/work?state=all")
    alloc = kit.job("alice", sleeper(1, "hello from the dashboard test"), name="webjob")
    row = page.locator(f"#alloc-{alloc}")
    expect(row).to_contain_text("webjob", timeout=WAIT_MS)
    expect(row).to_contain_text("alpha")
    expect(row.locator(".state")).to_have_text(ENDED, timeout=WAIT_MS)
    assert kit.pool.state(alloc) == row.locator(".state").inner_text()
    page.click(f"#alloc-{alloc} a")
    expect(page.locator("#stdout")).to_contain_text("hello from the dashboard test", timeout=WAIT_MS)
    assert errors == []
    ctx.close()


def test_cancel_a_running_job_from_its_page(kit: Kit) -> None:
    ctx, page = kit.sign_in("alice")
    code = "import time\nprint('step 1 of 1000', flush=True)\ntime.sleep(120)\n"
    alloc = kit.job("alice", code, name="longjob", gpus=1, gpu_milli=500)
    page.goto(f"{kit.pool.url}/ui/work/{alloc}")
    expect(page.locator("#field-state")).to_have_text("active", timeout=WAIT_MS)
    expect(page.locator("#stdout")).to_have_text("step 1 of 1000\n", timeout=WAIT_MS)  # live, while it runs
    page.click("#cancel")
    page.click("#cancel-confirm")
    expect(page.locator("#action-msg")).to_have_text("cancelled")
    assert kit.pool.state(alloc) == "cancelled"
    expect(page.locator("#field-state")).to_have_text("cancelled", timeout=WAIT_MS)
    expect(page.locator("#cancel")).to_be_hidden()
    ctx.close()


def test_a_member_does_not_see_another_tenants_work(kit: Kit) -> None:
    theirs = kit.job("alice", sleeper(60), name="alphas-secret")
    ctx, page = kit.sign_in("bob")
    mine = kit.job("bob", "print('beta')", name="betas-own")
    page.goto(kit.pool.url + "/ui/work?state=all")
    expect(page.locator(f"#alloc-{mine}")).to_contain_text("betas-own", timeout=WAIT_MS)
    expect(page.locator("#allocations")).not_to_contain_text("alphas-secret")
    assert page.locator(f"#alloc-{theirs}").count() == 0
    r = page.goto(f"{kit.pool.url}/ui/work/{theirs}")
    assert r is not None and r.status == 404
    expect(page.locator("#page-error")).to_have_text(f"allocation '{theirs}' not found")
    page.goto(kit.pool.url + "/ui/audit")
    expect(page.locator("#audit")).to_contain_text("not allowed")
    ctx.close()
    kit.pool.http.post(f"/api/v1/allocations/{theirs}/cancel")


def test_every_page_renders_without_script_errors(kit: Kit) -> None:
    """Also the screenshots for the docs: a fractional job and a whole-device job running."""
    jobs = [
        kit.job("alice", sleeper(60), name="train-small", gpus=1, gpu_milli=500),
        kit.job("bob", sleeper(60), name="train-large", gpus=1),
    ]
    ctx, page = kit.sign_in("admin")
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)
    expect(page.locator("#card-running .value")).to_have_text("2", timeout=WAIT_MS)
    waiting = kit.job("alice", sleeper(1), name="needs-a-whole-gpu", gpus=1)  # neither device is free
    jobs.append(waiting)
    expect(page.locator("#heatmap .cell")).to_have_count(2)
    expect(page.locator("#heatmap")).to_contain_text("alloc 50%")
    expect(page.locator("#heatmap")).to_contain_text("alloc 100%")
    # the scheduler's own words, once a cycle has looked at it (until then: "submitted")
    why = wait_for(
        "the scheduler's reason", lambda: (r := kit.pool.get(waiting)["reason"]) != "submitted" and r, 30
    )
    expect(page.locator(f"#pending-{waiting}")).to_contain_text(why, timeout=WAIT_MS)
    shoot(page, "overview")
    for name, ready in (
        ("nodes", "#nodes table"),
        ("work", f"#alloc-{jobs[0]}"),
        ("tenants", "#tenant-alpha"),
        ("usage", "#usage > *"),
        ("alerts", "#alerts > *"),
        ("audit", "#audit table"),
    ):
        page.goto(f"{kit.pool.url}/ui/{name}")
        expect(page.locator(ready).first).to_be_visible(timeout=WAIT_MS)
        if name == "usage":  # the ledger books each second: both tenants' jobs show, as the API says
            expect(page.locator("#usage")).to_contain_text("alpha", timeout=WAIT_MS)
            expect(page.locator("#usage")).to_contain_text("beta", timeout=WAIT_MS)
            r = kit.pool.http.get("/api/v1/usage", params={"by": "tenant", "since": "7d"})
            assert r.status_code == 200, r.text
            for row in r.json()["items"]:
                expect(page.locator("#usage")).to_contain_text(row["tenant"])
        if name in ("overview", "nodes", "work", "usage"):
            shoot(page, name)
    assert errors == []
    for alloc in jobs:
        kit.pool.http.post(f"/api/v1/allocations/{alloc}/cancel")
    page.click("#sign-out")
    expect(page.locator("#token")).to_be_visible()
    assert [c["name"] for c in ctx.cookies()] == []
    ctx.close()


class Busy:
    """Both devices held (alice half of one, bob the other whole) and one request waiting."""

    def __init__(self, held: list[int], waiting: int, why: str) -> None:
        self.held, self.waiting, self.why = held, waiting, why


@pytest.fixture(scope="module")
def busy(kit: Kit) -> Iterator[Busy]:
    held = [
        kit.job("alice", sleeper(120), name="hold-half", gpus=1, gpu_milli=500),
        kit.job("bob", sleeper(120), name="hold-whole", gpus=1),
    ]
    for alloc in held:
        wait_for(f"allocation {alloc} active", lambda a=alloc: kit.pool.state(a) == "active", 30)
    waiting = kit.job("alice", sleeper(1), name="wait-whole", gpus=1)
    why = wait_for(
        "the scheduler's reason", lambda: (r := kit.pool.get(waiting)["reason"]) != "submitted" and r, 30
    )
    yield Busy(held, waiting, why)
    for alloc in [*held, waiting]:
        kit.pool.http.post(f"/api/v1/allocations/{alloc}/cancel")


def test_work_filters_search_pages_and_pins_pending(kit: Kit, busy: Busy) -> None:
    batch = [kit.job("alice", f"print({i})", name=f"batch-{i}") for i in range(6)]
    for alloc in batch:
        wait_for(f"allocation {alloc} ended", lambda a=alloc: ENDED.match(kit.pool.state(a)), 30)
    ctx, page = kit.sign_in("admin")
    page.goto(kit.pool.url + "/ui/work")  # by default: active and pending only
    expect(page.locator("#allocations tbody tr").first).to_have_id(f"alloc-{busy.waiting}")
    expect(page.locator(f"#alloc-{busy.held[0]}")).to_be_visible()
    assert page.locator(f"#alloc-{batch[0]}").count() == 0
    shoot(page, "work")
    page.goto(kit.pool.url + "/ui/work?state=all&per=5")
    rows = page.locator("#allocations tbody tr")
    expect(rows).to_have_count(5)
    expect(rows.first).to_have_id(f"alloc-{busy.waiting}")  # pinned above newer, ended work
    expect(rows.first).to_contain_text("ago")
    page.click("#page-next")
    expect(page.locator("#work-count")).to_contain_text("page 2 of")
    assert "page=2" in page.url and "per=5" in page.url
    ctx.close()
    # the filters are a plain GET form: they work with the script off
    ctx, plain = kit.sign_in("admin", script=False)
    plain.goto(kit.pool.url + "/ui/work?state=all")
    plain.select_option("#f-tenant", "alpha")
    plain.fill("#f-q", "batch-3")
    plain.click("#f-apply")
    assert "tenant=alpha" in plain.url and "q=batch-3" in plain.url
    expect(plain.locator("#allocations tbody tr")).to_have_count(1)
    expect(plain.locator(f"#alloc-{batch[3]}")).to_contain_text("batch-3")
    plain.goto(kit.pool.url + "/ui/work?state=all&tenant=beta")
    expect(plain.locator(f"#alloc-{busy.held[1]}")).to_be_visible()
    assert plain.locator(f"#alloc-{busy.held[0]}").count() == 0
    ctx.close()


def test_overview_bars_chart_denominators_and_alerts(kit: Kit, busy: Busy) -> None:
    ctx, page = kit.sign_in("admin")
    expect(page.locator("#card-allocated .value")).to_have_text("1.5 / 2 GPUs")
    expect(page.locator("#card-used .value")).to_contain_text(" / 2 GPUs")
    expect(page.locator("#card-nodes .value")).to_have_text("1 / 1")
    # a bar's length is the share of its device: alice's half slice is half the track
    half = page.locator("#heatmap .cell", has_text="alloc 50%")
    track = float(half.locator("rect.track").first.get_attribute("width") or 0)
    assert float(half.locator("rect.alloc").get_attribute("width") or 0) == pytest.approx(track / 2)
    whole = page.locator("#heatmap .cell", has_text="alloc 100%")
    assert float(whole.locator("rect.alloc").get_attribute("width") or 0) == pytest.approx(track)
    expect(page.locator("#heatmap")).to_contain_text("0.5 / 1 GPU")
    expect(page.locator("#history-chart svg polyline.line-alloc")).to_have_count(1)
    expect(page.locator("#pending-chart svg polyline.line-pending")).to_have_count(1)
    expect(page.locator(f"#pending-{busy.waiting}")).to_contain_text("wait-whole")
    expect(page.locator("#firing")).to_be_visible()
    shoot(page, "overview")
    ctx.close()


def test_a_pending_jobs_page_explains_each_node_and_logs_follow_the_tail(kit: Kit, busy: Busy) -> None:
    ctx, page = kit.sign_in("alice")
    page.goto(f"{kit.pool.url}/ui/work/{busy.waiting}")
    expect(page.locator("#field-state")).to_have_text("pending", timeout=WAIT_MS)
    # one row per node, saying what that node lacks for this request (the API counts them)
    rows = page.locator("#why-nodes tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("no exclusive idle GPU")
    r = kit.pool.http.get(f"/api/v1/allocations/{busy.waiting}/explain")
    assert r.status_code == 200 and "no exclusive idle GPU" in r.json()["summary"], r.text
    expect(page.locator("#why-summary")).to_contain_text("no exclusive idle GPU")
    position = r.json()["queue_position"]
    expect(page.locator("#why-queue")).to_contain_text(f"Queue position {position} among alpha")
    expect(page.locator("#why-queue")).to_contain_text("priority 0")
    expect(page.locator("#why-quota")).to_contain_text("GPUs")
    shoot(page, "pending")
    # a long log shows its tail: the view is scrolled to the end
    chatty = kit.job("alice", "for i in range(400): print('line', i, flush=True)", name="chatty")
    page.goto(f"{kit.pool.url}/ui/work/{chatty}")
    expect(page.locator("#stdout")).to_contain_text("line 399", timeout=WAIT_MS)
    expect(page.locator("#why-nodes")).to_have_count(0)
    at_end = "e => e.scrollHeight > e.clientHeight && e.scrollTop + e.clientHeight >= e.scrollHeight - 8"
    assert page.locator("#stdout").evaluate(at_end)
    ctx.close()


def test_nodes_page_shows_units_power_health_and_allocated_capacity(kit: Kit, busy: Busy) -> None:
    node = kit.pool.http.get("/api/v1/nodes").json()["items"][0]
    name, devices = node["name"], node["devices"]
    ctx, page = kit.sign_in("admin")
    page.goto(kit.pool.url + "/ui/nodes")
    cpus = f"{node['cpu_milli'] / 1000:g}"
    expect(page.locator(f"#node-{name}-cpu")).to_have_text(re.compile(rf"^CPU [0-9.]+ / {cpus} allocated$"))
    expect(page.locator(f"#node-{name}-mem")).to_contain_text("GiB allocated")
    first = page.locator(f"#device-{name}-0")
    expect(first).to_contain_text(f"/ {devices[0]['memory_mib'] // 1024} GiB")
    if devices[0]["power_w"] is not None:  # A100: its rated board power is the denominator
        expect(first).to_contain_text("/ 400 W")
    expect(first.locator(".health .state")).to_have_text("ok")
    expect(page.locator("#nodes")).to_contain_text("0.5 / 1 GPU")  # alice's half slice
    expect(page.locator("#nodes svg.spark")).to_have_count(2 * len(devices))
    shoot(page, "nodes")
    ctx.close()


def test_usage_chart_csv_download_and_silencing_an_alert_rule(kit: Kit, busy: Busy) -> None:
    ctx, page = kit.sign_in("admin")
    page.goto(kit.pool.url + "/ui/usage?by=tenant&since=7d")
    chart = page.locator("#usage-chart svg")
    expect(chart.locator("polygon")).to_have_count(2)  # alpha and beta, stacked
    expect(chart.locator("polygon.stack-0 title")).to_have_text("alpha")
    expect(page.locator("#efficiency")).to_be_visible()
    static = kit.pool.http.get("/api/v1/usage/static-equivalent", params={"since": "7d"}).json()
    assert static["clipped"]  # the pool is minutes old: savings count only its life
    expect(page.locator("#static-window")).to_contain_text("only its life is counted")
    with page.expect_download() as got:
        page.click("#csv")
    text = Path(got.value.path()).read_text()
    assert text.splitlines()[0].startswith("tenant,gpu_hours,cpu_hours")
    assert {line.split(",")[0] for line in text.splitlines()[1:]} >= {"alpha", "beta"}
    shoot(page, "usage")
    # silencing a rule: the API's audited rule change, from a form carrying the CSRF token
    page.click("#rule-node-lost-toggle")
    expect(page.locator("#rule-node-lost")).to_contain_text("silenced")
    rules = {r["name"]: r for r in kit.pool.http.get("/api/v1/alert-rules").json()["items"]}
    assert rules["node-lost"]["enabled"] is False
    last = kit.pool.http.get("/api/v1/audit", params={"limit": 1000}).json()["items"][-1]
    assert (last["action"], last["target"], last["actor"]) == (
        "alert.rule.set",
        "alert-rule:node-lost",
        "user:admin",
    )
    page.click("#rule-node-lost-toggle")
    expect(page.locator("#rule-node-lost")).to_contain_text("on")
    forged = page.request.post(kit.pool.url + "/ui/alert-rules/node-lost/silence", form={"csrf": "forged"})
    assert forged.status == 403
    ctx.close()
    ctx, page = kit.sign_in("alice")  # a member: no buttons, and the route refuses
    page.goto(kit.pool.url + "/ui/usage")
    expect(page.locator("#rules")).to_be_visible()
    assert page.locator("#rules button").count() == 0
    csrf = page.locator('meta[name="csrf-token"]').get_attribute("content") or ""
    refused = page.request.post(kit.pool.url + "/ui/alert-rules/node-lost/silence", form={"csrf": csrf})
    assert refused.status == 403
    rules = {r["name"]: r for r in kit.pool.http.get("/api/v1/alert-rules").json()["items"]}
    assert rules["node-lost"]["enabled"] is True
    ctx.close()


def test_hostile_text_in_a_search_and_a_command_stays_text(kit: Kit) -> None:
    hostile = "<img src=x onerror=window.pwned=1>"
    alloc = kit.job("alice", f"print(1)  # {hostile}", name="hostile")
    ctx, page = kit.sign_in("admin")
    page.goto(f"{kit.pool.url}/ui/work?state=all&q={quote(hostile)}")
    expect(page.locator(f"#alloc-{alloc}")).to_be_visible()  # the search matched the command
    expect(page.locator("#f-q")).to_have_value(hostile)
    page.goto(f"{kit.pool.url}/ui/work/{alloc}")
    expect(page.locator("#field-command")).to_contain_text(hostile)
    assert page.locator("main img").count() == 0
    assert page.evaluate("window.pwned === undefined")
    ctx.close()


def test_a_member_sees_only_its_tenant_on_the_new_views(kit: Kit, busy: Busy) -> None:
    ctx, page = kit.sign_in("bob")
    page.goto(kit.pool.url + "/")
    expect(page.locator("#card-allocated .value")).to_have_text("1 / 2 GPUs")  # bob's whole device
    assert page.locator(f"#pending-{busy.waiting}").count() == 0
    expect(page.locator("#heatmap")).not_to_contain_text("alpha")
    page.goto(kit.pool.url + "/ui/work?state=all&tenant=alpha")
    expect(page.locator("#allocations")).to_contain_text("no allocations match")
    page.goto(kit.pool.url + "/ui/nodes")
    expect(page.locator("#nodes")).to_contain_text("beta")
    expect(page.locator("#nodes")).not_to_contain_text("alpha")
    page.goto(kit.pool.url + "/ui/usage")
    expect(page.locator("#usage")).to_contain_text("beta")
    expect(page.locator("main")).not_to_contain_text("alpha")
    csv = page.request.get(kit.pool.url + "/ui/usage.csv?by=user&since=1d")
    assert csv.ok and "alpha" not in csv.text() and "beta" in csv.text()
    r = page.goto(f"{kit.pool.url}/ui/work/{busy.waiting}")
    assert r is not None and r.status == 404
    expect(page.locator("#why-nodes")).to_have_count(0)
    ctx.close()
