"""verify() on every strategy, for real: gloo processes on CPU vs a single-process run with the same seed and data.

The cases run in four launches (three of 2 processes, some cases built on the meta device; one of 4): starting
processes costs seconds, running a small plan on them costs less. Each case also checks that the plan was really applied
(parameters sharded, layers checkpoint-wrapped, stages split) — agreeing with the reference is no proof otherwise.
"""

from __future__ import annotations

import pytest
from runtime_cases import (
    GPT_CELL,
    HF_GPT2_CELL,
    HF_LLAMA_CELL,
    LLAMA_CELL,
    RECSYS_CELL,
    RESNET_CELL,
    TIED_CELL,
    TYPED_CELL,
    gpt_mlp_tp,
    has_transformers,
    hf_llama_tp,
    llama_tp,
    make_plan,
    source,
)

from autopar_nb.source import ModelSource
from autopar_nb.verify import FP32_RTOL, StepDiff, VerifyReport, verify_many
from autopar_nb.verify.report import compare

STEPS = 5
G, L, R, V = source(GPT_CELL), source(LLAMA_CELL), source(RECSYS_CELL), source(RESNET_CELL)
SGD = {"lr": 0.05}

TWO = {
    "dp": (G, dict(dp=2)),
    # gradients accumulated unsharded over the micro-batches, reduce-scattered once (set_grad_sync)
    "zero1": (G, dict(dp=2, zero=1, micro_batches=2)),
    "zero2": (G, dict(dp=2, zero=2)),
    "zero3": (G, dict(dp=2, zero=3)),
    "fsdp_recompute": (G, dict(dp=2, zero=3, recompute={"h.0": "full", "h.1": "selective"})),
    "tp_sp": (L, dict(tp=2, tp_styles=llama_tp(sp=True), sp=True, loss_parallel=True)),
    # sequence parallelism over the blocks and final norm only: the replicated head gets the sequence back
    "tp_sp_head_outside": (L, dict(tp=2, tp_styles=llama_tp(sp=True, head=False), sp=True)),
    "embedding": (R, dict(tp=2, tp_styles={"tables.0": "rowwise", "tables.1": "colwise"})),
    "pp_gpipe": (G, dict(pp=2, schedule="gpipe", micro_batches=2, stages={"h.1": 1})),
    "pp_1f1b": (G, dict(pp=2, schedule="1f1b", micro_batches=4, stages={"h.1": 1})),
    "pp_interleaved": (G, dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, micro_batches=2,
                               stages={"h.0": 1, "h.1": 2, "ln_f": 3})),
    "bf16": (G, dict(dp=2, zero=3, amp="bf16", param_dtype="bf16")),
    "tp_bf16": (G, dict(tp=2, tp_styles=gpt_mlp_tp(), amp="bf16")),  # partial sums rounded to bf16 before the sum
    "batchnorm_dp": (V, dict(dp=2)),
}
# a cell may define loss_fn alone, make_batch alone, both or neither (neither: G); the script keeps what it defines
ONLY_LOSS = source(GPT_CELL + """

def loss_fn(model, batch):
    logits = model(batch[0])
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[0][:, 1:].flatten())
""")
ONLY_BATCH = source(GPT_CELL + """

def make_batch(step, rank):
    g = torch.Generator().manual_seed(7 * step + rank)
    return (torch.randint(0, 64, (4, 16), generator=g),)
""")
BOTH = source(ONLY_LOSS.code + ONLY_BATCH.code[len(GPT_CELL):])
TWO |= {"cell_loss_fn": (ONLY_LOSS, dict(dp=2)), "cell_make_batch": (ONLY_BATCH, dict(dp=2)),
        "cell_both": (BOTH, dict(dp=2))}
# random ops no attribute list names: F.dropout of a float attribute, SDPA's dropout_p, timm-style stochastic depth
NOISY_CELL = """
import torch, torch.nn as nn, torch.nn.functional as F

class DropPath(nn.Module):
    def __init__(self, drop_prob):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):  # timm's drop_path: a per-sample bernoulli(keep) mask, scaled by 1 / keep
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1 - self.drop_prob
        return x * x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep).div_(keep)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 8)
        self.attn_dropout, self.mixing_noise = 0.1, 0.3
        self.drop_path = DropPath(0.2)

    def forward(self, x):
        h = F.dropout(F.relu(self.fc1(x)), self.attn_dropout, self.training)
        B, T, _ = h.shape
        q = h.view(B, T, -1, 16).transpose(1, 2)  # heads of 16, split with fc1's columns under TP
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=self.mixing_noise if self.training else 0.0)
        return self.fc2(h + self.drop_path(a.transpose(1, 2).reshape(B, T, -1)))

model = Net()
example_inputs = (torch.randn(4, 8, 32),)
"""
N = source(NOISY_CELL)
TWO |= {"random_dp": (N, dict(dp=2)), "random_tp": (N, dict(tp=2, tp_styles={"fc1": "colwise", "fc2": "rowwise"}))}
T = source(TIED_CELL)  # the embedding and the head share one weight
TIED_TP = {"wte": "rowwise", "lm_head": "colwise", "h.0.up": "colwise", "h.0.down": "rowwise"}
TWO |= {
    "tied_pp": (T, dict(pp=2, schedule="1f1b", micro_batches=2, stages={"h.1": 1})),  # copies on 2 stages, summed
    "tied_tp": (T, dict(tp=2, tp_styles=TIED_TP)),  # one vocab-sharded DTensor for both
    "tied_zero3": (T, dict(dp=2, zero=3)),  # kept in the root FSDP unit
    # synthetic ids over the whole vocabulary (not below the 2-row type table): rank 1's half of wte is looked up
    "ids_tp": (source(TYPED_CELL), dict(tp=2, tp_styles={"wte": "rowwise", "lm_head": "colwise"})),
}
META = {  # built on the meta device, initialised shard by shard
    "meta_zero3": (G, dict(dp=2, zero=3)),
    "meta_tp": (L, dict(tp=2, tp_styles=llama_tp())),
    "meta_tied_tp": (T, dict(tp=2, tp_styles=TIED_TP)),  # the tie is kept through materialisation
}
if has_transformers():  # a model the user did not write: Hugging Face's LlamaForCausalLM, with the cell's loss_fn
    H = ModelSource(HF_LLAMA_CELL, loss_fn_var="loss_fn")
    TWO["hf_llama_tp"] = (H, dict(tp=2, tp_styles=hf_llama_tp()))
    # default configs: dropout 0.1 (switched off in both runs), a tied head, Hugging Face outputs, the default loss
    TWO["hf_gpt2_dp"] = (source(HF_GPT2_CELL), dict(dp=2))
    META["hf_llama_meta_zero3"] = (H, dict(dp=2, zero=3))
FOUR = {
    "dp_tp": (G, dict(dp=2, tp=2, zero=2, tp_styles=gpt_mlp_tp())),
    # Megatron's layout: DDP beside TP (FSDP2's replicate, since DDP takes no DTensors), gradient accumulation
    "dp_tp_zero0": (G, dict(dp=2, tp=2, zero=0, tp_styles=gpt_mlp_tp(), micro_batches=2)),
    "dp_tp_sp": (L, dict(dp=2, tp=2, zero=3, tp_styles=llama_tp(sp=True), sp=True)),
    "tp_pp": (G, dict(tp=2, pp=2, tp_styles=gpt_mlp_tp(), stages={"h.1": 1}, micro_batches=2)),
}
# the others use SGD, whose parameter updates are checked at 1e-5 too
ADAM = {"dp", "tp_sp", "bf16", "tp_bf16", "dp_tp"}


def _plans(cases):
    out = {}
    for name, (src, kw) in cases.items():
        plan = make_plan(src, **kw)
        if name not in ADAM:
            plan.optimizer.name, plan.optimizer.lr = "sgd", SGD["lr"]
        out[name] = (src, plan)
    return out


def _meta_ddp() -> dict:
    """ZeRO 0 (DDP) and 1 (FSDP2) under meta_init, with the plans' own optimizer: test_meta_init_with_ddp's
    cases."""
    cases = {"meta_zero1": (G, make_plan(G, dp=2, zero=1))}
    if has_transformers():
        H = ModelSource(HF_LLAMA_CELL, loss_fn_var="loss_fn")
        cases["hf_llama_meta_dp"] = (H, make_plan(H, dp=2, zero=0))
    return cases


@pytest.fixture(scope="module")
def reports():
    """name -> its report, through ``report(name)``: four launches (three of 2 processes, a third of the 2-process
    cases each, meta_init a flag per case; one of 4), each made when a test first asks for one of its cases: a test's
    timeout covers at most one launch, and on a loaded machine half the 2-process cases at once take most of it."""
    meta = _plans(META) | _meta_ddp()
    plans = _plans(TWO) | meta | _plans(FOUR)
    two = [n for n in plans if n not in FOUR]
    groups = [two[i::3] for i in range(3)] + [list(FOUR)]
    done: dict[str, VerifyReport] = {}

    def report(name: str) -> VerifyReport:
        if name not in done:
            group = next(g for g in groups if name in g)
            flags = [n in meta for n in group]
            done.update(zip(group, verify_many([plans[n] for n in group], steps=STEPS, meta_init=flags),
                            strict=True))
        return done[name]
    report.names = list(plans)
    return report



def _full_numel(src):
    model, _, _ = src.build(device="meta")
    return sum(p.numel() for p in model.parameters())


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [*TWO, *META, *FOUR])
def test_plan_matches_single_process(reports, name):
    report = reports(name)
    print(report)
    if name == "hf_gpt2_dp":
        assert report.random_off and "random ops switched off in both runs" in str(report)
    if name.startswith("random_"):  # each named, with its module; none left on
        assert report.random_off == ["1 x dropout p=0.1 (Net)", "1 x scaled_dot_product_attention dropout_p=0.3 (Net)",
                                     "1 x bernoulli_ -> its mean 0.8 (drop_path)"], report.random_off
        assert not report.random_left
    assert len(report.steps) == STEPS
    if "bf16" in name:
        assert report.rtol > FP32_RTOL
    else:
        assert report.rtol == FP32_RTOL
    assert report.ok, str(report)
    # every step after the first compared gradients at the same parameters, held to rtol
    assert all(s.grad_same_rel is not None and s.grad_same_rel <= report.rtol for s in report.steps[1:]), str(report)
    # the loss moved: the run trained (identical numbers from a model that never updates would prove little)
    assert report.steps[-1].ref_loss != report.steps[0].ref_loss


@pytest.mark.multiprocess
def test_plans_were_really_applied(reports):
    full_g, full_l, full_r = _full_numel(G), _full_numel(L), _full_numel(R)
    info = {name: reports(name).per_rank for name in reports.names}
    assert all(i["local_numel"] == full_g and i["dtensor_params"] == 0 for i in info["dp"])
    for name in ("zero1", "zero2", "zero3", "fsdp_recompute", "bf16", "meta_zero3"):
        assert all(i["local_numel"] < 0.6 * full_g for i in info[name]), name  # each rank holds about half
    assert all(i["checkpointed"] == 2 for i in info["fsdp_recompute"])
    assert all(i["dtensor_params"] > 0 and i["local_numel"] < full_l for i in info["tp_sp"])
    # rows of tables.0 and columns of tables.1 are split; tables.2 and the MLPs are replicated
    assert all(i["dtensor_params"] == 2 and i["local_numel"] < full_r for i in info["embedding"])
    assert [i["stages"] for i in info["pp_1f1b"]] == [[0], [1]]
    assert [i["stages"] for i in info["pp_interleaved"]] == [[0, 2], [1, 3]]
    assert sum(i["local_numel"] for i in info["pp_gpipe"]) == full_g
    assert all(i["local_numel"] < 0.45 * full_g for i in info["dp_tp"])  # sharded over dp, and MLPs over tp too
    assert len(info["tp_pp"]) == 4 and {tuple(i["stages"]) for i in info["tp_pp"]} == {(0,), (1,)}
    # replicated over dp (whole on each of the 2 replicas), MLPs split over tp
    assert all(0.45 * full_g < i["local_numel"] < full_g and i["dtensor_params"] > 0 for i in info["dp_tp_zero0"])
    full_t = _full_numel(T)
    assert [i["stages"] for i in info["tied_pp"]] == [[0], [1]]
    assert sum(i["local_numel"] for i in info["tied_pp"]) > full_t  # both stages hold a copy of the tied weight
    for name in ("tied_tp", "meta_tied_tp", "tied_zero3"):
        assert all(i["local_numel"] < full_t for i in info[name]), name


def test_compare_flags_a_changed_model():
    """The comparison itself: a parameter that moved differently in the parallel run is a mismatch."""
    import torch

    from autopar_nb.plan import OptimizerPlan, Plan

    plan = Plan(optimizer=OptimizerPlan(name="sgd"))
    ref = {"losses": [1.0], "grads": [{"w": torch.ones(3)}], "params": [{"w": torch.ones(3)}]}
    par = {"losses": [1.0], "grads": [{"w": torch.ones(3)}], "params": [{"w": torch.tensor([1.0, 1.0, 1.001])}]}
    assert compare(plan, 2, FP32_RTOL, ref, ref).ok
    report = compare(plan, 2, FP32_RTOL, par, ref)
    assert not report.ok and "MISMATCH" in str(report)
    missing = compare(plan, 2, FP32_RTOL, {**ref, "grads": [{}]}, ref)
    assert not missing.ok and missing.missing == ["w"]
    # dropped at a later step only (as FSDP under a zero-bubble schedule dropped a stage's weight
    # gradients): still missing, not passed over by the comparison
    two = {k: v * 2 for k, v in ref.items()}
    later = compare(plan, 2, FP32_RTOL, {**two, "grads": [{"w": torch.ones(3)}, {}]}, two)
    assert not later.ok and later.missing == ["w"]
    assert StepDiff(0, 2.0, 1.0, 0, 0, 0, 0).loss_rel == 1.0
    assert isinstance(report, VerifyReport)


def test_nan_is_a_mismatch():
    """A parallel run whose loss, gradients or parameters are NaN fails (a NaN compares False
    with every tolerance, and ``max`` passed over it: a pipeline whose bf16 activations were
    received into float32 buffers verified)."""
    import torch

    from autopar_nb.plan import OptimizerPlan, Plan

    plan = Plan(optimizer=OptimizerPlan(name="sgd"))
    ref = {"losses": [1.0], "grads": [{"w": torch.ones(3)}], "params": [{"w": torch.ones(3)}]}
    nan = torch.tensor([1.0, float("nan"), 1.0])
    assert not compare(plan, 2, FP32_RTOL, {**ref, "losses": [float("nan")]}, ref).ok
    assert not compare(plan, 2, FP32_RTOL, {**ref, "grads": [{"w": nan}]}, ref).ok
    assert not compare(plan, 2, FP32_RTOL, {**ref, "params": [{"w": nan}]}, ref).ok


def test_low_precision_rules():
    """bf16: losses at every step, gradients at the first step (same weights), parameters within Adam's +-lr per
    step; fp32: everything at every step."""
    from autopar_nb.verify import LOW_PRECISION_RTOL

    def report(low, *steps):
        return VerifyReport(plan="p", nproc=2, rtol=LOW_PRECISION_RTOL if low else FP32_RTOL, low_precision=low,
                            param_floor=0.03,
                            steps=[StepDiff(i, 1.0, 1.0, 0, g, 0, p) for i, (g, p) in enumerate(steps)])

    assert report(True, (0.01, 0.045), (0.2, 0.075)).ok  # later gradients follow the (rounded) weights
    assert not report(True, (0.05, 0.0)).ok  # first-step gradients: same weights, same data
    assert not report(True, (0.0, 0.09)).ok  # 0.02 + 1 x 0.03 + ...
    assert not report(False, (2e-5, 0.0)).ok and not report(False, (0.0, 0.0), (0.05, 0.0)).ok
    assert "gradients judged at step 0 only" in str(report(True, (0.0, 0.0)))


def test_adam_rule_for_gradients_after_the_first_step():
    """fp32 with Adam: step 0's gradients are held to rtol (same parameters); later ones to the parameters'
    allowance, as `make demo`'s ReLU MLP needs (a unit crossing zero after Adam's round-off-sized updates moved its
    gradient by 2.3e-2 at step 2, losses equal); the loss is held to rtol at every step."""
    def report(*steps, loss_rel=0.0):
        return VerifyReport(plan="p", nproc=2, rtol=FP32_RTOL, param_floor=0.062,
                            steps=[StepDiff(i, 1.0 + (loss_rel if i == len(steps) - 1 else 0.0), 1.0, 0, g, 0, p)
                                   for i, (g, p) in enumerate(steps)])

    demo = report((2.5e-7, 1.2e-4), (3.0e-6, 1.2e-4), (2.33e-2, 1.0e-2), (2.8e-4, 1.2e-2), (5.7e-4, 1.2e-2))
    assert demo.ok and [demo.judge(s)[1] for s in demo.steps][2] == "adam"
    assert not report((2e-5, 1.2e-4)).ok  # step 0: the same parameters, so rtol
    assert not report((0.0, 0.0), (0.07, 0.01)).ok  # step 1 allows rtol + 1 x 0.062
    assert report((0.0, 0.0), (0.06, 0.01)).ok
    assert not report((0.0, 0.0), (1e-3, 0.01), loss_rel=2e-5).ok  # the loss: rtol at every step
    assert "gradients after step 0" in str(demo)


def test_gradients_at_the_same_parameters_are_held_to_rtol_at_every_step():
    """Where verify computed the reference's gradients at the parallel run's own parameters (grad_same_rel), those
    decide every later step at rtol, whatever the drifted runs' gradients differ by; losses and parameters keep
    their rules."""
    def report(*steps, low=False):
        return VerifyReport(plan="p", nproc=2, rtol=FP32_RTOL, param_floor=0.062, low_precision=low,
                            steps=[StepDiff(i, 1.0, 1.0, 0, g, 0, p, grad_same_rel=same)
                                   for i, (g, p, same) in enumerate(steps)])

    drifted = report((2.5e-7, 1.2e-4, None), (2.33e-2, 1.0e-2, 3e-7), (0.5, 1.2e-2, 8e-6))
    assert drifted.ok and [drifted.judge(s)[1] for s in drifted.steps] == ["adam", "same params", "same params"]
    assert not report((0.0, 0.0, None), (0.0, 0.0, 2e-5)).ok  # same parameters: rtol, no allowance
    assert not report((0.0, 0.0, None), (0.0, 0.0, 2e-5), low=True).ok  # low precision too, at its rtol
    assert not report((0.0, 0.0, None), (0.0, 0.2, 0.0)).ok  # parameters keep their allowance: 1e-5 + 2 x 0.062
    text = str(drifted)
    assert "same-param: gradients after step 0" in text and "parameters checked against rtol + 6.2e-02" in text


def test_reference_runs_on_the_ranks_device_with_tf32_off(monkeypatch):
    """The reference asks the ranks' device type (CUDA kernels on a GPU host: CPU and GPU kernels differ by more than
    the fp32 tolerance) and switches TF32 off (cuDNN's default for convolutions); its tensors come back on the CPU."""
    import torch

    from autopar_nb.runtime import mesh
    from autopar_nb.verify import reference

    asked = []
    monkeypatch.setattr(mesh, "device_type", lambda: asked.append(1) or "cpu")
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    try:
        out = reference(G, make_plan(G, dp=2), steps=1)
        assert asked and not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    assert all(t.device.type == "cpu" for t in [*out["grads"][0].values(), *out["params"][0].values()])


def test_cold_verify_on_a_gpu_host_never_opens_cuda_in_the_kernel(monkeypatch):
    """``warm=False`` runs the reference in the calling process, except where the ranks use GPUs: there the whole
    verify goes to a fresh child process (a stand-in records it here), and nothing runs in this process."""
    import importlib

    from autopar_nb.verify import job as verify_job

    verify_mod = importlib.import_module("autopar_nb.verify.api")  # where verify() reads verify_here
    started = []

    class Job:
        def __init__(self, **kw):
            started.append(kw["warm"])
            self.reports, self.message, self.error = ["report"], "", None

        def wait(self):
            pass

    assert verify_mod.ranks_use_cuda() is False  # the real probe, on this CPU host (NVML or torch's count)
    monkeypatch.setattr(verify_job, "VerifyJob", Job)
    monkeypatch.setattr(verify_mod, "verify_here", lambda *a, **k: pytest.fail("ran in the kernel"))
    monkeypatch.setattr(verify_mod, "ranks_use_cuda", lambda: True)
    assert verify_mod.verify(G, make_plan(G, dp=2), steps=1, warm=False) == "report" and started == [False]
    monkeypatch.setattr(verify_mod, "ranks_use_cuda", lambda: False)
    monkeypatch.setattr(verify_mod, "verify_here", lambda *a, **k: ["here"])
    assert verify_mod.verify(G, make_plan(G, dp=2), steps=1, warm=False) == "here" and started == [False]


FAILING_CELL = '''
import os, torch, torch.nn as nn
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
example_inputs = (torch.randn(8, 16),)
def loss_fn(model, batch):
    out = model(*batch)
    if os.environ.get("RANK") == "1":
        raise ValueError("shapes disagree on this rank")
    return out.pow(2).mean()
'''


def test_where_failed_names_the_cell_line_else_the_script_line():
    from autopar_nb.failures import where_failed

    tb = ('Traceback (most recent call last):\n'
          '  File "/x/.venv/lib/python3.11/site-packages/torch/distributed/elastic/errors.py", line 3, in wrapper\n'
          '    return f(*args, **kwargs)\n'
          '  File "/x/autopar_nb/check.py", line 520, in _worker\n    ns["main"](argv)\n'
          '  File "/tmp/v/verify_0.py", line 458, in accumulate\n    loss = loss_fn(model, piece)\n'
          '  File "/tmp/v/verify_0.py", line 96, in loss_fn\n    raise ValueError("shapes disagree on this rank")\n'
          'ValueError: shapes disagree on this rank\n')
    assert where_failed(tb, FAILING_CELL) == 'cell line 8 (`raise ValueError("shapes disagree on this rank")`)'
    assert where_failed(tb).startswith("verify_0.py line 96 in loss_fn (`raise")
    assert where_failed(tb.split('  File "/tmp')[0]) == ""  # library frames only


@pytest.mark.multiprocess
def test_a_failing_rank_is_one_line_naming_the_cell_line():
    """Not ChildFailedError's box: the rank, the cell's line and the error; the whole account one attribute away."""
    from autopar_nb.verify import VerifyError, verify

    src = source(FAILING_CELL)
    with pytest.raises(VerifyError) as info:
        verify(src, make_plan(src, dp=2), steps=1, nproc=2)
    line = str(info.value)
    assert "\n" not in line and "ChildFailedError" not in line, line
    assert line.startswith('rank 1 failed at cell line 8 (`raise ValueError("shapes disagree on this rank")`): '
                           "ValueError: shapes disagree on this rank"), line
    assert "Traceback" in info.value.details and "loss_fn" in info.value.details


@pytest.mark.multiprocess
def test_meta_init_with_ddp(reports):
    """ZeRO 0 (DDP) and 1 under meta_init: DDP broadcasts rank 0's weights when it wraps, so the script wraps once
    materialize has given the meta parameters storage and values (it crashed on ``Tensor.item()`` of a meta tensor)."""
    meta_ddp = {name: reports(name) for name in ("meta_zero1", "hf_llama_meta_dp") if name in reports.names}
    for name, report in meta_ddp.items():
        assert report.ok, (name, str(report))
    full = _full_numel(G)
    assert all(i["local_numel"] < 0.6 * full for i in meta_ddp["meta_zero1"].per_rank)  # FSDP2: about half each
