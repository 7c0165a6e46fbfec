"""The ``%%autoparallel`` cell magic: parse options, run the cell on the meta device, capture, bind
the session."""

from __future__ import annotations

import contextlib
import dataclasses
import os

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .. import calibration
from ..capture import CaptureError
from ..capture.cache import cached_capture
from ..export import with_weights
from ..hardware import Cluster, parse_memory
from ..plan import AMP, FIX_ALIASES, FIX_CHOICES, FIX_KEYS, PlanError
from ..plan.fix import FIX_NUMBERS
from ..runtime.data import first_tensor
from ..source import PRETRAINED_KEY, ModelSource
from .cell import CellError, collated_rows, parse_fix, run_model_cell
from .session import MODES, Session

DTYPES = {"auto": None, **{("fp32" if amp == "none" else amp): amp for amp in AMP}}
"""--dtype value -> the ``amp`` it fixes (None: the planner chooses)"""
BOOL_WORDS = {"true": True, "on": True, "yes": True, "false": False, "off": False, "no": False}


def make_cluster(gpu: str, gpus: int | None, nodes: int, memory: str | None = None) -> Cluster:
    """The cluster the options describe: a named preset, or ``auto`` = this machine (its GPUs; on a
    CPU-only machine the ``cpu`` preset with 2 processes, so the plan can be launched here);
    ``memory`` ("3GiB"): a limit per rank (``Cluster.rank_memory``). Factors measured by earlier
    runs of this preset (``run.calibrate()``) are applied."""
    if gpu == "auto":
        detected = Cluster.detect()
        per_node = gpus or (detected.gpus_per_node if detected.name != "cpu" else 2)
        cluster = dataclasses.replace(detected, nodes=nodes, gpus_per_node=per_node)
    else:
        cluster = Cluster.preset(gpu, nodes=nodes, gpus_per_node=gpus or 8)
    if memory is not None:
        cluster = dataclasses.replace(cluster, rank_memory=parse_memory(memory))
    return calibration.apply(cluster)


def _typed_fix(fix: dict) -> dict:
    """``--fix sp=false`` arrives as the word "false" (``sp=1`` as the number 1): make the values of
    true/false choices bools, and those of number keys (``moe_capacity=1.5``) numbers."""
    out = {}
    for k, v in fix.items():
        key = FIX_ALIASES.get(k, k)
        if FIX_CHOICES.get(key) == (False, True):
            if isinstance(v, str) and v.lower() in BOOL_WORDS:
                v = BOOL_WORDS[v.lower()]
            elif v in (0, 1) and not isinstance(v, bool):
                v = bool(v)
        elif key in FIX_NUMBERS and isinstance(v, str):
            with contextlib.suppress(ValueError):  # else normalize_fix says what it must be
                v = float(v)
        out[key] = v
    return out


def _starting_weights(result, weights: str | None) -> tuple[ModelSource, str | None]:
    """The cell's source, with ``--weights`` if given, and the checkpoint its model starts from
    (``--weights``, or what the cell's ``from_pretrained`` names; None: random initial weights)."""
    found = result.namespace.get(PRETRAINED_KEY) or []
    if weights is None:
        return result.source, found[-1] if found else None
    if found:
        raise CellError(f"--weights {weights}, but the cell starts from its own checkpoint "
                        f"(from_pretrained({found[-1]!r})): --weights is for a cell that builds "
                        "its model from a config")
    if not os.path.isdir(weights):
        raise CellError(f"--weights {weights}: no such folder; name a folder of safetensors files "
                        "(what save_pretrained writes)")
    source = with_weights(result.source, weights)
    return source, source.weights


def batch_note(result, session: Session, flag: int | None) -> str | None:
    """One line when the batch a cell's ``make_batch`` trains on (its samples per rank x the plan's
    dp) is not the global batch the cell said: ``--batch``, else the batch of the ``example_inputs``
    it binds (which is the global batch when there is no ``--batch``); None when they agree or
    nothing was said."""
    per_rank = result.per_rank_batch
    if not per_rank:
        return None
    if flag:
        said = f"--batch {flag}"
    elif result.source.inputs_var is not None:
        flag = int(first_tensor(result.example_inputs).shape[0])
        said = f"example_inputs' batch of {flag}"
    else:
        return None  # make_batch(0, 0) is the example: one rank's samples by construction
    if flag == session.batch:
        return None
    return (f"make_batch returns {per_rank} samples per rank, so this plan "
            f"(dp={session.plan.mesh.dp}) trains {session.batch} per step, not {said}: "
            f"make_batch's figure is planned (have it return {flag} / dp samples to keep that "
            "global batch)")


def collate_note(result, session: Session, flag: int | None) -> str | None:
    """One line when the cell's ``collate_fn`` makes another number of rows than the samples each
    data-parallel rank reads per step. Where it makes a whole number of rows of each sample
    (``ModelSource.rows_per_sample``) the plan costs the rows, and a ``--batch`` (samples) that
    differs from them is said with the global batch planned; where it does not (a packing
    collate_fn), the run trains other rows than the plan costs, and that is said."""
    plan, per_sample = session.plan, session.source.rows_per_sample
    dp, rows = plan.mesh.dp, plan.batch.global_batch
    samples = rows // per_sample // dp
    read = collated_rows(session.source, result.namespace, samples)
    if read is None or read[0] < samples:
        return None
    if read[1] != samples * per_sample:
        return (f"collate_fn makes {read[1]} rows of the {samples} samples each rank reads per "
                f"step, so this plan (dp={dp}) trains {read[1] * dp} rows per step, not the {rows} "
                "its memory and time are for: the rows are what runs (have collate_fn return the "
                "same number of rows of each sample)")
    if per_sample == 1 or not flag:
        return None
    return (f"collate_fn makes {per_sample} rows of each sample, so the {flag} samples of --batch "
            f"{flag} are {rows} rows per step: the rows are planned, a global batch of {rows} "
            f"(dp={dp}: {samples} samples, {read[1]} rows per rank)")


def _checked_options(args) -> tuple[dict, Cluster]:
    """The pins and the cluster the magic's options give, checked before the cell runs: counts of
    at least 1, a ``--name`` Python can bind, and a preset and memory size it knows (CellError
    saying which option is wrong otherwise)."""
    if min([args.nodes, *(n for n in (args.gpus, args.steps) if n is not None)]) < 1:
        raise CellError("--nodes, --gpus and --steps must be >= 1 (got --nodes "
                        f"{args.nodes} --gpus {args.gpus} --steps {args.steps})")
    if not args.name.isidentifier():
        raise CellError(f"--name {args.name!r} is not a valid Python variable name")
    fix = _typed_fix(parse_fix(args.fix))
    if DTYPES[args.dtype] is not None:
        fix.setdefault("amp", DTYPES[args.dtype])
    try:
        cluster = make_cluster(args.gpu, args.gpus, args.nodes, args.memory)
    except ValueError as e:
        raise CellError(f"{'--memory' if 'memory size' in str(e) else '--gpu'}: {e}") from None
    return fix, cluster


@magics_class
class AutoparallelMagics(Magics):
    """Magics of autopar-nb."""

    @magic_arguments()
    @argument("--gpus", type=int, default=None,
              help="GPUs per node to plan for (default: the GPUs of this machine; 8 with a named "
                   "--gpu; 2 CPU processes on a machine without GPU). Example: --gpus 8")
    @argument("--nodes", type=int, default=1,
              help="number of nodes (default 1). Example: --nodes 4")
    @argument("--gpu", default="auto",
              help="device preset: a100-40gb, a100-80gb, h100-80gb, h100-pcie, h100-nvl, h200, "
                   "gh200, h20, l4, l40s, a10, a10g, v100, t4, cpu, or auto = detect this machine "
                   "(default). Example: --gpu h100-80gb")
    @argument("--memory", default=None,
              help="memory limit per rank (GiB unless a unit is given): the planner fits each rank "
                   "under it, and a CPU launch enforces it on each rank's RSS above its baseline, "
                   "stopping a rank that exceeds it as an out-of-memory would (re-planning: "
                   "ap.launch(replan=...)). Example: --gpu cpu --memory 3GiB")
    @argument("--batch", type=int, default=None,
              help="global batch size (samples per optimizer step over all GPUs; default: the "
                   "example inputs' batch). Example: --batch 512")
    @argument("--steps", type=int, default=None,
              help="the training steps the run will take: the planner compiles where the step time "
                   "compile saves, over these steps, exceeds Inductor's start-up (default 10,000, "
                   "torchtitan's default run; ap.launch(steps=N) plans again for its own N). "
                   "Example: --steps 200")
    @argument("--name", default="ap",
              help="variable the session is bound to (default ap). Example: --name gpt")
    @argument("--model", default=None,
              help="variable holding the model (default: `model`, or the only nn.Module the cell "
                   "creates). Example: --model net")
    @argument("--inputs", default=None,
              help="variable holding the example inputs (default: `example_inputs`, or the only "
                   "tensor/tuple of tensors the cell creates). Example: --inputs batch")
    @argument("--dtype", default="auto", choices=list(DTYPES),
              help="training precision: fp32, bf16 or fp16 autocast; auto lets the planner choose "
                   "(default). Example: --dtype bf16")
    @argument("--mode", default="auto", choices=list(MODES),
              help="auto (default) or semi: the planner chooses everything not pinned by --fix or "
                   "ap.override() (semi is the seed's name for planning around pinned layer "
                   "choices; pins work in both); manual: --fix must give dp, tp and pp, the "
                   "planner fills in per-layer choices and costs. Example: --mode manual --fix "
                   "dp=2,tp=4")
    @argument("--fix", default=None,
              help="pin global choices, comma-separated KEY=VALUE with KEY in "
                   f"{', '.join(FIX_KEYS)} (aliases: "
                   f"{', '.join(f'{a}={k}' for a, k in FIX_ALIASES.items())}). Example: --fix "
                   "tp=2,zero=3")
    @argument("--weights", default=None, metavar="DIR",
              help="a folder of safetensors files (what save_pretrained writes) that the model the "
                   "cell builds from a config starts from: verify, launch and export read it (a "
                   "cell calling from_pretrained names its own). Example: --weights ./tiny-llama")
    @argument("--include-cells", action="store_true",
              help="prepend the earlier cells that define names this cell uses (default: report "
                   "those names). Example: --include-cells")
    @cell_magic
    def autoparallel(self, line: str, cell: str):
        """Plan parallel training for the model this cell builds.

        The cell runs with every tensor on the meta device (no weights are allocated, so a 100B
        model plans on a laptop). It must bind the model (``model``) and example inputs
        (``example_inputs``: a tensor, a tuple of tensors or a dict of tensors); it may define
        ``loss_fn(model, batch)`` and ``make_batch(step, rank)``, which verify, launch and the
        exported script use, or bind a ``dataset`` (its first samples are then the example). With
        ``loss_fn`` the batch may be ``(x, y)``, a dict or ``(inputs, labels)``: the model is
        captured on what ``loss_fn`` gives it. ``make_batch`` returns one data-parallel rank's
        samples: each plan trains that many per rank (the global batch is that times dp, and a
        ``--batch`` or an example batch that disagrees is said). Re-running the cell with the model
        unchanged reuses its capture and plan. The cell must be self-contained (its own imports),
        because workers and the exported script run it on their own.

        The session is bound to ``ap`` (or ``--name``) and shown as the cell's output (the planner
        widget); it is also the cell's value. Everything the widget does is a call on it:
        ``ap.plan`` (with ``.explain()``, ``.cost``, ``.alternatives``), ``ap.override(glob, tp=...,
        stage=..., recompute=...)``, ``ap.replan(fix=...)``, ``ap.undo()``/``ap.redo()``,
        ``ap.verify(steps, nproc)``, ``ap.launch(nproc, steps)`` (a live dashboard; the plan weighs
        compile's start-up over ``--steps``, and launch plans again for its own ``steps`` where they
        differ), ``ap.tournament(k, steps)`` (the plan and its alternatives measured, the cost model
        calibrated from them; ``.adopt()`` takes the winner), ``ap.export(path)`` (a plain torchrun
        script, ``train.py``, beside its runtime module, ``train_runtime.py``; ``single_file=True``:
        one file) and ``ap.attach(path, host=...)`` (the dashboard of that script run on other
        hosts, which stream to this notebook).

        Examples::

            In [1]: %load_ext autopar_nb

            In [2]: %%autoparallel --gpus 8 --gpu h100-80gb --batch 32
               ...: import torch, torch.nn as nn
               ...: model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512))
               ...: example_inputs = (torch.randn(32, 1024),)

            In [3]: %%autoparallel --nodes 8 --gpus 8 --gpu h100-80gb --fix tp=8,zero=1 --name llama
               ...: from autopar_nb.zoo import Llama, LlamaConfig
               ...: model = Llama(LlamaConfig())
               ...: example_inputs = (torch.randint(0, 128256, (1, 8192)),)

            In [4]: ap.graph.summary()          # the captured operator graph, layers folded

        Errors in the cell or the options are reported in one line, and the namespace is left as it
        was.
        """
        args = parse_argstring(self.autoparallel, line)
        try:
            fix, cluster = _checked_options(args)
            history = [c for c in self.shell.user_ns.get("In", [])[1:] if isinstance(c, str)]
            result = run_model_cell(cell, self.shell.user_ns, model_var=args.model,
                                    inputs_var=args.inputs, history=history,
                                    include_cells=args.include_cells, first_line=2)
            source, start = _starting_weights(result, args.weights)
            graph, _ = cached_capture(result.model, result.model_inputs, source=result.source.code)
            # the plan costs the rows
            rows = args.batch * source.rows_per_sample if args.batch else None
            session = Session(graph, cluster, source, global_batch=rows, mode=args.mode, fix=fix,
                              per_rank_batch=result.per_rank_batch, steps=args.steps)
            session.replan()
            for note in (batch_note(result, session, args.batch),
                         collate_note(result, session, args.batch)):
                if note:
                    print(note)
            if start:  # the plan's figures are the model's; what it trains from is said here
                print(f"{args.name}: {session.plan.summary()}; starts from the weights in {start}")
        except (CellError, CaptureError, PlanError) as e:
            raise UsageError(f"%%autoparallel: {e}") from None
        self.shell.user_ns.update(result.bound)
        self.shell.user_ns[args.name] = session
        return session
