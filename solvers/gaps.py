"""Integral schedules as one choice per *gap* of each candidate, and what such a set of choices realises.

Between two consecutive reads ``lo < hi`` of a candidate (its producer counts as a read) the tensor is
kept, or dropped after ``lo`` and regenerated for ``hi``: recomputed (with its sources traced back,
recursively, to what is readable there) or swapped in from its host checkpoint, issued at ``q``.
:class:`GapModel` holds the choices and realises them on the discrete timing model of
:mod:`solvers._common`: what is readable and present at each stage, the bytes per stage, the recompute
and stall seconds. How the choices are made (repair, improvement, starts) is
:class:`solvers.relax.GapPlanner`.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._common import Problem, Schedule, TensorSchedule, early_recompute_stage, source_available

KEEP, REC, SWAP = "keep", "rec", "swap"
SWAP_ISSUE_POINTS = 4      # swap-in issue stages the improvement tries between the earliest and latest hidden


@dataclass
class Gap:
    k: int
    lo: int
    hi: int
    kind: str = KEEP
    q: int = -1                    # swap-in issue stage (SWAP)


@dataclass
class Realized:
    readable: np.ndarray           # (K, T) bool: readable at op t (produced, kept, landed or recomputed)
    pres: np.ndarray               # (K, T) bool: holds device bytes at stage t (readable, copy in flight)
    mem: np.ndarray                # (T,) int64 bytes at each stage (op rows)
    replay_over: np.ndarray        # (T,) int64 extra bytes while a replay runs (0 if none or not binding)
    recs: dict[int, set[int]]      # stage -> candidates recomputed there (incl. traced sources)
    cost: float                    # recompute + stall seconds (stalls against the unstretched clock)
    late: bool                     # a copy ends after the last op
    broken: list[Gap] = field(default_factory=list)   # recompute gaps whose sources cannot be traced

    def over(self, budget: int) -> np.ndarray:
        return np.maximum(self.mem + self.replay_over - budget, 0)


class GapModel:
    """One choice per gap, realised.

    Copies follow the simulator's rule (FIFO per direction, a swap-in waits for the host copy) on the
    unstretched compute clock ``cum``: recomputes and stalls only delay the compute stream, so a copy
    ends no later, relative to the stages, than computed here.
    """

    def __init__(self, p: Problem, *, link_weight: float = 0.0, allow_swap: bool = True,
                 allow_recompute: bool = True, stage_link: list[tuple[dict, list]] | None = None):
        self.p = p
        # the copies a link="stage" MILP offers (milp.stage_link_copies): when given, a schedule whose
        # copies that model cannot hold (one per direction per stage, offered issue stages) is late
        self.stage_link = stage_link
        self.link_weight = link_weight
        self.allow_swap = allow_swap
        self.allow_recompute = allow_recompute
        C = p.candidates
        self.K, self.T = len(C), p.T
        self.b = np.array([c.nbytes for c in C], dtype=np.int64)
        self.bf = self.b.astype(np.float64)
        self.gaps: list[Gap] = []
        self.gaps_of: list[list[int]] = []
        for k, c in enumerate(C):
            reads = [c.start] + [u for u in c.uses if u > c.start]
            mine = []
            for lo, hi in zip(reads[:-1], reads[1:]):
                if hi - lo >= 2:
                    mine.append(len(self.gaps))
                    self.gaps.append(Gap(k, lo, hi))
            self.gaps_of.append(mine)
        self.read_list = [sorted(set([c.start, *c.uses])) for c in C]
        self.out: list[int | None] = [None] * self.K      # swap-out stage per candidate
        self.op_extra = p.op_extra()
        self.replay_extra = np.array([p.replay_extra(k) for k in range(self.K)], dtype=np.int64)
        self._can_rec: dict[tuple[int, int], bool] = {}
        self._early: dict[tuple[int, int], int] = {}
        self._pinned: Gap | None = None
        self.src_cands = [[p.index[j] for j in c.src if j in p.index and p.index[j] != k] for k, c in enumerate(C)]
        self.rec_s = np.array([c.recompute_s for c in C])
        self.d2h_s = np.array([c.d2h_s for c in C])
        self.h2d_s = np.array([c.h2d_s for c in C])
        self.rep = _replay_representatives(p)
        self.cum = p.cum
        self.cum_l = [float(x) for x in p.cum]
        self.d2h_l = [float(x) for x in self.d2h_s]
        self.h2d_l = [float(x) for x in self.h2d_s]
        self.start = np.array([c.start for c in C], dtype=np.int64)
        self.base_read = np.zeros((self.K, self.T), dtype=bool)
        for k, rl in enumerate(self.read_list):
            self.base_read[k, rl] = True

    # ---- facts -------------------------------------------------------------------------------------
    def can_rec(self, k: int, t: int) -> bool:
        key = (k, t)
        v = self._can_rec.get(key)
        if v is None:
            c = self.p.candidates[k]
            v = self.allow_recompute and c.can_recompute and all(source_available(self.p, j, t) is not False
                                                                  for j in c.src)
            self._can_rec[key] = v
        return v

    def early_rec(self, g: Gap) -> int | None:
        """The stage inside gap ``g`` where its tensor can be recomputed and kept until ``g.hi`` when it
        cannot be recomputed at ``g.hi`` itself (:func:`solvers._common.early_recompute_stage`), or None."""
        if not self.allow_recompute:
            return None
        v = self._early.get((g.k, g.hi))
        if v is None:
            e = early_recompute_stage(self.p, g.k, g.hi)
            v = self._early[g.k, g.hi] = -1 if e is None else e
        return v if v > g.lo else None

    def stage_of(self, when: float, after: int) -> int:
        """The stage during which time ``when`` falls on the unstretched clock (at least ``after``)."""
        f = bisect.bisect_left(self.cum_l, when - 1e-12) - 1
        return f if f > after else after

    # ---- realise the current choices ----------------------------------------------------------------
    def realize(self) -> Realized:
        K, T, cum = self.K, self.T, self.cum
        readable = self.base_read.copy()
        pres = np.zeros((K, T), dtype=bool)
        cost = 0.0
        late = False
        swaps = []
        for g in self.gaps:
            if g.kind == KEEP:
                readable[g.k, g.lo:g.hi + 1] = True
            elif g.kind == SWAP:
                swaps.append(g)
            elif g.lo < g.q < g.hi:           # recomputed early (with a replay it shares), kept to hi
                readable[g.k, g.q + 1:g.hi + 1] = True
        # d2h: FIFO in issue order; the device copy is held until the copy ends
        cl = self.cum_l
        host_ready = [math.inf] * K
        free = 0.0
        for o, k in sorted((o, k) for k, o in enumerate(self.out) if o is not None):
            start = cl[o + 1] if cl[o + 1] > free else free
            free = host_ready[k] = start + self.d2h_l[k]
            f = self.stage_of(free, o + 1)
            if f >= T:
                late = True
                f = T - 1
            pres[k, o + 1:f + 1] = True
        # h2d: FIFO in issue order; a swap-in waits for its host copy
        free = 0.0
        swaps.sort(key=lambda g: (g.q, g.k))
        for g in swaps:
            k = g.k
            o = self.out[k]
            if o is None or o > g.lo:
                late = True          # no host copy: invalid, reported as a violation
                continue
            start = max(cl[g.q], free, host_ready[k])
            free = start + self.h2d_l[k]
            if free > cl[g.hi]:
                cost += free - cl[g.hi]
            pres[k, g.q:g.hi] = True
        # recomputes at the regeneration stages, sources traced recursively
        recs: dict[int, set[int]] = {}
        broken: list[Gap] = []
        blocked = pres & ~readable           # in flight: cannot be recomputed there
        for g in self.gaps:
            if g.kind == REC:
                at = g.q if g.lo < g.q < g.hi else g.hi
                acc = recs.setdefault(at, set())
                trial = set(acc)
                if self._trace(g.k, at, readable, blocked, trial, set()):
                    acc |= trial
                else:
                    broken.append(g)
        over = np.zeros(T, dtype=np.int64)
        for t, ks in recs.items():
            for k in ks:
                readable[k, t] = True
            if ks:
                cost += float(sum(self.rec_s[k] for k in {self.rep[k] for k in ks}))
                over[t] = max(max(int(self.replay_extra[k]) for k in ks) - int(self.op_extra[t]), 0)
        if self.stage_link is not None and self.link_conflicts():
            late = True
        pres |= readable
        pres[np.arange(K), self.start] = False      # at its producer a candidate is in base_mem
        # bytes per stage: a float BLAS product (exact: every partial sum is far below 2**53) is ~10x
        # faster than numpy's integer matmul, and realize() runs once per move tried
        mem = self.p.base_mem + np.rint(self.bf @ pres.astype(np.float64)).astype(np.int64)
        return Realized(readable, pres, mem, over, recs, cost, late, broken)

    def _trace(self, k: int, t: int, readable: np.ndarray, blocked: np.ndarray, acc: set[int], stack: set[int]) -> bool:
        """Recompute k at t: add it and, recursively, its sources that are not readable at t."""
        if k in acc:
            return True
        if not self.can_rec(k, t) or k in stack or blocked[k, t]:
            return False
        stack.add(k)
        for j in self.src_cands[k]:
            if readable[j, t] or j in acc:
                continue
            if not self._trace(j, t, readable, blocked, acc, stack):
                stack.discard(k)
                return False
        stack.discard(k)
        acc.add(k)
        return True

    def link_conflicts(self) -> list[tuple[str, Any]]:
        """Copies a ``link="stage"`` MILP cannot hold, in issue order: ``("out", k)`` for a swap-out
        it does not offer or that shares a stage with an earlier one, ``("in", gap)`` likewise for a
        swap-in (also one issued before its swap-out ended there)."""
        p, offer = self.p, self.stage_link
        bad: list[tuple[str, Any]] = []
        busy: set[int] = set()
        ends: dict[int, int] = {}
        for o, k in sorted((o, k) for k, o in enumerate(self.out) if o is not None):
            fs = offer[k][0].get(o)
            held = set(range(o + 1, fs[0] + 1)) if fs else set()
            if not fs or held & busy:
                bad.append(("out", k))
                continue
            busy |= held
            ends[k] = fs[0]
        busy = set()
        for g in sorted((g for g in self.gaps if g.kind == SWAP), key=lambda g: (g.q, g.k)):
            ready = p.in_ready(g.q, self.h2d_s[g.k])
            held = set(range(g.q, max(g.q, min(g.hi, ready - 1)) + 1))
            offered = any(q == g.q and u == g.hi for q, u, _ in offer[g.k][1])
            if not offered or ends.get(g.k, p.T) >= g.q or held & busy:
                bad.append(("in", g))
                continue
            busy |= held
        return bad

    def feasible(self, r: Realized) -> bool:
        return not r.broken and not r.late and not r.over(self.p.budget).any()

    # ---- the choices: read and change them ----------------------------------------------------------
    def gap_at(self, k: int, t: int) -> Gap | None:
        for i in self.gaps_of[k]:
            g = self.gaps[i]
            if g.lo < t < g.hi or (g.kind == SWAP and g.lo < t <= g.hi):
                return g
        return None

    def latest_hidden_q(self, g: Gap) -> int:
        """The latest issue stage whose copy (alone on the link) lands before op hi."""
        target = self.cum[g.hi] - self.h2d_s[g.k]
        q = int(np.searchsorted(self.cum, target + 1e-15, side="right")) - 1
        return min(max(q, g.lo + 1), g.hi)

    def swap_issue_stages(self, g: Gap, points: int = SWAP_ISSUE_POINTS) -> list[int]:
        """Issue stages to try for swapping gap ``g`` in: the earliest (``lo + 1``: no stall, the copy held
        longest), the latest hidden one (alone on the link, it lands just in time) and ``points`` evenly
        between them. With other copies queued on the link the latest hidden stage stalls and the earliest
        holds the bytes long; a stage between is often the one that does neither, which is what lets a
        plan carry more bytes over the host link instead of recomputing them."""
        a, b = g.lo + 1, self.latest_hidden_q(g)
        qs = {a, b}
        if points and b > a + 1:
            qs.update(int(round(x)) for x in np.linspace(a, b, points + 2)[1:-1])
        return sorted(qs)

    def _snapshot(self) -> tuple:
        return [(g.kind, g.q) for g in self.gaps], list(self.out)

    def _restore(self, snap: tuple) -> None:
        for g, (kind, q) in zip(self.gaps, snap[0]):
            g.kind, g.q = kind, q
        self.out = list(snap[1])

    def _set(self, g: Gap, kind: str, q: int = -1) -> None:
        g.kind, g.q = kind, q
        k = g.k
        if kind == SWAP and (self.out[k] is None or self.out[k] > g.lo):
            self.out[k] = self.p.candidates[k].start
        if kind != SWAP and self.out[k] is not None and not any(self.gaps[i].kind == SWAP for i in self.gaps_of[k]):
            self.out[k] = None

    def can_swap(self, g: Gap) -> bool:
        k = g.k
        o = self.out[k]
        if o is not None and o <= g.lo:
            return True
        return self.p.out_finish(self.p.candidates[k].start, self.d2h_s[k]) is not None

    def _do(self, move: tuple) -> None:
        if move[0] == "out":
            self.out[move[1]] = move[2]
        elif move[0] == "drop_out":
            k = move[1]
            for i in self.gaps_of[k]:
                g = self.gaps[i]
                if g.kind == SWAP:
                    g.kind, g.q = (REC if self.can_rec(k, g.hi) else KEEP), -1
            self.out[k] = None
        else:
            _, g, kind, q = move
            self._set(g, kind, q)

    # ---- output ------------------------------------------------------------------------------------
    def schedule(self, r: Realized) -> Schedule:
        p = self.p
        sched = Schedule()
        for k, c in enumerate(p.candidates):
            pres = r.readable[k, c.start:c.end + 1].copy()
            pres[0] = True
            recs = sorted(t for t, ks in r.recs.items() if k in ks)
            swaps = [(g.q, g.hi) for g in (self.gaps[i] for i in self.gaps_of[k]) if g.kind == SWAP]
            sched.tensors[c.tensor] = TensorSchedule(c.tensor, c.start, pres, recs, self.out[k], swaps)
        return sched


def _replay_representatives(p: Problem) -> list[int]:
    """Per candidate, the first candidate with the same producers (one replay serves them all)."""
    first: dict[tuple[int, ...], int] = {}
    return [first.setdefault(p.producers(k), k) for k in range(len(p.candidates))]
