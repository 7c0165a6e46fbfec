// Live dashboard of a launched run (autopar_nb/launch/dashboard.py). Renders the model's traits; holds no logic.
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];
const STATUS_COLORS = {starting: "#888", running: "#1f77b4", restarting: "#ff7f0e", finished: "#2ca02c",
                       failed: "#d62728", stopped: "#7f7f7f", hung: "#d62728"};

function fmtBytes(b) {
  if (b === null || b === undefined) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
  return `${b.toFixed(b < 10 ? 2 : 1)} ${u[i]}`;
}
const fmt = (v, d = 3) => (v === null || v === undefined ? "–" : Number(v).toPrecision(d));

function el(tag, attrs = {}, text = "") {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text) e.textContent = text;
  return e;
}

function svgEl(tag, attrs = {}) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

// a line chart of several series {name: [[x, y], ...]}
function lineChart(series, title, w = 330, h = 150) {
  const svg = svgEl("svg", {width: w, height: h, class: "apd-chart"});
  const pad = {l: 48, r: 8, t: 16, b: 18};
  const pts = Object.values(series).flat();
  const t = svgEl("text", {x: pad.l, y: 11, "font-size": 11}); t.textContent = title; svg.appendChild(t);
  if (!pts.length) return svg;
  const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (y1 === y0) { y1 += 1; y0 -= 1; }
  const X = x => pad.l + (x - x0) / (x1 - x0) * (w - pad.l - pad.r);
  const Y = y => h - pad.b - (y - y0) / (y1 - y0) * (h - pad.t - pad.b);
  svg.appendChild(svgEl("rect", {x: pad.l, y: pad.t, width: w - pad.l - pad.r, height: h - pad.t - pad.b,
                                 fill: "none", stroke: "#ccc"}));
  for (const [v, y] of [[y1, pad.t + 8], [y0, h - pad.b]]) {
    const lab = svgEl("text", {x: 2, y, "font-size": 10}); lab.textContent = fmt(v); svg.appendChild(lab);
  }
  const lx = svgEl("text", {x: w - pad.r - 40, y: h - 4, "font-size": 10}); lx.textContent = `step ${x1}`;
  svg.appendChild(lx);
  Object.entries(series).forEach(([name, p], i) => {
    if (!p.length) return;
    svg.appendChild(svgEl("polyline", {points: p.map(q => `${X(q[0])},${Y(q[1])}`).join(" "), fill: "none",
                                       stroke: COLORS[i % COLORS.length], "stroke-width": 1.5,
                                       "data-series": name}));
  });
  return svg;
}

// per-rank bar: measured memory, predicted tick, device limit as the full width
function memBar(r) {
  const w = 220, h = 14;
  const limit = r.mem_limit || Math.max(r.mem || 0, r.mem_pred || 0) * 1.2 || 1;
  const svg = svgEl("svg", {width: w, height: h, class: "apd-mem"});
  svg.appendChild(svgEl("rect", {x: 0, y: 0, width: w, height: h, fill: "#eee"}));
  const m = Math.min(1, (r.mem || 0) / limit);
  const over = r.mem_pred && r.mem > r.mem_pred * 1.1;
  svg.appendChild(svgEl("rect", {x: 0, y: 0, width: m * w, height: h, fill: over ? "#d62728" : "#1f77b4"}));
  if (r.mem_pred) {
    const px = Math.min(1, r.mem_pred / limit) * w;
    svg.appendChild(svgEl("line", {x1: px, x2: px, y1: 0, y2: h, stroke: "#000", "stroke-width": 2,
                                   class: "apd-pred"}));
  }
  return svg;
}

function render({model, el: root}) {
  root.classList.add("autopar-dashboard");
  const style = el("style");
  style.textContent = `.autopar-dashboard{font:12px sans-serif}.apd-status{font-weight:bold;margin:4px 0}
    .apd-row{display:flex;gap:12px;flex-wrap:wrap}.apd-table td,.apd-table th{padding:1px 6px;text-align:right}
    .apd-logs{font:11px monospace;white-space:pre;max-height:160px;overflow:auto;background:#f7f7f7;padding:4px}
    .apd-error{font:11px monospace;white-space:pre-wrap;color:#a00;max-height:200px;overflow:auto}`;
  root.appendChild(style);
  const head = el("div", {class: "apd-row"});
  const status = el("div", {class: "apd-status"});
  const stop = el("button", {class: "apd-stop"}, "Stop");
  stop.onclick = () => model.send({event: "stop"});
  head.append(status, stop);
  const table = el("table", {class: "apd-table"});
  const charts = el("div", {class: "apd-row"});
  const summary = el("div", {class: "apd-summary"});
  const error = el("div", {class: "apd-error"});
  const logs = el("div", {class: "apd-logs"});
  root.append(head, table, charts, summary, error, logs);

  function draw() {
    const st = model.get("status");
    const msg = model.get("message");
    status.textContent = msg.startsWith(st) ? msg : `${st}: ${msg}`;
    status.style.color = STATUS_COLORS[st] || "#000";
    stop.disabled = ["finished", "failed", "stopped", "hung"].includes(st);
    const ranks = model.get("ranks") || [];
    table.replaceChildren();
    const hdr = el("tr");
    for (const h of ["rank", "step", "attempt", "memory (measured | predicted | limit)", "", "util %",
                     model.get("throughput_unit"), "power W", "temp °C"]) hdr.appendChild(el("th", {}, h));
    table.appendChild(hdr);
    for (const r of ranks) {
      const tr = el("tr", {"data-rank": r.rank});
      const barCell = el("td"); barCell.appendChild(memBar(r));
      const memText = `${fmtBytes(r.mem)} ${r.mem_kind} | ${fmtBytes(r.mem_pred)} | ${fmtBytes(r.mem_limit)}`;
      for (const c of [r.rank, r.step ?? "–", r.attempt, memText]) tr.appendChild(el("td", {}, String(c)));
      tr.appendChild(barCell);
      for (const c of [`${fmt(r.util)} ${r.util_kind}`, fmt(r.throughput), fmt(r.power_w), fmt(r.temperature_c)])
        tr.appendChild(el("td", {}, c));
      table.appendChild(tr);
    }
    charts.replaceChildren(
      lineChart(Object.fromEntries(Object.entries(model.get("loss") || {}).map(([k, v]) => [`rank ${k}`, v])),
                "loss per rank"),
      lineChart({rank0: model.get("throughput") || []}, `throughput (${model.get("throughput_unit")}, rank 0)`));
    const s = model.get("summary") || {};
    summary.textContent = Object.keys(s).length
      ? `step time: measured ${fmt((s.step_time_s ?? NaN) * 1e3)} ms vs predicted ` +
        `${s.predicted_step_time_s ? fmt(s.predicted_step_time_s * 1e3) + " ms" : "–"}; peak memory: measured ` +
        `${fmtBytes(s.peak_memory)} (${s.memory_kind}) vs predicted ${fmtBytes(s.predicted_peak_memory)}`
      : "";
    const err = model.get("error");
    error.textContent = err ? `rank ${err.rank}: ${err.error}\n${err.traceback || ""}` : "";
    logs.textContent = ranks.map(r => (r.log || []).join("\n")).filter(Boolean).join("\n");
  }
  for (const t of ["status", "message", "ranks", "loss", "throughput", "summary", "error"])
    model.on(`change:${t}`, draw);
  draw();
}

export default {render};
