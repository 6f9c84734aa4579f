// llm-qos live dashboard: polls dashboard.json once a second with the admin key.
// The key lives in this tab's sessionStorage only and goes out as a Bearer header; every
// value from the server is written with textContent (user ids may be any string).
"use strict";

(() => {
  const KEY_STORE = "llm-qos.admin-key";
  const DATA_URL = "dashboard.json"; // next to this page: /admin/dashboard.json
  const POLL_MS = 1000;
  const HISTORY = 120; // points kept for the charts (two minutes at one a second)
  const SVG = "http://www.w3.org/2000/svg";

  let timer = null;
  let history = []; // {queued, inflight, tokens: {group: tokens/s}}

  const $ = (sel, root = document) => root.querySelector(sel);

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") node.className = v;
      else if (k.startsWith("data-")) node.setAttribute(k, v);
      else node[k] = v;
    }
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  }

  // ---------------------------------------------------------------- formatting
  const dash = "–";
  const num = (x, digits = 0) => (x === null || x === undefined ? dash : Number(x).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits }));
  const pct = (x) => (x === null || x === undefined ? dash : (100 * x).toFixed(1) + " %");
  function secs(x) {
    if (x === null || x === undefined) return dash;
    if (x < 1) return Math.round(x * 1000) + " ms";
    if (x < 60) return x.toFixed(1) + " s";
    return Math.floor(x / 60) + " min " + Math.round(x % 60) + " s";
  }

  function bar(value, mark, text, hot = false) {
    const b = el("span", { class: "bar" + (hot ? " hot" : "") });
    const v = value === null || value === undefined ? 0 : Math.max(0, Math.min(1, value));
    const fill = el("span", { class: "fill" });
    fill.style.width = (100 * v).toFixed(2) + "%";
    b.append(fill);
    if (mark !== null && mark !== undefined) {
      const m = el("span", { class: "mark", title: pct(mark) });
      m.style.left = "calc(" + (100 * Math.max(0, Math.min(1, mark))).toFixed(2) + "% - 1px)";
      b.append(m);
    }
    return [b, el("span", { class: "bar-text" }, text)];
  }

  function cell(field, content, cls = "") {
    const td = el("td", { class: cls, "data-field": field });
    if (Array.isArray(content)) td.append(...content);
    else td.textContent = content;
    return td;
  }

  // ---------------------------------------------------------------- status
  function setStatus(state, text) {
    const s = $("#status");
    s.dataset.state = state;
    s.textContent = text;
  }

  function askForKey(message) {
    stop();
    $("#board").hidden = true;
    $("#forget").hidden = true;
    $("#key-panel").hidden = false;
    $("#key-message").textContent = message || "";
    $("#key").focus();
  }

  // ---------------------------------------------------------------- rendering
  function render(d) {
    $("#board").hidden = false;
    $("#key-panel").hidden = true;
    $("#forget").hidden = false;
    $("#config-hash").textContent = d.config_hash || dash;
    // covered_s: the history behind the rates; short after start-up, long after a pause in polling
    $("#window").textContent = d.covered_s < d.window_s ? `${num(d.covered_s, 0)} s (filling ${num(d.window_s)} s)` : `${num(d.covered_s, 0)} s`;
    $("#w-in").textContent = d.cost.input_weight;
    $("#w-out").textContent = d.cost.output_weight;

    const sum = $("#summary");
    let tokens = null;
    for (const g of d.groups) if (g.tokens_per_s !== null) tokens = (tokens || 0) + g.tokens_per_s;
    $('[data-field="inflight"]', sum).textContent = num(d.inflight);
    $('[data-field="capacity"]', sum).textContent = num(d.capacity);
    $('[data-field="queued"]', sum).textContent = num(d.queued);
    $('[data-field="tokens_per_s"]', sum).textContent = num(tokens, 1);
    $('[data-field="refusals_per_s"]', sum).textContent = num(d.refusals.per_s, 2);

    $("#groups tbody").replaceChildren(
      ...d.groups.map((g) =>
        el(
          "tr",
          { "data-group": g.name },
          cell("name", g.name),
          cell("queued", num(g.queued), "num"),
          cell("oldest_wait_s", g.queued ? secs(g.oldest_wait_s) : dash, "num"),
          cell("inflight", num(g.inflight), "num"),
          cell("queue_wait", `${secs(g.queue_wait_s.p50)} / ${secs(g.queue_wait_s.p95)}`, "num"),
          cell("tokens_per_s", num(g.tokens_per_s, 1), "num"),
          cell("service_share", bar(g.service_share, g.min_share || null, pct(g.service_share) + (g.min_share ? ` ≥ ${pct(g.min_share)}` : "")), "share"),
          cell("refusals", num(g.refusals), "num"),
        ),
      ),
    );

    $("#users-total").textContent = `${d.users.top.length} of ${num(d.users.total)} users tracked, by recent service`;
    $("#users tbody").replaceChildren(
      ...d.users.top.map((u) =>
        el(
          "tr",
          { "data-user": u.id },
          cell("id", u.id),
          cell("group", u.group),
          cell("weight", num(u.weight, 2), "num"),
          cell("queued", num(u.queued), "num"),
          cell("service_per_s", num(u.service_per_s, 1), "num"),
          cell("service_share", bar(u.service_share, u.weight_share, `${pct(u.service_share)} / ${pct(u.weight_share)}`), "share"),
        ),
      ),
    );

    $("#engines tbody").replaceChildren(
      ...d.engines.map((e) => {
        const used = e.capacity ? e.inflight / e.capacity : 0;
        const signal = { ok: "ok", off: "warn", no_signal: "warn", waiting: "warn", stale: "bad" }[e.load_signal] || "warn";
        return el(
          "tr",
          { "data-engine": e.name },
          cell("name", [
            el("span", {}, e.pool && e.pool !== "default" ? `${e.pool} / ${e.name}` : e.name),
            e.state && e.state !== "healthy" ? el("span", { class: "flag bad" }, e.state) : "",
            el("div", { class: "muted small" }, e.url),
          ]),
          cell("kind", e.kind),
          cell("inflight", bar(used, null, `${num(e.inflight)} / ${num(e.capacity)}`), "share"),
          cell("max_inflight", num(e.max_inflight), "num"),
          cell("inflight_tokens", num(e.inflight_tokens), "num"),
          cell("load", bar(e.load, null, e.load === null ? "unknown" : pct(e.load), e.saturated), "share"),
          cell("waiting", num(e.waiting), "num"),
          cell("load_signal", [el("span", { class: "flag " + signal }, e.load_signal.replace("_", " ")), e.saturated ? el("span", { class: "flag bad" }, "saturated") : ""]),
        );
      }),
    );

    $("#refusals-window").textContent = `last ${num(d.covered_s)} s`;
    const reasons = Object.entries(d.refusals.by_reason).sort((a, b) => b[1] - a[1]);
    $("#no-refusals").hidden = reasons.length > 0;
    $("#refusals tbody").replaceChildren(
      ...reasons.map(([reason, n]) => {
        const groups = Object.entries(d.refusals.by_group)
          .filter(([, r]) => r[reason])
          .map(([g, r]) => `${g} ${num(r[reason])}`)
          .join(", ");
        return el("tr", { "data-reason": reason }, cell("reason", reason), cell("count", num(n), "num"), cell("groups", groups));
      }),
    );

    const point = { queued: d.queued, inflight: d.inflight, tokens: {} };
    for (const g of d.groups) point.tokens[g.name] = g.tokens_per_s || 0;
    history.push(point);
    if (history.length > HISTORY) history = history.slice(-HISTORY);
    drawCharts(d.groups.map((g) => g.name));
  }

  function polyline(values, max, cls) {
    const n = HISTORY - 1;
    const pts = values.map((v, i) => `${(400 * (HISTORY - values.length + i)) / n},${(105 - (100 * v) / max).toFixed(1)}`);
    const p = document.createElementNS(SVG, "polyline");
    p.setAttribute("points", pts.join(" "));
    p.setAttribute("class", cls);
    return p;
  }

  function drawCharts(groups) {
    const q = history.map((h) => h.queued);
    const f = history.map((h) => h.inflight);
    const maxReq = Math.max(1, ...q, ...f);
    $("#chart-requests").replaceChildren(polyline(q, maxReq, "c0"), polyline(f, maxReq, "c1"));
    $("#chart-requests-max").textContent = `(top ${num(maxReq)})`;
    const series = groups.map((g) => history.map((h) => h.tokens[g] || 0));
    const maxTok = Math.max(1, ...series.flat());
    $("#chart-tokens").replaceChildren(...series.map((s, i) => polyline(s, maxTok, "c" + (i % 6))));
    const legend = $("#chart-tokens-legend");
    legend.replaceChildren(...groups.flatMap((g, i) => [el("i", { class: "swatch c" + (i % 6) }), g + " "]), el("span", { class: "muted" }, `tokens / s (top ${num(maxTok, 0)})`));
  }

  // ---------------------------------------------------------------- polling
  function stop() {
    if (timer !== null) clearTimeout(timer);
    timer = null;
  }

  function schedule() {
    stop();
    timer = setTimeout(poll, POLL_MS);
  }

  async function poll() {
    const key = sessionStorage.getItem(KEY_STORE);
    if (!key) return askForKey("");
    let r;
    try {
      r = await fetch(DATA_URL, { headers: { Authorization: "Bearer " + key }, cache: "no-store", credentials: "omit", redirect: "error" });
    } catch (e) {
      setStatus("down", "proxy unreachable, retrying");
      return schedule();
    }
    if (r.status === 401) {
      sessionStorage.removeItem(KEY_STORE);
      setStatus("refused", "key refused");
      return askForKey("The proxy refused this admin key.");
    }
    if (r.status === 403) {
      setStatus("disabled", "admin disabled");
      return askForKey("Admin routes are disabled on this proxy: set admin.api_key in its config or LLM_QOS_ADMIN_KEY in its environment.");
    }
    if (!r.ok) {
      setStatus("down", `HTTP ${r.status}, retrying`);
      return schedule();
    }
    let data;
    try {
      data = await r.json();
    } catch (e) {
      setStatus("down", "unreadable answer, retrying");
      return schedule();
    }
    render(data);
    setStatus("live", "live · " + new Date().toLocaleTimeString());
    schedule();
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("#key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const key = $("#key").value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY_STORE, key);
      $("#key").value = "";
      $("#key-message").textContent = "";
      setStatus("idle", "connecting");
      poll();
    });
    $("#forget").addEventListener("click", () => {
      sessionStorage.removeItem(KEY_STORE);
      history = [];
      setStatus("idle", "not connected");
      askForKey("");
    });
    poll();
  });
})();
