"""Pipeline stage boundaries: contiguous layer ranges that minimise the slowest stage's time.

Exact for the given per-layer times: bisection on the bottleneck with a greedy maximal-prefix check
(a contiguous min-max partition is feasible for a bound iff packing each stage as full as possible
covers the chain), on runs of identical layers so the cost grows with runs and stages, not layers;
with layers pinned to stages, a dynamic programme over the chain. A stage starts only where one may
(``glued``: the layers that stay in the stage of the layer before them, ``GraphProfile.pp_glued``):
each partition runs on units, a layer where a stage may start and the glued layers after it, and
gives every layer its unit's stage.
"""

from __future__ import annotations

from ..cost.memory import in_flight, state_bytes
from ..plan import DTYPE_NAMES, ITEMSIZE


def unit_sizes(n: int, glued) -> list[int]:
    """The layers of each unit of a chain of ``n`` layers: a layer where a stage may start, then the
    ``glued`` layers after it (the first layer starts a unit whether glued or not)."""
    sizes: list[int] = []
    for i in range(n):
        if sizes and i in glued:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


def per_layer(assign: list[int] | None, sizes: list[int]) -> list[int] | None:
    """The stage of each layer, from the stage of each unit (``sizes``: :func:`unit_sizes`)."""
    return None if assign is None else [st for st, k in zip(assign, sizes, strict=True)
                                        for _ in range(k)]


def _sums(values: list[float], sizes: list[int]) -> list[float]:
    out, i = [], 0
    for k in sizes:
        out.append(sum(values[i:i + k]))
        i += k
    return out


def partition(times: list[float], n_stages: int, pins: dict[int, int],
              glued=frozenset()) -> list[int] | None:
    """Contiguous assignment of layers to ``n_stages`` non-empty stages minimising the slowest stage
    (module docstring), no stage starting at a ``glued`` layer; None when impossible (fewer units
    than stages, pins out of order, or pins that would start a stage at a glued layer)."""
    if glued:
        sizes = unit_sizes(len(times), glued)
        heads = [sum(sizes[:u]) for u in range(len(sizes))]
        unit_pins: dict[int, int] = {}
        for u, (h, k) in enumerate(zip(heads, sizes, strict=True)):
            pinned = {pins[i] for i in range(h, h + k) if i in pins}
            if len(pinned) > 1:
                return None
            unit_pins.update({u: pinned.pop()} if pinned else {})
        return per_layer(partition(_sums(times, sizes), n_stages, unit_pins), sizes)
    n = len(times)
    if n_stages == 1:
        if any(s != 0 for s in pins.values()):
            return None
        return [0] * n
    if n < n_stages:
        return None
    if pins:
        return _partition_dp(times, n_stages, pins)
    best = bisect_cap(lambda cap: _greedy(times, n_stages, cap), max(times), sum(times), rtol=1e-6,
                      steps=40)
    return fill_empty(best, n_stages)


def bisect_cap(assign_within, lo: float, hi: float, *, rtol: float, steps: int):
    """The assignment for the smallest stage-time cap in [lo, hi] that ``assign_within(cap)`` can
    meet (it returns None when the cap is too tight), by bisection on the cap; None when even ``hi``
    is too tight. Used by the time partitions here and by the planner's memory-capped partition."""
    best = assign_within(hi)
    for _ in range(steps):
        mid = (lo + hi) / 2
        a = assign_within(mid)
        if a is None:
            lo = mid
        else:
            hi, best = mid, a
        if hi - lo <= rtol * hi:
            break
    return best


def partition_runs(runs: list[tuple[float, int]], n_stages: int,
                   glued=frozenset()) -> list[int] | None:
    """:func:`partition` for a chain given as runs of identical layers ``(time, count)``: the greedy
    check counts how many layers of a run fit at once, so the cost grows with runs and stages, not
    layers."""
    if glued:  # units of equal time in runs again: a glued layer makes its unit one of its own
        sizes = unit_sizes(sum(c for _, c in runs), glued)
        unit_runs: list[tuple[float, int]] = []
        for t in _sums([t for t, c in runs for _ in range(c)], sizes):
            if unit_runs and unit_runs[-1][0] == t:
                unit_runs[-1] = (t, unit_runs[-1][1] + 1)
            else:
                unit_runs.append((t, 1))
        return per_layer(partition_runs(unit_runs, n_stages), sizes)
    n = sum(c for _, c in runs)
    if n < n_stages:
        return None
    if n_stages == 1:
        return [0] * n
    best = bisect_cap(lambda cap: _greedy_runs(runs, n_stages, cap), max(t for t, _ in runs),
                   sum(t * c for t, c in runs), rtol=1e-4, steps=50)
    assign = [st for st, k in best for _ in range(k)]
    return fill_empty(assign, n_stages)


def _greedy_runs(runs, n_stages, cap):
    out: list[tuple[int, int]] = []
    stage, acc = 0, 0.0
    cap = cap * (1 + 1e-12)
    for t, c in runs:
        while c > 0:
            k = c if t <= 0 else int((cap - acc) // t)
            if k <= 0:
                if acc == 0.0:
                    k = 1
                else:
                    stage, acc = stage + 1, 0.0
                    if stage >= n_stages:
                        return None
                    continue
            k = min(k, c)
            out.append((stage, k))
            acc += k * t
            c -= k
    return out


def _greedy(times, n_stages, cap):
    out, stage, acc = [], 0, 0.0
    for t in times:
        if acc > 0 and acc + t > cap * (1 + 1e-12):
            stage += 1
            acc = 0.0
            if stage >= n_stages:
                return None
        out.append(stage)
        acc += t
    return out


def fill_empty(assign, n_stages):
    """Split stages until every stage has a layer (never raises the bottleneck)."""
    groups: list[list[int]] = [[] for _ in range(n_stages)]
    for i, s in enumerate(assign):
        groups[s].append(i)
    groups = [g for g in groups if g]
    while len(groups) < n_stages:
        k = max(range(len(groups)), key=lambda j: len(groups[j]))
        g = groups[k]
        groups[k:k + 1] = [g[:len(g) // 2], g[len(g) // 2:]]
    out = [0] * len(assign)
    for s, g in enumerate(groups):
        for i in g:
            out[i] = s
    return out


def _partition_dp(times, n_stages, pins):
    n = len(times)
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    # f[k][i]: best bottleneck with layers [0, i) in stages [0, k)
    f = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    arg = [[0] * (n + 1) for _ in range(n_stages + 1)]
    f[0][0] = 0.0

    def ok(j, i, k):  # layers [j, i) on stage k
        return all(pins.get(x, k) == k for x in range(j, i))

    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                if f[k - 1][j] == inf or not ok(j, i, k - 1):
                    continue
                v = max(f[k - 1][j], prefix[i] - prefix[j])
                if v < f[k][i]:
                    f[k][i], arg[k][i] = v, j
    if f[n_stages][n] == inf:
        return None
    out = [0] * n
    i = n
    for k in range(n_stages, 0, -1):
        j = arg[k][i]
        for x in range(j, i):
            out[x] = k - 1
        i = j
    return out


def memory_partition(ev, s, choices, *, limit: float, rec_pinned: dict[int, str],
                     glued=frozenset()) -> list[int] | None:
    """Stages balanced by time subject to each pipeline rank's memory, with every free layer at full
    recompute (the least memory it can take): bisection on the bottleneck time with a greedy check
    that also caps each stage's bytes (model states + in-flight activations + a reserve for
    transient buffers and the loss), on units (no stage starting at a ``glued`` layer)."""
    f, half = ev.f, s.amp != "none"
    p_item = ITEMSIZE[DTYPE_NAMES.get(s.amp,
                                      "float32")]  # compute dtype: unsharded/gathered parameters
    g_item = ITEMSIZE["float32"]  # gradients, log-softmax
    sb = state_bytes(s.optimizer)
    dp = s.dp
    p_b = sb.param / (dp if s.zero_stage >= 3 else 1)
    g_b = sb.grad / (dp if s.zero_stage >= 2 else 1)
    o_b = sb.optimizer / (dp if s.zero_stage >= 1 else 1)
    # ZeRO 1 and 2 keep unsharded parameters from forward to backward; autocast caches 16-bit copies
    # of the weights
    held = p_item if s.zero_stage in (1, 2) or (s.zero_stage == 0 and half) else 0
    acc = 1 if (s.micro_batches > 1 or s.pp > 1) else 0
    # per parameter at the backward moment (unsharded copies held) or at the optimizer step (foreach
    # temporaries)
    per_param = max(p_b + o_b + acc * g_b + held, p_b + o_b + 2 * g_b)
    times, static, act = [], [], []
    reserve = 0.0
    for i, ch in enumerate(choices):
        rec = ch.recompute if i in rec_pinned else "full"
        lt = ev.choice_terms(i, s, ch)
        times.append(lt.time_s(rec))
        static.append(lt.params_local * per_param)
        act.append(lt.act[rec])
        gather = 2 * lt.params_local * (p_item + g_item) if s.zero_stage == 3 else 0.0
        reserve = max(reserve, lt.act["none"] + lt.work_bytes + gather)
    sizes = unit_sizes(len(choices), glued)
    if len(sizes) < s.pp:
        return None
    # the bytes are linear in the layers
    times, static, act = (_sums(x, sizes) for x in (times, static, act))
    prof = ev.prof
    out_numel = prof.output_numel * s.mb_samples / prof.batch * ev.seq_ratio
    # log-softmax saved, its gradient, the logits' gradient
    loss = out_numel * (g_item + g_item + p_item)
    cap = (limit - f.margin_fixed_bytes) / (1 + f.margin_fraction) - reserve
    caps = [cap - (loss if r == s.pp - 1 else 0.0) for r in range(s.pp)]
    flights = [in_flight(s.schedule, pp=s.pp, stage=r, micro_batches=s.micro_batches)
               for r in range(s.pp)]

    def greedy(bound):
        out, stage, acc_t, acc_m = [], 0, 0.0, 0.0
        for i in range(len(sizes)):
            need_m = static[i] + flights[stage] * act[i]
            if out and out[-1] == stage and (acc_t + times[i] > bound * (1 + 1e-12) or
                                             acc_m + need_m > caps[stage]):
                stage += 1
                if stage >= s.pp:
                    return None
                acc_t, acc_m = 0.0, 0.0
                need_m = static[i] + flights[stage] * act[i]
            if need_m > caps[stage] and acc_m == 0.0:
                return None
            out.append(stage)
            acc_t += times[i]
            acc_m += need_m
        return out

    best = bisect_cap(greedy, max(times), sum(times) * 4, rtol=1e-4, steps=40)
    return None if best is None else per_layer(fill_empty(best, s.pp), sizes)
