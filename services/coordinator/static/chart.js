// A small line chart in SVG: several named series of (x, y) points, axes with a few
// ticks, a legend with each series' latest value. Stacked, each series is drawn as a band
// on top of the ones before it (parts of a whole: a step's time split). Its data downloads
// as CSV (one column per series, a row per x). No dependencies.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const MAX_DOTS = 150; // a series with more points is drawn as a line only
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04"];

function svgElement(name, attrs, text) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function formatNumber(v) {
  if (!isFinite(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return Number(v.toPrecision(4)).toString();
}

function niceTicks(lo, hi, count) {
  if (lo === hi) { lo -= 1; hi += 1; }
  const step0 = (hi - lo) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(step0)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= step0);
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  return ticks;
}

// A long run has more points than a chart has pixels: draw every k-th (and the last).
const MAX_DRAWN = 1000;
function thin(points) {
  if (points.length <= MAX_DRAWN) return points;
  const stride = Math.ceil(points.length / MAX_DRAWN);
  const kept = points.filter((_, i) => i % stride === 0);
  if (kept[kept.length - 1] !== points[points.length - 1]) kept.push(points[points.length - 1]);
  return kept;
}

// Stacked: each series' points become [x, below, below + y], "below" being the sum of
// the series before it at that x (a series without a point at an x adds nothing there).
function stack(series) {
  const below = new Map();
  const out = new Map();
  for (const [name, pts] of series) {
    const byX = new Map(pts.map((p) => [p[0], p[1]]));
    const xs = [...new Set([...below.keys(), ...byX.keys()])].sort((a, b) => a - b);
    out.set(name, xs.map((x) => {
      const lo = below.get(x) || 0;
      const hi = lo + (byX.get(x) || 0);
      below.set(x, hi);
      return [x, lo, hi];
    }));
  }
  return out;
}

function csvField(v) {
  return /[",\n\r]/.test(v) ? `"${v.replace(/"/g, '""')}"` : v;
}

class LineChart {
  constructor(title, { width = 420, height = 220, stacked = false, xName = "x" } = {}) {
    this.title = title;
    this.xName = xName;
    this.stacked = stacked;
    this.width = width;
    this.height = height;
    this.series = new Map(); // name -> [[x, y], ...]
    this.root = document.createElement("figure");
    this.root.className = "chart";
    this.root.dataset.title = title;
    if (stacked) this.root.dataset.stacked = "true";
    const caption = document.createElement("figcaption");
    const csv = document.createElement("button");
    csv.type = "button";
    csv.className = "csv quiet-light";
    csv.textContent = "CSV";
    csv.title = "Download this chart's data as CSV";
    csv.addEventListener("click", () => this.download());
    caption.append(document.createTextNode(title), csv);
    this.svg = svgElement("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": title });
    this.legend = document.createElement("ul");
    this.legend.className = "legend";
    this.root.append(caption, this.svg, this.legend);
  }

  add(name, x, y) {
    if (typeof y !== "number" || !isFinite(y)) return;
    if (!this.series.has(name)) this.series.set(name, []);
    this.series.get(name).push([x, y]);
  }

  // One row per x (ascending), a column per series; a series without a point at an x is empty there.
  csv() {
    const names = [...this.series.keys()];
    const rows = new Map();
    names.forEach((name, i) => {
      for (const [x, y] of this.series.get(name)) {
        if (!rows.has(x)) rows.set(x, new Array(names.length).fill(""));
        rows.get(x)[i] = String(y);
      }
    });
    // (a name a spreadsheet would take for a formula is quoted with a leading ')
    const header = [this.xName, ...names].map((n) => (/^[=+@-]/.test(n) ? `'${n}` : n));
    const lines = [header.map(csvField).join(",")];
    for (const x of [...rows.keys()].sort((a, b) => a - b)) lines.push([String(x), ...rows.get(x)].map(csvField).join(","));
    return lines.join("\n") + "\n";
  }

  download() {
    const url = URL.createObjectURL(new Blob([this.csv()], { type: "text/csv" }));
    const a = document.createElement("a");
    a.href = url;
    a.download = `${this.title.replace(/[^A-Za-z0-9._-]+/g, "_").replace(/^_+|_+$/g, "").slice(0, 80) || "chart"}.csv`;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10_000);
  }

  points() {
    let n = 0;
    for (const pts of this.series.values()) n += pts.length;
    return n;
  }

  draw() {
    const { width, height } = this;
    const pad = { left: 56, right: 10, top: 10, bottom: 26 };
    this.svg.replaceChildren();
    this.legend.replaceChildren();
    this.root.dataset.points = String(this.points());
    const bands = this.stacked ? stack(this.series) : null;
    const all = bands
      ? [...bands.values()].flat().flatMap((p) => [[p[0], p[1]], [p[0], p[2]]])
      : [...this.series.values()].flat();
    if (!all.length) {
      this.svg.append(svgElement("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" },
        "no points yet"));
      return;
    }
    let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
    let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
    const sx = (x) => pad.left + ((x - x0) / (x1 - x0)) * (width - pad.left - pad.right);
    const sy = (y) => height - pad.bottom - ((y - y0) / (y1 - y0)) * (height - pad.top - pad.bottom);

    for (const t of niceTicks(y0, y1, 4)) {
      if (t < y0 || t > y1) continue;
      this.svg.append(svgElement("line", { x1: pad.left, x2: width - pad.right, y1: sy(t), y2: sy(t), class: "grid" }));
      this.svg.append(svgElement("text", { x: pad.left - 4, y: sy(t) + 4, "text-anchor": "end", class: "tick" },
        formatNumber(t)));
    }
    for (const t of niceTicks(x0, x1, 5)) {
      if (t < x0 || t > x1) continue;
      this.svg.append(svgElement("text", { x: sx(t), y: height - 8, "text-anchor": "middle", class: "tick" },
        formatNumber(t)));
    }
    this.svg.append(svgElement("line", { x1: pad.left, x2: pad.left, y1: pad.top, y2: height - pad.bottom, class: "axis" }));
    this.svg.append(svgElement("line", { x1: pad.left, x2: width - pad.right, y1: height - pad.bottom,
      y2: height - pad.bottom, class: "axis" }));

    let i = 0;
    for (const [name, pts] of this.series) {
      const color = COLORS[i++ % COLORS.length];
      if (bands) {
        const band = thin(bands.get(name));
        const top = band.map((p, k) => `${k ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[2]).toFixed(1)}`).join("");
        const bottom = [...band].reverse().map((p) => `L${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
        this.svg.append(svgElement("path", { d: `${top}${bottom}Z`, fill: color, "fill-opacity": 0.45, stroke: color,
          "stroke-width": 1 }));
      }
      const sorted = bands ? [] : thin([...pts].sort((a, b) => a[0] - b[0]));
      const d = sorted.map((p, k) => `${k ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
      if (d) this.svg.append(svgElement("path", { d, stroke: color, fill: "none", "stroke-width": 2 }));
      for (const p of sorted.length <= MAX_DOTS ? sorted : []) {
        const dot = svgElement("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: color });
        dot.append(svgElement("title", {}, `${name} @ ${p[0]}: ${formatNumber(p[1])}`));
        this.svg.append(dot);
      }
      const item = document.createElement("li");
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = color;
      const last = pts[pts.length - 1][1];
      item.append(swatch, document.createTextNode(`${name}: ${formatNumber(last)}`));
      this.legend.append(item);
    }
  }
}

window.LineChart = LineChart;
window.formatNumber = formatNumber;
