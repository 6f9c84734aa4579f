// llm-qos live dashboard: polls dashboard.json once a second with the admin key.
// The proxy samples its history itself (a point a second, five minutes kept): the first
// answer brings every point, later ones only the points after the last one held.
// The key lives in this tab's sessionStorage only and goes out as a Bearer header; every
// value from the server is written with textContent (user ids may be any string).
"use strict";

(() => {
  const KEY_STORE = "llm-qos.admin-key";
  const DATA_URL = "dashboard.json"; // next to this page: /admin/dashboard.json
  const POLL_MS = 1000;
  const SVG = "http://www.w3.org/2000/svg";

  let timer = null;
  // the proxy's chart points: {seq, t, queued, inflight, tokens_per_s: {group: x}, engines: {id: {inflight, ttft_s, tpot_s}}}
  let history = [];
  let historyId = null;
  let maxPoints = 300;
  let intervalS = 1;

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
    $("#window").textContent = d.covered_s < d.window_s - 0.5 ? `${num(d.covered_s, 0)} s (filling ${num(d.window_s)} s)` : `${num(d.window_s)} s`;
    renderReload(d.reload);
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
          cell("capacity_found", [
            el("span", {}, num(e.capacity_found)),
            el("div", { class: "muted small" }, `${e.capacity_reason || dash}${e.capacity_mode === "fixed" ? "" : ` · ≤ ${num(e.max_inflight)}`}`),
          ], "num"),
          cell("inflight_tokens", num(e.inflight_tokens), "num"),
          cell("load", bar(e.load, null, e.load === null ? "unknown" : pct(e.load), e.saturated), "share"),
          cell("waiting", num(e.waiting), "num"),
          cell("load_signal", [el("span", { class: "flag " + signal }, e.load_signal.replace("_", " ")), e.saturated ? el("span", { class: "flag bad" }, "saturated") : ""]),
          cell("ttft_s", secs(e.ttft_s), "num"),
          cell("tpot_s", secs(e.tpot_s), "num"),
          cell("routed", [el("span", {}, num(e.routed)), el("div", { class: "muted small" }, e.routed_per_s === null ? dash : `${num(e.routed_per_s, 1)} / s`)], "num"),
          cell("failed", [el("span", { class: e.failed ? "flag bad" : "" }, num(e.failed)), el("div", { class: "muted small" }, e.failed_per_s === null ? dash : `${num(e.failed_per_s, 2)} / s`)], "num"),
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

    renderObjectives(d.objectives || {});

    takeHistory(d.history);
    drawCharts(d.groups.map((g) => g.name), d.engines, objectiveNames(d.objectives || {}));
  }

  // [[group, objective], ...] of the groups' latency objectives
  function objectiveNames(objectives) {
    return Object.entries(objectives).flatMap(([g, objs]) => Object.keys(objs).map((o) => [g, o]));
  }

  function renderObjectives(objectives) {
    const rows = objectiveNames(objectives);
    $("#objectives-section").hidden = rows.length === 0;
    $("#objectives tbody").replaceChildren(
      ...rows.map(([g, o]) => {
        const ob = objectives[g][o];
        const goal = ob.percentile / 100;
        const att = ob.overall.attainment;
        const engines = Object.entries(ob.engines)
          .map(([id, r]) => `${id} ${pct(r.attainment)}`)
          .join(", ");
        return el(
          "tr",
          { "data-group": g, "data-objective": o },
          cell("group", g),
          cell("objective", o === "ttft" ? "TTFT" : "TPOT"),
          cell("target", `${secs(ob.target_s)} p${num(ob.percentile, 1)}`, "num"),
          cell("attainment", bar(att, goal, att === null ? "no requests" : `${pct(att)} ≥ ${pct(goal)}`, ob.met === false), "share"),
          cell("measured", secs(ob.overall.measured_s), "num"),
          cell("requests", num(ob.overall.requests), "num"),
          cell("engines", engines || dash),
        );
      }),
    );
  }

  function renderReload(r) {
    const node = $("#reload");
    const at = (t) => new Date(t * 1000).toLocaleTimeString();
    if (r.result === "error") {
      node.className = "flag bad";
      node.textContent = "failed: " + (r.error || "").slice(0, 120);
      node.title = `${r.error}\nthe config active since ${at(r.loaded_at)} stays (${num(r.errors)} failed, ${num(r.ok)} ok since start)`;
    } else if (r.result === "ok") {
      node.className = "flag ok";
      node.textContent = "ok · " + at(r.loaded_at);
      node.title = `${num(r.ok)} ok, ${num(r.errors)} failed since start`;
    } else {
      node.className = "flag none";
      node.textContent = "none since start-up · " + at(r.loaded_at);
      node.title = "";
    }
  }

  // ---------------------------------------------------------------- history
  function takeHistory(h) {
    if (h.full || h.id !== historyId) history = h.points.slice();
    else history.push(...h.points);
    historyId = h.id;
    maxPoints = h.max_points;
    intervalS = h.interval_s;
    if (history.length > maxPoints) history = history.slice(-maxPoints);
  }

  function dataUrl() {
    if (!history.length) return DATA_URL;
    return `${DATA_URL}?since=${history[history.length - 1].seq}&history=${encodeURIComponent(historyId)}`;
  }

  // ---------------------------------------------------------------- charts
  const W = 480, H = 150, ML = 46, MR = 10, MT = 8, MB = 20;

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function niceMax(x) {
    if (!(x > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(x)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= x) return m * p;
    return 10 * p;
  }

  // one chart: the y axis from 0 to a round maximum (five labelled lines), the x axis
  // over the history's span ending at the newest point (a labelled line per minute)
  function chart(id, series, fmt) {
    const span = maxPoints * intervalS;
    const end = history.length ? history[history.length - 1].t : 0;
    const values = series.flatMap((s) => s.values.filter((v) => v !== null && v !== undefined));
    const max = niceMax(Math.max(0, ...values));
    const x = (t) => ML + ((W - ML - MR) * (span - (end - t))) / span;
    const y = (v) => MT + (H - MT - MB) * (1 - v / max);
    const nodes = [];
    for (let i = 0; i <= 4; i++) {
      const v = (max * i) / 4;
      nodes.push(svg("line", { x1: ML, x2: W - MR, y1: y(v), y2: y(v), class: "grid" }));
      nodes.push(svg("text", { x: ML - 4, y: y(v) + 3, class: "axis y" }, fmt(v)));
    }
    for (let m = 0; m * 60 <= span; m++) {
      const xx = x(end - m * 60);
      nodes.push(svg("line", { x1: xx, x2: xx, y1: MT, y2: H - MB, class: "grid" }));
      nodes.push(svg("text", { x: Math.min(W - MR - 10, Math.max(ML + 10, xx)), y: H - 6, class: "axis x" }, m === 0 ? "now" : `−${m} min`));
    }
    nodes.push(svg("line", { x1: ML, x2: ML, y1: MT, y2: H - MB, class: "axis-line" }));
    nodes.push(svg("line", { x1: ML, x2: W - MR, y1: H - MB, y2: H - MB, class: "axis-line" }));
    for (const s of series) {
      // a gap (no value) breaks the line
      let run = [];
      const flush = () => {
        if (run.length) nodes.push(svg("polyline", { points: run.join(" "), class: "series " + s.cls }));
        run = [];
      };
      history.forEach((p, i) => {
        const v = s.values[i];
        if (v === null || v === undefined) return flush();
        run.push(`${x(p.t).toFixed(1)},${y(v).toFixed(1)}`);
      });
      flush();
    }
    $("#" + id).replaceChildren(...nodes);
  }

  const plain = (v) => (v >= 1000 ? num(v / 1000, 1) + "k" : num(v, v < 10 && v % 1 ? 1 : 0));
  const ms = (v) => (v >= 1 ? num(v, 1) + " s" : num(v * 1000, 0) + " ms");

  function legend(id, names, unit) {
    $("#" + id).replaceChildren(...names.flatMap((n, i) => [el("i", { class: "swatch c" + (i % 6) }), n + " "]), el("span", { class: "muted" }, unit));
  }

  function drawCharts(groups, engines, objectives) {
    chart("chart-requests", [{ values: history.map((h) => h.queued), cls: "c0" }, { values: history.map((h) => h.inflight), cls: "c1" }], plain);
    chart("chart-tokens", groups.map((g, i) => ({ values: history.map((h) => (h.tokens_per_s[g] === undefined ? null : h.tokens_per_s[g])), cls: "c" + (i % 6) })), plain);
    legend("chart-tokens-legend", groups, "(tokens / s)");
    const label = (e) => (e.pool && e.pool !== "default" ? `${e.pool} / ${e.name}` : e.name);
    for (const [field, id, unit] of [["ttft_s", "chart-ttft", "(time to first token)"], ["tpot_s", "chart-tpot", "(time per output token)"]]) {
      chart(id, engines.map((e, i) => ({ values: history.map((h) => (h.engines[e.id] ? h.engines[e.id][field] : null)), cls: "c" + (i % 6) })), ms);
      legend(id + "-legend", engines.map(label), unit);
    }
    $("#chart-objectives-figure").hidden = objectives.length === 0;
    if (objectives.length) {
      const att = (h, g, o) => (h.objectives && h.objectives[g] && h.objectives[g][o] !== undefined ? h.objectives[g][o] : null);
      chart("chart-objectives", objectives.map(([g, o], i) => ({ values: history.map((h) => att(h, g, o)), cls: "c" + (i % 6) })), (v) => pct(v));
      legend("chart-objectives-legend", objectives.map(([g, o]) => `${g} ${o}`), "(attainment: requests within target)");
    }
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
      r = await fetch(dataUrl(), { headers: { Authorization: "Bearer " + key }, cache: "no-store", credentials: "omit", redirect: "error" });
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
      historyId = null;
      setStatus("idle", "not connected");
      askForKey("");
    });
    poll();
  });
})();
