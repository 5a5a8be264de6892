"""A valid lower bound on the step time of *any* swap/recompute plan of a full graph under a budget.

The LP relaxation of the STR model is not solved on big graphs (ResNet-152: ~70k columns) and its
copy timing is conservative, so it bounds plans inside that model only. This bound holds for every
plan the simulator accepts whose actions are swaps, recomputes and frees (compression excluded, as in
STR's model), and costs milliseconds. Per stage ``t`` whose keep-all memory exceeds the budget:

- During op ``t`` the simulator counts every tensor alive at ``t`` unless its device copy is gone. Only
  evictable tensors made before ``t`` that op ``t`` does not read can be gone, so at least
  ``need = memory(t) - budget`` of their bytes must be off the device (those no stage reads after ``t``
  leave for free).
- Each of the others must come back before a later stage reads it: a *swap* (its swap-out finished
  before op ``t``, on the one d2h stream; its swap-in after ``t``, on the one h2d stream) or a
  *recompute* after ``t`` (one replay of its producer, and of the producer's in-place writers before
  ``t``, on the compute stream; a replay serves every output of the producer).
- So with ``X`` bytes swapped and the rest recomputed at cost ``R``, the step takes at least
  ``max(C_before, X / bw_d2h) + max(C_from + R, X / bw_h2d)``, where ``C_before``/``C_from`` are the op
  times before ``t`` and from ``t`` on. ``R`` is bounded below by a fractional knapsack over producers
  (cheapest seconds per byte first); the expression is convex in ``X``, minimized by golden section.

The bound is the maximum over stages (and the pure compute time). Tests check it against exhaustive
search over all plans of small graphs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridmem.graph.costs import DEFAULT_DEVICE, get_cost_model

if TYPE_CHECKING:
    from hybridmem.graph.ir import Graph


@dataclass(frozen=True)
class LowerBound:
    """``time_s`` <= the step time of every swap/recompute plan within the budget it was computed for."""

    time_s: float
    compute_s: float          # the pure compute time (the trivial bound)
    stage: int                # the stage whose memory gives the bound (-1: the compute time does)
    swap_bytes: float         # at that stage, bytes the bound lets the host link carry
    recompute_s: float        # ... and the recompute seconds it charges for the rest
    feasible: bool = True     # False: at some stage even evicting everything evictable does not fit

    @property
    def kind(self) -> str:
        return "compute" if self.stage < 0 else "swap/recompute"


def lower_bound(graph: "Graph", budget: int, device: Any = DEFAULT_DEVICE) -> LowerBound:
    """The bound above for ``budget`` bytes on ``device`` (a cost model name or object)."""
    model = get_cost_model(device) if isinstance(device, str) else device
    op_s = np.asarray(model.op_times(graph), dtype=np.float64)
    n = graph.num_stages
    compute = float(op_s.sum())
    if n == 0:
        return LowerBound(compute, compute, -1, 0.0, 0.0)
    before = np.concatenate(([0.0], np.cumsum(op_s)))  # before[t]: op time of stages < t
    # Seconds per byte: the marginal rate, so that a fixed cost per copy (none in the models today) is
    # left out rather than overcharged.
    per_d2h = (model.copy_time(2 << 30, "d2h") - model.copy_time(1 << 30, "d2h")) / (1 << 30)
    per_h2d = (model.copy_time(2 << 30, "h2d") - model.copy_time(1 << 30, "h2d")) / (1 << 30)
    mem = graph.memory_profile()
    writers = graph.writers()
    # Candidates (evictable tensors that outlive their producer) as arrays, for per-stage masks.
    cand = graph.evictable()
    ids = np.array([x.id for x in cand], dtype=np.int64)
    prod = np.array([x.producer for x in cand], dtype=np.int64)
    last = np.array([x.last_stage(n) for x in cand], dtype=np.int64)
    last_read = np.array([max(x.consumers, default=-1) for x in cand], dtype=np.int64)
    size = np.array([x.nbytes for x in cand], dtype=np.int64)
    # (candidate, in-place writer after its producer) pairs, flat: a stage's replay costs are array work
    pairs = [(j, w) for j, i in enumerate(ids) for w in set(writers.get(int(i), ())) if w > prod[j]]
    pair_c = np.array([j for j, _ in pairs], dtype=np.int64)
    pair_w = np.array([w for _, w in pairs], dtype=np.int64)
    det = np.array([s.deterministic for s in graph.stages], dtype=bool)
    best = LowerBound(compute, compute, -1, 0.0, 0.0)
    # the stages that need most first: the bound they give lets most of the others be skipped cheaply
    over = np.flatnonzero(mem > budget)
    for t in over[np.argsort(-mem[over], kind="stable")]:
        t = int(t)
        alive = (prod < t) & (t <= last)
        reads = graph.stages[t].inputs
        if reads:
            alive &= ~np.isin(ids, reads)
        later = alive & (last_read > t)
        # read by no later stage: freeing it is free
        need = int(mem[t]) - budget - int(size[alive & ~later].sum())
        if need <= 0:
            continue
        swap_cap = int(size[later].sum())
        if swap_cap < need:
            return LowerBound(float("inf"), compute, t, float(swap_cap), 0.0, feasible=False)
        if max(before[t], need * per_d2h) + max(compute - before[t], need * per_h2d) <= best.time_s:
            continue        # all swapped (no recompute): the value below is at most this, not above the bound
        sel = later[pair_c] & (pair_w <= t)
        rate, nbytes = _recompute_groups(prod[later], size[later], prod[pair_c[sel]], pair_w[sel], op_s, det)
        cum_b = np.concatenate(([0.0], np.cumsum(nbytes)))
        cum_s = np.concatenate(([0.0], np.cumsum(nbytes * rate)))

        def recompute_s(amount: float) -> float:
            # cheapest replays first, fractionally: a convex, piecewise-linear lower bound
            if amount <= 0:
                return 0.0
            k = min(int(np.searchsorted(cum_b, amount)) - 1, len(nbytes) - 1)
            return float(cum_s[k] + (amount - cum_b[k]) * rate[k])

        def total(swapped: float) -> float:
            return max(before[t], swapped * per_d2h) + max(compute - before[t] + recompute_s(need - swapped),
                                                           swapped * per_h2d)

        lo, hi = max(0.0, need - float(cum_b[-1])), float(need)
        if min(total(lo), total(hi)) <= best.time_s:
            continue        # the search below returns no more than either end: this stage cannot raise the bound
        x_best = _golden_min(total, lo, hi)
        value = total(x_best)
        if value > best.time_s:
            best = LowerBound(value, compute, t, x_best, recompute_s(need - x_best))
    return best


def _recompute_groups(prod: np.ndarray, size: np.ndarray, w_prod: np.ndarray, w_stage: np.ndarray,
                      op_s: np.ndarray, det: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(seconds per byte, bytes) of each producer's replay that could regenerate the tensors made by
    ``prod`` (``size`` bytes each), sorted cheapest first. A replay after ``t`` runs the producer and at
    least its forward in-place writers before ``t`` (``w_stage``, each writing a tensor of producer
    ``w_prod``; a writer of several of its tensors runs once); a non-deterministic stage (``det`` false)
    in it rules the recompute out."""
    groups, inverse = np.unique(prod, return_inverse=True)
    nbytes = np.bincount(inverse, weights=size.astype(np.float64), minlength=len(groups))
    cost = op_s[groups].astype(np.float64)
    ok = det[groups].copy()
    if len(w_stage):
        # each (producer, writer) once
        key = np.unique(w_prod * (len(op_s) + 1) + w_stage)
        g = np.searchsorted(groups, key // (len(op_s) + 1))
        w = key % (len(op_s) + 1)
        np.add.at(cost, g, op_s[w])
        np.logical_and.at(ok, g, det[w])
    rate = cost[ok] / nbytes[ok]
    order = np.argsort(rate, kind="stable")
    return rate[order], nbytes[ok][order]


def _golden_min(f: Any, lo: float, hi: float, iters: int = 80) -> float:
    """Argmin of a convex ``f`` on [lo, hi] (golden-section search; the ends are tried too)."""
    if hi <= lo:
        return lo
    g = (5 ** 0.5 - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return min((lo, hi, (a + b) / 2), key=f)
