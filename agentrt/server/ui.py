"""The live page: `GET /ui` (and `/`), the process table and KV usage of this server, updating live.

One self-contained HTML file with inline CSS and JS: no build step, nothing from another host.
The page itself holds no data, so it needs no key; its script polls `GET /v1/programs` and
`GET /metrics` every second with the API key (when the server has keys) taken from the page's
`?key=` parameter or typed into the page, and kept in the browser's localStorage.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from agentrt.server.openapi import Operation
from agentrt.server.timeline_page import CHARTS_HTML, CHARTS_JS, LEGEND, STYLE, TIMELINE_JS

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>agentrt: programs</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
  h1 { font-size: 1.3em; margin: 0 0 .6em; }
  .bar { display: flex; gap: 1.5em; flex-wrap: wrap; align-items: center; margin-bottom: 1em; }
  .stat b { font-size: 1.2em; }
  .kv { width: 220px; height: 14px; background: #ddd; border-radius: 3px; overflow: hidden; display: inline-block;
        vertical-align: middle; }
  .kv > div { height: 100%; background: #3b82f6; width: 0; transition: width .3s; }
  table { border-collapse: collapse; width: 100%; background: white; }
  th, td { padding: 4px 8px; border-bottom: 1px solid #e5e5e5; text-align: right; white-space: nowrap; }
  th { background: #f0f0f0; position: sticky; top: 0; }
  td.l, th.l { text-align: left; }
  tr[data-state="running"] td.state { color: #15803d; font-weight: 600; }
  tr[data-state="finished"] { color: #777; }
  tr[data-state="failed"] td.state, tr[data-state="cancelled"] td.state { color: #b91c1c; }
  #error { color: #b91c1c; }
  #keyform { display: none; }
  .muted { color: #888; }
  tr[data-program-id] { cursor: pointer; } tr.selected td { background: #eef4ff; }
  .cols { display: flex; gap: 1.5em; align-items: flex-start; } .cols > .tl { flex: 1; min-width: 0; }
  th.l { text-align: left; } h2 { font-size: 1.05em; margin: 1.2em 0 .4em; }
""" + STYLE + """
</style>
</head>
<body>
<h1>agentrt <span class="muted" id="model"></span></h1>
<div class="bar">
  <span class="stat">programs running <b id="count-running">-</b></span>
  <span class="stat">ended <b id="count-ended">-</b></span>
  <span class="stat">calls running <b id="calls-running">-</b> / waiting <b id="calls-waiting">-</b></span>
  <span class="stat">KV <span class="kv"><div id="kv-fill"></div></span> <b id="kv-usage">-</b></span>
  <span class="stat">prefix hits <b id="prefix-hits">-</b></span>
  <span class="stat">preemptions <b id="preemptions">-</b></span>
  <span class="stat" id="tiers-stat" hidden>KV tiers <b id="tiers">-</b></span>
  <span class="muted" id="updated"></span>
  <span id="error"></span>
  <form id="keyform">API key <input id="key" type="password" autocomplete="off"> <button>use</button></form>
</div>
""" + CHARTS_HTML + """
<table>
  <thead><tr>
    <th class="l">program</th><th class="l">name</th><th class="l">state</th><th>calls w/r/done</th>
    <th>threads</th><th>service s</th><th>wait s</th><th>queue level</th><th>KV blocks</th>
    <th>prefix hit tokens</th><th>tokens in/out</th><th>age s</th>
  </tr></thead>
  <tbody id="programs"></tbody>
</table>
<h2>timeline <span id="tl-title" class="muted">(click a program)</span></h2>
""" + LEGEND + """
<div class="cols"><div class="tl" id="timeline"></div><div id="totals"></div></div>
<script>
"use strict";
""" + TIMELINE_JS + CHARTS_JS + """
const params = new URLSearchParams(location.search);
if (params.get("key")) localStorage.setItem("agentrt-key", params.get("key"));
let key = localStorage.getItem("agentrt-key") || "";
const $ = (id) => document.getElementById(id);
$("keyform").addEventListener("submit", (e) => {
  e.preventDefault(); key = $("key").value.trim(); localStorage.setItem("agentrt-key", key); poll();
});
async function get(path) {
  const r = await fetch(path, {headers: key ? {"Authorization": "Bearer " + key} : {}, cache: "no-store"});
  if (r.status === 401) { $("keyform").style.display = "inline"; throw new Error("this server needs an API key"); }
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r;
}
function metrics(text) {  // each name summed over its series (replicas: one per replica); a fraction averaged
  const m = {}, n = {};
  for (const line of text.split("\\n")) {
    if (!line || line[0] === "#") continue;
    const i = line.lastIndexOf(" ");
    const name = line.slice(0, i).replace(/\\{.*\\}$/, "");
    m[name] = (m[name] || 0) + Number(line.slice(i + 1));
    n[name] = (n[name] || 0) + 1;
  }
  for (const name in m) if (name.endsWith("_perc")) m[name] /= n[name];
  return m;
}
function tiers(text) {  // the KV tiers' series by tier: {host: {blocks, hits}, disk: {...}}
  const t = {};
  for (const line of text.split("\\n")) {
    const g = /^agentrt:kv_tier_(blocks|hits_total)\\{tier="(\\w+)"[^}]*\\} (\\S+)$/.exec(line);
    if (!g) continue;
    const k = g[1] === "blocks" ? "blocks" : "hits";
    t[g[2]] = t[g[2]] || {blocks: 0, hits: 0};
    t[g[2]][k] += Number(g[3]);
  }
  return t;
}
function cell(text, cls) {
  const td = document.createElement("td"); td.textContent = text; if (cls) td.className = cls; return td;
}
function render(programs) {
  const body = $("programs");
  const rows = [];
  const now = Date.now() / 1000;
  for (const p of programs) {
    const tr = document.createElement("tr");
    tr.dataset.programId = p.id; tr.dataset.state = p.state; tr.dataset.name = p.name;
    if (p.replicas) tr.title = "replicas: " + p.replicas.join(", ");  // agentrt serve --replicas
    if (p.id === selected) tr.className = "selected";
    tr.addEventListener("click", () => { selected = p.id; picked = true; pollTimeline(); });
    tr.append(cell(p.id, "l"), cell(p.name, "l"), cell(p.state, "l state"),
      cell(p.calls_waiting + "/" + p.calls_running + "/" + p.calls_done), cell(p.num_threads),
      cell(p.service_s.toFixed(2)), cell(p.wait_s.toFixed(2)), cell(p.queue_level ?? "-"), cell(p.kv_blocks_pinned == null ? p.kv_blocks : p.kv_blocks + " (" + p.kv_blocks_pinned + " pinned)"),
      cell(p.kv_tier_loaded_tokens ? p.num_prefix_hit_tokens + " (" + p.kv_tier_loaded_tokens + " from tiers)" : p.num_prefix_hit_tokens ?? "-"), cell(p.num_prompt_tokens + "/" + p.num_output_tokens),
      cell(((p.ended_at ?? now) - p.created_at).toFixed(1)));
    rows.push(tr);
  }
  body.replaceChildren(...rows);
  if (!picked) {  // until a row is clicked: the newest program running here, else the newest
    const live = programs.find((p) => p.live && p.state === "running") || programs[0];
    selected = live ? live.id : null;
  }
  const running = programs.filter((p) => p.live && p.state === "running").length;  // only what this server runs
  $("count-running").textContent = running;
  $("count-ended").textContent = programs.length - running;
}
async function poll() {
  try {
    const [progs, met] = await Promise.all([get("v1/programs?limit=200"), get("metrics")]);
    render((await progs.json()).data);
    const text = await met.text();
    const m = metrics(text);
    const usage = m["agentrt:kv_cache_usage_perc"] || 0;
    $("kv-usage").textContent = (100 * usage).toFixed(1) + "%";
    $("kv-fill").style.width = (100 * usage) + "%";
    $("calls-running").textContent = m["agentrt:num_requests_running"] ?? "-";
    $("calls-waiting").textContent = m["agentrt:num_requests_waiting"] ?? "-";
    const q = m["agentrt:prefix_cache_queries_total"] || 0, h = m["agentrt:prefix_cache_hits_total"] || 0;
    $("prefix-hits").textContent = q ? (100 * h / q).toFixed(0) + "% of " + q + " tokens" : "-";
    $("preemptions").textContent = m["agentrt:num_preemptions_total"] ?? "-";
    const t = tiers(text);
    $("tiers-stat").hidden = !Object.keys(t).length;
    $("tiers").textContent = Object.entries(t).map(([name, v]) => name + " " + v.blocks + " blocks, " + v.hits + " hits").join(" · ");
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    $("error").textContent = ""; $("keyform").style.display = key ? "none" : $("keyform").style.display;
  } catch (e) {
    $("error").textContent = String(e.message || e);
  }
}
let selected = null, picked = false, since = null, samples = [];
async function pollTimeline() {
  if (selected === null) return;
  try {
    const tl = await (await get("v1/programs/" + encodeURIComponent(selected) + "/timeline")).json();
    $("tl-title").innerHTML = '<a href="ui/programs/' + encodeURIComponent(selected) + '">' + esc(selected) + "</a> " +
      esc(tl.name) + " · " + esc(tl.state);
    $("timeline").dataset.programId = selected;
    drawTotals($("totals"), tl);
    drawTimeline($("timeline"), tl);
  } catch (e) {
    $("tl-title").textContent = String(e.message || e);
  }
}
async function pollHistory() {
  try {
    const h = await (await get("v1/stats/history" + (since === null ? "" : "?since=" + since))).json();
    if (h.data.length) since = h.data[h.data.length - 1].t;
    samples = samples.concat(h.data).filter((s) => s.t > since - 900);
    drawCharts(samples);
  } catch (e) {}
}
setInterval(() => { pollTimeline(); pollHistory(); }, 1000);
pollHistory();
get("v1/models").then((r) => r.json()).then((d) => { $("model").textContent = d.data[0].id; }).catch(() => {});
poll();
setInterval(poll, 1000);
</script>
</body>
</html>
"""


async def ui(request: Request) -> Response:
    return HTMLResponse(PAGE, headers={"Cache-Control": "no-store"})


async def root(request: Request) -> Response:
    root = request.scope.get("root_path", "")  # behind a proxy under a prefix (--root-path)
    return RedirectResponse(root + "/ui" + (f"?{request.url.query}" if request.url.query else ""))


ROUTES = [
    Route("/ui", ui, methods=["GET"]),
    Route("/", root, methods=["GET"]),
]

OPERATIONS = [
    Operation("get", "/ui", "the live page: process table and KV usage", None, media_type="text/html", errors=(),
              auth=False),
]
