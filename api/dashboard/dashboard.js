// The usage dashboard: one page over the public API (docs/dashboard.md). The key is kept in this
// tab's session storage and sent only to this origin; every value is put in as text, never HTML.
"use strict";

const KEY = "kiln_key";
const FAST_MS = 2000;   // balance and the chosen sandbox's series
const SLOW_MS = 10000;  // the sandbox list and the daily totals
const $ = (id) => document.getElementById(id);
let selected = null;
let chosenTemplate = null;
let chosenVersion = null;
let logAbort = null;
let timers = [];

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function api(path) {
  const r = await fetch(path, { headers: { Authorization: "Bearer " + sessionStorage.getItem(KEY) } });
  let body = null;
  try {
    body = await r.json();
  } catch (e) {
    body = null;
  }
  if (!r.ok) {
    const err = (body && body.error) || {};
    throw new ApiError(r.status, err.code || "error", err.message || "the server answered " + r.status);
  }
  return body;
}

// µcr (millionths of a credit) as credits.
function credits(ucr, digits = 4) {
  return (ucr / 1e6).toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function when(iso) {
  return iso ? iso.replace("T", " ").slice(0, 19) : "–";
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function showError(id, err) {
  const p = $(id);
  p.hidden = !err;
  p.textContent = err ? err.message : "";
}

function stamp(text) {
  $("status").textContent = text;
}

async function loadBalance() {
  const b = await api("/v1/billing/balance");
  $("balance").textContent = credits(b.balance_ucr);
  // A negative balance is a debt: shown in red, with since when; new sandboxes are refused.
  const inDebt = b.debt_ucr > 0 || !!b.debt_since;
  $("balance").classList.toggle("in-debt", inDebt);
  $("debt").hidden = !inDebt;
  $("debt").textContent = inDebt
    ? `in debt: ${credits(b.debt_ucr)} owed${b.debt_since ? ` (at or below zero since ${b.debt_since})` : ""}; new sandboxes are refused until a grant covers it` +
      (b.snapshots_delete_at ? `; paused sandboxes and their snapshots will be deleted at ${b.snapshots_delete_at}` : "")
    : "";
  $("used").textContent = credits(b.used_ucr);
  $("granted").textContent = credits(b.granted_ucr);
  $("burn").textContent = credits(b.burn_rate_ucr_s * 3600, 2);
}

async function loadSandboxes() {
  const list = await api("/v1/sandboxes?limit=100");
  const body = $("sandboxes").tBodies[0];
  body.replaceChildren();
  for (const sb of list.sandboxes) {
    const tr = document.createElement("tr");
    tr.dataset.id = sb.id;
    if (sb.id === selected) tr.classList.add("selected");
    cell(tr, sb.id);
    cell(tr, sb.state, "state-" + sb.state);
    cell(tr, String(sb.vcpus));
    cell(tr, sb.memory_mib + " MiB");
    cell(tr, sb.disk_gib + " GiB");
    cell(tr, when(sb.created_at));
    tr.addEventListener("click", () => select(sb.id));
    body.appendChild(tr);
  }
  $("no-sandboxes").hidden = list.sandboxes.length > 0;
  if (!selected && list.sandboxes.length) select(list.sandboxes[0].id);
}

async function loadDays() {
  const days = await api("/v1/usage");
  const body = $("days").tBodies[0];
  body.replaceChildren();
  for (const d of days.totals) {
    const tr = document.createElement("tr");
    cell(tr, d.day);
    cell(tr, d.sandbox_id);
    // storage: a kept snapshot (named, a template's image, a cached layer) at the snapshot price
    cell(tr, d.kind === "storage" ? "storage" : "sandbox", "kind-" + d.kind);
    cell(tr, (d.cpu_ms / 1000).toFixed(1) + " s");
    const gibh = d.mem_byte_s / 2 ** 30 / 3600;
    cell(tr, gibh >= 1 ? gibh.toFixed(2) + " GiB·h" : (gibh * 1024).toFixed(1) + " MiB·h");
    cell(tr, bytes(d.rx_bytes));
    cell(tr, bytes(d.tx_bytes));
    cell(tr, credits(d.ucr));
    body.appendChild(tr);
  }
  $("no-days").hidden = days.totals.length > 0;
}

// The tenant's templates, each with its newest version; the chosen one's versions and build log.
async function loadTemplates() {
  const list = await api("/v1/templates?limit=100");
  const body = $("templates").tBodies[0];
  body.replaceChildren();
  for (const t of list.templates) {
    const v = t.latest_version || {};
    const tr = document.createElement("tr");
    tr.dataset.id = t.id;
    if (t.id === chosenTemplate) tr.classList.add("selected");
    cell(tr, t.name);
    cell(tr, v.version ? "v" + v.version : "–");
    cell(tr, v.status || "–", "state-" + v.status);
    cell(tr, v.reason || "");
    cell(tr, when(t.created_at));
    tr.addEventListener("click", () => chooseTemplate(t.id));
    body.appendChild(tr);
  }
  $("no-templates").hidden = list.templates.length > 0;
  if (!chosenTemplate && list.templates.length) chooseTemplate(list.templates[0].id);
}

async function loadVersions() {
  if (!chosenTemplate) return;
  const t = await api("/v1/templates/" + encodeURIComponent(chosenTemplate));
  $("template-detail").hidden = false;
  $("template-name").textContent = t.name;
  const body = $("versions").tBodies[0];
  body.replaceChildren();
  for (const v of t.versions) {
    const tr = document.createElement("tr");
    tr.dataset.version = String(v.version);
    if (v.version === chosenVersion) tr.classList.add("selected");
    cell(tr, "v" + v.version);
    cell(tr, v.status, "state-" + v.status);
    cell(tr, v.reason || "");
    cell(tr, `${v.vcpus} vCPU, ${v.memory_mib} MiB, ${v.disk_gib} GiB`);
    cell(tr, when(v.started_at));
    cell(tr, when(v.finished_at));
    tr.addEventListener("click", () => chooseVersion(v.version, v.status));
    body.appendChild(tr);
  }
  if (chosenVersion === null && t.versions.length) chooseVersion(t.versions[0].version, t.versions[0].status);
}

function chooseTemplate(id) {
  chosenTemplate = id;
  chosenVersion = null;
  for (const tr of $("templates").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.id === id);
  run(loadVersions);
}

function chooseVersion(version, status) {
  chosenVersion = version;
  for (const tr of $("versions").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.version === String(version));
  followLog(chosenTemplate, version, status).catch((err) => {
    if (err.name === "AbortError") return;
    if (err.status === 401) signOut(err);
    else showError("board-error", err);
  });
}

// The build log (server-sent events, kept after the build): followed while it runs, each line
// put in as text; the end event says how the build ended.
async function followLog(id, version, status) {
  if (logAbort) logAbort.abort();
  logAbort = new AbortController();
  const pre = $("build-log");
  pre.textContent = "";
  $("log-version").textContent = "v" + version;
  if (status === "pending") {
    $("log-state").textContent = "(not built yet: waiting for its source)";
    return;
  }
  $("log-state").textContent = "(following)";
  const r = await fetch(`/v1/templates/${encodeURIComponent(id)}/log?version=${version}`, {
    headers: { Authorization: "Bearer " + sessionStorage.getItem(KEY), Accept: "text/event-stream" },
    signal: logAbort.signal,
  });
  if (!r.ok) {
    let err = {};
    try {
      err = (await r.json()).error || {};
    } catch (e) {
      err = {};
    }
    throw new ApiError(r.status, err.code || "error", err.message || "the server answered " + r.status);
  }
  const reader = r.body.getReader();
  const text = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += text.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      let event = "message";
      let data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) event = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (!data) continue;
      const d = JSON.parse(data);
      if (event === "log") pre.textContent += d.text;
      else if (event === "end") {
        $("log-state").textContent = `(${d.status}${d.reason ? ": " + d.reason : ""})`;
        pre.dataset.ended = d.status;
      }
    }
  }
}

// Draws `series` (arrays of numbers, one value a second, same length) into the chart's SVG.
function draw(id, series, latest) {
  const fig = $(id);
  const svg = fig.querySelector("svg");
  const ns = "http://www.w3.org/2000/svg";
  const w = 600, h = 160, pad = 4;
  const n = series[0].length;
  const max = Math.max(1, ...series.flat());
  const top = max * 1.15;  // headroom: a flat series is not drawn on the frame
  svg.replaceChildren();
  const axis = document.createElementNS(ns, "line");
  axis.setAttribute("class", "axis");
  axis.setAttribute("x1", 0);
  axis.setAttribute("x2", w);
  axis.setAttribute("y1", h - pad);
  axis.setAttribute("y2", h - pad);
  svg.appendChild(axis);
  series.forEach((values, k) => {
    const line = document.createElementNS(ns, "polyline");
    const pts = values.map((v, i) => {
      const x = n > 1 ? (i / (n - 1)) * w : w;
      const y = h - pad - (v / top) * (h - 2 * pad);
      return x.toFixed(1) + "," + y.toFixed(1);
    });
    line.setAttribute("points", pts.join(" "));
    if (k) line.setAttribute("class", "second");
    svg.appendChild(line);
  });
  svg.dataset.points = String(n);
  svg.dataset.max = String(max);
  fig.querySelector(".latest").textContent = latest;
}

async function loadSeries() {
  if (!selected) return;
  const id = selected;
  const usage = await api("/v1/sandboxes/" + encodeURIComponent(id) + "/usage");
  if (id !== selected) return;
  const p = usage.points;
  $("detail").hidden = false;
  $("detail-id").textContent = id;
  $("no-points").hidden = p.length > 0;
  if (!p.length) return;
  const last = p[p.length - 1];
  draw("chart-cpu", [p.map((x) => x.cpu_ms)], last.cpu_ms + " ms");
  draw("chart-mem", [p.map((x) => x.mem_bytes / 2 ** 20)], bytes(last.mem_bytes));
  draw("chart-net", [p.map((x) => x.rx_bytes / 1024), p.map((x) => x.tx_bytes / 1024)],
       bytes(last.rx_bytes) + " / " + bytes(last.tx_bytes));
  draw("chart-cost", [p.map((x) => x.ucr)], last.ucr + " µcr");
}

function select(id) {
  selected = id;
  for (const tr of $("sandboxes").tBodies[0].rows) tr.classList.toggle("selected", tr.dataset.id === id);
  run(loadSeries);
}

// Runs a loader; a lost key ends the session, other errors show and the next round retries.
async function run(loader) {
  try {
    await loader();
    showError("board-error", null);
    stamp("updated " + new Date().toLocaleTimeString());
  } catch (err) {
    if (err.status === 401) {
      signOut(err);
      return;
    }
    showError("board-error", err);
  }
}

function every(ms, loaders) {
  const tick = () => loaders.forEach(run);
  tick();
  timers.push(setInterval(tick, ms));
}

async function signIn() {
  timers.forEach(clearInterval);
  timers = [];
  try {
    // both scopes the page needs, checked before it shows anything
    await Promise.all([api("/v1/billing/balance"), api("/v1/sandboxes?limit=1")]);
  } catch (err) {
    signOut(err);
    return;
  }
  showError("signin-error", null);
  $("signin").hidden = true;
  $("board").hidden = false;
  $("signout").hidden = false;
  every(FAST_MS, [loadBalance, loadSeries]);
  every(SLOW_MS, [loadSandboxes, loadDays, loadTemplates, loadVersions]);
}

function signOut(err) {
  timers.forEach(clearInterval);
  timers = [];
  selected = null;
  chosenTemplate = null;
  chosenVersion = null;
  if (logAbort) logAbort.abort();
  logAbort = null;
  sessionStorage.removeItem(KEY);
  $("board").hidden = true;
  $("detail").hidden = true;
  $("template-detail").hidden = true;
  $("signout").hidden = true;
  $("signin").hidden = false;
  $("key").value = "";
  stamp("");
  showError("signin-error", err || null);
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY, $("key").value.trim());
  signIn();
});
$("signout").addEventListener("click", () => signOut(null));
if (sessionStorage.getItem(KEY)) signIn();
