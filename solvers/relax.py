"""STR's approximate planner: the LP relaxation of the MILP, made integral by recursive source tracing.

1. Solve the LP relaxation of :mod:`solvers.milp` (fast: it is a pure LP). Its value is a lower bound
   on the recompute + stall overhead of any plan in the model, reported as ``plan.info["lp_bound_s"]``.
2. Round per *gap*. Between two consecutive reads ``lo < hi`` of a candidate (its producer counts as a
   read), the tensor is either kept, or dropped after ``lo`` and regenerated for ``hi`` by a recompute or
   by a swap-in issued at some ``q`` (from its host checkpoint). The LP's mass on each way (mean of S over
   the gap, R at ``hi``, Y landing at ``hi``) picks the first choice; a second rule evicts every gap the LP
   mostly drops (mean S below 1/2), however it regenerates it, and lets step 5 keep back what fits.
3. Trace sources. A recompute at ``hi`` needs the producer's inputs there: kept, landed, or recomputed
   in turn at ``hi`` (recursively, sharing replays), else that recompute is not possible.
4. Repair memory, stage by stage in time order: at the first stage over budget, the cheapest change per
   byte freed there (keep -> swap-in hidden behind compute, keep -> recompute, an earlier swap-in issued
   later) is applied, until every stage fits.
5. Extend residency where memory allows: costly regenerations are turned back into keeps (or into
   cheaper swap-ins) while every stage still fits.

The same machinery without the LP (all gaps start as keeps) is the ``greedy`` planner used to warm-start
the MILP. Everything runs on the discrete timing model of :mod:`solvers._common`; the simulator then
judges the plan.

What a set of gap choices realises (memory, timing, traced sources) is :mod:`solvers.gaps`; how they
are made (repair, improvement, exchanges, starts) is :class:`GapPlanner` here; the LP itself is
:mod:`solvers.lp`.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from hybridmem.graph.plan import Action

from . import lp as lp_relaxation
from ._common import Problem, Schedule
from .gaps import KEEP, REC, SWAP, SWAP_ISSUE_POINTS, Gap, GapModel, Realized
from .lp import LPValues
from .milp import stage_link_copies


class GapPlanner(GapModel):
    """Integral schedules as one choice per gap (:class:`solvers.gaps.GapModel`), made: repaired where
    memory is over, improved gap by gap and by exchanges, legalised for a ``link="stage"`` MILP, and
    started from Capuchin's construction, a plan's actions or the LP's mass.
    """

    def legalize(self) -> None:
        """Drop the copies a ``link="stage"`` MILP cannot hold, first conflict first: a swap-out with
        its swap-ins, a swap-in's gap recomputed where possible, else kept (the repair then makes room)."""
        for _ in range(2 * (len(self.gaps) + self.K) + 1):
            bad = self.link_conflicts()
            if not bad:
                return
            kind, x = bad[0]
            if self._move_copy(kind, x, len(bad)):
                continue
            if kind == "out":
                self._do(("drop_out", x))
            else:
                self._set(x, REC if self.can_rec(x.k, x.hi) else KEEP)

    def _move_copy(self, kind: str, x: Any, n_bad: int) -> bool:
        """Move a conflicting copy to another issue stage the stage link model offers (a swap-in: the
        least stall first; a swap-out: the latest that still ends before its swap-ins) if that leaves
        fewer conflicts. Whether it moved."""
        snap = self._snapshot()
        if kind == "in":
            opts = sorted((st, q) for q, u, st in self.stage_link[x.k][1]
                          if u == x.hi and x.lo < q <= x.hi and q != x.q)
            tries = [(lambda q=q: self._set(x, SWAP, q)) for _, q in opts]
        else:
            lo = min((self.gaps[i].lo for i in self.gaps_of[x] if self.gaps[i].kind == SWAP), default=-1)
            opts = sorted((t for t in self.stage_link[x][0] if t <= lo and t != self.out[x]), reverse=True)
            tries = [(lambda t=t: self._do(("out", x, t))) for t in opts]
        for move in tries:
            move()
            if len(self.link_conflicts()) < n_bad:
                return True
            self._restore(snap)
        return False

    def _moves(self, k: int, t: int, r: Realized) -> list[tuple[float, tuple]]:
        """Changes that may take candidate k off the device at stage t, with a rough added cost."""
        moves: list[tuple[float, tuple]] = []
        g = self.gap_at(k, t)
        if g is not None and self._pinned is g:
            return moves                   # the exchange keeps this gap: others must make room
        if g is not None and g.kind == REC and g.lo < g.q < t:
            return [(0.0, ("set", g, REC, -1))]     # recomputed early: recompute it where it is read
        held_by_out = self.out[k] is not None and not r.readable[k, t] and (g is None or g.kind != SWAP or g.q > t)
        if held_by_out:
            o = self.out[k]
            start = self.p.candidates[k].start
            if o != start:
                moves.append((0.0, ("out", k, start)))
            cost = sum(self.rec_s[k] for i in self.gaps_of[k] if self.gaps[i].kind == SWAP)
            moves.append((cost, ("drop_out", k)))
            return moves
        if g is None or g.kind == REC:
            return moves
        if self.can_rec(k, g.hi):
            extra = sum(self.rec_s[j] for j in self.src_cands[k] if not r.readable[j, g.hi])
            moves.append((self.rec_s[k] + extra, ("set", g, REC, -1)))
        elif self.early_rec(g) is not None and self.early_rec(g) > t:
            e = self.early_rec(g)            # recomputed where its sources still are, kept until read
            extra = sum(self.rec_s[j] for j in self.src_cands[k] if not r.readable[j, e])
            moves.append((self.rec_s[k] + extra, ("set", g, REC, e)))
        if self.allow_swap and self.can_swap(g):
            link = self.link_weight * (self.h2d_s[k] + (self.d2h_s[k] if self.out[k] is None else 0.0))
            if self.stage_link is not None:
                # only copies the stage link model holds: any other makes the schedule late
                for st, seq in self.legal_swaps(g, after=t):
                    moves.append((st + link, seq))
                return moves
            q_late = self.latest_hidden_q(g)
            for q in sorted({t + 1, max(q_late, t + 1)}):
                if q <= g.hi:
                    moves.append((self.p.in_stall(q, g.hi, self.h2d_s[k]) + link, ("set", g, SWAP, q)))
        return moves

    def legal_swaps(self, g: Gap, after: int, most: int = 2) -> list[tuple[float, Any]]:
        """With ``stage_link``: ways to swap gap ``g`` in, issued after stage ``after``, that add no copy
        the stage link model cannot hold, as ``(stall seconds, move)``: an offered swap-in issue stage
        (least stall first, then the latest) behind the tensor's swap-out, or behind a swap-out moved to
        another offered issue stage where the one it has (or would get) shares the link. At most ``most``."""
        k = g.k
        offer_out, offer_in = self.stage_link[k]
        qs = sorted(((st, -q) for q, u, st in offer_in if u == g.hi and max(g.lo, after) < q <= g.hi))
        if not qs:
            return []
        if self.out[k] is not None and self.out[k] <= g.lo:
            outs = [self.out[k]]           # its checkpoint is there already (other gaps may read it)
        else:
            outs = sorted((o for o in offer_out if o <= g.lo), reverse=True)
        snap = self._snapshot()
        before = len(self.link_conflicts())
        found: list[tuple[float, Any]] = []
        for o in outs:
            for st, mq in qs:
                seq = (("set", g, SWAP, -mq), ("out", k, o))
                for m in seq:
                    self._do(m)
                ok = len(self.link_conflicts()) <= before
                self._restore(snap)
                if ok:
                    found.append((st, seq))
                    break                      # the least stall behind this swap-out
            if len(found) >= most:
                break
        return found

    def repair(self, deadline: float, tries: int = 4) -> Realized:
        """Fix memory violations in time order: at the first stage over budget, the change with the least
        added time per byte freed there (among the ``tries`` most promising) that does not add overflow."""
        B = self.p.budget
        r = self.realize()
        steps = 0
        while time.perf_counter() < deadline:
            if r.broken:
                steps += 1
                if steps > 20 * (len(self.gaps) + self.K):
                    break
                for g in r.broken:          # its sources went away: swap it in if possible, else keep it
                    self._swap_or_keep(g)
                r = self.realize()
                if r.broken:
                    for g in r.broken:
                        self._set(g, KEEP)
                    r = self.realize()
                continue
            over = r.over(B)
            bad = np.flatnonzero(over)
            if not bad.size:
                break
            t = int(bad[0])
            need = int(over[t])
            moves = []
            for k in np.flatnonzero(r.pres[:, t] & ~self.base_read[:, t]):
                for cost, mv in self._moves(int(k), t, r):
                    moves.append(((cost + 1e-9) / min(int(self.b[k]), need), mv))
            moves.sort(key=lambda m: m[0])
            best = self._best_move([mv for _, mv in moves[:tries]], t, r, over)
            if best is None:
                # nothing frees t alone: a swap-out queued behind earlier ones may end in time if one
                # of those gives its host checkpoint up (its gaps recomputed or kept)
                combos = []
                for _, mv in moves:
                    if mv[0] == "set" and mv[2] == SWAP:
                        k = mv[1].k
                        ahead = [j for j in range(self.K) if j != k and self.out[j] is not None
                                 and self.out[j] <= (self.out[k] if self.out[k] is not None else self.p.candidates[k].start)]
                        combos += [(("drop_out", j), mv) for j in ahead]
                best = self._best_move(combos[:4 * tries], t, r, over)
            if best is None:
                break
            for mv in best[1]:
                self._do(mv)
            r = best[2]
            steps += 1
            if steps > 20 * (len(self.gaps) + self.K):
                break
        return r

    def _swap_or_keep(self, g: Gap) -> None:
        """Swap ``g`` in (hidden where possible; with ``stage_link`` only as that model allows), else keep it."""
        if self.stage_link is None:
            self._set(g, SWAP, self.latest_hidden_q(g)) if self.can_swap(g) else self._set(g, KEEP)
            return
        if self.allow_swap and self.can_swap(g):
            legal = self.legal_swaps(g, after=g.lo, most=1)
            if legal:
                for m in legal[0][1]:
                    self._do(m)
                return
        self._set(g, KEEP)

    def _best_move(self, moves: list, t: int, r: Realized, over: np.ndarray):
        """Try each move (or tuple of moves); the least added time per byte freed at t, without new overflow."""
        B = self.p.budget
        best = None
        total_over = int(over.sum())
        for mv in moves:
            seq = mv if isinstance(mv[0], tuple) else (mv,)
            ks = {self._touches(m) for m in seq}
            snap = self._snap_of(ks)
            for m in seq:
                self._do(m)
            r2 = self.realize(r, ks)
            over2 = r2.over(B)
            freed = int(over[t] - over2[t])
            # with stage_link (a start for the MILP): a move that leaves a recompute without its sources
            # is undone by the swap-or-keep above, which puts the bytes back: the repair would go round
            if freed > 0 and not r2.late and not (self.stage_link is not None and len(r2.broken) > len(r.broken)):
                dcost = r2.cost - r.cost
                growth = max(int(over2.sum()) - total_over + freed, 0)
                score = (max(dcost, 0.0) + 1e-9) / freed + (1e3 if growth else 0.0) + 1e6 * len(r2.broken)
                if best is None or score < best[0]:
                    best = (score, seq, r2)
            self._restore_of(snap)
        return best

    def improve(self, r: Realized, deadline: float) -> Realized:
        """Extend residency where memory allows; else try a cheaper regeneration. Repeats until stable:
        first with a swap-in issued at the earliest or the latest hidden stage only (few trials per gap),
        then also at the stages between them (:meth:`swap_issue_stages`), until stable again."""
        for points in (0, SWAP_ISSUE_POINTS):
            r = self._improve(r, deadline, points)
        return r

    def _improve(self, r: Realized, deadline: float, points: int) -> Realized:
        base = self.realize()      # what each trial is derived from (r as given may be any equal one)
        changed = True
        while changed and time.perf_counter() < deadline:
            changed = False
            costly = [g for g in self.gaps if g.kind != KEEP]
            costly.sort(key=lambda g: -(self.rec_s[g.k] if g.kind == REC else self.p.in_stall(g.q, g.hi, self.h2d_s[g.k])))
            for g in costly:
                if time.perf_counter() >= deadline:
                    break
                k = g.k
                saved = (g.kind, g.q, self.out[k])      # all a trial (_set on g) changes
                trials: list[tuple[str, int]] = [(KEEP, -1)]
                if self.allow_swap and self.can_swap(g):
                    trials += [(SWAP, q) for q in self.swap_issue_stages(g, points) if q != g.q]
                if g.kind == SWAP and self.can_rec(g.k, g.hi):
                    trials.append((REC, -1))
                if g.kind == REC:      # regenerate where a replay of it runs anyway (as a source), keep to hi
                    trials += [(REC, t) for t, ks in r.recs.items() if g.lo < t < g.hi and g.k in ks and t != g.q]
                    if g.lo < g.q < g.hi:
                        trials.append((REC, -1))
                best = None
                for kind, q in trials:
                    self._set(g, kind, q)
                    # taken only if it fits and costs less than r and the best trial yet
                    bound = r.cost - 1e-12 if best is None else min(r.cost - 1e-12, best[0])
                    r2 = self.realize(base, (k,), reject_at=bound)
                    if r2 is not None and self.feasible(r2) and r2.cost < bound:
                        best = (r2.cost, kind, q, r2)
                    g.kind, g.q, self.out[k] = saved
                if best is not None:
                    self._set(g, best[1], best[2])
                    r = base = best[3]
                    changed = True
        return r

    def exchange(self, r: Realized, deadline: float, repair_s: float = 0.5) -> Realized:
        """Exchanges the gap-by-gap improvement cannot find: the costliest regenerations are kept
        instead, the repair makes room elsewhere (never by evicting that gap again), and the result is
        accepted when it fits and costs less. One pass, costliest first."""
        costly = [g for g in self.gaps if g.kind != KEEP]
        costly.sort(key=lambda g: -(self.rec_s[g.k] if g.kind == REC else self.p.in_stall(g.q, g.hi, self.h2d_s[g.k])))
        for g in costly:
            if time.perf_counter() >= deadline:
                break
            if g.kind == KEEP:
                continue                   # an earlier exchange kept it already
            snap = self._snapshot()
            self._set(g, KEEP)
            self._pinned = g
            try:
                r2 = self.repair(min(deadline, time.perf_counter() + repair_s))
            finally:
                self._pinned = None
            if self.feasible(r2) and r2.cost < r.cost - 1e-12:
                r = r2
            else:
                self._restore(snap)
        return self.realize() if not self.feasible(r) else r

    def capuchin_fill(self, deadline: float | None = None) -> tuple[Realized, int, int]:
        """Capuchin's order from keep-everything: swaps of the longest-idle gaps first, each kept only if
        its copy stays hidden and it lowers the overflow; then recomputes by memory saved per second.
        Past ``deadline`` it stops where it is (the result may not fit)."""
        p, B = self.p, self.p.budget
        r = self.realize()
        idle = []
        for gi, gap in enumerate(self.gaps):
            free_time = p.cum[gap.hi] - p.cum[gap.lo + 1]
            c = p.candidates[gap.k]
            if free_time > c.d2h_s + c.h2d_s:
                idle.append((-free_time, gi))
        idle.sort()
        swapped = recomputed = 0

        def over_in(gap: Gap) -> bool:
            return bool(r.over(B)[gap.lo + 1:gap.hi].any())

        for _, gi in idle:
            if not r.over(B).any() or (deadline is not None and time.perf_counter() >= deadline):
                break
            gap = self.gaps[gi]
            # exact shortcut: a swap (or recompute) of this gap changes memory only inside it (and may
            # delay other copies), so with no overflow inside the gap it cannot lower the total
            if not over_in(gap) or not self.can_swap(gap):
                continue
            snap = self._snap_of((gap.k,))
            self._set(gap, SWAP, self.latest_hidden_q(gap))
            self.out[gap.k] = gap.lo
            r2 = self.realize(r, (gap.k,))
            if r2.cost > r.cost + 1e-9 or r2.late or r2.broken or r2.over(B).sum() >= r.over(B).sum():
                self._restore_of(snap)
                continue
            r = r2
            swapped += 1
        msps = sorted((-(p.candidates[g.k].nbytes / max(p.candidates[g.k].recompute_s, 1e-12)), gi)
                      for gi, g in enumerate(self.gaps) if g.kind == KEEP)
        for _, gi in msps:
            if not r.over(B).any() or (deadline is not None and time.perf_counter() >= deadline):
                break
            gap = self.gaps[gi]
            if not over_in(gap) or not self.can_rec(gap.k, gap.hi):
                continue
            snap = self._snap_of((gap.k,))
            self._set(gap, REC)
            r2 = self.realize(r, (gap.k,))
            if r2.broken or r2.over(B).sum() >= r.over(B).sum():
                self._restore_of(snap)
                continue
            r = r2
            recomputed += 1
        return r, swapped, recomputed

    def load_actions(self, actions: list) -> None:
        """Choices that follow a plan's actions (e.g. a coarse plan written on this problem's graph)."""
        by_t: dict[int, dict[str, list[int]]] = {}
        for a in actions:
            k = self.p.index.get(a.tensor)
            if k is not None:
                by_t.setdefault(k, {}).setdefault(a.kind, []).append(a.stage)
        for k in range(self.K):
            acts = by_t.get(k, {})
            outs = sorted(acts.get("swap_out", []))
            self.out[k] = outs[0] if outs else None
            for i in self.gaps_of[k]:
                g = self.gaps[i]
                frees = [f for f in acts.get("free", []) if g.lo <= f < g.hi]
                g.kind, g.q = KEEP, -1
                if not frees:
                    continue
                f = min(frees)
                ins = [q for q in acts.get("swap_in", []) if f < q <= g.hi]
                recs = [t for t in acts.get("recompute", []) if f < t <= g.hi]
                if ins and self.out[k] is not None and self.out[k] <= g.lo:
                    g.kind, g.q = SWAP, max(ins)
                elif recs and self.can_rec(k, g.hi):
                    g.kind, g.q = REC, (min(recs) if min(recs) < g.hi else -1)
                elif recs and self.early_rec(g) is not None:
                    g.kind, g.q = REC, self.early_rec(g)     # recomputed before the read, as the plan does
            if self.out[k] is not None and not any(self.gaps[i].kind == SWAP for i in self.gaps_of[k]):
                self.out[k] = None

    def load_lp(self, lp: "LPValues", rule: str = "mass", drop: float = 0.5) -> None:
        """First choice per gap from the LP's mass on keep / recompute / swap-in.

        ``rule="mass"``: the way with the most mass (recompute: R at the gap's end). ``rule="drop"``: the
        gap is evicted when the LP keeps less than ``1 - drop`` of it on average, and regenerated the
        way the LP leans to (recompute unless it puts more on swap-ins), whatever it does at the gap's
        end: the LP often drops a tensor but regenerates it fractionally elsewhere (recomputed where a
        replay runs anyway, spread over stages), which the mass rule reads as a keep and the repair then
        has to make up for with its greedy. The improvement pass keeps back what memory allows."""
        if rule not in ("mass", "drop"):
            raise ValueError(f"load_lp rule {rule!r}: expected 'mass' or 'drop'")
        for g in self.gaps:
            k = g.k
            keep = float(np.mean([lp.S.get((t, k), 0.0) for t in range(g.lo + 1, g.hi)]))
            rec = lp.R.get((g.hi, k), 0.0)
            swap_by_q: dict[int, float] = {}
            for (q, u, _), v in lp.Y_by_k.get(k, {}).items():
                if u == g.hi and g.lo < q <= g.hi:
                    swap_by_q[q] = swap_by_q.get(q, 0.0) + v
            swap = sum(swap_by_q.values())
            if rule == "drop":
                if 1.0 - keep < drop:
                    self._set(g, KEEP)
                elif rec >= swap and self.can_rec(k, g.hi):
                    self._set(g, REC)
                elif swap_by_q and self.can_swap(g):
                    self._set(g, SWAP, max(swap_by_q, key=swap_by_q.get))
                elif self.can_rec(k, g.hi):
                    self._set(g, REC)
                elif self.allow_swap and self.can_swap(g):
                    self._set(g, SWAP, self.latest_hidden_q(g))
                else:
                    self._set(g, KEEP)
            elif rec >= max(keep, swap) and rec > 0 and self.can_rec(k, g.hi):
                self._set(g, REC)
            elif swap > keep and swap_by_q and self.can_swap(g):
                self._set(g, SWAP, max(swap_by_q, key=swap_by_q.get))
            else:
                self._set(g, KEEP)
        for k in range(self.K):
            if self.out[k] is not None:
                lo = min(self.gaps[i].lo for i in self.gaps_of[k] if self.gaps[i].kind == SWAP)
                outs = {t: v for t, v in lp.P_by_k.get(k, {}).items() if t <= lo and self.base_read[k, t]}
                if outs:
                    self.out[k] = max(outs, key=outs.get)


VARIANTS = ({"link_weight": 0.0}, {"link_weight": 1.0}, {"link_weight": 0.0, "allow_swap": False},
            {"link_weight": 0.0, "allow_recompute": False})


def round_schedule(p: Problem, lp: LPValues | None, *, time_budget: float = 10.0,
                   variants: tuple[dict[str, Any], ...] = VARIANTS,
                   rules: tuple[str, ...] = ("lp-drop", "lp", "keep")) -> tuple[Schedule | None, dict[str, Any]]:
    """Source-tracing rounding of ``lp`` (None: start from keep-everything, the greedy planner).

    A few variants of the repair (how much a new copy's link time counts against it; recompute only)
    run from the LP's choices (``rules``: "lp-drop" and "lp", the two rules of
    :meth:`GapPlanner.load_lp`, dropped mass first: it fits more often) and from keep-everything
    ("keep"); the cheapest feasible result wins.
    """
    t0 = time.perf_counter()
    deadline = t0 + time_budget
    best: tuple[float, GapPlanner, Realized, str] | None = None
    starts = [(name, src, rule) for name, src, rule in (("lp-drop", lp, "drop"), ("lp", lp, "mass"), ("keep", None, ""))
              if name in rules and (src is not None or name == "keep")]
    tried = 0
    for name, src, rule in starts:
        for v in variants:
            if time.perf_counter() >= deadline and (best is not None or tried):
                break
            gp = GapPlanner(p, **v)
            if src is not None:
                gp.load_lp(src, rule)
            left = max(deadline - time.perf_counter(), 0.05)
            r = gp.repair(time.perf_counter() + left / 2)
            tried += 1
            if not gp.feasible(r):
                continue
            r = gp.improve(r, time.perf_counter() + max(deadline - time.perf_counter(), 0.05) / 2)
            if best is None or r.cost < best[0] - 1e-12:
                best = (r.cost, gp, r, f"{name}:{'+'.join(f'{k}={x}' for k, x in v.items())}")
        if best is not None and best[0] <= 1e-12:
            break
    info: dict[str, Any] = {"rounding_s": round(time.perf_counter() - t0, 4), "rounding_tries": tried}
    if best is None:
        info["rounding"] = "no variant fitted the budget"
        return None, info
    info["rounded_overhead_s"] = best[0]
    info["rounding"] = best[3]
    return best[1].schedule(best[2]), info


def schedule_of_actions(p: Problem, actions: list) -> Schedule:
    """A plan's actions as a schedule on ``p`` (one choice per gap, see :meth:`GapPlanner.load_actions`):
    a warm start for the MILP."""
    gp = GapPlanner(p)
    gp.load_actions(actions)
    return gp.schedule(gp.realize())


def stage_link_start(p: Problem, actions: list[Action], compact: bool, time_budget: float = 2.0) -> Schedule | None:
    """A plan's ``actions`` (on the graph: a schedule of ``p`` written out, or another planner's plan)
    made a start that satisfies a ``link="stage"`` MILP's rows (CBC drops a start that does not): the
    copies that model cannot hold are moved or dropped (:meth:`GapPlanner.legalize`), the memory is
    repaired with copies that model holds only and the result improved. Three tries, until one fits:
    the repair may add such copies; it keeps the copies left and adds none (a greedy repair that adds
    copies can end where nothing it may still change frees the stage over budget); recomputes only
    (no link rows at all). None if no such schedule fits."""
    t0 = time.perf_counter()
    offer = stage_link_copies(p, compact)
    group_of = {s: t for t, g in enumerate(p.groups) for s in g}
    # stages mapped back to the problem's (a coarse stage stands for a run of graph stages)
    actions = [Action(a.kind, a.tensor, group_of[a.stage]) for a in actions if a.tensor in p.index]
    tries = ((True, True), (False, True), (False, False))      # (the repair adds copies, copies kept)
    for i, (add_copies, keep_copies) in enumerate(tries):
        gp = GapPlanner(p, stage_link=offer, allow_swap=add_copies)
        gp.load_actions(actions)
        gp.legalize()
        if not keep_copies:
            gp.out = [None] * gp.K
            for g in gp.gaps:
                if g.kind == SWAP:
                    gp._set(g, REC if gp.can_rec(g.k, g.hi) else KEEP)
        end = t0 + time_budget * (i + 1) / len(tries)
        r = gp.repair(time.perf_counter() + max(end - time.perf_counter(), 0.0) / 2)
        if gp.feasible(r):
            return gp.schedule(gp.improve(r, max(end, time.perf_counter() + 0.05)))
    return None


def refine(p: Problem, starts: list[tuple[str, Any]], *, time_budget: float = 5.0,
           keep_improved_only: bool = False, planners: dict[str, Any] | None = None) -> list[tuple[str, Schedule, float]]:
    """Improve plans on ``p`` (the full graph) gap by gap: each start is ``(name, actions)`` (a plan's
    actions, e.g. the coarse plan written on the full graph: repaired first if it does not fit there),
    ``(name, GapPlanner)`` (a planner on ``p`` in some state, used as it is) or ``("capuchin", None)``
    (Capuchin's construction). Returns ``(name, schedule, model seconds)`` for
    every start that fits, improved by extending residency and cheaper regenerations where memory allows.
    With ``keep_improved_only``, a start that fits as it is comes back only if the model finds it
    improved (the caller judged the start itself already). ``planners``: filled with each start's
    planner as the polish left it (a later polish can go on from there)."""
    t0 = time.perf_counter()
    out = []
    for i, (name, arg) in enumerate(starts):
        share = (t0 + time_budget - time.perf_counter()) / (len(starts) - i)
        if share <= 0.05:
            break
        t1 = time.perf_counter()
        if isinstance(arg, GapPlanner):
            gp = arg                       # a construction already run on p (e.g. Capuchin's)
            r = gp.realize()
        elif name == "capuchin":
            gp = GapPlanner(p)
            r, _, _ = gp.capuchin_fill(t1 + share)
        else:
            gp = GapPlanner(p)
            gp.load_actions(arg)
            r = gp.realize()
        repaired = False
        if not gp.feasible(r):
            r = gp.repair(t1 + share / 2)
            if not gp.feasible(r):
                continue
            repaired = True
        if planners is not None:
            planners[name] = gp
        c0 = r.cost
        if repaired or not keep_improved_only:
            out.append((f"{name}", gp.schedule(r), r.cost))
        # the improvement first, for all of the share if it needs it (it converges, and what it finds
        # is most of what a start gains); the exchanges get what it leaves
        r = gp.improve(r, t1 + share)
        how = "+improve"
        if time.perf_counter() < t1 + share:
            c1 = r.cost
            r = gp.exchange(r, t1 + share)
            if r.cost < c1 - 1e-12:
                r = gp.improve(r, t1 + share)
                how = "+exchange"
        if r.cost < c0 - 1e-12 or not keep_improved_only:
            out.append((f"{name}{how}", gp.schedule(r), r.cost))
    return out


def is_large(p: Problem) -> bool:
    """Problems where the compact model is used (the full one is for exactness on small graphs)."""
    return p.T * max(len(p.candidates), 1) > 1000


def solve_relaxed(p: Problem, *, time_limit: float | None = None, verbose: bool = False,
                  variants: tuple[dict[str, Any], ...] = VARIANTS, rules: tuple[str, ...] = ("lp-drop", "lp", "keep"),
                  lp_job: lp_relaxation.Background | None = None,
                  **model_options: Any) -> tuple[Schedule | None, dict[str, Any]]:
    """LP relaxation + source-tracing rounding. ``info`` has the LP bound (seconds of step time).

    ``model_options`` go to :func:`solvers.milp.build_model` (e.g. ``swap=False``: the relaxation of
    Checkmate's recompute-only MILP, whose rounding is a start of the ``approx`` portfolio). ``lp_job``:
    the same LP of ``p`` already started in the background (:class:`solvers.lp.Background`), waited for
    here instead of solved again."""
    t0 = time.perf_counter()
    model_options.setdefault("compact", is_large(p))
    done = lp_job.result() if lp_job is not None else lp_relaxation.solve(p, time_limit, verbose, **model_options)
    res = done.result
    info: dict[str, Any] = {"lp_status": res.status, "lp_vars": res.num_vars, "lp_constraints": res.num_constraints,
                            "lp_s": round(res.solve_s + res.build_s, 4)}
    if done.values is not None:
        info["lp_bound_s"] = p.compute_s + max(res.objective, 0.0)
    remaining = 8.0 if time_limit is None else max(time_limit - (time.perf_counter() - t0), 0.2)
    sched, rinfo = round_schedule(p, done.values, time_budget=remaining, variants=variants, rules=rules)
    info.update(rinfo)
    return sched, info
