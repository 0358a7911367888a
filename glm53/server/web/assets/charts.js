// The dashboard's pictures, drawn here (SVG for the line and bar charts, a canvas for the heatmap): a few hundred
// lines instead of a charting library. Each redraws at its container's size in CSS pixels, so text stays legible
// on a phone, and skips drawing while hidden. Figures a test or a reader may want are also in data-* attributes.

import { el, svg } from "./dom.js";

const PAD = { left: 44, right: 8, top: 8, bottom: 18 };

function niceMax(value) {
  if (!(value > 0)) return 1;
  const step = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 2.5, 5, 10].map((m) => m * step).find((v) => v >= value * 1.05) ?? 10 * step;
}

function size(container) {
  const box = container.getBoundingClientRect();
  return { w: Math.floor(box.width), h: Math.floor(box.height) };
}

function timeAxis(node, w, h, windowS) {
  const y = h - 4;
  node.append(
    Object.assign(svg("text", { x: PAD.left, y, class: "axis" }), { textContent: `${Math.round(windowS / 60)} min ago` }),
    Object.assign(svg("text", { x: w - PAD.right, y, class: "axis end" }), { textContent: "now" }),
  );
}

function valueAxis(node, w, h, max, format) {
  for (const f of [0, 0.5, 1]) {
    const y = PAD.top + (1 - f) * (h - PAD.top - PAD.bottom);
    node.append(svg("line", { x1: PAD.left, x2: w - PAD.right, y1: y, y2: y, class: "grid" }));
    node.append(Object.assign(svg("text", { x: PAD.left - 4, y: y + 4, class: "axis end" }), { textContent: format(max * f) }));
  }
}

// One or more series over the last `windowS` seconds: samples are {t (seconds), [key]: number | null}; a null
// leaves a gap (nothing measured in that interval).
export class LineChart {
  constructor(container, { series, format, windowS }) {
    this.container = container;
    this.series = series; // [{key, label, className}]
    this.format = format;
    this.windowS = windowS;
    this.samples = [];
    this.now = 0;
    this.plot = el("div", { className: "plot" });
    this.legend = el("div", { className: "legend" });
    container.append(this.plot, this.legend);
    new ResizeObserver(() => this.draw()).observe(this.plot);
  }

  update(samples, now) {
    this.samples = samples.filter((s) => s.t >= now - this.windowS);
    this.now = now;
    const first = this.series[0].key;
    const values = this.samples.map((s) => s[first]).filter((v) => v !== null && v !== undefined);
    this.container.dataset.points = values.length;
    this.container.dataset.last = values.length ? values.at(-1) : "";
    this.legend.replaceChildren(
      ...this.series.map(({ key, label, className }) => {
        const last = this.samples.findLast((s) => s[key] !== null && s[key] !== undefined)?.[key];
        return el("span", { className: `key ${className}` }, el("i"), `${label} `, el("b", {}, last === undefined ? "—" : this.format(last)));
      }),
    );
    this.draw();
  }

  draw() {
    const { w, h } = size(this.plot);
    if (!w || !h) return;
    const node = svg("svg", { viewBox: `0 0 ${w} ${h}`, width: w, height: h });
    const values = this.samples.flatMap((s) => this.series.map(({ key }) => s[key])).filter((v) => v !== null && v !== undefined);
    const max = niceMax(Math.max(0, ...values));
    valueAxis(node, w, h, max, this.format);
    timeAxis(node, w, h, this.windowS);
    const x = (t) => PAD.left + (1 - (this.now - t) / this.windowS) * (w - PAD.left - PAD.right);
    const y = (v) => PAD.top + (1 - v / max) * (h - PAD.top - PAD.bottom);
    for (const { key, className } of this.series) {
      let d = "";
      let open = false;
      for (const s of this.samples) {
        const v = s[key];
        if (v === null || v === undefined) {
          open = false;
          continue;
        }
        d += `${open ? "L" : "M"}${x(s.t).toFixed(1)},${y(v).toFixed(1)}`;
        open = true;
      }
      // a lone point between gaps draws no segment: a dot shows it
      const lone = this.samples.filter((s, i, all) => s[key] != null && all[i - 1]?.[key] == null && all[i + 1]?.[key] == null);
      node.append(svg("path", { d, class: `line ${className}` }));
      for (const s of lone) node.append(svg("circle", { cx: x(s.t), cy: y(s[key]), r: 2.5, class: `dot ${className}` }));
    }
    this.plot.replaceChildren(node);
  }
}

// Stacked bars, one per sample: samples are {t, parts: [number, ...] | null}.
export class StackedBars {
  constructor(container, { parts, format, windowS, intervalS }) {
    this.container = container;
    this.parts = parts; // [{label, className}]
    this.format = format;
    this.windowS = windowS;
    this.intervalS = intervalS;
    this.samples = [];
    this.plot = el("div", { className: "plot" });
    this.legend = el("div", { className: "legend" });
    this.note = el("p", { className: "muted note" });
    container.append(this.plot, this.legend, this.note);
    new ResizeObserver(() => this.draw()).observe(this.plot);
  }

  // `totals`: the parts since the server started (for the legend's shares), or null when there is nothing to split
  update(samples, now, totals, note) {
    this.samples = samples.filter((s) => s.t >= now - this.windowS && s.parts);
    this.now = now;
    this.note.textContent = note;
    this.container.dataset.bars = this.samples.length;
    const sum = totals ? totals.reduce((a, b) => a + b, 0) : 0;
    this.container.dataset.totals = totals ? totals.join(",") : "";
    this.legend.replaceChildren(
      ...this.parts.map(({ label, className }, i) =>
        el("span", { className: `key ${className}` }, el("i"), `${label} `, el("b", {}, sum ? `${((100 * totals[i]) / sum).toFixed(1)} %` : "—")),
      ),
    );
    this.draw();
  }

  draw() {
    const { w, h } = size(this.plot);
    if (!w || !h) return;
    const node = svg("svg", { viewBox: `0 0 ${w} ${h}`, width: w, height: h });
    const max = niceMax(Math.max(0, ...this.samples.map((s) => s.parts.reduce((a, b) => a + b, 0))));
    valueAxis(node, w, h, max, this.format);
    timeAxis(node, w, h, this.windowS);
    const plotW = w - PAD.left - PAD.right;
    const barW = Math.max(1, (plotW * this.intervalS) / this.windowS - 1);
    const scale = (h - PAD.top - PAD.bottom) / max;
    for (const s of this.samples) {
      const x = PAD.left + (1 - (this.now - s.t) / this.windowS) * plotW - barW;
      let base = h - PAD.bottom;
      s.parts.forEach((v, i) => {
        if (!v) return;
        base -= v * scale;
        node.append(svg("rect", { x: x.toFixed(1), y: base.toFixed(1), width: barW.toFixed(1), height: (v * scale).toFixed(1), class: `bar ${this.parts[i].className}` }));
      });
    }
    this.plot.replaceChildren(node);
  }
}

// viridis at five stops: dark for a low hit rate, yellow for a high one
const STOPS = [
  [68, 1, 84],
  [59, 82, 139],
  [33, 145, 140],
  [94, 201, 98],
  [253, 231, 37],
];

export function rateColor(rate) {
  const f = Math.min(1, Math.max(0, rate)) * (STOPS.length - 1);
  const i = Math.min(STOPS.length - 2, Math.floor(f));
  const mix = STOPS[i].map((c, k) => Math.round(c + (STOPS[i + 1][k] - c) * (f - i)));
  return `rgb(${mix.join(",")})`;
}

// Rows (MoE layers) by columns (poll intervals, oldest first), a rate in 0..1 or null per cell, and one column
// more at the right: each row's rate since the server started.
export class Heatmap {
  constructor(container) {
    this.container = container;
    this.canvas = el("canvas");
    this.tip = el("p", { className: "muted note", textContent: "Hover a cell for its figures." });
    this.scale = el("div", { className: "scale" }, el("span", {}, "0 %"), el("i"), el("span", {}, "100 % hits"));
    container.append(this.canvas, this.scale, this.tip);
    this.data = null;
    new ResizeObserver(() => this.draw()).observe(container);
    this.canvas.addEventListener("mousemove", (e) => this.hover(e));
  }

  update(data) {
    // data: {labels: [...], columns: [{t, rates: [...]}], totals: [...], now}
    this.data = data;
    this.container.dataset.rows = data.labels.length;
    this.container.dataset.columns = data.columns.length;
    this.container.dataset.totals = data.totals.map((r) => (r === null ? "" : r)).join(",");
    this.draw();
  }

  layout() {
    const rows = this.data.labels.length;
    const width = this.container.clientWidth;
    const rowH = Math.max(6, Math.min(16, Math.floor(340 / rows)));
    const labelW = 30;
    const totalW = 28;
    const gap = 6;
    // at least a minute's columns wide, the newest at the right (as "now" in the line charts)
    const slots = Math.max(this.data.columns.length, 60);
    const cellW = Math.max(1, (width - labelW - totalW - gap) / slots);
    const left = labelW + (slots - this.data.columns.length) * cellW;
    return { rows, width, rowH, labelW, totalW, cellW, left, height: rows * rowH + 14 };
  }

  draw() {
    if (!this.data || !this.container.clientWidth) return;
    const L = this.layout();
    const ratio = window.devicePixelRatio || 1;
    this.canvas.width = L.width * ratio;
    this.canvas.height = L.height * ratio;
    this.canvas.style.width = `${L.width}px`;
    this.canvas.style.height = `${L.height}px`;
    const g = this.canvas.getContext("2d");
    g.scale(ratio, ratio);
    g.font = "10px system-ui, sans-serif";
    g.textBaseline = "middle";
    const every = L.rowH >= 10 ? 1 : 5;
    this.data.labels.forEach((label, r) => {
      const y = r * L.rowH;
      g.fillStyle = "#8b93a7";
      if (r % every === 0) g.fillText(label, 0, y + L.rowH / 2);
      this.data.columns.forEach((col, c) => {
        const rate = col.rates[r];
        g.fillStyle = rate === null || rate === undefined ? "#262b36" : rateColor(rate);
        g.fillRect(L.left + c * L.cellW, y, Math.ceil(L.cellW), L.rowH - 1);
      });
      const total = this.data.totals[r];
      g.fillStyle = total === null ? "#262b36" : rateColor(total);
      g.fillRect(L.width - L.totalW, y, L.totalW, L.rowH - 1);
    });
    g.fillStyle = "#8b93a7";
    g.textBaseline = "alphabetic";
    g.fillText("layer", 0, L.height - 2);
    g.fillText("over time →", L.labelW, L.height - 2);
    g.textAlign = "right";
    g.fillText("all", L.width, L.height - 2);
  }

  hover(event) {
    if (!this.data) return;
    const L = this.layout();
    const box = this.canvas.getBoundingClientRect();
    const x = event.clientX - box.left;
    const r = Math.floor((event.clientY - box.top) / L.rowH);
    if (r < 0 || r >= L.rows) return;
    const label = `layer ${this.data.labels[r]}`;
    const pct = (v) => (v === null || v === undefined ? "no picks" : `${(100 * v).toFixed(1)} % hits`);
    if (x >= L.width - L.totalW) this.tip.textContent = `${label}, since start: ${pct(this.data.totals[r])}`;
    else {
      const col = this.data.columns[Math.floor((x - L.left) / L.cellW)];
      if (col) this.tip.textContent = `${label}, ${Math.round(this.data.now - col.t)} s ago: ${pct(col.rates[r])}`;
    }
  }
}
