"""Distributed checkpoints (DCP): every rank writes its shards; a checkpoint loads at another world
size or layout.

A checkpoint counts once every rank finished writing it: its manifest (``manifest.json``: each
file's size and CRC-32), written last and atomically, marks it complete, so a run killed in the
middle of a save, or a save that failed (a full disk), resumes from the one before. At resume every
file is checked against the manifest, and a truncated or damaged checkpoint is passed over for the
newest one that is whole (:func:`resume_point`). Older checkpoints beyond the newest ``keep`` are
removed after each save.

Tensors split part by part (fused projections, ``_StridedShard``) are stored in their original
layout (see :func:`dcp_layout`). Keys are the model's parameter names whatever the plan: a rank
holding several pipeline stages (:class:`PipelineStages`) stores its stages' entries without the
stage index, so a checkpoint written under one schedule loads under any other plan.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from .layouts import dcp_layout, restore_layout
from .units import fmt_bytes

# optimizer state keyed by parameter name, so each pipeline rank's share is its own set of keys
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


MANIFEST = "manifest.json"
"""each file of a checkpoint with its size and CRC-32 (zip's and PNG's check against accidental
damage), written last"""


def checkpoints(ckpt_dir: str | None) -> list[str]:
    """The ``step_N`` folders of ``ckpt_dir`` whose save finished on every rank (they have a
    manifest), newest first."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return []
    steps = [int(d.removeprefix("step_")) for d in os.listdir(ckpt_dir)
             if re.fullmatch(r"step_\d+", d)
             and os.path.exists(os.path.join(ckpt_dir, d, MANIFEST))]
    return [os.path.join(ckpt_dir, f"step_{s}") for s in sorted(steps, reverse=True)]


def latest_checkpoint(ckpt_dir: str | None) -> str | None:
    """The newest ``step_N`` folder of ``ckpt_dir`` whose save finished on every rank (its files
    unchecked)."""
    return next(iter(checkpoints(ckpt_dir)), None)


def crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def manifest_problem(path: str, *, rank: int = 0, world: int = 1) -> str | None:
    """What is wrong with the files of checkpoint ``path`` that its manifest lists (None: this
    rank's share of them, every ``world``-th from ``rank``, has the sizes and checksums written
    there)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = sorted(json.load(f)["files"].items())
    except (OSError, ValueError, KeyError, AttributeError) as e:
        return f"unreadable manifest ({type(e).__name__}: {e})"
    for name, want in files[rank::world]:
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.isfile(file) else None
        if size != want["size"]:
            return (f"{name} has {'no file' if size is None else f'{size} bytes'}, the manifest "
                    f"{want['size']}")
        if crc32(file) != want["crc32"]:
            return f"{name} does not match its checksum"
    return None


def resume_point(ckpt_dir: str | None) -> str | None:
    """The newest complete checkpoint of ``ckpt_dir`` whose files match its manifest; each one
    passed over is said in one line. Collective: every rank checks its share of the files, and all
    agree."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for path in checkpoints(ckpt_dir):
        problems = [None] * world
        dist.all_gather_object(problems, manifest_problem(path, rank=rank, world=world))
        problem = next((p for p in problems if p), None)
        if problem is None:
            return path
        if rank == 0:
            print(f"checkpoint {path} is damaged ({problem}): trying the one before", flush=True)
    return None


def _states(model, optimizer):
    """(model state, optimizer state) in DCP's form."""
    return get_state_dict(model, optimizer, options=FLAT)


class PipelineStages(nn.ModuleList):
    """The pipeline stages one rank holds, checkpointed as one model: by the model's names, not the
    stage index."""


STAGE_INDEX = re.compile(r"^((?:state|param_groups)\.)?\d+\.")
"""the index of a pipeline stage in a key of a ``ModuleList`` of stages: ``0.layers.1.w`` (model),
``state.0.layers.1.w.exp_avg`` and ``param_groups.0.layers.1.w.lr`` (flattened optimizer state)"""


def by_name(state: dict | None, stages: bool) -> dict | None:
    """``state`` keyed by the model's names: without the stage index when ``stages`` (the entries of
    a tied parameter that two stages of this rank hold under one name are equal: the first is
    kept)."""
    if state is None or not stages:
        return state
    out: dict = {}
    for key, value in state.items():
        out.setdefault(STAGE_INDEX.sub(r"\1", key), value)
    return out


def by_stage(loaded: dict | None, like: dict | None, stages: bool) -> dict | None:
    """The inverse of :func:`by_name`: ``loaded`` (keyed by name) back under the keys of
    ``like``."""
    if loaded is None or not stages:
        return loaded
    return {key: loaded[STAGE_INDEX.sub(r"\1", key)] for key in like}


def _staged(model, optimizer, step: int, data) -> dict:
    """The state DCP writes, keyed by the model's names (:func:`by_name`)."""
    stages = isinstance(model, PipelineStages)
    model_sd, optim_sd = (by_name(sd, stages) for sd in _states(model, optimizer))
    state = {"model": model_sd, "step": step, "optim": optim_sd}
    state |= {"data": data.state_dict()} if data is not None else {}
    return dcp_layout(state)


def _clear(path: str) -> None:
    """Remove what a failed or replaced save left at ``path``: never mixed with this save's files.
    Collective."""
    if dist.get_rank() == 0 and os.path.exists(path):
        shutil.rmtree(path)
    dist.barrier()


SAVE_ERRORS = (OSError, RuntimeError, dcp.api.CheckpointException)
"""what a save can meet and the run survive: a full disk, a vanished mount"""


def save_checkpoint(path: str, model, optimizer, step: int, *, data=None,
                    keep: int = 0) -> str | None:
    """Write ``model`` (a module, or this rank's :class:`PipelineStages`), ``optimizer``, ``step``
    and the ``data`` stream's position (a run that reads a dataset), keyed by the model's names
    (:func:`by_name`), then the manifest; ``keep``: the newest checkpoints kept beside, older ones
    removed (0: all). Returns None once saved, else why the save failed, the same on every rank: the
    folder is removed and the checkpoint before stays the latest. Collective: every rank calls
    it."""
    state = _staged(model, optimizer, step, data)
    _clear(path)
    try:
        dcp.save(state, checkpoint_id=path)
        error = None
    except SAVE_ERRORS as e:
        error = _why(e)
    return finish(path, step, error, keep=keep)


def finish(path: str, step: int, error: str | None, *, keep: int, group=None) -> str | None:
    """After every rank wrote its files of checkpoint ``path`` (``error``: why this rank's failed):
    the manifest, written by rank 0 once every rank checksummed its share of the files, then the
    older checkpoints beyond ``keep`` removed; or, if a rank failed, the folder removed. Returns
    None or the first rank's error, the same on every rank. Collective over ``group`` (default: the
    world)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    # also the barrier: every rank's shards are on disk (or the save failed somewhere)
    error = _agree(error, group)
    if error is None:  # each rank checksums its share of the files
        try:
            names = sorted(f for f in os.listdir(path) if f != MANIFEST)
            mine: dict | str = {n: {"size": os.path.getsize(os.path.join(path, n)),
                                    "crc32": crc32(os.path.join(path, n))}
                                for n in names[rank::world]}
        except OSError as e:
            mine = f"{type(e).__name__}: {e}"
        shares = [None] * world
        dist.all_gather_object(shares, mine, group=group)
        error = next((s for s in shares if isinstance(s, str)), None)
        if error is None and rank == 0:
            error = _write_manifest(path, {"step": step, "world_size": world,
                                           "files": {k: v for s in shares for k, v in s.items()}})
        error = _agree(error, group)
    if rank == 0:
        if error is not None:
            shutil.rmtree(path, ignore_errors=True)
        elif keep > 0:
            prune(os.path.dirname(path) or ".", keep=keep)
    return error


class AsyncCheckpointer:
    """Checkpoints written in the background with ``dcp.async_save``: a save stalls training only
    while it copies this rank's state (weights, optimizer state) into host memory, the staging copy,
    then a thread writes the files, checksums them and writes the manifest while training goes on.
    The price: that copy, as large as the rank's state, held in host memory until written (on a GPU,
    device memory is untouched), and the writer's CPU time. The manifest is still written last, once
    every rank's files are on disk, so a run killed mid-save resumes from the checkpoint before. The
    writer's collectives go over a gloo group of their own: on the training's group, two threads'
    collectives could interleave in a different order on each rank. Collective to build."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self.pending = None

    def save(self, path: str, model, optimizer, step: int, *, data=None,
             keep: int = 0) -> tuple[int, str] | None:
        """Start saving as :func:`save_checkpoint` does, after the save before it finished (one in
        flight at a time: one staging copy); returns that one's (step, error) when it failed, else
        None. Collective."""
        failed = self.wait()
        state = _staged(model, optimizer, step, data)
        _clear(path)
        future, error = None, None
        try:
            os.makedirs(path, exist_ok=True)
            future = dcp.async_save(state, checkpoint_id=path, process_group=self.group)
        except SAVE_ERRORS as e:
            error = _why(e)
        self.pending = self.writer.submit(self._written, future, path, step, error, keep)
        return failed

    def _written(self, future, path: str, step: int, error: str | None,
                 keep: int) -> tuple[int, str] | None:
        if future is not None:
            try:
                future.result()
            except SAVE_ERRORS as e:
                error = error or _why(e)
        error = finish(path, step, error, keep=keep, group=self.group)
        return None if error is None else (step, error)

    def wait(self) -> tuple[int, str] | None:
        """Block until the save in flight (if any) has its manifest; its (step, error) if it failed.
        Call it on every rank before reading a checkpoint back, and before the process group
        closes."""
        pending, self.pending = self.pending, None
        return pending.result() if pending is not None else None

    def close(self) -> tuple[int, str] | None:
        """:meth:`wait`, then stop the writer thread."""
        failed = self.wait()
        self.writer.shutdown()
        return failed


STAGING_STATES = 3
"""copies of each parameter a rank's state holds at most: the weights and AdamW's two moments"""


def async_checkpointer(mode: str, params, *, device: str) -> AsyncCheckpointer | None:
    """The background writer that ``--async-checkpoint`` ``mode`` asks for: "on", "off" (None: saves
    block), or "auto": on where it pays, training on an accelerator (``device`` not "cpu"), whose
    host cores the writer then has to itself, and where the staging copy fits: this host's available
    memory holds every local rank's copy (its ``params`` and optimizer state, :data:`STAGING_STATES`
    times the local weights) twice over; said in one line where it does not. On CPU the writer takes
    its time from the training's cores (BENCHMARKS.md: the stall per save drops 5x, the run's time
    only when cores are spare). Host memory is not in the plan's cost model (device memory only).
    Collective."""
    if mode == "off" or (mode == "auto" and device == "cpu"):
        return None
    if mode == "auto":
        local = sum(p.to_local().nbytes if isinstance(p, DTensor) else p.nbytes for p in params)
        need = 2 * STAGING_STATES * local * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if ((short := _agree(None if need <= available_host_memory()
                             else fmt_bytes(need))) is not None):
            if dist.get_rank() == 0:
                print(f"checkpoints saved synchronously: twice the staging copies ({short}: every "
                      "local rank's weights and optimizer state) exceed the available host memory "
                      "(--async-checkpoint on forces it)", flush=True)
            return None
    return AsyncCheckpointer()


def available_host_memory() -> float:
    """Bytes of host memory available (Linux's MemAvailable; infinite where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return math.inf


def _why(e: BaseException) -> str:
    """One line: the error, or the first rank's underlying one of a DCP failure (without the ranks'
    tracebacks)."""
    failures = getattr(e, "failures", None)
    e = next(iter(failures.values()))[0] if failures else e
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _agree(error: str | None, group=None) -> str | None:
    """The first rank's error among every rank's (None: none failed). Collective over ``group``
    (default: the world)."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error, group=group)
    return next((e for e in errors if e), None)


def _write_manifest(path: str, manifest: dict) -> str | None:
    """Write the manifest atomically (a temporary file, synced, then renamed); None, or why it
    failed."""
    tmp = os.path.join(path, MANIFEST + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, MANIFEST))
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def prune(ckpt_dir: str, *, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints, and the unfinished ones older than
    the newest."""
    done = checkpoints(ckpt_dir)
    newest = int(os.path.basename(done[0]).removeprefix("step_")) if done else 0
    unfinished = [os.path.join(ckpt_dir, d) for d in os.listdir(ckpt_dir)
                  if re.fullmatch(r"step_\d+", d) and int(d.removeprefix("step_")) < newest
                  and os.path.join(ckpt_dir, d) not in done]
    for path in done[keep:] + unfinished:
        shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path: str, model, optimizer, *, data=None) -> int:
    """Read a checkpoint written by :func:`save_checkpoint` into ``model``, ``optimizer`` and the
    ``data`` stream (without a saved position, the stream counts from the step); returns its
    step."""
    stages = isinstance(model, PipelineStages)
    model_sd, optim_sd = _states(model, optimizer)
    like = {"model": by_name(model_sd, stages), "step": 0, "optim": by_name(optim_sd, stages)}
    if (data is not None
        and "data.step" in dcp.FileSystemReader(path).read_metadata().state_dict_metadata):
        like["data"] = data.state_dict()
    state = dcp_layout(like)
    dcp.load(state, checkpoint_id=path)
    state = restore_layout(state, like)
    if "data" in state:
        data.load_state_dict(state["data"])
    model_state = by_stage(state["model"], model_sd, stages)
    set_state_dict(model, optimizer, model_state_dict=model_state,
                   optim_state_dict=by_stage(state["optim"], optim_sd, stages), options=FLAT)
    return state["step"]
