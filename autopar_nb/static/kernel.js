// Whether the kernel behind a widget is gone: one implementation for every front end (launch/dashboard.py's SHARED_JS
// puts this file in front of each).
// When the kernel dies or restarts, JupyterLab's widget manager sets the model's comm_live to false, which the model
// announces with "comm_live_update" (the only change of it after a view is made: a model starts live), while every
// control still looked alive and sent into nothing. A front end that marks the view's element instead (the class
// jupyter-widgets-disconnected) is followed too. `onGone` is called once; the returned function stops the watch.
function watchKernel(model, el, onGone) {
  let gone = false;
  const once = () => { if (!gone) { gone = true; onGone(); } };
  const check = () => { if (el.classList.contains("jupyter-widgets-disconnected")) once(); };
  const mo = new MutationObserver(check);
  mo.observe(el, { attributes: true, attributeFilter: ["class"] });
  model.on("comm_live_update", once);
  check();
  return () => { mo.disconnect(); model.off("comm_live_update", once); };
}
