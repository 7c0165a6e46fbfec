"""Run one TP layout on the stand-in of a captured model, as the exported script would apply it: the
styles :func:`.styles.tp_styles` builds, applied by the runtime's ``apply_tp``, ``set_local_sizes``,
``shard_head_tables`` and ``tie_parameters``, then the model's forward once, on rank 0 of a fake
process group (no communication) with meta tensors (no storage). The planner calls it
(``forward.py``) for every layout it may offer; a failure comes back as the module it happened in
and one line saying why, with the user's line.

Only a failing forward counts: a layout the styles or the runtime refuse to build is left to export,
which says why in its own words.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import select
import signal
import time
import traceback
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..capture.meta_stand_in import StandIn, meta_copy
from ..runtime.heads import set_local_sizes, shard_head_tables
from ..runtime.pp_graph import masks_as_in_eager
from ..runtime.pretrained import tied_parameters
from ..runtime.tp import apply_tp, tie_parameters
from ..runtime.train import switch_off_kv_cache
from .degrees import stage_refusal
from .styles import head_tables, local_sizes, out_features, tp_styles

TORCH_DIR = os.path.dirname(torch.__file__)
PACKAGE_DIR = os.path.dirname(os.path.dirname(__file__))
USER_FILES_IN_PACKAGE = ("zoo.py",)
"""files of autopar_nb that hold models (their lines are the user's model code)"""


FORKED_TRIAL_TIMEOUT_S = 120.0
"""how long a forked copy may run one layout before the planner gives up on checking it (a trial on
meta tensors takes about a second for a small model, a few for a 22B one; only a copy stuck on a
lock takes longer)"""


class Layout(NamedTuple):
    """One TP layout as plain values (hashable: the key of the stand-in's results)."""

    tp: int
    styles: tuple[tuple[str, str], ...]
    """module path -> "colwise" | "rowwise" (``LayerPlan.tp``)"""
    parts: tuple[tuple[str, tuple[int, ...]], ...]
    """colwise module path -> its parts (``LayerPlan.tp_parts``)"""
    layers: tuple[str, ...]
    """every layer path, in model order"""
    loss_parallel: bool
    repeats: tuple[tuple[str, str], ...] = ()
    """repeated-block member -> the block's first member, whose output it hands on instead of
    running (the same code on the same shapes, unsplit: capture ran it)"""


def run_layout(stand: StandIn, layout: Layout) -> tuple[str, str] | None:
    """None when the forward runs on ``layout``'s local shards (or the check cannot run: the styles
    cannot be built); else (module path, why) of the first failure. In a process that holds a
    process group already (a user's notebook or worker) the layout runs in a forked copy of the
    process (:func:`_in_forked_copy`)."""
    model = meta_copy(stand.model)
    styles_of = dict(layout.styles)
    try:
        styles = tp_styles(model, styles_of, layers=list(layout.layers),
                           loss_parallel=layout.loss_parallel,
                           parts={m: list(p) for m, p in layout.parts}, tp=layout.tp)
        sizes = local_sizes(model, styles, tp=layout.tp)
        tables = head_tables(model, styles, tp=layout.tp,
                             parts={m: list(p) for m, p in layout.parts},
                             call=lambda model: call(model, stand))
    except (NotImplementedError, ValueError):
        return None  # export refuses it with its own message
    # found on the whole model: split with the heads even where the run cannot be
    stand.tables[layout] = tables
    stand.stage_refusals[layout] = stage_refusal(sizes, tables)
    trial = functools.partial(_trial, stand, model, layout, styles, sizes, tables)
    if dist.is_initialized():
        # a process group of the user's: the fake one cannot sit beside it
        return _in_forked_copy(trial, stand)
    return trial()


def _trial(stand: StandIn, model: nn.Module, layout: Layout, styles, sizes,
           tables) -> tuple[str, str] | None:
    """:func:`run_layout` once the styles are built: applied on rank 0 of a fake process group of
    ``layout.tp`` ranks (set up here, and taken down), then the forward."""
    ties = tied_parameters(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.tp)
    try:
        mesh = init_device_mesh("cpu", (layout.tp,))
        try:
            apply_tp(model, mesh, {path: style.build() for path, style in styles.items()})
            set_local_sizes(model, sizes)
            shard_head_tables(model, mesh, tables)
            tie_parameters(model, ties)
        except (NotImplementedError, ValueError, AttributeError, TypeError):
            return None
        error = call(model, stand, layout.repeats)
        # every block run, lest handing the first one's output on failed
        if error is not None and layout.repeats:
            error = call(model, stand)
    finally:
        dist.destroy_process_group()
    if error is None:
        return None
    # a failure that is the meta device's (``.item()``), not the layout's?
    if "whole" not in stand.results:
        stand.results["whole"] = call(meta_copy(stand.model), stand) is None
    return blame(model, layout, error) if stand.results["whole"] else None


def _in_forked_copy(trial, stand: StandIn) -> tuple[str, str] | None:
    """``trial()`` in a forked copy of this process, for a process that holds a process group
    already (the default group is global state, and a second cannot be set up beside it): the copy
    sets the user's group aside, runs the trial on its own fake group and sends back only its
    answer, so nothing it does reaches the user's group or model. None (unchecked, as export still
    refuses what it cannot build) where there is no fork or the copy died."""
    if not hasattr(os, "fork"):
        return None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            _held = _set_aside_user_groups()  # alive until the exit below
            answer = pickle.dumps((trial(), stand.results.get("whole")))
            with os.fdopen(write, "wb") as out:
                out.write(answer)
            code = 0
        finally:
            # no atexit, no flush of the copied buffers, no destructor of the user's group
            os._exit(code)
    os.close(write)
    data = _read_until(read, time.monotonic() + FORKED_TRIAL_TIMEOUT_S)
    # stuck (a lock another thread held at the fork): the layout goes unchecked, planning goes on
    if data is None:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    if not data:
        return None
    result, whole = pickle.loads(data)
    if whole is not None:
        stand.results["whole"] = whole
    return result


def _read_until(fd: int, deadline: float) -> bytes | None:
    """Everything written to the pipe ``fd`` until its writer closes it (closed here), or None at
    ``deadline``."""
    chunks = []
    try:
        while (left := deadline - time.monotonic()) > 0:
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)
        return None
    finally:
        os.close(fd)


def _set_aside_user_groups() -> tuple:
    """In the forked copy: no default group, so the fake one can be set up; the user's groups are
    kept referenced (returned) so that taking the fake one down, which forgets every group, destroys
    none of theirs (a gloo group's destructor would wait on threads the copy does not have)."""
    from torch.distributed import distributed_c10d as c10d

    # as torch's DataLoader does in a forked worker: the copy has no thread pool of its own
    torch.set_num_threads(1)
    held = (c10d._world.default_pg, list(c10d._world.pg_map))
    c10d._update_default_pg(None)
    return held


def call(model: nn.Module, stand: StandIn, repeats=()) -> Exception | None:
    """Call ``model`` on the stand-in's inputs as capture did (training mode, no key/value cache,
    Hugging Face's plain masks skipped as its eager forward skips them); the exception it raised, if
    any. ``repeats``: (module, first member of its block) pairs whose module hands on the first
    member's last output instead of running."""
    switch_off_kv_cache(model)
    model.train()
    outputs: dict[str, object] = {}
    hooks = [model.get_submodule(first).register_forward_hook(
        lambda _m, _a, out, first=first: outputs.__setitem__(first, out))
             for first in {f for _, f in repeats}]
    for path, first in repeats:
        model.get_submodule(path).forward = lambda *a, first=first, **k: outputs[first]
    try:
        with torch.no_grad(), masks_as_in_eager(own_positions="position_ids" not in stand.kwargs):
            model(*stand.args, **stand.kwargs)
    # the model's own code failed (on local shards: the caller says where and why)
    except Exception as e:
        return e
    finally:
        for hook in hooks:
            hook.remove()
        for path, _ in repeats:
            del model.get_submodule(path).forward  # the class's forward again
    return None


def blame(model: nn.Module, layout: Layout, error: BaseException) -> tuple[str, str]:
    """(the module to keep whole, why): the innermost module whose code was running when ``error``
    was raised, or the closest one above it that holds split modules (the root, "", when none
    does)."""
    split = dict(layout.styles)
    paths = {id(m): p for p, m in model.named_modules()}
    frames = list(traceback.walk_tb(error.__traceback__))
    module = ""
    for frame, _ in frames:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in paths:
            module = paths[id(owner)]  # the innermost wins: later frames are deeper
    while module and not any(p == module or p.startswith(module + ".") for p in split):
        module = module.rpartition(".")[0]
    user = [(f, n) for f, n in frames if _is_user_file(f.f_code.co_filename)]
    where = ""
    line = ""
    if user:
        frame, lineno = user[-1]
        line = _line_of(frame.f_code.co_filename, lineno, frame)
        where = (f" in {_file_name(frame.f_code.co_filename)} line "
                 f"{lineno}") + (f" (`{line}`)" if line else "")
    return module, diagnosis(model, layout, module, error, line, where)


def diagnosis(model: nn.Module, layout: Layout, module: str, error: BaseException, line: str,
              where: str) -> str:
    """One line: what failed, where (``where``: " in <file> line <n> (`<line>`)"), and what to write
    instead."""
    split, tp = dict(layout.styles), layout.tp
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    names = [p for p in split if p.startswith(module + ".") or not module]
    called = [p for p in names if re.search(rf"\.{re.escape(p.rpartition('.')[2])}\s*\(", line)]
    text = first if len(first) <= 160 else first[:157] + "..."
    if ".split(" in line and called and isinstance(error, (ValueError, RuntimeError)):
        proj = called[0]
        parts = len(dict(layout.parts).get(proj, ())) or 1
        width = out_features(model.get_submodule(proj)) // parts
        return (f"{proj.rpartition('.')[2]}'s output is split with the global width "
                f"{width}{where}, but a rank holds 1/{tp} of it; use chunk({parts}) or view(..., "
                "-1, head_dim)")
    if re.search(r"\.(view|reshape)\(", line) and "invalid for input of size" in first:
        return (f"{module or 'the model'} reshapes a split tensor with global sizes{where}; "
                "compute them from the local tensor (view(B, T, -1, head_dim)) or from attributes "
                "the runtime sets per rank (self.n_head)")
    if "broadcast" in first or "must match the size" in first:
        return (f"{module or 'the model'} meets a tensor of all heads with one rank's heads{where} "
                "(a per-head table is split with the heads only where it is the attention module's "
                "own parameter or buffer with one dim of its head count)")
    return f"{module or 'the model'}'s forward fails on {tp} TP ranks' local shards{where}: {text}"


def _is_user_file(filename: str) -> bool:
    """A file of the model's code: not torch's, not autopar_nb's (but its zoo)."""
    if filename.startswith(TORCH_DIR):
        return False
    if filename.startswith(PACKAGE_DIR):
        return os.path.basename(filename) in USER_FILES_IN_PACKAGE
    return True


def _file_name(filename: str) -> str:
    return "the cell" if filename.startswith("<") else os.path.basename(filename)


def _line_of(filename: str, lineno: int, frame) -> str:
    import linecache

    return linecache.getline(filename, lineno, frame.f_globals).strip()

