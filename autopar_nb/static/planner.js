// autopar-nb planner widget front end (anywidget ES module; no build step, no network).
// State lives in the Python model's traits; this file renders them and sends edits back as
// {kind: ...} messages (see autopar_nb/widget/model.py, PlannerWidget.handle).

const GiB = 2 ** 30;

function h(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "style") e.setAttribute("style", v);
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(e.dataset, v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function si(x, unit = "") {
  if (x === null || x === undefined) return "–";
  const a = Math.abs(x);
  for (const [p, s] of [["P", 1e15], ["T", 1e12], ["G", 1e9], ["M", 1e6], ["k", 1e3]]) {
    if (a >= s) return `${(x / s).toFixed(2)} ${p}${unit}`;
  }
  return `${x.toFixed(0)} ${unit}`;
}
const gib = (b) => `${(b / GiB).toFixed(2)} GiB`;
const ms = (s) => (s >= 1e-2 ? `${(s * 1e3).toFixed(1)} ms` : s >= 1e-4 ? `${(s * 1e3).toFixed(2)} ms`
  : `${(s * 1e6).toFixed(1)} µs`);
const PIN = "●";

// ---- the widget -------------------------------------------------------------------------------------------------
// `ui` is what every function below shares: the model, the DOM parts, the view state (pan/zoom, search) and send().

function render({ model, el, host }) {
  const ui = skeleton(model, el);
  const stopPanel = runPanel(ui, el, host);
  toolbar(ui);
  const stopPanZoom = panZoom(ui);
  graphEvents(ui);
  const renderAll = () => {
    ui.root.classList.remove("ap-busy");
    renderHeader(ui);
    renderMessages(ui);
    renderGraph(ui);
    renderSide(ui);
    renderControls(ui);
    renderLanes(ui);
    renderTable(ui);
    markSelection(ui, model.get("selection"), false);
  };
  renderAll();
  const onMessages = () => { ui.root.classList.remove("ap-busy"); renderMessages(ui); };
  const onSelection = () => { markSelection(ui, model.get("selection"), false); renderGraph(ui); };
  model.on("change:revision", renderAll);
  model.on("change:messages", onMessages);
  model.on("change:selection", onSelection);
  // the first layout needs the element in the page to know its size
  const ro = new ResizeObserver(() => {
    if (!ui.view.fitted && ui.viewport.clientWidth > 0) { fitView(ui); ui.view.fitted = true; }
  });
  ro.observe(ui.viewport);
  return () => {
    model.off("change:revision", renderAll);
    model.off("change:messages", onMessages);
    model.off("change:selection", onSelection);
    stopPanZoom();
    stopPanel();
    ro.disconnect();
  };
}

// ---- skeleton: the DOM parts, filled by the renderers ------------------------------------------------------------
function skeleton(model, el) {
  // keys typed in the widget (search box, number inputs) are not notebook shortcuts
  const root = h("div", { class: "ap-root", "data-lm-suppress-shortcuts": "true", tabindex: "-1",
    onkeydown: (ev) => { if (ev.target.matches("input, select, textarea")) ev.stopPropagation(); } });
  el.append(root);
  const ui = {
    model, root,
    // view state kept across re-renders
    view: { scale: 1, x: 0, y: 0, fitted: false, search: "", svgText: null },
    drag: null,
    send: (msg) => { root.classList.add("ap-busy"); model.send(msg); },
    header: h("div", { class: "ap-header" }),
    messages: h("div", { class: "ap-messages" }),
    toolbar: h("div", { class: "ap-toolbar" }),
    legend: h("div", { class: "ap-legend" }),
    canvas: h("div", { class: "ap-svg" }),
    tooltip: h("div", { class: "ap-tooltip", style: "display:none" }),
    side: h("div", { class: "ap-side" }),
    controls: h("div", { class: "ap-controls" }),
    lanes: h("div", { class: "ap-lanes" }),
    table: h("div", { class: "ap-table-wrap" }),
  };
  ui.viewport = h("div", { class: "ap-viewport" }, ui.canvas);
  ui.graphPanel = h("div", { class: "ap-graph" }, ui.toolbar, ui.viewport, ui.legend, ui.tooltip);
  root.append(ui.header, ui.messages, h("div", { class: "ap-main" }, ui.graphPanel, ui.side),
    h("div", { class: "ap-section-title" }, "Global choices"), ui.controls,
    h("div", { class: "ap-section-title" }, "Pipeline stages ", h("span", { class: "ap-hint" },
      "drag a layer to another lane, or a lane's ⇤ handle onto a layer to move the boundary")), ui.lanes,
    h("div", { class: "ap-section-title" }, "Layers"), ui.table);
  return ui;
}

// ---- toolbar: search, depth, blocks, fit -------------------------------------------------------------------------
function toolbar(ui) {
  const search = h("input", { class: "ap-search", type: "search", placeholder: "search ops / modules…" });
  search.addEventListener("input", () => { ui.view.search = search.value.trim().toLowerCase(); applySearch(ui, false); });
  search.addEventListener("keydown", (ev) => { if (ev.key === "Enter") applySearch(ui, true); });
  ui.depth = h("input", { class: "ap-depth", type: "range", min: 0, step: 1 });
  ui.depthLabel = h("span", { class: "ap-depth-label" });
  ui.depth.addEventListener("change", () => ui.send({ kind: "depth", value: Number(ui.depth.value) }));
  ui.blocks = h("span", { class: "ap-blocks" });
  const fit = h("button", { class: "ap-btn", title: "fit the graph to the view", onclick: () => fitView(ui) }, "fit");
  const zin = h("button", { class: "ap-btn", title: "zoom in", onclick: () => zoomAt(ui, 1.25) }, "+");
  const zout = h("button", { class: "ap-btn", title: "zoom out", onclick: () => zoomAt(ui, 0.8) }, "−");
  ui.toolbar.append(search, h("label", { class: "ap-depth-wrap" }, "depth ", ui.depth, ui.depthLabel), ui.blocks,
    zout, zin, fit);
}

// ---- pan / zoom --------------------------------------------------------------------------------------------------
function applyTransform(ui) {
  const v = ui.view;
  ui.canvas.style.transform = `translate(${v.x}px, ${v.y}px) scale(${v.scale})`;
}

function fitView(ui) {
  const svg = ui.canvas.querySelector("svg");
  if (!svg) return;
  const v = ui.view;
  const vw = ui.viewport.clientWidth || 600, vh = ui.viewport.clientHeight || 420;
  const w = svg.width.baseVal.value || 600, hgt = svg.height.baseVal.value || 400;
  // whole graph when it is legible that way; else fit the width (at most 0.8) and start at the top
  const whole = Math.min(vw / w, vh / hgt) * 0.97;
  v.scale = Math.min(1.2, Math.max(whole, Math.min(0.8, (vw / w) * 0.97)));
  v.x = (vw - w * v.scale) / 2;
  v.y = Math.max(4, (vh - hgt * v.scale) / 2);
  applyTransform(ui);
}

function zoomAt(ui, f, cx, cy) {
  const v = ui.view;
  const r = ui.viewport.getBoundingClientRect();
  cx = cx ?? r.width / 2; cy = cy ?? r.height / 2;
  const s = Math.min(8, Math.max(0.05, v.scale * f));
  v.x = cx - (cx - v.x) * (s / v.scale);
  v.y = cy - (cy - v.y) * (s / v.scale);
  v.scale = s;
  applyTransform(ui);
}

// ctrl/cmd + wheel zooms at the pointer; a plain wheel scrolls the graph while it overflows, else the page; a drag
// pans. Returns the function that removes the window listeners.
function panZoom(ui) {
  const { view, viewport, canvas } = ui;
  viewport.addEventListener("wheel", (ev) => {
    const r = viewport.getBoundingClientRect();
    if (ev.ctrlKey || ev.metaKey) {
      ev.preventDefault();
      zoomAt(ui, ev.deltaY < 0 ? 1.1 : 1 / 1.1, ev.clientX - r.left, ev.clientY - r.top);
      return;
    }
    const svg = canvas.querySelector("svg");
    const gh = svg ? svg.height.baseVal.value * view.scale : 0;
    const ny = Math.min(4, Math.max(r.height - gh - 4, view.y - ev.deltaY));
    if (gh > r.height && ny !== view.y) {
      ev.preventDefault();
      view.y = ny;
      applyTransform(ui);
    }
  }, { passive: false });
  viewport.addEventListener("mousedown", (ev) => {
    if (ev.button !== 0) return;
    ui.drag = { x: ev.clientX, y: ev.clientY, vx: view.x, vy: view.y, moved: false };
  });
  const onMove = (ev) => {
    const drag = ui.drag;
    if (!drag) return;
    const dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
    if (Math.abs(dx) + Math.abs(dy) > 3) drag.moved = true;
    view.x = drag.vx + dx; view.y = drag.vy + dy;
    if (drag.moved) applyTransform(ui);
  };
  // cleared after the click that ends a drag has been seen (a drag is no click)
  const endDrag = () => { setTimeout(() => { ui.drag = null; }, 0); };
  window.addEventListener("mousemove", onMove);
  window.addEventListener("mouseup", endDrag);
  return () => {
    window.removeEventListener("mousemove", onMove);
    window.removeEventListener("mouseup", endDrag);
  };
}

// ---- graph: hover, click, search ---------------------------------------------------------------------------------
function graphEvents(ui) {
  const { model, canvas, tooltip } = ui;
  canvas.addEventListener("mouseover", (ev) => {
    const g = ev.target.closest && ev.target.closest("g.node");
    const info = g && model.get("nodes")[g.id];
    if (!info) return;
    tooltip.replaceChildren(h("table", {}, tooltipRows(info).map(([k, v]) =>
      h("tr", {}, h("th", {}, k), h("td", {}, v)))));
    tooltip.style.display = "block";
  });
  canvas.addEventListener("mousemove", (ev) => {
    const r = ui.graphPanel.getBoundingClientRect();
    tooltip.style.left = `${ev.clientX - r.left + 14}px`;
    tooltip.style.top = `${ev.clientY - r.top + 14}px`;
  });
  canvas.addEventListener("mouseout", (ev) => {
    const g = ev.target.closest && ev.target.closest("g.node");
    if (g && !g.contains(ev.relatedTarget)) tooltip.style.display = "none";
  });
  canvas.addEventListener("click", (ev) => {
    if (ui.drag && ui.drag.moved) return;
    const g = ev.target.closest && ev.target.closest("g.node, g.cluster");
    if (!g) return;
    if (g.classList.contains("node")) {
      const info = model.get("nodes")[g.id];
      if (info && info.layer) selectLayer(ui, info.layer, true);
    } else {
      const c = model.get("clusters")[g.id];
      if (c && c.expandable) ui.send({ kind: "expand", block: c.block });
      else if (c && c.layer) selectLayer(ui, c.layer, true);
    }
  });
}

function tooltipRows(info) {
  if (info.kind === "input") return [["input", info.label]];
  const rows = [[info.kind === "op" ? "op" : "module", info.label], ["aten", info.op]];
  if (info.in_shapes && info.in_shapes.length) rows.push(["in", info.in_shapes.join(", ")]);
  if (info.out_shapes && info.out_shapes.length) rows.push(["out", info.out_shapes.join(", ")]);
  rows.push(["FLOPs", si(info.flops_each, "FLOP") + (info.repeats > 1 ? ` × ${info.repeats}` : "")]);
  rows.push(["memory", `activations ${si(info.act_bytes, "B")}, params ${si(info.param_bytes, "B")}`]);
  rows.push(["layer", `${info.layer} (stage ${info.stage})`]);
  rows.push(["split", info.split]);
  return rows;
}

function selectLayer(ui, path, scroll) {
  ui.model.send({ kind: "select", layer: path });
  markSelection(ui, path, scroll);
}

function markSelection(ui, path, scroll) {
  for (const tr of ui.table.querySelectorAll("tr[data-layer]")) {
    const on = tr.dataset.layer === path;
    tr.classList.toggle("ap-selected", on);
    if (on && scroll) tr.scrollIntoView({ block: "nearest" });
  }
  for (const c of ui.lanes.querySelectorAll(".ap-chip")) c.classList.toggle("ap-selected", c.dataset.layer === path);
}

function applySearch(ui, jump) {
  const q = ui.view.search;
  let first = null;
  const nodes = ui.model.get("nodes");
  for (const g of ui.canvas.querySelectorAll("g.node")) {
    const info = nodes[g.id] || {};
    const hay = `${g.id} ${g.textContent} ${info.label || ""} ${info.op || ""} ${info.module || ""} ${info.layer || ""}`
      .toLowerCase();
    const hit = q && hay.includes(q);
    g.classList.toggle("ap-match", !!hit);
    g.classList.toggle("ap-dim", !!q && !hit);
    if (hit && !first) first = g;
  }
  if (jump && first) {
    const vr = ui.viewport.getBoundingClientRect(), gr = first.getBoundingClientRect();
    ui.view.x += vr.left + vr.width / 2 - (gr.left + gr.width / 2);
    ui.view.y += vr.top + vr.height / 2 - (gr.top + gr.height / 2);
    applyTransform(ui);
    const info = nodes[first.id];
    if (info && info.layer) selectLayer(ui, info.layer, true);
  }
}

// ---- header and messages -----------------------------------------------------------------------------------------
function renderHeader(ui) {
  const { model, send } = ui;
  const t = model.get("timings") || {};
  const timing = [t.replan_ms != null ? `re-plan ${t.replan_ms.toFixed(0)} ms` : null,
    t.layout_ms != null ? `layout ${(t.layout_ms + (t.render_ms || 0)).toFixed(0)} ms` : null]
    .filter(Boolean).join(" · ");
  ui.header.replaceChildren(
    h("div", { class: "ap-title" }, h("b", {}, "autopar"), " ", h("span", { class: "ap-summary" }, model.get("summary"))),
    h("div", { class: "ap-header-buttons" },
      h("button", { class: "ap-btn ap-undo", disabled: !model.get("can_undo"), title: "undo (ap.undo())",
        onclick: () => send({ kind: "undo" }) }, "↶ undo"),
      h("button", { class: "ap-btn ap-redo", disabled: !model.get("can_redo"), title: "redo (ap.redo())",
        onclick: () => send({ kind: "redo" }) }, "↷ redo"),
      model.get("actions").flatMap((a) => [
        h("button", { class: `ap-btn ap-action ap-action-${a}`, title: `ap.${a}()`,
          onclick: () => send({ kind: "action", name: a }) }, a[0].toUpperCase() + a.slice(1)),
        a === "verify" || a === "launch" ? runInput(ui, `${a}_steps`, "steps", `steps of ap.${a}()`) : null]),
      model.get("actions").some((a) => a === "verify" || a === "launch")
        ? runInput(ui, "nproc", "processes", "processes for Verify and Launch") : null,
      h("span", { class: "ap-timing" }, timing)));
}

// ---- Verify/Launch: their inputs (the run_options trait) and the live view below the widget ------------------
function runInput(ui, key, label, title) {
  const { model } = ui;
  const opts = model.get("run_options") || {};
  const auto = key === "nproc" ? (model.get("run_defaults") || {}).nproc : null;
  const input = h("input", { class: `ap-run-input ap-run-${key.replace("_", "-")}`, type: "number", min: 1,
    step: 1, value: opts[key] ?? "", placeholder: auto ? `${auto}` : "", title });
  input.addEventListener("change", () => {
    const v = parseInt(input.value, 10);
    model.set("run_options", { ...model.get("run_options"), [key]: Number.isFinite(v) && v > 0 ? v : null });
    model.save_changes();
  });
  return h("label", { class: "ap-run-field", title }, label, input);
}

function runPanel(ui, el, host) {
  // the child widget (anywidget's host.getWidget) is rendered after the planner, in the same output
  const panel = h("div", { class: "ap-run-panel" });
  el.append(panel);
  let ctrl = null;
  const show = async () => {
    const ref = ui.model.get("panel");
    if (ctrl) ctrl.abort();
    ctrl = null;
    panel.replaceChildren();
    if (!ref) return;
    if (!host || !host.getWidget) {
      panel.append(h("div", { class: "ap-msg ap-msg-info" }, "display(ap.widget().last_result) shows the live view"));
      return;
    }
    const mine = new AbortController();
    ctrl = mine;
    try {
      const child = await host.getWidget(ref);
      if (ctrl !== mine) return;
      await child.render({ el: panel, signal: mine.signal });
      panel.scrollIntoView({ block: "nearest", behavior: "smooth" });
    } catch (err) {
      panel.append(h("div", { class: "ap-msg ap-msg-error" }, `the live view could not be shown: ${err}`));
    }
  };
  ui.model.on("change:panel", show);
  show();
  return () => { ui.model.off("change:panel", show); if (ctrl) ctrl.abort(); };
}

function renderMessages(ui) {
  const msgs = ui.model.get("messages") || [];
  ui.messages.replaceChildren(...msgs.map((m) => h("div", { class: `ap-msg ap-msg-${m.level}` },
    h("div", {}, h("span", {}, m.text), m.detail ? h("pre", { class: "ap-detail" }, m.detail) : null),
    h("button", { class: "ap-msg-close", title: "dismiss", onclick: (ev) => ev.target.parentElement.remove() }, "×"))));
}

// ---- graph -------------------------------------------------------------------------------------------------------
function renderGraph(ui) {
  const { model, canvas } = ui;
  if (model.get("svg") !== ui.view.svgText) loadSvg(ui);
  const changed = new Set(model.get("changed"));
  const nodes = model.get("nodes");
  for (const g of canvas.querySelectorAll("g.node")) {
    const info = nodes[g.id];
    g.classList.toggle("ap-selected-node", !!info && info.layer === model.get("selection"));
    g.classList.toggle("ap-changed-node", !!info && changed.has(info.layer));
  }
  ui.depth.max = model.get("max_depth");
  ui.depth.value = model.get("depth");
  ui.depthLabel.textContent = `${model.get("depth")}/${model.get("max_depth")}`;
  ui.blocks.replaceChildren(...foldButtons(ui));
  ui.legend.replaceChildren(...model.get("legend").map((l) => legendItem(l.color, l.label)),
    legendItem(null, "communication (collective, bytes/step)", "ap-swatch-comm"),
    legendItem(null, "changed", "ap-swatch-changed"));
}

function loadSvg(ui) {
  const { model, canvas, view } = ui;
  canvas.innerHTML = model.get("svg");
  view.svgText = model.get("svg");
  if (!view.fitted) requestAnimationFrame(() => { fitView(ui); view.fitted = ui.viewport.clientWidth > 0; });
  for (const g of canvas.querySelectorAll("g.node, g.cluster")) {
    const t = g.querySelector("title");
    if (t) t.remove(); // our tooltip replaces the browser's
  }
  for (const [cid, c] of Object.entries(model.get("clusters"))) {
    const g = canvas.querySelector(`g[id="${CSS.escape(cid)}"]`);
    if (g && c.expandable) g.classList.add("ap-expandable");
  }
  applySearch(ui, false);
}

// one "expand NAME" / "fold NAME" button per repeated block
function foldButtons(ui) {
  const exp = ui.model.get("expanded");
  const foldable = Object.values(ui.model.get("clusters")).filter((c) => c.expandable || c.collapsible);
  const seen = new Set();
  return foldable.filter((c) => c.block || c.collapsible).map((c) => {
    const name = c.block || c.layer.replace(/\.\d+$/, "");
    if (seen.has(name)) return null;
    seen.add(name);
    const kind = exp.includes(name) ? "collapse" : "expand";
    return h("button", { class: "ap-btn ap-fold", onclick: () => ui.send({ kind, block: name }) },
      `${kind === "collapse" ? "fold" : "expand"} ${name}`);
  }).filter(Boolean);
}

function legendItem(color, label, swatchClass = "") {
  return h("span", { class: "ap-legend-item" },
    h("span", { class: `ap-swatch ${swatchClass}`.trim(), style: color ? `background:${color}` : null }), label);
}

// ---- side panels: memory, step time, changes, alternatives, explanation ------------------------------------------
function renderSide(ui) {
  const { model } = ui;
  ui.side.replaceChildren(...[memoryPanel(model.get("memory")), timePanel(model.get("time")),
    changesPanel(model.get("changes")), alternativesPanel(ui, model.get("alternatives")),
    explanationPanel(model.get("explanation"))].filter(Boolean));
}

function memoryPanel(mem) {
  if (!mem.bars || !mem.bars.length) return null;
  const scale = Math.max(mem.limit, mem.peak) * 1.04;
  const pct = (b) => `${(100 * b / scale).toFixed(2)}%`;
  return h("div", { class: "ap-panel ap-memory" },
    h("div", { class: "ap-panel-title" }, "Memory per rank ",
      h("span", { class: mem.over ? "ap-bad" : "ap-hint" }, `peak ${gib(mem.peak)} of ${gib(mem.limit)}`)),
    mem.bars.map((b) => h("div", { class: "ap-bar-row" + (b.over ? " ap-over" : "") },
      h("span", { class: "ap-bar-label" }, b.label),
      h("div", { class: "ap-bar", title: mem.parts.map((p) => `${p.label}: ${gib(b[p.key])}`).join("\n") },
        mem.parts.map((p) => h("span", { class: "ap-seg", style: `width:${pct(b[p.key])};background:${p.color}` })),
        h("span", { class: "ap-limit", style: `left:${pct(mem.limit)}`, title: `device limit ${gib(mem.limit)}` })),
      h("span", { class: "ap-bar-value" }, gib(b.total)))),
    h("div", { class: "ap-keys" }, mem.parts.map((p) => legendItem(p.color, p.label)),
      legendItem(null, "device limit", "ap-swatch-limit")));
}

function timePanel(tm) {
  if (!tm.parts || !tm.parts.length) return null;
  const total = tm.parts.reduce((a, p) => a + p.s, 0) || 1;
  return h("div", { class: "ap-panel ap-time" },
    h("div", { class: "ap-panel-title" }, "Step time ", h("b", {}, ms(tm.total))),
    h("div", { class: "ap-bar ap-bar-time" }, tm.parts.map((p) =>
      h("span", { class: "ap-seg", title: `${p.label}: ${ms(p.s)}`,
        style: `width:${(100 * p.s / total).toFixed(2)}%;background:${p.color}` }))),
    h("div", { class: "ap-keys" }, tm.parts.map((p) => legendItem(p.color, `${p.label} ${ms(p.s)}`))),
    h("div", { class: "ap-stats" },
      h("span", {}, "MFU ", h("b", { class: "ap-mfu" }, `${(100 * tm.mfu).toFixed(1)}%`)),
      h("span", {}, `${tm.model_tflops.toFixed(1)} TFLOP/s/GPU`),
      tm.tokens_per_s ? h("span", {}, `${si(tm.tokens_per_s)}tok/s`)
        : h("span", {}, `${tm.samples_per_s.toFixed(1)} samples/s`)));
}

function changesPanel(changes) {
  if (!changes.length) return null;
  return h("div", { class: "ap-panel ap-changes" },
    h("div", { class: "ap-panel-title" }, `Changed against the previous plan (${changes.length})`),
    h("ul", {}, changes.slice(0, 12).map((c) => h("li", {}, c))));
}

function alternativesPanel(ui, alts) {
  if (!alts.length) return null;
  return h("div", { class: "ap-panel ap-alternatives" },
    h("div", { class: "ap-panel-title" }, "Alternatives"),
    h("table", {}, alts.map((a) => h("tr", { title: a.changes.join("\n") },
      h("td", {}, a.summary, h("div", { class: "ap-hint" },
        a.n_changes ? `${a.changes.slice(0, 2).join("; ")}${a.n_changes > 2 ? ` (+${a.n_changes - 2})` : ""}` : "")),
      h("td", { class: "ap-num" }, a.step_ms != null ? `${a.step_ms.toFixed(1)} ms` : ""),
      h("td", { class: "ap-num" }, a.peak_gib != null ? `${a.peak_gib.toFixed(1)} GiB` : ""),
      h("td", {}, h("button", { class: "ap-btn ap-adopt", onclick: () => ui.send({ kind: "adopt", index: a.index }) },
        "adopt"))))));
}

function explanationPanel(expl) {
  if (!expl.length) return null;
  return h("details", { class: "ap-panel ap-explanation" }, h("summary", {}, "Why this plan"),
    h("ul", {}, expl.map((x) => h("li", {}, x))));
}

// ---- global choices ----------------------------------------------------------------------------------------------
const GLOBAL_LABELS = { dp: "dp", tp: "tp", pp: "pp", zero_stage: "ZeRO", micro_batches: "micro-batches",
  schedule: "schedule", virtual_stages: "virtual stages", amp: "AMP", sequence_parallel: "seq. parallel",
  recompute: "recompute (all layers)" };

function choiceSelect(cls, key, value, fixed, options, onchange) {
  const cur = fixed !== undefined ? String(fixed) : "auto";
  const sel = h("select", { class: cls, dataset: { key }, onchange: (ev) => onchange(ev.target.value) },
    h("option", { value: "auto" }, `auto${value !== undefined && fixed === undefined ? ` (${value})` : ""}`),
    options.map((o) => h("option", { value: String(o) }, String(o))));
  sel.value = cur;
  return sel;
}

function renderControls(ui) {
  const c = ui.model.get("controls");
  const items = clusterControls(ui, c);
  for (const [key, label] of Object.entries(GLOBAL_LABELS)) {
    const sel = choiceSelect("ap-global", key, c.values[key], c.fixed[key], c.options[key] || [],
      (v) => ui.send({ kind: "global", key, value: v }));
    items.push(h("span", { class: "ap-ctl" + (c.fixed[key] !== undefined ? " ap-pinned" : "") }, `${label} `, sel));
  }
  ui.controls.replaceChildren(...items);
}

// device preset, nodes, GPUs per node: one "cluster" message when any changes
function clusterControls(ui, c) {
  const preset = h("select", { class: "ap-preset" }, c.presets.concat(c.presets.includes(c.preset) ? [] : [c.preset])
    .map((p) => h("option", { value: p }, p)));
  preset.value = c.preset;
  const nodes = h("input", { class: "ap-nodes", type: "number", min: 1, value: c.nodes });
  const gpus = h("input", { class: "ap-gpus", type: "number", min: 1, value: c.gpus_per_node });
  const apply = () => ui.send({ kind: "cluster", preset: preset.value, nodes: Number(nodes.value),
    gpus_per_node: Number(gpus.value) });
  for (const x of [preset, nodes, gpus]) x.addEventListener("change", apply);
  return [h("span", { class: "ap-ctl", title: c.device }, "device ", preset),
    h("span", { class: "ap-ctl" }, "nodes ", nodes), h("span", { class: "ap-ctl" }, "GPUs/node ", gpus)];
}

// ---- pipeline lanes: drag a layer chip onto a lane, or a lane's boundary handle onto a chip ----------------------
function renderLanes(ui) {
  const st = ui.model.get("stages");
  const rows = Object.fromEntries(ui.model.get("layers").map((r) => [r.path, r]));
  ui.lanes.replaceChildren(...st.map((lane) => laneElement(ui, lane, rows)));
  if (st.length <= 1) {
    ui.lanes.append(h("div", { class: "ap-hint" },
      "one pipeline stage (pp = 1): set pp above to split the model into lanes"));
  }
}

function laneElement(ui, lane, rows) {
  const handle = lane.index > 0 ? h("span", { class: "ap-boundary", draggable: "true",
    title: `drag onto a layer to make it the first layer of stage ${lane.index}`,
    ondragstart: (ev) => { ev.dataTransfer.setData("text/plain", `boundary:${lane.index}`); } }, "⇤") : null;
  const sel = ui.model.get("selection");
  return h("div", {
    class: "ap-lane", dataset: { stage: lane.index },
    ondragover: (ev) => { ev.preventDefault(); ev.currentTarget.classList.add("ap-drop"); },
    ondragleave: (ev) => ev.currentTarget.classList.remove("ap-drop"),
    ondrop: (ev) => {
      ev.preventDefault();
      ev.currentTarget.classList.remove("ap-drop");
      const d = ev.dataTransfer.getData("text/plain");
      if (d.startsWith("layer:")) {
        const layer = d.slice(6);
        if ((rows[layer] || {}).stage !== lane.index) ui.send({ kind: "stage", layer, stage: lane.index });
      }
    },
  }, h("span", { class: "ap-lane-label" }, `stage ${lane.index}`), handle,
  lane.layers.map((p) => chipElement(ui, p, rows[p] || {}, p === sel)));
}

function chipElement(ui, path, row, selected) {
  return h("span", {
    class: "ap-chip" + (row.changed ? " ap-changed" : "") + (row.stage_pinned ? " ap-pinned" : "")
      + (selected ? " ap-selected" : ""),
    draggable: "true", dataset: { layer: path }, title: `${path}: ${row.type || ""} ${row.params || ""} params`,
    ondragstart: (ev) => { ev.dataTransfer.setData("text/plain", `layer:${path}`); ev.dataTransfer.effectAllowed = "move"; },
    onclick: () => selectLayer(ui, path, true),
    ondragover: (ev) => ev.preventDefault(),
    ondrop: (ev) => {
      const d = ev.dataTransfer.getData("text/plain");
      if (d.startsWith("boundary:")) {
        ev.preventDefault(); ev.stopPropagation();
        ui.send({ kind: "boundary", stage: Number(d.slice(9)), layer: path });
      }
    },
  }, row.stage_pinned ? h("span", { class: "ap-pin", title: "stage pinned" }, `${PIN} `) : null, path);
}

// ---- layer table: strategy and recompute per layer ---------------------------------------------------------------
function renderTable(ui) {
  const rows = ui.model.get("layers");
  const sel = ui.model.get("selection");
  // the recompute modes come from Python (autopar_nb.plan.RECOMPUTE), like every other vocabulary
  const recomputeOpts = (ui.model.get("controls").options || {}).recompute || [];
  ui.table.replaceChildren(h("table", { class: "ap-table" },
    h("thead", {}, h("tr", {}, ["layer", "type", "params", "stage", "strategy", "recompute", ""]
      .map((x) => h("th", {}, x)))),
    h("tbody", {}, rows.map((r) => layerRow(ui, r, r.path === sel, recomputeOpts)))));
}

function layerRow(ui, r, selected, recomputeOpts) {
  const send = ui.send;
  const strat = h("select", { class: "ap-strategy", dataset: { layer: r.path },
    onchange: (ev) => send({ kind: "strategy", layer: r.path, value: ev.target.value }) },
  r.choices.map((c) => h("option", { value: c.value }, c.value === "auto" ? `auto (${r.auto_label})` : c.label)));
  strat.value = r.strategy;
  const rec = h("select", { class: "ap-recompute", dataset: { layer: r.path },
    onchange: (ev) => send({ kind: "recompute", layer: r.path, value: ev.target.value }) },
  h("option", { value: "auto" }, `auto (${r.recompute})`),
  recomputeOpts.map((o) => h("option", { value: o }, o)));
  rec.value = r.recompute_pinned ? r.recompute : "auto";
  const pinnedAny = r.pinned.length > 0;
  const pin = (title) => h("span", { class: "ap-pin", title }, `${PIN} `);
  return h("tr", { class: (r.changed ? "ap-changed " : "") + (selected ? "ap-selected" : ""), dataset: { layer: r.path },
    onclick: (ev) => { if (ev.target.tagName !== "SELECT" && ev.target.tagName !== "BUTTON") selectLayer(ui, r.path, false); } },
  h("td", { class: "ap-path" }, pinnedAny ? pin(`pinned: ${r.pinned.join(", ")}`) : null, r.path),
  h("td", {}, r.type), h("td", { class: "ap-num" }, r.params),
  h("td", { class: "ap-num" }, r.stage_pinned ? pin("stage pinned") : null, r.stage),
  h("td", { class: r.strategy !== "auto" ? "ap-pinned" : "" }, strat),
  h("td", { class: r.recompute_pinned ? "ap-pinned" : "" }, rec),
  h("td", {}, pinnedAny ? h("button", { class: "ap-btn ap-unpin", title: "un-pin every choice for this layer",
    onclick: () => send({ kind: "unpin", layer: r.path }) }, "auto") : null));
}

export default { render };
