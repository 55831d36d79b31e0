"""The timeline as one self-contained HTML page: no network, no external scripts — the data
and a small plain-JavaScript SVG renderer are embedded.

What it shows: per rank a band of rows (compute, transfers, waits, other streams) with the
spans as coloured bars labelled like ``F mb3``, a dashed line at every step's start, flow
arrows from each send to its receive, a time axis; a legend; zoom (wheel, or drag on the axis)
and pan (drag), ``reset``; details of a span on hover; and per rank a table of busy %, bubble
%, the schedule's theoretical bubble beside it (on unit jobs, and at the measured mean job
times when the records name the schedule), wait %, and the mean duration of each job kind
(:mod:`.summary`, computed in Python and drawn by the page, so the page and ``flowexec
timeline`` print the same figures).

>>> from .records import Span
>>> html = page_html([Span(0, "h", 1, 0, 0, "F", 0, "compute", 0, 1000, "host")])
>>> html.startswith("<!DOCTYPE html>"), "src=" in html, "<link" in html
(True, False, False)
"""
from __future__ import annotations

import html as _html
import json
from typing import Any, Iterable, Mapping

from .records import JOB_KINDS, Span
from .summary import step_windows, summarize
from .trace import LEGAL_COLOURS, ROWS, colour, pair_flows, row_name, row_of, span_name


def page_data(spans: Iterable[Span], meta: Mapping[str, Any] | None = None,
              offsets: Mapping[int, tuple[int, int]] | None = None) -> dict[str, Any]:
    """What the page draws, as JSON-able data (times in µs from the earliest span).
    ``offsets``: per rank its clock offset and round trip in ns, shown in the header."""
    spans = sorted(spans, key=lambda s: (s.rank, s.start_ns, s.end_ns))
    meta = dict(meta or {})
    t0 = min((s.start_ns for s in spans), default=0)
    us = lambda ns: round((ns - t0) / 1e3, 3)  # noqa: E731
    ranks = []
    # One row per kind of row: receives posted up front overlap, drawn translucent under the
    # sends (the trace spreads them over lanes instead: a trace viewer's slices must nest).
    placed = {s: row_of(s) for s in spans}
    for rank in sorted({s.rank for s in spans}):
        mine = [s for s in spans if s.rank == rank]
        keys = {placed[s] for s in mine}
        base = [r for r in ROWS if any(k.partition("#")[0] == r for k in keys)]
        base += sorted({k.partition("#")[0] for k in keys} - set(ROWS))
        rows = sorted(keys, key=lambda k: (base.index(k.partition("#")[0]), int(k.partition("#")[2] or 0)))
        off = (offsets or {}).get(rank)
        ranks.append({"rank": rank, "host": mine[0].host, "pid": mine[0].pid,
                      "rows": [row_name(r) for r in rows], "row_keys": rows,
                      "clocks": sorted({s.clock for s in mine}),
                      "offset_ns": off[0] if off else None, "rtt_ns": off[1] if off else None})
    row_index = {(r["rank"], k): i for r in ranks for i, k in enumerate(r["row_keys"])}
    theory = meta.get("theory_bubble_per_rank") or meta.get("theory_bubble")
    if isinstance(theory, Mapping):
        theory = {int(k): v for k, v in theory.items()}
    kinds = sorted({s.kind for s in spans}, key=lambda k: (k not in JOB_KINDS, JOB_KINDS.index(k) if k in JOB_KINDS else 0, k))
    return {
        "meta": meta,
        "ranks": ranks,
        "spans": [{"rank": s.rank, "row": row_index[(s.rank, placed[s])], "ts": us(s.start_ns),
                   "dur": round(s.duration_ns / 1e3, 3), "kind": s.kind, "label": span_name(s), "step": s.step,
                   "stage": s.stage, "micro": s.micro, "clock": s.clock, "stream": s.stream,
                   "issued": None if s.issue_ns is None else us(s.issue_ns), "peer": s.peer, "name": s.name}
                  for s in spans],
        "steps": [{"step": k, "ts": us(lo), "dur": round((hi - lo) / 1e3, 3)}
                  for k, (lo, hi) in sorted(step_windows(spans).items())],
        "flows": [{"from_rank": a.rank, "from_row": row_index[(a.rank, placed[a])], "from_ts": us(a.start_ns),
                   "to_rank": b.rank, "to_row": row_index[(b.rank, placed[b])], "to_ts": us(b.end_ns),
                   "label": f"{span_name(a)} r{a.rank}→r{b.rank}"} for a, b in pair_flows(spans)],
        "summary": [r.to_dict() for r in summarize(spans, theory)],
        "kinds": kinds,
        "colours": {k: "rgb(%d,%d,%d)" % LEGAL_COLOURS[colour(k)] for k in kinds + ["step"]},
    }


def page_html(spans: Iterable[Span], meta: Mapping[str, Any] | None = None,
              offsets: Mapping[int, tuple[int, int]] | None = None, title: str = "flowexec timeline") -> str:
    """The page for merged ``spans`` as one HTML string."""
    data = json.dumps(page_data(spans, meta, offsets)).replace("</", "<\\/")
    return _TEMPLATE.replace("@TITLE@", _html.escape(title)).replace("@DATA@", data).replace("@SCRIPT@", _SCRIPT)


def write_page(spans: Iterable[Span], path: str, meta: Mapping[str, Any] | None = None,
               offsets: Mapping[int, tuple[int, int]] | None = None) -> str:
    """Write :func:`page_html` to ``path``; returns ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(page_html(spans, meta, offsets))
    return path


_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>@TITLE@</title>
<style>
body{font:13px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:16px 20px;color:#1d2330;background:#fff}
h1{font-size:18px;margin:0 0 2px} #meta{color:#5b6475;margin-bottom:8px}
#bar{display:flex;gap:14px;align-items:center;flex-wrap:wrap;margin:6px 0}
#legend span.sw{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:-2px;margin:0 4px 0 10px}
button{font:inherit;padding:2px 10px;border:1px solid #c5cbd6;border-radius:4px;background:#f5f7fa;cursor:pointer}
#chartbox{border:1px solid #dde2ea;border-radius:6px;overflow:hidden;user-select:none}
svg text{font-size:11px;fill:#1d2330} svg .lbl{fill:#fff;pointer-events:none} svg .dark{fill:#1d2330}
svg rect.span{stroke:rgba(0,0,0,.25);stroke-width:.5} svg rect.span:hover{stroke:#000;stroke-width:1.5}
#tip{position:fixed;display:none;background:#1d2330;color:#fff;padding:6px 9px;border-radius:4px;font-size:12px;pointer-events:none;white-space:pre;z-index:9}
table{border-collapse:collapse;margin-top:14px} th,td{padding:4px 10px;border-bottom:1px solid #e3e7ee;text-align:right}
td{white-space:nowrap} th{vertical-align:bottom}
th{background:#f5f7fa;font-weight:600} td:first-child,th:first-child{text-align:left}
.hint{color:#8a93a3;font-size:12px}
</style></head><body>
<h1>@TITLE@</h1><div id="meta"></div>
<div id="bar"><div id="legend"></div><label><input type="checkbox" id="flows" checked> flows</label>
<button id="reset">reset zoom</button><span class="hint">wheel: zoom · drag: pan · hover: details</span></div>
<div id="chartbox"><svg id="chart" xmlns="http://www.w3.org/2000/svg"></svg></div>
<table id="summary"></table><div id="tip"></div>
<script id="timeline-data" type="application/json">@DATA@</script>
<script>@SCRIPT@</script></body></html>
"""

_SCRIPT = r"""
(function(){
"use strict";
const D = JSON.parse(document.getElementById("timeline-data").textContent);
const NS = "http://www.w3.org/2000/svg", LW = 150, RH = 20, GAP = 4, HEAD = 18, AX = 26;
const svg = document.getElementById("chart"), tip = document.getElementById("tip");
const pct = x => (x == null ? "–" : (100 * x).toFixed(1) + " %");
const ms = ns => (ns / 1e6).toFixed(3);
const el = (tag, attrs, parent, text) => { const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]); if (text != null) e.textContent = text;
  if (parent) parent.appendChild(e); return e; };
let end = 0; for (const s of D.spans) end = Math.max(end, s.ts + s.dur);
let v0 = 0, v1 = end > 0 ? end * 1.02 : 1;
// rank bands: a header line then one row per kind of row
const bandTop = {}; let y = AX;
for (const r of D.ranks) { bandTop[r.rank] = y; y += HEAD + r.rows.length * (RH + GAP) + 8; }
const H = y + 4;
const rowY = (rank, row) => bandTop[rank] + HEAD + row * (RH + GAP);
const m = D.meta || {};
document.getElementById("meta").textContent = [
  m.schedule ? "schedule " + m.schedule : null, m.n_stages ? m.n_stages + " stages" : null,
  m.n_micro ? m.n_micro + " micro-batches" : null, D.steps.length + " step(s) recorded",
  D.spans.length + " spans", m.device ? "device " + m.device : null,
  "clocks: " + D.ranks.map(r => "rank " + r.rank + " " + r.clocks.join("+") +
    (r.offset_ns != null ? " (offset " + (r.offset_ns / 1e3).toFixed(1) + " µs, rtt " + (r.rtt_ns / 1e3).toFixed(1) + " µs)" : "")).join(", ")
].filter(Boolean).join(" · ");
const legend = document.getElementById("legend");
for (const k of D.kinds) { const sw = document.createElement("span"); sw.className = "sw";
  sw.style.background = D.colours[k]; legend.appendChild(sw); legend.appendChild(document.createTextNode(k)); }
function width() { return Math.max(600, document.getElementById("chartbox").clientWidth || 1200); }
function draw() {
  const W = width(), CW = W - LW - 10, sx = t => LW + (t - v0) / (v1 - v0) * CW;
  svg.setAttribute("width", W); svg.setAttribute("height", H); svg.setAttribute("viewBox", "0 0 " + W + " " + H);
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const clip = el("clipPath", {id: "clip"}, el("defs", {}, svg)); el("rect", {x: LW, y: 0, width: CW, height: H}, clip);
  // axis: about 8 ticks at a round step
  const span = v1 - v0, raw = span / 8, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const tick = [1, 2, 5, 10].map(f => f * mag).find(t => t >= raw) || raw;
  const axis = el("g", {id: "axis"}, svg);
  el("rect", {x: LW, y: 0, width: CW, height: AX - 4, fill: "#f5f7fa"}, axis);
  for (let t = Math.ceil(v0 / tick) * tick; t <= v1; t += tick) {
    const x = sx(t); el("line", {x1: x, x2: x, y1: AX - 8, y2: H, stroke: "#eef1f5"}, axis);
    if (x > W - 50) continue;  // no label cut by the edge
    el("text", {x: x + 2, y: 13}, axis, tick >= 1000 ? (t / 1000).toFixed(tick >= 10000 ? 0 : 1) + " ms" : t.toFixed(0) + " µs");
  }
  for (const r of D.ranks) {
    const g = el("g", {class: "rank", "data-rank": r.rank}, svg);
    el("text", {x: 6, y: bandTop[r.rank] + 13, "font-weight": "600"}, g, "rank " + r.rank + " · " + r.host);
    r.rows.forEach((name, i) => { const yy = rowY(r.rank, i);
      el("rect", {x: LW, y: yy, width: CW, height: RH, fill: i % 2 ? "#fafbfc" : "#f3f5f8"}, g);
      el("text", {x: 16, y: yy + 14, class: "dark"}, g, name); });
  }
  const body = el("g", {"clip-path": "url(#clip)"}, svg);
  const steps = el("g", {id: "steps"}, body);
  for (const s of D.steps) { const x = sx(s.ts);
    el("line", {class: "stepline", "data-step": s.step, x1: x, x2: x, y1: AX - 4, y2: H, stroke: "#6b7280", "stroke-dasharray": "4 3"}, steps);
    el("text", {x: x + 3, y: AX + 8, class: "dark", "font-size": "10"}, steps, "step " + s.step); }
  const bars = el("g", {id: "spans"}, body);
  const order = D.spans.map((s, i) => i).sort((a, b) => (D.spans[b].kind === "recv") - (D.spans[a].kind === "recv"));
  order.forEach(i => { const s = D.spans[i];
    const x = sx(s.ts), w = Math.max(1, s.dur / (v1 - v0) * CW), yy = rowY(s.rank, s.row);
    const rc = el("rect", {class: "span", x: x, y: yy + 1, width: w, height: RH - 2, rx: 2, fill: D.colours[s.kind] || "#888",
      "fill-opacity": s.kind === "recv" ? 0.35 : 1,
      "data-i": i, "data-kind": s.kind, "data-label": s.label, "data-rank": s.rank, "data-ts": s.ts, "data-dur": s.dur}, bars);
    if (s.kind !== "recv" && w > 6 * s.label.length + 6) el("text", {x: x + 4, y: yy + 14, class: ["step", "send", "recv", "wait", "I", "W"].includes(s.kind) ? "dark" : "lbl"}, bars, s.label);
  });
  if (document.getElementById("flows").checked) {
    const fl = el("g", {id: "flowlines"}, body);
    for (const f of D.flows) { const x1 = sx(f.from_ts), y1 = rowY(f.from_rank, f.from_row) + RH / 2;
      const x2 = sx(f.to_ts), y2 = rowY(f.to_rank, f.to_row) + RH / 2;
      const k = Math.min(30, Math.abs(x2 - x1) / 2);
      el("path", {class: "flow", d: "M" + x1 + "," + y1 + " C" + (x1 + k) + "," + y1 + " " + (x2 - k) + "," + y2 + " " + x2 + "," + y2,
        fill: "none", stroke: "#374151", "stroke-opacity": .45, "stroke-width": 1}, fl);
      el("circle", {cx: x2, cy: y2, r: 2, fill: "#374151"}, fl); }
  }
}
// hover details
svg.addEventListener("mousemove", e => {
  const t = e.target; if (!(t.classList && t.classList.contains("span"))) { tip.style.display = "none"; return; }
  const s = D.spans[+t.getAttribute("data-i")];
  tip.textContent = s.label + "  (rank " + s.rank + ", " + s.stream + ")\nstep " + s.step + (s.stage != null ? " · stage " + s.stage : "") +
    (s.micro != null ? " · micro-batch " + s.micro : "") + "\nstart " + (s.ts / 1e3).toFixed(3) + " ms · duration " +
    (s.dur / 1e3).toFixed(3) + " ms" + (s.issued != null ? "\nissued at " + (s.issued / 1e3).toFixed(3) + " ms (host)" : "") +
    (s.peer != null ? "\npeer rank " + s.peer : "") + (s.name ? "\n" + s.name : "") + "\nclock: " + s.clock;
  tip.style.display = "block"; tip.style.left = (e.clientX + 14) + "px"; tip.style.top = (e.clientY + 12) + "px";
});
svg.addEventListener("mouseleave", () => { tip.style.display = "none"; });
// zoom around the cursor, pan by dragging
const tAt = px => v0 + (px - LW) / (width() - LW - 10) * (v1 - v0);
svg.addEventListener("wheel", e => { e.preventDefault(); const r = svg.getBoundingClientRect(), c = tAt(e.clientX - r.left);
  const f = Math.exp(e.deltaY * 0.0015); v0 = c - (c - v0) * f; v1 = c + (v1 - c) * f; draw(); }, {passive: false});
let drag = null;
svg.addEventListener("mousedown", e => { drag = {x: e.clientX, v0: v0, v1: v1}; });
window.addEventListener("mouseup", () => { drag = null; });
window.addEventListener("mousemove", e => { if (!drag) return; const dt = (e.clientX - drag.x) / (width() - LW - 10) * (drag.v1 - drag.v0);
  v0 = drag.v0 - dt; v1 = drag.v1 - dt; draw(); });
document.getElementById("reset").onclick = () => { v0 = 0; v1 = end > 0 ? end * 1.02 : 1; draw(); };
document.getElementById("flows").onchange = draw;
window.addEventListener("resize", draw);
// the summary table, one row per rank
const tab = document.getElementById("summary"), jk = ["F", "B", "I", "W", "OPT"].filter(k => D.summary.some(r => k in r.mean_ns));
const atc = m.theory_bubble_measured_costs || null;
const head = ["rank", "steps", "busy", "bubble (measured)", "bubble (theory)"].concat(atc ? ["theory at measured job times"] : [])
  .concat(["waiting to receive"]).concat(jk.map(k => "mean " + k + " (ms)"));
const hr = tab.insertRow(); for (const h of head) { const th = document.createElement("th"); th.textContent = h; hr.appendChild(th); }
for (const r of D.summary) { const tr = tab.insertRow(); tr.className = "rank-row"; tr.setAttribute("data-rank", r.rank);
  const cells = [String(r.rank), String(r.steps), pct(r.busy), pct(r.bubble), pct(r.theory_bubble)]
    .concat(atc ? [pct(atc[r.rank])] : []).concat([pct(r.window_ns ? r.wait_ns / r.window_ns : 0)])
    .concat(jk.map(k => k in r.mean_ns ? ms(r.mean_ns[k]) + " ×" + r.count[k] : "–"));
  const keys = ["rank", "steps", "busy", "bubble", "theory"].concat(atc ? ["theory-costs"] : [])
    .concat(["wait"]).concat(jk.map(k => "mean-" + k));
  cells.forEach((c, i) => { const td = tr.insertCell(); td.textContent = c; td.setAttribute("data-col", keys[i]); }); }
draw();
document.body.setAttribute("data-rendered", String(D.spans.length));
})();
"""
