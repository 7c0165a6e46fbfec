// autopar-nb planner widget front end (anywidget ES module; no build step, no network).
// State lives in the Python model's traits; this file renders them and sends edits back as {kind: ...} messages
// (see autopar_nb/widget/model.py, PlannerWidget.handle). Which split a layer can take, which global options the
// planner can plan, how the graph is folded: all come from Python; nothing here decides them.

// the view scale at which the graph's smallest label is 9 CSS px (autopar_nb/widget/layout.py: LEGIBLE_SCALE)
const legible = (ui) => (ui.model.get("view") || {}).legible || 0.75;
let widgetCount = 0;

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

const PIN = "●";
const NARROW_PX = 900; // below this widget width the side panels go below the graph (.ap-narrow)

// ---- the widget -------------------------------------------------------------------------------------------------
// `ui` is what every function below shares: the model, the DOM parts, the view state (pan/zoom, search, selection on
// the sharding board) and send().

function render({ model, el, host }) {
  const ui = skeleton(model, el);
  // the last Launch's dashboard, then the last Verify's progress, then the last Tournament's standings: none takes
  // another's place
  const stopPanels = ["panel", "verify_panel", "tournament_panel"].map((trait) => runPanel(ui, el, host, trait));
  toolbar(ui);
  const stopPanZoom = panZoom(ui);
  const stopGraph = graphEvents(ui);
  const stopBoard = boardEvents(ui);
  const renderAll = () => {
    const t0 = performance.now();
    ui.root.classList.remove("ap-busy");
    // a part is drawn again only when a trait it shows changed (an unchanged trait keeps its object in the model)
    const parts = {};
    const timed = (name, fn) => { const t = performance.now(); fn(); parts[name] = Math.round(performance.now() - t); };
    timed("header", () => { renderHeader(ui); renderMessages(ui); });
    timed("graph", () => renderGraph(ui));
    if (changed(ui, "side", ["memory", "time", "change_groups", "changes", "alternatives", "levers", "explanation",
      "view", "components", "measured", "timeline"])) {
      timed("side", () => renderSide(ui));
    }
    if (changed(ui, "controls", ["controls"])) timed("controls", () => renderControls(ui));
    if (changed(ui, "precision", ["precision"])) timed("precision", () => renderPrecision(ui));
    if (changed(ui, "board", ["board"])) timed("board", () => renderBoard(ui));
    if (changed(ui, "lanes", ["stages", "layers", "selection"])) timed("lanes", () => renderLanes(ui));
    if (changed(ui, "table", ["layers", "selection", "controls"])) timed("table", () => renderTable(ui));
    markSelection(ui, model.get("selection"), false);
    // the front end's own time for the last re-render, in all and per part (the browser tests read them)
    ui.root.dataset.renderMs = (performance.now() - t0).toFixed(1);
    ui.root.dataset.renderParts = JSON.stringify(parts);
  };
  renderAll();
  // a rejected edit changes no plan trait: redraw the controls so none keeps showing the value that was refused
  const onMessages = () => {
    ui.root.classList.remove("ap-busy");
    renderMessages(ui);
    if ((model.get("messages") || []).some((m) => m.level === "error")) {
      renderControls(ui); renderPrecision(ui); renderBoard(ui); renderLanes(ui); renderTable(ui);
    }
  };
  const onSelection = () => { markSelection(ui, model.get("selection"), false); renderGraph(ui); };
  const onTimings = () => renderHeader(ui);
  const onMeasured = () => { if (changed(ui, "side", ["memory", "time", "change_groups", "changes", "alternatives",
    "levers", "explanation", "view", "components", "measured", "timeline"])) renderSide(ui); };
  model.on("change:measured", onMeasured);
  model.on("change:revision", renderAll);
  model.on("change:messages", onMessages);
  model.on("change:selection", onSelection);
  model.on("change:timings", onTimings);
  model.on("change:calibrated", onTimings);  // a tournament that ended calibrated the session's next plans
  const stopSize = reportViewport(ui), stopTheme = followTheme(ui), stopKernel = watchKernel(model, el, () => kernelGone(ui));
  return () => {
    model.off("change:revision", renderAll);
    model.off("change:messages", onMessages);
    model.off("change:selection", onSelection);
    model.off("change:timings", onTimings);
    model.off("change:calibrated", onTimings);
    model.off("change:measured", onMeasured);
    stopPanZoom(); stopGraph(); stopBoard(); stopPanels.forEach((stop) => stop()); stopSize(); stopTheme(); stopKernel();
    if (ui.tl) { ui.tl.ro.disconnect(); ui.tl.u.destroy(); }
  };
}

// whether any of the traits ``keys`` holds another object than when the part ``name`` was last drawn
function changed(ui, name, keys) {
  const now = keys.map((k) => ui.model.get(k));
  const before = ui.drawn[name];
  ui.drawn[name] = now;
  return !before || now.some((v, i) => v !== before[i]);
}

// [left, right] of an SVG path or polygon (its points as x,y pairs; graphviz writes absolute coordinates)
function shapeXs(shape) {
  const nums = ((shape && (shape.getAttribute("points") || shape.getAttribute("d"))) || "").match(/-?[\d.]+/g) || [];
  const xs = nums.filter((_, i) => i % 2 === 0).map(Number);
  return xs.length ? [Math.min(...xs), Math.max(...xs)] : [-Infinity, Infinity];
}

// ---- skeleton: the DOM parts, filled by the renderers ------------------------------------------------------------
function skeleton(model, el) {
  // keys typed in the widget (search box, number inputs, the board's keys) are not notebook shortcuts
  const root = h("div", { class: "ap-root", "data-lm-suppress-shortcuts": "true", tabindex: "-1",
    onkeydown: (ev) => {
      if (ev.target.matches("input, select, textarea, .ap-schip, .ap-board")) ev.stopPropagation();
    } });
  el.append(root);
  widgetCount += 1;
  const ui = {
    model, root, id: `ap${widgetCount}`,
    // view state kept across re-renders
    view: { scale: 1, x: 0, y: 0, fitted: false, userMoved: false, search: "", svgText: null, hits: [], hit: -1,
      gw: 0, gh: 0 },
    drag: null,
    drawn: {},
    board: { selected: new Set(), anchor: null, open: new Set(), target: null, dragging: null, focus: null },
    send: (msg) => { if (ui.gone) return; root.classList.add("ap-busy"); model.send(msg); },
    origin: null,
    header: h("div", { class: "ap-header" }),
    messages: h("div", { class: "ap-messages", role: "status" }),
    toolbar: h("div", { class: "ap-toolbar" }),
    legend: h("div", { class: "ap-legend" }),
    canvas: h("div", { class: "ap-svg" }),
    tooltip: h("div", { class: "ap-tooltip", style: "display:none" }),
    menu: h("div", { class: "ap-menu", style: "display:none", role: "menu" }),
    ghost: h("div", { class: "ap-ghost", style: "display:none" }),
    minimap: h("div", { class: "ap-minimap", style: "display:none", title: "overview: click or drag to move the view" }),
    side: h("div", { class: "ap-side" }),
    controls: h("div", { class: "ap-controls" }),
    precision: h("div", { class: "ap-precision" }),
    boardEl: h("div", { class: "ap-board", tabindex: "-1" }),
    boardStatus: h("div", { class: "ap-board-status", "aria-live": "polite" }),
    lanes: h("div", { class: "ap-lanes" }),
    table: h("div", { class: "ap-table-wrap" }),
  };
  ui.viewport = h("div", { class: "ap-viewport" }, ui.canvas, ui.minimap);
  ui.graphPanel = h("div", { class: "ap-graph" }, ui.toolbar, ui.viewport, ui.legend, ui.tooltip, ui.menu);
  root.append(ui.header, ui.messages, h("div", { class: "ap-main" }, ui.graphPanel, ui.side),
    h("div", { class: "ap-section-title" }, "Global choices"), ui.controls,
    h("div", { class: "ap-section-title" }, "Mixed precision ops ", h("span", { class: "ap-hint" },
      "beyond autocast's own lists (torch or Paddle names: softmax, layer_norm, matmul, elementwise_add…)")),
    ui.precision,
    h("div", { class: "ap-section-title" }, "Sharding ", h("span", { class: "ap-hint" },
      "drag layers to a split (shift/ctrl-click or drag a box to select several; keys: ←→ move, space select, "
      + "↑↓ choose a lane, Enter apply)")), ui.boardEl, ui.boardStatus,
    h("div", { class: "ap-section-title" }, "Pipeline stages ", h("span", { class: "ap-hint" },
      "drag a layer to another lane, or a lane's ⇤ handle onto a layer to move the boundary")), ui.lanes,
    h("div", { class: "ap-section-title" }, "Layers"), ui.table, ui.ghost);
  for (const type of ["pointerdown", "keydown", "change", "drop"]) {
    root.addEventListener(type, (ev) => { ui.origin = editSection(ui, ev.target); }, true);
  }
  return ui;
}

// the part after which the answer to an edit made in ``target`` shows, beside the edit (null: under the header,
// which the graph and side panels, where the other edits are made, sit right below)
function editSection(ui, target) {
  const sections = [[ui.controls, ui.controls], [ui.precision, ui.precision], [ui.boardEl, ui.boardStatus],
    [ui.lanes, ui.lanes], [ui.table, ui.table]];
  const hit = target && sections.find(([part]) => part.contains(target));
  return hit ? hit[1] : null;
}

// the viewport's size goes to Python (the `viewport` trait), which picks the depth, folding and columns that fit it
function reportViewport(ui) {
  let timer = null, last = null, seen = null;
  const ro = new ResizeObserver(() => {
    const size = `${ui.viewport.clientWidth}x${ui.viewport.clientHeight}`;
    // fitted again at the new size ("fit" or the automatic fit) until the user pans or zooms
    const refit = !ui.view.fitted || (!ui.view.userMoved && seen !== null && size !== seen);
    seen = size;
    if (refit && ui.viewport.clientWidth > 0 && ui.canvas.querySelector("svg")) fitView(ui, ui.view.fitMode || "auto");
    clearTimeout(timer);
    timer = setTimeout(() => {
      const w = Math.round(ui.viewport.clientWidth), hgt = Math.round(ui.viewport.clientHeight);
      if (w < 200 || hgt < 150) return;
      if (last && Math.abs(w - last[0]) < 0.04 * last[0] && Math.abs(hgt - last[1]) < 0.04 * last[1]) return;
      last = [w, hgt];
      ui.model.set("viewport", { width: w, height: hgt });
      ui.model.save_changes();
    }, 200);
  });
  ro.observe(ui.viewport);
  // a narrow notebook column (JupyterLab at 1024 px with the file browser open: ~700 px) stacks the side panels
  // below the graph instead of squeezing the graph to a sliver beside them
  const narrow = new ResizeObserver(() => ui.root.classList.toggle("ap-narrow", ui.root.clientWidth < NARROW_PX));
  narrow.observe(ui.root);
  return () => { ro.disconnect(); narrow.disconnect(); clearTimeout(timer); };
}

// JupyterLab's theme switch sets the body's data-jp-theme-* attributes and swaps its CSS variables, with no new
// model state; the graph's paper and the side panels' chart colours are read when drawn, so they are drawn again
// (twice: the new theme's stylesheet may land after the attributes change)
function followTheme(ui) {
  const timers = [];
  const redraw = () => { ui.view.svgText = null; renderGraph(ui); renderSide(ui); };  // the SVG again: its tints
  const mo = new MutationObserver(() => { timers.push(setTimeout(redraw, 50), setTimeout(redraw, 500)); });
  mo.observe(document.body, { attributes: true, attributeFilter: ["data-jp-theme-light", "data-jp-theme-name"] });
  // JupyterLab renders a widget before its output is in the page, where the panel has no background yet: the first
  // graph came out light in a notebook opened in the dark theme. Once the root is laid out, draw again if it is dark
  const ro = new ResizeObserver(() => {
    if (ui.root.isConnected && panelBackground(ui).dark !== ui.root.classList.contains("ap-dark")) redraw();
  });
  ro.observe(ui.root);
  return () => { mo.disconnect(); ro.disconnect(); timers.forEach(clearTimeout); };
}

// the kernel is gone (static/kernel.js): say so at the top and disable the controls that need the kernel (the graph's
// own view controls stay)
function kernelGone(ui) {
  ui.gone = true;
  ui.root.classList.add("ap-gone");
  ui.root.classList.remove("ap-busy");
  ui.root.prepend(h("div", { class: "ap-kernel-gone", role: "alert" }, h("b", {}, "The kernel stopped"),
    " (it died or was restarted): this planner is no longer connected, its plan and buttons are those of the "
    + "old kernel. Run the cell again for a live one."));
  for (const c of ui.root.querySelectorAll("button, input, select")) {
    if (!c.closest(".ap-toolbar")) c.disabled = true;
  }
}

// ---- toolbar: search, depth, blocks, auto view, zoom ---------------------------------------------------------------
function toolbar(ui) {
  const search = h("input", { class: "ap-search", type: "search", placeholder: "search ops / modules…",
    "aria-label": "search the graph" });
  search.addEventListener("input", () => { ui.view.search = search.value.trim().toLowerCase(); applySearch(ui, 0); });
  search.addEventListener("keydown", (ev) => { if (ev.key === "Enter") applySearch(ui, ev.shiftKey ? -1 : 1); });
  ui.searchCount = h("span", { class: "ap-search-count", "aria-live": "polite" });
  const prev = h("button", { class: "ap-btn ap-search-prev", title: "previous match (shift+Enter)",
    onclick: () => applySearch(ui, -1) }, "↑");
  const next = h("button", { class: "ap-btn ap-search-next", title: "next match (Enter)",
    onclick: () => applySearch(ui, 1) }, "↓");
  ui.depth = h("input", { class: "ap-depth", type: "range", min: 0, step: 1, "aria-label": "module depth" });
  ui.depthLabel = h("span", { class: "ap-depth-label" });
  ui.depth.addEventListener("change", () => ui.send({ kind: "depth", value: Number(ui.depth.value) }));
  ui.blocks = h("span", { class: "ap-blocks" });
  ui.autoBtn = h("button", { class: "ap-btn ap-auto-view", title: "the view that fits this panel (depth, folding, columns)",
    onclick: () => { ui.view.userMoved = false; ui.send({ kind: "auto_view" }); } }, "auto view");
  const fit = h("button", { class: "ap-btn ap-fit", title: "fit the whole graph in the view",
    onclick: () => fitView(ui, "whole") }, "fit");
  const zin = h("button", { class: "ap-btn ap-zoom-in", title: "zoom in", onclick: () => zoomAt(ui, 1.25) }, "+");
  const zout = h("button", { class: "ap-btn ap-zoom-out", title: "zoom out", onclick: () => zoomAt(ui, 0.8) }, "−");
  ui.toolbar.append(h("span", { class: "ap-search-wrap" }, search, ui.searchCount, prev, next),
    h("label", { class: "ap-depth-wrap" }, "depth ", ui.depth, ui.depthLabel), ui.blocks, ui.autoBtn, zout, zin, fit);
}

// ---- pan / zoom / fit / minimap ------------------------------------------------------------------------------------
function applyTransform(ui) {
  const v = ui.view;
  ui.canvas.style.transform = `translate(${v.x}px, ${v.y}px) scale(${v.scale})`;
  updateMinimap(ui);
}

function graphSize(ui) {
  const svg = ui.canvas.querySelector("svg");
  if (!svg) return null;
  return [svg.width.baseVal.value || 600, svg.height.baseVal.value || 400];
}

// "auto": the whole graph when its labels stay legible that way, else legible size from the top with the minimap;
// "whole": the whole graph whatever the size
function fitView(ui, mode = "auto") {
  const size = graphSize(ui);
  if (!size) return;
  const [w, hgt] = size;
  const v = ui.view;
  const vw = ui.viewport.clientWidth || 600, vh = ui.viewport.clientHeight || 420;
  const whole = Math.min(vw / w, vh / hgt) * 0.96;
  if (mode === "whole" || whole >= legible(ui)) {
    v.scale = Math.min(1.1, whole);
    v.x = (vw - w * v.scale) / 2;
    v.y = Math.max(4, (vh - hgt * v.scale) / 2);
  } else {
    v.scale = legible(ui);
    v.x = w * v.scale <= vw ? (vw - w * v.scale) / 2 : 8;
    v.y = 8;
  }
  v.fitted = vw > 0;
  v.fitMode = mode;
  if (mode === "whole") v.userMoved = false;
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
  v.userMoved = true;
  applyTransform(ui);
}

function updateMinimap(ui) {
  const size = graphSize(ui);
  const mm = ui.minimap;
  if (!size || !ui.view.svgText) { mm.style.display = "none"; return; }
  const [w, hgt] = size;
  const v = ui.view, vw = ui.viewport.clientWidth, vh = ui.viewport.clientHeight;
  const overflow = w * v.scale > vw + 2 || hgt * v.scale > vh + 2;
  mm.style.display = overflow ? "block" : "none";
  if (!overflow) return;
  const k = Math.min(150 / w, 120 / hgt);
  mm.style.width = `${w * k}px`; mm.style.height = `${hgt * k}px`;
  if (mm.dataset.src !== ui.view.svgText.length + ":" + w) {
    mm.dataset.src = ui.view.svgText.length + ":" + w;
    mm.replaceChildren(h("img", { alt: "", draggable: "false",
      src: "data:image/svg+xml;charset=utf-8," + encodeURIComponent(ui.view.svgText) }),
    h("div", { class: "ap-minimap-view" }));
  }
  const box = mm.querySelector(".ap-minimap-view");
  const x0 = Math.max(0, -v.x / v.scale), y0 = Math.max(0, -v.y / v.scale);
  box.style.left = `${x0 * k}px`; box.style.top = `${y0 * k}px`;
  box.style.width = `${Math.min(w - x0, vw / v.scale) * k}px`;
  box.style.height = `${Math.min(hgt - y0, vh / v.scale) * k}px`;
  ui.minimapScale = k;
}

// ctrl/cmd + wheel zooms at the pointer; a plain wheel scrolls the graph while it overflows, else the page; a drag on
// the background pans (a drag from a node or cluster takes it to the legend, see graphEvents). Returns a cleanup.
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
      view.userMoved = true;
      applyTransform(ui);
    }
  }, { passive: false });
  viewport.addEventListener("mousedown", (ev) => {
    if (ev.button !== 0 || ev.target.closest(".ap-minimap")) return;
    ev.preventDefault(); // a pan or a drag to a swatch, never a text selection across the labels
    const grab = ev.target.closest && ev.target.closest("g.node, g.cluster, [data-cluster]");
    ui.drag = { x: ev.clientX, y: ev.clientY, vx: view.x, vy: view.y, moved: false, grab };
    if (grab) startLongPress(ui, ev, grab);
  });
  const onMove = (ev) => {
    const drag = ui.drag;
    if (!drag) return;
    const dx = ev.clientX - drag.x, dy = ev.clientY - drag.y;
    if (Math.abs(dx) + Math.abs(dy) > 4) { drag.moved = true; cancelLongPress(ui); }
    if (drag.grab && drag.moved) { nodeDragMove(ui, ev, drag); return; }
    if (!drag.moved) return;
    view.x = drag.vx + dx; view.y = drag.vy + dy;
    view.userMoved = true;
    applyTransform(ui);
  };
  // cleared after the click that ends a drag has been seen (a drag is no click)
  const endDrag = (ev) => {
    cancelLongPress(ui);
    if (ui.drag && ui.drag.grab && ui.drag.moved) nodeDrop(ui, ev);
    setTimeout(() => { ui.drag = null; }, 0);
  };
  window.addEventListener("mousemove", onMove);
  window.addEventListener("mouseup", endDrag);
  // the minimap moves the view to where it is clicked or dragged
  const toMinimap = (ev) => {
    const size = graphSize(ui);
    if (!size || !ui.minimapScale) return;
    const r = ui.minimap.getBoundingClientRect();
    const gx = (ev.clientX - r.left) / ui.minimapScale, gy = (ev.clientY - r.top) / ui.minimapScale;
    view.x = viewport.clientWidth / 2 - gx * view.scale;
    view.y = viewport.clientHeight / 2 - gy * view.scale;
    view.userMoved = true;
    applyTransform(ui);
  };
  let mmDown = false;
  ui.minimap.addEventListener("mousedown", (ev) => { ev.preventDefault(); ev.stopPropagation(); mmDown = true; toMinimap(ev); });
  const mmMove = (ev) => { if (mmDown) toMinimap(ev); };
  const mmUp = () => { mmDown = false; };
  window.addEventListener("mousemove", mmMove);
  window.addEventListener("mouseup", mmUp);
  return () => {
    window.removeEventListener("mousemove", onMove);
    window.removeEventListener("mouseup", endDrag);
    window.removeEventListener("mousemove", mmMove);
    window.removeEventListener("mouseup", mmUp);
  };
}

// ---- graph: hover, click, search, context menu, drag to a legend swatch ----------------------------------------------
function targetOf(ui, el) {
  // what a node, cluster or group stands for when it is given a split: {pattern | layers, refused, name}
  if (!el) return null;
  const cid = el.dataset && el.dataset.cluster ? el.dataset.cluster : el.id;
  if (el.classList.contains("node")) {
    const info = ui.model.get("nodes")[el.id];
    if (!info || !info.target) return null;
    const t = info.target;
    return { pattern: t.pattern && !(info.kind === "group") ? t.pattern : null, layers: t.layers,
      name: info.kind === "group" ? info.group : (t.pattern || info.layer), refused: info.refused || {},
      why: t.why, group: info.kind === "group" };
  }
  const c = ui.model.get("clusters")[cid];
  if (!c) return null;
  return { pattern: null, layers: c.layers, name: c.block ? `${c.block} (${c.layers.length} layers)` : c.layer,
    refused: c.refused || {} };
}

function graphEvents(ui) {
  const { model, canvas, tooltip } = ui;
  canvas.addEventListener("mouseover", (ev) => {
    if (ui.drag && ui.drag.moved) return;
    const g = ev.target.closest && ev.target.closest("g.node");
    const info = g && model.get("nodes")[g.id];
    const box = !g && ev.target.closest && ev.target.closest("g.cluster, [data-cluster]");
    const rows = info ? tooltipRows(info) : box ? boxTooltipRows(ui, box.dataset.cluster || box.id) : null;
    if (!rows) return;
    tooltip.replaceChildren(h("table", {}, rows.map(([k, v]) => h("tr", {}, h("th", {}, k), h("td", {}, v)))));
    tooltip.style.display = "block";
  });
  canvas.addEventListener("mousemove", (ev) => {
    const r = ui.graphPanel.getBoundingClientRect();
    tooltip.style.left = `${ev.clientX - r.left + 14}px`;
    tooltip.style.top = `${ev.clientY - r.top + 14}px`;
  });
  canvas.addEventListener("mouseout", (ev) => {
    const g = ev.target.closest && ev.target.closest("g.node, g.cluster, [data-cluster]");
    if (g && !g.contains(ev.relatedTarget)) tooltip.style.display = "none";
  });
  canvas.addEventListener("click", (ev) => {
    if (ui.drag && ui.drag.moved) return;
    if (ui.longPressed) { ui.longPressed = false; return; }
    hideMenu(ui);
    const g = ev.target.closest && ev.target.closest("g.node, g.cluster, [data-cluster]");
    if (!g) return;
    if (g.classList.contains("node")) {
      const info = model.get("nodes")[g.id];
      if (info && info.kind === "group") ui.send({ kind: "expand_group", group: info.group });
      else if (info && info.layer) selectLayer(ui, info.layer, true);
    } else {
      const c = model.get("clusters")[g.dataset.cluster || g.id];
      if (c && c.expandable) ui.send({ kind: "expand", block: c.block });
      else if (c && c.layer) selectLayer(ui, c.layer, true);
    }
  });
  canvas.addEventListener("contextmenu", (ev) => {
    const g = ev.target.closest && ev.target.closest("g.node, g.cluster, [data-cluster]");
    const target = targetOf(ui, g);
    if (!target) return;
    ev.preventDefault();
    ev.stopPropagation(); // JupyterLab's own context menu would open on top of this one
    showMenu(ui, target, ev.clientX, ev.clientY);
  });
  const closeMenu = (ev) => { if (!ui.menu.contains(ev.target)) hideMenu(ui); };
  const onKey = (ev) => { if (ev.key === "Escape") { hideMenu(ui); endNodeDrag(ui); } };
  document.addEventListener("mousedown", closeMenu, true);
  document.addEventListener("keydown", onKey, true);
  return () => { document.removeEventListener("mousedown", closeMenu, true); document.removeEventListener("keydown", onKey, true); };
}

function tooltipRows(info) {
  if (info.kind === "input") return [["input", info.label]];
  if (info.kind === "group") {
    const rows = [["group", info.group], ["layers", `${info.layers.length}: ${info.types}`],
      ["params", count(info.params)], ["FLOPs", count(info.flops, "FLOP")], ["split", info.splits.join(" + ")]];
    if (info.members) rows.push(["differs", info.members]);
    rows.push(["", "click to open; right-click or drag to a legend swatch to change its split"]);
    return rows;
  }
  const rows = [[info.kind === "op" ? "op" : "module", info.label], ["aten", info.op]];
  if (info.in_shapes && info.in_shapes.length) rows.push(["in", info.in_shapes.join(", ")]);
  if (info.out_shapes && info.out_shapes.length) rows.push(["out", info.out_shapes.join(", ")]);
  rows.push(["FLOPs", count(info.flops_each, "FLOP") + (info.repeats > 1 ? ` × ${info.repeats}` : "")]);
  rows.push(["memory", `activations ${bytes(info.act_bytes)}, params ${bytes(info.param_bytes)}`]);
  rows.push(["layer", `${info.layer} (stage ${info.stage})`]);
  rows.push(["split", (info.splits || [info.split]).join(" + ")]);
  if (info.members) rows.push(["members", info.members]);
  return rows;
}

// a layer's or submodule's box: its path, type, split and memory, summed over the nodes drawn inside it
function boxTooltipRows(ui, cid) {
  const clusters = ui.model.get("clusters") || {};
  let c = clusters[cid], module = null, type = c && c.type;
  if (!c) {
    c = Object.values(clusters).find((x) => x.modules && x.modules[cid]);
    if (!c) return null;
    [module, type] = c.modules[cid];
  }
  const inside = Object.values(ui.model.get("nodes") || {}).filter((n) => c.layers.includes(n.layer)
    && (!module || n.module === module || (n.module || "").startsWith(module + ".")));
  const weighted = inside.filter((n) => n.param_bytes > 0);
  const labels = Object.fromEntries((ui.model.get("legend") || []).map((l) => [l.key, l.label]));
  const splits = [...new Set((weighted.length ? weighted : inside).flatMap((n) => n.splits || [n.split]))];
  const sum = (k) => inside.reduce((a, n) => a + (n[k] || 0), 0);
  const each = c.layers.length > 1 ? ` (each of ${c.layers.length} layers)` : "";
  const stages = [...new Set(inside.map((n) => n.stage))];
  // a folded block's box stands for the same module in each of its layers: blocks.*.attn
  const shown = module && c.block ? `${c.block}.*${module.slice(c.layer.length)}` : module;
  const rows = [["module", shown || (c.block ? `${c.block} × ${c.layers.length}` : c.layer)], ["type", type || "?"],
    ["split", splits.map((k) => labels[k] || k).join(" + ") || "no parameters"],
    ["memory", `params ${bytes(sum("param_bytes"))}, activations ${bytes(sum("act_bytes"))}${each}`]];
  if (stages.length > 1 || (stages[0] || 0) > 0) rows.push(["stage", stages.join(", ")]);
  if (module) rows.push(["layer", c.block ? `${c.block} × ${c.layers.length}` : c.layer]);
  else rows.push(["", `click to ${c.expandable ? "open" : "select"}; right-click or drag to a legend swatch to change `
    + "its split"]);
  return rows;
}

function legendChoices(ui) {
  return (ui.model.get("legend") || []).filter((l) => l.strategy);
}

function showMenu(ui, target, cx, cy) {
  const r = ui.graphPanel.getBoundingClientRect();
  const items = legendChoices(ui).map((l) => {
    const why = target.why || target.refused[l.strategy];
    return h("button", { class: "ap-menu-item" + (why ? " ap-refused" : ""), role: "menuitem",
      disabled: !!why, title: why || `${target.name} → ${l.label}`, dataset: { strategy: l.strategy },
      onclick: () => { hideMenu(ui); applyTarget(ui, target, l.strategy); } },
    swatch(l), h("span", {}, l.label), why ? h("span", { class: "ap-why" }, why) : null);
  });
  items.push(h("button", { class: "ap-menu-item", role: "menuitem", dataset: { strategy: "auto" },
    onclick: () => { hideMenu(ui); applyTarget(ui, target, "auto"); } }, h("span", { class: "ap-swatch" }),
  h("span", {}, "planner's choice (un-pin)")));
  ui.menu.replaceChildren(h("div", { class: "ap-menu-title" }, target.name), ...items);
  ui.menu.style.display = "block";
  // kept inside the graph panel: opened upwards when it would run past the bottom
  const mh = ui.menu.offsetHeight;
  ui.menu.style.left = `${Math.max(0, Math.min(cx - r.left, r.width - ui.menu.offsetWidth - 4))}px`;
  ui.menu.style.top = `${Math.max(0, Math.min(cy - r.top, r.height - mh - 4))}px`;
}

function hideMenu(ui) { ui.menu.style.display = "none"; }

function applyTarget(ui, target, strategy) {
  if (target.pattern) ui.send({ kind: "shard", pattern: target.pattern, value: strategy });
  else ui.send({ kind: "shard", layers: target.layers, value: strategy });
}

// long press (touch, or a held mouse button) opens the same menu as a right click
function startLongPress(ui, ev, grab) {
  cancelLongPress(ui);
  const x = ev.clientX, y = ev.clientY;
  ui.longPress = setTimeout(() => {
    const target = targetOf(ui, grab);
    if (target && ui.drag && !ui.drag.moved) { ui.longPressed = true; ui.drag = null; showMenu(ui, target, x, y); }
  }, 600);
}
function cancelLongPress(ui) { clearTimeout(ui.longPress); }

// dragging a node or cluster: the legend swatches become drop targets, greyed with the reason when refused
function nodeDragMove(ui, ev, drag) {
  if (!drag.target) {
    drag.target = targetOf(ui, drag.grab);
    if (!drag.target) { drag.grab = null; return; }
    ui.tooltip.style.display = "none";
    for (const item of ui.legend.querySelectorAll(".ap-legend-item[data-strategy]")) {
      const why = drag.target.why || drag.target.refused[item.dataset.strategy];
      item.classList.add(why ? "ap-refused" : "ap-drop-ok");
      if (why) item.title = `refused: ${why}`;
    }
  }
  const over = document.elementFromPoint(ev.clientX, ev.clientY);
  const item = over && over.closest && over.closest(".ap-legend-item[data-strategy]");
  for (const x of ui.legend.querySelectorAll(".ap-drop-hover")) x.classList.remove("ap-drop-hover");
  let note = "drop on a legend swatch";
  if (item && ui.legend.contains(item)) {
    item.classList.add("ap-drop-hover");
    const why = drag.target.why || drag.target.refused[item.dataset.strategy];
    note = why ? `✗ ${why}` : `→ ${item.dataset.label}`;
  }
  ui.ghost.replaceChildren(h("b", {}, drag.target.name), " ", h("span", {}, note));
  ui.ghost.style.display = "block";
  ui.ghost.style.left = `${ev.clientX + 12}px`;
  ui.ghost.style.top = `${ev.clientY + 12}px`;
}

function nodeDrop(ui, ev) {
  const drag = ui.drag;
  const over = document.elementFromPoint(ev.clientX, ev.clientY);
  const item = over && over.closest && over.closest(".ap-legend-item[data-strategy]");
  if (drag.target && item && ui.legend.contains(item)) {
    const why = drag.target.why || drag.target.refused[item.dataset.strategy];
    if (!why) applyTarget(ui, drag.target, item.dataset.strategy);
  }
  endNodeDrag(ui);
}

function endNodeDrag(ui) {
  ui.ghost.style.display = "none";
  for (const item of ui.legend.querySelectorAll(".ap-legend-item")) {
    item.classList.remove("ap-refused", "ap-drop-ok", "ap-drop-hover");
    item.removeAttribute("title");
  }
}

function selectLayer(ui, path, scroll) {
  ui.model.send({ kind: "select", layer: path });
  markSelection(ui, path, scroll);
}

function markSelection(ui, path, scroll) {
  for (const tr of ui.table.querySelectorAll("tr[data-layer]")) {
    const on = tr.dataset.layer === path;
    tr.classList.toggle("ap-selected", on);
    if (on && scroll) revealRow(ui.table, tr);
  }
  for (const c of ui.lanes.querySelectorAll(".ap-chip")) c.classList.toggle("ap-selected", c.dataset.layer === path);
}

// the selected row into view inside the table's own scroll box only: scrollIntoView also scrolls every scrolling
// ancestor (the notebook), which took the graph just clicked off screen
function revealRow(wrap, tr) {
  const box = wrap.getBoundingClientRect(), row = tr.getBoundingClientRect();
  const head = wrap.querySelector("thead");
  const top = box.top + (head ? head.getBoundingClientRect().height : 0);
  if (row.top < top) wrap.scrollTop -= top - row.top;
  else if (row.bottom > box.bottom) wrap.scrollTop += row.bottom - box.bottom;
}

// highlight every match; step moves to the next (1) or previous (-1) match and brings it into view
function applySearch(ui, step) {
  const q = ui.view.search;
  const nodes = ui.model.get("nodes");
  const hits = [];
  for (const g of ui.canvas.querySelectorAll("g.node")) {
    const info = nodes[g.id] || {};
    const hay = `${g.id} ${g.textContent} ${info.label || ""} ${info.op || ""} ${info.module || ""} ${info.layer || ""} `
      + `${(info.layers || []).join(" ")}`;
    const hit = !!q && hay.toLowerCase().includes(q);
    g.classList.toggle("ap-match", hit);
    g.classList.toggle("ap-dim", !!q && !hit);
    g.classList.remove("ap-current");
    if (hit) hits.push(g);
  }
  const v = ui.view;
  const sameQuery = v.hitQuery === q;
  v.hits = hits; v.hitQuery = q;
  if (!hits.length) v.hit = -1;
  else if (step) v.hit = sameQuery && v.hit >= 0 ? (v.hit + step + hits.length) % hits.length : 0;
  else v.hit = sameQuery ? Math.min(v.hit, hits.length - 1) : -1;
  ui.searchCount.textContent = q ? (hits.length ? `${v.hit >= 0 ? v.hit + 1 : "–"} of ${hits.length}` : "no match") : "";
  if (v.hit >= 0) {
    const cur = hits[v.hit];
    cur.classList.add("ap-current");
    if (step) {
      if (v.scale < legible(ui)) { v.scale = legible(ui); applyTransform(ui); }
      const vr = ui.viewport.getBoundingClientRect(), gr = cur.getBoundingClientRect();
      v.x += vr.left + vr.width / 2 - (gr.left + gr.width / 2);
      v.y += vr.top + vr.height / 2 - (gr.top + gr.height / 2);
      v.userMoved = true;
      applyTransform(ui);
      const info = nodes[cur.id];
      if (info && info.layer) selectLayer(ui, info.layer, false);
    }
  }
}

// ---- header and messages -----------------------------------------------------------------------------------------
function renderHeader(ui) {
  const { model, send } = ui;
  const t = model.get("timings") || {};
  ui.root.dataset.kernelMs = ((t.replan_ms || 0) + (t.refresh_ms || 0)).toFixed(1); // read by the browser tests
  const timing = [t.replan_ms != null ? `re-plan ${t.replan_ms.toFixed(0)} ms` : null,
    t.layout_ms != null ? `layout ${t.layout_ms.toFixed(0)} ms` : null].filter(Boolean).join(" · ");
  const cal = model.get("calibrated") || {};
  ui.header.replaceChildren(
    h("div", { class: "ap-title" }, h("b", {}, "autopar"), " ", h("span", { class: "ap-summary" }, model.get("summary")),
      cal.text ? h("span", { class: "ap-calibrated", title: cal.title }, cal.text) : null),
    h("div", { class: "ap-header-buttons" },
      h("button", { class: "ap-btn ap-undo", disabled: !model.get("can_undo"), title: "undo (ap.undo())",
        onclick: () => send({ kind: "undo" }) }, "↶ undo"),
      h("button", { class: "ap-btn ap-redo", disabled: !model.get("can_redo"), title: "redo (ap.redo())",
        onclick: () => send({ kind: "redo" }) }, "↷ redo"),
      model.get("actions").flatMap((a) => [
        h("button", { class: `ap-btn ap-action ap-action-${a}`, title: `ap.${a}()`,
          // the inputs go with the click: their own update may still be held back by ipywidgets (see _action)
          onclick: () => send({ kind: "action", name: a, run_options: model.get("run_options") }) },
        a[0].toUpperCase() + a.slice(1)),
        a === "verify" || a === "launch" ? runInput(ui, `${a}_steps`, "steps", `steps of ap.${a}()`) : null,
        ...(a === "tournament" ? [
          runInput(ui, "tournament_k", "k", "alternatives measured beside the plan (ap.tournament(k=...))"),
          runInput(ui, "tournament_steps", "steps", "the most steps a trial runs (it stops once they are stable)"),
        ] : [])]),
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

function runPanel(ui, el, host, trait) {
  // the child widget (anywidget's host.getWidget) is rendered after the planner, in the same output
  const panel = h("div", { class: "ap-run-panel", dataset: { trait } });
  el.append(panel);
  let ctrl = null;
  const show = async () => {
    const ref = ui.model.get(trait);
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
  ui.model.on(`change:${trait}`, show);
  show();
  return () => { ui.model.off(`change:${trait}`, show); if (ctrl) ctrl.abort(); };
}

function renderMessages(ui) {
  const msgs = ui.model.get("messages") || [];
  // the answer to the last edit sits beside it (the lower sections are ~1000 px below the top), on screen
  const after = ui.origin || ui.header;
  if (after.nextElementSibling !== ui.messages) after.after(ui.messages);
  ui.messages.classList.toggle("ap-messages-near", !!ui.origin);
  if (ui.origin && msgs.length && msgs !== ui.messagesShown) {
    requestAnimationFrame(() => ui.messages.scrollIntoView({ block: "nearest" }));
  }
  ui.messagesShown = msgs;
  ui.messages.replaceChildren(...msgs.map((m) => h("div", { class: `ap-msg ap-msg-${m.level}` },
    h("div", {}, h("span", {}, m.text), m.detail ? h("pre", { class: "ap-detail" }, m.detail) : null),
    h("button", { class: "ap-msg-close", title: "dismiss", onclick: (ev) => ev.target.parentElement.remove() }, "×"))));
}

// ---- graph -------------------------------------------------------------------------------------------------------
function renderGraph(ui) {
  const { model, canvas } = ui;
  const fresh = model.get("svg") !== ui.view.svgText;
  if (fresh) loadSvg(ui);
  const changed = new Set((model.get("view") || {}).outlined === false ? [] : model.get("changed"));
  const nodes = model.get("nodes");
  for (const g of canvas.querySelectorAll("g.node")) {
    const info = nodes[g.id];
    g.classList.toggle("ap-selected-node", !!info && info.layer === model.get("selection"));
    g.classList.toggle("ap-changed-node", !!info && changed.has(info.layer));
  }
  const view = model.get("view") || {};
  ui.depth.max = model.get("max_depth");
  ui.depth.value = model.get("depth");
  ui.depthLabel.textContent = `${model.get("depth")}/${model.get("max_depth")}`
    + ((view.groups || []).length ? ` · ${view.groups.length} group${view.groups.length > 1 ? "s" : ""}` : "")
    + (view.columns > 1 ? ` · ${view.columns} columns` : "");
  ui.autoBtn.disabled = !!view.auto && !(model.get("expanded") || []).length;
  ui.blocks.replaceChildren(...foldButtons(ui));
  ui.legend.replaceChildren(...model.get("legend").map((l) => legendItem(l)),
    legendItem({ label: "communication (collective, bytes/step)" }, "ap-swatch-comm"),
    legendItem({ label: "changed (dashed dark outline, Δ)" }, "ap-swatch-changed"));
}

function loadSvg(ui) {
  const { model, canvas, view } = ui;
  canvas.innerHTML = model.get("svg");
  view.svgText = model.get("svg");
  const svg = canvas.querySelector("svg");
  if (svg) {
    // gradient ids are document-wide: make this widget's own (two planners on a page would share them)
    for (const def of svg.querySelectorAll("linearGradient[id], radialGradient[id]")) {
      const old = def.id;
      def.id = `${ui.id}_${old}`;
      for (const user of svg.querySelectorAll(`[fill="url(#${old})"]`)) user.setAttribute("fill", `url(#${def.id})`);
    }
    // cluster labels above the edges, each on a box of its cluster's fill, so an edge never runs through a label
    const NS = "http://www.w3.org/2000/svg";
    const top = svg.querySelector("g.graph") || svg;
    const layer = document.createElementNS(NS, "g");
    layer.setAttribute("class", "ap-cluster-labels");
    top.append(layer);
    const labels = [];
    const tint = paperTint(ui);
    let outer = null; // a submodule's cluster has no fill of its own: it lies on its layer's, written just before
    for (const g of svg.querySelectorAll("g.cluster")) {
      const shape = g.querySelector("path, polygon");
      let own = shape ? shape.getAttribute("fill") : null;
      if (own && own !== "none") { own = tint(own); shape.style.fill = own; outer = own; }
      const fill = own && own !== "none" ? own : outer;
      for (const t of [...g.querySelectorAll("text")]) {
        t.dataset.cluster = g.id;
        t.classList.add("ap-clabel");
        layer.append(t);
        if (fill && fill !== "none") labels.push([t, fill, g.id, shapeXs(shape)]);
      }
    }
    // each label's box from its own attributes (getBBox would force a layout of the whole notebook page): a width of
    // 0.6 em per character (Helvetica's widest digits and capitals are ~0.67 em, most letters ~0.5), ascent 0.9 em,
    // descent 0.3 em; a box a little too wide only hides more of an edge
    labels.forEach(([t, fill, id, [left, right]]) => {
      const fs = parseFloat(t.getAttribute("font-size")) || 12;
      const w = t.textContent.length * fs * 0.6, x = parseFloat(t.getAttribute("x")) || 0;
      const anchor = t.getAttribute("text-anchor");
      let x0 = anchor === "middle" ? x - w / 2 : anchor === "end" ? x - w : x;
      let x1 = x0 + w;
      x0 = Math.max(x0, left + 2); x1 = Math.min(x1, right - 2); // inside the cluster's outline
      const b = { x: x0, y: (parseFloat(t.getAttribute("y")) || 0) - 0.9 * fs, width: x1 - x0, height: 1.2 * fs };
      const bg = document.createElementNS(NS, "rect");
      for (const [k, v] of [["x", b.x - 2], ["y", b.y - 1], ["width", b.width + 4], ["height", b.height + 2], ["fill", fill]]) {
        bg.setAttribute(k, v);
      }
      bg.setAttribute("class", "ap-clabel-bg");
      bg.dataset.cluster = id;
      t.style.stroke = fill;
      layer.insertBefore(bg, t);
    });
  }
  for (const g of canvas.querySelectorAll("g.node, g.cluster")) {
    const t = g.querySelector("title");
    if (t) t.remove(); // our tooltip replaces the browser's
  }
  for (const [cid, c] of Object.entries(model.get("clusters"))) {
    const g = canvas.querySelector(`g[id="${CSS.escape(cid)}"]`);
    if (g && c.expandable) g.classList.add("ap-expandable");
    if (g && c.differs) g.classList.add("ap-differs");
  }
  for (const [nid, info] of Object.entries(model.get("nodes"))) {
    if (info.kind !== "group") continue;
    const g = canvas.querySelector(`g[id="${CSS.escape(nid)}"]`);
    if (g) g.classList.add("ap-group");
  }
  // re-fit after a re-plan unless the user moved the view; a new view (depth, groups, folds, columns) is another
  // graph, where the old pan and zoom mean nothing: it is fitted again
  const v = model.get("view") || {};
  const shape = JSON.stringify([v.depth, v.groups, v.breaks, model.get("expanded")]);
  if (shape !== view.shape) { view.userMoved = false; view.shape = shape; }
  if (!view.userMoved || !view.fitted) requestAnimationFrame(() => fitView(ui, "auto"));
  else updateMinimap(ui);
  applySearch(ui, 0);
}

// a dark notebook theme gets a dark graph: the paper is the panel's background, and each layer box's pale tint is
// mixed into it (12 %); nodes keep their light fills and dark text. Returns the function that tints a box's fill.
function paperTint(ui) {
  const { bg, dark } = panelBackground(ui);
  ui.root.classList.toggle("ap-dark", dark);
  if (!dark) return (fill) => fill;
  return (fill) => {
    const m = /^#([0-9a-f]{6})$/i.exec(fill);
    if (!m) return fill;
    const c = [0, 2, 4].map((i) => parseInt(m[1].slice(i, i + 2), 16));
    return `rgb(${c.map((x, i) => Math.round(0.12 * x + 0.88 * bg[i])).join(", ")})`;
  };
}

// the panel's background and whether it is dark; an element not yet in the page has no computed colour (light)
function panelBackground(ui) {
  const bg = (getComputedStyle(ui.root).backgroundColor.match(/[\d.]+/g) || []).map(Number);
  const dark = bg.length >= 3 && (bg.length < 4 || bg[3] > 0.5) && 0.299 * bg[0] + 0.587 * bg[1] + 0.114 * bg[2] < 110;
  return { bg, dark };
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

function swatch(l, cls = "") {
  const style = l.color2 ? `background:linear-gradient(90deg, ${l.color} 50%, ${l.color2} 50%)`
    : l.color ? `background:${l.color}` : null;
  return h("span", { class: `ap-swatch ${cls}`.trim(), style });
}

function legendItem(l, swatchClass = "") {
  return h("span", { class: "ap-legend-item", dataset: l.strategy ? { strategy: l.strategy, label: l.label } : {},
    title: l.strategy ? `drag a node or cluster here to give it this split` : null },
  swatch(l, swatchClass), l.label);
}

// ---- side panels: memory, step time, changes, alternatives, explanation ------------------------------------------
function renderSide(ui) {
  const { model } = ui;
  const measured = model.get("measured") || {};
  ui.side.replaceChildren(...[memoryPanel(model.get("memory")),
    componentsPanel(model.get("components") || {}, measured), timelinePanel(ui), timePanel(model.get("time")),
    changesPanel(ui), alternativesPanel(ui, model.get("alternatives"), model.get("levers") || []),
    explanationPanel(model.get("explanation"))].filter(Boolean));
  mountTimeline(ui);  // static/timeline.js: uPlot sizes its chart to the panel, so once the panel is in the page
  measuredMarks(ui, model.get("memory"), model.get("time"), measured);
}

// ---- measured beside predicted (autopar_nb/widget/measured.py): once a launched run of this plan measured them ----
function ratioText(r) { return r ? `×${r.toFixed(2)}` : ""; }
// coloured only where the figure is off by the rule of the run's prediction_error events (measured.py's "off"): a
// ratio alone says nothing on CPU, where RSS holds torch's first-use allocations and the speed is not calibrated
function ratioClass(r, off) { return !r || !off ? "ap-ratio" : r > 1 ? "ap-ratio ap-ratio-over" : "ap-ratio ap-ratio-under"; }
function measuredText(f, unit) {
  return h("span", { class: "ap-measured" }, "measured ", h("b", {}, unit(f.measured)), " ",
    h("span", { class: ratioClass(f.ratio, f.off) }, ratioText(f.ratio)));
}

// the memory bars and the step time get the measured figure (a dashed mark on each bar, its value and the ratio
// to the prediction it compares with); the panels themselves are drawn by memoryPanel and timePanel
function measuredMarks(ui, mem, tm, measured) {
  if (!measured.run) return;
  const run = measured.run;
  const who = `run ${run.id} (${run.status}, ${run.steps} step${run.steps === 1 ? "" : "s"}, ${run.device})`;
  const memEl = ui.side.querySelector(".ap-memory");
  if (memEl && mem && mem.bars) {
    const scale = Math.max(mem.limit, mem.peak) * 1.04;
    memEl.querySelectorAll(".ap-bar-row").forEach((row, i) => {
      const b = (measured.bars || [])[i];
      if (!b || !b.measured) return;
      const title = `measured by ${who}: ${bytes(b.measured)} on rank ${b.rank} against ${bytes(b.predicted)} `
        + `predicted (${run.basis})`;
      row.querySelector(".ap-bar").append(h("span", { class: "ap-measured-mark", title,
        style: `left:${Math.min(100, 100 * b.measured / scale).toFixed(2)}%` }));
      row.classList.add("ap-has-measured");
      // on a line of its own, naming both figures: the bar's value is the whole prediction, margin included, and
      // the measured peak compares with the predicted tensors without it (a smaller figure, which the ratio is of)
      row.append(h("span", { class: "ap-bar-measured", title }, `${measured.peak_label || "measured peak"} `,
        h("b", {}, bytes(b.measured)), " ", h("span", { class: ratioClass(b.ratio, b.off) }, ratioText(b.ratio)),
        ` of ${bytes(b.predicted)} predicted tensors (no margin), rank ${b.rank}`));
    });
    memEl.append(h("div", { class: "ap-hint ap-measured-note" }, `measured: ${who}; ${run.basis}`),
      h("div", { class: "ap-keys" }, legendItem({ label: "measured peak" }, "ap-swatch-measured")));
  }
  const timeEl = ui.side.querySelector(".ap-time");
  const t = measured.time || {};
  if (timeEl && t.measured) {
    const title = t.compared ? `median step time of ${who} against the plan's ${secs(t.predicted)}`
      : `median step time of ${who}; ${t.note}`;
    timeEl.querySelector(".ap-panel-title").append(" ", h("span", { class: "ap-time-measured", title },
      t.compared ? measuredText(t, secs) : h("span", { class: "ap-measured" }, `measured ${secs(t.measured)} (${t.note})`)));
    timeEl.append(h("div", { class: "ap-hint ap-measured-note" },
      "measured: the whole step (a launched run times its steps, not their parts)"));
  }
  const tp = measured.throughput || {};
  const stats = timeEl && timeEl.querySelector(".ap-stats");
  if (stats && tp.mfu) {  // more is better here: a ratio below 1 is the bad one
    const pctOf = (x) => `${(100 * x).toFixed(1)}%`;
    const rate = (f, unit, what = "") => h("span", { class: "ap-measured" }, `measured ${what}`,
      h("b", {}, unit(f.measured)), " ", h("span", { class: ratioClass(f.ratio && 1 / f.ratio, f.off) }, ratioText(f.ratio)));
    stats.append(h("span", { class: "ap-throughput-measured",
      title: `MFU: the plan's FLOPs per step over the measured step time of ${who}` }, rate(tp.mfu, pctOf, "MFU ")));
    if (tp.measured) {
      stats.append(h("span", { class: "ap-throughput-measured", title: `median of the steps of ${who}` },
        rate(tp, (x) => `${count(x)} ${tp.unit}`)));
    }
  }
}

// the peak rank's named memory components with where each figure comes from, and what a run measured beside them
function componentsPanel(comp, measured) {
  if (!comp.rows || !comp.rows.length) return null;
  const c = measured.components || {};
  const row = (label, value, source, f) => h("tr", {},
    h("td", {}, label), h("td", { class: "ap-num" }, bytes(value)),
    h("td", { class: "ap-num ap-comp-measured" }, f && f.measured ? [bytes(f.measured), " ",
      h("span", { class: ratioClass(f.ratio, f.off) }, ratioText(f.ratio))] : ""),
    h("td", { class: "ap-hint" }, source));
  const rows = comp.rows.map((r) => row(r.label, r.bytes, r.source, null));
  if (c.peak) {
    rows.push(row(`peak (rank ${c.rank})`, c.peak.predicted, measured.run.basis, c.peak));
    if (c.reserved) {
      rows.push(row("allocator reserve", c.reserved.predicted,
        "the whole prediction, margin included, against the caching allocator's peak reserve (its fragmentation)",
        c.reserved));
    }
    rows.push(row("between steps", c["between steps"].predicted,
      "parameters and optimizer state (what a rank keeps between steps) against the least it held at a step's end",
      c["between steps"]));
  }
  return h("details", { class: "ap-panel ap-components" },
    h("summary", {}, `Memory components (rank ${comp.rank})`),
    h("table", {}, h("tr", {}, h("th", {}, "component"), h("th", {}, "predicted"), h("th", {}, "measured"),
      h("th", {}, "source")), rows),
    measured.run ? h("div", { class: "ap-hint" }, measured.run.note) : null);
}

function memoryPanel(mem) {
  if (!mem.bars || !mem.bars.length) return null;
  const scale = Math.max(mem.limit, mem.peak) * 1.04;
  const pct = (b) => `${(100 * b / scale).toFixed(2)}%`;
  return h("div", { class: "ap-panel ap-memory" },
    h("div", { class: "ap-panel-title" }, "Memory per rank ",
      h("span", { class: mem.over ? "ap-bad" : "ap-hint" }, `peak ${bytes(mem.peak)} of ${bytes(mem.limit)}`)),
    mem.bars.map((b) => h("div", { class: "ap-bar-row" + (b.over ? " ap-over" : "") },
      h("span", { class: "ap-bar-label" }, b.label),
      h("div", { class: "ap-bar", title: mem.parts.map((p) => `${p.label}: ${bytes(b[p.key])}`).join("\n") },
        mem.parts.map((p) => h("span", { class: "ap-seg", style: `width:${pct(b[p.key])};background:${p.color}` })),
        h("span", { class: "ap-limit", style: `left:${pct(mem.limit)}`, title: `device limit ${bytes(mem.limit)}` })),
      h("span", { class: "ap-bar-value" }, bytes(b.total)))),
    h("div", { class: "ap-keys" }, mem.parts.map((p) => legendItem({ color: p.color, label: p.label })),
      legendItem({ label: "device limit" }, "ap-swatch-limit")));
}

function timePanel(tm) {
  if (!tm.parts || !tm.parts.length) return null;
  const total = tm.parts.reduce((a, p) => a + p.s, 0) || 1;
  return h("div", { class: "ap-panel ap-time" },
    h("div", { class: "ap-panel-title" }, "Step time ", h("b", {}, secs(tm.total))),
    h("div", { class: "ap-bar ap-bar-time" }, tm.parts.map((p) =>
      h("span", { class: "ap-seg", title: `${p.label}: ${secs(p.s)}`,
        style: `width:${(100 * p.s / total).toFixed(2)}%;background:${p.color}` }))),
    h("div", { class: "ap-keys" }, tm.parts.map((p) => legendItem({ color: p.color, label: `${p.label} ${secs(p.s)}` }))),
    h("div", { class: "ap-stats" },
      h("span", { title: `MFU: model FLOPs (${tm.mfu_basis}) per second over the datasheet peak` },
        "MFU ", h("b", { class: "ap-mfu" }, `${(100 * tm.mfu).toFixed(1)}%`)),
      h("span", {}, `${tm.model_tflops.toFixed(1)} TFLOP/s/GPU`),
      tm.tokens_per_s ? h("span", {}, `${count(tm.tokens_per_s)} tok/s`)
        : h("span", {}, `${count(tm.samples_per_s)} samples/s`)));
}

function changesPanel(ui) {
  const groups = ui.model.get("change_groups") || [];
  const raw = ui.model.get("changes") || [];
  if (!raw.length) return null;
  const view = ui.model.get("view") || {};
  const shown = groups.slice(0, 8);
  return h("div", { class: "ap-panel ap-changes" },
    h("div", { class: "ap-panel-title" }, "Changed against the previous plan"),
    h("ul", { class: "ap-change-groups" }, shown.map((g) => h("li", {}, g.text)),
      groups.length > shown.length ? h("li", { class: "ap-hint" }, `+ ${groups.length - shown.length} more`) : null),
    view.outlined === false ? h("div", { class: "ap-hint" }, "most layers changed: the graph outlines none") : null,
    h("details", { class: "ap-raw-changes" }, h("summary", {}, `all ${raw.length} raw change${raw.length > 1 ? "s" : ""}`),
      h("ul", {}, raw.slice(0, 500).map((c) => h("li", {}, c)))));
}

// a lever row (autopar_nb/widget/lever_rows.py): the plan with one lever flipped; taken with the fix it names
function leverRow(lv) {
  return h("tr", { class: "ap-lever" + (lv.fits ? "" : " ap-lever-nofit"), dataset: { lever: lv.lever },
    title: `${lv.label}: ${lv.trade}\n${lv.fix}` },
  h("td", {}, h("div", { class: "ap-alt-differs" }, lv.label), h("div", { class: "ap-hint ap-alt-trade" }, lv.trade)),
  h("td", { class: "ap-num" }, secs(lv.step_s), h("br"), bytes(lv.peak_bytes)),
  h("td", { class: "ap-hint ap-lever-fix" }, lv.fix));
}

function alternativesPanel(ui, alts, levers) {
  if (!alts.length && !levers.length) return null;
  return h("div", { class: "ap-panel ap-alternatives" },
    h("div", { class: "ap-panel-title" }, "Alternatives ",
      h("span", { class: "ap-hint" }, "adopt one as the current plan; nothing gets pinned")),
    h("table", {}, alts.map((a) => h("tr", { class: "ap-alt", title: a.changes.join("\n") },
      h("td", {}, h("div", { class: "ap-alt-differs" }, a.differs.join(", ")),
        h("div", { class: "ap-hint ap-alt-trade" }, a.trade),
        a.members.length > 1 ? h("div", { class: "ap-alt-members" }, `${a.members.length} variants by micro-batches: `,
          a.members.map((m) => h("button", { class: "ap-btn ap-btn-small ap-adopt-member",
            title: `${m.micro_batches} micro-batches: ${secs(m.step_s)}, ${bytes(m.peak_bytes)}; ${m.trade}; `
              + `ap.adopt(${m.index})`, onclick: () => ui.send({ kind: "adopt", index: m.index }) },
          `${m.micro_batches}`))) : null),
      h("td", { class: "ap-num" }, secs(a.step_s), h("br"), bytes(a.peak_bytes)),
      h("td", {}, h("button", { class: "ap-btn ap-adopt", title: `ap.adopt(${a.index})`,
        onclick: () => ui.send({ kind: "adopt", index: a.index }) }, "adopt"))))),
    levers.length ? h("div", { class: "ap-panel-title ap-levers-title" }, "Levers ",
      h("span", { class: "ap-hint" }, "each flipped alone on this plan")) : null,
    levers.length ? h("table", { class: "ap-levers" }, levers.map(leverRow)) : null);
}

function explanationPanel(expl) {
  if (!expl.length) return null;
  return h("details", { class: "ap-panel ap-explanation" }, h("summary", {}, "Why this plan"),
    h("ul", {}, expl.map((x) => h("li", {}, x))));
}

// ---- global choices ----------------------------------------------------------------------------------------------
// the options the planner cannot plan with the other choices are disabled and say why
function choiceSelect(cls, key, value, fixed, options, disabled, onchange) {
  const cur = fixed !== undefined ? String(fixed) : "auto";
  const refused = disabled || {};
  const short = (why) => (why.length > 64 ? `${why.slice(0, 62)}…` : why);
  const sel = h("select", { class: cls, dataset: { key }, onchange: (ev) => onchange(ev.target.value),
    title: Object.entries(refused).map(([o, why]) => `${o}: ${why}`).join("\n") || null },
  h("option", { value: "auto" }, `auto${value !== undefined && fixed === undefined ? ` (${value})` : ""}`),
  options.map((o) => {
    const why = refused[String(o)];
    return h("option", { value: String(o), disabled: !!why && String(o) !== cur, title: why || null },
      why ? `${o} — ${short(why)}` : String(o));
  }));
  sel.value = cur;
  return sel;
}

function renderControls(ui) {
  const c = ui.model.get("controls");
  const items = clusterControls(ui, c);
  for (const [key, label] of Object.entries(c.labels || {})) { // autopar_nb/widget/choices.py: CONTROL_LABELS
    const sel = choiceSelect("ap-global", key, c.values[key], c.fixed[key], c.options[key] || [],
      (c.disabled || {})[key], (v) => ui.send({ kind: "global", key, value: v }));
    items.push(h("span", { class: "ap-ctl" + (c.fixed[key] !== undefined ? " ap-pinned" : "") }, `${label} `, sel));
  }
  ui.controls.replaceChildren(...items);
}

// ---- precision editor: the plan's op lists (autopar_nb/widget/choices.py precision_state; "precision" messages) -----
function renderPrecision(ui) {
  const p = ui.model.get("precision") || {};
  const lists = p.lists || {}, reach = p.reach || {};
  const off = p.disabled || "";
  const datalist = h("datalist", { id: `${ui.id}-amp-ops` }, (p.choices || []).map((o) => h("option", { value: o })));
  const rows = Object.entries(p.labels || {}).map(([key, label]) => {
    const send = (op, action) => ui.send({ kind: "precision", list: key, op, action });
    const chips = (lists[key] || []).map((op) => {
      const n = reach[op] || 0;
      return h("span", { class: "ap-opchip" + (n ? "" : " ap-opchip-none"), dataset: { op },
        title: n ? `${n} op${n === 1 ? "" : "s"} of this model` : "no op of this model has this name" },
      op, h("span", { class: "ap-opchip-n" }, ` · ${n}`),
      h("button", { class: "ap-opchip-x", title: `remove ${op}`, "aria-label": `remove ${op}`,
        onclick: () => send(op, "remove") }, "×"));
    });
    const input = h("input", { class: "ap-op-input", type: "text", list: `${ui.id}-amp-ops`, dataset: { list: key },
      placeholder: "op name", disabled: !!off, title: off || `an op to ${label}` });
    const add = () => { if (!off) send(input.value.trim(), "add"); };
    input.addEventListener("keydown", (ev) => { if (ev.key === "Enter") { ev.preventDefault(); add(); } });
    const btn = h("button", { class: "ap-btn ap-btn-small ap-op-add", disabled: !!off, title: off || null,
      onclick: add }, "add");
    return h("div", { class: "ap-oplist", dataset: { list: key } }, h("span", { class: "ap-oplist-label" }, label),
      chips.length ? chips : h("span", { class: "ap-hint" }, "autocast's default"), input, btn);
  });
  const note = off ? [h("div", { class: "ap-hint ap-precision-off" }, off)] : [];
  ui.precision.replaceChildren(datalist, ...rows, ...note);
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

// ---- sharding board: one lane per split, one chip per layer (a folded block's run of alike layers as one) ---------
// A chip is a "unit": the layers it stands for. Selection is a set of layer paths.
function boardUnits(ui) {
  const b = ui.model.get("board") || {};
  const units = [];
  for (const c of b.chips || []) {
    const prev = units[units.length - 1];
    const joins = prev && c.block && !ui.board.open.has(c.block) && prev.block === c.block && prev.lane === c.lane
      && prev.recompute === c.recompute && prev.pinned === c.pinned && prev.sp === c.sp;
    if (joins) {
      prev.paths.push(c.path); prev.changed = prev.changed || c.changed; prev.kinds.add(c.kind);
    } else {
      units.push({ ...c, paths: [c.path], kinds: new Set([c.kind]) });
    }
  }
  for (const u of units) {
    const n = u.paths.length;
    u.key = u.paths[0];
    u.label = n === 1 ? u.paths[0] : `${u.paths[0]}–${u.paths[n - 1].split(".").pop()}`;
    u.count = n;
  }
  return units;
}

function refusalsFor(ui, kinds, lane) {
  const refused = (ui.model.get("board") || {}).refused || {};
  const why = [];
  for (const k of kinds) if (refused[k] && refused[k][lane]) why.push(refused[k][lane]);
  return [...new Set(why)];
}

function selectedUnits(ui) {
  return ui.board.units.filter((u) => u.paths.some((p) => ui.board.selected.has(p)));
}

function renderBoard(ui) {
  const b = ui.model.get("board") || {};
  if (!b.lanes) { ui.boardEl.replaceChildren(); return; }
  const units = boardUnits(ui);
  ui.board.units = units;
  const known = new Set(units.flatMap((u) => u.paths));
  for (const p of [...ui.board.selected]) if (!known.has(p)) ui.board.selected.delete(p);
  const lane = (value, label, hint, python, cls, list) => h("div", {
    class: `ap-slane ${cls}`, dataset: { lane: value }, title: python ? `${hint}\nap.override(layers, ${python})` : hint,
  }, h("div", { class: "ap-slane-head" }, h("span", { class: "ap-slane-label" }, label),
    h("span", { class: "ap-slane-hint" }, hint), h("span", { class: "ap-slane-why" })),
  h("div", { class: "ap-slane-chips" }, list.map((u) => chipUnit(ui, u))));
  const lanes = b.lanes.map((l) => lane(l.value, l.label, l.hint, l.python, "ap-slane-split",
    units.filter((u) => u.lane === l.value)));
  const stray = units.filter((u) => !b.lanes.some((l) => l.value === u.lane));
  if (stray.length) lanes.push(lane("other", "other", "splits without a lane", "", "ap-slane-other", stray));
  const auto = h("div", { class: "ap-slane ap-slane-auto", dataset: { lane: "auto" },
    title: "drop here to un-pin: the planner chooses the split again" },
  h("div", { class: "ap-slane-head" }, h("span", { class: "ap-slane-label" }, "↺ planner's choice"),
    h("span", { class: "ap-slane-hint" }, "un-pin the split")));
  const rec = h("div", { class: "ap-rlanes" }, h("span", { class: "ap-rlanes-label" }, "recompute"),
    [{ value: "auto", label: "↺ auto" }, ...b.recompute].map((r) => h("div", { class: "ap-rlane", dataset: { recompute: r.value },
      title: r.value === "auto" ? "drop here to let the planner choose recompute" : `drop here: ap.override(layers, recompute='${r.value}')` },
    r.label, h("span", { class: "ap-slane-why" }))));
  ui.boardEl.replaceChildren(...[h("div", { class: "ap-slanes" }, lanes, auto), rec,
    b.hidden ? h("div", { class: "ap-hint" }, `${b.hidden} layer${b.hidden > 1 ? "s" : ""} without parameters not shown`) : null,
    h("div", { class: "ap-band", style: "display:none" })].filter(Boolean));
  markBoard(ui);
}

function chipUnit(ui, u) {
  const blockRun = u.block && u.count > 1;
  const openFirst = u.block && ui.board.open.has(u.block) && (ui.model.get("board").blocks[u.block] || [])[0] === u.paths[0];
  return h("span", {
    class: "ap-schip" + (u.changed ? " ap-changed" : "") + (u.pinned ? " ap-pinned" : ""),
    draggable: "true", tabindex: "0", role: "option", dataset: { paths: u.paths.join(","), key: u.key },
    title: `${u.paths.length > 1 ? `${u.count} × ` : ""}${u.type}, ${u.params} params${u.count > 1 ? " each" : ""}`
      + `; stage ${u.stage}; recompute ${u.recompute}${u.pinned ? "; split pinned" : ""}`,
  }, u.pinned ? h("span", { class: "ap-pin", title: "split pinned" }, `${PIN} `) : null, u.label,
  u.count > 1 ? h("span", { class: "ap-count" }, ` ×${u.count}`) : null,
  u.sp && u.lane !== "sequence_parallel" ? h("span", { class: "ap-badge", title: "sequence parallel" }, "+SP") : null,
  u.recompute !== "none" ? h("span", { class: "ap-badge ap-badge-rec", title: `recompute ${u.recompute}` },
    `↻ ${u.recompute === "selective" ? "sel" : u.recompute}`) : null,
  blockRun ? h("button", { class: "ap-split-apart", title: `split ${u.block} apart: one chip per layer`,
    dataset: { block: u.block }, tabindex: "-1" }, "⋯") : null,
  openFirst ? h("button", { class: "ap-fold-chips", title: `fold ${u.block} back into runs of alike layers`,
    dataset: { block: u.block }, tabindex: "-1" }, "⤡") : null);
}

// selection, drag targets and keyboard targets drawn on the board
function markBoard(ui) {
  const st = ui.board;
  for (const el of ui.boardEl.querySelectorAll(".ap-schip")) {
    const paths = el.dataset.paths.split(",");
    el.classList.toggle("ap-selected", paths.every((p) => st.selected.has(p)));
    el.setAttribute("aria-selected", paths.every((p) => st.selected.has(p)) ? "true" : "false");
  }
  const moving = st.dragging || (st.target ? (selectedUnits(ui).length ? selectedUnits(ui)
    : ui.board.units.filter((u) => u.key === st.focus)) : null);
  for (const el of ui.boardEl.querySelectorAll(".ap-slane[data-lane], .ap-rlane")) {
    const why = el.querySelector(".ap-slane-why");
    el.classList.remove("ap-refused", "ap-drop-ok", "ap-kbd-target");
    if (why) why.textContent = "";
    if (!moving) continue;
    let reasons = [];
    if (el.dataset.lane && el.dataset.lane !== "auto") reasons = refusalsFor(ui, new Set(moving.flatMap((u) => [...u.kinds])), el.dataset.lane);
    el.classList.add(reasons.length ? "ap-refused" : "ap-drop-ok");
    if (reasons.length && why) why.textContent = `✗ ${reasons.join("; ")}`;
    el.title = reasons.length ? `refused: ${reasons.join("; ")}` : el.title.replace(/^refused: .*$/m, "");
    if (st.target && targetKey(el) === st.target) el.classList.add("ap-kbd-target");
  }
}

const targetKey = (el) => (el.dataset.lane ? `lane:${el.dataset.lane}` : `rec:${el.dataset.recompute}`);

function boardTargets(ui) {
  return [...ui.boardEl.querySelectorAll(".ap-slane[data-lane], .ap-rlane")].filter((el) => el.dataset.lane !== "other");
}

// one drop = one message = one re-plan = one undo step
function applyToTarget(ui, units, el) {
  const paths = units.flatMap((u) => u.paths);
  if (!paths.length || !el) return false;
  if (el.dataset.recompute) {
    ui.send({ kind: "recompute", layers: paths, value: el.dataset.recompute });
    return true;
  }
  const lane = el.dataset.lane;
  if (lane !== "auto" && refusalsFor(ui, new Set(units.flatMap((u) => [...u.kinds])), lane).length) return false;
  if (lane !== "auto" && units.every((u) => u.lane === lane && u.pinned)) return false;
  ui.send({ kind: "shard", layers: paths, value: lane });
  return true;
}

function boardEvents(ui) {
  const el = ui.boardEl, st = ui.board;
  const unitOf = (chip) => ui.board.units.find((u) => u.key === chip.dataset.key);
  const status = (text) => { ui.boardStatus.textContent = text; ui.boardStatus.classList.remove("ap-board-refused"); };
  el.addEventListener("click", (ev) => {
    const btn = ev.target.closest("button.ap-split-apart, button.ap-fold-chips");
    if (btn) {
      if (btn.classList.contains("ap-split-apart")) st.open.add(btn.dataset.block);
      else st.open.delete(btn.dataset.block);
      renderBoard(ui);
      return;
    }
    const chip = ev.target.closest(".ap-schip");
    if (!chip || st.banded) { st.banded = false; return; }
    const u = unitOf(chip);
    if (!u) return;
    if (ev.shiftKey && st.anchor) {
      const keys = ui.board.units.map((x) => x.key);
      const [a, b] = [keys.indexOf(st.anchor), keys.indexOf(u.key)].sort((x, y) => x - y);
      if (!(ev.ctrlKey || ev.metaKey)) st.selected.clear();
      for (const x of ui.board.units.slice(a, b + 1)) x.paths.forEach((p) => st.selected.add(p));
    } else if (ev.ctrlKey || ev.metaKey) {
      const on = u.paths.every((p) => st.selected.has(p));
      u.paths.forEach((p) => (on ? st.selected.delete(p) : st.selected.add(p)));
      st.anchor = u.key;
    } else {
      st.selected.clear();
      u.paths.forEach((p) => st.selected.add(p));
      st.anchor = u.key;
    }
    st.focus = u.key;
    markBoard(ui);
    status(`${st.selected.size} layer${st.selected.size === 1 ? "" : "s"} selected`);
  });
  el.addEventListener("dragstart", (ev) => {
    const chip = ev.target.closest && ev.target.closest(".ap-schip");
    if (!chip) return;
    const u = unitOf(chip);
    if (!u.paths.every((p) => st.selected.has(p))) {
      st.selected.clear(); u.paths.forEach((p) => st.selected.add(p)); st.anchor = u.key;
    }
    st.dragging = selectedUnits(ui);
    ev.dataTransfer.setData("text/plain", `shard:${[...st.selected].join(",")}`);
    ev.dataTransfer.effectAllowed = "move";
    markBoard(ui);
  });
  // a refused lane takes no drop (the browser shows the no-drop cursor): the status line says why, and says it
  // again when the layers are let go there
  const laneName = (t) => (t.dataset.lane ? (t.querySelector(".ap-slane-label") || t).textContent
    : `recompute ${t.dataset.recompute}`);
  const refusal = (t) => ((t.querySelector(".ap-slane-why") || {}).textContent || t.title.replace(/^refused: /, ""))
    .replace(/^✗ /, "");
  el.addEventListener("dragend", () => {
    const t = st.refusedOver;
    st.dragging = null; st.refusedOver = null;
    markBoard(ui);
    if (t) {
      status(`✗ not moved: ${laneName(t)} refuses ${st.selected.size === 1 ? "this layer" : "these layers"}: ${refusal(t)}`);
      ui.boardStatus.classList.add("ap-board-refused");
    }
  });
  el.addEventListener("dragover", (ev) => {
    const t = ev.target.closest && ev.target.closest(".ap-slane[data-lane], .ap-rlane");
    for (const x of el.querySelectorAll(".ap-drop")) if (x !== t) x.classList.remove("ap-drop");
    const refused = !!(t && st.dragging && t.classList.contains("ap-refused"));
    if (refused && st.refusedOver !== t) status(`✗ ${laneName(t)}: refused: ${refusal(t)}`);
    else if (!refused && st.refusedOver) status("");
    st.refusedOver = refused ? t : null;
    ui.boardStatus.classList.toggle("ap-board-refused", refused);
    if (!t || !st.dragging || refused) return; // no preventDefault: the drop is refused
    ev.preventDefault();
    ev.dataTransfer.dropEffect = "move";
    t.classList.add("ap-drop");
  });
  el.addEventListener("dragleave", (ev) => {
    const t = ev.target.closest && ev.target.closest(".ap-slane[data-lane], .ap-rlane");
    if (t && !t.contains(ev.relatedTarget)) t.classList.remove("ap-drop");
  });
  el.addEventListener("drop", (ev) => {
    const t = ev.target.closest && ev.target.closest(".ap-slane[data-lane], .ap-rlane");
    if (!t || !st.dragging) return;
    ev.preventDefault();
    t.classList.remove("ap-drop");
    const units = st.dragging;
    st.dragging = null;
    applyToTarget(ui, units, t);
    markBoard(ui);
  });
  // rubber band: drag on the board's background selects the chips it touches
  el.addEventListener("mousedown", (ev) => {
    if (ev.button !== 0 || ev.target.closest(".ap-schip, button")) return;
    const r = el.getBoundingClientRect();
    st.band = { x: ev.clientX, y: ev.clientY, add: ev.shiftKey || ev.ctrlKey || ev.metaKey,
      base: new Set(st.selected), r };
    ev.preventDefault();
  });
  const onMove = (ev) => {
    const b = st.band;
    if (!b) return;
    const x0 = Math.min(b.x, ev.clientX), x1 = Math.max(b.x, ev.clientX);
    const y0 = Math.min(b.y, ev.clientY), y1 = Math.max(b.y, ev.clientY);
    if (x1 - x0 + y1 - y0 < 6) return;
    st.banded = true;
    const band = el.querySelector(".ap-band");
    const r = el.getBoundingClientRect();
    Object.assign(band.style, { display: "block", left: `${x0 - r.left}px`, top: `${y0 - r.top}px`,
      width: `${x1 - x0}px`, height: `${y1 - y0}px` });
    st.selected = new Set(b.add ? b.base : []);
    for (const chip of el.querySelectorAll(".ap-schip")) {
      const c = chip.getBoundingClientRect();
      if (c.right >= x0 && c.left <= x1 && c.bottom >= y0 && c.top <= y1) {
        chip.dataset.paths.split(",").forEach((p) => st.selected.add(p));
      }
    }
    markBoard(ui);
  };
  const onUp = () => {
    if (!st.band) return;
    st.band = null;
    const band = el.querySelector(".ap-band");
    if (band) band.style.display = "none";
    if (st.banded) status(`${st.selected.size} layer${st.selected.size === 1 ? "" : "s"} selected`);
    setTimeout(() => { st.banded = false; }, 0);
  };
  window.addEventListener("mousemove", onMove);
  window.addEventListener("mouseup", onUp);
  // keyboard: ←/→ move between chips, space selects, ↑/↓ choose a lane, Enter applies, Escape cancels
  el.addEventListener("keydown", (ev) => {
    const chip = ev.target.closest && ev.target.closest(".ap-schip");
    if (!chip) return;
    const chips = [...el.querySelectorAll(".ap-schip")];
    const i = chips.indexOf(chip);
    const u = unitOf(chip);
    st.focus = u.key;
    if (ev.key === "ArrowRight" || ev.key === "ArrowLeft") {
      const next = chips[Math.max(0, Math.min(chips.length - 1, i + (ev.key === "ArrowRight" ? 1 : -1)))];
      if (ev.shiftKey) { unitOf(next).paths.forEach((p) => st.selected.add(p)); u.paths.forEach((p) => st.selected.add(p)); }
      next.focus();
      st.focus = next.dataset.key;
      markBoard(ui);
    } else if (ev.key === " ") {
      const on = u.paths.every((p) => st.selected.has(p));
      u.paths.forEach((p) => (on ? st.selected.delete(p) : st.selected.add(p)));
      st.anchor = u.key;
      markBoard(ui);
      status(`${st.selected.size} layer${st.selected.size === 1 ? "" : "s"} selected`);
    } else if (ev.key === "ArrowDown" || ev.key === "ArrowUp") {
      const targets = boardTargets(ui);
      let k = targets.findIndex((t) => targetKey(t) === st.target);
      if (k < 0) k = targets.findIndex((t) => t.contains(chip)) ;
      k = (k + (ev.key === "ArrowDown" ? 1 : -1) + targets.length) % targets.length;
      st.target = targetKey(targets[k]);
      markBoard(ui);
      const t = targets[k];
      const n = (selectedUnits(ui).length ? selectedUnits(ui) : [u]).reduce((a, x) => a + x.paths.length, 0);
      const why = t.querySelector(".ap-slane-why");
      status(`${n} layer${n === 1 ? "" : "s"} → ${t.querySelector(".ap-slane-label, .ap-rlane") ? (t.dataset.lane
        ? t.querySelector(".ap-slane-label").textContent : `recompute ${t.dataset.recompute}`) : ""}: `
        + (t.classList.contains("ap-refused") ? `refused (${why ? why.textContent : ""})` : "press Enter to apply"));
    } else if (ev.key === "Enter" && st.target) {
      const units = selectedUnits(ui).length ? selectedUnits(ui) : [u];
      const t = boardTargets(ui).find((x) => targetKey(x) === st.target);
      if (t && t.classList.contains("ap-refused")) { status("refused: " + (t.querySelector(".ap-slane-why") || {}).textContent); return; }
      st.target = null;
      if (applyToTarget(ui, units, t)) status("applied: re-planning…");
      markBoard(ui);
    } else if (ev.key === "Escape") {
      st.target = null; st.selected.clear(); markBoard(ui); status("");
    } else {
      return;
    }
    ev.preventDefault();
  });
  // after a re-render the chip that had the keyboard focus gets it back
  el.addEventListener("focusin", (ev) => { st.hasFocus = !!(ev.target.closest && ev.target.closest(".ap-schip")); });
  el.addEventListener("focusout", (ev) => { if (!el.contains(ev.relatedTarget)) st.hasFocus = false; });
  const refocus = () => {
    if (!st.hasFocus || !st.focus || el.contains(document.activeElement)) return;
    const chip = [...el.querySelectorAll(".ap-schip")].find((c) => c.dataset.paths.split(",").includes(st.focus));
    if (chip) chip.focus({ preventScroll: true });
  };
  ui.model.on("change:revision", refocus);
  return () => {
    window.removeEventListener("mousemove", onMove);
    window.removeEventListener("mouseup", onUp);
    ui.model.off("change:revision", refocus);
  };
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
    class: "ap-lane", dataset: { stage: lane.index, rank: lane.rank ?? lane.index },
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
  }, h("span", { class: "ap-lane-label", title: lane.chunk !== undefined ? `pipeline rank ${lane.rank} runs this stage`
    + ` as its model chunk ${lane.chunk}` : null }, lane.label || `stage ${lane.index}`), handle,
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
