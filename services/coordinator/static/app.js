// The coordinator's page: runs, live curves, recent groups, config, controls. It talks to
// the REST API of the origin that served it, with the stack's token from sessionStorage.
"use strict";

const TOKEN_KEY = "rlmesh.token";
const DRAFT_KEY = "rlmesh.newRunConfig";
const POLL_MS = 1500;
const METRICS_PAGE = 1000;
const RUNS_PAGE = 1000;
const SAMPLES_PAGE = 10;
const ACTIVE = ["pending", "running", "paused", "stopping"];
const FINAL = ["completed", "stopped", "failed"];
const TEMPLATE = {
  name: "my-run",
  model_path: "/models/policy",
  datasets: [{ name: "train", path: "train.jsonl" }, { name: "held_out", path: "held_out.jsonl", eval: true }],
  num_rollouts: 100,
  rollout: { rollout_batch_size: 8, n_samples_per_prompt: 4, sampling: { max_new_tokens: 256 } },
};

// Charts: a title, the metric names (or patterns) it draws, the x of a point, options. The
// names are those the coordinator records (GET /runs/{id}/metrics).
const CHARTS = [
  ["Reward: train and held-out", ["rollout/reward_mean", /^eval\/[^/]+\/reward_mean$/]],
  // The eval's reward components, each its own line (the chart above has their weighted total).
  ["Held-out reward by component", [/^eval\/[^/]+\/reward\/.+_mean$/]],
  ["Response length (tokens)", ["rollout/response_length_mean", /^eval\/[^/]+\/response_length_mean$/]],
  ["KL to the rollout policy (approx)", ["train/approx_kl", /^train\/kl/]],
  ["Entropy", ["train/entropy"]],
  ["Clip fraction", ["train/clip_frac"]],
  ["Gradient norm", ["train/grad_norm"]],
  ["Loss", ["train/loss", "train/pg_loss"]],
  ["Samples per second", ["iteration/samples_per_second"]],
  // Stacked: the bands add up to the step's wall time (docs/metrics.md, "A step's time split").
  ["Step time split (s): generate, reward, train, weight update, other",
    ["split/generate_seconds", "split/reward_seconds", "split/train_seconds", "split/update_seconds",
      "split/eval_seconds", "split/other_seconds"], null, { stacked: true }],
  ["Buffer depth (groups)", ["buffer/queued_groups", "buffer/leased_groups", "buffer/partial_groups"]],
  ["Staleness (weight versions)", ["train/staleness_mean", "train/staleness_max"]],
  // Samples of older weights: the trainer/engine log-prob gap and the importance weights (docs/metrics.md).
  ["Off-policy: log-prob gap, importance weights, ESS",
    ["train/train_rollout_logprob_abs_diff", "train/is_weight_mean", "train/is_weight_max",
      "train/is_truncated_masked_fraction", "train/is_ess", "train/staleness_mean"]],
  ["Failed, rejected and dropped",
    ["rollout/failed_ratio", /^rollout\/failed\//, "train/failed_count", "train/rejected_groups", "rollout/groups_aborted",
      "rollout/groups_filtered", "buffer/dead_letter_groups", "buffer/stale_groups_dropped", /^buffer\/dropped\//]],
  ["SFT warm start: loss", ["sft/loss"], "sft_step"],
];

const state = {
  token: sessionStorage.getItem(TOKEN_KEY) || "",
  runs: [],
  selected: null,   // run id
  run: null,        // GET /runs/{id}
  since: 0,         // metrics cursor
  charts: [],       // {def, chart}
  extra: new Map(), // metric name -> chart added by hand
  names: new Set(), // metric names seen
  tab: "curves",
  samplesOffset: 0,
  timer: null,
};

const $ = (sel) => document.querySelector(sel);

class ApiError extends Error {
  constructor(status, detail) {
    super(typeof detail === "string" ? detail : JSON.stringify(detail));
    this.status = status;
    this.detail = detail;
  }
}

async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (state.token) headers.Authorization = `Bearer ${state.token}`;
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, { ...options, headers });
  const text = await r.text();
  let body = null;
  try { body = text ? JSON.parse(text) : null; } catch (e) { body = text; }
  if (r.status === 401) {
    showLogin((body && body.detail) || "the coordinator refused the token");
    throw new ApiError(401, body && body.detail);
  }
  if (!r.ok) throw new ApiError(r.status, body && body.detail !== undefined ? body.detail : text);
  return body;
}

function describeError(e) {
  if (!(e instanceof ApiError)) return String(e);
  if (Array.isArray(e.detail)) {  // 422: a list of {loc, msg}
    return e.detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("\n");
  }
  return `${e.status}: ${e.message}`;
}

// ---- token ---------------------------------------------------------------------------

function showLogin(message) {
  stopPolling();
  $("#forget-token").hidden = true;
  $("#app").hidden = true;
  $("#login").hidden = false;
  $("#login-error").textContent = message || "";
  $("#token").focus();
}

$("#token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.token = $("#token").value.trim();
  sessionStorage.setItem(TOKEN_KEY, state.token);
  $("#token").value = "";
  start();
});

$("#forget-token").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  state.token = "";
  showLogin("");
});

// ---- runs list -----------------------------------------------------------------------

function badge(el, status) {
  el.textContent = status;
  el.className = `badge status-${status}`;
}

function renderRuns() {
  const body = $("#runs tbody");
  body.replaceChildren();
  for (const r of [...state.runs].reverse()) {
    const tr = document.createElement("tr");
    tr.dataset.runId = r.id;
    if (r.id === state.selected) tr.className = "selected";
    const name = document.createElement("td");
    name.append(document.createTextNode(r.name || "(unnamed)"), document.createElement("br"));
    const code = document.createElement("code");
    code.textContent = r.id;
    name.append(code);
    const status = document.createElement("td");
    const b = document.createElement("span");
    badge(b, r.status);
    status.append(b);
    const phase = document.createElement("td");
    phase.textContent = r.queue_position ? `queued #${r.queue_position}` : r.phase;
    const progress = document.createElement("td");
    progress.textContent = `${r.rollout_id} / ${r.num_rollouts}`;
    const pick = document.createElement("td");
    const box = document.createElement("input");
    box.type = "checkbox";
    box.className = "compare";
    box.title = "Compare this run's curves with the other ticked runs'";
    box.checked = compareIds().includes(r.id);
    box.addEventListener("click", (ev) => ev.stopPropagation());
    box.addEventListener("change", () => toggleCompare(r.id, box.checked));
    pick.append(box);
    tr.append(pick, name, status, phase, progress);
    tr.addEventListener("click", () => selectRun(r.id));
    body.append(tr);
  }
}

// ---- one run -------------------------------------------------------------------------

function resetCharts() {
  state.since = 0;
  state.names = new Set();
  state.extra = new Map();
  state.charts = CHARTS.map(([title, names, x, options]) => ({
    names, x: x || "rollout_id", chart: new LineChart(title, { xName: x || "rollout_id", ...options }),
  }));
  const box = $("#charts");
  box.replaceChildren(...state.charts.map((c) => c.chart.root));
  for (const c of state.charts) c.chart.draw();
  $("#add-chart").replaceChildren(new Option("(metric)", ""));
}

function matches(names, key) {
  return names.some((n) => (typeof n === "string" ? n === key : n.test(key)));
}

function addRecords(records) {
  const touched = new Set();
  for (const rec of records) {
    for (const [key, value] of Object.entries(rec)) {
      if (typeof value !== "number" || ["rollout_id", "sft_step", "step", "time"].includes(key)) continue;
      if (!state.names.has(key)) {
        state.names.add(key);
        $("#add-chart").append(new Option(key, key));
      }
      for (const c of state.charts) {
        if (rec[c.x] !== undefined && matches(c.names, key)) {
          c.chart.add(key, rec[c.x], value);
          touched.add(c.chart);
        }
      }
      const extra = state.extra.get(key);
      if (extra && rec.rollout_id !== undefined) {
        extra.add(key, rec.rollout_id, value);
        touched.add(extra);
      }
    }
  }
  for (const chart of touched) chart.draw();
}

async function pollMetrics(runId) {
  for (;;) {
    const page = await api(`/runs/${runId}/metrics?since=${state.since}&limit=${METRICS_PAGE}`);
    if (state.selected !== runId) return;
    state.since = page.next;
    addRecords(page.records);
    $("#metric-count").textContent = String(page.total);
    if (page.records.length < METRICS_PAGE) return;
  }
}

$("#add-chart").addEventListener("change", async (ev) => {
  const key = ev.target.value;
  ev.target.value = "";
  if (!key || state.extra.has(key) || !state.selected) return;
  const chart = new LineChart(key, { xName: "rollout_id" });
  state.extra.set(key, chart);
  $("#charts").append(chart.root);
  // The points so far: the field alone, from the start.
  let since = 0;
  for (;;) {
    const page = await api(`/runs/${state.selected}/metrics?since=${since}&limit=${METRICS_PAGE}&fields=${encodeURIComponent(key)}`);
    for (const rec of page.records) if (rec.rollout_id !== undefined) chart.add(key, rec.rollout_id, rec[key]);
    since = page.next;
    if (since >= page.total) break;
  }
  chart.draw();
});

function renderRun() {
  const r = state.run;
  if (!r) return;
  $("#run").hidden = false;
  $("#run-name").textContent = r.name || "(unnamed)";
  $("#run-id").textContent = r.id;
  badge($("#run-status"), r.status === "paused" && !r.held ? "pausing" : r.status);
  $("#run-phase").textContent = r.queue_position ? `queued, #${r.queue_position} in line` : `phase ${r.phase}`;
  $("#run-progress").textContent = `rollout ${r.rollout_id} / ${r.num_rollouts}, weights v${r.weight_version}`;
  $("#run-waiting").textContent = r.waiting_for ? `waiting for ${r.waiting_for}` : "";
  $("#run-error").textContent = r.error || "";
  const warnings = r.warnings || [];
  if ($("#run-warnings").childElementCount !== warnings.length) {
    $("#run-warnings").replaceChildren(...warnings.map((w) => el("li", "", w)));
  }
  $("#pause").disabled = !["pending", "running"].includes(r.status);
  $("#resume").disabled = r.status !== "paused";
  $("#stop").disabled = !(ACTIVE.includes(r.status) || r.status === "queued") || r.status === "stopping";
  $("#delete").disabled = !(FINAL.includes(r.status) || r.status === "queued");
  const config = JSON.stringify(r.config, null, 2);
  if ($("#config").textContent !== config) $("#config").textContent = config;
}

async function selectRun(runId) {
  if (state.selected !== runId) {
    state.selected = runId;
    state.run = null;
    state.samplesOffset = 0;
    resetCharts();
    $("#samples").replaceChildren();
  }
  renderRuns();
  await refresh();
  if (state.tab === "samples") await loadSamples();
  if (state.tab === "checkpoints") await loadCheckpoints();
}

async function control(action) {
  const id = state.selected;
  try {
    if (action === "delete") {
      if (!confirm(`Delete run ${id}, its metrics and its buffer data? Checkpoints stay on disk.`)) return;
      await api(`/runs/${id}`, { method: "DELETE" });
      state.selected = null;
      state.run = null;
      $("#run").hidden = true;
    } else {
      await api(`/runs/${id}/${action}`, { method: "POST" });
    }
    $("#run-error").textContent = "";
  } catch (e) {
    $("#run-error").textContent = describeError(e);
  }
  await refresh();
}

for (const action of ["pause", "resume", "stop", "delete"]) {
  $(`#${action}`).addEventListener("click", () => control(action));
}

// ---- checkpoints ---------------------------------------------------------------------

async function loadCheckpoints() {
  const id = state.selected;
  const body = $("#checkpoints tbody");
  try {
    const list = await api(`/runs/${id}/checkpoints`);
    body.replaceChildren(...list.map((c) => {
      const tr = el("tr");
      tr.append(el("td", "num", String(c.step)), el("td", "num", `v${c.weight_version}`),
        el("td", "", c.automatic ? "automatic" : "saved"), el("td", "", new Date(c.written_at * 1000).toLocaleString()),
        el("td", "", c.path));
      return tr;
    }));
    $("#checkpoints-note").textContent = list.length ? "" : "No checkpoints (checkpoint_interval is 0, or none was written yet).";
  } catch (e) {
    $("#checkpoints-note").textContent = describeError(e);
  }
}

// ---- tabs, new runs, polling ---------------------------------------------------------

for (const b of document.querySelectorAll("#tabs button")) {
  b.addEventListener("click", () => {
    state.tab = b.dataset.tab;
    for (const other of document.querySelectorAll("#tabs button")) other.classList.toggle("active", other === b);
    for (const t of document.querySelectorAll(".tab")) t.hidden = t.id !== `tab-${state.tab}`;
    if (state.tab === "samples") loadSamples();
    if (state.tab === "checkpoints") loadCheckpoints();
    if (state.tab === "compare") loadCompare();
  });
}

$("#config-input").value = sessionStorage.getItem(DRAFT_KEY) || JSON.stringify(TEMPLATE, null, 2);
$("#config-input").addEventListener("input", (ev) => sessionStorage.setItem(DRAFT_KEY, ev.target.value));

$("#config-to-new").addEventListener("click", () => {
  if (!state.run) return;
  $("#config-input").value = JSON.stringify(state.run.config, null, 2);
  sessionStorage.setItem(DRAFT_KEY, $("#config-input").value);
  $("#new-run").open = true;
});

$("#start-run").addEventListener("click", async () => {
  $("#start-error").textContent = "";
  let config;
  try {
    config = JSON.parse($("#config-input").value);
  } catch (e) {
    $("#start-error").textContent = `not JSON: ${e.message}`;
    return;
  }
  try {
    const created = await api("/runs", { method: "POST", body: JSON.stringify(config) });
    $("#config-input").value = JSON.stringify(config, null, 2);
    sessionStorage.setItem(DRAFT_KEY, $("#config-input").value);
    await refreshRuns();
    await selectRun(created.id);
  } catch (e) {
    $("#start-error").textContent = describeError(e);
  }
});

async function refreshRuns() {
  const runs = [];
  for (;;) {  // (the API answers a page of runs at a time)
    const page = await api(`/runs?offset=${runs.length}&limit=${RUNS_PAGE}`);
    runs.push(...page);
    if (page.length < RUNS_PAGE) break;
  }
  state.runs = runs;
  renderRuns();
}

async function refresh() {
  try {
    await refreshRuns();
    $("#connection").textContent = `updated ${new Date().toLocaleTimeString()}`;
    const id = state.selected;
    if (!id) return;
    state.run = await api(`/runs/${id}?metrics_last=0`);
    if (state.selected !== id) return;
    renderRun();
    await pollMetrics(id);
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) return;
    if (e instanceof ApiError && e.status === 404 && state.selected) {
      state.selected = null;
      $("#run").hidden = true;
      return;
    }
    $("#connection").textContent = `cannot reach the coordinator: ${describeError(e)}`;
  }
}

function stopPolling() {
  if (state.timer) clearTimeout(state.timer);
  state.timer = null;
}

async function tick() {
  await refresh();
  if (state.tab === "samples" && state.run && ACTIVE.includes(state.run.status) && state.samplesOffset === 0) {
    await loadSamples();
  }
  if (state.tab === "compare") await pollCompare();
  if (!$("#app").hidden) state.timer = setTimeout(tick, POLL_MS);
}

async function start() {
  stopPolling();
  try {
    await api("/runs?limit=1");
  } catch (e) {
    if (!(e instanceof ApiError && e.status === 401)) showLogin(`cannot reach the coordinator: ${describeError(e)}`);
    return;
  }
  $("#login").hidden = true;
  $("#app").hidden = false;
  $("#forget-token").hidden = !state.token;
  resetCharts();
  await tick();
  if (!state.selected && state.runs.length) await selectRun(state.runs[state.runs.length - 1].id);
}

// (after the page's other scripts have run: samples.js and compare.js add to it)
window.addEventListener("DOMContentLoaded", start);
