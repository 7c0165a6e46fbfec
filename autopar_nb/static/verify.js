// Progress of a background verify (autopar_nb/verify/job.py, VerifyView): a bar, one row per step, each row
// marked pass/fail with the rule it was judged by. Renders the model's traits; holds no logic.

function h(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (v !== undefined && v !== null && v !== false) e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) e.append(c);
  return e;
}
const num = (v, d = 6) => (v === null || v === undefined ? "–" : Number(v).toFixed(d));
const sci = (v) => (v === null || v === undefined ? "–" : Number(v).toExponential(2));
const RUNNING = ["starting", "parallel", "reference"];
// a relative difference and the tolerance its rule allowed (null: not judged at this step)
const rel = (v, tol) => h("td", { class: tol !== null && v > tol ? "apd-fail" : "" }, sci(v),
  h("span", { class: "apd-muted" }, tol === null || tol === undefined ? " (not judged)" : `${v > tol ? " > " : " ≤ "}${sci(tol)}`));

function render({ model, el }) {
  const root = h("div", { class: "apd apd-verify" });
  el.appendChild(root);
  const pill = h("span", { class: "apd-pill apd-state" });
  const status = h("span", { class: "apd-status" });
  const stop = h("button", { class: "apd-btn apd-stop", title: "end the verify processes" }, "Stop");
  stop.addEventListener("click", () => { stop.disabled = true; stop.textContent = "Stopping…"; model.send({ event: "stop" }); });
  const bar = h("div", { class: "apd-progress" }, h("div"));
  const table = h("div", { class: "apd-table-wrap" });
  const notes = h("div", { class: "apd-notes" });
  const error = h("div", { class: "apd-error" });
  root.append(h("div", { class: "apd-head" }, h("span", { class: "apd-title" }, "Verify"), pill, status, stop),
              bar, error, table, notes);

  function draw() {
    const st = model.get("status");
    const p = model.get("progress") || {};
    pill.textContent = st;
    pill.dataset.state = st;
    status.textContent = model.get("message");
    stop.disabled = !RUNNING.includes(st);
    if (!RUNNING.includes(st)) stop.textContent = "Stop";
    // the parallel steps are 60 % of the bar, the reference 30 %, the comparison the rest
    const frac = st === "starting" ? 0.02 : st === "parallel" ? 0.6 * (p.done || 0) / (p.steps || 1)
      : st === "reference" ? 0.75 : 1;
    bar.firstChild.style.width = `${(100 * frac).toFixed(0)}%`;
    bar.classList.toggle("apd-busy", st === "reference" || st === "starting");
    const rows = model.get("rows") || [];
    const judged = rows.some((r) => r.ok !== undefined);
    const head = ["step", "loss (parallel)", ...(judged ? ["reference", "loss rel ≤ tol", "grad rel ≤ tol",
                                                            "param rel ≤ tol", "verdict", "rule"] : [])];
    table.replaceChildren(h("table", { class: "apd-table" },
      h("thead", {}, h("tr", {}, head.map((c) => h("th", { class: c === "rule" ? "apd-left" : "" }, c)))),
      h("tbody", {}, rows.map((r) => h("tr", { "data-step": r.step, "data-ok": judged ? String(r.ok) : "" },
        h("td", {}, `${r.step}`), h("td", {}, num(r.loss)),
        ...(judged ? [h("td", {}, num(r.ref_loss)), rel(r.loss_rel, r.loss_tol), rel(r.grad_rel, r.grad_tol),
                      rel(r.param_rel, r.param_tol),
                      h("td", { class: r.ok ? "apd-pass" : "apd-fail" }, r.ok ? "pass" : "fail"),
                      h("td", { class: "apd-left apd-muted" }, r.rule)] : []))))));
    notes.replaceChildren(...(model.get("notes") || []).map((n) => h("p", {}, n)));
    const err = model.get("error");
    error.replaceChildren(...(err ? [h("div", { class: "apd-error-head" }, model.get("message")),
                                     h("pre", { class: "apd-pre apd-traceback" }, err)] : []));
  }
  for (const k of ["status", "message", "progress", "rows", "notes", "error"]) model.on(`change:${k}`, draw);
  draw();
}

export default { render };
