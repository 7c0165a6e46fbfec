"""Code the exported script embeds verbatim: small, self-contained helpers (stdlib + torch only).

Each constant is one block of the script; :func:`autopar_nb.export.render_script` picks the ones a plan needs.
"""

_METRICS = '''
class Metrics:
    """One JSON line per step to the launcher at AUTOPAR_METRICS=host:port (with AUTOPAR_TOKEN); else nothing."""

    def __init__(self, rank):
        self.sock = None
        address, token = os.environ.get("AUTOPAR_METRICS"), os.environ.get("AUTOPAR_TOKEN")
        if address and token:
            host, port = address.rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)), timeout=30)
            self.send({"token": token, "rank": rank})

    def send(self, record):
        if self.sock is not None:
            try:
                self.sock.sendall((json.dumps(record) + "\\n").encode())
            except OSError:  # the launcher went away: keep training
                self.sock = None
'''

_MEMORY = '''
def memory_stats(device):
    """Bytes: CUDA allocator figures on GPUs, and the process's resident set size."""
    stats = {}
    if device == "cuda":
        stats = {"mem_allocated": torch.cuda.memory_allocated(), "mem_reserved": torch.cuda.memory_reserved(),
                 "mem_peak": torch.cuda.max_memory_allocated()}
    try:
        import psutil

        stats["rss"] = psutil.Process().memory_info().rss
    except ImportError:
        import resource

        stats["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return stats
'''

_SPLIT = '''
def tree_map(fn, batch):
    if isinstance(batch, dict):
        return {k: tree_map(fn, v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(tree_map(fn, v) for v in batch)
    return fn(batch) if isinstance(batch, torch.Tensor) else batch


def to_device(batch, device):
    return tree_map(lambda t: t.to(device), batch)


def split_batch(batch, n):
    """n micro-batches along dim 0 (tensor_split, as the pipeline schedules split their inputs)."""
    return [batch] if n == 1 else [tree_map(lambda t, i=i: t.tensor_split(n)[i], batch) for i in range(n)]


def first_tensor(batch):
    while isinstance(batch, (tuple, list, dict)):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return batch
'''

_MODEL_INPUTS = '''
class ModelCalled(Exception):
    pass


def model_inputs(batch):
    """The arguments loss_fn(model, batch) passes to the model: the first pipeline stage's inputs."""

    def record_call(*args, **kwargs):
        raise ModelCalled(args, kwargs)

    try:
        loss_fn(record_call, batch)
    except ModelCalled as call:
        return call.args[0], call.args[1]
    raise ValueError("loss_fn(model, batch) never called model(...)")


'''

_RESTORE_LEAVES = '''
def restore_leaf_modules(stage, model):
    """Put the model's own leaf modules (same parameters) back in place of the tracer's interpreters, so TP styles
    and checkpoint wrappers see real nn.Linear / nn.Embedding modules."""
    originals = dict(model.named_modules())
    for path, module in list(stage.named_modules()):
        original = originals.get(path)
        if path and original is not None and not list(original.children()) and module is not original:
            parent, _, name = path.rpartition(".")
            stage.get_submodule(parent).register_module(name, original)
    return stage
'''

_CONTIGUOUS = '''
def contiguous_outputs(module, args, output):
    """Stage outputs go to the next rank as they are, and gloo sends only contiguous tensors."""
    if isinstance(output, torch.Tensor):
        return output.contiguous()
    if isinstance(output, (tuple, list)):
        return type(output)(t.contiguous() if isinstance(t, torch.Tensor) else t for t in output)
    return output
'''

_BOUNDARY = '''
def boundary_values(pipe, stages, mb_args, mb_kwargs):
    """What enters and leaves each stage, from one micro-batch through the whole traced model: the stages' static
    shapes (no shape inference on made-up tensors: made-up ids could index out of an embedding)."""
    def leaf(t):  # requires_grad says which gradients travel back
        return t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

    seen = {}
    hooks = [stage.register_forward_hook(
        lambda m, args, out, i=i: seen.__setitem__(
            i, (tuple(leaf(a) for a in args), tuple(leaf(t) for t in (out if isinstance(out, tuple) else (out,))))))
        for i, stage in enumerate(stages)]
    pipe(*mb_args, **mb_kwargs)
    for h in hooks:
        h.remove()
    return [seen[i] for i in range(len(stages))]
'''

_WRAP = '''
def wrap(root, path, wrapper):
    """Replace the submodule at ``path`` by ``wrapper(submodule)``."""
    parent, _, name = path.rpartition(".")
    root.get_submodule(parent).register_module(name, wrapper(root.get_submodule(path)))
'''

_SAVE_MATMULS = '''
SAVE_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.convolution.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def save_matmuls(ctx, op, *args, **kwargs):
    """Selective recompute: keep matmul/conv/attention outputs, recompute the cheap ops between them."""
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE
'''

_INIT_WEIGHTS = '''
@torch.no_grad()
def init_weights(parts, skeleton, device):
    """Allocate the local shards and initialise them as the single-process model would be: module by module in
    construction order with the seed re-applied, each module's full weights existing only while its shard is
    copied out. Uses each module's reset_parameters() (norm-like modules without one: weight 1, bias 0)."""
    local = {}
    for part in parts:
        part.to_empty(device=device)
        for name, t in [*part.named_parameters(), *part.named_buffers()]:
            local[name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")] = t
    torch.manual_seed(SEED)
    for path, module in skeleton.named_modules():
        if not [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            continue
        full = copy.copy(module)  # this module alone, full size, on the host
        full._modules = {}
        full._parameters = {n: None if p is None else torch.nn.Parameter(torch.empty_like(p, device="cpu"))
                            for n, p in module._parameters.items()}
        full._buffers = {n: None if b is None else torch.empty_like(b, device="cpu")
                         for n, b in module._buffers.items()}
        if hasattr(full, "reset_parameters"):
            full.reset_parameters()
        else:
            for name, p in full.named_parameters(recurse=False):
                p.fill_(1.0 if name == "weight" else 0.0)
        for name, value in [*full.named_parameters(recurse=False), *full.named_buffers(recurse=False)]:
            target = local.get(f"{path}.{name}" if path else name)
            if target is None:  # on another pipeline stage
                continue
            if isinstance(target, DTensor):
                shard = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements,
                                          src_data_rank=None)
                target.to_local().copy_(shard.to_local())
            else:
                target.copy_(value)
'''

_LATEST = '''
def latest_checkpoint(ckpt_dir):
    """The newest step_N folder whose save finished on every rank (a run killed mid-save leaves one unmarked)."""
    if not os.path.isdir(ckpt_dir):
        return None
    steps = [int(d.removeprefix("step_")) for d in os.listdir(ckpt_dir)
             if d.startswith("step_") and os.path.exists(os.path.join(ckpt_dir, d, "COMPLETE"))]
    return os.path.join(ckpt_dir, f"step_{max(steps)}") if steps else None


def mark_complete(path):
    dist.barrier()  # every rank's shards are on disk before the checkpoint counts
    if dist.get_rank() == 0:
        open(os.path.join(path, "COMPLETE"), "w").close()

'''

_CHECKPOINT = _LATEST + '''
# optimizer state keyed by parameter name, so each pipeline rank's share is its own set of keys
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def save_checkpoint(path, model, optimizer, step):
    """Distributed checkpoint: every rank writes its shards; loadable at another world size or layout."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=path)
    mark_complete(path)


def load_checkpoint(path, model, optimizer):
    model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)
    return state["step"]
'''

_CHECKPOINT_ZERO1 = _LATEST + '''
def save_checkpoint(path, model, optimizer, step):
    """The model as a distributed checkpoint; ZeRO-1 optimizer shards one file per rank (resume with the same DP)."""
    model_sd, _ = get_state_dict(model, [])
    dcp.save({"model": model_sd, "step": step}, checkpoint_id=path)
    torch.save(optimizer.optim.state_dict(), os.path.join(path, f"zero1_rank{dist.get_rank()}.pt"))
    mark_complete(path)


def load_checkpoint(path, model, optimizer):
    model_sd, _ = get_state_dict(model, [])
    state = {"model": model_sd, "step": 0}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    optimizer.optim.load_state_dict(torch.load(os.path.join(path, f"zero1_rank{dist.get_rank()}.pt")))
    return state["step"]
'''
