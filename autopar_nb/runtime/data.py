"""Batches and the loss: synthetic data and a default loss when the cell defines none, and the pieces of a step that
depend on a batch's structure.

Conventions for a cell's own ``loss_fn(model, batch)`` and ``make_batch(step, rank)``:

* ``rank`` is the data-parallel rank (TP and pipeline ranks of one replica get the same batch); tensors are split
  along dim 0 into ``plan.batch.micro_batches`` micro-batches, so dim 0 must be the batch dimension.
* with pipelining, ``loss_fn`` must call ``model`` exactly once: the first stage receives the arguments of that call
  (found by calling ``loss_fn`` with a stand-in model, :func:`model_call`), and the last stage evaluates ``loss_fn``
  with the model call answered by its output. The loss should be a mean over the micro-batch (the schedules divide
  gradients by the number of micro-batches).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


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
    """``n`` micro-batches along dim 0 (``tensor_split``, as the pipeline schedules split their inputs)."""
    if n == 1:
        return [batch]
    return [tree_map(lambda t, i=i: t.tensor_split(n)[i], batch) for i in range(n)]


def concat_batches(batches: list):
    """The inverse of :func:`split_batch` across data-parallel ranks (for SyncBatchNorm references)."""
    first = batches[0]
    if isinstance(first, dict):
        return {k: concat_batches([b[k] for b in batches]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(concat_batches([b[i] for b in batches]) for i in range(len(first)))
    return torch.cat(batches) if isinstance(first, torch.Tensor) else first


def synthetic_batch(example, step: int, rank: int, *, batch_size: int, int_high: int):
    """Data shaped like ``example`` (the cell's example inputs): a fixed random batch of ``batch_size`` samples for
    each (step, data-parallel rank); integer tensors (token ids) drawn from ``[0, int_high)``."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)

    def like(t):
        shape = (batch_size, *t.shape[1:])
        if t.is_floating_point():
            return torch.randn(shape, generator=g).to(t.dtype)
        return torch.randint(0, int_high, shape, generator=g, dtype=t.dtype)

    return tree_map(like, example)


def default_loss(model, batch, *, causal: bool = True):
    """The loss when the cell defines none. A Hugging Face output with ``.loss`` (the batch had ``labels``) is used
    as it is; otherwise, for token ids in and ``(batch, seq, vocab)`` logits out, cross-entropy against the ids —
    the next token's for a causal LM (``causal``), the same position's for a masked LM — else the mean squared
    output."""
    out = model(**batch) if isinstance(batch, dict) else model(*batch) if isinstance(batch, tuple) else model(batch)
    if getattr(out, "loss", None) is not None:
        return out.loss
    logits = out.logits if hasattr(out, "logits") else out
    if hasattr(logits, "to_tuple"):  # another Hugging Face output (e.g. last_hidden_state first)
        logits = logits.to_tuple()[0]
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    ids = first_tensor(batch)
    if logits.dim() == 3 and ids.dim() == 2 and not ids.is_floating_point() and logits.shape[:2] == ids.shape:
        if causal:
            logits, ids = logits[:, :-1], ids[:, 1:]
        return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    return logits.float().pow(2).mean()


def default_batch_size(example, *, dp: int, global_batch: int) -> int:
    """Samples per data-parallel rank and step for synthetic data: the plan's global batch over ``dp``, else the
    example's own batch size."""
    n = int(first_tensor(example).shape[0])
    return global_batch // dp if global_batch > 1 and global_batch % dp == 0 else n


def smallest_table(model: nn.Module) -> int:
    """Rows of the model's smallest embedding table (synthetic ids stay below it), 2 when it has none."""
    tables = [m.num_embeddings for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    return min(tables) if tables else 2


def is_causal_lm(model: nn.Module) -> bool:
    """Whether the default loss should predict the next token: not for Hugging Face encoders (masked LMs) and
    encoder-decoders, which say so in their config."""
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
    """The arguments ``loss_fn(model, batch)`` passes to the model: the first pipeline stage's inputs."""
    def record(*args, **kwargs):
        raise ModelCalled(args, kwargs)

    try:
        loss_fn(record, batch)
    except ModelCalled as call:
        return call.args[0], call.args[1]
    raise ValueError("loss_fn(model, batch) never called model(...); pipelining needs loss_fn to call the model once")

