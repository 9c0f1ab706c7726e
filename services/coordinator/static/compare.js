// Comparing runs: the ticked runs' curves of one metric overlaid, one colour per run, each
// named by the run and the config settings that differ between the runs (from GET /runs/{id}),
// with a table of all those settings below.
"use strict";

const COMPARE_MAX = 8;     // runs overlaid at most: the chart has as many colours
const LEGEND_KEYS = 4;     // differing settings named in a legend entry (the table has them all)
const SETTINGS_ROWS = 100; // rows of the settings table at most

const compare = {
  ids: [],                 // the ticked runs, in the order ticked
  metric: "rollout/reward_mean",
  runs: new Map(),         // id -> {detail, since, points: [[x, y], ...]}
  names: new Set(["rollout/reward_mean"]),
  generation: 0,           // bumped when the metric changes: answers for the old one are dropped
  dirty: true,
  busy: false,
};

function compareIds() {
  return compare.ids;
}

function toggleCompare(id, on) {
  compare.ids = compare.ids.filter((x) => x !== id);
  if (on && compare.ids.length >= COMPARE_MAX) {
    $("#compare-note").textContent = `At most ${COMPARE_MAX} runs at a time: untick one first.`;
  } else if (on) {
    compare.ids.push(id);
  }
  compare.dirty = true;
  renderRuns();
  if (state.tab === "compare") loadCompare();
}

// A config as dotted keys (optimizer.lr) and their values as JSON; lists are one value.
function flatten(value, prefix, out) {
  if (value && typeof value === "object" && !Array.isArray(value)) {
    for (const [k, v] of Object.entries(value)) flatten(v, prefix ? `${prefix}.${k}` : k, out);
  } else {
    out.set(prefix, JSON.stringify(value));
  }
  return out;
}

// The settings whose values are not the same in every config (the name is shown anyway).
function differingSettings(configs) {
  const flat = configs.map((c) => flatten(c || {}, "", new Map()));
  const keys = new Set(flat.flatMap((f) => [...f.keys()]));
  return [...keys].filter((k) => k !== "name" && new Set(flat.map((f) => f.get(k))).size > 1).sort()
    .map((key) => ({ key, values: flat.map((f) => (f.has(key) ? f.get(key) : "(unset)")) }));
}

function runLabels(runs, settings) {
  const seen = new Set();
  return runs.map((r, i) => {
    const named = settings.slice(0, LEGEND_KEYS).map((s) => `${s.key}=${s.values[i]}`);
    if (settings.length > LEGEND_KEYS) named.push(`+${settings.length - LEGEND_KEYS} more`);
    let label = `${r.detail.name || "(unnamed)"}${named.length ? ` (${named.join(", ")})` : ""}`;
    if (seen.has(label)) label += ` [${r.detail.id}]`;  // two series of one name would be drawn as one
    seen.add(label);
    return label;
  });
}

function xOf(metric) {
  return metric.startsWith("sft/") ? "sft_step" : "rollout_id";
}

function noteNames(records) {
  let added = false;
  for (const rec of records || []) {
    for (const [k, v] of Object.entries(rec)) {
      if (typeof v === "number" && !["rollout_id", "sft_step", "step", "time"].includes(k) && !compare.names.has(k)) {
        compare.names.add(k);
        added = true;
      }
    }
  }
  return added;
}

function renderMetricSelect() {
  const select = $("#compare-metric");
  for (const k of state.names) compare.names.add(k);
  if (select.options.length === compare.names.size) return;
  const names = [...compare.names].sort();
  select.replaceChildren(...names.map((k) => new Option(k, k, false, k === compare.metric)));
}

$("#compare-metric").addEventListener("change", (ev) => {
  compare.metric = ev.target.value;
  compare.generation += 1;
  for (const r of compare.runs.values()) {
    r.since = 0;
    r.points = [];
  }
  compare.dirty = true;
  loadCompare();
});

// New points of the metric for every compared run, from each one's cursor.
async function fetchPoints() {
  const { metric, generation } = compare;
  const x = xOf(metric);
  for (const [id, run] of compare.runs) {
    for (;;) {
      const page = await api(`/runs/${id}/metrics?since=${run.since}&limit=${METRICS_PAGE}` +
        `&fields=${encodeURIComponent(metric)}`);
      if (generation !== compare.generation || compare.runs.get(id) !== run) return;
      for (const rec of page.records) {
        if (rec[x] !== undefined && typeof rec[metric] === "number") run.points.push([rec[x], rec[metric]]);
      }
      if (page.records.length) compare.dirty = true;
      run.since = page.next;
      if (run.since >= page.total) break;
    }
  }
}

async function loadCompare() {
  if (compare.busy) return;
  compare.busy = true;
  try {
    for (const id of [...compare.runs.keys()]) {
      if (!compare.ids.includes(id)) compare.runs.delete(id);
    }
    for (const id of compare.ids) {
      if (compare.runs.has(id)) continue;
      try {
        const detail = await api(`/runs/${id}?metrics_last=20`);
        compare.runs.set(id, { detail, since: 0, points: [] });
        noteNames(detail.metrics);
      } catch (e) {
        if (!(e instanceof ApiError && e.status === 404)) throw e;
        compare.ids = compare.ids.filter((x) => x !== id);  // deleted since it was ticked
        renderRuns();
      }
      compare.dirty = true;
    }
    renderMetricSelect();
    await fetchPoints();
    if (compare.dirty) renderCompare();
  } catch (e) {
    $("#compare-note").textContent = describeError(e);
  } finally {
    compare.busy = false;
  }
}

async function pollCompare() {
  await loadCompare();
}

function renderCompare() {
  compare.dirty = false;
  const runs = compare.ids.filter((id) => compare.runs.has(id)).map((id) => compare.runs.get(id));
  $("#compare-note").textContent = runs.length < 2
    ? `Tick two or more runs in the list to compare them (${runs.length} ticked).` : "";
  const settings = differingSettings(runs.map((r) => r.detail.config));
  const labels = runLabels(runs, settings);
  const chart = new LineChart(`Runs compared: ${compare.metric}`, { xName: xOf(compare.metric) });
  chart.root.dataset.runs = String(runs.length);
  runs.forEach((r, i) => {
    for (const [x, y] of r.points) chart.add(labels[i], x, y);
  });
  chart.draw();
  $("#compare-charts").replaceChildren(chart.root);

  const head = el("tr");
  head.append(el("th", "", "setting"), ...runs.map((r) => el("th", "", r.detail.name || r.detail.id)));
  $("#compare-settings thead").replaceChildren(runs.length ? head : "");
  const rows = settings.slice(0, SETTINGS_ROWS).map((s) => {
    const tr = el("tr");
    tr.append(el("td", "", s.key), ...s.values.map((v) => el("td", "", v)));
    return tr;
  });
  if (runs.length >= 2 && !settings.length) {
    const tr = el("tr");
    tr.append(el("td", "muted", "no setting differs"));
    rows.push(tr);
  }
  $("#compare-settings tbody").replaceChildren(...rows);
}
