// kvscope's built-in page: polls the JSON API every two seconds and draws the charts as inline SVG.
// Plain JavaScript, no framework, nothing from the network but the service itself. Every text that comes from
// the API goes through textContent or setAttribute: never innerHTML.
"use strict";

(() => {
  const POLL_MS = 2000;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const ARM_COLORS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9"];
  const TIER_COLORS = ["#E69F00", "#56B4E9", "#009E73", "#CC79A7", "#999999", "#F0E442"];
  // why prompt tokens missed (the A/B contract's miss_causes), in the order they stack
  const MISS_CAUSES = {
    cold: "#999999",
    evicted: "#D55E00",
    chain_broken: "#CC79A7",
    not_admitted: "#0072B2",
    elsewhere: "#009E73",
  };

  const state = {
    tests: [], // GET /api/v1/ab
    details: {}, // id -> GET /api/v1/ab/{id}
    alerts: [], // GET /api/v1/alerts
    verdicts: null, // GET /api/v1/verdicts, when the service has it: its newest 50
    verdictsMore: false, // whether the service holds older verdicts than those
    verdictsApi: true,
    selected: null,
    alertGroupsOpen: {}, // group key -> open, for the groups the reader opened or closed
    error: null,
    updated: null,
  };

  // ------------------------------------------------------------------------------------------- DOM helpers

  function setAttrs(node, attrs) {
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "text") node.textContent = String(value);
      else if (key === "style") Object.assign(node.style, value); // CSSOM: allowed by the page's CSP
      else node.setAttribute(key, String(value));
    }
    return node;
  }

  function append(node, children) {
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const el = (tag, attrs, ...children) => append(setAttrs(document.createElement(tag), attrs), children);
  const svg = (tag, attrs, ...children) => append(setAttrs(document.createElementNS(SVG_NS, tag), attrs), children);
  const byId = (id) => document.getElementById(id);
  function fill(id, ...children) {
    const node = byId(id);
    node.replaceChildren();
    return append(node, children);
  }

  const rendered = {};
  /** Re-render a section only when its data changed, so focus, selection and tooltips survive the polling. */
  function renderIf(key, data, draw) {
    const signature = JSON.stringify(data);
    if (rendered[key] === signature) return;
    rendered[key] = signature;
    draw();
  }

  // -------------------------------------------------------------------------------------------- formatting

  const BYTE_UNITS = ["B", "kB", "MB", "GB", "TB", "PB", "EB"];

  function byteUnit(n) {
    let index = 0;
    while (Math.abs(n) >= 1000 && index < BYTE_UNITS.length - 1) {
      n /= 1000;
      index += 1;
    }
    return index;
  }

  /** Decimal units (the scenarios' GB are 10^9 B); `unit` and `digits` fix them for an axis. */
  function fmtBytes(n, unit, digits) {
    if (!Number.isFinite(n)) return "–";
    const index = unit === undefined ? byteUnit(n) : unit;
    const value = n / 1000 ** index;
    if (digits === undefined) digits = index === 0 || Math.abs(value) >= 100 ? 0 : Math.abs(value) >= 10 ? 1 : 2;
    return `${value.toFixed(digits)} ${BYTE_UNITS[index]}`;
  }

  const BINARY_UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
  const trimmed = (value, digits) => String(Number(value.toFixed(digits)));

  /** A size (a tier's capacity): in binary units when it is a whole number of hundredths of one (50 GiB,
   * 1.5 GiB, 64 MiB), else in decimal units to four significant digits (46.09 TB, 429.5 GB). */
  function fmtSize(n) {
    if (!Number.isFinite(n)) return "–";
    if (Math.abs(n) < 1000) return `${n} B`;
    let k = 0;
    while (k < BINARY_UNITS.length - 1 && Math.abs(n) >= 1024 ** (k + 1)) k += 1;
    if (k && Number.isSafeInteger(n) && (BigInt(n) * 100n) % 1024n ** BigInt(k) === 0n) {
      return `${trimmed(n / 1024 ** k, 2)} ${BINARY_UNITS[k]}`;
    }
    const index = byteUnit(n);
    return `${String(Number((n / 1000 ** index).toPrecision(4)))} ${BYTE_UNITS[index]}`;
  }

  const fmtPct = (x) => (Number.isFinite(x) ? `${(x * 100).toFixed(1)}%` : "–");
  const fmtInt = (n) => (Number.isFinite(n) ? Math.round(n).toLocaleString("en-US") : "–");
  // times in UTC, as the service's logs and Prometheus show them
  const fmtClock = (ts) => (ts ? new Date(ts * 1000).toISOString().slice(11, 19) : "–");
  const fmtStamp = (ts) => (ts ? `${new Date(ts * 1000).toISOString().replace("T", " ").slice(0, 19)} UTC` : "–");

  function fmtDuration(seconds) {
    if (!Number.isFinite(seconds) || seconds < 0) return "–";
    if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 1 : 0)} s`;
    const minutes = Math.floor(seconds / 60);
    if (minutes < 60) return `${minutes} min ${Math.floor(seconds % 60)} s`;
    return `${Math.floor(minutes / 60)} h ${minutes % 60} min`;
  }

  function niceStep(span, count) {
    const raw = span / Math.max(1, count);
    const magnitude = 10 ** Math.floor(Math.log10(raw));
    const n = raw / magnitude;
    return magnitude * (n <= 1 ? 1 : n <= 2 ? 2 : n <= 5 ? 5 : 10);
  }

  const sum = (values) => values.reduce((a, b) => a + b, 0);
  const ago = (ts) => fmtDuration(Date.now() / 1000 - ts);
  const headRow = (names) => el("thead", {}, el("tr", {}, names.map((h) => el("th", { scope: "col", text: h }))));
  const badge = (kind, text) => el("span", { class: `badge ${kind}`, text: text || kind });
  const abHref = (id) => `#ab=${encodeURIComponent(id)}`;
  const verdictHref = (id) => `/api/v1/verdicts/${encodeURIComponent(String(id))}`;

  function armColors(detail) {
    const colors = {};
    Object.keys(detail.arms || {}).forEach((name, i) => (colors[name] = ARM_COLORS[i % ARM_COLORS.length]));
    return colors;
  }

  /** {tier: the sum over the rows of row[key][tier]}, e.g. bytes written per tier over all rounds. */
  function totalsByTier(rows, key) {
    const totals = {};
    for (const row of rows) {
      for (const [tier, n] of Object.entries(row[key] || {})) totals[tier] = (totals[tier] || 0) + n;
    }
    return totals;
  }

  /** A colour per tier name, in the arms' tier order (top tier first), then any other tier a row names. */
  function tierColors(detail) {
    const colors = {};
    const add = (tier) => {
      if (!(tier in colors)) colors[tier] = TIER_COLORS[Object.keys(colors).length % TIER_COLORS.length];
    };
    for (const arm of Object.values(detail.arms || {})) (arm.tiers || []).forEach((tier) => add(tier.name));
    for (const arm of Object.values(detail.arms || {})) {
      for (const row of arm.rows || []) Object.keys(row.written_bytes || {}).forEach(add);
    }
    return colors;
  }

  // ----------------------------------------------------------------------------------------------- polling

  async function getJSON(url) {
    const response = await fetch(url, { headers: { Accept: "application/json" }, cache: "no-store" });
    if (!response.ok) {
      const error = new Error(`GET ${url}: HTTP ${response.status}`);
      error.status = response.status;
      throw error;
    }
    return response.json();
  }

  function selectedFromHash() {
    const match = /^#ab=(.+)$/.exec(window.location.hash);
    return match ? decodeURIComponent(match[1]) : null;
  }

  /** The test named in the URL; without one the newest running test, else the one shown, else the newest. */
  function choose(tests) {
    const ids = new Set(tests.map((t) => t.id));
    const wanted = selectedFromHash();
    if (wanted && ids.has(wanted)) return wanted;
    const newest = [...tests].sort((a, b) => b.started_at - a.started_at);
    const running = newest.find((t) => t.status === "running");
    if (running && !wanted) return running.id;
    if (state.selected && ids.has(state.selected)) return state.selected;
    return newest.length ? newest[0].id : null;
  }

  /** The service's verdict list (GET /api/v1/verdicts: {verdicts, next_offset}), newest first; an evidence API
   * the service does not have is no error. */
  async function pollVerdicts() {
    if (!state.verdictsApi) return;
    try {
      const body = await getJSON("/api/v1/verdicts?limit=50");
      state.verdicts = Array.isArray(body.verdicts) ? body.verdicts : [];
      state.verdictsMore = body.next_offset !== null && body.next_offset !== undefined;
    } catch (error) {
      if (error.status >= 400 && error.status < 500) state.verdictsApi = false;
    }
  }

  /** The last round every arm of a detail holds (0 before the first). */
  function roundsHeld(detail) {
    const arms = Object.values(detail.arms || {});
    if (!arms.length) return 0;
    return Math.min(...arms.map((arm) => Math.max(0, ...(arm.rows || []).map((row) => row.round))));
  }

  /** `fresh` (a later answer) with each arm's rows after `held`'s rows up to round `upTo` (all of them: Infinity). */
  function withRows(held, fresh, upTo) {
    const arms = {};
    for (const [name, arm] of Object.entries(fresh.arms || {})) {
      const before = (((held.arms || {})[name] || {}).rows || []).filter((row) => row.round <= upTo);
      arms[name] = { ...arm, rows: [...before, ...(arm.rows || [])] };
    }
    return { ...fresh, arms };
  }

  /** GET /api/v1/ab/{id} from the round after `since` (every row: null), page after page: an answer holds the
   * rows of a bounded number of rounds and names the `next_since_round` of the rest. */
  async function getDetail(url, since) {
    let detail = await getJSON(since === null ? url : `${url}?since_round=${since}`);
    while (detail.next_since_round != null && detail.next_since_round > (since ?? 0)) {
      since = detail.next_since_round;
      detail = withRows(detail, await getJSON(`${url}?since_round=${since}`), Infinity);
    }
    return detail;
  }

  /** The selected test's detail: every row the first time, then (while it runs, and once when it ends) only the
   * rows after the last round every arm holds, added to those the page has; an ended test's rows do not change. */
  async function pollDetail(summary) {
    const cached = state.details[summary.id];
    if (cached && cached.status !== "running" && cached.status === summary.status) return;
    const url = `/api/v1/ab/${encodeURIComponent(summary.id)}`;
    if (!cached) {
      state.details[summary.id] = await getDetail(url, null);
      return;
    }
    const since = roundsHeld(cached);
    state.details[summary.id] = withRows(cached, await getDetail(url, since), since);
  }

  let timer = null;
  let inFlight = false;
  let again = false;

  async function poll() {
    if (inFlight) {
      again = true;
      return;
    }
    inFlight = true;
    clearTimeout(timer);
    try {
      const [tests, alerts] = await Promise.all([getJSON("/api/v1/ab"), getJSON("/api/v1/alerts")]);
      state.tests = tests;
      state.alerts = alerts;
      state.selected = choose(tests);
      const summary = tests.find((t) => t.id === state.selected);
      if (summary) await pollDetail(summary);
      await pollVerdicts();
      state.error = null;
      state.updated = Date.now();
    } catch (error) {
      state.error = error.message || String(error);
    }
    render();
    inFlight = false;
    if (again) {
      again = false;
      poll();
    } else {
      timer = setTimeout(poll, POLL_MS);
    }
  }

  // ------------------------------------------------------------------------------------------------ render

  function render() {
    renderLive();
    const statuses = state.tests.map((t) => [t.id, t.status]);
    renderIf("alerts", [state.alerts, state.selected, statuses, Math.floor(Date.now() / 10000)], renderAlerts);
    renderIf("list", [state.tests, state.selected], renderList);
    const detail = state.details[state.selected];
    renderIf("detail", [detail || null, detail && detail.status === "running" ? Date.now() : 0], () =>
      renderDetail(detail),
    );
    renderIf("verdicts", [state.verdicts, state.verdictsMore, detail ? detail.verdicts : null], renderAllVerdicts);
  }

  function renderLive() {
    const live = byId("live");
    const firing = state.alerts.filter((a) => a.state === "firing").length;
    document.title = `${firing ? `(${firing} firing) ` : ""}kvscope · KV-cache tiers`;
    // screen readers hear changes of the connection or of the firing count, not every poll
    const news = state.error ? "connection to the service lost" : `${firing} alert${firing === 1 ? "" : "s"} firing`;
    if (byId("announce").textContent !== news) byId("announce").textContent = news;
    if (state.error) {
      live.className = "live down";
      byId("live-text").textContent = `connection problem, retrying: ${state.error}`;
    } else {
      live.className = "live ok";
      const when = fmtClock(state.updated / 1000);
      byId("live-text").textContent = `live · updated ${when} UTC · every ${POLL_MS / 1000} s`;
    }
  }

  /** The alerts by A/B (label `ab`), the cluster's (no `ab`) in a group of their own. First the A/B shown, then
   * the running ones, then any other group with an active alert: those are open. Ended A/Bs' groups come last,
   * newest first, collapsed. */
  function alertGroups() {
    const tests = new Map(state.tests.map((t) => [t.id, t]));
    const groups = new Map();
    for (const alert of state.alerts) {
      const ab = (alert.labels || {}).ab;
      const key = ab ? `ab:${ab}` : "cluster";
      if (!groups.has(key)) groups.set(key, { key, ab: ab || null, test: tests.get(ab) || null, alerts: [] });
      groups.get(key).alerts.push(alert);
    }
    const newest = (g) => (g.test ? g.test.started_at : Math.max(...g.alerts.map((a) => a.active_at || 0)));
    const ranked = [...groups.values()].map((g) => {
      const active = g.alerts.filter((a) => a.state === "firing" || a.state === "pending").length;
      const selected = g.ab !== null && g.ab === state.selected;
      const running = !!g.test && g.test.status === "running";
      const rank = selected ? 0 : running ? 1 : active ? 2 : 3;
      return { ...g, active, rank, open: rank < 3 };
    });
    return ranked.sort((a, b) => a.rank - b.rank || newest(b) - newest(a));
  }

  const ALERT_RANK = { firing: 0, pending: 1, resolved: 2 };

  function renderAlerts() {
    const count = (s) => state.alerts.filter((a) => a.state === s).length;
    fill(
      "alerts-counts",
      badge(count("firing") ? "firing" : "", `${count("firing")} firing`),
      badge(count("pending") ? "pending" : "", `${count("pending")} pending`),
      badge("", `${count("resolved")} resolved`),
    );
    if (!state.alerts.length) {
      fill("alerts-body", el("p", { class: "empty", text: "No alerts." }));
      return;
    }
    fill("alerts-body", alertGroups().map(alertGroup));
  }

  function alertGroup(group) {
    const override = state.alertGroupsOpen[group.key];
    const details = el("details", {
      class: `alert-group ${group.open ? "active" : "ended"}`,
      "data-group": group.ab ? "ab" : "cluster",
      "data-ab": group.ab,
      "data-status": group.test ? group.test.status : null,
      open: override === undefined ? group.open : override,
    });
    // a group the reader opened or closed stays so across the polls, until it is as the page would have it anyway
    details.addEventListener("toggle", () => {
      if (details.open === group.open) delete state.alertGroupsOpen[group.key];
      else state.alertGroupsOpen[group.key] = details.open;
    });
    const n = group.alerts.length;
    const states = ["firing", "pending", "resolved"]
      .map((s) => [s, group.alerts.filter((a) => a.state === s).length])
      .filter(([, k]) => k)
      .map(([s, k]) => badge(s, `${k} ${s}`));
    const title = group.ab
      ? [
          "A/B ",
          el("a", { href: abHref(group.ab), title: `show A/B test ${group.ab}`, text: group.ab }),
          group.test ? ` · ${group.test.scenario}` : "",
        ]
      : ["Clusters (alerts without an A/B)"];
    details.append(
      el(
        "summary",
        {},
        el("span", { class: "group-title" }, title),
        group.test ? badge(group.test.status) : group.ab ? badge("", "no longer listed") : null,
        el("span", { class: "group-count", text: `${n} alert${n === 1 ? "" : "s"}` }),
        el("span", { class: "labels" }, states),
      ),
    );
    const alerts = [...group.alerts].sort(
      (a, b) => ALERT_RANK[a.state] - ALERT_RANK[b.state] || (b.active_at || 0) - (a.active_at || 0),
    );
    const hidden = group.ab ? new Set(["ab", "scenario"]) : new Set(); // the group's title says them
    const rows = alerts.map((alert) => {
      const labels = Object.fromEntries(Object.entries(alert.labels || {}).filter(([k]) => !hidden.has(k)));
      return el(
        "tr",
        { class: `alert ${alert.state}`, "data-alert": alert.name },
        el("td", {}, badge(alert.state)),
        el(
          "td",
          {},
          el("div", { class: "alert-name", text: alert.name }),
          el("div", { class: "summary", text: alert.summary }),
        ),
        el("td", {}, labelChips(labels)),
        alertWhen(alert),
      );
    });
    details.append(
      el("table", { class: "alerts" }, headRow(["State", "Alert", "Labels", "When (UTC)"]), el("tbody", {}, rows)),
    );
    return details;
  }

  function alertWhen(alert) {
    if (alert.state === "resolved") {
      const fired = alert.fired_at ? `after ${fmtDuration(alert.resolved_at - alert.fired_at)} firing` : "";
      const at = fmtClock(alert.resolved_at);
      return el("td", { class: "num when", title: fmtStamp(alert.resolved_at) }, `resolved ${at}`, el("br"), fired);
    }
    const since = alert.state === "firing" ? alert.fired_at : alert.active_at;
    return el("td", { class: "num when", title: fmtStamp(since) }, fmtClock(since), el("br"), `for ${ago(since)}`);
  }

  function labelChips(labels) {
    return el(
      "div",
      { class: "labels" },
      Object.entries(labels).map(([key, value]) => {
        const text = [el("span", { text: `${key}=` }), el("b", { text: value })];
        return key === "ab"
          ? el("a", { class: "label", href: abHref(value), title: `show A/B test ${value}` }, text)
          : el("span", { class: "label" }, text);
      }),
    );
  }

  function progress(test) {
    const arms = Object.values(test.arms || {});
    const done = sum(arms.map((a) => a.rounds_done || 0));
    const total = (test.rounds || 0) * arms.length;
    const fraction = total ? Math.min(1, done / total) : 0;
    const perArm = arms.length ? Math.min(...arms.map((a) => a.rounds_done || 0)) : 0;
    return el(
      "div",
      {
        class: "progress",
        role: "progressbar",
        "aria-valuemin": 0,
        "aria-valuemax": total,
        "aria-valuenow": done,
        "aria-label": `${test.id}: ${done} of ${total} arm rounds done`,
      },
      el("div", { class: "bar" }, el("div", { class: "fill", style: { width: `${(fraction * 100).toFixed(1)}%` } })),
      el("span", { class: "text", text: `${perArm}/${test.rounds}` }),
    );
  }

  function verdictTally(verdicts) {
    if (!verdicts || !verdicts.length) return "–";
    const failed = verdicts.filter((v) => v.passed === false).length;
    const errors = verdicts.filter((v) => v.passed !== true && v.passed !== false).length;
    const passed = verdicts.length - failed - errors;
    return el(
      "span",
      { class: "labels" },
      passed ? badge("pass", `${passed} pass`) : null,
      failed ? badge("fail", `${failed} fail`) : null,
      errors ? badge("unjudged", `${errors} not judged`) : null,
    );
  }

  function renderList() {
    if (!state.tests.length) {
      fill(
        "ab-list-body",
        el("p", { class: "empty" }, "No A/B tests yet. Start one with ", el("code", { text: "POST /api/v1/ab" }), "."),
      );
      return;
    }
    const tests = [...state.tests].sort((a, b) => b.started_at - a.started_at);
    const rows = tests.map((test) =>
      el(
        "tr",
        {
          class: `ab-row ${test.status}${test.id === state.selected ? " selected" : ""}`,
          "data-ab": test.id,
          "aria-current": test.id === state.selected ? "true" : null,
        },
        el("td", {}, el("a", { href: abHref(test.id), title: `started ${fmtStamp(test.started_at)}`, text: test.id })),
        el("td", { text: test.scenario }),
        el("td", {}, badge(test.status)),
        el("td", {}, progress(test)),
        el("td", {}, verdictTally(test.verdicts)),
      ),
    );
    fill(
      "ab-list-body",
      el(
        "table",
        { "aria-describedby": "ab-list-title" },
        headRow(["Test", "Scenario", "Status", "Rounds", "Verdicts"]),
        el("tbody", {}, rows),
      ),
    );
  }

  function renderDetail(detail) {
    if (!detail) {
      fill("ab-detail-title", "A/B test");
      fill("ab-detail-status");
      fill("ab-detail-meta");
      fill("ab-chart", el("p", { class: "empty", text: "Select an A/B test." }));
      for (const id of ["ab-chart-legend", "bytes-chart", "bytes-chart-legend", "arm-cards", "ab-verdicts"]) fill(id);
      byId("ab-detail-error").hidden = true;
      return;
    }
    fill("ab-detail-title", `A/B test ${detail.id} · ${detail.scenario}`);
    fill("ab-detail-status", badge(detail.status));
    const end = detail.ended_at || Date.now() / 1000;
    const pace = detail.rounds_per_minute ? `${detail.rounds_per_minute} rounds/min` : "as fast as possible";
    fill(
      "ab-detail-meta",
      `started ${fmtStamp(detail.started_at)} · ${detail.ended_at ? "took" : "running for"} ` +
        `${fmtDuration(end - detail.started_at)} · ${detail.rounds} rounds per arm · ${pace}`,
    );
    const error = byId("ab-detail-error");
    error.hidden = !detail.error;
    error.textContent = detail.error || "";

    const colors = armColors(detail);
    drawCharts(detail);
    drawArmCards(detail, colors, armShapes(detail));
    if (detail.verdicts && detail.verdicts.length) {
      fill("ab-verdicts", verdictTable(detail.verdicts, false, "ab-verdicts-title"));
    } else {
      const why = detail.status === "running" ? "The criteria run when every arm has finished." : "No verdicts.";
      fill("ab-verdicts", el("p", { class: "empty", text: why }));
    }
  }

  // ------------------------------------------------------------------------------------------------ charts
  // Charts are drawn in CSS pixels at the width of their box (the SVG's viewBox is its size: nothing scales
  // them, so their text is the style sheet's 11-12 px at any window width); a change of width redraws them.

  let chartsWidth = null; // the detail panel's width the charts were drawn at

  function drawCharts(detail) {
    chartsWidth = byId("ab-detail").clientWidth;
    const colors = armColors(detail);
    drawHitChart(detail, colors, armShapes(detail));
    drawBytesCharts(detail, colors);
  }

  let resizing = false;
  new ResizeObserver(() => {
    if (resizing) return;
    resizing = true;
    requestAnimationFrame(() => {
      resizing = false;
      const detail = state.details[state.selected];
      if (detail && rendered.detail && byId("ab-detail").clientWidth !== chartsWidth) drawCharts(detail);
    });
  }).observe(byId("ab-detail"));

  const SHAPES = ["circle", "square", "triangle", "diamond", "triangle-down", "cross"];

  /** An SVG path of a point marker of `shape` centred on (x, y), about 2s across. */
  function markerPath(shape, x, y, s) {
    const f = (n) => n.toFixed(1);
    const polygon = (points) => `M${points.map(([px, py]) => `${f(x + px * s)},${f(y + py * s)}`).join("L")}Z`;
    switch (shape) {
      case "square":
        return polygon([[-0.9, -0.9], [0.9, -0.9], [0.9, 0.9], [-0.9, 0.9]]);
      case "triangle":
        return polygon([[0, -1.25], [1.15, 0.85], [-1.15, 0.85]]);
      case "triangle-down":
        return polygon([[0, 1.25], [1.15, -0.85], [-1.15, -0.85]]);
      case "diamond":
        return polygon([[0, -1.3], [1.3, 0], [0, 1.3], [-1.3, 0]]);
      case "cross": {
        const a = 0.38;
        const b = 1.15;
        const arm = [[-a, -b], [a, -b], [a, -a], [b, -a], [b, a], [a, a]];
        return polygon([...arm, ...arm.map(([px, py]) => [-px, -py])]);
      }
      default:
        return `M${f(x - s)},${f(y)}a${f(s)},${f(s)} 0 1,0 ${f(2 * s)},0a${f(s)},${f(s)} 0 1,0 ${f(-2 * s)},0Z`;
    }
  }

  function armShapes(detail) {
    const shapes = {};
    Object.keys(detail.arms || {}).forEach((name, i) => (shapes[name] = SHAPES[i % SHAPES.length]));
    return shapes;
  }

  /** Line widths by drawing order: the first arm's line is the widest, each next one narrower and drawn over it,
   * so where curves coincide each still shows as a band of its colour. */
  function lineWidths(count) {
    const step = count <= 3 ? 3 : count <= 6 ? 2 : 1;
    return Array.from({ length: count }, (_, i) => 2 + step * (count - 1 - i));
  }

  /** The width of a chart's box in CSS px (a hidden box: a default). */
  const boxWidth = (node, fallback) => Math.floor(node.clientWidth) || fallback;

  function frame(width, height, margin, titleText, descText, idPrefix) {
    const titleId = `${idPrefix}-title`;
    const descId = `${idPrefix}-desc`;
    const root = svg(
      "svg",
      {
        width,
        height,
        viewBox: `0 0 ${width} ${height}`,
        role: "img",
        "aria-labelledby": `${titleId} ${descId}`,
      },
      svg("title", { id: titleId, text: titleText }),
      svg("desc", { id: descId, text: descText }),
    );
    return { root, plotW: width - margin.left - margin.right, plotH: height - margin.top - margin.bottom };
  }

  /** Round numbers to label on an axis: every round when they fit, else multiples of a nice step (and round 1
   * when that leaves room). */
  function roundTicks(rounds, fit) {
    fit = Math.max(2, fit);
    if (rounds <= fit) return Array.from({ length: rounds }, (_, i) => i + 1);
    const step = niceStep(rounds, fit);
    const ticks = step >= 4 ? [1] : [];
    for (let r = step; r <= rounds; r += step) ticks.push(r);
    return ticks;
  }

  /** The horizontal offsets of the points of one round: arms whose points would cover each other (closer than
   * `near` px) are spread side by side, `gap` px apart; the others stay on their round. */
  function dodge(points, near, gap) {
    const offsets = new Map();
    const sorted = [...points].sort((a, b) => a.y - b.y || a.index - b.index);
    let cluster = [];
    const flush = () => {
      cluster.sort((a, b) => a.index - b.index);
      cluster.forEach((p, j) => offsets.set(p.index, (j - (cluster.length - 1) / 2) * gap));
      cluster = [];
    };
    for (const p of sorted) {
      if (cluster.length && p.y - cluster[cluster.length - 1].y >= near) flush();
      cluster.push(p);
    }
    flush();
    return offsets;
  }

  function drawHitChart(detail, colors, shapes) {
    const arms = Object.entries(detail.arms || {});
    const rounds = Math.max(2, detail.rounds || 0);
    const width = Math.max(280, boxWidth(byId("ab-chart"), 800));
    const height = width < 560 ? 250 : 300;

    // predicted collapse rounds: a dotted vertical line per round the planner expects arms to collapse in, its
    // label on a row of its own when it would run into another's
    const predictedArms = new Map();
    for (const [name, arm] of arms) {
      const predicted = arm.prediction && arm.prediction.collapse_round;
      if (predicted) predictedArms.set(predicted, [...(predictedArms.get(predicted) || []), name]);
    }
    const labelRows = [];
    const labels = [...predictedArms].sort((a, b) => a[0] - b[0]);
    const margin = { left: 54, right: 18, top: 26, bottom: 40 };
    const plotW0 = width - margin.left - margin.right;
    const xOf = (r) => margin.left + ((r - 1) / (rounds - 1)) * plotW0;
    const placed = labels.map(([predicted, names]) => {
      const text = `predicted collapse, round ${predicted}: ${names.join(", ")}`;
      const at = xOf(predicted);
      const w = text.length * 6.3 + 6;
      const end = at + 4 + w > width - 2; // no room on the right: the label ends at the line
      const from = end ? at - 4 - w : at + 4;
      let row = labelRows.findIndex((right) => right < from);
      if (row < 0) row = labelRows.push(-Infinity) - 1;
      labelRows[row] = from + w + 8;
      return { predicted, names, text, at, end, row };
    });
    margin.top += 15 * Math.max(0, labelRows.length - 1);

    const description = arms
      .map(([name, arm]) => {
        const last = (arm.rows || []).at(-1);
        const now = last
          ? `round ${last.round}: hit ratio ${fmtPct(last.hit_ratio)}, ideal ${fmtPct(last.ideal_hit_ratio)}`
          : "no rounds yet";
        const collapse = arm.observed_collapse_round ? `, collapsed at round ${arm.observed_collapse_round}` : "";
        return `${name}: ${now}${collapse}`;
      })
      .join("; ");
    const title = `Hit ratio per round, ${detail.id}`;
    const fullHeight = height + 15 * Math.max(0, labelRows.length - 1);
    const { root, plotW, plotH } = frame(width, fullHeight, margin, title, description, "hit");
    const x = (r) => margin.left + ((r - 1) / (rounds - 1)) * plotW;
    const y = (v) => margin.top + (1 - Math.max(0, Math.min(1, v))) * plotH;
    const bottom = margin.top + plotH;

    const grid = svg("g", { class: "grid" });
    const axis = svg("g", { class: "axis" });
    for (let v = 0; v <= 1.0001; v += 0.2) {
      grid.append(svg("line", { x1: margin.left, x2: margin.left + plotW, y1: y(v), y2: y(v) }));
      const label = `${Math.round(v * 100)}%`;
      axis.append(svg("text", { x: margin.left - 8, y: y(v) + 4, "text-anchor": "end", text: label }));
    }
    for (const r of roundTicks(rounds, Math.floor(plotW / 34))) {
      axis.append(svg("text", { x: x(r), y: bottom + 17, "text-anchor": "middle", text: r }));
    }
    axis.append(
      svg("line", { x1: margin.left, x2: margin.left + plotW, y1: bottom, y2: bottom }),
      svg("text", { x: margin.left + plotW / 2, y: bottom + 35, "text-anchor": "middle", text: "round" }),
      svg("text", {
        x: 0,
        y: 0,
        transform: `translate(14 ${margin.top + plotH / 2}) rotate(-90)`,
        "text-anchor": "middle",
        text: "hit ratio",
      }),
    );
    root.append(grid, axis);

    const markers = svg("g", { class: "markers" });
    for (const label of placed) {
      const at = x(label.predicted);
      markers.append(
        svg(
          "line",
          {
            class: "marker-line predicted",
            "data-arms": label.names.join(" "),
            x1: at,
            x2: at,
            y1: margin.top,
            y2: bottom,
            style: { stroke: label.names.length === 1 ? colors[label.names[0]] : "var(--muted)" },
          },
          svg("title", {
            text: `the planner predicts ${label.names.join(", ")} collapse(s) at round ${label.predicted}`,
          }),
        ),
        svg("text", {
          class: "marker-label",
          x: label.end ? at - 4 : at + 4,
          y: 14 + 15 * label.row,
          "text-anchor": label.end ? "end" : "start",
          text: label.text,
        }),
      );
    }
    root.append(markers);

    // each arm: its line (under the ideal), then its points in its own shape (over it); points that would cover
    // another arm's are spread side by side
    const widths = lineWidths(arms.length);
    const spacing = plotW / (rounds - 1);
    const size = spacing >= 14 ? 4.2 : spacing >= 7 ? 3 : 2;
    const stride = Math.max(1, Math.ceil(5 / spacing)); // a point every `stride` rounds on a dense chart
    const offsets = new Map(); // round -> Map(arm index -> dx)
    const byRound = new Map();
    arms.forEach(([, arm], index) => {
      for (const row of arm.rows || []) {
        if (!byRound.has(row.round)) byRound.set(row.round, []);
        byRound.get(row.round).push({ index, y: y(row.hit_ratio) });
      }
    });
    const gap = Math.min(2 * size + 2.5, (spacing * 0.8) / Math.max(1, arms.length - 1));
    for (const [r, points] of byRound) offsets.set(r, dodge(points, 2 * size + 1, gap));

    const pointGroups = [];
    arms.forEach(([name, arm], index) => {
      const rows = arm.rows || [];
      const group = svg("g", { class: "arm", "data-arm": name });
      const points = svg("g", { class: "arm-points", "data-arm": name });
      group.append(
        svg(
          "polyline",
          {
            class: "hit-line",
            "data-arm": name,
            stroke: colors[name],
            "stroke-width": widths[index],
            points: rows.map((r) => `${x(r.round).toFixed(1)},${y(r.hit_ratio).toFixed(1)}`).join(" "),
          },
          svg("title", { text: `${name}: hit ratio per round` }),
        ),
      );
      for (const row of rows) {
        const collapsed = row.round === arm.observed_collapse_round;
        if (!collapsed && (row.round - 1) % stride !== 0) continue;
        const dx = (offsets.get(row.round) && offsets.get(row.round).get(index)) || 0;
        points.append(
          svg(
            "path",
            {
              class: collapsed ? "point collapse" : "point",
              "data-round": row.round,
              "data-shape": shapes[name],
              d: markerPath(shapes[name], x(row.round) + dx, y(row.hit_ratio), collapsed ? size * 1.7 : size),
              fill: colors[name],
            },
            svg("title", {
              text:
                `${name} · round ${row.round}: hit ratio ${fmtPct(row.hit_ratio)}` +
                ` (ideal ${fmtPct(row.ideal_hit_ratio)})` +
                (collapsed ? " · first round below the collapse tolerance" : ""),
            }),
          ),
        );
      }
      root.append(group);
      pointGroups.push(points);
    });

    // the ideal, drawn over every arm's line (an arm that tracks it would hide it), under their points: dark dashes
    // on a light casing. One line when every arm has the same ideal, else one per arm, its casing in the arm's colour
    const ideals = arms.map(([name, arm]) => [name, (arm.rows || []).map((r) => [r.round, r.ideal_hit_ratio])]);
    const union = new Map();
    let shared = true; // compared on the rounds both arms have: a running arm may be a round behind
    for (const [, points] of ideals) {
      for (const [r, v] of points) {
        if (union.has(r) && Math.abs(union.get(r) - v) > 1e-9) shared = false;
        union.set(r, v);
      }
    }
    const idealGroup = svg("g", { class: "ideals" });
    const drawn = shared ? [["", [...union].sort((a, b) => a[0] - b[0])]] : ideals;
    for (const [name, points] of drawn) {
      if (!points.length) continue;
      const at = points.map(([r, v]) => `${x(r).toFixed(1)},${y(v).toFixed(1)}`).join(" ");
      idealGroup.append(
        svg("polyline", {
          class: "ideal-casing",
          points: at,
          "data-arm": shared ? null : name,
          style: { stroke: shared ? "var(--panel)" : colors[name] },
        }),
        svg(
          "polyline",
          { class: "ideal-line", "data-arm": shared ? null : name, points: at },
          svg("title", {
            text: `${shared ? "every arm" : name}: ideal hit ratio (an infinite cache)`,
          }),
        ),
      );
    }
    root.append(idealGroup, ...pointGroups);
    fill("ab-chart", root);

    const legend = arms.map(([name], index) =>
      legendItem(name, { series: "arm", arm: name, color: colors[name], shape: shapes[name], width: widths[index] }),
    );
    if (shared) legend.push(legendItem("ideal: an infinite cache's hit ratio, every arm", { series: "ideal" }));
    else {
      legend.push(
        ...arms.map(([name]) => legendItem(`${name}: ideal`, { series: "ideal", arm: name, casing: colors[name] })),
      );
    }
    if (placed.length) legend.push(legendItem("predicted collapse (planner)", { series: "predicted" }));
    if (arms.some(([, arm]) => arm.observed_collapse_round)) {
      const text = "observed collapse: first round below the tolerance (large marker)";
      legend.push(legendItem(text, { series: "observed" }));
    }
    fill("ab-chart-legend", legend);
  }

  /** A legend entry: a short sample of the series (line, marker, dashes or box) and its name. */
  function legendItem(text, { series, arm, color, shape, width, casing }) {
    let marks;
    if (series === "arm") {
      marks = [
        svg("line", { x1: 0, x2: 30, y1: 7, y2: 7, stroke: color, "stroke-width": Math.min(width, 5) }),
        svg("path", { class: "point", d: markerPath(shape, 15, 7, 3.6), fill: color }),
      ];
    } else if (series === "ideal") {
      marks = [
        svg("line", {
          class: "ideal-casing",
          x1: 0,
          x2: 30,
          y1: 7,
          y2: 7,
          style: { stroke: casing || "var(--panel)" },
        }),
        svg("line", { class: "ideal-line", x1: 0, x2: 30, y1: 7, y2: 7 }),
      ];
    } else if (series === "predicted") {
      marks = [svg("line", { class: "marker-line", x1: 15, x2: 15, y1: 0, y2: 14, style: { stroke: "var(--muted)" } })];
    } else if (series === "observed") {
      const d = markerPath("circle", 15, 7, 5);
      marks = [svg("path", { class: "point collapse", d, style: { fill: "var(--muted)" } })];
    } else {
      marks = [svg("rect", { x: 8, y: 1, width: 14, height: 12, rx: 2, style: { fill: color } })];
    }
    return el(
      "li",
      { "data-series": series, "data-arm": arm, "data-shape": shape },
      svg("svg", { width: 30, height: 14, viewBox: "0 0 30 14", "aria-hidden": "true" }, marks),
      el("span", { text }),
    );
  }

  function drawBytesCharts(detail, colors) {
    const arms = Object.entries(detail.arms || {});
    const tiers = tierColors(detail);
    const rounds = Math.max(1, detail.rounds || 0);
    const totals = arms.flatMap(([, arm]) => (arm.rows || []).map((r) => sum(Object.values(r.written_bytes || {}))));
    const top = Math.max(1, ...totals);
    const unit = byteUnit(top);
    const unitStep = niceStep(top / 1000 ** unit, 4);
    const step = unitStep * 1000 ** unit;
    const digits = Math.max(0, -Math.floor(Math.log10(unitStep) + 1e-9));
    const max = Math.ceil(top / step) * step;
    const margin = { left: 66, right: 12, top: 26, bottom: 36 };
    const height = 220;

    // one cell per arm (the style sheet lays them out), then each chart drawn at its cell's width
    const cells = arms.map(([name]) => el("div", { class: "bytes-cell", "data-arm": name }));
    fill("bytes-chart", cells);
    arms.forEach(([name, arm], index) => {
      const width = Math.max(240, boxWidth(cells[index], 440));
      const rows = arm.rows || [];
      const written = totalsByTier(rows, "written_bytes");
      const summary = Object.entries(written)
        .map(([tier, bytes]) => `${tier} ${fmtBytes(bytes)}`)
        .join(", ");
      const title = `${name}: bytes written per round, by tier`;
      const description = `total written: ${summary || "nothing yet"}`;
      const { root, plotW, plotH } = frame(width, height, margin, title, description, `bytes-${index}`);
      setAttrs(root, { class: "bytes-svg", "data-arm": name });
      const band = plotW / rounds;
      const y = (v) => margin.top + (1 - v / max) * plotH;
      const bottom = margin.top + plotH;
      const grid = svg("g", { class: "grid" });
      const axis = svg("g", { class: "axis" });
      for (let v = 0; v <= max * 1.0001; v += step) {
        grid.append(svg("line", { x1: margin.left, x2: margin.left + plotW, y1: y(v), y2: y(v) }));
        const label = v ? fmtBytes(v, unit, digits) : "0";
        axis.append(svg("text", { x: margin.left - 6, y: y(v) + 4, "text-anchor": "end", text: label }));
      }
      for (const r of roundTicks(rounds, Math.floor(plotW / 30))) {
        const at = { x: margin.left + (r - 0.5) * band, y: bottom + 16 };
        axis.append(svg("text", { ...at, "text-anchor": "middle", text: r }));
      }
      axis.append(
        svg("line", { x1: margin.left, x2: margin.left + plotW, y1: bottom, y2: bottom }),
        svg("text", { x: margin.left + plotW / 2, y: bottom + 32, "text-anchor": "middle", text: "round" }),
      );
      root.append(
        grid,
        axis,
        svg("rect", { x: margin.left, y: 5, width: 11, height: 11, rx: 2, fill: colors[name] }),
        svg("text", {
          class: "chart-title",
          x: margin.left + 17,
          y: 15,
          text: `${name} · written ${fmtBytes(sum(Object.values(written)))}`,
        }),
      );
      const bars = svg("g", { class: "bars" });
      for (const row of rows) {
        let base = 0;
        for (const [tier, bytes] of Object.entries(row.written_bytes || {})) {
          if (!bytes) continue;
          bars.append(
            svg(
              "rect",
              {
                class: "bar",
                "data-tier": tier,
                x: (margin.left + (row.round - 1) * band + band * 0.15).toFixed(1),
                width: (band * 0.7).toFixed(1),
                y: y(base + bytes).toFixed(1),
                height: Math.max(0.5, y(base) - y(base + bytes)).toFixed(1),
                fill: tiers[tier],
              },
              svg("title", {
                text: `${name} · round ${row.round} · ${tier}: ${fmtBytes(bytes)} written (${fmtInt(bytes)} B)`,
              }),
            ),
          );
          base += bytes;
        }
      }
      root.append(bars);
      cells[index].append(root);
    });
    fill(
      "bytes-chart-legend",
      Object.entries(tiers).map(([tier, color]) => legendItem(`tier ${tier}`, { series: "tier", color })),
    );
  }

  function drawArmCards(detail, colors, shapes) {
    const cards = Object.entries(detail.arms || {}).map(([name, arm]) => {
      const rows = arm.rows || [];
      const last = rows.at(-1);
      const query = sum(rows.map((r) => r.query_tokens || 0));
      const hits = sum(rows.map((r) => r.hit_tokens || 0));
      const evictions = totalsByTier(rows, "evictions");
      const observed = arm.observed_collapse_round;
      const predicted = arm.prediction && arm.prediction.collapse_round;
      const items = [
        ["engine", arm.engine || "emulator"],
        ["store", arm.store || "embedded"],
        ["placement", arm.placement || "replicate"],
        ["rounds", `${arm.rounds_done} / ${detail.rounds}`],
        ["hit ratio, last round", last ? `${fmtPct(last.hit_ratio)} (ideal ${fmtPct(last.ideal_hit_ratio)})` : "–"],
        ["hit ratio, all rounds", query ? fmtPct(hits / query) : "–"],
        // tokens a request recomputed beyond what an infinite cache would have recomputed
        ["excess recompute, last round", last ? `${fmtInt(last.excess_recompute_tokens_per_request)} tokens/request` : "–"],
        ["collapse predicted", predicted ? `round ${predicted}` : "no"],
        ["collapse observed", observed ? `round ${observed}` : "no", !!observed],
        ["TTFT mean, last round", last && last.ttft_s ? `${last.ttft_s.mean.toFixed(2)} s` : "–"],
        ...Object.entries(evictions).map(([tier, n]) => [`evictions, ${tier}`, fmtInt(n)]),
      ];
      const mark = svg(
        "svg",
        { class: "swatch", width: 14, height: 14, viewBox: "0 0 14 14", "aria-hidden": "true" },
        svg("path", { class: "point", d: markerPath(shapes[name], 7, 7, 4.2), fill: colors[name] }),
      );
      return el(
        "div",
        { class: "card", "data-arm": name },
        el("h4", {}, mark, name),
        tierList(name, arm.tiers || []),
        el(
          "dl",
          {},
          items.map(([term, value, bad]) => [
            el("dt", { text: term }),
            el("dd", { class: bad ? "bad" : null, text: value }),
          ]),
        ),
        missCauses(name, rows),
      );
    });
    fill("arm-cards", cards);
  }

  /** The cause of most of a round's hits lost against the ideal: every cause but cold, which an infinite cache
   * misses too (the first in MISS_CAUSES' order on a tie). */
  function lostMost(causes) {
    const lost = Object.keys(MISS_CAUSES).filter((cause) => cause !== "cold" && causes[cause]);
    return lost.reduce((most, cause) => (causes[cause] > causes[most] ? cause : most), lost[0]) || null;
  }

  /** Why an arm's prompt tokens missed, round by round: a bar per round stacked by cause, each a share of the
   * round's misses (hover: the tokens, evicted ones by tier); none for a real store, whose misses are unexplained. */
  function missCauses(arm, rows) {
    const explained = rows.filter((row) => row.miss_causes);
    if (!explained.length) return null;
    const width = 220;
    const height = 48;
    const step = width / explained.length;
    const bars = explained.map((row, i) => {
      const causes = row.miss_causes;
      const total = sum(Object.keys(MISS_CAUSES).map((cause) => causes[cause] || 0));
      const lost = row.hit_tokens < row.ideal_hit_tokens ? lostMost(causes) : null;
      const lostText = lost ? `; of the hits lost against the ideal, most ${lost}` : "";
      let y = height;
      const parts = Object.entries(MISS_CAUSES)
        .filter(([cause]) => total && causes[cause])
        .map(([cause, color]) => {
          const h = (causes[cause] / total) * height;
          y -= h;
          const tiers = cause === "evicted" ? Object.entries(causes.evicted_by_tier || {}).filter(([, n]) => n) : [];
          const by = tiers.length ? ` (${tiers.map(([tier, n]) => `${tier} ${fmtInt(n)}`).join(", ")})` : "";
          return svg(
            "rect",
            { class: "miss-cause", "data-cause": cause, x: i * step, y, width: Math.max(step - 1, 1), height: h,
              fill: color },
            svg("title", { text: `round ${row.round}: ${cause} ${fmtInt(causes[cause])} tokens${by}${lostText}` }),
          );
        });
      return svg("g", { class: "miss-round", "data-round": row.round, ...(lost ? { "data-lost": lost } : {}) }, parts);
    });
    const totals = {};
    for (const row of explained) {
      for (const cause of Object.keys(MISS_CAUSES)) totals[cause] = (totals[cause] || 0) + (row.miss_causes[cause] || 0);
    }
    const all = sum(Object.values(totals));
    return el(
      "figure",
      { class: "miss-causes", "data-arm": arm },
      el("figcaption", { text: "missed tokens by cause, per round" }),
      svg(
        "svg",
        { class: "miss-svg", width, height, viewBox: `0 0 ${width} ${height}`, preserveAspectRatio: "none", role: "img",
          "aria-label": `why ${arm}'s prompt tokens missed, per round` },
        bars,
      ),
      el(
        "ul",
        { class: "miss-legend" },
        Object.entries(MISS_CAUSES)
          .filter(([cause]) => totals[cause])
          .map(([cause, color]) =>
            el(
              "li",
              { "data-cause": cause },
              svg("svg", { class: "swatch", width: 10, height: 10, "aria-hidden": "true" },
                  svg("rect", { width: 10, height: 10, fill: color })),
              `${cause} ${fmtPct(totals[cause] / all)}`,
            ),
          ),
      ),
    );
  }

  /** An arm's tiers, top first: name, capacity (its exact bytes on hover), eviction policy, backend; then the tiers
   * attached to its cluster outside its store's path (an idle pool a verifier proves untouched), marked so. */
  function tierList(arm, tiers) {
    if (!tiers.length) return el("p", { class: "empty", text: "tiers: not reported" });
    const head = el(
      "li",
      { class: "tiers-head", "aria-hidden": "true" },
      ["tier", "capacity", "policy", "backend"].map((h) => el("span", { text: h })),
    );
    const lines = tiers.map((tier) =>
      el(
        "li",
        {
          class: tier.attached ? "tier attached" : "tier",
          "data-tier": tier.name,
          title: tier.attached ? "attached to the arm's cluster, outside its store's path" : null,
        },
        el(
          "span",
          { class: "tier-name", text: tier.name },
          tier.attached ? el("span", { class: "tier-attached", text: " attached" }) : null,
        ),
        el("span", {
          class: "tier-capacity",
          title: Number.isFinite(tier.capacity) ? `${fmtInt(tier.capacity)} B` : null,
          text: fmtSize(tier.capacity),
        }),
        el("span", { class: "tier-policy", text: tier.policy || "–" }),
        el("span", { class: "tier-backend", text: tier.backend || "–" }),
      ),
    );
    return el("ul", { class: "tiers", "aria-label": `tiers of ${arm}, top first` }, head, lines);
  }

  // ---------------------------------------------------------------------------------------------- verdicts

  // passed: true, false, or null when the criterion could not be judged (its `error` says why)
  const OUTCOMES = { true: ["pass", "PASS"], false: ["fail", "FAIL"] };
  const outcome = (v) => OUTCOMES[v.passed] || ["unjudged", "NOT JUDGED"];

  /** A threshold's entries as `name = value` (lists joined by commas). */
  function fmtThreshold(threshold) {
    const entries = Object.entries(threshold || {});
    if (!entries.length) return "–";
    return entries
      .map(([key, value]) => {
        if (Array.isArray(value)) return `${key} = ${value.join(", ")}`;
        return `${key} = ${value && typeof value === "object" ? JSON.stringify(value) : String(value)}`;
      })
      .join("; ");
  }

  /** What the A/B details the page holds say of each verdict (its description and threshold), by verdict id. */
  function knownVerdicts() {
    const known = new Map();
    for (const detail of Object.values(state.details)) {
      for (const v of detail.verdicts || []) {
        if (v.verdict_id !== null && v.verdict_id !== undefined) known.set(v.verdict_id, v);
      }
    }
    return known;
  }

  function verdictTable(verdicts, withRuns, titleId) {
    const head = ["Result", "Criterion: what it checks", "Measured, against the threshold"];
    head.push(...(withRuns ? ["Runs"] : []), "Evidence");
    const known = withRuns ? knownVerdicts() : new Map();
    const rows = verdicts.map((listed) => {
      const v = { ...(known.get(listed.verdict_id) || {}), ...listed };
      const [kind, word] = outcome(v);
      const id = v.verdict_id;
      const digest = v.digest ? String(v.digest) : null;
      const evidence =
        id === null || id === undefined
          ? "–"
          : [
              el(
                "span",
                { class: "verdict-links" },
                el("a", { href: verdictHref(id), title: `evidence of verdict ${id} (JSON)`, text: `#${id} evidence` }),
                el("a", { href: `${verdictHref(id)}/bundle`, title: `evidence bundle of verdict ${id}`, text: "bundle" }),
              ),
              digest
                ? el("div", { class: "mono digest", title: `digest ${digest}`, text: `${digest.slice(0, 12)}…` })
                : null,
            ];
      const description =
        v.description ||
        (v.kind ? `a ${v.kind} criterion (no description recorded)` : "no description recorded for this criterion");
      const threshold = v.threshold ? fmtThreshold(v.threshold) : null;
      return el(
        "tr",
        { class: `verdict ${kind}`, "data-verdict": id, "data-criterion": v.criterion },
        el("td", {}, el("span", { class: `badge verdict-outcome ${kind}`, text: word })),
        el(
          "td",
          {},
          el("div", { class: "mono criterion", text: v.criterion || "–" }),
          el("div", { class: `verdict-description${v.description ? "" : " missing"}`, text: description }),
        ),
        el(
          "td",
          {},
          el(
            "div",
            {},
            el("span", { class: "verdict-label", text: kind === "unjudged" ? "why: " : "measured: " }),
            el("span", { class: "verdict-summary", text: v.summary || v.error || "–" }),
          ),
          threshold
            ? el(
                "div",
                {},
                el("span", { class: "verdict-label", text: "threshold: " }),
                el("span", { class: "verdict-threshold", text: threshold }),
              )
            : null,
        ),
        withRuns ? el("td", { text: runsOf(v.runs) }) : null,
        el("td", {}, evidence),
      );
    });
    return el(
      "table",
      { class: "verdicts", "aria-describedby": titleId },
      headRow(head.filter(Boolean)),
      el("tbody", {}, rows),
    );
  }

  /** A verdict's runs, whether the API gives a list, a {role: run} object or a string. */
  function runsOf(runs) {
    if (Array.isArray(runs)) return runs.join(", ");
    if (runs && typeof runs === "object") return Object.values(runs).join(", ");
    return runs ? String(runs) : "–";
  }

  function renderAllVerdicts() {
    const section = byId("verdicts");
    section.hidden = !state.verdicts || !state.verdicts.length;
    if (section.hidden) return;
    const newest = [...state.verdicts].sort((a, b) => (b.verdict_id || 0) - (a.verdict_id || 0)).slice(0, 50);
    fill(
      "verdicts-body",
      state.verdictsMore
        ? el("p", { class: "meta", text: `The newest ${newest.length}; older ones are in the evidence API.` })
        : null,
      verdictTable(newest, true, "verdicts-title"),
    );
  }

  // ------------------------------------------------------------------------------------------------- start

  window.addEventListener("hashchange", () => {
    state.selected = choose(state.tests);
    render();
    poll();
  });
  poll();
})();
