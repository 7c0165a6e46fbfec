"""Which module's forward made each autograd node of a step (:class:`NodeSpans`): how
``verify.measure`` places a peak met in backward or a recompute in the module whose backward runs
then."""

from __future__ import annotations


def _last_node() -> int:
    """The sequence number of the latest autograd node this thread made (one made here and dropped:
    autograd has no call that reads the counter), unseen by the tracker's dispatch mode; -1 where
    grad is off."""
    import torch

    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        node = torch.empty(0, requires_grad=True).view(-1).grad_fn
    return node._sequence_nr() if node is not None else -1


class NodeSpans:
    """Which module's forward made each autograd node. Autograd numbers its nodes in the order the
    forward creates them (``Node._sequence_nr()``, per thread); a module's forward made the nodes
    after its inputs' and after the last one of the modules that finished before it began, up to its
    outputs' ``grad_fn``. In backward, the node running (``torch._C._current_autograd_node()``) then
    names the module whose backward runs: its innermost span. A checkpoint's recompute, run by a
    node of its layer, adds no span. ``with`` registers global module hooks."""

    def __init__(self, name_of):
        self.name_of = name_of
        """module -> its name (the tracker's), or None"""
        self.spans: list[tuple[int, int, str, int]] = []
        """(after this sequence number, up to this one, module name, its earlier calls this step) of
        every forward call of the step (:meth:`new_step` forgets the step before)"""
        self._calls: dict[str, int] = {}
        self._begun_calls: dict[str, int] = {}
        """module name -> its forward calls begun this step (counted at the call's start: the one
        running is the last; a module whose output makes no node is counted too)"""
        self._last = -1
        self._begun: list[int] = []

    def __enter__(self):
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        self._handles = (register_module_forward_pre_hook(self._pre),
                         register_module_forward_hook(self._post))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    def _pre(self, module, args) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        if torch._C._current_autograd_node() is None:  # a forward, not a recompute inside backward
            # after its inputs' nodes: an op between two modules (LLaMA's silu x up product, read by
            # the down projection) is its caller's, not the next module's
            made = [t.grad_fn._sequence_nr() for t in tree_leaves(args)
                    if isinstance(t, torch.Tensor) and t.grad_fn]
            # and after every node made so far outside modules: a pipeline stage's loss, made
            # between its micro-batches' forwards, is not the next forward's first module's (whose
            # input is a received leaf)
            self._begun.append(max([self._last, *made, _last_node()]))
            name = self.name_of(module)
            if name:
                self._begun_calls[name] = self._begun_calls.get(name, 0) + 1

    def _post(self, module, args, out) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        if torch._C._current_autograd_node() is not None or not self._begun:
            return
        start = self._begun.pop()
        made = [t.grad_fn._sequence_nr() for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                and t.grad_fn]
        name = self.name_of(module)
        if made and max(made) > start and name:
            self.spans.append((start, max(made), name, self._calls.get(name, 0)))
            self._calls[name] = self._calls.get(name, 0) + 1
            self._last = max(self._last, max(made))

    def new_step(self) -> None:
        """Forget the calls so far: a step's nodes are gone once it ended, and calls are counted per
        step."""
        self.spans, self._calls, self._begun_calls = [], {}, {}

    def forward_call(self, name: str) -> int | None:
        """Which of the step's forward calls of module ``name`` is running (from 0: a pipeline
        stage's micro-batch, as :meth:`module_of` counts a backward's); None where it has not run
        this step."""
        calls = self._begun_calls.get(name)
        return calls - 1 if calls else None

    def call_before(self, seq: int | None = None) -> int | None:
        """Which call of its module the forward call that last finished before node ``seq`` was made
        (None: the latest to finish) was: a loss is made outside every module, right after the
        forward of the micro-batch it is the loss of (a pipeline's last stage's), so it is that
        micro-batch's. None where none finished."""
        done = [(end, call) for _, end, _, call in self.spans if seq is None or end < seq]
        return max(done)[1] if done else None

    def module_of(self, seq: int) -> tuple[str, int] | None:
        """The innermost module whose forward made node ``seq`` (the latest call of the narrowest
        span), and which of its calls this step that was (a pipeline stage's micro-batch)."""
        best = None
        for k, (start, end, name, call) in enumerate(self.spans):
            if start < seq <= end and (best is None or (end - start, -k) < best[0]):
                best = ((end - start, -k), (name, call))
        return best[1] if best else None
