"""The drawings of the live page, in plain SVG from inline JS (nothing loaded from another host): a program's
timeline (`TIMELINE_JS`: `drawTimeline`, `drawTotals`), the live charts (`CHARTS_JS`: `drawChart`), and the
page of one program's timeline at `/ui/programs/{id}` (`PROGRAM_PAGE`).

A timeline has a row per thread; each call is a bar: queued (grey), prefill (amber), decode (blue), with a
green stripe under it for its prompt's cached share (violet: the part loaded from a KV tier), red hatching
from a preemption to its rescheduling, a teal line for its program's KV pin after it (to the TTL or the
thread's next call), and dashed tool gaps between calls, named by the tool when the runtime was told.
"""

from __future__ import annotations

STYLE = """
  .tl svg { background: white; border: 1px solid #e5e5e5; display: block; }
  .tl text { font: 11px system-ui, sans-serif; fill: #444; }
  .tl .axis { stroke: #ddd; }
  .legend span { display: inline-block; margin-right: 1em; font-size: 12px; }
  .legend i { display: inline-block; width: 12px; height: 10px; margin-right: 4px; vertical-align: middle; }
  .totals td, .totals th { padding: 2px 8px; text-align: right; border-bottom: 1px solid #eee; }
  #totals { flex: 0 0 230px; }
  .charts { display: flex; gap: 12px; flex-wrap: wrap; margin: .5em 0 1em; }
  .chart { background: white; border: 1px solid #e5e5e5; padding: 4px 6px; }
  .chart h3 { font-size: 12px; margin: 0; font-weight: 600; color: #444; }
  .chart h3 b { font-weight: 400; color: #666; }
"""

LEGEND = """<div class="legend">
  <span><i style="background:#cbd5e1"></i>queued</span><span><i style="background:#f59e0b"></i>prefill</span>
  <span><i style="background:#3b82f6"></i>decode</span><span><i style="background:#16a34a"></i>cached prompt</span>
  <span><i style="background:#8b5cf6"></i>from a KV tier</span>
  <span><i style="background:repeating-linear-gradient(45deg,#dc2626 0 2px,transparent 2px 4px)"></i>preempted</span>
  <span><i style="background:#0d9488;height:3px"></i>KV pinned (TTL)</span>
  <span><i style="border-top:1px dashed #888;height:0"></i>tool gap</span>
</div>"""

TIMELINE_JS = r"""
function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
function fmtS(s) { return s < 10 ? s.toFixed(2) : s.toFixed(1); }
function drawTimeline(el, tl) {  // el: a container; tl: GET /v1/programs/{id}/timeline
  const W = Math.max(500, el.clientWidth || 1000), labelW = 170, rowH = 24, top = 22;
  const t0 = tl.started_at, t1 = Math.max(tl.ended_at ?? tl.now, t0 + 0.001);
  const x = (t) => labelW + (W - labelW - 12) * (Math.min(Math.max(t, t0), t1) - t0) / (t1 - t0);
  const several = tl.totals.replicas.length > 1;
  const H = top + rowH * Math.max(1, tl.threads.length) + 6;
  const out = [`<svg width="${W}" height="${H}">`,
    `<defs><pattern id="hatch" width="4" height="4" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">` +
    `<rect width="2" height="4" fill="#dc2626"/></pattern></defs>`];
  for (let i = 0; i <= 5; i++) {
    const t = t0 + (t1 - t0) * i / 5, xi = x(t);
    out.push(`<line class="axis" x1="${xi}" y1="14" x2="${xi}" y2="${H}"/>`,
             `<text x="${xi}" y="11" text-anchor="middle">${fmtS(t - t0)} s</text>`);
  }
  const arrivals = tl.threads.flatMap((r) => r.calls.map((c) => c.arrival_at)).sort((a, b) => a - b);
  tl.threads.forEach((row, i) => {
    const y = top + i * rowH, mid = y + rowH / 2;
    const label = row.thread_id.startsWith(tl.program_id) ? row.thread_id.slice(tl.program_id.length) : row.thread_id;
    out.push(`<g class="thread" data-thread-id="${esc(row.thread_id)}">`,
             `<text x="4" y="${mid + 4}">${esc(label || row.thread_id)} · ${row.calls.length} call${row.calls.length === 1 ? "" : "s"}</text>`);
    for (const g of row.gaps) {
      out.push(`<g class="gap"><title>${esc(g.tool ? "tool " + g.tool : "between calls")}: ${fmtS(g.end_at - g.start_at)} s</title>` +
               `<line x1="${x(g.start_at)}" y1="${mid}" x2="${x(g.end_at)}" y2="${mid}" stroke="#888" stroke-dasharray="3,3"/>` +
               (g.tool && x(g.end_at) - x(g.start_at) > 40 ? `<text x="${(x(g.start_at) + x(g.end_at)) / 2}" y="${mid - 3}" text-anchor="middle">${esc(g.tool)}</text>` : "") +
               `</g>`);
    }
    row.calls.forEach((c, j) => {
      const sched = c.scheduled_at ?? c.end_at, first = c.first_token_at ?? c.end_at;
      const h = rowH - 8, yb = y + 3;
      const seg = (a, b, color, cls) => b > a ? `<rect class="${cls}" x="${x(a)}" y="${yb}" width="${Math.max(1, x(b) - x(a))}" height="${h}" fill="${color}"/>` : "";
      const info = [`${c.request_id} (${c.state})`, `queued ${fmtS(sched - c.arrival_at)} s`,
        c.scheduled_at != null ? `prefill ${fmtS(first - c.scheduled_at)} s` : null,
        c.first_token_at != null ? `decode ${fmtS(c.end_at - c.first_token_at)} s` : null,
        `prompt ${c.num_prompt_tokens} tokens, ${c.num_cached_tokens} cached` + (c.num_tier_loaded_tokens ? ` (${c.num_tier_loaded_tokens} from tiers)` : ""),
        `output ${c.num_output_tokens} tokens`, c.preemptions.length ? `preempted ${c.preemptions.length}x` : null,
        c.tool ? `after tool ${c.tool}` : null, c.replica ? `replica ${c.replica}` : null,
        c.priority ? `priority ${c.priority}` : null].filter((v) => v != null).join("\n");
      out.push(`<g class="call" data-request-id="${esc(c.request_id)}" data-state="${esc(c.state)}"><title>${esc(info)}</title>`,
               seg(c.arrival_at, sched, "#cbd5e1", "queued"), seg(sched, first, "#f59e0b", "prefill"),
               seg(first, c.end_at, "#3b82f6", "decode"));
      if (c.num_prompt_tokens && c.num_cached_tokens) {  // the prompt's cached share, under the bar
        const w = Math.max(2, (x(c.end_at) - x(c.arrival_at)) * c.num_cached_tokens / c.num_prompt_tokens);
        const wt = w * c.num_tier_loaded_tokens / c.num_cached_tokens;
        out.push(`<rect class="cached" x="${x(c.arrival_at)}" y="${yb + h}" width="${w}" height="3" fill="#16a34a"/>`);
        if (wt) out.push(`<rect class="tier" x="${x(c.arrival_at)}" y="${yb + h}" width="${wt}" height="3" fill="#8b5cf6"/>`);
      }
      for (const p of c.preemptions) {
        const b = p.resumed_at ?? c.end_at;
        out.push(`<rect class="preempted" x="${x(p.at)}" y="${yb}" width="${Math.max(2, x(b) - x(p.at))}" height="${h}" fill="url(#hatch)"/>`,
                 `<line x1="${x(p.at)}" y1="${y}" x2="${x(p.at)}" y2="${y + rowH - 2}" stroke="#dc2626" stroke-width="2"/>`);
      }
      if (c.pin_until != null) {
        // the program's pin lasts until its TTL or the program's next call, whichever is first
        const next = arrivals.find((a) => a >= c.end_at), end = Math.min(c.pin_until, next ?? c.pin_until);
        if (end > c.end_at) out.push(`<line class="pin" x1="${x(c.end_at)}" y1="${yb + h - 1}" x2="${x(end)}" y2="${yb + h - 1}" stroke="#0d9488" stroke-width="3"/>`);
      }
      if (several && c.replica) out.push(`<text x="${x(c.arrival_at) + 2}" y="${yb + h - 3}" fill="white">${esc(c.replica.slice(0, 6))}</text>`);
      out.push(`</g>`);
    });
    out.push(`</g>`);
  });
  out.push(`</svg>`);
  el.innerHTML = out.join("");
}
function drawTotals(el, tl) {
  const t = tl.totals;
  const rows = [["calls", t.calls + (t.calls_in_flight ? ` (${t.calls_in_flight} in flight)` : "")],
    ["threads", tl.threads.length], ["wall", fmtS(t.wall_s) + " s"], ["queued", fmtS(t.queued_s) + " s"],
    ["prefill", fmtS(t.prefill_s) + " s"], ["decode", fmtS(t.decode_s) + " s"], ["tool gaps", fmtS(t.tool_s) + " s"],
    ["service", fmtS(t.service_s) + " s"], ["preemptions", t.num_preemptions + (t.num_preemptions ? ` (${fmtS(t.preempted_s)} s)` : "")],
    ["prompt tokens", t.num_prompt_tokens], ["cached", t.num_cached_tokens + (t.num_tier_loaded_tokens ? ` (${t.num_tier_loaded_tokens} from tiers)` : "")],
    ["output tokens", t.num_output_tokens]];
  if (t.replicas.length) rows.push(["replicas", t.replicas.join(", ")]);
  el.innerHTML = `<table class="totals">` + rows.map(([k, v]) => `<tr><th class="l">${k}</th><td data-total="${k}">${esc(v)}</td></tr>`).join("") + `</table>`;
}
"""

CHARTS_JS = r"""
function drawChart(el, title, series, fmt) {  // series: [{name, color, points: [[t, v], ...]}]
  const W = 260, H = 90, pad = 4;
  const all = series.flatMap((s) => s.points);
  const tmin = all.length ? Math.min(...all.map((p) => p[0])) : 0, tmax = all.length ? Math.max(...all.map((p) => p[0])) : 1;
  const vmax = Math.max(1e-9, ...all.map((p) => p[1] ?? 0));
  const x = (t) => pad + (W - 2 * pad) * (tmax > tmin ? (t - tmin) / (tmax - tmin) : 1);
  const y = (v) => H - pad - (H - 2 * pad) * (v ?? 0) / vmax;
  const lines = series.map((s) => `<polyline class="series" data-series="${s.name}" fill="none" stroke="${s.color}" stroke-width="1.5" points="${s.points.map((p) => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" ")}"/>`);
  const last = series.map((s) => { const p = s.points[s.points.length - 1]; return `<span style="color:${s.color}">${s.name} ${p ? fmt(p[1]) : "-"}</span>`; });
  el.innerHTML = `<h3>${title} <b>max ${fmt(vmax)}</b></h3><svg width="${W}" height="${H}"><line x1="0" y1="${H - pad}" x2="${W}" y2="${H - pad}" stroke="#ddd"/>${lines.join("")}</svg><div style="font-size:11px">${last.join(" · ")}</div>`;
  const lastValue = series.length && series[0].points.length ? series[0].points[series[0].points.length - 1][1] : null;
  el.dataset.last = lastValue ?? "";
  el.dataset.max = all.length ? Math.max(...all.map((p) => p[1] ?? 0)) : "";
}
const COLORS = ["#3b82f6", "#f59e0b", "#16a34a", "#8b5cf6", "#dc2626", "#0d9488", "#6b7280"];
function drawCharts(samples) {  // GET /v1/stats/history's samples, oldest first
  const pts = (f) => samples.map((s) => [s.t, f(s)]);
  const keys = (f) => [...new Set(samples.flatMap((s) => Object.keys(f(s))))].sort();
  const n = (v) => v == null ? "-" : Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(1);
  drawChart(document.getElementById("chart-tokens"), "output tokens/s", [{name: "tokens/s", color: COLORS[0], points: pts((s) => s.tokens_per_s)}], n);
  drawChart(document.getElementById("chart-calls"), "calls", [{name: "running", color: COLORS[0], points: pts((s) => s.running)},
    {name: "waiting", color: COLORS[1], points: pts((s) => s.waiting)}], n);
  drawChart(document.getElementById("chart-kv"), "KV blocks in use", keys((s) => s.kv_blocks).map((k, i) =>
    ({name: k, color: COLORS[i], points: pts((s) => s.kv_blocks[k] ?? 0)})), n);
  drawChart(document.getElementById("chart-hits"), "prefix hit rate %", [{name: "hits", color: COLORS[2],
    points: samples.filter((s) => s.prefix_hit_rate != null).map((s) => [s.t, 100 * s.prefix_hit_rate])}], n);
  drawChart(document.getElementById("chart-programs"), "programs", keys((s) => s.programs).map((k, i) =>
    ({name: k, color: COLORS[i], points: pts((s) => s.programs[k] ?? 0)})), n);
}
"""

CHARTS_HTML = """<div class="charts">
  <div class="chart" id="chart-tokens"></div><div class="chart" id="chart-calls"></div>
  <div class="chart" id="chart-kv"></div><div class="chart" id="chart-hits"></div>
  <div class="chart" id="chart-programs"></div>
</div>"""

PROGRAM_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>agentrt: program</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
  h1 { font-size: 1.3em; margin: 0 0 .6em; }
  .muted { color: #888; } #error { color: #b91c1c; } #keyform { display: none; }
  .cols { display: flex; gap: 1.5em; align-items: flex-start; } .cols > .tl { flex: 1; min-width: 0; }
  th.l { text-align: left; font-weight: 400; color: #555; }
""" + STYLE + """
</style>
</head>
<body>
<h1><a href="../../ui">agentrt</a> · program <span id="pid"></span> <span class="muted" id="meta"></span></h1>
<span id="error"></span>
<form id="keyform">API key <input id="key" type="password" autocomplete="off"> <button>use</button></form>
""" + LEGEND + """
<div class="cols"><div class="tl" id="timeline"></div><div id="totals"></div></div>
<script>
"use strict";
""" + TIMELINE_JS + r"""
const params = new URLSearchParams(location.search);
if (params.get("key")) localStorage.setItem("agentrt-key", params.get("key"));
let key = localStorage.getItem("agentrt-key") || "";
const $ = (id) => document.getElementById(id);
const pid = decodeURIComponent(location.pathname.split("/").pop());
$("pid").textContent = pid;
$("keyform").addEventListener("submit", (e) => {
  e.preventDefault(); key = $("key").value.trim(); localStorage.setItem("agentrt-key", key); poll();
});
let timer = null;
async function poll() {
  try {
    const r = await fetch("../../v1/programs/" + encodeURIComponent(pid) + "/timeline",
                          {headers: key ? {"Authorization": "Bearer " + key} : {}, cache: "no-store"});
    if (r.status === 401) { $("keyform").style.display = "inline"; throw new Error("this server needs an API key"); }
    if (!r.ok) throw new Error("HTTP " + r.status + ": " + ((await r.json()).error || {}).message);
    const tl = await r.json();
    $("meta").textContent = tl.name + " · " + tl.state;
    document.body.dataset.state = tl.state;
    drawTotals($("totals"), tl);
    drawTimeline($("timeline"), tl);
    $("error").textContent = "";
    if (tl.state !== "running" && timer !== null) { clearInterval(timer); timer = null; }
  } catch (e) {
    $("error").textContent = String(e.message || e);
  }
}
poll();
timer = setInterval(poll, 1000);
</script>
</body>
</html>
"""
