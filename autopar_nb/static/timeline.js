// The memory timeline of one step in the planner widget (the `timeline` trait: autopar_nb/widget/timeline.py), like
// PyTorch's memory_viz active-memory view: a pipeline rank's predicted tensors at each moment of the step, the peak
// marked and its largest terms named; after a launched run, what it measured on the same axes. A run measures one
// peak per rank, not a curve, so that is a horizontal line; a step measured under torch's memory tracker
// (`measured` in the rank's entry: bytes or null per moment) is a second curve over the same moments. Drawn with uPlot, as the run dashboard's charts are
// (the vendored build widget/model.py puts in front of this file); `bytes` comes from units.js, `h` from planner.js.
/* global uPlot */

const TL_HEIGHT = 140;
const TL_COLORS = { predicted: "#4c78a8", peak: "#e45756", measured: "#f58518", curve: "#54a24b" };
const TL_INCRS = [];
for (let k = 0; k < 6; k++) for (const m of [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]) TL_INCRS.push(m * 1024 ** k);
const TL_SHORT = { forward: "fwd", backward: "bwd", recompute: "rec", loss: "loss", "gradient reduction": "reduce",
  "optimizer step": "opt" };

// a moment's label in a few characters for the x axis: "bwd h.3"; on a multi-stage schedule, where a layer runs
// once per micro-batch, "bwd h.3 m2" at micro-batch 2 ("bwdI"/"bwdW": a zero-bubble backward's input and weight
// passes); the full label is in the legend when hovering
function shortMoment(label) {
  const phase = Object.keys(TL_SHORT).find((p) => label.startsWith(p));
  if (!phase) return label;
  const rest = label.slice(phase.length).replace(/ \(.*\)$/, "").trim().split(".").slice(-2).join(".");
  const mb = / \((?:(input|weight) pass, )?micro-batch (\d+) of \d+\)$/.exec(label);
  const pass = mb && mb[1] ? mb[1][0].toUpperCase() : "";
  return `${TL_SHORT[phase]}${pass}${rest ? " " + (rest.length > 10 ? rest.slice(0, 9) + "…" : rest) : ""}`
    + (mb ? ` m${mb[2]}` : "");
}

// the largest measured peak among the ranks of this pipeline rank's stage: {bytes, rank} or null
function measuredPeak(measured, ranks) {
  let best = null;
  for (const [r, b] of measured.peaks || []) {
    if (ranks.includes(r) && (!best || b > best.bytes)) best = { bytes: b, rank: r };
  }
  return best;
}

// the panel (the chart is made once it is in the page: mountTimeline); null without a timeline
function timelinePanel(ui) {
  const tl = ui.model.get("timeline") || {};
  const title = h("div", { class: "ap-panel-title" }, "Memory over one step ");
  if (tl.error) return h("div", { class: "ap-panel ap-timeline" }, title, h("div", { class: "ap-hint" }, tl.error));
  if (!tl.ranks || !tl.ranks.length) return null;
  // the peak rank, until the user picks one (kept across plans while the new plan has it)
  if (!ui.timelinePicked || !(ui.timelineRank >= 0 && ui.timelineRank < tl.ranks.length)) ui.timelineRank = tl.default;
  const d = tl.ranks[ui.timelineRank];
  title.title = `${tl.basis}; the plan adds ${bytes(d.margin)} of allocator margin to the peak`;
  if (tl.ranks.length > 1) {
    title.append(h("select", { class: "ap-tl-rank", title: "the pipeline rank shown (every dp × tp rank of its stage "
      + "holds the same)", onchange: (ev) => {
        ui.timelineRank = Number(ev.target.value); ui.timelinePicked = true; redrawTimeline(ui);
      } },
    tl.ranks.map((r) => h("option", { value: r.rank, selected: r.rank === ui.timelineRank },
      `pp rank ${r.rank}${r.rank === tl.default ? " (peak)" : ""}`))));
  }
  const measured = ui.model.get("measured") || {};
  const seen = measured.run ? measuredPeak(measured, d.global_ranks) : null;
  return h("div", { class: "ap-panel ap-timeline", "data-rank": d.rank },
    title, h("div", { class: "ap-tl-chart" }),
    h("div", { class: "ap-keys" }, legendItem({ color: TL_COLORS.predicted, label: "predicted tensors (no margin)" }),
      legendItem({ color: TL_COLORS.peak, label: "peak" }, "ap-swatch-tl-peak"),
      seen ? legendItem({ label: measured.peak_label }, "ap-swatch-tl-measured") : null,
      d.measured ? legendItem({ label: d.measured_basis }, "ap-swatch-tl-curve") : null),
    momentText(h("div", { class: "ap-tl-moment" }), d, d.peak),
    seen ? h("div", { class: "ap-hint ap-tl-measured-note" }, `${measured.peak_label}: ${bytes(seen.bytes)} on rank `
      + `${seen.rank}, run ${measured.run.id}; a launched run measures one peak per rank, drawn as a line`) : null);
}

// what one moment holds (the peak's until the pointer is over another): "peak 3.1 MiB at backward h.3: saved
// activations 1.2 MiB, ..."
function momentText(el, d, i) {
  el.replaceChildren(i === d.peak ? "peak " : "", h("b", {}, bytes(d.bytes[i])), ` at ${d.labels[i]}: `,
    d.terms[i].map(([k, b]) => `${k} ${bytes(b)}`).join(", "),
    d.measured && d.measured[i] !== null ? `; measured ${bytes(d.measured[i])}` : "");
  return el;
}

function redrawTimeline(ui) {
  const old = ui.side.querySelector(".ap-timeline");
  const panel = timelinePanel(ui);
  if (old && panel) { old.replaceWith(panel); mountTimeline(ui); }
}

// the uPlot chart in the panel, sized to it and re-sized with it; the previous chart, if any, is destroyed
function mountTimeline(ui) {
  if (ui.tl) { ui.tl.ro.disconnect(); ui.tl.u.destroy(); ui.tl = null; }
  const el = ui.side.querySelector(".ap-tl-chart");
  if (!el) return;
  const tl = ui.model.get("timeline");
  const d = tl.ranks[ui.timelineRank];
  const measured = ui.model.get("measured") || {};
  const seen = measured.run ? measuredPeak(measured, d.global_ranks) : null;
  const n = d.bytes.length;
  const readout = el.parentElement.querySelector(".ap-tl-moment");
  const xs = Array.from({ length: n }, (_, i) => i);
  const peakSeries = xs.map((i) => (i === d.peak ? d.bytes[i] : null));
  const css = (name, fb) => getComputedStyle(ui.root).getPropertyValue(name).trim() || fb;
  const fg = () => css("--ap-fg", "#1f2328");
  const grid = () => css("--ap-border", "#d0d7de");
  const axis = (more) => ({ stroke: fg, grid: { stroke: grid, width: 1 }, ticks: { stroke: grid, width: 1 },
    font: "11px sans-serif", labelFont: "11px sans-serif", ...more });
  const series = [{},
    { stroke: TL_COLORS.predicted, fill: "rgba(76, 120, 168, 0.22)", width: 1.5, points: { show: n <= 60, size: 4 } },
    { stroke: TL_COLORS.peak, width: 0, points: { show: true, size: 9, fill: TL_COLORS.peak } },
  ];
  const data = [xs, d.bytes, peakSeries];
  if (seen) {
    series.push({ stroke: TL_COLORS.measured, dash: [6, 4], width: 1.5, points: { show: false } });
    data.push(xs.map(() => seen.bytes));
  }
  if (d.measured) {
    series.push({ stroke: TL_COLORS.curve, width: 1.5, spanGaps: true, points: { show: n <= 60, size: 4 } });
    data.push(d.measured);
  }
  const top = Math.max(d.bytes[d.peak], seen ? seen.bytes : 0, ...(d.measured || []).filter((b) => b !== null));
  const width = () => Math.max(240, el.clientWidth);
  const u = new uPlot({
    width: width(), height: TL_HEIGHT, series, legend: { show: false },
    cursor: { drag: { x: false, y: false } },
    scales: { x: { time: false, range: () => [-0.5, n - 0.5] }, y: { range: () => [0, top * 1.4 || 1] } },
    axes: [axis({ size: 30, space: 84, incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500],
      values: (u, splits) => splits.map((v) => (Number.isInteger(v) && v >= 0 && v < n ? shortMoment(d.labels[v]) : "")) }),
    axis({ size: 62, incrs: TL_INCRS, values: (u, splits) => splits.map((v) => bytes(v)) })],
    hooks: { draw: [(u) => placePeakLabel(u, d)],
      setCursor: [(u) => momentText(readout, d, u.cursor.idx === null || u.cursor.idx === undefined ? d.peak
        : u.cursor.idx)] },
  }, data, el);
  u.root.dataset.chart = "timeline";
  const ro = new ResizeObserver(() => {
    if (Math.abs(width() - u.width) > 2) u.setSize({ width: width(), height: TL_HEIGHT });
  });
  ro.observe(el);
  ui.tl = { u, ro };
}

// "peak 3.1 MiB" above the peak's point, kept inside the plot
function placePeakLabel(u, d) {
  let label = u.over.querySelector(".ap-tl-peak");
  if (!label) {
    label = h("div", { class: "ap-tl-peak" });
    u.over.append(label);
  }
  label.textContent = `peak ${bytes(d.bytes[d.peak])}`;
  label.title = `${d.labels[d.peak]}: ${d.terms[d.peak].map(([k, b]) => `${k} ${bytes(b)}`).join(", ")}`;
  const x = u.valToPos(d.peak, "x"), y = u.valToPos(d.bytes[d.peak], "y");
  const w = label.offsetWidth || 80;
  label.style.left = `${Math.min(Math.max(0, x - w / 2), Math.max(0, u.over.clientWidth - w))}px`;
  label.style.top = `${y > 22 ? y - 22 : y + 8}px`;
}
