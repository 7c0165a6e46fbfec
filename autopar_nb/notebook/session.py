"""Session: what ``%%autoparallel`` binds in the user's namespace (``ap`` by default).

It holds the captured graph, the cluster, the cell's source and the user's constraints, and offers
the same operations as the widget as plain Python calls.
"""

from __future__ import annotations

import copy
import dataclasses
import html
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..graph import ModelGraph, human
from ..hardware import Cluster
from ..plan import Plan, PlanError, normalize_fix
from ..source import ModelSource
from .scaling import scaled_plan

MODES = ("auto", "semi", "manual")


@dataclass
class Session:
    """One model cell: ``graph`` (the captured ModelGraph), ``cluster``, ``source`` (the cell code
    and names) and the planning constraints. ``plan`` is the current Plan once a planner has run."""

    graph: ModelGraph
    cluster: Cluster
    source: ModelSource
    global_batch: int | None = None
    """samples per optimizer step (--batch; rows where a dataset's collate_fn makes several of each
    sample: what the model trains on); None = the example inputs' batch size"""
    per_rank_batch: int | None = None
    """samples each data-parallel rank trains on whatever dp (the cell's ``make_batch``): it wins
    over ``global_batch``, and each plan's global batch is this x its dp"""
    mode: str = "auto"
    """auto: the planner chooses everything; semi: it honours pinned choices (--fix, override());
    manual: --fix must give the whole mesh and the planner only costs it"""
    fix: dict[str, Any] = field(default_factory=dict)
    """pinned global choices, e.g. {"tp": 2, "zero_stage": 3}"""
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    """layer-path glob -> pinned per-layer choices, e.g. {"h.*.mlp": {"tp": "colwise-rowwise"}}"""
    steps: int | None = None
    """the run's length in steps (--steps, ``replan(steps=...)``, the latest ``launch``'s): the plan
    weighs torch.compile's start-up over them; None: the planner's default, torchtitan's 10,000"""
    plan: Plan | None = None
    _undo: list[tuple] = field(default_factory=list, repr=False)
    _redo: list[tuple] = field(default_factory=list, repr=False)
    _observers: list = field(default_factory=list, repr=False, compare=False)
    """callables ``fn(session)`` run after every replan/undo/redo (the widget registers one)"""
    _widget: Any = field(default=None, repr=False, compare=False)
    measured_timelines: tuple | None = field(default=None, repr=False, compare=False)
    """(the plan measured, {pipeline rank: its MemoryTimeline with the measured curve}) after
    ``memory_timeline(measure=True)``: what the widget draws beside that plan's predicted
    timeline"""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} unknown; choose one of {', '.join(MODES)}")

    # ---- planning --------------------------------------------------------------------------------
    def replan(self, fix: dict[str, Any] | None = None,
               overrides: dict[str, dict[str, Any]] | None = None, *,
               cluster: Cluster | None = None, top_k: int = 5, steps: int | None = None) -> Plan:
        """Plan again with new constraints, a new cluster or a new run length in ``steps`` (None
        keeps the current ones); return the new plan.

        Atomic: if the planner rejects the constraints (PlanError saying which one fails and by how
        much memory), the session keeps its previous constraints and plan. The previous state can be
        restored with undo().
        """
        fix = normalize_fix(self.fix if fix is None else fix)
        steps = self.steps if steps is None else steps
        overrides = copy.deepcopy(self.overrides if overrides is None else overrides)
        missing = [k for k in ("dp", "tp", "pp") if k not in fix]
        if self.mode == "manual" and missing:
            raise PlanError("manual mode needs the whole mesh pinned: add "
                            f"{', '.join(f'{k}=N' for k in missing)} to --fix (dp * tp * pp = "
                            f"{self.cluster.world_size} GPUs), or use --mode auto")
        cluster = cluster or self.cluster
        new = self._planned(fix, overrides, cluster, top_k=top_k, steps=steps)
        self._remember()
        self.fix, self.overrides, self.cluster, self.plan = fix, overrides, cluster, new
        self.steps = steps
        self._notify()
        return new

    def _planned(self, fix: dict[str, Any], overrides: dict[str, dict[str, Any]], cluster: Cluster,
                 *, top_k: int = 5, steps: int | None = None) -> Plan:
        """The planner's plan for this session's model and batch under these constraints; the
        session unchanged."""
        from ..planner import remembered_plan as make_plan

        return make_plan(self.graph, cluster, global_batch=self.batch,
                         per_rank_batch=self.per_rank_batch, seq_len=self.graph.seq_len, fix=fix,
                         overrides=overrides, top_k=top_k,
                         default_loss=self.source.loss_fn_var is None, steps=steps)

    def override(self, pattern: str, **choices: Any) -> Plan:
        """Pin per-layer choices for every layer or module matching the glob ``pattern`` and re-plan
        (the seed's semi-auto mode). Choices: ``tp`` ("colwise", "rowwise", "colwise-rowwise",
        "vocab", "sequence_parallel", "replicate"), ``stage`` (pipeline stage), ``recompute``
        ("none", "selective", "full"), ``fsdp`` (bool). ``choices`` given as None un-pin those
        fields.

        >>> ap.override("h.*.mlp", tp="colwise-rowwise")
        >>> ap.override("h.10", stage=2)
        """
        overrides = copy.deepcopy(self.overrides)
        # the entry moves last: the planner reads overrides in order, so the latest call wins where
        # globs overlap
        entry = {**overrides.pop(pattern, {}), **choices}
        entry = {k: v for k, v in entry.items() if v is not None}
        if entry:
            overrides[pattern] = entry
        return self.replan(overrides=overrides)

    def adopt(self, alternative: int | Plan) -> Plan:
        """Make one of ``plan.alternatives`` (its index, or the Plan) the current plan as it is,
        pinning nothing: the constraints stay those the user set, so the next edit re-plans from
        them. The plan it replaces joins the alternatives; one undo() goes back.

        >>> ap.adopt(0)   # the next best plan, e.g. more micro-batches for less memory
        """
        if self.plan is None:
            raise PlanError("there is no plan yet: run ap.replan() first")
        alts = list(self.plan.alternatives)
        if isinstance(alternative, int):
            if not 0 <= alternative < len(alts):
                raise IndexError(f"alternative {alternative} does not exist: the plan has "
                                 f"{len(alts)} alternative(s) (0..{len(alts) - 1})")
            chosen = alts[alternative]
        else:
            chosen = next((a for a in alts if a is alternative), None)
            if chosen is None:
                raise PlanError("adopt() takes one of ap.plan.alternatives (or its index)")
        previous = copy.copy(self.plan)
        previous.alternatives = []
        new = copy.copy(chosen)
        new.alternatives = sorted([previous, *(a for a in alts if a is not chosen)],
                                  key=lambda p: p.cost.step_time_s if p.cost else 0.0)
        new.explanation = [f"Adopted an alternative: {chosen.summary()}. The planner's choice "
                           f"({previous.summary()}) is now among the alternatives. Nothing is "
                           "pinned: the next edit re-plans from the same constraints."]
        self._remember()
        self.plan = new
        self._notify()
        return new

    def _remember(self) -> None:
        """Push the state in force onto the undo stack before it changes (a new edit drops what redo
        held).

        The state before the first plan is not pushed: undo must never take the session back to no
        plan (the widget would go blank and Export re-plan behind the user's back), so a fresh plan
        has nothing to undo."""
        if self.plan is not None:
            self._undo.append(self._state())
        self._redo.clear()

    def undo(self) -> Plan | None:
        """Go back to the constraints and plan before the last replan/override; returns the restored
        plan. The first plan cannot be undone (IndexError "nothing to undo"): there is no plan
        before it."""
        if not self._undo:
            raise IndexError("nothing to undo")
        self._redo.append(self._state())
        self.fix, self.overrides, self.cluster, self.plan, self.steps = self._undo.pop()
        self._notify()
        return self.plan

    def redo(self) -> Plan | None:
        """Re-apply what undo() took back."""
        if not self._redo:
            raise IndexError("nothing to redo")
        self._undo.append(self._state())
        self.fix, self.overrides, self.cluster, self.plan, self.steps = self._redo.pop()
        self._notify()
        return self.plan

    # ---- running the plan ------------------------------------------------------------------------
    def current_plan(self) -> Plan:
        """The session's plan, planning first if there is none yet."""
        return self.plan if self.plan is not None else self.replan()

    def plan_for(self, nproc: int | None) -> Plan:
        """The current plan at ``nproc`` processes: the same TP/PP layout with fewer (or more)
        data-parallel replicas, so a plan made for 64 GPUs can be checked on 2 local processes. The
        scaled plan's cost is the cost model's for ``nproc`` devices of the session's kind (a run of
        it still has a prediction to compare with), its ``cluster["scaled_from"]`` the world size
        planned, and its explanation one line saying all this. Raises PlanError when ``nproc``
        cannot hold one copy of the model-parallel layout."""
        return scaled_plan(self.current_plan(), nproc, graph=self.graph, cluster=self.cluster)

    def verify(self, steps: int = 5, nproc: int | None = None, *, warm: bool = True, **kwargs: Any):
        """Run the plan for real on ``nproc`` local processes (gloo on CPU, NCCL on GPUs) and a
        single-process reference with the same seed and data; returns a VerifyReport with, per step,
        the loss difference and the max gradient/parameter difference (did parallelism change my
        model?). The plan is checked as it is: ``steps`` is how long the check runs, not the run the
        plan is for (``launch`` re-plans for its steps).

        ``nproc`` defaults to the plan's world size; a smaller count keeps the TP/PP layout and
        fewer data-parallel replicas (see plan_for). The model is built for real in every process:
        use a small config of your model. ``warm`` (default): in the warm pool, whose processes have
        torch imported (the first call starts it; later ones take about a second less per process
        start); False: fresh processes. ``weights``: a checkpoint folder the model (built from a
        config in the cell) starts from (see export).
        """
        from ..verify import verify

        return verify(self.source, self.plan_for(nproc), steps=steps, nproc=nproc, warm=warm,
                      **kwargs)

    def export(self, path: str = "train.py", *, nproc: int | None = None, **kwargs: Any):
        """Write the plan as a standalone torchrun script at ``path``, its runtime module and the
        plan JSON beside it (``single_file=True``: the script alone, the runtime inside), and print
        the torchrun commands for one node and several. The script needs torch only, not autopar_nb.
        ``weights="DIR"``: a cell that builds its model from a config starts from the weights in DIR
        (safetensors, as ``save_pretrained`` writes them), read as a ``from_pretrained`` cell's are.
        The script's ``--steps`` defaults to the run planned (``steps``, when the session has one;
        else 100)."""
        from ..export import export

        if self.steps is not None:
            kwargs.setdefault("steps", self.steps)
        return export(self.source, self.plan_for(nproc), path, **kwargs)

    def launch(self, nproc: int | None = None, steps: int = 50, *, warm: bool = True,
               replan: str = "ask", **script_flags: Any):
        """Export the plan to a run directory and run that script on ``nproc`` local processes with
        torch's elastic launcher. Returns a Run at once (the kernel stays free): ``run.wait()``,
        ``run.stop()``, ``run.metrics``, ``run.logs(rank)``; displayed, it is a live dashboard.
        ``script_flags`` go to the script (``ckpt_dir="ckpt", ckpt_every=10`` -> ``--ckpt-dir ckpt
        --ckpt-every 10``). ``warm`` (default): through the warm pool, ranks forked with torch and
        the cell's imports loaded, running the same script (see ``autopar_nb.launch.launch``);
        False: a fresh interpreter per rank, as torchrun starts them by default.

        ``replan``: when a rank runs out of memory or nears its limit (``run.events``), "ask"
        (default) proposes a new plan (the dashboard's "Re-plan & resume", or ``run.replan()``),
        "auto" re-plans and resumes at once, "off" only reports. Re-planning stops the run,
        calibrates the memory the ranks held beyond the prediction, plans again with this session's
        pins kept (``ap.plan`` becomes the new plan; ``ap.undo()`` goes back) and resumes from the
        last checkpoint in ``ckpt_dir`` (from step 0 without one). ``weights="DIR"``: start from the
        weights in DIR (see export).

        ``steps`` reach the plan: where it weighed compile's start-up over another run length, it is
        planned again for ``steps`` first (said in one line where a choice changes; one undo() goes
        back)."""
        from ..export import export, with_weights
        from ..launch import launch
        from ..launch.replan import Replanner, check_mode

        check_mode(replan)
        self.plan_steps(steps)
        plan = self.plan_for(nproc)
        # scaled: said here in one line, and on the dashboard (its comparison notes)
        if plan is not self.plan:
            print(plan.explanation[0])
        source = with_weights(self.source, script_flags.pop("weights", None))
        run_flags = {
            k: script_flags.pop(k)
            for k in ("max_restarts", "hang_timeout_s", "run_dir", "backend", "monitor", "env",
                      "memory_threshold") if k in script_flags
        }

        def start(p: Plan, run_dir=None):
            flags = {**run_flags, **({"run_dir": run_dir} if run_dir is not None else {})}
            return launch(lambda path: export(source, p, path, quiet=True), p.mesh.world_size,
                          steps, plan=p, warm=warm, **flags, **script_flags)

        run = start(plan)
        # the planner widget shows what it measures beside the plan's figures
        if self._widget is not None:
            self._widget.follow(run)
        if replan != "off":
            Replanner(
                replan, cluster=self.cluster, ckpt_dir=script_flags.get("ckpt_dir"),
                launch_fn=start, plan_fn=lambda calib, target, pins: self.replan_for_memory(
                    calib, target, pins, nproc)).attach(run)
        return run

    def plan_steps(self, steps: int | None, *, say: Callable[[str], Any] = print) -> Plan:
        """The plan, weighing compile's start-up over ``steps`` (its compile lever says over how
        many it weighed; a plan without one, an adopted alternative or one with nothing to compile,
        is kept): planned again where they differ, as an edit where a choice changes (one line,
        passed to ``say``, says which; one undo() goes back), else in place. ``self.steps`` becomes
        ``steps``."""
        plan = self.current_plan()
        weighed = next((lv.steps for lv in plan.levers if lv.name == "compile"), None)
        if steps is None or weighed is None or weighed == steps:
            return plan
        new = self._planned(self.fix, self.overrides, self.cluster, steps=steps)
        if plan.diff(new):
            self._remember()
            self.plan = new
            say(f"Re-planned for the {steps:,} steps launched (the plan weighed compile's start-up "
                "over "
                  f"{weighed:,} steps): {plan.summary()} -> {new.summary()}; ap.undo() goes back.")
        # the same choices: the plan stays the object a run or the undo stack may hold, its words
        # re-weighed
        else:
            plan.explanation, plan.levers = new.explanation, new.levers
        self.steps = steps
        self._notify()
        return self.plan

    def tournament(self, k: int = 4, steps: int = 20, **kwargs: Any):
        """Run the plan and its ``k`` best alternatives for a few steps each on local processes,
        measure them, calibrate the cost model from all of them and report predicted vs measured
        order (Kendall's tau) and the winner; ``.adopt()`` on the result makes the winner this
        session's plan. The plans are measured as they are: a trial's ``steps`` time steady steps,
        its first ones (compile's among them) left out. See ``autopar_nb.launch.trials.tournament``
        for the options."""
        from ..launch.trials import tournament

        return tournament(self, k, steps, **kwargs)

    def replan_for_memory(self, calibration: dict[str, float], target_bytes: float | None,
                          pins: dict[str, Any], nproc: int | None = None) -> Plan:
        """Plan again after a run measured more memory than predicted
        (``autopar_nb.launch.replan``): the cluster takes the ``calibration`` factors (kept for
        later plans), each rank is fitted under ``target_bytes`` (the watch's threshold of the
        limit; the plan still records the limit itself), ``pins`` (what the checkpoint imposes) join
        the user's. Returns the new plan at ``nproc`` processes; one undo() goes back."""
        cluster = dataclasses.replace(self.cluster, calibration={**(self.cluster.calibration or {}),
                                                                 **calibration})
        planning = (dataclasses.replace(cluster, rank_memory=target_bytes) if target_bytes
                    else cluster)
        self.replan(fix={**self.fix, **pins}, cluster=planning)
        self.cluster = cluster  # the user's limit, not the planning target
        info = {k: v for k, v in self.plan.cluster.items() if k != "memory_limit_bytes"}
        self.plan.cluster = info | ({"memory_limit_bytes": int(cluster.rank_memory)}
                                    if cluster.rank_memory else {})
        self._notify()
        return self.plan_for(nproc)

    def attach(self, path: str = "train.py", *, host: str | None = None, port: int = 0,
               advertise: str | None = None, nproc: int | None = None, steps: int | None = None,
               lost_after_s: float | None = None, restart_wait_s: float | None = None,
               backend: str | None = None, overwrite: bool = False, quiet: bool = False):
        """Export the plan to ``path`` and attach the launch dashboard to its run on other hosts:
        the metrics server listens on ``host`` (an address of this machine the hosts reach, or
        "0.0.0.0" with ``advertise``), and the torchrun commands to run there are printed with
        ``AUTOPAR_METRICS`` and ``AUTOPAR_TOKEN`` in front (also ``run.commands``, ``run.env``).
        Returns the AttachedRun at once; displayed, it is the dashboard, fed by the ranks' stream
        alone (see ``autopar_nb.launch.attached``: ``lost_after_s``, ``restart_wait_s``);
        ``run.stop()`` detaches. The script runs ``steps`` (None: the session's ``steps``, as
        ``export`` writes them; else 100)."""
        from ..export import export
        from ..launch import attach
        from ..launch.attached import LOST_AFTER_S, RESTART_WAIT_S, check_host

        check_host(host, advertise)  # before anything is written
        plan = self.plan_for(nproc)
        steps = steps if steps is not None else self.steps or 100
        exported = export(self.source, plan, path, steps=steps, quiet=True, overwrite=overwrite)
        run = attach(exported.script, plan.mesh.world_size, steps, host=host, port=port,
                     advertise=advertise, plan=plan, commands=exported.commands, backend=backend,
                     lost_after_s=LOST_AFTER_S if lost_after_s is None else lost_after_s,
                     restart_wait_s=RESTART_WAIT_S if restart_wait_s is None else restart_wait_s,
                     run_dir=exported.script.parent)
        if not quiet:
            files = [f for f in (exported.script, exported.runtime, exported.plan_json)
                     if f is not None]
            print(f"wrote {', '.join(map(str, files))}; listening on {run.address} for {run.nproc} "
                  "rank(s). Copy these files to the hosts and run there (the token lets ranks in; "
                  "keep it to yourself):")
            print("\n".join(f"  {c}" for c in run.commands))
        return run

    # ---- widget (autopar_nb.widget) --------------------------------------------------------------
    def _notify(self) -> None:
        for fn in list(self._observers):
            fn(self)

    def widget(self):
        """The planner widget for this session (created once, then reused); it follows every
        replan/undo/redo."""
        if self._widget is None:
            from ..widget import PlannerWidget

            self._widget = PlannerWidget(self)
        return self._widget

    def _repr_mimebundle_(self, include=None, exclude=None):
        # shown as the planner widget (which plans first if no plan exists yet); without a planner
        # IPython falls back to _repr_html_
        try:
            view = self.widget()
        except ImportError:
            return None
        bundle = view._repr_mimebundle_(include=include, exclude=exclude)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        if isinstance(data, dict):
            data["text/plain"] = repr(self)
        return bundle

    def _state(self) -> tuple:
        return dict(self.fix), copy.deepcopy(self.overrides), self.cluster, self.plan, self.steps

    @property
    def batch(self) -> int:
        """The global batch the plan is made for."""
        if self.per_rank_batch and self.plan is not None:
            return self.plan.batch.global_batch
        return self.global_batch or self.graph.batch_size

    def memory_timeline(self, rank: int | None = None, *, measure: bool = False):
        """The current plan's predicted memory over one step on pipeline rank ``rank`` (None: the
        one with the largest peak): :func:`autopar_nb.memory_timeline`; ``print()`` it for a chart
        in text. With ``measure``, also what the plan's exported script holds at each moment,
        measured on CPU under torch's memory tracker
        (:func:`autopar_nb.verify.timeline.measured_timeline`, a few seconds for a small model); the
        widget then draws that curve on the same axes, until the plan changes. A plan measured on a
        real gloo group (a pipeline, expert parallelism) runs every rank, so one measurement keeps
        every pipeline rank's curve, and a later call for another of them returns its kept curve."""
        from ..planner.timeline import memory_timeline

        plan = self.current_plan()
        predicted = memory_timeline(plan, self.graph, cluster=self.cluster, rank=rank)
        if not measure:
            return predicted
        from ..verify.measure import needs_real_group
        from ..verify.timeline import measured_timelines

        kept = (dict(self.measured_timelines[1])
                if self.measured_timelines and self.measured_timelines[0] is plan else {})
        every = needs_real_group(plan)  # the one run measures every rank
        if every and predicted.rank in kept:
            return kept[predicted.rank]
        tls = measured_timelines(self.source, plan, self.graph, cluster=self.cluster,
                                 ranks=None if every else (predicted.rank,))
        self.measured_timelines = (plan, {**kept, **{tl.rank: tl for tl in tls}})
        self._notify()
        return next(tl for tl in tls if tl.rank == predicted.rank)

    def summary(self) -> str:
        """Plain-text summary: model, cluster, layers (repeated blocks folded)."""
        lines = [self.graph.summary(),
                 f"cluster: {self.cluster.describe()}; global batch {self.batch}"]
        if self.plan is not None:
            lines.append(f"plan: {self.plan.summary()}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<autopar_nb.Session {self.graph.model_type}: {self.summary().splitlines()[0]}>"

    def _repr_html_(self) -> str:
        g = self.graph
        rows = []
        for layer, count in g.folded_layers():
            name = layer.path if count == 1 else f"{g.block_of(layer.path).name}.[0–{count - 1}]"
            rows.append(
                f"<tr><td><code>{html.escape(name)}</code></td><td>{html.escape(layer.type)}</td>"
                f"<td style='text-align:right'>{f'× {count}' if count > 1 else ''}</td>"
                f"<td style='text-align:right'>{human(layer.num_params)}</td>"
                f"<td style='text-align:right'>{human(layer.flops)}FLOP</td></tr>")
        inputs = ", ".join(str(tuple(i.shape)) for i in g.inputs)
        plan = ("<p><b>Plan:</b> "
                f"{html.escape(self.plan.summary())}</p>") if self.plan is not None else ""
        return (
            f"<div class='autopar-summary'><p><b>{html.escape(g.model_type)}</b>: "
            f"{human(g.num_params)}params, "
            f"{human(g.step_flops)}FLOP per step (fwd+bwd) on inputs {inputs}; {len(g.nodes)} ops "
            f"({g.tracer}). Cluster: {html.escape(self.cluster.describe())}; "
            f"global batch {self.batch}.</p>"
            f"{plan}<table><thead><tr><th>layer</th><th>type</th><th></th><th>params</th>"
            f"<th>fwd</th></tr>"
            f"</thead><tbody>{''.join(rows)}</tbody></table></div>")

