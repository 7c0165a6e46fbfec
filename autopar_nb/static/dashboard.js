// Live dashboard of a launched run (autopar_nb/launch/dashboard.py). Renders the model's traits; holds no logic.
// `uPlot` is defined by the vendored build that dashboard.py puts in front of this file (static/vendor/uplot), and
// `bytes`/`secs` by static/units.js and `watchKernel` by static/kernel.js, after it.
/* global uPlot */

const TAB10 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
               "#17becf"];
const TERMINAL = ["finished", "failed", "stopped", "hung"];
const rankColor = (r) => (r < TAB10.length ? TAB10[r] : `hsl(${(r * 137.5) % 360}, 65%, 50%)`);

const fmtNum = (v, d = 3) => (v === null || v === undefined || Number.isNaN(v) ? "–" : Number(v).toPrecision(d));
function fmtRate(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (v >= 1e6) return `${(v / 1e6).toPrecision(3)}M`;
  if (v >= 1e3) return `${(v / 1e3).toPrecision(3)}k`;
  return v.toPrecision(3);
}
function fmtSecs(s) {
  if (s === null || s === undefined || Number.isNaN(s)) return "–";
  if (s < 60) return `${s.toFixed(0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)}:${String(Math.floor(s % 60)).padStart(2, "0")}`;
  return `${Math.floor(s / 3600)}:${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} h`;
}

function h(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) e.append(c);
  return e;
}

// float32 bytes (a DataView from the kernel) -> per-rank arrays for uPlot (NaN -> null: a gap)
function columns(dv, n, ranks) {
  if (!dv || !n) return Array.from({ length: ranks }, () => []);
  const all = new Float32Array(dv.buffer.slice(dv.byteOffset, dv.byteOffset + dv.byteLength));
  const out = [];
  for (let r = 0; r < ranks; r++) {
    const col = new Array(n);
    for (let i = 0; i < n; i++) { const v = all[r * n + i]; col[i] = Number.isNaN(v) ? null : v; }
    out.push(col);
  }
  return out;
}
function xs(dv, n) {
  if (!dv || !n) return [];
  return Array.from(new Float32Array(dv.buffer.slice(dv.byteOffset, dv.byteOffset + dv.byteLength)));
}
const BYTE_INCRS = [];
for (let k = 0; k < 6; k++) for (const m of [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]) BYTE_INCRS.push(m * 1024 ** k);
const maxOf = (arrs) => {
  let m = -Infinity;
  for (const a of arrs) for (const v of a) if (v !== null && v > m) m = v;
  return m;
};

// One uPlot chart: per-rank lines (+ extra series), themed from the page's CSS variables at every redraw.
class Chart {
  constructor(root, card, { key, xLabel, yFmt, axisFmt, ranks, extra = [], yMin = null, syncKey, incrs }) {
    this.root = root;
    this.card = card;
    this.ranks = ranks;
    this.extra = extra;
    const css = (name, fb) => getComputedStyle(root).getPropertyValue(name).trim() || fb;
    const fg = () => css("--apd-fg", "#1f2328");
    const grid = () => css("--apd-border", "#d0d7de");
    const axis = (label, values, more = {}) => ({
      stroke: fg, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 }, label, labelSize: label ? 16 : 0,
      font: "11px sans-serif", labelFont: "11px sans-serif", values, ...more,
    });
    const series = [{ label: xLabel, value: (u, v) => (v === null ? "–" : xLabel === "time" ? fmtSecs(v) : `${v}`) }];
    for (let r = 0; r < ranks; r++) {
      // a dot where a line has one or two points (the first sample, the first step), which draw no line
      series.push({ label: `rank ${r}`, stroke: rankColor(r), width: 1.5, value: (u, v) => yFmt(v), spanGaps: false,
                    points: { show: (u, si, i0, i1) => i1 - i0 < 2, size: 6 } });
    }
    for (const e of extra) series.push({ width: 1.25, value: (u, v) => yFmt(v), points: { show: false }, ...e });
    const width = Math.max(240, card.clientWidth - 12);
    this.u = new uPlot({
      width, height: 170, series, legend: { live: true },
      cursor: { sync: { key: syncKey }, drag: { x: true, y: false } },
      scales: { x: { time: false }, y: { range: (u, lo, hi) => this.range(lo, hi, yMin) } },
      axes: [axis(xLabel === "time" ? null : "step", xLabel === "time" ? (u, splits) => splits.map((v) => fmtSecs(v)) : undefined),
             axis(null, axisFmt === null ? undefined : (u, splits) => splits.map(axisFmt || yFmt), { size: 62, incrs })],
    }, [[], ...series.slice(1).map(() => [])], card.querySelector(".apd-chart"));
    this.u.root.dataset.chart = key;
    this.waitNote = h("div", { class: "apd-chart-wait" });
    card.appendChild(this.waitNote);
  }

  // no rank has a value yet: its empty axes (0 to 1, no unit) would read as a broken chart, so the card says what
  // it waits for instead
  waiting(text) {
    const empty = !this.u.data.slice(1, 1 + this.ranks).some((c) => c.some((v) => v !== null && v !== undefined));
    this.card.classList.toggle("apd-waiting", empty);
    this.waitNote.textContent = empty ? text : "";
  }

  range(lo, hi, yMin) {
    if (lo === null || hi === null || !Number.isFinite(lo) || !Number.isFinite(hi)) return [0, 1];
    const low = yMin === null ? lo : Math.min(yMin, lo);
    const pad = (hi - low) * 0.06 || Math.abs(hi) * 0.1 || 1;
    return [yMin === 0 && low >= 0 ? 0 : low - pad, hi + pad];
  }

  set(x, perRank, extra = []) {
    this.u.batch(() => {
      this.u.setData([x, ...perRank, ...extra]);
      if (this.u.cursor.left < 0 && x.length) {  // not hovering: the latest values every rank has
        let i = x.length - 1;
        while (i > 0 && i > x.length - 4 && perRank.some((c) => c[i] === null)) i--;
        this.u.setLegend({ idx: i });
      }
    });
    this.points = x.length;
  }

  resize() {
    const w = Math.max(240, this.card.clientWidth - 12);
    if (Math.abs(w - this.u.width) > 2) this.u.setSize({ width: w, height: 170 });
  }
}

function render({ model, el }) {
  const root = h("div", { class: "apd autopar-dashboard" });
  el.appendChild(root);
  const timings = [];  // ms per update, read by bench/dashboard.py
  root.__apdTimings = timings;
  const chartTimings = [];  // ms of the updates that redrew the charts
  root.__apdChartTimings = chartTimings;
  root.__apdCounts = {};  // updates per kind (charts, table, ...)

  const pill = h("span", { class: "apd-pill apd-state" });
  const status = h("span", { class: "apd-status" });
  let gone = false;
  const send = (msg) => { if (!gone) model.send(msg); };
  const stop = h("button", { class: "apd-btn apd-stop", title: "run.stop(): end every worker" }, "Stop");
  stop.addEventListener("click", () => { stop.disabled = true; stop.textContent = "Stopping…"; send({ event: "stop" }); });
  const head = h("div", { class: "apd-head" }, h("span", { class: "apd-title" }, "Run"), pill, status, stop);
  const notes = h("div", { class: "apd-notes" });
  const replan = h("div", { class: "apd-replan" });
  const events = h("div", { class: "apd-events" });
  const error = h("div", { class: "apd-error" });
  const tableWrap = h("div", { class: "apd-table-wrap" });
  const charts = h("div", { class: "apd-charts" });
  const summary = h("div", { class: "apd-summary" });
  const logs = h("pre", { class: "apd-pre apd-log-text" });
  const logBox = h("details", { class: "apd-logs" }, h("summary", {}, "last log lines per rank"), logs);
  root.append(head, notes, replan, events, error, tableWrap, charts, summary, logBox);

  let built = null;  // {ranks, mem, util, loss, rate, time}
  const card = (key, title) => {
    const note = h("span", { class: "apd-card-note" });
    const c = h("div", { class: "apd-card", "data-chart": key },
                h("div", { class: "apd-card-title" }, h("span", {}, title), note), h("div", { class: "apd-chart" }));
    c.note = note;
    charts.appendChild(c);
    return c;
  };

  function build(info) {
    const R = info.nproc || 1;
    charts.replaceChildren();
    const id = info.run_id || "run";
    const dashed = (label, color) => ({ label, stroke: color, dash: [6, 4], width: 1.25 });
    // the plan's prediction: one dashed line per distinct figure (a pipeline stage's ranks share theirs)
    const groups = new Map();
    (info.predicted_memory || []).forEach((p, r) => {
      if (p !== null && p !== undefined) groups.set(p, [...(groups.get(p) || []), r]);
    });
    const memExtra = [...groups].map(([value, rs]) => ({
      ...dashed(groups.size === 1 ? (R > 1 ? "predicted (every rank)" : "predicted")
        : rs.length === 1 ? `predicted ${rs[0]}` : `predicted ${rs[0]}–${rs[rs.length - 1]}`,
      groups.size === 1 && R > 1 ? "#888" : rankColor(rs[0])), value }));
    if (info.backend === "nccl") memExtra.push({ ...dashed(info.limit_label || "limit", "#888"), dash: [2, 3], limit: true });
    const unit = info.unit || "samples/s";
    const b = { ranks: R };
    b.mem = new Chart(root, card("memory", "Memory per rank"), { key: "memory", xLabel: "time", yFmt: bytes, ranks: R,
      extra: memExtra.map(({ value, limit, ...e }) => e), yMin: 0, syncKey: `apd-t-${id}`, incrs: BYTE_INCRS });
    b.mem.meta = memExtra;
    b.util = new Chart(root, card("util", info.util_label || "Utilisation"), { key: "util", xLabel: "time",
      yFmt: (v) => (v === null ? "–" : `${v.toFixed(0)} %`), ranks: R, yMin: 0, syncKey: `apd-t-${id}` });
    b.loss = new Chart(root, card("loss", "Loss per rank"), { key: "loss", xLabel: "step", yFmt: (v) => fmtNum(v, 4),
      axisFmt: null, ranks: R, syncKey: `apd-s-${id}` });
    b.rate = new Chart(root, card("throughput", `Throughput per rank (${unit})`), { key: "throughput", xLabel: "step",
      yFmt: fmtRate, ranks: R, yMin: 0, syncKey: `apd-s-${id}` });
    const pt = info.compare_time ? info.predicted_step_time_s : null;
    b.time = new Chart(root, card("step_time", "Step time per rank"), { key: "step_time", xLabel: "step", yFmt: secs,
      ranks: R, extra: pt ? [dashed("predicted", "#888")] : [], yMin: 0, syncKey: `apd-s-${id}` });
    b.wait = new Chart(root, card("data_wait", "Data wait per step"), { key: "data_wait", xLabel: "step", yFmt: secs,
      ranks: R, yMin: 0, syncKey: `apd-s-${id}` });
    b.wait.card.note.textContent = "making and moving each batch";
    b.predictedTime = pt;
    b.mem.card.note.textContent = info.memory_label || "";
    b.time.card.note.textContent = pt ? `predicted ${secs(pt)} dashed` : (info.plan_device && !info.compare_time ? `not compared with ${info.plan_device}` : "");
    b.charts = [b.mem, b.util, b.loss, b.rate, b.time, b.wait];
    root.__apdCharts = Object.fromEntries(b.charts.map((c) => [c.u.root.dataset.chart, c.u]));  // for tests
    built = b;
  }

  function drawCharts() {
    if (!built) return;
    const tl = model.get("timeline") || {};
    const st = model.get("steps") || {};
    const R = built.ranks;
    const info = model.get("info") || {};
    // memory and utilisation over time
    const t = xs(tl.t, tl.n);
    const mem = columns(tl.memory, tl.n, R);
    const top = Math.max(maxOf(mem), ...built.mem.meta.filter((m) => !m.limit).map((m) => m.value));
    const limit = info.limit;
    const limitOn = limit && top > 0 && limit <= 3 * top;  // a limit far above the lines would flatten them
    const memExtra = built.mem.meta.map((m) => t.map(() => (m.limit ? (limitOn ? limit : null) : m.value)));
    built.mem.set(t, mem, memExtra);
    built.mem.card.note.textContent = info.memory_label || "";
    built.util.set(t, columns(tl.util, tl.n, R));
    // per step
    const x = xs(st.x, st.n);
    built.loss.set(x, columns(st.loss, st.n, R));
    built.rate.set(x, columns(st.throughput, st.n, R));
    built.time.set(x, columns(st.step_time_s, st.n, R), built.predictedTime ? [x.map(() => built.predictedTime)] : []);
    built.wait.set(x, columns(st.data_wait_s, st.n, R));
    drawWaiting();
    drawMeasured();
  }

  function drawWaiting() {
    if (!built) return;
    const ended = TERMINAL.includes(model.get("status"));
    for (const c of [built.mem, built.util]) c.waiting(ended ? "no sample was taken" : "waiting for the first sample");
    for (const c of [built.loss, built.rate, built.time, built.wait]) {
      c.waiting(ended ? "no step was reported" : "waiting for the first step");
    }
  }

  // where a chart shows a prediction, what was measured beside it, with the ratio
  function drawMeasured() {
    if (!built) return;
    const info = model.get("info") || {};
    const ranks = model.get("ranks") || [];
    const pt = built.predictedTime;
    const times = ranks.map((r) => r.step_time).filter((v) => v);
    if (pt && times.length) {
      const med = [...times].sort((a, b) => a - b)[Math.floor(times.length / 2)];
      built.time.card.note.textContent = `predicted ${secs(pt)} dashed; measured ${secs(med)} (${(med / pt).toFixed(2)}×)`;
    }
    const peaks = ranks.filter((r) => r.memory_peak && r.memory_pred);
    if (peaks.length) {
      const worst = peaks.reduce((a, b) => (a.memory_peak / a.memory_pred >= b.memory_peak / b.memory_pred ? a : b));
      built.mem.card.note.textContent = `${info.memory_label || ""} · peak ${bytes(worst.memory_peak)} vs predicted ` +
        `${bytes(worst.memory_pred)} (${(worst.memory_peak / worst.memory_pred).toFixed(2)}×, rank ${worst.rank})`;
    }
  }

  function drawNotes(info) {
    const lines = [];
    const plan = info.plan ? `plan ${info.plan}${info.plan_device ? ` for ${info.plan_device}` : ""}` : "no plan given";
    lines.push(h("p", {}, `${plan} · running on ${info.run_device || "?"} · ${info.steps ? `${info.steps} steps` : ""}`));
    for (const n of info.notes || []) lines.push(h("p", { class: "apd-note-warn" }, n));
    notes.replaceChildren(...lines);
  }

  function drawTable() {
    const ranks = model.get("ranks") || [];
    const gpu = (model.get("info") || {}).backend === "nccl";
    const unit = (model.get("info") || {}).unit || "samples/s";
    const cols = ["rank", "state", "step", "memory", "peak", "predicted", gpu ? "GPU %" : "CPU %", unit, "step time",
                  "data wait", ...(gpu ? ["power", "temp"] : [])];
    const rows = ranks.map((r) => {
      const over = r.memory_off;  // the rule of the run's prediction_error events (launch/watch.py)
      const wait = r.data_wait !== null && r.data_wait !== undefined && r.step_time
        ? `${secs(r.data_wait)} (${((100 * r.data_wait) / r.step_time).toFixed(0)} %)` : "–";
      return h("tr", { "data-rank": r.rank, "data-state": r.state },
        h("td", {}, h("span", { class: "apd-swatch", style: `background:${rankColor(r.rank)}` }), `${r.rank}`),
        h("td", { class: "apd-left" }, h("span", { class: "apd-pill", "data-state": r.state }, r.state)),
        h("td", {}, r.step === null || r.step === undefined ? "–" : `${r.step}`),
        h("td", { title: r.memory_source ? `source: ${r.memory_source}` : "" }, bytes(r.memory)),
        h("td", { class: over ? "apd-peak apd-over" : "apd-peak", title: r.memory_peak_kind || "" }, bytes(r.memory_peak)),
        h("td", { class: "apd-pred", title: "the plan's predicted tensors (no margin); measured peak / predicted" },
          bytes(r.memory_pred), r.memory_pred && r.memory_peak ? h("span", { class: over ? "apd-over" : "apd-muted" },
            ` (${(r.memory_peak / r.memory_pred).toFixed(2)}×)`) : null),
        h("td", {}, r.util === null || r.util === undefined ? "–" : `${Number(r.util).toFixed(0)}`),
        h("td", {}, fmtRate(r.throughput)),
        h("td", {}, secs(r.step_time)),
        h("td", {}, wait),
        ...(gpu ? [h("td", {}, r.power_w ? `${r.power_w.toFixed(0)} W` : "–"),
                   h("td", {}, r.temperature_c ? `${r.temperature_c.toFixed(0)} °C` : "–")] : []));
    });
    tableWrap.replaceChildren(h("table", { class: "apd-table" },
      h("thead", {}, h("tr", {}, cols.map((c, i) => h("th", { class: i === 1 ? "apd-left" : "" }, c)))),
      h("tbody", {}, rows)));
    logs.textContent = ranks.map((r) => (r.log || []).join("\n")).filter(Boolean).join("\n") || "(no output yet)";
  }

  function drawError() {
    const e = model.get("error");
    const st = model.get("status");
    const knock = ((e && e.knock_on) || []).map((k) => h("div", {},
      `then rank ${k.rank} (+${secs(k.after_s)}): ${k.error.split("\n")[0].slice(0, 200)} — a consequence`));
    if (e && e.rank !== null && e.rank !== undefined) {
      const when = e.time_s !== undefined ? `, ${secs(e.time_s)} after launch` : "";
      error.replaceChildren(
        h("div", { class: "apd-error-head" }, `Rank ${e.rank} failed first${when}: ${e.error}`),
        e.traceback ? h("pre", { class: "apd-pre apd-traceback" }, e.traceback) : null,
        knock.length ? h("div", { class: "apd-knock" }, knock) : null);
    } else if (e) {
      error.replaceChildren(h("div", { class: "apd-error-head" }, e.error || "the run failed"),
        knock.length ? h("div", { class: "apd-knock" }, knock) : null);
    } else if (st === "hung") {
      const hang = model.get("hang") || {};
      const stacks = Object.entries(hang.stacks || {}).sort(([a], [b]) => (a == hang.rank ? -1 : b == hang.rank ? 1 : a - b));
      error.replaceChildren(h("div", { class: "apd-error-head" }, model.get("message")),
        ...stacks.map(([r, text]) => h("details", { class: "apd-stack", "data-rank": r, open: r == hang.rank },
          h("summary", {}, `rank ${r}: where its threads were`), h("pre", { class: "apd-pre" }, text))),
        stacks.length ? null : h("div", { class: "apd-knock" }, "no stacks: the script does not print them on SIGUSR1 (exported scripts do)"));
    } else {
      error.replaceChildren();
    }
  }

  function drawSummary() {
    const s = model.get("summary") || {};
    if (!Object.keys(s).length) { summary.replaceChildren(); return; }
    const parts = [];
    const t = s.step_time_s;
    if (t) {
      const p = s.compare_time && s.predicted_step_time_s;
      parts.push(h("p", {}, `Step time (median, steady state): ${secs(t)}` +
        (p ? ` vs predicted ${secs(p)} (measured ${(t / p).toFixed(2)}× the prediction)` :
          " (not compared with the plan's prediction: see above)")));
    }
    // the rank table's peak and prediction (report.peak_figures), under the same labels
    const mem = s.memory_by_rank || {};
    const pred = s.predicted_memory_by_rank || {};
    const ranks = Object.keys(mem).sort((a, b) => a - b);
    if (ranks.length) {
      const shown = ranks.length > 8 ? [ranks.reduce((a, b) => (mem[a] >= mem[b] ? a : b))] : ranks;
      const txt = shown.map((r) => `rank ${r} ${bytes(mem[r])}${pred[r] ? ` vs ${bytes(pred[r])} (${(mem[r] / pred[r]).toFixed(2)}×)` : ""}`);
      const vs = Object.keys(pred).length ? ` vs ${s.predicted_label}` : "";
      parts.push(h("p", { class: "apd-summary-memory" }, `${s.memory_label}${vs}: ${txt.join("; ")}` +
        (ranks.length > 8 ? ` (the highest of ${ranks.length} ranks)` : "")));
    }
    if (s.data && s.data.message) {  // the script's data-wait verdict (Run.data)
      parts.push(h("p", { class: s.data.bottleneck ? "apd-data apd-note-warn" : "apd-data" }, s.data.message));
    }
    const c = s.calibration || {};
    const btn = c.can ? h("button", { class: "apd-btn apd-calibrate", title: "run.calibrate()" }, "Calibrate") : null;
    if (btn) btn.addEventListener("click", () => { btn.disabled = true; send({ event: "calibrate" }); });
    parts.push(h("p", { class: "apd-calibration" }, c.text || "", btn ? " " : "", btn));
    summary.replaceChildren(...parts);
  }

  // re-planning: a proposal with its two answers, or the re-plan under way
  function drawReplan() {
    const r = model.get("replan") || {};
    if (!r.text) { replan.replaceChildren(); return; }
    const go = h("button", { class: "apd-btn apd-replan-go", title: "run.replan(): stop, re-plan for less memory, resume from the last checkpoint" }, "Re-plan & resume");
    go.addEventListener("click", () => { go.disabled = true; go.textContent = "Re-planning…"; send({ event: "replan" }); });
    const no = h("button", { class: "apd-btn apd-replan-stop", title: "run.stop()" }, "Stop");
    no.addEventListener("click", () => { no.disabled = true; send({ event: "stop" }); });
    replan.replaceChildren(h("span", {}, r.text), ...(r.pending ? [" ", go, " ", no] : []));
  }

  // the event timeline: launch, restarts, watch events, re-plans with their reason, resume, the end
  const KIND_CLASS = { oom: "bad", memory_high: "warn", straggler: "warn", prediction_error: "warn", replan: "act",
                       resume: "act", restart: "warn", launch: "ok", finish: "ok", fail: "bad", stop: "bad", hang: "bad",
                       numerics: "warn", checkpoint: "bad", node_lost: "bad" };
  function drawEvents() {
    const evs = model.get("events") || [];
    if (!evs.length) { events.replaceChildren(); return; }
    const end = Math.max(1, ...evs.map((e) => e.t));
    const strip = h("div", { class: "apd-ev-strip" }, evs.map((e) => h("span", {
      class: `apd-ev-dot apd-ev-${KIND_CLASS[e.kind] || "warn"}`, "data-kind": e.kind,
      style: `left:${((100 * e.t) / end).toFixed(2)}%`, title: `${secs(e.t)} · ${e.kind}: ${e.reason}` })));
    const list = h("ol", { class: "apd-ev-list" }, evs.map((e) => h("li", { "data-kind": e.kind },
      h("span", { class: "apd-ev-t" }, secs(e.t)), " ",
      h("span", { class: `apd-ev-kind apd-ev-${KIND_CLASS[e.kind] || "warn"}` }, e.kind.replace("_", " ")),
      e.reason ? ` ${e.reason}` : "")));
    events.replaceChildren(h("div", { class: "apd-card-title" }, h("span", {}, "Events")), strip, list);
  }

  function drawStatus() {
    const st = model.get("status");
    const msg = model.get("message") || "";
    pill.textContent = st;
    pill.dataset.state = st;
    status.textContent = msg.startsWith(st) ? msg.slice(st.length).replace(/^[: ]+/, "") : msg;
    if (TERMINAL.includes(st)) { stop.disabled = true; stop.textContent = "Stop"; }
  }

  function update(what) {
    const t0 = performance.now();
    for (const k of Object.keys(what)) root.__apdCounts[k] = (root.__apdCounts[k] || 0) + 1;
    try {
      const info = model.get("info") || {};
      if (what.info || !built || built.ranks !== (info.nproc || 1)) { build(info); drawNotes(info); drawCharts(); }
      else if (what.charts) drawCharts();
      if (what.status) { drawStatus(); drawError(); drawWaiting(); }
      if (what.table) { drawTable(); drawMeasured(); }
      if (what.summary) drawSummary();
      if (what.replan) drawReplan();
      if (what.events) drawEvents();
    } finally {
      if (gone) for (const b of root.querySelectorAll("button")) b.disabled = true;  // one drawn from a late message
      const ms = performance.now() - t0;
      timings.push(ms);
      if (what.charts) chartTimings.push(ms);
      for (const a of [timings, chartTimings]) if (a.length > 2000) a.splice(0, 1000);
    }
  }

  // coalesce the traits of one kernel message into one update
  let pending = null;
  const schedule = (k) => {
    if (!pending) { pending = {}; queueMicrotask(() => { const p = pending; pending = null; update(p); }); }
    pending[k] = true;
  };
  model.on("change:info", () => schedule("info"));
  model.on("change:timeline", () => schedule("charts"));
  model.on("change:steps", () => schedule("charts"));
  model.on("change:ranks", () => schedule("table"));
  for (const k of ["status", "message", "error", "hang"]) model.on(`change:${k}`, () => schedule("status"));
  model.on("change:summary", () => schedule("summary"));
  model.on("change:replan", () => schedule("replan"));
  model.on("change:events", () => schedule("events"));

  const ro = new ResizeObserver(() => { if (built) for (const c of built.charts) c.resize(); });
  ro.observe(charts);
  update({ info: true, status: true, table: true, summary: true, charts: true, replan: true, events: true });
  // the kernel held the run: without it the figures stop and no button reaches the workers
  const stopKernel = watchKernel(model, el, () => {
    gone = true;
    root.classList.add("apd-gone");
    root.prepend(h("div", { class: "apd-kernel-gone", role: "alert" }, h("b", {}, "The kernel stopped"),
      " (it died or was restarted): this dashboard no longer updates and its buttons no longer reach the run; "
      + "its figures are the last the old kernel sent."));
    for (const b of root.querySelectorAll("button")) b.disabled = true;
  });
  return () => { ro.disconnect(); stopKernel(); if (built) for (const c of built.charts) c.u.destroy(); };
}

export default { render };
