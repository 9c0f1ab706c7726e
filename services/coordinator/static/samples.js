// The samples browser: the run's newest kept groups (the buffer's recent_groups), newest
// first, a page at a time, optionally only the samples of one status and reward range.
"use strict";

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

function promptOf(sample) {
  if (sample.messages && sample.messages.length) {
    return sample.messages.map((m) => `[${m.role}] ${m.content}`).join("\n");
  }
  return sample.prompt;
}

function renderGroup(g) {
  const card = el("article", "group");
  card.dataset.groupId = g.group_id;
  const first = g.samples[0] || {};
  const shown = g.samples_total !== undefined ? ` · ${g.samples.length} of ${g.samples_total} samples match` : "";
  card.append(el("h3", "", `group ${g.group_index} · ${g.dataset || "?"} · ${g.group_id}${shown}`));
  card.append(el("pre", "prompt", promptOf(first)));
  if (first.label) card.append(el("p", "muted", `label: ${first.label}`));
  const table = el("table", "samples");
  const head = el("tr");
  for (const h of ["#", "status", "reward", "components", "weights", "tokens", "response"]) head.append(el("th", "", h));
  table.append(head);
  for (const s of g.samples) {
    const tr = el("tr");
    tr.append(el("td", "", String(s.index)));
    tr.append(el("td", `sample-${s.status}`, s.status));
    tr.append(el("td", "num", formatNumber(s.reward)));
    tr.append(el("td", "", Object.entries(s.reward_components || {}).map(([k, v]) => `${k}=${formatNumber(v)}`).join(", ")));
    tr.append(el("td", "", (s.weight_versions || []).map((v) => `v${v}`).join(" ")));
    tr.append(el("td", "num", String(s.response_length)));
    const response = el("td");
    response.append(el("pre", "response", s.response));
    const meta = s.metadata || {};
    if (meta.failure) response.append(el("p", "error", `failed: ${meta.failure}`));
    if (Array.isArray(meta.agent_turns) && meta.agent_turns.length) {
      // An agent episode: the model's turns and the tools' answers (trained with loss mask 0).
      const tools = meta.agent_turns.filter((t) => t.role === "tool").length;
      const turns = el("details", "turns");
      turns.append(el("summary", "", `${meta.agent_turns.length} turns, ${tools} tool answers`));
      for (const t of meta.agent_turns) {
        const who = t.role === "tool" ? `tool${t.name ? " " + t.name : ""}` : t.role;
        turns.append(el("pre", `turn turn-${t.role}`, `[${who}] ${t.content}`));
      }
      response.append(turns);
    }
    tr.append(response);
    table.append(tr);
  }
  card.append(table);
  return card;
}

// The filter as query parameters; an empty field is no bound.
function samplesFilter() {
  const q = new URLSearchParams();
  const status = $("#samples-status").value;
  if (status) q.set("status", status);
  for (const [field, param] of [["#samples-min-reward", "min_reward"], ["#samples-max-reward", "max_reward"]]) {
    const v = $(field).value.trim();
    if (v !== "") q.set(param, v);
  }
  return q;
}

async function loadSamples() {
  const id = state.selected;
  if (!id) return;
  try {
    const q = samplesFilter();
    const filtered = [...q.keys()].length > 0;
    q.set("offset", String(state.samplesOffset));
    q.set("limit", String(SAMPLES_PAGE));
    const page = await api(`/runs/${id}/samples?${q}`);
    if (state.selected !== id) return;
    $("#samples-total").textContent = filtered
      ? `${page.total} of the ${page.kept} groups kept match` : `${page.total} groups kept`;
    $("#samples").replaceChildren(...page.groups.map(renderGroup));
    if (!page.groups.length) $("#samples").append(el("p", "muted", filtered ? "no group matches" : "no groups yet"));
    $("#samples-newer").disabled = state.samplesOffset === 0;
    $("#samples-older").disabled = state.samplesOffset + SAMPLES_PAGE >= page.total;
  } catch (e) {
    $("#samples").replaceChildren(el("p", "error", describeError(e)));
  }
}

$("#samples-newer").addEventListener("click", () => {
  state.samplesOffset = Math.max(0, state.samplesOffset - SAMPLES_PAGE);
  loadSamples();
});
$("#samples-older").addEventListener("click", () => {
  state.samplesOffset += SAMPLES_PAGE;
  loadSamples();
});
$("#samples-refresh").addEventListener("click", loadSamples);
for (const field of ["#samples-status", "#samples-min-reward", "#samples-max-reward"]) {
  $(field).addEventListener("change", () => {
    state.samplesOffset = 0;
    loadSamples();
  });
}
