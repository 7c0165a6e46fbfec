"""The degrees a model and a cluster allow: divisors of the world, tensor-parallel degrees that
divide every head count and split dimension, context-parallel degrees that cut the sequence evenly,
tensor-parallel layouts that cannot run inside pipeline stages."""

from __future__ import annotations

import math

from .styles import GROUPS, HEAD_COUNTS, KV_HEADS


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tp_blockers(prof, t: int, tp_on: list[bool]) -> list[str]:
    """Why TP degree ``t`` cannot apply: layers whose heads, parts or split dims ``t`` does not
    divide. A key/value projection with fewer heads than ``t`` is repeated instead when ``t`` is a
    multiple of its heads."""
    out = []
    for i, lp in enumerate(prof.layers):
        if not tp_on[i]:
            continue
        kv = sorted(r.heads for r in lp.repeatable.values() if r.heads % t and t % r.heads)
        bad = sorted(d for d in lp.divisors if d % t) + kv
        if bad:
            heads = sorted(h for h in lp.heads if h % t) + kv
            what = f"head count {heads[0]}" if heads else f"dim {bad[0]}"
            out.append(f"tp={t} does not divide the {what} of {lp.path}")
    return out


def cp_degrees(prof, cluster, *, seq_len: int | None, why: str = "") -> tuple[list[int], str]:
    """Context-parallel degrees the runtime can run for this model: the divisors > 1 of the world
    size that split the sequence into 2 * cp equal chunks (torch's load balancing), inside a node
    (the ring's all-gathers stay on the fast links); and why there are none ("" when there are).
    ``why``: a reason from outside the graph."""
    why = why or prof.cp_blocker or ("" if seq_len else "the inputs are not token sequences")
    if why:
        return [], why
    out = [c for c in divisors(cluster.world_size) if 1 < c <= cluster.gpus_per_node
           and seq_len % (2 * c) == 0]
    return out, "" if out else (f"no degree cp > 1 of the world size {cluster.world_size} (inside "
                                f"a node) cuts seq_len {seq_len} into 2 * cp equal chunks")


def stage_refusal(sizes: dict[str, dict[str, int]], tables: dict[str, dict]) -> str:
    """Why TP cannot run inside pipeline stages ("" where it can): the pipeline's trace fixes what
    the code computed from a global head count (nanoGPT's ``view(B, T, self.n_head, -1)``, T5's
    ``zeros(1, self.n_heads, q, k)``), which no ``set_local_sizes`` reaches, and it reads a
    head-indexed table whole; only the widths of equal parts split apart adapt
    (``runtime.pp_graph.splits_into_equal_parts``: GPT-2's ``split_size``)."""
    counts = {*HEAD_COUNTS, *KV_HEADS, *GROUPS}
    for path, attributes in sizes.items():
        read = [name for name in attributes if name.rpartition(".")[2] in counts]
        if read:
            return (f"tensor parallelism inside pipeline stages: {path} reads {', '.join(read)}, "
                    "and the pipeline's trace fixes what it computes from the global value (heads "
                    "per rank cannot be set in a traced module); plan with pp=1 or tp=1")
    if tables:
        return (f"tensor parallelism inside pipeline stages: {next(iter(tables))} holds a "
                "head-indexed table, which the pipeline's trace reads whole; plan with pp=1 or "
                "tp=1")
    return ""
