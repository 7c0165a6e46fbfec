"""Data and loss when the cell defines none, and the pieces of a step that depend on the batch's structure.

The default ``make_batch``/``loss_fn`` are kept as source text: verify executes it, and the exported script embeds
it verbatim, so both train on exactly the same data with exactly the same loss.

Conventions for a cell's own ``loss_fn(model, batch)`` and ``make_batch(step, rank)``:

* ``rank`` is the data-parallel rank (TP and pipeline ranks of one replica get the same batch); tensors are split
  along dim 0 into ``plan.batch.micro_batches`` micro-batches, so dim 0 must be the batch dimension.
* with pipelining, ``loss_fn`` must call ``model`` exactly once: the first stage receives the arguments of that call
  (found by calling ``loss_fn`` with a stand-in model, :func:`model_call`), and the last stage evaluates ``loss_fn``
  with the model call answered by its output. The loss should be a mean over the micro-batch (the schedules divide
  gradients by the number of micro-batches).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

DEFAULT_DATA_LOSS = '''\
def make_batch(step, rank):
    """Synthetic data shaped like {inputs}: a fixed random batch for each (step, data-parallel rank)."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)

    def like(t):
        shape = (BATCH_SIZE, *t.shape[1:])
        if t.is_floating_point():
            return torch.randn(shape, generator=g).to(t.dtype)
        return torch.randint(0, INT_HIGH, shape, generator=g, dtype=t.dtype)

    if isinstance({inputs}, dict):
        return {{k: like(v) for k, v in {inputs}.items()}}
    if isinstance({inputs}, (tuple, list)):
        return tuple(like(v) for v in {inputs})
    return like({inputs})


def loss_fn(model, batch):
    """Next-token cross-entropy for a language model (token ids in, logits out), else mean squared output."""
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, tuple):
        out = model(*batch)
    else:
        out = model(batch)
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0] if isinstance(batch, tuple) else batch
    if out.dim() == 3 and first.dim() == 2 and not first.is_floating_point():
        return F.cross_entropy(out.flatten(0, 1).float(), first.roll(-1, 1).flatten())
    return out.float().pow(2).mean()
'''


def default_constants(model: nn.Module, example_inputs: Any, *, dp: int, global_batch: int) -> dict[str, int]:
    """``BATCH_SIZE`` (per data-parallel rank) and ``INT_HIGH`` (ids drawn below the smallest embedding table)."""
    first = example_inputs
    while isinstance(first, (tuple, list, dict)):
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    batch = global_batch // dp if global_batch > 1 and global_batch % dp == 0 else int(first.shape[0])
    tables = [m.num_embeddings for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    return {"BATCH_SIZE": batch, "INT_HIGH": min(tables) if tables else 2}


def add_default_data_loss(ns: dict[str, Any], *, inputs_var: str, constants: dict[str, int]) -> None:
    """Define the default ``make_batch``/``loss_fn`` in ``ns`` (the cell's namespace)."""
    import torch.nn.functional as F

    ns.setdefault("torch", torch)
    ns.setdefault("F", F)
    ns.update(constants)
    exec(compile(DEFAULT_DATA_LOSS.format(inputs=inputs_var), "<autopar defaults>", "exec"), ns)


def tree_map(fn, batch):
    if isinstance(batch, dict):
        return {k: tree_map(fn, v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(tree_map(fn, v) for v in batch)
    return fn(batch) if isinstance(batch, torch.Tensor) else batch


def split_batch(batch: Any, n: int) -> list[Any]:
    """``n`` micro-batches along dim 0 (``tensor_split``, as the pipeline schedules split their inputs)."""
    if n == 1:
        return [batch]
    pieces = []
    for i in range(n):
        pieces.append(tree_map(lambda t, i=i: t.tensor_split(n)[i], batch))
    return pieces


def concat_batches(batches: list[Any]) -> Any:
    """The inverse of :func:`split_batch` across data-parallel ranks (for SyncBatchNorm references)."""
    first = batches[0]
    if isinstance(first, dict):
        return {k: concat_batches([b[k] for b in batches]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(concat_batches([b[i] for b in batches]) for i in range(len(first)))
    return torch.cat(batches) if isinstance(first, torch.Tensor) else first


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
