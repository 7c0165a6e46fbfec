"""Pretrained Hugging Face weights: a cell that calls ``from_pretrained`` means "start from these weights".

On the meta device (capture, and the exported script's ``meta_init``) transformers refuses ``from_pretrained``: it
wants to read weights that meta tensors cannot hold. :class:`FromConfig` answers those calls with the model the
checkpoint's config describes (``_from_config``: the same modules, parameter names and shapes, no weights) and
notes which checkpoint each came from; once the model is parallelised, :func:`load_pretrained` reads into each rank
only its shards (DCP's Hugging Face storage reader), whatever the plan's TP, FSDP and pipeline stages;
:func:`save_hf` writes the trained weights back in the same format.
"""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from .checkpoint import PipelineStages, by_name, by_stage
from .init import canonical_name
from .layouts import dcp_layout, restore_layout

MODEL_KWARGS = ("torch_dtype", "dtype", "attn_implementation")
"""``from_pretrained`` keywords that describe the model itself (``_from_config`` takes them)"""
LOADING_KWARGS = ("device_map", "low_cpu_mem_usage", "use_safetensors", "weights_only", "state_dict",
                  "ignore_mismatched_sizes", "output_loading_info", "offload_folder", "offload_state_dict",
                  "quantization_config", "key_mapping", "tp_plan", "tp_size", "device_mesh", "variant", "gguf_file")
"""keywords about how weights are read, which a model built from its config has no use for"""


class FromConfig:
    """While started (or as a context manager), ``PreTrainedModel.from_pretrained(name, ...)`` builds
    ``cls._from_config(config)``, the checkpoint's config with the call's config keywords applied, and appends
    ``name`` to :attr:`found`. Without transformers installed, nothing changes."""

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
            config, kwargs = AutoConfig.from_pretrained(config or name, *args, return_unused_kwargs=True, **kwargs)
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
    """The reader of the checkpoint folder ``path`` and the names it stores (read from the files' headers)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"from_pretrained({path!r}): sharded loading reads a local folder of safetensors; "
                                f"download it first (huggingface-cli download {path} --local-dir DIR) and name DIR")
    reader = HuggingFaceStorageReader(path)
    return reader, set(reader.read_metadata().state_dict_metadata)


def _source(key: str, stored: set[str], ties) -> str | None:
    """The stored name parameter ``key`` is read from: its own, or that of a parameter tied to it (None: neither)."""
    return key if key in stored else next((n for group in ties if key in group for n in group if n in stored), None)


def check_pretrained(path: str, model, *, ties: list[list[str]] = (), what: str = "from_pretrained") -> None:
    """Raise before anything runs where :func:`load_pretrained` could not read ``model``'s parameters from the
    checkpoint in ``path`` (a missing folder, names it does not store), in one line that starts with ``what``
    (where the checkpoint was named) and shows the first names on either side that do not match."""
    _, stored = _stored(path)
    names = [canonical_name(n) for n, _ in model.named_parameters(remove_duplicate=False)]
    missing = [n for n in names if _source(n, stored, ties) is None]
    if missing:
        extra = sorted(stored - set(names))
        raise ValueError(
            f"{what}={path!r}: the checkpoint stores no weight named {missing[0]} (nor one tied to it)"
            + (f", nor {len(missing) - 1} more of the model's" if len(missing) > 1 else "")
            + (f"; it stores {len(extra)} names the model does not have, e.g. {extra[0]}" if extra else "")
            + (": name a checkpoint of this model (save_pretrained of the same class and config)" if what == "weights"
               else ": export with meta_init=False, and the cell's from_pretrained reads the weights whole"))


def load_pretrained(path: str, parts: list, *, ties: list[list[str]] = ()) -> None:
    """Read the Hugging Face checkpoint in the folder ``path`` (``save_pretrained``'s safetensors) into the
    parallelised ``parts`` (this rank's pipeline stages, or the model): each rank reads its own shards. A parameter
    the checkpoint leaves out because it is tied (``ties``: groups of names that are one parameter; an output head
    tied to the embedding) reads its group's stored tensor, also where another pipeline stage holds that one."""
    stages = len(parts) > 1
    model = PipelineStages(parts) if stages else parts[0]
    own = get_model_state_dict(model)
    named = by_name(own, stages)
    reader, stored = _stored(path)
    params = by_name({canonical_name(k): None for k, _ in model.named_parameters(remove_duplicate=False)}, stages)
    like, alias, copies = {}, {}, {}
    for key, tensor in named.items():
        if key in stored or key not in params:  # a buffer the checkpoint leaves out keeps what init computed
            if key in stored:
                like[key] = tensor
            continue
        source = _source(key, stored, ties)
        if source is None:
            raise ValueError(f"the checkpoint in {path} stores no weight named {key} (nor one tied to it)")
        if source in named:
            copies[key] = source
        else:  # held by another pipeline stage: read into this rank's copy
            like[source], alias[source] = tensor, key
    laid = dcp_layout(like)
    dcp.load(laid, storage_reader=reader, no_dist=not dist.is_initialized())  # a whole model in one process too
    state = {alias.get(k, k): v for k, v in restore_layout(laid, like).items()}
    state |= {key: state[source] for key, source in copies.items()}
    state |= {key: tensor for key, tensor in named.items() if key not in state}
    set_model_state_dict(model, by_stage(state, own, stages))


def save_hf(path: str, parts: list, model, *, ties: list[list[str]] = ()) -> None:
    """Write the weights of the parallelised ``parts`` to the folder ``path`` in Hugging Face's format (safetensors
    and ``config.json``: what ``from_pretrained`` reads), under the names of ``model``'s state dict (the cell's
    model, whose ``config`` is written too), a tied parameter once, under its first name. Collective: every rank
    writes its shards (DCP's ``HuggingFaceStorageWriter``), which are then joined into whole tensors."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    stages = len(parts) > 1
    later = {name for group in ties for name in group[1:]}
    keys = {canonical_name(k) for k in model.state_dict()} - later
    state = by_name(get_model_state_dict(PipelineStages(parts) if stages else parts[0]), stages)
    state = {k: v for k, v in state.items() if k in keys}
    dcp.save(dcp_layout(state), storage_writer=HuggingFaceStorageWriter(path, save_distributed=True,
                                                                        enable_consolidation=True))
    if dist.get_rank() == 0:  # the coordinator joined the ranks' files inside save: what from_pretrained reads
        shutil.rmtree(os.path.join(path, "sharded"))
        model.config.save_pretrained(path)
