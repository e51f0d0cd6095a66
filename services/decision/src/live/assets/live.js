// The live page of br-decision's admin port: polls /live/api/group/NAME?since=SEQ every
// sample interval and draws the history as SVG. No framework, no build step; every string
// that comes from σ (endpoints, ids) is set as text, never parsed as markup.
"use strict";

const COLORS = [
  "#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b", "#9d755d",
  "#ff9da6", "#bab0ac", "#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf",
];
const SVG_NS = "http://www.w3.org/2000/svg";

const state = {
  groups: [],        // names, in --groups order
  group: null,       // the one shown
  samples: [],       // oldest first
  lastSeq: 0,
  now: null,         // the group's state at the last sample
  policy: "",
  intervalMs: 500,
  capacity: 600,
  error: null,
  timer: null,
};

const $ = (id) => document.getElementById(id);

function fmtInt(n) {
  return Math.round(n).toLocaleString("en-US");
}

function fmtShare(x) {
  return (100 * x).toFixed(1) + " %";
}

function fmtMs(v) {
  if (v === null || v === undefined) return "–";
  if (v === "+Inf") return "above the last bucket";
  if (v === 0) return "0"; // an axis' origin, not a measured time
  return v < 1 ? (v * 1000).toFixed(0) + " µs" : v.toFixed(v < 10 ? 2 : 0) + " ms";
}

function fmtRate(v) {
  if (v === null || v === undefined) return "–";
  return v < 10 ? v.toFixed(1) : fmtInt(v);
}

function fmtDuration(ms) {
  return ms >= 1000 ? (ms / 1000) + " s" : ms + " ms";
}

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

// The smallest "nice" number (1, 2, 2.5, 5 × 10^k) at or above v.
function niceCeil(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// series: [{name, color, points: [[unixMs, value or null]]}]; opts: {fmt, yMax}.
function drawChart(svg, series, opts) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = svg.clientWidth || 600;
  const H = svg.clientHeight || 150;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const padL = 64, padR = 12, padT = 8, padB = 20;
  const all = series.flatMap((s) => s.points).filter((p) => p[1] !== null);
  if (all.length === 0) {
    svg.appendChild(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" },
      opts.empty || "no data yet"));
    return;
  }
  const tMax = Math.max(...all.map((p) => p[0]));
  const tMin = tMax - state.capacity * state.intervalMs;
  // a count axis spans at least 0..4, so its five gridlines get five distinct labels
  const yMax = opts.yMax !== undefined
    ? opts.yMax
    : Math.max(niceCeil(Math.max(...all.map((p) => p[1]))), opts.minMax || 0);
  const x = (t) => padL + ((t - tMin) / (tMax - tMin || 1)) * (W - padL - padR);
  const y = (v) => padT + (1 - v / yMax) * (H - padT - padB);
  for (let i = 0; i <= 4; i++) {
    const v = (yMax * i) / 4;
    svg.appendChild(svgEl("line", { x1: padL, x2: W - padR, y1: y(v), y2: y(v), class: "gridline" }));
    svg.appendChild(svgEl("text", { x: padL - 6, y: y(v) + 4, "text-anchor": "end" }, opts.fmt(v)));
  }
  const spanMin = (tMax - tMin) / 60000;
  const stepMin = spanMin > 30 ? 10 : spanMin > 10 ? 5 : 1;
  for (let m = 0; m <= spanMin; m += stepMin) {
    const t = tMax - m * 60000;
    svg.appendChild(svgEl("text", { x: x(t), y: H - 4, "text-anchor": m === 0 ? "end" : "middle" },
      m === 0 ? "now" : `−${m} min`));
  }
  drawMarkers(svg, x, tMin, W, padT, H - padB);
  for (const s of series) {
    let d = "";
    let pen = false;
    for (const [t, v] of s.points) {
      if (v === null || t < tMin) { pen = false; continue; }
      d += `${pen ? "L" : "M"}${x(t).toFixed(1)},${y(v).toFixed(1)}`;
      pen = true;
    }
    if (d) svg.appendChild(svgEl("path", { d, class: "series", stroke: s.color }));
  }
}

// A rank state change as the page says it: "rank 3 cordoned", "rank 3 SUSPECT", "rank 8 joined".
const EVENT_WORDS = {
  live: "LIVE", suspect: "SUSPECT", fenced: "FENCED", cordoned: "cordoned", uncordoned: "uncordoned",
  joined: "joined",
};

function eventText(e) {
  return `rank ${e.worker_id} ${EVENT_WORDS[e.kind] || e.kind}`;
}

// The samples at which a rank's state changed: [{t, kind, label, title}], oldest first. One
// marker per sample; its label names the first change and counts the others (the tooltip
// lists them).
function markers() {
  const out = [];
  for (const s of state.samples) {
    const events = s.events || [];
    const more = events.length - 1 + (s.events_omitted || 0);
    if (events.length === 0) continue;
    const all = events.map(eventText).join(", ");
    out.push({
      t: s.unix_ms,
      kind: events[0].kind,
      label: eventText(events[0]) + (more > 0 ? ` +${more} more` : ""),
      title: all + (s.events_omitted ? `, and ${s.events_omitted} more` : ""),
    });
  }
  return out;
}

// Each marker: a dashed vertical line at its sample and its label at the top, staggered over
// three rows so that changes close in time stay readable.
function drawMarkers(svg, x, tMin, W, top, bottom) {
  markers().filter((m) => m.t >= tMin).forEach((m, i) => {
    const g = svgEl("g", { class: `marker marker-${m.kind}` });
    const at = x(m.t);
    g.appendChild(svgEl("title", {}, m.title));
    g.appendChild(svgEl("line", { x1: at, x2: at, y1: top, y2: bottom }));
    const left = at > W - 140;
    g.appendChild(svgEl("text", {
      x: left ? at - 4 : at + 4, y: top + 10 + (i % 3) * 12,
      "text-anchor": left ? "end" : "start", class: "marker-label",
    }, m.label));
    svg.appendChild(g);
  });
}

function drawLegend(box, series) {
  box.textContent = "";
  for (const s of series) {
    const item = el("span", {});
    const sw = el("span", { class: "swatch" });
    sw.style.background = s.color;
    item.appendChild(sw);
    item.appendChild(document.createTextNode(s.name));
    box.appendChild(item);
  }
}

function setBanner(kind, text) {
  const b = $("banner");
  if (!text) { b.hidden = true; b.textContent = ""; return; }
  b.hidden = false;
  b.className = "banner " + kind;
  b.textContent = text;
}

function renderBanner() {
  const g = state.group;
  const now = state.now;
  if (state.error) return setBanner("bad", `Cannot read the live data of group ${g}: ${state.error}`);
  if (!now) return setBanner("warn", `Waiting for the first sample of group ${g}.`);
  if (now.placing === "no_sigma" || !now.sigma) {
    return setBanner("bad", `No σ yet for group ${g}: this decision service has not received a ` +
      "complete snapshot from the snapshot service (Watch), so it cannot place any request.");
  }
  if (now.sigma.workers.length === 0) {
    return setBanner("bad", `Group ${g} has no workers: no shim has said Hello to ingest for ` +
      "this group yet, so every Assign is UNAVAILABLE.");
  }
  if (now.placing === "no_live_worker") {
    return setBanner("bad", `Group ${g} has no live worker taking new work (every rank is ` +
      "suspect, fenced or cordoned): every Assign is UNAVAILABLE.");
  }
  if (now.stale) {
    return setBanner("warn", "σ is stale: the snapshot service is unreachable; this replica " +
      "answers from its last σ plus its own reservations.");
  }
  setBanner("", "");
}

function renderHeader() {
  $("group-name").textContent = state.group ? `group ${state.group}` : "";
  $("policy").textContent = state.policy ? `policy ${state.policy}` : "";
  const sigma = state.now && state.now.sigma;
  const v = $("sigma-version");
  // 64-bit numbers arrive as decimal strings (a JSON number would lose their low bits) and
  // are shown as they came, the digits brctl prints
  v.textContent = sigma ? `σ epoch ${sigma.epoch} version ${sigma.version}` : "no σ";
  v.dataset.version = sigma ? sigma.version : "";
  const last = state.samples[state.samples.length - 1];
  $("updated").textContent = last ? `sampled ${new Date(last.unix_ms).toLocaleTimeString()}` : "";
  $("interval").textContent = fmtDuration(state.intervalMs);
}

function rankIds() {
  const ids = new Set();
  for (const s of state.samples) for (const l of s.loads) ids.add(l.worker_id);
  if (state.now && state.now.sigma) for (const w of state.now.sigma.workers) ids.add(w.worker_id);
  return [...ids].sort((a, b) => a - b);
}

function renderCharts() {
  const S = state.samples;
  const last = S[S.length - 1];
  const ranks = rankIds();
  const color = (i) => COLORS[i % COLORS.length];
  const loadSeries = ranks.map((id, i) => ({
    name: `rank ${id}`,
    color: color(i),
    points: S.map((s) => {
      const l = s.loads.find((x) => x.worker_id === id);
      return [s.unix_ms, l ? l.load_tokens : null];
    }),
  }));
  const noSigma = "no σ yet";
  const noRanks = state.now && state.now.sigma ? "no ranks in σ" : noSigma;
  drawChart($("chart-load"), loadSeries, { fmt: fmtInt, minMax: 4, empty: noRanks });
  drawLegend($("legend-load"), loadSeries);
  const rankSeries = (f) => ranks.map((id, i) => ({
    name: `rank ${id}`,
    color: color(i),
    points: S.map((s) => {
      const l = s.loads.find((x) => x.worker_id === id);
      const v = l ? f(l) : null;
      return [s.unix_ms, v === undefined ? null : v];
    }),
  }));
  const decode = [{ name: "", color: COLORS[0], points: S.map((s) => [s.unix_ms, s.decode_tokens_per_s === undefined ? null : s.decode_tokens_per_s]) }];
  drawChart($("chart-decode"), decode, { fmt: fmtRate, minMax: 4, empty: "no decode rate yet" });
  const tpot = rankSeries((l) => l.tpot_ms);
  drawChart($("chart-tpot"), tpot, { fmt: fmtMs, empty: "no rank decoding" });
  drawLegend($("legend-tpot"), tpot);
  const one = (f) => [{ name: "", color: COLORS[0], points: S.map((s) => [s.unix_ms, f(s)]) }];
  const withSigma = (f) => (s) => (s.sigma_version === null ? null : f(s));
  // the barrier idle is what the step time pays (br-sim's barrier_idle); the imbalance,
  // max − min, is what the results tables, br-sim and the demo call imbalance
  const barrier = [
    { name: "barrier idle G·M − ΣL", color: COLORS[0], points: S.map((s) => [s.unix_ms, withSigma((x) => x.barrier_idle_tokens)(s)]) },
    { name: "imbalance max − min", color: COLORS[1], points: S.map((s) => [s.unix_ms, withSigma((x) => x.imbalance_tokens)(s)]) },
  ];
  drawChart($("chart-imbalance"), barrier, { fmt: fmtInt, minMax: 4, empty: noSigma });
  drawLegend($("legend-imbalance"), barrier);
  drawChart($("chart-idle"), one(withSigma((s) => s.barrier_idle_share)), { fmt: fmtShare, yMax: 1, empty: noSigma });
  const rate = [
    { name: "answered", color: COLORS[0], points: S.map((s) => [s.unix_ms, s.assign_rate]) },
    { name: "failed", color: COLORS[3], points: S.map((s) => [s.unix_ms, s.assign_failed_rate]) },
  ];
  drawChart($("chart-rate"), rate, { fmt: (v) => v.toFixed(v < 10 ? 1 : 0) });
  drawLegend($("legend-rate"), rate);
  const ms = (v) => (typeof v === "number" ? v : null);
  const latency = [
    { name: "p50", color: COLORS[0], points: S.map((s) => [s.unix_ms, ms(s.latency_p50_ms)]) },
    { name: "p99", color: COLORS[1], points: S.map((s) => [s.unix_ms, ms(s.latency_p99_ms)]) },
  ];
  drawChart($("chart-latency"), latency, { fmt: (v) => fmtMs(v), empty: "no Assign answered yet" });
  drawLegend($("legend-latency"), latency);
  drawChart($("chart-pool"), one((s) => s.pool), { fmt: fmtInt, minMax: 4 });

  const sigma = state.now && state.now.sigma;
  $("load-now").textContent = sigma ? `M = ${fmtInt(sigma.max_load_tokens)}` : "";
  $("imbalance-now").textContent = sigma
    ? `idle ${fmtInt(sigma.barrier_idle_tokens)} · imbalance ${fmtInt(sigma.imbalance_tokens)}`
    : "";
  $("idle-now").textContent = sigma ? fmtShare(sigma.barrier_idle_share) : "";
  const decodeNow = last ? last.decode_tokens_per_s : null;
  const dn = $("decode-now");
  dn.textContent = decodeNow === null || decodeNow === undefined ? "" : `${fmtRate(decodeNow)} tokens/s`;
  dn.dataset.tokensPerS = decodeNow === null || decodeNow === undefined ? "" : String(decodeNow);
  const tpots = last ? last.loads.map((l) => l.tpot_ms).filter((v) => typeof v === "number") : [];
  $("tpot-now").textContent = tpots.length
    ? `${fmtMs(Math.min(...tpots))} – ${fmtMs(Math.max(...tpots))}`
    : "";
  $("rate-now").textContent = last ? `${last.assign_rate.toFixed(1)}/s` : "";
  $("latency-now").textContent = last ? `p50 ${fmtMs(last.latency_p50_ms)} · p99 ${fmtMs(last.latency_p99_ms)}` : "";
  $("pool-now").textContent = state.now ? fmtInt(state.now.pool) : "";
}

function stateCell(w) {
  const td = el("td", { class: "state" });
  td.appendChild(el("span", { class: `state-${w.liveness}` }, w.liveness.toUpperCase()));
  if (w.cordoned) td.appendChild(el("span", { class: "cordoned" }, " · CORDONED"));
  return td;
}

function renderWorkers() {
  const body = $("workers-body");
  body.textContent = "";
  const sigma = state.now && state.now.sigma;
  const workers = sigma ? sigma.workers : [];
  $("workers-now").textContent = sigma
    ? `${workers.length} ranks, ${workers.filter((w) => w.liveness === "live").length} live, ` +
      `${sigma.requests} requests in σ`
    : "";
  if (workers.length === 0) {
    const tr = el("tr", {});
    tr.appendChild(el("td", { colspan: "11", class: "muted" }, sigma ? "no workers in σ" : "no σ yet"));
    body.appendChild(tr);
    return;
  }
  const max = Math.max(1, ...workers.map((w) => w.load_tokens));
  // decode rate and TPOT: the last sample's (the worker table is σ at that sample)
  const last = state.samples[state.samples.length - 1];
  const decode = new Map(last ? last.loads.map((l) => [l.worker_id, l]) : []);
  const known = (v) => (typeof v === "number" ? String(v) : "");
  for (const w of workers) {
    const d = decode.get(w.worker_id) || {};
    const tr = el("tr", { class: "rank", id: `rank-${w.worker_id}`,
      "data-worker": String(w.worker_id), "data-load": String(w.load_tokens),
      "data-liveness": w.liveness, "data-cordoned": String(w.cordoned),
      "data-tokens-per-s": known(d.decode_tokens_per_s), "data-tpot-ms": known(d.tpot_ms) });
    tr.appendChild(el("td", {}, String(w.worker_id)));
    tr.appendChild(stateCell(w));
    tr.appendChild(el("td", { class: "mono" }, w.incarnation));
    tr.appendChild(el("td", { class: "num load" }, fmtInt(w.load_tokens)));
    const barCell = el("td", { class: "barcell" });
    const bar = el("div", { class: "bar" });
    bar.style.width = `${(100 * w.load_tokens) / max}%`;
    barCell.appendChild(bar);
    tr.appendChild(barCell);
    tr.appendChild(el("td", { class: "num running" }, String(w.running)));
    tr.appendChild(el("td", { class: "num" }, String(w.reserved)));
    tr.appendChild(el("td", { class: "num" }, String(w.capacity)));
    tr.appendChild(el("td", { class: "num decode" }, fmtRate(d.decode_tokens_per_s)));
    tr.appendChild(el("td", { class: "num tpot" }, fmtMs(d.tpot_ms)));
    tr.appendChild(el("td", { class: "endpoint", title: w.endpoint }, w.endpoint || "–"));
    body.appendChild(tr);
  }
}

function render() {
  renderHeader();
  renderBanner();
  renderCharts();
  renderWorkers();
}

function schedule(ms) {
  clearTimeout(state.timer);
  state.timer = setTimeout(poll, ms);
}

async function poll() {
  const g = state.group;
  try {
    const since = state.lastSeq ? `?since=${state.lastSeq}` : "";
    const r = await fetch(`/live/api/group/${encodeURIComponent(g)}${since}`, { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}: ${(await r.text()).slice(0, 200)}`);
    const j = await r.json();
    if (g !== state.group) return; // the picker moved on meanwhile
    if (j.last_seq < state.lastSeq) {
      // the service restarted: its seqs start again
      state.samples = [];
      state.lastSeq = 0;
      return schedule(0);
    }
    state.samples.push(...j.samples);
    if (state.samples.length > j.history_samples) {
      state.samples.splice(0, state.samples.length - j.history_samples);
    }
    state.lastSeq = j.last_seq;
    state.now = j.now;
    state.policy = j.policy;
    state.intervalMs = j.sample_interval_ms;
    state.capacity = j.history_samples;
    state.error = null;
  } catch (e) {
    state.error = e.message || String(e);
  }
  render();
  schedule(Math.max(250, state.intervalMs));
}

function selectGroup(name) {
  state.group = name;
  state.samples = [];
  state.lastSeq = 0;
  state.now = null;
  history.replaceState(null, "", `#group=${encodeURIComponent(name)}`);
  schedule(0);
}

async function loadGroups() {
  const r = await fetch("/live/api/groups", { cache: "no-store" });
  if (!r.ok) throw new Error(`HTTP ${r.status}`);
  const j = await r.json();
  state.groups = j.groups.map((g) => g.group);
  state.intervalMs = j.sample_interval_ms;
  state.capacity = j.history_samples;
  const picker = $("group-picker");
  picker.textContent = "";
  for (const g of j.groups) {
    const n = g.now;
    const note = !n ? "" : n.placing === "no_sigma" ? " (no σ)" : ` (${n.live_ranks}/${n.ranks} live)`;
    picker.appendChild(el("option", { value: g.group }, g.group + note));
  }
  $("picker-label").hidden = state.groups.length < 2;
  const wanted = new URLSearchParams(location.hash.slice(1)).get("group");
  const pick = state.groups.includes(wanted) ? wanted : state.groups[0];
  picker.value = pick;
  return pick;
}

async function start() {
  try {
    selectGroup(await loadGroups());
  } catch (e) {
    setBanner("bad", `Cannot list the groups of this decision service: ${e.message || e}`);
    setTimeout(start, 2000);
    return;
  }
  // keep the picker's notes current
  setInterval(() => loadGroups().catch(() => {}), 10000);
}

document.addEventListener("DOMContentLoaded", () => {
  $("group-picker").addEventListener("change", (e) => selectGroup(e.target.value));
  window.addEventListener("resize", render);
  start();
});
