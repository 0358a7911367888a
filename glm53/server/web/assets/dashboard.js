// The engine view: /stats and /health polled once a second (a poll costs the server one small JSON answer, and
// needs no held connection or endpoint of its own), /server_info when the engine's state changes. Rates over an
// interval come from the difference of two polls' counters. Whatever this engine does not report (the CPU demo
// model has no expert cache, host link or GPU) shows as "—" or a sentence saying so.

import { APIError, getJSON, health } from "./api.js";
import { Heatmap, LineChart, StackedBars } from "./charts.js";
import { el } from "./dom.js";

const POLL_S = 1;
const WINDOW_S = 300; // the line charts' span
const HEATMAP_COLUMNS = 120;
const $ = (id) => document.getElementById(id);

const num = (v) => typeof v === "number" && Number.isFinite(v);
const fixed = (digits) => (v) => (num(v) ? v.toFixed(digits) : "—");
const seconds = (v) => (!num(v) ? "—" : v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`);

export function bytes(v) {
  if (!num(v)) return "—";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (v >= 1000 && i < units.length - 1) {
    v /= 1000;
    i++;
  }
  return `${v.toFixed(i && v < 10 ? 2 : i ? 1 : 0)} ${units[i]}`;
}

// a counter's growth between two polls; null when either is missing or it went down (the server restarted)
function grown(now, before) {
  return num(now) && num(before) && now >= before ? now - before : null;
}

export class Dashboard {
  constructor({ onUnauthorized }) {
    this.onUnauthorized = onUnauthorized;
    this.samples = [];
    this.previous = null; // the last /stats answer
    this.info = null; // the last /server_info answer
    this.infoState = null; // the engine state it was fetched in
    this.timer = null;
    this.tokps = new LineChart($("chart-tokps"), { series: [{ key: "tokps", label: "tok/s (all jobs)", className: "s1" }], format: fixed(1), windowS: WINDOW_S });
    this.ttft = new LineChart($("chart-ttft"), { series: [{ key: "ttft", label: "mean TTFT", className: "s2" }], format: seconds, windowS: WINDOW_S });
    this.jobs = new LineChart($("chart-jobs"), {
      series: [
        { key: "active", label: "running", className: "s1" },
        { key: "waiting", label: "queued", className: "s3" },
      ],
      format: fixed(0),
      windowS: WINDOW_S,
    });
    this.split = new StackedBars($("chart-split"), {
      parts: [
        { label: "over the link", className: "p1" },
        { label: "CPU tier", className: "p2" },
        { label: "prefetched", className: "p3" },
      ],
      format: fixed(0),
      windowS: WINDOW_S,
      intervalS: POLL_S,
    });
    this.heatmap = new Heatmap($("heatmap"));
  }

  start() {
    if (this.timer === null) this.poll();
  }

  stop() {
    clearTimeout(this.timer);
    this.timer = null;
  }

  async poll() {
    this.timer = setTimeout(() => this.poll(), POLL_S * 1000);
    const [h, stats] = await Promise.all([health().catch(() => null), getJSON("/stats").catch((err) => err)]);
    if (this.timer === null) return; // stopped meanwhile
    this.showHealth(h);
    if (stats instanceof APIError) {
      if (stats.status === 401) {
        this.stop();
        this.onUnauthorized(stats);
      }
      return;
    }
    const state = stats.scheduler?.state;
    if (state !== this.infoState) {
      this.infoState = state;
      getJSON("/server_info")
        .then((info) => {
          this.info = info;
          this.showSettings();
        })
        .catch(() => (this.infoState = null)); // asked again at the next poll
    }
    this.record(stats);
    this.render(stats);
  }

  record(stats) {
    const t = performance.now() / 1000;
    const prev = this.previous;
    this.previous = { t, stats };
    const sched = stats.scheduler ?? {};
    const req = stats.requests ?? {};
    const sample = { t, tokps: sched.state === "ready" ? sched.decode_tokens_per_second : null, waiting: sched.waiting, active: sched.active, ttft: null, rates: null, parts: null };
    if (prev) {
      const before = prev.stats;
      const n = grown(req.ttft_count, before.requests?.ttft_count);
      if (n) sample.ttft = grown(req.ttft_seconds_sum, before.requests?.ttft_seconds_sum) / n;
      const cache = offload(stats).cache;
      const cacheBefore = offload(before).cache;
      if (cache?.per_layer && cacheBefore?.per_layer?.length === cache.per_layer.length) {
        sample.rates = cache.per_layer.map((l, i) => {
          const picks = grown(l.picks, cacheBefore.per_layer[i].picks);
          const hits = grown(l.hits, cacheBefore.per_layer[i].hits);
          return picks && hits !== null ? hits / picks : null;
        });
        const steps = grown(cache.decode_steps, cacheBefore.decode_steps);
        if (steps) {
          const [link, cpu, pre] = missParts(stats).map((v, i) => grown(v, missParts(before)[i]));
          if (link !== null) sample.parts = [link / steps, (cpu ?? 0) / steps, (pre ?? 0) / steps];
        }
      }
    }
    this.samples.push(sample);
    while (this.samples.length && this.samples[0].t < t - WINDOW_S) this.samples.shift();
  }

  render(stats) {
    const now = this.previous.t;
    this.tokps.update(this.samples, now);
    this.ttft.update(this.samples, now);
    this.jobs.update(this.samples, now);
    this.showJobs(stats.scheduler ?? {});
    this.showCache(stats, now);
    this.showMemory(stats);
    this.showLink(offload(stats).link);
  }

  showHealth(h) {
    const pill = $("status");
    const status = h?.status ?? "unreachable";
    pill.dataset.state = status;
    pill.textContent = status === "loading" && num(h.progress) ? `loading ${Math.round(100 * h.progress)} %` : status === "ok" ? "ready" : status;
    const panel = $("load-panel");
    panel.hidden = status !== "loading" && status !== "failed";
    if (panel.hidden) return;
    $("load-bar").style.width = `${num(h.progress) ? 100 * h.progress : 0}%`;
    const parts = [h.phase ?? (status === "failed" ? "the load failed" : "starting")];
    if (num(h.progress)) parts.push(`${(100 * h.progress).toFixed(1)} %`);
    if (num(h.done) && num(h.total)) parts.push(h.unit === "B" ? `${bytes(h.done)} of ${bytes(h.total)}` : `${h.done} of ${h.total} ${h.unit ?? ""}`);
    if (num(h.rate_per_s)) parts.push(h.unit === "B" ? `${bytes(h.rate_per_s)}/s` : `${h.rate_per_s.toFixed(1)}/s`);
    if (num(h.eta_s)) parts.push(`about ${Math.ceil(h.eta_s)} s left`);
    if (h.error) parts.push(h.error);
    $("load-text").textContent = parts.join(" · ");
  }

  showJobs(s) {
    const figures = [
      ["running", s.active],
      ["queued", s.waiting],
      ["finished", s.jobs_finished],
      ["cancelled", s.jobs_cancelled],
      ["cut at length", s.jobs_length],
      ["errors", s.jobs_error],
      ["refused (429)", s.jobs_rejected],
    ];
    $("jobs").replaceChildren(...figures.map(([label, v]) => el("div", { className: "figure" }, el("b", { textContent: num(v) ? String(v) : "—" }), el("span", {}, label))));
    $("jobs").dataset.cancelled = num(s.jobs_cancelled) ? s.jobs_cancelled : "";
  }

  showCache(stats, now) {
    const cache = offload(stats).cache;
    const box = $("heatmap");
    if (!cache?.per_layer?.length) {
      box.dataset.rows = 0;
      box.replaceChildren(el("p", { className: "muted" }, stats.engine ? "— this engine has no expert cache (the CPU demo model keeps every expert in RAM)." : "— (no engine yet)"));
      this.heatmap = null;
      this.split.update([], now, null, "— nothing is offloaded on this engine.");
      return;
    }
    if (!this.heatmap) {
      box.replaceChildren();
      this.heatmap = new Heatmap(box);
    }
    const columns = this.samples.filter((s) => s.rates).slice(-HEATMAP_COLUMNS).map((s) => ({ t: s.t, rates: s.rates }));
    this.heatmap.update({ labels: cache.per_layer.map((l) => layerNumber(l.layer)), columns, totals: cache.per_layer.map((l) => l.hit_rate ?? null), now });
    const [link, cpu, pre] = missParts(stats);
    const overall = num(cache.hit_rate) ? `hit rate ${(100 * cache.hit_rate).toFixed(1)} %` + (num(cache.oracle_hit_rate) ? ` (best possible for its size: ${(100 * cache.oracle_hit_rate).toFixed(1)} %)` : "") : "no decode step yet";
    this.split.update(this.samples, now, link === null ? null : [link, cpu ?? 0, pre ?? 0], `Misses a decode step, by where they were served; ${overall}.`);
  }

  showMemory(stats) {
    const engine = stats.engine ?? {};
    const off = offload(stats);
    // the share of the GPU the engine may use (GLM53_VRAM_LIMIT_GB emulates a smaller card), else the whole GPU
    const limitGB = this.info?.settings?.vram_limit_gb ?? this.info?.gpu?.total_memory_gb;
    const vram = off.vram_budget?.limit_bytes ?? (num(limitGB) ? limitGB * 1e9 : null);
    const store = off.host_store;
    const rows = [
      ["VRAM allocated", num(engine.vram_allocated_gb) ? engine.vram_allocated_gb * 1e9 : null, vram],
      ["VRAM reserved", num(engine.vram_reserved_gb) ? engine.vram_reserved_gb * 1e9 : null, vram],
      ["expert cache (VRAM)", off.cache?.cache_bytes, vram],
      ["experts in pinned RAM", store?.pinned ? store.arena_bytes : null, null],
      ["process RSS", stats.process?.rss_bytes, null],
    ];
    $("memory").replaceChildren(...rows.map(([label, v, total]) => meter(label, bytes(v), num(v) && num(total) ? v / total : null, total ? `of ${bytes(total)}` : "")));
  }

  showLink(link) {
    const box = $("link");
    if (!link) {
      box.replaceChildren(el("p", { className: "muted" }, "— no host link in use (the CPU demo model runs in RAM)."));
      return;
    }
    const measured = link.measured ?? {};
    const top = Math.max(...[measured.zero_copy_gbs, measured.copy_gbs, link.emulated_gbs].filter(num), 1) * 1.1;
    const gbs = (v) => (num(v) ? `${v.toFixed(1)} GB/s` : "—");
    const rows = [
      ["zero-copy reads (misses)", measured.zero_copy_gbs],
      ["copies (prefill staging)", measured.copy_gbs],
    ];
    if (num(link.emulated_gbs)) rows.push(["emulated link (GLM53_LINK_EMULATE_GBS)", link.emulated_gbs]);
    box.replaceChildren(...rows.map(([label, v]) => meter(label, gbs(v), num(v) ? v / top : null, "")), el("p", { className: "muted note" }, "measured on this machine at start"));
  }

  showSettings() {
    const info = this.info;
    const facts = [
      ["model", info.loaded_model?.name ?? info.served_name],
      ["architecture", info.loaded_model?.architecture],
      ["served as", info.served_name],
      ["context", info.context_length],
      ["GPU", info.gpu ? `${info.gpu.name} (${info.gpu.total_memory_gb} GB)` : info.state === "ready" ? "none (CPU)" : null],
      ["version", info.version],
      ["load time", num(info.load_seconds) ? `${info.load_seconds.toFixed(1)} s` : null],
    ];
    const rows = [
      ...facts.map(([k, v]) => [k, v, "fact"]),
      ...Object.entries(info.settings ?? {}).map(([k, v]) => [k, v, info.setting_sources?.[k] ?? ""]),
    ];
    const table = el(
      "table",
      {},
      el("tbody", {}, ...rows.map(([k, v, source]) => el("tr", { className: source === "default" || source === "fact" ? "" : "set" }, el("th", { textContent: k }), el("td", { textContent: show(v) }), el("td", { className: "muted", textContent: source === "fact" ? "" : source })))),
    );
    $("settings-table").replaceChildren(table);
  }
}

function show(v) {
  if (v === null || v === undefined) return "—";
  return typeof v === "object" ? JSON.stringify(v) : String(v);
}

function offload(stats) {
  return stats?.engine?.offload ?? {};
}

// The cache's misses since start, by where they were served: [over the link, by the CPU tier, from prefetched
// copies]; the link's share is what neither of the others took. [null, null, null] without a cache.
function missParts(stats) {
  const off = offload(stats);
  const misses = off.cache?.misses;
  if (!num(misses)) return [null, null, null];
  const cpu = off.cpu_tier?.split?.cpu_picks ?? 0;
  const pre = off.prefetch?.used ?? 0;
  return [Math.max(0, misses - cpu - pre), cpu, pre];
}

function layerNumber(key) {
  return /layers\.(\d+)/.exec(key)?.[1] ?? key;
}

function meter(label, value, fraction, note) {
  const fill = el("div", { className: "bar-fill" });
  fill.style.width = `${num(fraction) ? Math.min(100, 100 * fraction) : 0}%`;
  return el("div", { className: "meter" }, el("div", { className: "meter-head" }, el("span", {}, label), el("b", {}, value), el("span", { className: "muted" }, note)), el("div", { className: num(fraction) ? "bar" : "bar empty" }, fill));
}
