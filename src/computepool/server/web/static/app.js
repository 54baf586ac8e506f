// ComputePool dashboard: fills the server-rendered page shells from the JSON API (/api/v1) with
// the session cookie, and refreshes them every two seconds. Data is only ever placed with
// textContent (never as HTML); writes carry the session's CSRF token in X-CSRF-Token.
"use strict";

(() => {
  const POLL_MS = 2000;
  const LOG_CAP = 2_000_000; // characters of a log kept on the page
  const HOLDING = ["bound", "active"];
  const LIVE = ["pending", "bound", "active"];
  const body = document.body;
  const page = body.dataset.page;
  const me = { name: body.dataset.user, role: body.dataset.role, tenant: body.dataset.tenant };
  const csrfMeta = document.querySelector('meta[name="csrf-token"]');
  const csrf = csrfMeta ? csrfMeta.content : "";

  // ---- talking to the API -------------------------------------------------------------------

  async function api(path, method = "GET") {
    const init = { method, credentials: "same-origin", headers: { Accept: "application/json" } };
    if (method !== "GET") init.headers["X-CSRF-Token"] = csrf;
    let res;
    try {
      res = await fetch("/api/v1" + path, init);
    } catch (e) {
      return { status: 0, ok: false, data: null, error: "the control plane cannot be reached" };
    }
    let data = null;
    try {
      data = await res.json();
    } catch (e) {
      data = null;
    }
    if (res.status === 401) window.location.assign("/"); // the session ended: sign in again
    const error = data && data.error ? data.error : res.statusText || "HTTP " + res.status;
    return { status: res.status, ok: res.ok, data, error };
  }

  const items = (r) => (r.ok && r.data && Array.isArray(r.data.items) ? r.data.items : []);

  // ---- building the DOM (text only) ---------------------------------------------------------

  function h(tag, props, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = String(v);
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, String(v));
    }
    for (const kid of kids.flat(Infinity)) {
      if (kid === undefined || kid === null) continue;
      e.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
    return e;
  }

  function put(id, node) {
    const box = document.getElementById(id);
    if (box) box.replaceChildren(node);
  }

  // cols: [{label, value(row) → text or Node, cls}]; rowId(row) names the row (tests and links)
  function table(cols, rows, empty, rowId) {
    if (!rows.length) return h("p", { class: "empty", text: empty || "nothing" });
    return h(
      "table",
      {},
      h("thead", {}, h("tr", {}, cols.map((c) => h("th", { text: c.label, class: c.cls })))),
      h(
        "tbody",
        {},
        rows.map((r) =>
          h("tr", { id: rowId ? rowId(r) : null }, cols.map((c) => h("td", { class: c.cls }, c.value(r)))),
        ),
      ),
    );
  }

  function message(text, cls = "empty") {
    return h("p", { class: cls, text });
  }

  // ---- formatting ---------------------------------------------------------------------------

  const dash = "—";
  function num(x, digits = 1) {
    if (x === null || x === undefined || Number.isNaN(x)) return dash;
    const v = Number(x);
    // small non-zero figures (a few GPU-seconds as GPU-hours) keep three significant digits
    if (v !== 0 && Math.abs(v) < Math.pow(10, -digits)) return v.toPrecision(3);
    return v.toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: 0 });
  }
  const pct = (x) => (x === null || x === undefined ? dash : num(x, 0) + "%");
  const when = (iso) => (iso ? new Date(iso).toLocaleString() : dash);
  function ago(iso) {
    if (!iso) return dash;
    const s = Math.max(0, (Date.now() - new Date(iso).getTime()) / 1000);
    if (s < 90) return Math.round(s) + " s";
    if (s < 5400) return Math.round(s / 60) + " min";
    if (s < 172800) return num(s / 3600, 1) + " h";
    return num(s / 86400, 1) + " d";
  }
  function resources(req) {
    const parts = [];
    if (req.gpus) {
      const share = req.gpu_milli < 1000 ? num(req.gpu_milli / 1000, 3) + " of " : "";
      parts.push(share + req.gpus + " GPU" + (req.gpus > 1 ? "s" : "") + (req.gang_nodes > 1 ? " × " + req.gang_nodes + " nodes" : ""));
    }
    if (req.mig) parts.push("MIG " + req.mig);
    if (req.cpu_milli) parts.push(num(req.cpu_milli / 1000, 2) + " CPU");
    if (req.memory_mib) parts.push(num(req.memory_mib, 0) + " MiB");
    return parts.join(", ") || "none";
  }
  function stateBadge(state) {
    return h("span", { class: "state state-" + state, text: state });
  }
  function allocLink(a) {
    return h("a", { href: "/ui/work/" + Number(a.id), text: "#" + Number(a.id) });
  }
  // ---- views --------------------------------------------------------------------------------

  // parts the server renders ([data-live]): fetch the same address again and swap in
  // each [data-live] region by id; the server escaped every value, and DOMParser runs no script.
  // Expanded <details> stay expanded across the swap.
  async function serverView() {
    let res;
    try {
      res = await fetch(window.location.href, { credentials: "same-origin", headers: { Accept: "text/html" } });
    } catch (e) {
      throw new Error("the control plane cannot be reached");
    }
    if (res.redirected || res.status === 401) {
      window.location.assign("/"); // the session ended: sign in again
      return;
    }
    const doc = new DOMParser().parseFromString(await res.text(), "text/html");
    for (const old of document.querySelectorAll("[data-live]")) {
      const fresh = doc.getElementById(old.id);
      if (!fresh) continue;
      const open = new Set([...old.querySelectorAll("details[open]")].map((d) => d.id));
      for (const d of fresh.querySelectorAll("details")) if (d.id && open.has(d.id)) d.open = true;
      old.replaceWith(document.adoptNode(fresh));
    }
  }

  const logState = { stdout: 0, stderr: 0, ended: false };

  async function allocation() {
    const id = Number(body.dataset.allocId);
    if (!id || !document.getElementById("detail")) return;
    const r = await api("/allocations/" + id);
    if (!r.ok) {
      put("detail", message(r.error, "error"));
      return;
    }
    const a = r.data;
    let why = a.reason;
    if (a.state === "pending") {
      const ex = await api("/allocations/" + id + "/explain");
      if (ex.ok) why = ex.data.summary;
    }
    const rows = [
      ["state", stateBadge(a.state)],
      ["name", a.name || dash],
      ["tenant", a.tenant],
      ["owner", a.owner],
      ["command", a.command ? a.command.join(" ") : dash],
      ["asks for", resources(a.request)],
      ["nodes", a.nodes.join(", ") || dash],
      ["slices", a.slices.map((s) => s.node + " #" + s.device_index + " " + num(s.compute_milli / 1000, 3) + " GPU " + s.isolation).join("; ") || dash],
      ["attempt", String(a.attempt)],
      ["exit code", a.exit_code === null ? dash : String(a.exit_code)],
      ["why", why || dash],
      ["created", when(a.created_at)],
      ["started", when(a.started_at)],
      ["ended", when(a.ended_at)],
    ];
    put("detail", h("dl", { class: "detail" }, rows.map(([k, v]) => [h("dt", { text: k }), h("dd", { id: "field-" + k.replace(" ", "-") }, v)])));
    document.getElementById("cancel").hidden = !LIVE.includes(a.state);
    put(
      "events",
      table(
        [
          { label: "at", value: (e) => when(e.at) },
          { label: "state", value: (e) => e.state },
          { label: "why", value: (e) => e.reason, cls: "reason" },
        ],
        a.events,
        "no history",
      ),
    );
    if (!logState.ended) {
      const lr = await api("/allocations/" + id + "/logs?stdout=" + logState.stdout + "&stderr=" + logState.stderr);
      if (lr.ok) {
        for (const stream of ["stdout", "stderr"]) {
          const pre = document.getElementById(stream);
          const chunk = lr.data[stream];
          // follow the end (the tail), unless the reader scrolled up to read
          const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 8;
          if (chunk.data) pre.textContent = (pre.textContent + chunk.data).slice(-LOG_CAP);
          if (chunk.data && atEnd) pre.scrollTop = pre.scrollHeight;
          logState[stream] = chunk.next;
        }
        logState.ended = lr.data.ended;
      }
    }
  }

  function wireCancel() {
    const button = document.getElementById("cancel");
    if (!button) return;
    const id = Number(body.dataset.allocId);
    const msg = document.getElementById("action-msg");
    button.addEventListener("click", () => {
      const confirmButton = h("button", { type: "button", id: "cancel-confirm", class: "danger", text: "Yes, cancel allocation " + id });
      confirmButton.addEventListener("click", async () => {
        confirmButton.disabled = true;
        const r = await api("/allocations/" + id + "/cancel", "POST");
        msg.replaceChildren(r.ok ? "cancelled" : "not cancelled: " + r.error);
        refresh();
      });
      msg.replaceChildren(confirmButton);
    });
  }

  async function tenants() {
    const [tenantsR, allocsR, usageR] = await Promise.all([
      api("/tenants"),
      api("/allocations?limit=1000"),
      api("/usage?by=tenant&since=30d"),
    ]);
    const list = items(tenantsR);
    const quotas = await Promise.all(list.map((t) => api("/tenants/" + encodeURIComponent(t.name) + "/quota")));
    const allocs = items(allocsR);
    const usage = usageR.ok ? new Map(items(usageR).map((u) => [u.tenant, u])) : null;
    const rows = list.map((t, i) => {
      const q = quotas[i].ok ? quotas[i].data : {};
      const mine = allocs.filter((a) => a.tenant === t.name);
      const inUse = mine
        .filter((a) => HOLDING.includes(a.state))
        .reduce((s, a) => s + a.slices.reduce((u, sl) => u + sl.compute_milli, 0), 0);
      const cpu = mine.filter((a) => HOLDING.includes(a.state)).reduce((s, a) => s + a.request.cpu_milli * a.nodes.length, 0);
      const g = q.gpu_milli;
      return {
        t,
        guaranteed: g ? g.guaranteed / 1000 : null,
        limit: g ? g.limit / 1000 : null,
        inUse: inUse / 1000,
        borrowed: Math.max(0, inUse / 1000 - (g ? g.guaranteed / 1000 : 0)),
        cpu: cpu / 1000,
        running: mine.filter((a) => a.state === "active").length,
        waiting: mine.filter((a) => a.state === "pending").length,
        usage: usage ? usage.get(t.name) || {} : null,
      };
    });
    const fromUsage = (field, digits) => (r) => (r.usage ? num(r.usage[field] || 0, digits) : dash);
    put(
      "tenants",
      table(
        [
          { label: "tenant", value: (r) => r.t.name },
          { label: "weight", value: (r) => num(r.t.weight, 2) },
          { label: "GPUs guaranteed", value: (r) => (r.guaranteed === null ? "none" : num(r.guaranteed, 2)) },
          { label: "GPU limit", value: (r) => (r.limit === null ? "pool" : num(r.limit, 2)) },
          { label: "GPUs in use", value: (r) => num(r.inUse, 2) },
          { label: "borrowed", value: (r) => num(r.borrowed, 2) },
          { label: "CPUs in use", value: (r) => num(r.cpu, 2) },
          { label: "running / waiting", value: (r) => r.running + " / " + r.waiting },
          { label: "GPU-hours", value: fromUsage("gpu_hours", 2) },
          { label: "energy kWh", value: fromUsage("energy_kwh", 2) },
          { label: "cost", value: fromUsage("cost", 2) },
        ],
        rows,
        tenantsR.ok ? "no tenants" : tenantsR.error,
        (r) => "tenant-" + r.t.name,
      ),
    );
  }

  async function alerts() {
    const state = document.getElementById("alert-state").value;
    const [r, rules] = await Promise.all([api("/alerts?state=" + state), api("/alert-rules")]);
    put(
      "alerts",
      r.ok
        ? table(
            [
              { label: "state", value: (a) => stateBadge(a.state) },
              { label: "severity", value: (a) => a.severity },
              { label: "rule", value: (a) => a.rule },
              { label: "subject", value: (a) => a.subject },
              { label: "tenant", value: (a) => a.tenant || dash },
              { label: "since", value: (a) => when(a.since) },
              { label: "resolved", value: (a) => when(a.resolved_at) },
              { label: "summary", value: (a) => a.summary, cls: "reason" },
            ],
            items(r),
            "no alerts",
            (a) => "alert-" + a.id,
          )
        : message(r.status === 404 ? "alerts are not available on this control plane" : r.error, "error"),
    );
    put(
      "rules",
      rules.ok
        ? table(
            [
              { label: "rule", value: (x) => x.name },
              { label: "on", value: (x) => (x.enabled ? "yes" : "no") },
              { label: "threshold", value: (x) => (x.threshold === null ? dash : num(x.threshold, 2) + " " + (x.unit || "")) },
              { label: "for", value: (x) => num(x.duration_s, 0) + " s" },
              { label: "what", value: (x) => x.description, cls: "reason" },
            ],
            items(rules),
            "no rules",
          )
        : message(rules.error, "error"),
    );
  }

  const audit = { after: 0, rows: [], denied: "" };
  const AUDIT_PAGE = 1000;
  const AUDIT_KEEP = 300;

  async function auditView() {
    for (let i = 0; i < 50 && !audit.denied; i++) {
      const r = await api("/audit?after=" + audit.after + "&limit=" + AUDIT_PAGE);
      if (!r.ok) {
        if (r.status === 403) audit.denied = "not allowed: the audit log is for admins and tenant admins";
        else put("audit", message(r.error, "error"));
        break;
      }
      const got = items(r);
      if (got.length) {
        audit.rows = audit.rows.concat(got).slice(-AUDIT_KEEP);
        audit.after = got[got.length - 1].seq;
      }
      if (got.length < AUDIT_PAGE) break;
    }
    if (audit.denied) {
      put("audit", message(audit.denied, "error"));
      return;
    }
    put(
      "audit",
      table(
        [
          { label: "seq", value: (x) => String(x.seq) },
          { label: "time", value: (x) => when(x.time) },
          { label: "actor", value: (x) => x.actor },
          { label: "tenant", value: (x) => x.tenant || dash },
          { label: "action", value: (x) => x.action },
          { label: "target", value: (x) => x.target },
          { label: "outcome", value: (x) => x.outcome },
        ],
        [...audit.rows].reverse(),
        "no records",
      ),
    );
  }

  function wireVerify() {
    const button = document.getElementById("verify");
    if (!button) return;
    button.addEventListener("click", async () => {
      const r = await api("/audit/verify");
      let text;
      if (r.ok) text = r.data.ok ? "intact: " + r.data.records + " records" : "BROKEN at " + r.data.first_broken + ": " + (r.data.cause || "");
      else text = r.status === 403 ? "not allowed" : r.error;
      document.getElementById("verify-msg").textContent = text;
    });
  }

  // ---- the refresh loop ---------------------------------------------------------------------

  const views = {
    allocation,
    tenants,
    alerts,
    audit: auditView,
  };
  let timer = null;
  let running = false;

  async function refresh() {
    clearTimeout(timer);
    const view = views[page];
    const served = document.querySelector("[data-live]") !== null;
    if ((!view && !served) || running) return;
    running = true;
    const live = document.getElementById("live");
    try {
      if (!document.hidden && view) await view();
      if (!document.hidden && served) await serverView();
      if (live) live.textContent = "updated " + new Date().toLocaleTimeString();
    } catch (e) {
      if (live) live.textContent = "not updated: " + e;
    } finally {
      running = false;
      timer = setTimeout(refresh, POLL_MS);
    }
  }

  for (const id of ["alert-state"]) {
    const control = document.getElementById(id);
    if (control) control.addEventListener("change", refresh);
  }
  wireCancel();
  wireVerify();
  refresh();
})();
