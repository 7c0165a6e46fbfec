"""Pipeline stage boundaries: contiguous layer ranges that minimise the slowest stage's time.

Exact for the given per-layer times: bisection on the bottleneck with a greedy maximal-prefix check (a contiguous
min-max partition is feasible for a bound iff packing each stage as full as possible covers the chain), on runs of
identical layers so the cost grows with runs and stages, not layers; with layers pinned to stages, a dynamic
programme over the chain.
"""

from __future__ import annotations


def partition(times: list[float], n_stages: int, pins: dict[int, int]) -> list[int] | None:
    """Contiguous assignment of layers to ``n_stages`` non-empty stages minimising the slowest stage (module
    docstring); None when impossible (fewer layers than stages, or pins out of order)."""
    n = len(times)
    if n_stages == 1:
        if any(s != 0 for s in pins.values()):
            return None
        return [0] * n
    if n < n_stages:
        return None
    if pins:
        return _partition_dp(times, n_stages, pins)
    best = bisect_cap(lambda cap: _greedy(times, n_stages, cap), max(times), sum(times), rtol=1e-6, steps=40)
    return fill_empty(best, n_stages)


def bisect_cap(assign_within, lo: float, hi: float, *, rtol: float, steps: int):
    """The assignment for the smallest stage-time cap in [lo, hi] that ``assign_within(cap)`` can meet (it returns
    None when the cap is too tight), by bisection on the cap; None when even ``hi`` is too tight. Used by the time
    partitions here and by the planner's memory-capped partition."""
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


def partition_runs(runs: list[tuple[float, int]], n_stages: int) -> list[int] | None:
    """:func:`partition` for a chain given as runs of identical layers ``(time, count)``: the greedy check counts
    how many layers of a run fit at once, so the cost grows with runs and stages, not layers."""
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
