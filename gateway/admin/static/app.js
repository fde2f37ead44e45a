// loraplex operator console: plain JS, no build step, no third-party code.
// The admin key lives in sessionStorage and goes out as a Bearer token on every /admin/api call.
"use strict";

const KEY_STORAGE = "loraplex.adminKey";
const FAST_POLL_MS = 2000;
const SLOW_POLL_MS = 6000;
const EDITABLE_LIMITS = [
  ["requests_per_minute", "rpm"], ["tokens_per_minute", "tpm"], ["max_concurrent_requests", "concurrency"],
];
const ui = { timers: [], tenants: [], recentFirst: null };

// ---- tiny DOM helpers ---------------------------------------------------------------------------
const $ = (id) => document.getElementById(id);
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else if (k === "style") el.style.cssText = v;  // through the CSSOM: the page's CSP refuses style attributes
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) el.append(c instanceof Node ? c : String(c));
  return el;
}
const fmtInt = (n) => (n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US"));
function fmtNum(n, digits = 1) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(1) + "M";
  if (Math.abs(n) >= 1e4) return (n / 1e3).toFixed(1) + "k";
  return Number.isInteger(n) ? String(n) : n.toFixed(digits);
}
const fmtPct = (r) => (r === null || r === undefined ? "–" : (100 * r).toFixed(r >= 0.995 || r === 0 ? 0 : 1) + "%");
const fmtMs = (ms) => (ms === null || ms === undefined ? "–" : ms >= 1000 ? (ms / 1000).toFixed(2) + "s" : ms.toFixed(0) + "ms");
const fmtBytes = (b) => (b >= 1 << 20 ? (b / (1 << 20)).toFixed(1) + " MiB" : b >= 1024 ? (b / 1024).toFixed(1) + " KiB" : b + " B");
const fmtTime = (t) => new Date(t * 1000).toLocaleString("en-GB", { hour12: false });
const clockSeconds = (t) => new Date(t * 1000).toLocaleTimeString("en-GB", { hour12: false });
const clock = (t) => new Date(t * 1000).toLocaleTimeString("en-GB", { hour12: false, hour: "2-digit", minute: "2-digit" });

function toast(message, bad = false) {
  const el = $("toast");
  el.textContent = message;
  el.className = bad ? "toast bad" : "toast";
  el.hidden = false;
  clearTimeout(ui.toastTimer);
  ui.toastTimer = setTimeout(() => { el.hidden = true; }, 3500);
}

// ---- API ----------------------------------------------------------------------------------------
class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}
async function api(path, options = {}) {
  const key = sessionStorage.getItem(KEY_STORAGE);
  const headers = { authorization: `Bearer ${key}` };
  if (options.body !== undefined) headers["content-type"] = "application/json";
  const resp = await fetch(path, { method: options.method || "GET", headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body) });
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) {
    if (resp.status === 401) signOut("Your key is no longer valid. Sign in again.");
    throw new ApiError(resp.status, (data.error && data.error.message) || `HTTP ${resp.status}`);
  }
  return data;
}

// ---- login --------------------------------------------------------------------------------------
async function signIn(key) {
  sessionStorage.setItem(KEY_STORAGE, key);
  try {
    const me = await api("/admin/api/me");
    $("whoami").textContent = `${me.tenant} · ${me.key_id}`;
  } catch (e) {
    sessionStorage.removeItem(KEY_STORAGE);
    const why = e.status === 403 ? "This key is not an admin key." : e.status === 401 ? "Unknown, revoked or expired key." : e.message;
    showLogin(why);
    return;
  }
  $("login").hidden = true;
  $("app").hidden = false;
  startPolling();
}
function showLogin(error = "") {
  ui.timers.forEach(clearInterval);
  ui.timers = [];
  $("app").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = error;
  $("login-key").focus();
}
function signOut(message = "") {
  sessionStorage.removeItem(KEY_STORAGE);
  showLogin(message);
}

// ---- charts (SVG, drawn here) -------------------------------------------------------------------
const SVG_NS = "http://www.w3.org/2000/svg";
function svg(tag, attrs) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}
function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 4, 6, 8, 10]) if (m * p >= v) return m * p; // quarter gridlines stay round
  return 10 * p;
}
// series: [{values: [number|null], color}], times: [posix seconds]
function lineChart(container, times, series, opts = {}) {
  const W = container.clientWidth || 480, H = container.clientHeight || 150;
  const pad = { l: 44, r: 10, t: 8, b: 20 };
  const all = series.flatMap((s) => s.values).filter((v) => v !== null && v !== undefined);
  const max = opts.max || niceMax(Math.max(0, ...all));
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img" });
  const x = (i) => pad.l + (i / Math.max(1, times.length - 1)) * (W - pad.l - pad.r);
  const y = (v) => pad.t + (1 - v / max) * (H - pad.t - pad.b);
  for (let g = 0; g <= 4; g++) {
    const v = (max * g) / 4;
    root.append(svg("line", { x1: pad.l, x2: W - pad.r, y1: y(v), y2: y(v), class: "grid" }));
    const label = svg("text", { x: pad.l - 6, y: y(v) + 3, "text-anchor": "end", class: "axis" });
    label.textContent = opts.format ? opts.format(v) : Math.abs(v) >= 1e4 ? fmtNum(v) : String(+v.toFixed(2));
    root.append(label);
  }
  const ticks = 5;
  for (let k = 0; k <= ticks; k++) {
    const i = Math.round((k / ticks) * (times.length - 1));
    const label = svg("text", { x: x(i), y: H - 5, "text-anchor": k === 0 ? "start" : k === ticks ? "end" : "middle", class: "axis" });
    const span = (times[times.length - 1] || 0) - (times[0] || 0);
    label.textContent = span <= 900 ? clockSeconds(times[i] || 0) : clock(times[i] || 0);
    root.append(label);
  }
  let drawn = 0, nonzero = 0;
  for (const s of series) {
    let d = "", area = "", open = false, first = null, last = null;
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) { open = false; return; }
      d += `${open ? "L" : "M"}${x(i).toFixed(1)},${y(v).toFixed(1)}`;
      open = true; drawn += 1; nonzero += v > 0 ? 1 : 0;
      if (first === null) first = i;
      last = i;
    });
    if (!d) continue;
    if (s.fill && first !== null) {
      area = `M${x(first)},${y(0)}` + s.values.map((v, i) => (v === null || v === undefined ? "" : `L${x(i).toFixed(1)},${y(v).toFixed(1)}`)).join("") + `L${x(last)},${y(0)}Z`;
      root.append(svg("path", { d: area, fill: s.color, "fill-opacity": 0.12, stroke: "none" }));
    }
    root.append(svg("path", { d, fill: "none", stroke: s.color, "stroke-width": 2, "stroke-linejoin": "round", "stroke-linecap": "round" }));
    s.values.forEach((v, i) => { // a point with no neighbour draws no line: mark it
      const alone = (k) => k < 0 || k >= s.values.length || s.values[k] === null || s.values[k] === undefined;
      if (v !== null && v !== undefined && alone(i - 1) && alone(i + 1)) {
        root.append(svg("circle", { cx: x(i).toFixed(1), cy: y(v).toFixed(1), r: 3, fill: s.color }));
      }
    });
  }
  if (!drawn) {
    const t = svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" });
    t.textContent = "no data yet";
    root.append(t);
  }
  container.replaceChildren(root);
  container.dataset.points = String(drawn);
  container.dataset.nonzero = String(nonzero); // for tests: points above zero
}

// ---- overview -----------------------------------------------------------------------------------
function lastSeconds(series, bucketS, seconds) {
  const n = Math.max(1, Math.round(seconds / bucketS));
  return series.slice(-n);
}
function weightedPercentiles(points) {
  const p50 = points.map((p) => p.ttft_p50_ms).filter((v) => v !== null);
  const p95 = points.map((p) => p.ttft_p95_ms).filter((v) => v !== null);
  const median = (a) => (a.length ? a.slice().sort((x, y) => x - y)[Math.floor((a.length - 1) / 2)] : null);
  return [median(p50), p95.length ? Math.max(...p95) : null];
}
async function refreshOverview() {
  const { bucket_s: bucketS, series } = await api("/admin/api/overview");
  const times = series.map((p) => p.t);
  const css = getComputedStyle(document.documentElement);
  const accent = css.getPropertyValue("--accent").trim(), accent2 = css.getPropertyValue("--accent-2").trim();
  lineChart($("chart-tps"), times, [{ values: series.map((p) => p.tokens_per_s), color: accent, fill: true }]);
  lineChart($("chart-ttft"), times, [{ values: series.map((p) => p.ttft_p50_ms), color: accent },
    { values: series.map((p) => p.ttft_p95_ms), color: accent2 }], { format: (v) => fmtNum(v, 0) });
  lineChart($("chart-queue"), times, [{ values: series.map((p) => p.queue_depth), color: "#fbbf24", fill: true }]);
  lineChart($("chart-hits"), times, [{ values: series.map((p) => p.cache_hit_ratio), color: "#4ade80", fill: true }],
    { max: 1, format: (v) => fmtPct(v) });

  const recent = lastSeconds(series, bucketS, 15);
  $("kpi-tps").textContent = fmtNum(recent.reduce((a, p) => a + p.tokens_per_s, 0) / recent.length);
  const minute = lastSeconds(series, bucketS, 60);
  const [p50, p95] = weightedPercentiles(minute);
  $("kpi-ttft").textContent = p50 === null ? "–" : `${fmtMs(p50)} / ${fmtMs(p95)}`;
  const requests = minute.reduce((a, p) => a + p.requests, 0);
  const refusals = minute.reduce((a, p) => a + p.refusals, 0);
  $("kpi-requests").textContent = fmtInt(requests);
  $("kpi-requests-sub").textContent = refusals ? `last minute · ${refusals} refused` : "last minute";
  const five = lastSeconds(series, bucketS, 300);
  const hitPoints = five.filter((p) => p.cache_hit_ratio !== null);
  $("kpi-hits").textContent = hitPoints.length
    ? fmtPct(hitPoints.reduce((a, p) => a + p.cache_hit_ratio, 0) / hitPoints.length) : "–";
  $("updated").textContent = "updated " + new Date().toLocaleTimeString("en-GB", { hour12: false });
}

// ---- live state: workers, queue -----------------------------------------------------------------
function stat(label, value) {
  return h("div", { class: "stat" }, h("div", { class: "label" }, label), h("div", { class: "value" }, value));
}
function bar(ratio) {
  const cls = ratio >= 0.95 ? "bar full" : ratio >= 0.75 ? "bar hot" : "bar";
  return h("div", { class: cls }, h("span", { style: `width:${Math.min(100, Math.max(0, 100 * ratio)).toFixed(1)}%` }));
}
async function refreshLive() {
  const live = await api("/admin/api/live");
  const pill = $("worker-pill");
  pill.textContent = live.worker_up ? `worker up · ${live.workers[0].model}` : "worker down";
  pill.className = live.worker_up ? "pill up" : "pill down";
  const q = live.queue;
  $("kpi-queue").textContent = q ? fmtInt(q.waiting) : "–";
  $("kpi-queue-sub").textContent = q ? `waiting · ${q.in_flight}/${q.capacity} slots busy` : "no queue";
  const w = live.workers[0];
  $("kpi-kv").textContent = w ? fmtPct(w.kv_usage) : "–";
  $("kpi-kv-sub").textContent = w ? `${w.num_kv_blocks - w.num_free_kv_blocks} of ${w.num_kv_blocks} blocks` : "";

  $("workers-list").replaceChildren(...(live.workers.length ? live.workers.map((wk) => h("div", { class: "card worker" },
    h("div", { class: "worker-head" }, h("strong", {}, wk.model), h("span", { class: "pill up" }, "up")),
    h("div", { class: "stats" },
      stat("Running", fmtInt(wk.num_running)), stat("Waiting", fmtInt(wk.num_waiting)),
      stat("KV in use", fmtPct(wk.kv_usage)),
      stat("Prefix hit ratio", fmtPct(wk.prefix_hit_ratio)), stat("Cached blocks", fmtInt(wk.prefix_cache_blocks)),
      stat("Adapter loads / evictions", `${fmtInt(wk.adapter_loads)} / ${fmtInt(wk.adapter_evictions)}`)),
    h("div", { style: "margin-top:10px" }, bar(wk.kv_usage)),
    h("div", { class: "chips" }, wk.resident_adapters.length
      ? wk.resident_adapters.map((sha) => h("span", { class: "chip", title: sha }, sha.slice(0, 12)))
      : h("span", { class: "muted small" }, "no adapters resident"))))
    : [h("div", { class: "card muted" }, "No worker answered.")]));

  const detail = [];
  if (!q) detail.push(h("p", { class: "muted" }, "This gateway runs without a queue."));
  else {
    const rows = Object.entries(q.by_priority), tenants = Object.entries(q.by_tenant);
    const top = Math.max(1, ...rows.map(([, d]) => d), ...tenants.map(([, d]) => d));
    detail.push(h("div", { class: "qrow" }, h("span", { class: "muted" }, "slots busy"), bar(q.in_flight / Math.max(1, q.capacity)),
      h("span", {}, `${q.in_flight}/${q.capacity}`)));
    for (const [p, d] of rows) detail.push(h("div", { class: "qrow" }, h("span", {}, `priority ${p}`), bar(d / top), h("span", {}, d)));
    for (const [t, d] of tenants) detail.push(h("div", { class: "qrow" }, h("span", {}, t), bar(d / top), h("span", {}, d)));
    if (!rows.length && !tenants.length) detail.push(h("p", { class: "muted small" }, "Nobody is waiting."));
    const refused = Object.entries((live.admission && live.admission.refused) || {});
    if (refused.length) detail.push(h("p", { class: "muted small" }, "Refused since start: " + refused.map(([r, n]) => `${r} ${n}`).join(" · ")));
  }
  $("queue-detail").replaceChildren(...detail);
}

// ---- tenants ------------------------------------------------------------------------------------
function editableLimit(tenant, field, testid) {
  const value = tenant.limits[field];
  const button = h("button", { class: "editable", title: "Click to edit", "data-testid": `${testid}-limit-${tenant.name}` }, fmtInt(value));
  button.addEventListener("click", () => {
    const input = h("input", { class: "edit-input", type: "number", min: "1", value: String(value), "data-testid": `${testid}-input-${tenant.name}` });
    let done = false;
    const finish = async (save) => {
      if (done) return;
      done = true;
      input.classList.remove("edit-input"); // the editor is closing: let the table redraw
      input.disabled = true;
      const next = Number(input.value);
      if (save && Number.isInteger(next) && next !== value) {
        try {
          await api(`/admin/api/tenants/${encodeURIComponent(tenant.id)}`, { method: "PATCH", body: { policy: { [field]: next } } });
          toast(`${tenant.name}: ${field.replaceAll("_", " ")} set to ${fmtInt(next)}`);
        } catch (e) { toast(e.message, true); }
      }
      await Promise.allSettled([refreshTenants(), refreshAudit()]);
    };
    input.addEventListener("keydown", (ev) => { if (ev.key === "Enter") finish(true); if (ev.key === "Escape") finish(false); });
    input.addEventListener("blur", () => finish(true));
    button.replaceWith(input);
    input.focus();
    input.select();
  });
  return button;
}
function usageCell(used, limit, label) {
  return h("div", { class: "usage" }, h("span", {}, `${fmtInt(used)} / ${label}`), bar(limit ? used / limit : 0));
}
async function refreshTenants() {
  if (document.querySelector(".edit-input")) return; // never redraw under an open editor
  const { tenants } = await api("/admin/api/tenants");
  ui.tenants = tenants;
  const rows = tenants.map((t) => {
    const u = t.usage_today, L = t.limits;
    const cachedShare = u.prompt_tokens ? u.cached_tokens / u.prompt_tokens : null;
    const budget = L.daily_token_budget;
    return h("tr", { "data-tenant": t.name },
      h("td", {}, h("strong", {}, t.name), h("div", { class: "sub" }, t.id)),
      h("td", {}, h("span", { class: t.suspended ? "pill suspended" : "pill active" }, t.suspended ? "suspended" : "active")),
      h("td", {}, h("div", { class: "usage" }, h("span", {}, `${fmtInt(t.requests_last_minute)} / `, editableLimit(t, "requests_per_minute", "rpm")),
        bar(t.requests_last_minute / L.requests_per_minute))),
      h("td", {}, editableLimit(t, "tokens_per_minute", "tpm")),
      h("td", {}, editableLimit(t, "max_concurrent_requests", "concurrency")),
      h("td", {}, h("span", {}, fmtNum(u.total_tokens)), h("div", { class: "sub" },
        `${fmtInt(u.requests)} req · ${cachedShare === null ? "–" : fmtPct(cachedShare)} cached`)),
      h("td", {}, budget === null ? h("span", { class: "muted" }, "unlimited") : usageCell(u.total_tokens, budget, fmtNum(budget))),
      h("td", {}, `${L.min_priority}–${L.max_priority}`, h("div", { class: "sub" }, `default ${L.default_priority} · w ${L.fair_share_weight}`)),
      h("td", {}, fmtInt(t.active_keys)),
      h("td", {}, h("div", { class: "actions" },
        h("button", { class: "small", onclick: () => createKey(t) }, "New key"),
        h("button", { class: t.suspended ? "small" : "small danger", "data-testid": `suspend-${t.name}`,
          onclick: () => setSuspended(t, !t.suspended) }, t.suspended ? "Resume" : "Suspend"))));
  });
  $("tenants-table").tBodies[0].replaceChildren(...rows);
}
async function setSuspended(tenant, suspended) {
  if (suspended && !confirm(`Suspend ${tenant.name}? Its keys will get 403 until resumed.`)) return;
  try {
    await api(`/admin/api/tenants/${encodeURIComponent(tenant.id)}`, { method: "PATCH", body: { suspended } });
    toast(`${tenant.name} ${suspended ? "suspended" : "resumed"}`);
  } catch (e) { toast(e.message, true); }
  await Promise.allSettled([refreshTenants(), refreshAudit()]);
}
async function createKey(tenant) {
  try {
    const made = await api(`/admin/api/tenants/${encodeURIComponent(tenant.id)}/keys`, { method: "POST", body: { name: "dashboard" } });
    const box = $("new-key");
    box.replaceChildren(h("strong", {}, `New key for ${tenant.name}`), h("p", { class: "muted small" }, "Shown once. Copy it now."),
      h("code", {}, made.key), " ", h("button", { class: "small ghost", onclick: () => { box.hidden = true; } }, "Done"));
    box.hidden = false;
  } catch (e) { toast(e.message, true); }
  await Promise.allSettled([refreshTenants(), refreshAudit()]);
}

// ---- adapters, audit ----------------------------------------------------------------------------
async function refreshAdapters() {
  const { adapters } = await api("/admin/api/adapters");
  const rows = adapters.map((a) => h("tr", {},
    h("td", {}, a.tenant), h("td", {}, h("strong", {}, a.name), h("span", { class: "muted" }, `@${a.version}`),
      h("div", { class: "sub" }, a.description || a.sha256.slice(0, 16))),
    h("td", {}, a.rank), h("td", {}, fmtBytes(a.size_bytes)), h("td", {}, fmtTime(a.created_at)),
    h("td", {}, a.shared ? "shared" : h("span", { class: "muted" }, "private")),
    h("td", {}, h("span", { class: a.resident ? "dot on" : "dot", title: a.resident ? "loaded on the worker" : "not loaded" }))));
  $("adapters-table").tBodies[0].replaceChildren(...(rows.length ? rows
    : [h("tr", {}, h("td", { colspan: "7", class: "muted" }, "No adapters uploaded yet."))]));
}
function diff(before, after) {
  if (before && after && typeof before === "object" && typeof after === "object" && !Array.isArray(before)) {
    const keys = [...new Set([...Object.keys(before), ...Object.keys(after)])].filter((k) => JSON.stringify(before[k]) !== JSON.stringify(after[k]));
    if (keys.length) return keys.map((k) => h("div", {}, `${k}: ${JSON.stringify(before[k] ?? null)} → `, h("b", {}, JSON.stringify(after[k] ?? null))));
  }
  return [h("span", {}, `${JSON.stringify(before)} → `), h("b", {}, JSON.stringify(after))];
}
async function refreshAudit() {
  const { entries } = await api("/admin/api/audit?limit=30");
  const names = Object.fromEntries(ui.tenants.map((t) => [t.id, t.name]));
  const rows = entries.map((e) => h("tr", {},
    h("td", {}, fmtTime(e.at)), h("td", { class: "small" }, e.actor), h("td", {}, h("code", {}, e.action)),
    h("td", {}, names[e.target] || e.target), h("td", { class: "json" }, diff(e.before, e.after))));
  $("audit-table").tBodies[0].replaceChildren(...(rows.length ? rows
    : [h("tr", {}, h("td", { colspan: "5", class: "muted" }, "No admin changes yet."))]));
}

// ---- polling ------------------------------------------------------------------------------------
function every(ms, fn) {
  const run = () => fn().catch((e) => { if (!(e instanceof ApiError && e.status === 401)) console.warn(e); });
  run();
  ui.timers.push(setInterval(run, ms));
}
function startPolling() {
  every(FAST_POLL_MS, refreshOverview);
  every(FAST_POLL_MS, refreshLive);
  every(SLOW_POLL_MS / 2, refreshTenants);
  every(SLOW_POLL_MS, () => refreshTenants().then(refreshAudit));
  every(SLOW_POLL_MS * 2, refreshAdapters);
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", (ev) => { ev.preventDefault(); signIn($("login-key").value.trim()); });
  $("logout").addEventListener("click", () => signOut());
  $("new-tenant").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const name = $("new-tenant-name").value.trim();
    if (!name) return;
    try {
      await api("/admin/api/tenants", { method: "POST", body: { name } });
      $("new-tenant-name").value = "";
      toast(`tenant ${name} created`);
    } catch (e) { toast(e.message, true); }
    await Promise.allSettled([refreshTenants(), refreshAudit()]);
  });
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) signIn(key); else showLogin();
});
