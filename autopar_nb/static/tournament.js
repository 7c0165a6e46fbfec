// A tournament's progress and standings (autopar_nb/launch/tournament_job.py, TournamentView): a bar, one row per
// plan, measured against predicted step time per plan as a chart, the verdict, Stop and Adopt. Renders the model's
// traits (static/units.js in front of it writes the units, static/kernel.js watches the kernel); holds no logic.

function h(tag, attrs = {}, ...children) {
  const e = document.createElementNS(attrs.svg ? "http://www.w3.org/2000/svg" : "http://www.w3.org/1999/xhtml", tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "svg") continue;
    if (k === "class") e.setAttribute("class", v);
    else if (v !== undefined && v !== null && v !== false) e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) e.append(c);
  return e;
}
const rank = (r) => ["rank_predicted", "rank_measured", "rank_calibrated"].map((k) => r[k] ?? "–").join("/");
const tau = (v) => (v === null || v === undefined ? "n/a" : `${v >= 0 ? "+" : ""}${v.toFixed(2)}`);

// measured (y) against predicted (x) step time on log axes (a CPU prediction can be off by 10x and more before
// calibration), one point per measured plan labelled with its row number; hollow points are the calibrated
// predictions; on the diagonal a prediction is exact
function chart(rows) {
  const pts = rows.map((r, i) => ({ ...r, i })).filter((r) => r.measured_s !== null && r.measured_s !== undefined);
  if (!pts.length) return h("div", { class: "apt-chart-empty" }, "the chart fills in as plans are measured");
  const W = 320, H = 220, L = 52, B = 34, T = 10, R = 10;
  const xs = pts.flatMap((p) => [p.predicted_s, p.calibrated_s]).filter((v) => v !== null && v !== undefined);
  const all = [...xs, ...pts.map((p) => p.measured_s)];
  const lo = Math.min(...all) / 1.2, hi = Math.max(...all) * 1.2;
  const frac = (v) => Math.log(v / lo) / Math.log(hi / lo);
  const sx = (v) => L + (W - L - R) * frac(v);
  const sy = (v) => H - B - (H - B - T) * frac(v);
  const svg = { svg: true };
  const marks = pts.flatMap((p) => [
    p.calibrated_s !== null && p.calibrated_s !== undefined
      ? h("circle", { ...svg, class: "apt-cal", cx: sx(p.calibrated_s), cy: sy(p.measured_s), r: 4 },
        h("title", svg, `#${p.i} calibrated ${secs(p.calibrated_s)}, measured ${secs(p.measured_s)}`)) : null,
    h("circle", { ...svg, class: "apt-pred", cx: sx(p.predicted_s), cy: sy(p.measured_s), r: 4, "data-row": p.i },
      h("title", svg, `#${p.i} ${p.plan}: predicted ${secs(p.predicted_s)}, measured ${secs(p.measured_s)}`)),
    h("text", { ...svg, class: "apt-label", x: sx(p.predicted_s) + 6, y: sy(p.measured_s) - 5 }, `${p.i}`)]);
  return h("svg", { ...svg, class: "apt-chart", viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img",
    "aria-label": "measured against predicted step time per plan" },
    h("line", { ...svg, class: "apt-axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
    h("line", { ...svg, class: "apt-axis", x1: L, y1: T, x2: L, y2: H - B }),
    h("line", { ...svg, class: "apt-diag", x1: sx(lo), y1: sy(lo), x2: sx(hi), y2: sy(hi) }),
    h("text", { ...svg, class: "apt-tick", x: L, y: H - B + 13, "text-anchor": "start" }, secs(lo)),
    h("text", { ...svg, class: "apt-tick", x: W - R, y: H - B + 13, "text-anchor": "end" }, secs(hi)),
    h("text", { ...svg, class: "apt-tick", x: L - 4, y: H - B, "text-anchor": "end" }, secs(lo)),
    h("text", { ...svg, class: "apt-tick", x: L - 4, y: T + 8, "text-anchor": "end" }, secs(hi)),
    h("text", { ...svg, class: "apt-axis-label", x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" },
      "predicted step time, log (● before, ○ after calibration)"),
    h("text", { ...svg, class: "apt-axis-label", x: 12, y: (T + H - B) / 2, "text-anchor": "middle",
      transform: `rotate(-90 12 ${(T + H - B) / 2})` }, "measured"),
    marks);
}

function render({ model, el }) {
  const root = h("div", { class: "apd apd-tournament" });
  el.appendChild(root);
  const pill = h("span", { class: "apd-pill apd-state" });
  const status = h("span", { class: "apd-status" });
  const adopt = h("button", { class: "apd-btn apt-adopt", title: "make the measured winner the session's plan (t.adopt())" },
    "Adopt the winner");
  adopt.addEventListener("click", () => { adopt.disabled = true; model.send({ event: "adopt" }); });
  const stop = h("button", { class: "apd-btn apd-stop", title: "end the running trial's processes and run no further plan; what was measured is kept" },
    "Stop");
  stop.addEventListener("click", () => { stop.disabled = true; stop.textContent = "Stopping…"; model.send({ event: "stop" }); });
  const bar = h("div", { class: "apd-progress" }, h("div"));
  const error = h("div", { class: "apd-error" });
  const table = h("div", { class: "apd-table-wrap" });
  const plot = h("div", { class: "apt-plot" });
  const notes = h("div", { class: "apd-notes" });
  root.append(h("div", { class: "apd-head" }, h("span", { class: "apd-title" }, "Tournament"), pill, status, stop, adopt),
    bar, error, h("div", { class: "apt-body" }, table, plot), notes);

  function draw() {
    const st = model.get("status"), p = model.get("progress") || {}, sum = model.get("summary") || {};
    const rows = model.get("rows") || [];
    pill.textContent = st;
    pill.dataset.state = st;
    status.textContent = model.get("message");
    adopt.disabled = !["finished", "stopped"].includes(st) || sum.winner === null || sum.winner === undefined;
    if (st !== "running") { stop.disabled = true; stop.textContent = "Stop"; }
    bar.firstChild.style.width = `${(100 * (st === "running" ? (p.done || 0) / (p.total || 1) : 1)).toFixed(0)}%`;
    bar.classList.toggle("apd-busy", st === "running");
    const head = ["#", "plan", "status", "predicted", "measured", "calibrated", "pred. peak", "meas. peak",
      "rank p/m/c", "steps", "note"];
    table.replaceChildren(h("table", { class: "apd-table apt-table" },
      h("thead", {}, h("tr", {}, head.map((c) => h("th", { class: c === "plan" || c === "note" ? "apd-left" : "" }, c)))),
      h("tbody", {}, rows.map((r, i) => h("tr", { "data-row": i, "data-status": r.status,
        "data-winner": sum.winner === i ? "true" : null },
        h("td", {}, `${i}`), h("td", { class: "apd-left apt-plan", title: r.plan }, r.plan),
        h("td", { class: `apt-status apt-${r.status}` }, r.status), h("td", {}, secs(r.predicted_s)),
        h("td", {}, secs(r.measured_s)), h("td", {}, secs(r.calibrated_s)), h("td", {}, bytes(r.predicted_peak)),
        h("td", {}, bytes(r.measured_peak)), h("td", {}, rank(r)), h("td", {}, `${r.steps || 0}`),
        h("td", { class: "apd-left apd-muted" }, r.note || ""))))));
    plot.replaceChildren(chart(rows));
    const lines = [];
    if (sum.verdict) lines.push(h("p", { class: "apt-verdict" }, sum.verdict));
    if (sum.tau_calibrated !== null && sum.tau_calibrated !== undefined) {
      lines.push(h("p", {}, `tau after calibration ${tau(sum.tau_calibrated)} is in-sample: the factors were fitted `
        + "on these runs; the next plans show whether they hold"));
    }
    if (sum.saved) lines.push(h("p", { class: "apt-saved" }, sum.saved));
    if (model.get("adopted")) lines.push(h("p", { class: "apt-adopted" }, model.get("adopted")));
    notes.replaceChildren(...lines);
    const err = model.get("error");
    error.replaceChildren(...(err ? [h("div", { class: "apd-error-head" }, model.get("message")),
      h("pre", { class: "apd-pre apd-traceback" }, err)] : []));
  }
  let gone = false;
  const onChange = () => { draw(); if (gone) { adopt.disabled = true; stop.disabled = true; } };
  const keys = ["status", "message", "progress", "rows", "summary", "adopted", "error"];
  for (const k of keys) model.on(`change:${k}`, onChange);
  draw();
  const stopKernel = watchKernel(model, el, () => {
    gone = true;
    root.prepend(h("div", { class: "apd-kernel-gone", role: "alert" }, h("b", {}, "The kernel stopped"),
      " (it died or was restarted): the tournament ended with it; these standings are the last the old kernel sent."));
    adopt.disabled = true;
    stop.disabled = true;
  });
  return () => { stopKernel(); for (const k of keys) model.off(`change:${k}`, onChange); };
}

export default { render };
