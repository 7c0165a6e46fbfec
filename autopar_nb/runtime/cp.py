"""Context parallelism (ring attention): every sample's sequence split over the ``cp`` ranks of a
model replica, each attention computed by torch's ring attention
(``torch.distributed.tensor.experimental.context_parallel``).

torch's ``context_parallel`` shards the batch along the sequence (head-tail load balancing for
causal attention), replaces ``F.scaled_dot_product_attention`` for the duration of a step and hands
the attention op to its ring code (``_templated_ring_attention`` and its backward: K/V all-gathered
over the cp ranks, dK/dV passed round the ring, partial outputs merged by their logsumexp). torch
2.13 registers that hand-over for the CUDA kernels only (flash, efficient, cuDNN); on CPU, SDPA runs
``aten._scaled_dot_product_flash_attention_for_cpu``, for which DTensor has no sharding rule ("does
not have a sharding strategy registered"). :func:`enable_cpu_ring_attention` registers the CPU
kernel and its backward with torch's own ring functions, as torch registers the CUDA ones; the
communication stays torch's.

The loss of a cp rank is the sum over its tokens divided by the tokens of the whole sample times cp:
data parallelism averages gradients over the ``dp * cp`` ranks (the ``"dp_cp"`` mesh dim), which
gives the gradient of the mean over every token of the batch.

Positions: a model that numbers its tokens itself (``torch.arange`` over the sequence it sees)
would number each rank's part from 0. A model whose forward takes ``position_ids`` (Hugging Face's
decoders: given, they number nothing) is called with each token's place in the whole sequence,
sharded by ``context_parallel`` with the tokens (the same load balancing), as torchtitan shards its
rotary table.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp
from torch.nn.parallel import DistributedDataParallel as DDP

from .pp_graph import masks_as_in_eager

SEQ_DIM = 2
"""the sequence dim of SDPA's (batch, heads, seq, head_dim) query, key and value"""
IGNORE_INDEX = -100
"""cross-entropy's ignore_index: the label of the last position of a sample (no next token)"""
POSITIONS = "position_ids"
"""the forward argument through which a model takes its tokens' positions (Hugging Face's name)"""


def _sharded(local: torch.Tensor, mesh) -> DTensor:
    """A local result of the ring attention as the sequence-sharded DTensor DTensor's dispatch
    returns."""
    shape = list(local.shape)
    shape[SEQ_DIM] *= mesh.size()
    spec = DTensorSpec(mesh, (Shard(SEQ_DIM),),
                       TensorMeta(torch.Size(shape), local.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=local.requires_grad)


def _cpu_flash_ring(op_call, args, kwargs):
    """``aten._scaled_dot_product_flash_attention_for_cpu`` on sequence-sharded DTensors: torch's
    ring attention with the CPU kernel (which returns the logsumexp the ring merge needs)."""
    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    query, key, value, *rest = info.local_args
    kw = dict(info.local_kwargs)
    dropout_p = rest[0] if rest else kw.get("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kw.get("is_causal", False)
    if kw.get("attn_mask") is not None:
        raise NotImplementedError("context parallelism takes attention without attn_mask "
                                  "(is_causal, or no mask)")
    mesh = info.compute_mesh
    out, lse = torch_cp._templated_ring_attention(
        mesh.get_group(), SEQ_DIM,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, query, key, value,
        is_causal=is_causal, dropout_p=dropout_p, scale=kw.get("scale"))
    return _sharded(out, mesh), _sharded(lse, mesh)


def _cpu_flash_ring_backward(op_call, args, kwargs):
    """The backward of :func:`_cpu_flash_ring`: torch's ring backward with the CPU kernel's
    backward."""
    info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    grad_out, query, key, value, out, lse, dropout_p, is_causal = info.local_args[:8]
    mesh = info.compute_mesh
    grads = torch_cp._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out, grad_out_name="grad_out", query=query, key=key, value=value, out=out,
        logsumexp=lse, is_causal=is_causal, dropout_p=dropout_p,
        scale=info.local_kwargs.get("scale"))
    return tuple(_sharded(g, mesh) for g in grads[:3])


def enable_cpu_ring_attention() -> None:
    """Register the CPU attention kernel (and its backward) with torch's context-parallel
    dispatcher, beside the CUDA kernels torch registers itself; ``context_parallel`` then runs ring
    attention on CPU processes too."""
    torch_cp.custom_ops[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default] = (
        _cpu_flash_ring)
    torch_cp.custom_ops[
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    ] = _cpu_flash_ring_backward


@dataclass
class SequenceShard:
    """This cp rank's part of a micro-batch: token ids and their labels, load-balanced along the
    sequence."""

    inputs: torch.Tensor
    """(batch, seq / cp) token ids"""
    labels: torch.Tensor
    """(batch, seq / cp) the token each position predicts; IGNORE_INDEX where there is none"""
    positions: torch.Tensor
    """(1 or batch, seq / cp) each token's place in its whole sequence (one row for every sample, or
    one each)"""
    tokens: torch.Tensor
    """(batch,) labelled positions of each whole sample (every cp rank's together)"""


def sequence_tensor(batch) -> torch.Tensor:
    """The one (batch, seq) tensor of token ids a context-parallel model is called with; ValueError
    otherwise."""
    ids = batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 1 else batch
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        raise ValueError("context parallelism needs batches of one (batch, seq) tensor of token "
                         f"ids, got {type(batch).__name__}: split the sequence of several inputs "
                         "by hand, or use cp=1")
    return ids


@contextlib.contextmanager
def sequence_shards(cp_mesh, batch, *, causal: bool, per_sample: bool = False):
    """Run a forward and backward inside this (with ... as shard:): the micro-batch's sequences
    split over ``cp_mesh`` by torch's ``context_parallel`` (which also routes SDPA to its ring
    attention for the duration). The labels are built before the split (the next token for a causal
    LM, the same one otherwise), so the tokens that cross a shard boundary keep theirs.
    ``per_sample``: positions in one row per sample, which a pipeline schedule splits into
    micro-batches with the tokens. ``batch`` None (a pipeline stage between the first and the last,
    which reads no data): nothing to split, yet its attention runs as the ring (yields None)."""
    if batch is None:
        # context_parallel shards at least one buffer: a stand-in of 2 * cp positions, split as the
        # sequences are
        buffers, shard = [torch.zeros(1, 2 * cp_mesh.size(), device=cp_mesh.device_type)], None
    else:
        ids = sequence_tensor(batch)
        labels = ids.clone() if not causal else torch.cat(
            [ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)
        # one row for every sample, as a model numbering its own positions makes them (so the rotary
        # tables or position embeddings it computes from them keep the shapes the cost model
        # captured)
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        shard = SequenceShard(ids.clone(), labels, positions.repeat(ids.shape[0], 1) if per_sample
                              else positions, (labels != IGNORE_INDEX).sum(1))
        buffers = [shard.inputs, shard.labels, shard.positions]
    if cp_mesh.device_type == "cpu":
        enable_cpu_ring_attention()
    # a rank's positions jump where its head chunk meets its tail chunk: Hugging Face's masking
    # would take that for two sequences packed into one row and mask them apart (each row is one
    # sequence here)
    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                          no_restore_buffers=set(buffers)), masks_as_in_eager(own_positions=True):
        yield shard


def shard_of(shard, batch):
    """What ``shard(batch)`` (a :func:`sequence_shards`) yields, outside its block: this rank's part
    of the sequences, for the pipeline's trace (which runs no attention across ranks)."""
    with shard(batch) as piece:
        return piece


def takes_positions(model) -> bool:
    """Whether ``model``'s forward takes ``position_ids`` (read from its signature, through a DDP
    wrapper): then context parallelism passes each token's global position."""
    inner = model.module if isinstance(model, DDP) else model
    try:
        return POSITIONS in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature Python can read
        return False


def sequence_loss(model, shard: SequenceShard, *, cp: int,
                  positions: bool | None = None) -> torch.Tensor:
    """The default loss (cross-entropy against the labels) on this cp rank's tokens, scaled so that
    the average over the ``dp * cp`` ranks is the mean over the whole batch (module docstring).
    ``positions``: whether the model is given ``position_ids`` (None: read from its forward,
    :func:`takes_positions`; a pipeline's first stage is called as the whole model was, which the
    loss cannot read from the stage)."""
    given = takes_positions(model) if positions is None else positions
    out = model(shard.inputs, **({POSITIONS: shard.positions} if given else {}))
    logits = out.logits if hasattr(out, "logits") else out
    loss = F.cross_entropy(logits.flatten(0, 1).float(), shard.labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss * cp / shard.tokens.sum()
