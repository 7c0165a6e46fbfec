"""Pretrained Hugging Face weights: a cell that calls ``from_pretrained`` means "start from these
weights".

On the meta device (capture, and the exported script's ``meta_init``) transformers refuses
``from_pretrained``: it wants to read weights that meta tensors cannot hold. :class:`FromConfig`
answers those calls with the model the checkpoint's config describes (``_from_config``: the same
modules, parameter names and shapes, no weights) and notes which checkpoint each came from; once the
model is parallelised, :func:`load_pretrained` reads into each rank only its shards (DCP's Hugging
Face storage reader), whatever the plan's TP, FSDP and pipeline stages, renamed and merged as
transformers' own conversion mapping says (:class:`HFNames`: Mixtral's experts, stored one by one,
stacked from the experts each rank holds); :func:`save_hf` writes the trained weights back in the
same format.
"""

from __future__ import annotations

import copy
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from .checkpoint import PipelineStages, by_name, by_stage
from .init import canonical_name
from .layouts import dcp_layout, restore_layout

MODEL_KWARGS = ("torch_dtype", "dtype", "attn_implementation")
"""``from_pretrained`` keywords that describe the model itself (``_from_config`` takes them)"""
LOADING_KWARGS = ("device_map", "low_cpu_mem_usage", "use_safetensors", "weights_only",
                  "state_dict", "ignore_mismatched_sizes", "output_loading_info", "offload_folder",
                  "offload_state_dict", "quantization_config", "key_mapping", "tp_plan", "tp_size",
                  "device_mesh", "variant", "gguf_file")
"""keywords about how weights are read, which a model built from its config has no use for"""


class FromConfig:
    """While started (or as a context manager), ``PreTrainedModel.from_pretrained(name, ...)``
    builds ``cls._from_config(config)``, the checkpoint's config with the call's config keywords
    applied, and appends ``name`` to :attr:`found`. Without transformers installed, nothing
    changes."""

    def __init__(self):
        self.found: list[str] = []
        self._original = None

    def start(self) -> FromConfig:
        try:
            from transformers import PreTrainedModel
        except ImportError:
            return self
        self._original = PreTrainedModel.__dict__["from_pretrained"]
        PreTrainedModel.from_pretrained = classmethod(self._from_config)
        return self

    def stop(self) -> None:
        if self._original is not None:
            from transformers import PreTrainedModel

            PreTrainedModel.from_pretrained, self._original = self._original, None

    def __enter__(self) -> FromConfig:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _from_config(self, cls, name, *args, **kwargs):
        from transformers import AutoConfig

        model_kw = {k: kwargs.pop(k) for k in MODEL_KWARGS if k in kwargs}
        for k in LOADING_KWARGS:
            kwargs.pop(k, None)
        config = kwargs.pop("config", None)
        if config is None or isinstance(config, str | os.PathLike):
            config, kwargs = AutoConfig.from_pretrained(config or name, *args,
                                                        return_unused_kwargs=True, **kwargs)
        for key, value in kwargs.items():  # what from_pretrained sets on a config it is handed
            if hasattr(config, key):
                setattr(config, key, value)
        dtype = model_kw.pop("dtype", None) or model_kw.pop("torch_dtype", None)
        if dtype not in (None, "auto"):
            model_kw["torch_dtype"] = dtype
        self.found.append(os.fspath(name))
        return cls._from_config(config, **model_kw)


def tied_parameters(model) -> list[list[str]]:
    """Groups of parameter paths that are the same tensor (by identity), in model order."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [paths for paths in groups.values() if len(paths) > 1]


def _stored(path: str) -> tuple[HuggingFaceStorageReader, set[str]]:
    """The reader of the checkpoint folder ``path`` and the names it stores (read from the files'
    headers)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"from_pretrained({path!r}): sharded loading reads a local folder "
                                "of safetensors; download it first (huggingface-cli download "
                                f"{path} --local-dir DIR) and name DIR")
    reader = HuggingFaceStorageReader(path)
    return reader, set(reader.read_metadata().state_dict_metadata)


def _source(key: str, stored, ties) -> str | None:
    """The stored name parameter ``key`` is read from: its own, or that of a parameter tied to it
    (None: neither)."""
    return key if key in stored else next((n for group in ties if key in group for n in group
                                           if n in stored), None)


class HFNames:
    """How transformers names a model's weights from a checkpoint's (its conversion mapping, which
    ``from_pretrained`` applies as it loads): ``renamed``, model name -> the stored name it only
    renames (Mixtral's ``block_sparse_moe.gate`` is its ``mlp.gate``); ``merged``, model name ->
    (the converter, its source pattern -> the stored names it stacks, in expert order) for a weight
    built from several (Mixtral's ``experts.gate_up_proj`` is every expert's ``w1`` and ``w3``,
    stacked and concatenated). Empty for a model transformers does not convert."""

    def __init__(self, model, stored: set[str]):
        self.renamed: dict[str, str] = {}
        self.merged: dict[str, tuple] = {}
        try:
            from transformers import PreTrainedModel
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import (
                WeightConverter,
                WeightRenaming,
                dot_natural_key,
                rename_source_key,
            )
        except ImportError:
            return
        if not isinstance(model, PreTrainedModel):
            return
        mapping = get_model_conversion_mapping(model)
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        own = {canonical_name(k): True for k in model.state_dict()}
        # transformers' order: experts 0, 1, .., 10
        for key in sorted(stored - own.keys(), key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix,
                                                own)
            if target not in own:
                continue
            if pattern is None:
                self.renamed[target] = key
            else:
                converter = next(c for c in converters if pattern in c.source_patterns)
                self.merged.setdefault(target, (converter, {}))[1].setdefault(pattern,
                                                                              []).append(key)

    def names(self, stored: set[str]) -> set[str]:
        """The model's names the checkpoint holds: its own, renamed or merged."""
        return stored | self.renamed.keys() | self.merged.keys()


def check_pretrained(path: str, model, *, ties: list[list[str]] = (),
                     what: str = "from_pretrained") -> None:
    """Raise before anything runs where :func:`load_pretrained` could not read ``model``'s
    parameters from the checkpoint in ``path`` (a missing folder, names it does not store, renamed
    as transformers renames them), in one line that starts with ``what`` (where the checkpoint was
    named) and shows the first names on either side that do not match."""
    _, stored = _stored(path)
    hf = HFNames(model, stored)
    held = hf.names(stored)
    names = [canonical_name(n) for n, _ in model.named_parameters(remove_duplicate=False)]
    missing = [n for n in names if _source(n, held, ties) is None]
    if missing:
        used = {*names, *hf.renamed.values(),
                *(n for _, lists in hf.merged.values() for ns in lists.values()
                                                 for n in ns)}
        extra = sorted(stored - used)
        raise ValueError(
            f"{what}={path!r}: the checkpoint stores no weight named {missing[0]} (nor one tied to "
            "it)" + (f", nor {len(missing) - 1} more of the model's" if len(missing) > 1 else "")
            + (f"; it stores {len(extra)} names the model does not have, e.g. {extra[0]}" if extra
               else "")
            + ": name a checkpoint of this model (save_pretrained of the same class and config)")


def load_pretrained(path: str, parts: list, *, model=None, ties: list[list[str]] = ()) -> None:
    """Read the Hugging Face checkpoint in the folder ``path`` (``save_pretrained``'s safetensors)
    into the parallelised ``parts`` (this rank's pipeline stages, or the model): each rank reads its
    own shards. A parameter the checkpoint leaves out because it is tied (``ties``: groups of names
    that are one parameter; an output head tied to the embedding) reads its group's stored tensor,
    also where another pipeline stage holds that one. ``model``: the model as the cell built it (its
    class and config, which say how transformers renames and merges the checkpoint's weights:
    :class:`HFNames`; meta is enough); default ``parts[0]``."""
    stages = len(parts) > 1
    whole = PipelineStages(parts) if stages else parts[0]
    own = get_model_state_dict(whole)
    named = by_name(own, stages)
    reader, stored = _stored(path)
    hf = HFNames(parts[0] if model is None else model, stored)
    held = hf.names(stored)
    params = by_name({canonical_name(k): None
                      for k, _ in whole.named_parameters(remove_duplicate=False)}, stages)
    like, alias, copies, merged = {}, {}, {}, {}
    for key, tensor in named.items():
        # a buffer the checkpoint leaves out keeps what init computed
        if key not in params and key not in held:
            continue
        source = _source(key, held, ties)
        if source is None:
            raise ValueError(f"the checkpoint in {path} stores no weight named {key} (nor one tied "
                             "to it)")
        if source in hf.merged and source == key:
            merged[key] = tensor
        elif source != key and source in named:
            copies[key] = source
        else:  # its own, or held by another pipeline stage: read into this rank's copy
            stored_name = hf.renamed.get(source, source)
            like[stored_name], alias[stored_name] = tensor, key
    laid = dcp_layout(like)
    boxes = {key: _Merge(tensor, *hf.merged[key], reader.read_metadata())
             for key, tensor in merged.items()}
    reads = {name: t for box in boxes.values() for name, t in box.reads.items()}
    # one process too
    dcp.load({**laid, **reads}, storage_reader=reader, no_dist=not dist.is_initialized())
    state = {alias[k]: v for k, v in restore_layout(laid, like).items()}
    state |= {key: box.fill(reads, model or parts[0]) for key, box in boxes.items()}
    state |= {key: state[source] for key, source in copies.items()}
    state |= {key: tensor for key, tensor in named.items() if key not in state}
    set_model_state_dict(whole, by_stage(state, own, stages))


class _Merge:
    """One weight transformers builds from several stored ones (:class:`HFNames`'s ``merged``), read
    into this rank's box of it: the stored tensors of the experts the box covers (``reads``, whole),
    then the converter's own operations on them (``fill``). Where the operations stack the experts
    first (``MergeModulelist(dim=0)``) and only concatenate along other dims after, the experts
    outside the box are not read: that is what expert parallelism and FSDP's dim-0 shards need;
    other operations read every expert and keep the box."""

    def __init__(self, tensor, converter, lists: dict[str, list[str]], metadata):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        self.tensor, self.converter, self.lists = tensor, converter, lists
        self.laid = dcp_layout(tensor)
        if isinstance(self.laid, DTensor):
            self.size, self.offset = compute_local_shape_and_global_offset(self.laid.shape,
                                                                           self.laid.device_mesh,
                                                                           self.laid.placements)
        else:
            self.size, self.offset = tuple(tensor.shape), (0,) * tensor.dim()
        first_op, *rest = converter.operations
        stacked_first = type(first_op).__name__ == "MergeModulelist" and first_op.dim == 0 and all(
            type(op).__name__ == "Concatenate" and op.dim > 0 for op in rest)
        counts = {len(names) for names in lists.values()}
        if stacked_first and counts != {tensor.shape[0]}:
            raise ValueError(f"{converter}: {counts} stored experts for a weight of "
                             f"{tensor.shape[0]}")
        self.first, self.count = ((self.offset[0], self.size[0]) if stacked_first
                                  else (0, max(counts)))
        if 0 in self.size:  # an empty shard (FSDP's last ranks of a short dim)
            self.count = 0
        meta = metadata.state_dict_metadata
        self.reads = {name: torch.empty(tuple(meta[name].size), dtype=meta[name].properties.dtype)
                      for names in lists.values()
                      for name in names[self.first:self.first + self.count]}

    def fill(self, reads: dict, model):
        """The tensor, its box holding the merged weights (the converter's operations on what was
        read)."""
        if self.count:
            collected = {pattern: [reads[n] for n in names[self.first:self.first + self.count]]
                         for pattern, names in self.lists.items()}
            for op in self.converter.operations:
                collected = op.convert(collected, source_patterns=self.converter.source_patterns,
                                       target_patterns=self.converter.target_patterns, model=model,
                                       config=getattr(model, "config", None))
            (merged,) = collected.values()
            box = (slice(self.offset[0] - self.first, self.offset[0] - self.first + self.size[0]),
                   *(slice(o, o + n) for o, n in zip(self.offset[1:], self.size[1:], strict=True)))
            local = self.laid.to_local() if isinstance(self.laid, DTensor) else self.laid
            with torch.no_grad():
                local.copy_(merged[box])
        return restore_layout(self.laid, self.tensor)


def save_hf(path: str, parts: list, model, *, ties: list[list[str]] = ()) -> None:
    """Write the weights of the parallelised ``parts`` to the folder ``path`` in Hugging Face's
    format (safetensors and ``config.json``: what ``from_pretrained`` reads), under the names of
    ``model``'s state dict (the cell's model, whose ``config`` is written too), a tied parameter
    once, under its first name. Mixtral's experts stay stacked as the model holds them, which
    transformers 5 reads as they are (not the one-by-one names its own ``save_pretrained`` writes,
    which older readers expect). Collective: every rank writes its shards (DCP's
    ``HuggingFaceStorageWriter``), which are then joined into whole tensors."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    stages = len(parts) > 1
    later = {name for group in ties for name in group[1:]}
    keys = {canonical_name(k) for k in model.state_dict()} - later
    state = by_name(get_model_state_dict(PipelineStages(parts) if stages else parts[0]), stages)
    state = {k: v for k, v in state.items() if k in keys}
    dcp.save(dcp_layout(state), storage_writer=HuggingFaceStorageWriter(path, save_distributed=True,
                                                                        enable_consolidation=True))
    # the coordinator joined the ranks' files inside save: what from_pretrained reads
    if dist.get_rank() == 0:
        shutil.rmtree(os.path.join(path, "sharded"))
        config = copy.deepcopy(model.config)
        # switched off for training (train.switch_off_kv_cache):
        if getattr(config, "use_cache", None) is False:
            config.use_cache = True  # whoever loads the weights generates, and reads the cache then
        config.save_pretrained(path)
