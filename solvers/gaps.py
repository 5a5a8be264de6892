"""Integral schedules as one choice per *gap* of each candidate, and what such a set of choices realises.

Between two consecutive reads ``lo < hi`` of a candidate (its producer counts as a read) the tensor is
kept, or dropped after ``lo`` and regenerated for ``hi``: recomputed (with its sources traced back,
recursively, to what is readable there) or swapped in from its host checkpoint, issued at ``q``.
:class:`GapModel` holds the choices and realises them on the discrete timing model of
:mod:`solvers._common`: what is readable and present at each stage, the bytes per stage, the recompute
and stall seconds. How the choices are made (repair, improvement, starts) is
:class:`solvers.relax.GapPlanner`.

The planner tries thousands of single-candidate changes; each is realised from the realisation before it
(``realize(base, changed)``), redoing only the rows, copies and replay stages the change can reach, with
the same result as a full realisation.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

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


class _Stage(NamedTuple):
    """The replays traced at one stage."""
    recs: set[int]                 # candidates replayed there (traced sources included)
    broken: tuple[int, ...]        # indices of the recompute gaps there whose sources cannot be traced
    cost: float                    # seconds of the replays (one per representative)
    over: int                      # replay bytes beyond the op's own extra bytes (0 if none)
    seen: frozenset[int]           # candidates whose readable / in-flight bit the tracing read there


class _D2H(NamedTuple):
    """The swap-out queue, timed."""
    outs: list[tuple[int, int]]              # (issue stage, candidate), sorted: FIFO order
    free: list[float]                        # per entry: when its copy ends (the link is free)
    late: list[bool]                         # per entry: it ends after the last op
    ranges: list[tuple[int, int] | None]     # per candidate: the stages [a, b) its device copy is held
    host_ready: list[float]                  # per candidate: when its host copy is ready (inf: none)


class _H2D(NamedTuple):
    """The swap-in queue, timed."""
    swaps: list[tuple[int, int, int]]        # (issue stage, candidate, gap index), sorted: FIFO order
    free: list[float]                        # per entry: when the link is free after it
    stall: list[float]                       # per entry: the seconds it stalls (0.0 if none)
    late: list[bool]                         # per entry: no host copy to swap in from (invalid)
    total: float                             # the stalls summed in queue order


def _span(new: list[tuple], old: list[tuple], touched: set[int] | frozenset[int]) -> tuple[int, int]:
    """[i, j): the entries of queue ``new`` that may time differently from ``old``'s: past them both
    queues hold the same entries (none of a candidate in ``touched``), shifted by the length difference."""
    m = min(len(new), len(old))
    i = 0
    while i < m and new[i] == old[i] and new[i][1] not in touched:
        i += 1
    j = 0
    while j < m - i and new[-1 - j] == old[-1 - j] and new[-1 - j][1] not in touched:
        j += 1
    return i, len(new) - j


class _Inc(NamedTuple):
    """What a realisation was derived from, kept so that the next one redoes only what a change touches
    (:meth:`GapModel.realize` with ``changed``)."""
    d2h: _D2H                                # the swap-out queue
    h2d: _H2D                                # the swap-in queue
    gap_at: list[int]                        # per gap: the stage it is recomputed at, -1 if it is not
    at_gaps: dict[int, list[int]]            # stage -> its recompute gaps in gap order; keys in first-gap order
    stages: dict[int, _Stage]                # stage -> its replays


class Realized:
    """What a set of choices realises. ``readable`` and ``pres`` of a realisation derived from another one
    (:meth:`GapModel.realize` with ``changed``) are built from that one's and the rows that differ on first
    use: most such realisations are a trial only ever judged by ``mem``, ``cost`` and ``broken``."""

    def __init__(self, mem: np.ndarray, replay_over: np.ndarray, recs: dict[int, set[int]], cost: float,
                 late: bool, broken: list[Gap], inc: _Inc, arrays: tuple[np.ndarray, ...] | None = None,
                 parent: Realized | None = None, rows: dict[int, tuple[np.ndarray, ...]] | None = None):
        self.mem = mem                 # (T,) int64 bytes at each stage (op rows)
        self.replay_over = replay_over  # (T,) int64 extra bytes while a replay runs (0 if none or not binding)
        self.recs = recs               # stage -> candidates recomputed there (incl. traced sources)
        self.cost = cost               # recompute + stall seconds (stalls against the unstretched clock)
        self.late = late               # a copy ends after the last op (or breaks the stage link model)
        self.broken = broken           # recompute gaps whose sources cannot be traced
        self._inc = inc
        # (readable before replays, the copies' device stages, readable, pres), each (K, T) bool; or
        # the parent's with ``rows`` (candidate -> those four rows) in their place
        self._arrays = arrays
        self._parent = parent
        self._rows = rows

    def _full(self) -> tuple[np.ndarray, ...]:
        if self._arrays is None:
            arrays = tuple(a.copy() for a in self._parent._full())
            for k, rows in self._rows.items():
                for a, row in zip(arrays, rows):
                    a[k] = row
            self._arrays, self._parent, self._rows = arrays, None, None
        return self._arrays

    @property
    def readable(self) -> np.ndarray:
        """(K, T) bool: readable at op t (produced, kept, landed or recomputed)."""
        return self._full()[2]

    @property
    def pres(self) -> np.ndarray:
        """(K, T) bool: holds device bytes at stage t (readable, copy in flight)."""
        return self._full()[3]

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
    check_incremental = False      # tests: every derived realisation is checked against a full one

    def realize(self, base: Realized | None = None, changed: Iterable[int] = (),
                reject_at: float | None = None) -> Realized | None:
        """What the current choices realise.

        With ``base`` (a realisation of this model) the caller promises that the choices differ from the
        ones ``base`` realised only in the gaps and the swap-out of the candidates ``changed``. Then only
        what those touch is redone: their rows, the rows of the swap-outs queued behind theirs that now
        end at another stage, the stages whose replays can see a changed row, the bytes of the changed
        rows. The result is the same as a full realisation's (same floating-point operations in the same
        order); a move tried on one candidate then costs a fraction of a full realisation.

        ``reject_at`` (with ``base``): None instead of a realisation that is late, has broken gaps or costs
        at least this much, found before its bytes are counted (most moves tried fail so)."""
        if base is None:
            return self._realize_full()
        r = self._realize_from(base, set(changed), reject_at)
        if self.check_incremental:
            full = self._realize_full()
            if r is None:
                assert full.late or full.broken or full.cost >= reject_at, "rejected a realisation that passes"
            else:
                _assert_same(r, full)
        return r

    def _realize_full(self) -> Realized:
        K, T, gaps, out = self.K, self.T, self.gaps, self.out
        r0 = self.base_read.copy()              # readable before the replays
        gap_at = [-1] * len(gaps)
        at_gaps: dict[int, list[int]] = {}
        swaps: list[tuple[int, int, int]] = []
        for gi, g in enumerate(gaps):
            if g.kind == KEEP:
                r0[g.k, g.lo:g.hi + 1] = True
            elif g.kind == SWAP:
                swaps.append((g.q, g.k, gi))
            else:
                at = g.hi
                if g.lo < g.q < g.hi:           # recomputed early (with a replay it shares), kept to hi
                    r0[g.k, g.q + 1:g.hi + 1] = True
                    at = g.q
                gap_at[gi] = at
                at_gaps.setdefault(at, []).append(gi)
        swaps.sort()
        outs = sorted((o, k) for k, o in enumerate(out) if o is not None)
        d2h, _ = self._d2h(outs)
        h2d, stall, late_in = self._h2d(swaps, d2h.host_ready)
        late_out = any(d2h.late)
        cpres = np.zeros((K, T), dtype=bool)    # device bytes of copies in flight
        for k, rg in enumerate(d2h.ranges):
            if rg is not None:
                cpres[k, rg[0]:rg[1]] = True
        for q, k, gi in swaps:
            o = out[k]
            if o is not None and o <= gaps[gi].lo:
                cpres[k, q:gaps[gi].hi] = True
        blocked = cpres & ~r0                   # in flight: cannot be recomputed there
        stages = {t: self._stage(t, gis, r0[:, t].tolist(), blocked[:, t].tolist()) for t, gis in at_gaps.items()}
        readable = r0.copy()
        replay_over = np.zeros(T, dtype=np.int64)
        for t, st in stages.items():
            if st.recs:
                readable[list(st.recs), t] = True
                replay_over[t] = st.over
        pres = cpres | readable
        pres[np.arange(K), self.start] = False      # at its producer a candidate is in base_mem
        # bytes per stage: a float BLAS product (exact: every partial sum is far below 2**53) is ~10x
        # faster than numpy's integer matmul
        mem = self.p.base_mem + np.rint(self.bf @ pres.astype(np.float64)).astype(np.int64)
        recs, cost, broken = self._totals(at_gaps, stages, stall)
        late = late_out or late_in or bool(self.stage_link is not None and self.link_conflicts())
        return Realized(mem, replay_over, recs, cost, late, broken,
                        _Inc(d2h, h2d, gap_at, at_gaps, stages), arrays=(r0, cpres, readable, pres))

    def _realize_from(self, base: Realized, changed: set[int], reject_at: float | None = None) -> Realized | None:
        b = base._inc
        gaps, out, gaps_of = self.gaps, self.out, self.gaps_of
        r0b, cpb, rdb, prb = base._full()
        # the changed candidates' rows before replays, and which recompute stages their gaps moved between
        gap_at = b.gap_at
        moved_at: set[int] = set()
        new_r0: dict[int, np.ndarray] = {}
        for k in changed:
            row = self.base_read[k].copy()
            for gi in gaps_of[k]:
                g = gaps[gi]
                at = -1
                if g.kind == KEEP:
                    row[g.lo:g.hi + 1] = True
                elif g.kind == REC:
                    at = g.hi
                    if g.lo < g.q < g.hi:
                        row[g.q + 1:g.hi + 1] = True
                        at = g.q
                if at != gap_at[gi]:
                    if gap_at is b.gap_at:
                        gap_at = list(gap_at)
                    moved_at.update((gap_at[gi], at))
                    gap_at[gi] = at
            new_r0[k] = row
        moved_at.discard(-1)
        at_gaps = b.at_gaps
        if moved_at:
            lists = dict(at_gaps)
            for t in moved_at:
                gl = sorted({gi for gi in lists.get(t, ()) if gap_at[gi] == t}
                            | {gi for k in changed for gi in gaps_of[k] if gap_at[gi] == t})
                if gl:
                    lists[t] = gl
                else:
                    lists.pop(t, None)
            at_gaps = dict(sorted(lists.items(), key=lambda kv: kv[1][0]))    # first-gap order, as a full pass
        # the copy queues: a changed copy shifts the ones queued behind it, until the link is free when
        # it was before
        swaps = [s for s in b.h2d.swaps if s[1] not in changed]
        for k in changed:
            swaps += [(gaps[gi].q, k, gi) for gi in gaps_of[k] if gaps[gi].kind == SWAP]
        swaps.sort()
        outs = [x for x in b.d2h.outs if x[1] not in changed] + [(out[k], k) for k in changed if out[k] is not None]
        outs.sort()
        d2h, moved = self._d2h(outs, b.d2h, changed)
        h2d, stall, late_in = self._h2d(swaps, d2h.host_ready, b.h2d, moved.union(changed))
        late_out = any(d2h.late)
        if reject_at is not None and (late_out or late_in):
            return None
        ranges = d2h.ranges
        dirty = set(changed)
        dirty.update(k for k in moved if ranges[k] != b.d2h.ranges[k])
        # the dirty rows before replays, and the stages where what a replay sees changed
        rows: dict[int, tuple[np.ndarray, ...]] = {}
        diff: dict[int, np.ndarray] = {}       # per dirty row: the columns where a replay would see it differ
        for k in dirty:
            r0k = new_r0.get(k)
            if r0k is None:
                r0k = r0b[k]
            cp = self._cpres_row(k, ranges[k])
            d = (cp & ~r0k) != (cpb[k] & ~r0b[k])
            if k in new_r0:
                d |= r0k != r0b[k]
            rows[k] = (r0k, cp)
            diff[k] = d
        # a stage is traced again only if its gaps changed or its tracing read a bit that changed (it is
        # a function of those bits alone)
        redo = set()
        for t in at_gaps:
            if t in moved_at or any(d[t] and k in b.stages[t].seen for k, d in diff.items()):
                redo.add(t)
        gone = [t for t in moved_at if t not in at_gaps]
        stages = b.stages
        replay_over = base.replay_over
        remarked: set[int] = set()         # candidates whose replay marks changed
        if redo or gone:
            stages = dict(stages)
            replay_over = replay_over.copy()
            for t in gone:
                remarked |= stages.pop(t).recs
                replay_over[t] = 0
            for t in redo:
                rcol = r0b[:, t].tolist()
                bcol = (cpb[:, t] & ~r0b[:, t]).tolist()
                for k, (r0k, cp) in rows.items():
                    rcol[k] = bool(r0k[t])
                    bcol[k] = bool(cp[t]) and not rcol[k]
                st = self._stage(t, at_gaps[t], rcol, bcol)
                old = stages.get(t)
                remarked |= st.recs ^ old.recs if old is not None else st.recs
                stages[t] = st
                replay_over[t] = st.over if st.recs else 0
        recs, cost, broken = self._totals(at_gaps, stages, stall)
        late = late_out or late_in or bool(self.stage_link is not None and self.link_conflicts())
        if reject_at is not None and (late or broken or cost >= reject_at):
            return None
        # final rows and the bytes they change
        mem = base.mem.copy()
        marks_at = redo.union(gone)
        for k in dirty | remarked:
            r0k, cp = rows.get(k) or (r0b[k], cpb[k])
            if k in changed:           # its rows before replays changed anywhere: all its marks again
                rd = r0k.copy()
                for t, st in stages.items():
                    if k in st.recs:
                        rd[t] = True
            else:                      # only the marks at the stages redone can differ
                rd = rdb[k].copy()
                for t in marks_at:
                    st = stages.get(t)
                    rd[t] = bool(r0k[t]) or (st is not None and k in st.recs)
            pr = cp | rd
            pr[self.start[k]] = False
            rows[k] = (r0k, cp, rd, pr)
            d = np.flatnonzero(pr != prb[k])
            if d.size:
                mem[d] += np.where(pr[d], self.b[k], -self.b[k])
        return Realized(mem, replay_over, recs, cost, late, broken,
                        _Inc(d2h, h2d, gap_at, at_gaps, stages), parent=base, rows=rows)

    def _d2h(self, outs: list[tuple[int, int]], old: _D2H | None = None,
             changed: Iterable[int] = ()) -> tuple[_D2H, set[int]]:
        """The swap-outs, FIFO in issue order: the device stages [a, b) each copy is held (until it ends),
        when each host copy is ready, whether one ends after the last op. With ``old`` (the queue before
        the candidates ``changed`` changed) only the entries from the first that differs are timed again,
        until the link is free at the same time as before ahead of the same entries. Also returns the
        candidates whose host copy is now ready at another time."""
        T, cl, d2h, n = self.T, self.cum_l, self.d2h_l, len(outs)
        if old is None:
            i0, i1, off = 0, n, 0
            ranges: list[tuple[int, int] | None] = [None] * self.K
            host_ready = [math.inf] * self.K
            free_l: list[float] = []
            late_l: list[bool] = []
        else:
            i0, i1 = _span(outs, old.outs, ())
            if i0 == n == len(old.outs):
                return old, set()
            off = len(old.outs) - n
            ranges, host_ready = list(old.ranges), list(old.host_ready)
            free_l, late_l = old.free[:i0], old.late[:i0]
        moved: set[int] = set()
        if old is not None:
            for k in changed:
                if self.out[k] is None and old.ranges[k] is not None:    # dropped
                    ranges[k], host_ready[k] = None, math.inf
                    moved.add(k)
        free = free_l[-1] if free_l else 0.0
        for i in range(i0, n):
            if i >= i1:            # the same entries as before from here: the same times if the link is
                p = i + off
                if free == (old.free[p - 1] if p else 0.0):
                    free_l += old.free[p:]
                    late_l += old.late[p:]
                    break
            o, k = outs[i]
            start = cl[o + 1] if cl[o + 1] > free else free
            free = start + d2h[k]
            f = self.stage_of(free, o + 1)
            late_l.append(f >= T)
            if f >= T:
                f = T - 1
            free_l.append(free)
            if old is not None and free != old.host_ready[k]:
                moved.add(k)
            host_ready[k] = free
            ranges[k] = (o + 1, f + 1)
        return _D2H(outs, free_l, late_l, ranges, host_ready), moved

    def _h2d(self, swaps: list[tuple[int, int, int]], host_ready: list[float], old: _H2D | None = None,
             touched: set[int] | frozenset[int] = frozenset()) -> tuple[_H2D, float, bool]:
        """The swap-ins, FIFO in issue order, each after its host copy: the seconds they stall (in total,
        summed in queue order), and whether one has no host copy (invalid, reported as a violation). With
        ``old`` (the queue before the candidates ``touched`` changed or had their host copy ready at
        another time) only the entries from the first one that differs are timed again, as in :meth:`_d2h`."""
        cl, h2d, out, gaps, n = self.cum_l, self.h2d_l, self.out, self.gaps, len(swaps)
        if old is None:
            i0, i1, off = 0, n, 0
            free_l: list[float] = []
            stall_l: list[float] = []
            late_l: list[bool] = []
        else:
            i0, i1 = _span(swaps, old.swaps, touched)
            if i0 == n == len(old.swaps):
                return old, old.total, any(old.late)
            off = len(old.swaps) - n
            free_l, stall_l, late_l = old.free[:i0], old.stall[:i0], old.late[:i0]
        free = free_l[-1] if free_l else 0.0
        for i in range(i0, n):
            if i >= i1:
                p = i + off
                if free == (old.free[p - 1] if p else 0.0):
                    free_l += old.free[p:]
                    stall_l += old.stall[p:]
                    late_l += old.late[p:]
                    break
            q, k, gi = swaps[i]
            o = out[k]
            g = gaps[gi]
            if o is None or o > g.lo:
                free_l.append(free)
                stall_l.append(0.0)
                late_l.append(True)
                continue
            start = max(cl[q], free, host_ready[k])
            free = start + h2d[k]
            free_l.append(free)
            stall_l.append(free - cl[g.hi] if free > cl[g.hi] else 0.0)
            late_l.append(False)
        cost = 0.0
        for s in stall_l:          # in queue order, as the copies are timed: the same sum whatever was redone
            if s:
                cost += s
        return _H2D(swaps, free_l, stall_l, late_l, cost), cost, any(late_l)

    def _cpres_row(self, k: int, rg: tuple[int, int] | None) -> np.ndarray:
        """Candidate k's device stages held by its copies in flight (swap-out range ``rg``, its swap-ins)."""
        row = np.zeros(self.T, dtype=bool)
        if rg is not None:
            row[rg[0]:rg[1]] = True
        o = self.out[k]
        if o is not None:
            for gi in self.gaps_of[k]:
                g = self.gaps[gi]
                if g.kind == SWAP and o <= g.lo:
                    row[g.q:g.hi] = True
        return row

    def _stage(self, t: int, gis: list[int], readable: list[bool], blocked: list[bool]) -> _Stage:
        """The replays at stage t for its recompute gaps ``gis`` (in gap order), sources traced on the
        stage's columns of readable-before-replays and in-flight."""
        acc: set[int] = set()
        broken = []
        seen: set[int] = set()
        for gi in gis:
            trial = set(acc)
            if self._trace(self.gaps[gi].k, t, readable, blocked, trial, set(), seen):
                acc |= trial
            else:
                broken.append(gi)
        if not acc:
            return _Stage(acc, tuple(broken), 0.0, 0, frozenset(seen))
        cost = float(sum(self.rec_s[k] for k in {self.rep[k] for k in acc}))
        over = max(max(int(self.replay_extra[k]) for k in acc) - int(self.op_extra[t]), 0)
        return _Stage(acc, tuple(broken), cost, over, frozenset(seen))

    def _totals(self, at_gaps: dict[int, list[int]], stages: dict[int, _Stage],
                stall: float) -> tuple[dict[int, set[int]], float, list[Gap]]:
        """recs in first-gap order, the cost (stalls, then the replays in that order) and the broken gaps."""
        recs: dict[int, set[int]] = {}
        cost = stall
        broken: list[int] = []
        for t in at_gaps:
            st = stages[t]
            recs[t] = st.recs
            if st.recs:
                cost += st.cost
            broken += st.broken
        broken.sort()
        return recs, cost, [self.gaps[i] for i in broken]

    def _trace(self, k: int, t: int, readable: list[bool], blocked: list[bool], acc: set[int], stack: set[int],
               seen: set[int]) -> bool:
        """Recompute k at t: add it and, recursively, its sources that are not readable at t (``readable``,
        ``blocked``: the stage's columns; ``seen`` gets the candidates whose bits were read)."""
        if k in acc:
            return True
        seen.add(k)
        if not self.can_rec(k, t) or k in stack or blocked[k]:
            return False
        stack.add(k)
        for j in self.src_cands[k]:
            seen.add(j)
            if readable[j] or j in acc:
                continue
            if not self._trace(j, t, readable, blocked, acc, stack, seen):
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

    def _snap_of(self, ks: Iterable[int]) -> list:
        """The choices of candidates ``ks`` alone (what a move on them changes): cheaper than a snapshot."""
        return [(k, self.out[k], [(self.gaps[i].kind, self.gaps[i].q) for i in self.gaps_of[k]]) for k in ks]

    def _restore_of(self, snap: list) -> None:
        for k, o, choices in snap:
            self.out[k] = o
            for i, (kind, q) in zip(self.gaps_of[k], choices):
                self.gaps[i].kind, self.gaps[i].q = kind, q

    @staticmethod
    def _touches(move: tuple) -> int:
        """The candidate a move (see :meth:`_do`) changes."""
        return move[1].k if move[0] == "set" else move[1]

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


def _assert_same(r: Realized, full: Realized) -> None:
    """A derived realisation must equal the full one, down to the order of ``recs`` and the cost's bits."""
    assert r.cost == full.cost, ("cost", r.cost, full.cost)
    assert r.late == full.late, ("late", r.late, full.late)
    assert [id(g) for g in r.broken] == [id(g) for g in full.broken], "broken"
    assert list(r.recs.items()) == list(full.recs.items()), ("recs", r.recs, full.recs)
    assert np.array_equal(r.mem, full.mem), ("mem", np.flatnonzero(r.mem != full.mem))
    assert np.array_equal(r.replay_over, full.replay_over), "replay_over"
    for name, x, y in zip(("readable before replays", "copies", "readable", "pres"), r._full(), full._full()):
        assert np.array_equal(x, y), (name, np.argwhere(x != y)[:5])
    assert r._inc == full._inc, "derivation state"
