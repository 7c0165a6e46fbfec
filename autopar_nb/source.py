"""ModelSource: the code that builds the model, kept verbatim so other processes (verify workers,
the exported script, launched runs) can rebuild it exactly.

Cell convention (documented in the README): the code binds

* ``model`` — an ``nn.Module`` (another name with ``--model``),
* ``example_inputs`` — a tensor, a tuple of positional tensors or a dict of keyword tensors
  (``--inputs``),
* optionally ``loss_fn(model, batch) -> scalar tensor``, where ``batch`` has the structure of
  ``example_inputs``,
* optionally ``make_batch(step, rank) -> batch``, the data for a given step on a given data-parallel
  rank,
* optionally ``dataset`` — a map-style or iterable ``torch.utils.data.Dataset`` whose samples,
  batched by ``collate_fn`` (optional too, torch's default otherwise), are batches with the
  structure of ``example_inputs``. Training then reads it with a ``DataLoader`` over the
  data-parallel ranks (``runtime.data.DataStream``) unless the cell also defines ``make_batch``;
  ``example_inputs`` may then be left out: the first :data:`EXAMPLE_SAMPLES` samples, collated, are
  the example.
"""

from __future__ import annotations

import linecache
from dataclasses import dataclass
from typing import Any

PRETRAINED_KEY = "__pretrained__"
"""the namespace entry a meta build leaves: the checkpoints the code's ``from_pretrained`` calls
named"""
EXAMPLE_SAMPLES = 8
"""samples of the dataset collated into the example inputs when the cell binds a dataset but no
example inputs"""


@dataclass(frozen=True)
class ModelSource:
    """The model's code and the names it binds (see the module docstring)."""

    code: str
    model_var: str = "model"
    inputs_var: str | None = "example_inputs"
    """None: the example inputs are the dataset's first samples (``dataset_var`` is set), else
    ``make_batch(0, 0)``"""
    loss_fn_var: str | None = None
    """name of ``loss_fn(model, batch)`` when the code defines one"""
    make_batch_var: str | None = None
    """name of ``make_batch(step, rank)`` when the code defines one"""
    dataset_var: str | None = None
    """name of the ``torch.utils.data.Dataset`` the code binds, if any"""
    collate_fn_var: str | None = None
    """name of the dataset's ``collate_fn(samples) -> batch`` when the code defines one"""
    rows_per_sample: int = 1
    """rows the ``collate_fn`` makes of each dataset sample (read on the meta device when the cell
    runs): the plan costs rows, what the model trains on, so a step of a plan whose global batch is
    N rows reads N / this samples"""
    filename: str = "<autoparallel-cell>"
    first_line: int = 1
    """the number the code's first line has where the user sees it (2 under the ``%%autoparallel``
    line): the code runs as if that many lines came before it, so tracebacks and messages count
    lines as the notebook shows them"""
    weights: str | None = None
    """a folder of safetensors files (``save_pretrained``'s) the model starts from, for code that
    builds it from a config (``export(weights=...)``): a real build reads them into the model, as
    ``from_pretrained`` would"""

    def run(self, namespace: dict[str, Any] | None = None, *, device: Any = None,
            seed: int | None = 0) -> dict[str, Any]:
        """Execute the code in ``namespace`` (a fresh dict by default) and return it.

        ``device="meta"`` builds every tensor on the meta device (no storage); ``seed`` seeds torch
        first so every process builds identical initial weights, which a real build then replaces
        with :attr:`weights` if set.
        """
        import torch

        ns: dict[str, Any] = {"__name__": "__autoparallel__"} if namespace is None else namespace
        # register the code with linecache so tracebacks and capture errors can quote the cell's
        # lines; blank lines in front make every frame's line number the one the notebook shows
        text = "\n" * (self.first_line - 1) + self.code
        linecache.cache[self.filename] = (len(text), None, text.splitlines(True), self.filename)
        compiled = compile(text, self.filename, "exec")
        if seed is not None:
            torch.manual_seed(seed)
        if device is None:
            exec(compiled, ns)
        # from_pretrained builds from the checkpoint's config: shapes, no weights
        elif str(device) == "meta":
            from .runtime.pretrained import FromConfig

            with torch.device(device), FromConfig() as answered:
                exec(compiled, ns)
            ns[PRETRAINED_KEY] = answered.found
        else:
            with torch.device(device):
                exec(compiled, ns)
        if self.weights and str(device) != "meta":
            from .runtime.pretrained import load_pretrained, tied_parameters

            model = ns[self.model_var]
            load_pretrained(self.weights, [model], ties=tied_parameters(model))
        return ns

    def build(self, *, device: Any = None, seed: int | None = 0) -> tuple[Any, Any, dict[str, Any]]:
        """Run the code and return ``(model, example_inputs, namespace)``."""
        ns = self.run(device=device, seed=seed)
        return ns[self.model_var], self.example_inputs(ns), ns

    def model_inputs(self, ns: dict[str, Any], example: Any = None) -> Any:
        """What the model is called with on the example batch — what capture traces: the batch
        itself when the code defines no ``loss_fn`` (the default loss calls ``model(*batch)``), else
        the arguments ``loss_fn(model, batch)`` passes to the model, found by calling it with a hook
        that stops at the model's first call (nothing of the forward runs): ``(x, y)`` samples the
        loss unpacks, dicts, ``(inputs, labels)``. A call that mixes positional and keyword
        arguments comes back as keywords (the forward's parameter names). Raises ``ValueError`` when
        the loss does not call the model. Example inputs the code binds may be the model's own
        inputs where its batches (a dataset's, ``make_batch``'s) are more (``example_inputs =
        (dense, sparse)`` with ``(dense, sparse, label)`` batches): where the loss fails on them,
        they are taken as they are."""
        example = self.example_inputs(ns) if example is None else example
        if self.loss_fn_var is None:
            return example
        model = ns[self.model_var]
        called: list[tuple[tuple, dict]] = []

        def stop(module, args, kwargs):
            called.append((args, kwargs))
            raise _ModelCalled

        hook = model.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            ns[self.loss_fn_var](model, example)
        except _ModelCalled:
            pass
        except Exception:
            # the example is the dataset's samples: the loss must take them
            if self.inputs_var is None:
                raise
            return example
        finally:
            hook.remove()
        if not called:
            raise ValueError(f"{self.loss_fn_var}(model, batch) returned without calling the model")
        return _as_inputs(model, *called[0])

    def example_inputs(self, ns: dict[str, Any]) -> Any:
        """The example inputs in the namespace ``ns`` the code made: its ``inputs_var``, else the
        dataset's first :data:`EXAMPLE_SAMPLES` samples collated, else ``make_batch(0, 0)`` (rank
        0's first batch)."""
        if self.inputs_var is not None:
            return ns[self.inputs_var]
        if self.dataset_var is None:
            return ns[self.make_batch_var](0, 0)
        from .runtime.data import first_batch

        collate = ns[self.collate_fn_var] if self.collate_fn_var else None
        return first_batch(ns[self.dataset_var], batch_size=EXAMPLE_SAMPLES, collate_fn=collate)


class _ModelCalled(Exception):
    """Raised by the hook of :meth:`ModelSource.model_inputs` once it has the model's arguments."""


def _as_inputs(model, args: tuple, kwargs: dict) -> Any:
    """A call's arguments as capture takes them: a tuple of positional ones or a dict of keyword
    ones."""
    if not kwargs:
        return args
    if not args:
        return dict(kwargs)
    import inspect

    params = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()):
        raise ValueError(f"the loss calls {type(model).__name__} with positional and keyword "
                         "arguments and its forward takes *args: call it with keywords only")
    out: dict[str, Any] = {}
    for name, value in inspect.signature(model.forward).bind(*args, **kwargs).arguments.items():
        if params[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out
