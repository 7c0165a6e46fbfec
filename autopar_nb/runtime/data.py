"""Batches and the loss: the cell's dataset read by a DataLoader, synthetic data and a default loss
when the cell defines none, and the pieces of a step that depend on a batch's structure.

A cell's ``dataset`` (map-style or iterable) is read by :class:`DataStream`: a ``DataLoader`` over a
:class:`DataSampler` (torch's ``DistributedSampler`` of the data-parallel ranks only: TP and
pipeline ranks of one replica read the same samples), one permutation per epoch, and a position
(epoch, samples of it consumed) that checkpoints keep, so a resumed run reads the next unseen
sample, at the same or another data-parallel degree.

Conventions for a cell's own ``loss_fn(model, batch)`` and ``make_batch(step, rank)``:

* ``rank`` is the data-parallel rank (TP and pipeline ranks of one replica get the same batch);
  tensors are split along dim 0 into ``plan.batch.micro_batches`` micro-batches, so dim 0 must be
  the batch dimension.
* with pipelining, ``loss_fn`` must call ``model`` exactly once: the first stage receives the
  arguments of that call (found by calling ``loss_fn`` with a stand-in model, :func:`model_call`),
  and the last stage evaluates ``loss_fn`` with the model call answered by its output. The loss
  should be a mean over the micro-batch (the schedules divide gradients by the number of
  micro-batches).
"""

from __future__ import annotations

import dataclasses
import os
from itertools import islice

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, default_collate
from torch.utils.data.distributed import DistributedSampler


def tree_map(fn, batch):
    """``fn`` applied to every tensor of a (nested) tuple/list/dict batch."""
    if isinstance(batch, dict):
        return {k: tree_map(fn, v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(tree_map(fn, v) for v in batch)
    return fn(batch) if isinstance(batch, torch.Tensor) else batch


def to_device(batch, device):
    """The batch with every tensor moved to ``device``."""
    return tree_map(lambda t: t.to(device), batch)


def first_tensor(batch):
    """The first tensor of a batch (the token ids of a language model)."""
    while isinstance(batch, (tuple, list, dict)):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return batch


def split_batch(batch, n: int) -> list:
    """``n`` micro-batches along dim 0 (``tensor_split``, as the pipeline schedules split their
    inputs); a dataclass of tensors (context parallelism's ``SequenceShard``) field by field."""
    if n == 1:
        return [batch]
    if dataclasses.is_dataclass(batch):
        parts = {f.name: split_batch(getattr(batch, f.name), n) for f in dataclasses.fields(batch)}
        return [dataclasses.replace(batch, **{name: p[i] for name, p in parts.items()})
                for i in range(n)]
    return [tree_map(lambda t, i=i: t.tensor_split(n)[i], batch) for i in range(n)]


def concat_batches(batches: list):
    """The inverse of :func:`split_batch` across data-parallel ranks (for SyncBatchNorm
    references)."""
    first = batches[0]
    if isinstance(first, dict):
        return {k: concat_batches([b[k] for b in batches]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(concat_batches([b[i] for b in batches]) for i in range(len(first)))
    return torch.cat(batches) if isinstance(first, torch.Tensor) else first


def synthetic_batch(example, step: int, rank: int, *, batch_size: int, int_high):
    """Data shaped like ``example`` (the cell's example inputs): a fixed random batch of
    ``batch_size`` samples for each (step, data-parallel rank); integer tensors from ``[0, high)``,
    ``high`` their entry of ``int_high`` (or it)."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)

    def like(t, high):
        if isinstance(t, dict):
            return {k: like(v, high[k] if isinstance(high, dict) else high) for k, v in t.items()}
        if isinstance(t, (tuple, list)):
            return type(t)(like(v, high[i] if isinstance(high, (tuple, list)) else high)
                           for i, v in enumerate(t))
        if not isinstance(t, torch.Tensor):
            return t
        shape = (batch_size, *t.shape[1:])
        if t.is_floating_point():
            return torch.randn(shape, generator=g).to(t.dtype)
        return torch.randint(0, high, shape, generator=g, dtype=t.dtype)

    return like(example, int_high)


def call_model(model, batch):
    """``model`` called on a batch: keyword arguments for a dict, positional ones for a tuple, else
    the batch."""
    return (model(**batch) if isinstance(batch, dict) else model(*batch) if isinstance(batch, tuple)
            else model(batch))


def default_loss(model, batch, *, causal: bool = True):
    """The loss when the cell defines none. A Hugging Face output with ``.loss`` (the batch had
    ``labels``) is used as it is; otherwise, for token ids in and ``(batch, seq, vocab)`` logits
    out, cross-entropy against the ids — the next token's for a causal LM (``causal``), the same
    position's for a masked LM — else the mean squared output."""
    out = call_model(model, batch)
    if getattr(out, "loss", None) is not None:
        return out.loss
    logits = out.logits if hasattr(out, "logits") else out
    if hasattr(logits, "to_tuple"):  # another Hugging Face output (e.g. last_hidden_state first)
        logits = logits.to_tuple()[0]
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    ids = first_tensor(batch)
    if (logits.dim() == 3 and ids.dim() == 2 and not ids.is_floating_point()
        and logits.shape[:2] == ids.shape):
        if causal:
            logits, ids = logits[:, :-1], ids[:, 1:]
        return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    return logits.float().pow(2).mean()


def default_batch_size(example, *, dp: int, global_batch: int) -> int:
    """Samples per data-parallel rank and step for synthetic data: the plan's global batch over
    ``dp``, else the example's own batch size."""
    n = int(first_tensor(example).shape[0])
    return global_batch // dp if global_batch > 1 and global_batch % dp == 0 else n


def smallest_table(model: nn.Module) -> int:
    """Rows of the model's smallest embedding table, 2 when it has none: the bound of synthetic ids
    for an integer input that indexes no table (``export/synthetic_ids.py``)."""
    tables = [m.num_embeddings for m in model.modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    return min(tables) if tables else 2


def is_causal_lm(model: nn.Module) -> bool:
    """Whether the default loss should predict the next token: not for Hugging Face encoders (masked
    LMs) and encoder-decoders, which say so in their config."""
    config = getattr(model, "config", None)
    if not hasattr(config, "is_encoder_decoder"):  # not a Hugging Face model
        return True
    if getattr(config, "is_encoder_decoder", False):
        return False
    name = type(model).__name__
    return bool(getattr(config, "is_decoder", False)) or "CausalLM" in name or "LMHead" in name


class ModelCalled(Exception):
    """Raised by the stand-in model that :func:`model_call` hands to ``loss_fn``."""


def model_call(loss_fn, batch) -> tuple[tuple, dict]:
    """The arguments ``loss_fn(model, batch)`` passes to the model: the first pipeline stage's
    inputs."""
    def record(*args, **kwargs):
        raise ModelCalled(args, kwargs)

    try:
        loss_fn(record, batch)
    except ModelCalled as call:
        return call.args[0], call.args[1]
    raise ValueError("loss_fn(model, batch) never called model(...); pipelining needs loss_fn to "
                     "call the model once")



def first_batch(dataset, *, batch_size: int, collate_fn=None):
    """The dataset's first ``batch_size`` samples, collated (``collate_fn``, else torch's default):
    a batch with the shapes of every step's (the pipeline traces its stages on it)."""
    samples = list(islice(iter(dataset), batch_size)) if isinstance(dataset, IterableDataset) else [
        dataset[i] for i in range(min(batch_size, len(dataset)))]
    return (collate_fn or default_collate)(samples)


class DataSampler(DistributedSampler):
    """torch's ``DistributedSampler`` over ``num_replicas`` data-parallel ranks, resumable in the
    middle of an epoch.

    Each epoch draws one order of the dataset (``randperm`` seeded ``seed + epoch``, as
    ``DistributedSampler`` does); ``start`` samples of it were consumed already (by every rank
    together: a checkpoint's position). The rest is dealt round-robin, rank ``r`` taking positions
    ``start + r``, ``start + r + num_replicas``, ..., whole global batches only (``batch_size`` per
    rank): one step of the ranks together reads a contiguous block of the order, whatever
    ``num_replicas`` is, so a run resumed with another data-parallel degree neither repeats nor
    skips."""

    def __init__(self, dataset, *, num_replicas: int, rank: int, batch_size: int,
                 shuffle: bool = True, seed: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=True)
        self.batch_size = batch_size
        self.start = 0

    def order(self) -> list[int]:
        """The epoch's order of sample indices."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def __iter__(self):
        per_step = self.batch_size * self.num_replicas
        end = self.start + (len(self.dataset) - self.start) // per_step * per_step
        return iter(self.order()[self.start + self.rank:end:self.num_replicas])

    def __len__(self) -> int:
        return (len(self.dataset) - self.start) // (self.batch_size
                                                    * self.num_replicas) * self.batch_size


class IterableShard(IterableDataset):
    """An iterable dataset's share for one data-parallel rank: the stream (``set_epoch`` called when
    the dataset has it) read in global batches of ``batch_size * num_replicas`` samples, rank ``r``
    keeping samples ``r``, ``r + num_replicas``, ... of each (the layout :class:`DataSampler`
    gives), the first ``start`` samples skipped (read and dropped: a stream cannot seek) and a last
    incomplete global batch dropped."""

    def __init__(self, dataset, *, num_replicas: int, rank: int, batch_size: int):
        self.dataset, self.num_replicas, self.rank, self.batch_size = (dataset, num_replicas, rank,
                                                                       batch_size)
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        items, per_step = (islice(iter(self.dataset), self.start, None),
                           self.batch_size * self.num_replicas)
        while len(chunk := list(islice(items, per_step))) == per_step:
            yield from chunk[self.rank::self.num_replicas]


def default_num_workers() -> int:
    """DataLoader worker processes per rank: the cores this node gives each rank beyond its own, at
    most 4 (0: the rank loads its batches itself)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(0, min(4, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1))


class DataStream:
    """This data-parallel rank's batches from the cell's ``dataset``, as ``make_batch(step, rank)``:
    a ``DataLoader`` of ``batch_size`` samples per step over a :class:`DataSampler` (map-style
    datasets) or an :class:`IterableShard` (iterable ones; read by the rank itself: worker processes
    would each replay the stream), ``collate_fn`` the cell's or torch's default; worker processes
    (``num_workers``) prefetch ``prefetch_factor`` batches each, into pinned memory on GPUs
    (``pin_memory``).

    Its position (``state_dict``: the epoch, the samples of it the data-parallel ranks consumed
    together, the next step) goes into every checkpoint; a resumed run continues with the next
    unseen sample. Asking for the step just handed out again returns the same batch (the pipeline
    traces its stages on step 0's)."""

    def __init__(self, dataset, *, batch_size: int, dp: int, dp_rank: int, collate_fn=None,
                 seed: int = 0, shuffle: bool = True, num_workers: int = 0,
                 pin_memory: bool = False, prefetch_factor: int = 2):
        iterable = isinstance(dataset, IterableDataset)
        if not iterable and len(dataset) < batch_size * dp:
            raise ValueError(f"the dataset has {len(dataset)} samples, fewer than one step reads: "
                             f"batch_size({batch_size}) x data-parallel ranks({dp}) = "
                             f"{batch_size * dp}")
        self.global_batch = batch_size * dp
        self.sampler = (IterableShard(dataset, num_replicas=dp, rank=dp_rank, batch_size=batch_size)
                        if iterable else DataSampler(dataset, num_replicas=dp, rank=dp_rank,
                                                     batch_size=batch_size, shuffle=shuffle,
                                    seed=seed))
        self.num_workers = 0 if iterable else num_workers
        self.loader = DataLoader(self.sampler if iterable else dataset, batch_size=batch_size,
                                 sampler=None if iterable else self.sampler, collate_fn=collate_fn,
                                 drop_last=True, num_workers=self.num_workers,
                                 pin_memory=pin_memory, persistent_workers=self.num_workers > 0,
                                 prefetch_factor=prefetch_factor if self.num_workers > 0 else None)
        self.epoch, self.consumed, self.next_step = 0, 0, 0
        self.last: tuple = (None, None)  # (step, batch) handed out last
        self.batches = None  # the loader's iterator over the current epoch

    def __call__(self, step: int, rank: int):
        if step == self.last[0]:
            return self.last[1]
        # a checkpoint without a data position (an older one): from the step count
        if step != self.next_step:
            self.load_state_dict({"epoch": 0, "consumed": 0, "step": 0}, skip_steps=step)
        while True:
            if self.batches is None:
                self.sampler.set_epoch(self.epoch)
                self.sampler.start = self.consumed
                self.batches = iter(self.loader)
            try:
                batch = next(self.batches)
                break
            except StopIteration:
                self.epoch, self.consumed, self.batches = self.epoch + 1, 0, None
        self.consumed += self.global_batch
        self.next_step, self.last = step + 1, (step, batch)
        return batch

    def state_dict(self) -> dict:
        """The position: ``{"epoch", "consumed", "step"}`` (samples of the epoch read by all ranks;
        the next step)."""
        return {"epoch": self.epoch, "consumed": self.consumed, "step": self.next_step}

    def load_state_dict(self, state: dict, *, skip_steps: int = 0) -> None:
        """Continue from ``state`` (:meth:`state_dict`'s), ``skip_steps`` global batches further."""
        epoch, consumed = (int(state["epoch"]),
                           int(state["consumed"]) + skip_steps * self.global_batch)
        size = None if isinstance(self.sampler, IterableShard) else len(self.sampler.dataset)
        per_epoch = size // self.global_batch * self.global_batch if size else None
        while per_epoch and consumed >= per_epoch and skip_steps:  # whole epochs skipped
            epoch, consumed = epoch + 1, consumed - per_epoch
        self.epoch, self.consumed, self.next_step = epoch, consumed, int(state["step"]) + skip_steps
        self.last, self.batches = (None, None), None
