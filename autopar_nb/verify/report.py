"""What a verify found: the tolerances a plan's run is held to, each step's differences
(:class:`StepDiff`), the report that judges them (:class:`VerifyReport`), and the comparison of the
parallel run's recorded losses, gradients and parameters with the single-process reference's
(:func:`compare`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..plan import Plan

FP32_RTOL = 1e-5
# bf16 keeps 8 significant bits: one rounding is up to 2**-8 = 3.9e-3 relative; the parallel run
# rounds partial sums in a different order (sharded matmuls, reductions across ranks), so a few
# roundings may add up: 2e-2.
LOW_PRECISION_RTOL = 2e-2
# float8 matmuls keep 3 (e4m3) or 2 (e5m2) significant bits: torchao's own tests hold a float8 LLaMA
# feed-forward's output and gradients to an SQNR above 20 dB against bf16
# (test/float8/test_numerics_integration.py), an error of 10 % of the signal
FLOAT8_RTOL = 0.1


@dataclass
class StepDiff:
    """Differences at one training step (relative values are divided by the largest reference
    magnitude)."""

    step: int
    loss: float
    ref_loss: float
    grad_max_diff: float
    grad_rel: float
    param_max_diff: float
    """after the optimizer step"""
    param_rel: float
    grad_same_rel: float | None = None
    """the parallel run's gradients against the reference's at the parallel run's own parameters
    (the same parameters: :func:`same_parameter_grads`); None at step 0 (same parameters anyway) or
    where not computed"""

    @property
    def loss_diff(self) -> float:
        return abs(self.loss - self.ref_loss)

    @property
    def loss_rel(self) -> float:
        return self.loss_diff / max(abs(self.ref_loss), 1e-12)


@dataclass
class VerifyReport:
    """Result of :func:`verify`: print it for a table; ``ok`` says whether every step is within
    ``rtol``."""

    plan: str
    nproc: int
    rtol: float
    steps: list[StepDiff] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """parameters of the reference with no gradient in the parallel run (at any step)"""
    per_rank: list[dict] = field(default_factory=list)
    """what each rank held: ``local_numel`` (parameter elements stored there), ``dtensor_params``
    (parameters sharded/replicated as DTensors), ``checkpointed`` (checkpoint-wrapped modules),
    ``stages`` (pipeline stages)"""

    param_floor: float = 0.0
    """extra parameter tolerance per step, relative: Adam-type optimizers divide each gradient
    element by its running RMS, so an element whose gradient is at rounding level (about Adam's eps,
    or bf16's resolution) moves by ``+lr`` or ``-lr`` whichever way it rounds; such a difference
    says nothing about the model. ``2 * lr / max|param|`` per step for adam/adamw, else 0."""
    low_precision: bool = False
    """bf16/fp16: gradients are judged at the first step only, where both runs start from the same
    weights; after an update the weights differ by the rounding above and so do later gradients (the
    losses are still judged)"""
    random_off: list[str] = field(default_factory=list)
    """random ops of one forward switched off in both runs ("2 x dropout p=0.1 (h.0.attn)"): the
    ranks would draw other masks than the reference (:mod:`autopar_nb.randomness`)"""
    random_left: list[str] = field(default_factory=list)
    """random ops of one forward that could not be switched off ("1 x randint (Net)"): the runs draw
    them apart"""

    def judge(self, s: StepDiff) -> tuple[bool, str]:
        """Whether step ``s`` agrees, and the rule it was judged by:

        * ``rtol``: loss, gradients and parameters within ``rtol``;
        * ``adam``: parameters within ``rtol`` plus ``param_floor`` per step so far; gradients at
          step 0 within ``rtol`` (both runs start from the same parameters), later ones within
          ``rtol`` plus what the parameters were allowed to differ by at the step before (``rtol +
          step * param_floor``). The runs' parameters differ after a step because Adam turns
          round-off in near-zero gradients into updates of up to ``lr``; gradients at different
          parameters differ by about as much in smooth models, and by more where an activation is
          not smooth (a ReLU unit whose pre-activation crosses zero for one sample switches that
          sample's contribution, about ``1 / batch`` of the gradient), so later gradients get the
          parameters' allowance, not their measured difference. The loss stays within ``rtol`` at
          every step;
        * ``low precision``: loss and parameters as above; gradients at step 0 only;
        * ``same params`` (whenever :func:`same_parameter_grads` was computed, as verify does): loss
          and parameters as above, and the gradients of every step after the first within ``rtol``
          of the reference's gradients at the parallel run's own parameters — the allowances above
          are then needed for the parameters only.
        """
        # the allowed parameter difference
        prev = self.rtol + s.step * self.param_floor if s.step > 0 else 0.0
        param_ok = s.param_rel <= self.rtol + (s.step + 1) * self.param_floor
        if not s.loss_rel <= self.rtol or not param_ok:  # (a NaN loss fails)
            return False, "rtol"
        if s.grad_same_rel is not None:  # gradients at the same parameters: rtol at every step
            return s.grad_same_rel <= self.rtol, "same params"
        if s.grad_rel <= self.rtol and s.param_rel <= self.rtol:
            return True, "rtol"
        if self.low_precision:
            return s.step > 0 or s.grad_rel <= self.rtol, "low precision"
        return (s.grad_rel <= self.rtol + (prev if self.param_floor else 0.0),
                "adam" if self.param_floor else "rtol")

    @property
    def ok(self) -> bool:
        return not self.missing and all(self.judge(s)[0] for s in self.steps)

    @property
    def max_loss_rel(self) -> float:
        return max(s.loss_rel for s in self.steps)

    @property
    def max_grad_rel(self) -> float:
        return max(s.grad_rel for s in self.steps)

    @property
    def max_param_rel(self) -> float:
        return max(s.param_rel for s in self.steps)

    @property
    def losses(self) -> list[float]:
        """The parallel run's loss at each step."""
        return [s.loss for s in self.steps]

    def __str__(self) -> str:
        left = (f"random ops verify could not switch off ran in the forward: "
                f"{', '.join(self.random_left)}; the two runs draw them differently"
                if self.random_left else "")
        first = ([f"{left}, so this mismatch may come from them rather than from the plan"]
                 if left and not self.ok else [])
        head = (f"verify {self.plan} on {self.nproc} processes: "
                f"{'OK' if self.ok else 'MISMATCH'} (rtol {self.rtol:g})")
        rows = [f"{'step':>4} {'loss':>12} {'reference':>12} {'|Δloss|':>10} {'rel':>9} "
                f"{'max|Δgrad|':>11} {'rel':>9} {'same-param':>10} {'max|Δparam|':>12} {'rel':>9}  "
                "rule"]
        for s in self.steps:
            ok, rule = self.judge(s)
            same = f"{s.grad_same_rel:>10.2e}" if s.grad_same_rel is not None else f"{'-':>10}"
            rows.append(f"{s.step:>4} {s.loss:>12.6f} {s.ref_loss:>12.6f} {s.loss_diff:>10.2e} "
                        f"{s.loss_rel:>9.2e} {s.grad_max_diff:>11.2e} {s.grad_rel:>9.2e} {same} "
                        f"{s.param_max_diff:>12.2e} {s.param_rel:>9.2e}  "
                        f"{rule}{'' if ok else ' FAILED'}")
        if any(s.grad_same_rel is not None for s in self.steps):
            rows.append("same-param: gradients after step 0 against the reference's at the "
                        "parallel run's own parameters, judged at rtol")
        if self.param_floor:
            what = "parameters" if any(s.grad_same_rel is not None for s in self.steps) else \
                "parameters, and gradients after step 0,"
            rows.append(f"{what} checked against rtol + {self.param_floor:.1e} per step (Adam: see "
                        "param_floor)")
        if self.low_precision:
            rows.append("low precision: gradients judged at step 0 only (same weights there; see "
                        "low_precision)")
        if self.random_off:
            rows.append("random ops switched off in both runs (per forward): "
                        f"{', '.join(self.random_off)}")
        if left and self.ok:
            rows.append(left)
        if self.missing:
            rows.append(f"no gradient in the parallel run for: {', '.join(self.missing)}")
        return "\n".join([*first, head, *rows])

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


def default_rtol(plan: Plan) -> float:
    """The tolerance a plan's run is held to against the single-process reference, which runs the
    model as the cell wrote it (no float8): float32's, autocast's, or float8's
    (:data:`FLOAT8_RTOL`)."""
    p = plan.precision
    return (FLOAT8_RTOL if p.float8 != "none" else FP32_RTOL if p.amp == "none"
            else LOW_PRECISION_RTOL)


def merge_ranks(per_rank: list[dict]) -> dict:
    """One run's record from the ranks' (:class:`~autopar_nb.verify.ranks.Recorder` results): the
    losses of the first, and per step the gradients and parameters every keeping rank reported (one
    per pipeline stage)."""
    out = {"losses": per_rank[0]["losses"], "grads": [], "params": []}
    steps = len(out["losses"])
    for key in ("grads", "params"):
        for s in range(steps):
            merged: dict = {}
            for r in per_rank:
                if r[key]:
                    merged.update(r[key][s])
            out[key].append(merged)
    return out


def max_diff(par: dict, ref: dict) -> tuple[float, float]:
    """The largest element difference over the tensors both name (inf for a NaN), and that divided
    by the reference's largest magnitude."""
    diff = scale = 0.0
    for name, r in ref.items():
        if name in par:
            d = (par[name] - r).abs().max().item()
            diff = max(diff, math.inf if math.isnan(d) else d)  # max() would pass over a NaN
            scale = max(scale, r.abs().max().item())
    return diff, diff / max(scale, 1e-12)


def compare(plan: Plan, nproc: int, rtol: float, par: dict, ref: dict) -> VerifyReport:
    """The report of the parallel run ``par`` (:func:`merge_ranks`) against the reference ``ref``
    (:func:`~autopar_nb.verify.reference_run.reference`, with its ``same_grads``), held to
    ``rtol``."""
    report = VerifyReport(plan=plan.summary(), nproc=nproc, rtol=rtol)
    if plan.optimizer.name in ("adam", "adamw") and ref["params"]:
        scale = max(t.abs().max().item() for t in ref["params"][0].values())
        report.param_floor = 2 * plan.optimizer.lr / max(scale, 1e-12)
    report.low_precision = plan.precision.amp != "none"
    # at every step: a gradient dropped after the first is not compared (max_diff passes over it)
    steps = zip(ref["grads"], par["grads"], strict=False)
    report.missing = sorted({n for r, q in steps for n in set(r) - set(q)})
    same = ref.get("same_grads") or []
    for s, (lp, lr) in enumerate(zip(par["losses"], ref["losses"], strict=True)):
        gd, gr = max_diff(par["grads"][s], ref["grads"][s])
        pd, pr = max_diff(par["params"][s], ref["params"][s])
        forced = same[s] if s < len(same) else None
        report.steps.append(StepDiff(step=s, loss=lp, ref_loss=lr, grad_max_diff=gd, grad_rel=gr,
                                     param_max_diff=pd, param_rel=pr,
                                     grad_same_rel=max_diff(par["grads"][s], forced)[1] if forced
                                     else None))
    return report
