"""What every planner shares: the problem (graph, costs, budget, candidates), transfer timing, the
solver-neutral :class:`Schedule`, its conversion to a :class:`~hybridmem.graph.plan.Plan`, and simulator checks.

Discrete time model (the planners' view of the plan timing rules in :mod:`hybridmem.graph.plan`):

- ``cum[k]`` is the compute time before stage ``k`` when nothing is recomputed and nothing stalls.
  Recomputes and stalls only *lengthen* the compute stream, so a copy that finishes by some stage in this
  model finishes by that stage in reality too: every timing fact below is conservative.
- A swap-out issued after op ``t`` starts at ``cum[t + 1]`` and ends during stage ``out_finish(t, d)``:
  the device copy stays (and counts against the budget) through that stage, and the D2H link is busy
  during stages ``t + 1 .. out_finish``.
- A swap-in issued at the start of stage ``q`` starts at ``cum[q]``; its device buffer counts from ``q``.
  It is *hidden* if it is first read at stage ``u >= in_ready(q, d)`` (the copy ends before ``cum[u]``);
  read earlier it stalls the compute stream by ``cum[q] + d - cum[u]``. The H2D link is busy during
  stages ``q .. min(u, in_ready - 1)``.
- One copy per direction at a time. The MILP either gives each copy the stages it overlaps alone
  (``link="stage"``: one row per stage) or follows the simulator's FIFO queue (``link="fifo"``, small
  problems); the rounding/repair planner (:mod:`solvers.relax`) always queues copies FIFO. Small
  uncoarsened MILPs drop this discrete model for the simulator's own clock (``link="exact"``,
  :mod:`solvers.exact_time`), which also sees what stalls and replays let copies finish.

Problems may be *coarse*: ``Problem.groups`` maps each problem stage to a run of graph stages
(:mod:`solvers.coarsen`) and a candidate may be a bundle of tensors evicted together; plans are always
written on the full graph (:func:`schedule_to_actions`) and judged by the simulator there.
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable

import numpy as np

from hybridmem.graph.costs import get_cost_model
from hybridmem.graph.ir import Graph
from hybridmem.graph.plan import Action, Plan
from hybridmem.graph.simulate import min_feasible_budget
from hybridmem.graph.simulate import simulate as sim

from . import coarsen

EPS_TIME = 1e-12


@dataclass
class Candidate:
    """What the planner decides about: one evictable tensor, or a *bundle* of tensors made in one
    (coarse) stage and last read in one, evicted and regenerated together. Stages ``start .. end`` (of
    the problem, i.e. coarse stages when the graph is coarsened) bound its variables."""

    tensor: int                # key: the first member's tensor id
    nbytes: int
    start: int                 # producer stage: resident there by definition
    end: int                   # last stage that reads it (the planner frees it after this)
    uses: tuple[int, ...]      # stages (> start) whose op reads it
    src: tuple[int, ...]       # fine tensor ids the members' producers read, members excluded
    recompute_s: float         # seconds to replay the members' producers and in-place writers
    can_recompute: bool
    d2h_s: float
    h2d_s: float
    members: tuple[int, ...] = ()   # fine tensor ids, in producer order


@dataclass
class Problem:
    """One planning problem: a graph under a device cost model and a byte budget.

    ``groups[t]`` lists the graph's stages that problem stage ``t`` stands for (one each unless the
    graph was coarsened); memory per problem stage is the maximum over its graph stages.
    """

    graph: Graph
    budget: int
    device: str                            # the cost model's name (what plans record)
    op_s: np.ndarray                       # compute seconds per stage under the device model
    cum: np.ndarray                        # cum[k] = sum(op_s[:k]), length T + 1
    candidates: list[Candidate]
    base_mem: np.ndarray                   # bytes per stage the planner does not control (int64)
    early_free: list[Action]               # frees of non-candidate tensors right after their last reader
    live_until: np.ndarray                 # per graph tensor id: last graph stage it is on the device
    groups: list[list[int]] = field(default_factory=list)
    op_extra_bytes: np.ndarray | None = None
    fine_op_s: np.ndarray | None = None
    model: Any = None                      # the cost model itself (simulations use it)
    index: dict[int, int] = field(default_factory=dict)   # graph tensor id -> candidate position
    _readers: dict[int, set[int]] | None = field(default=None, repr=False)

    @cached_property
    def graph_hash(self) -> str:
        """The graph's structure hash (what every plan records), computed once per problem."""
        return self.graph.structure_hash()

    @cached_property
    def num_forward(self) -> int:
        return self.graph.num_forward

    @property
    def first(self) -> list[int]:
        return [g[0] for g in self.groups]

    @property
    def last(self) -> list[int]:
        return [g[-1] for g in self.groups]

    @property
    def T(self) -> int:
        return len(self.op_s)

    @property
    def compute_s(self) -> float:
        return float(self.cum[-1])

    # ---- transfer timing ----------------------------------------------------------------------
    def out_finish(self, t: int, d: float) -> int | None:
        """Stage during which a swap-out of ``d`` seconds issued after op ``t`` ends (None: after the step)."""
        target = self.cum[t + 1] + d
        f = int(np.searchsorted(self.cum, target - EPS_TIME, side="left")) - 1
        f = max(f, t + 1)
        return f if f < self.T else None

    def in_ready(self, q: int, d: float) -> int:
        """First stage whose op can read a swap-in of ``d`` seconds issued at the start of ``q`` without stalling."""
        target = self.cum[q] + d
        return max(int(np.searchsorted(self.cum, target - EPS_TIME, side="left")), q)

    def source_stages(self, k: int) -> set[int]:
        """Stages where candidate ``k`` may be read by a replay (it is an input of another candidate's producer)."""
        if self._readers is None:
            readers: dict[int, set[int]] = {}
            for kk, c in enumerate(self.candidates):
                for j in c.src:
                    kj = self.index.get(j)
                    if kj is not None and kj != kk:
                        readers.setdefault(kj, set()).update(range(c.start + 1, c.end + 1))
            self._readers = readers
        c = self.candidates[k]
        return {t for t in self._readers.get(k, ()) if c.start < t <= c.end}

    def min_bytes(self) -> np.ndarray:
        """Per stage, the least any plan of this planner needs: the constant part plus the candidates the op reads."""
        need = self.base_mem.copy()
        for c in self.candidates:
            for t in c.uses:
                need[t] += c.nbytes
        return need

    def producers(self, k: int) -> tuple[int, ...]:
        """The graph stages a recompute of candidate k replays."""
        c = self.candidates[k]
        return tuple(dict.fromkeys(self.graph.tensors[x].producer for x in (c.members or (c.tensor,))))

    def op_extra(self) -> np.ndarray:
        """Bytes op t adds to what is on the device before it (outputs, workspace); 0 for merged stages."""
        return self.op_extra_bytes

    def replay_extra(self, k: int) -> int:
        """Transient bytes while candidate k's producers are replayed: workspace and their other outputs."""
        c = self.candidates[k]
        g = self.graph
        mset = set(c.members)
        best = 0
        for pr in dict.fromkeys(g.tensors[x].producer for x in c.members):
            st = g.stages[pr]
            best = max(best, st.workspace + sum(g.tensors[x].nbytes for x in set(st.outputs) if x not in mset))
        return int(best)

    def in_stall(self, q: int, u: int, d: float) -> float:
        """Seconds the compute stream waits at stage ``u`` for a swap-in issued at ``q``."""
        return max(0.0, float(self.cum[q] + d - self.cum[u]))


def default_min_bytes(graph: Graph) -> int:
    """Saved tensors smaller than this stay resident: 1e-4 of the saved bytes (BatchNorm statistics, ...)."""
    return max(1, int(1e-4 * graph.saved_bytes()))


def select_candidates(graph: Graph, min_bytes: int | None = None) -> list[int]:
    """Forward-produced saved activations, at least ``min_bytes`` big, with a stage between producer and
    last reader where they are not read (the only ones eviction can help)."""
    nf = graph.num_forward
    lim = default_min_bytes(graph) if min_bytes is None else max(1, min_bytes)
    chosen = []
    for t in graph.evictable():
        if not (t.saved and t.producer < nf and t.nbytes >= lim):
            continue
        uses = sorted(c for c in t.consumers if c > t.producer)
        if uses and uses[-1] - t.producer >= 2 and len(uses) < uses[-1] - t.producer:
            chosen.append(t.id)
    return chosen


def build_problem(graph: Graph, budget: int, device: Any = "h100-80gb", *, min_bytes: int | None = None,
                  candidates: Iterable[int] | None = None, groups: list[list[int]] | None = None,
                  bundle: bool = False) -> Problem:
    """Collect the planner's view of ``graph`` (optionally coarsened: ``groups`` of consecutive stages).

    Candidates: :func:`select_candidates` (or the given tensor ids). With ``bundle``, candidates made in
    the same problem stage and last read in the same one form one bundle. Every other evictable tensor
    keeps its natural lifetime, except that it is freed right after its last reader when the graph keeps
    it longer.
    """
    model = get_cost_model(device)
    fine_op = np.asarray(model.op_times(graph), dtype=np.float64)
    n = graph.num_stages
    if groups is None:
        groups = [[i] for i in range(n)]
    T = len(groups)
    group_of = np.empty(n, dtype=np.int64)
    for gi, g in enumerate(groups):
        group_of[g] = gi
    op_s = np.array([fine_op[g].sum() for g in groups], dtype=np.float64)
    cum = np.concatenate([[0.0], np.cumsum(op_s)])
    chosen = select_candidates(graph, min_bytes) if candidates is None else list(candidates)
    chosen_set = set(chosen)
    tensors = graph.tensors

    # fine memory the planner does not control: natural lifetimes, early frees, candidates only at
    # their producer stage
    base = graph.memory_profile().astype(np.int64)
    delta = np.zeros(n + 1, dtype=np.int64)
    live_until = np.full(len(tensors), n - 1, dtype=np.int64)
    early: list[Action] = []
    fine_end: dict[int, int] = {}
    for t in tensors:
        if t.producer < 0:
            continue
        last = t.last_stage(n)
        uses = sorted(c for c in t.consumers if c > t.producer)
        end = uses[-1] if uses else t.producer
        if t.id in chosen_set:
            delta[t.producer + 1] -= t.nbytes
            delta[last + 1] += t.nbytes
            live_until[t.id] = end
            fine_end[t.id] = end
            continue
        if t.evictable and end < last:
            delta[end + 1] -= t.nbytes
            delta[last + 1] += t.nbytes
            early.append(Action("free", t.id, end))
            last = end
        live_until[t.id] = last
    fine_base = base + np.cumsum(delta[:-1])

    # candidates (bundles) on problem stages
    keyed: dict[tuple, list[int]] = {}
    for x in sorted(chosen, key=lambda x: (tensors[x].producer, x)):
        t = tensors[x]
        key = (int(group_of[t.producer]), int(group_of[fine_end[x]])) if bundle else (x,)
        keyed.setdefault(key, []).append(x)
    det = [s.deterministic for s in graph.stages]
    writers = graph.writers()
    cands: list[Candidate] = []
    for members in keyed.values():
        mset = set(members)
        start = int(group_of[tensors[members[0]].producer])
        uses = sorted({int(group_of[c]) for x in members for c in tensors[x].consumers} - {start})
        uses = [u for u in uses if u > start]
        if not uses:
            continue
        # a recompute replays the producers and the forward stages that wrote the members in place
        # (Graph.replay_stages, as the simulator charges it); their inputs are its sources. The stages that
        # rebuild sources gone by the backward (a chain of forward temporaries) only with
        # meta["plan_chains"] (plan(..., trace_sources=True)): one source set serves every read of a
        # candidate here, and a chain's sources would stand for reads in the forward too, where the
        # producer's own inputs are still there
        prods = sorted({r for x in members
                        for r in graph.replay_stages(x, writers=writers, trace=bool(graph.meta.get("plan_chains")))})
        made = mset.union(*(graph.stages[r].outputs for r in prods))
        src = tuple(dict.fromkeys(j for pr in prods for j in graph.stages[pr].inputs if j not in made))
        nbytes = sum(tensors[x].nbytes for x in members)
        cands.append(Candidate(
            tensor=members[0], nbytes=nbytes, start=start, end=uses[-1], uses=tuple(uses), src=src,
            recompute_s=float(sum(fine_op[pr] for pr in prods)), can_recompute=all(det[pr] for pr in prods),
            d2h_s=float(sum(model.copy_time(tensors[x].nbytes, "d2h") for x in members)),
            h2d_s=float(sum(model.copy_time(tensors[x].nbytes, "h2d") for x in members)),
            members=tuple(members)))
    # candidates made in a problem stage are part of its constant memory at every graph stage of it
    # after their producer (their own stage); elsewhere the planner's variables count them
    add = np.zeros(n + 1, dtype=np.int64)
    for c in cands:
        for x in c.members:
            t = tensors[x]
            hi = min(groups[c.start][-1], fine_end[x])
            if hi > t.producer:
                add[t.producer + 1] += t.nbytes
                add[hi + 1] -= t.nbytes
    fine_base = fine_base + np.cumsum(add[:-1])
    base_mem = np.array([fine_base[g].max() for g in groups], dtype=np.int64)
    if all(len(g) == 1 for g in groups):
        op_extra = np.array([sum(tensors[x].nbytes for x in set(s.outputs)) + s.workspace for s in graph.stages],
                            dtype=np.int64)
    else:
        op_extra = np.zeros(T, dtype=np.int64)      # conservative: a replay may meet the stage's peak
    p = Problem(graph=graph, budget=int(budget), device=getattr(model, "name", str(device)), op_s=op_s, cum=cum,
                candidates=cands, base_mem=base_mem, early_free=early, live_until=live_until, groups=groups,
                op_extra_bytes=op_extra, fine_op_s=fine_op, model=model)
    p.index = {x: k for k, c in enumerate(cands) for x in c.members}
    return p


def memory_floor(graph: Graph, model: Any, min_bytes: int | None = None) -> int:
    """The least budget any plan of these planners can fit: what some stage needs with every evictable
    tensor the planners may move off the device (:func:`hybridmem.graph.simulate.min_feasible_budget`, and
    the planning problem's own per-stage need)."""
    need = build_problem(graph, graph.peak_bytes(), model, min_bytes=min_bytes).min_bytes()
    return max(min_feasible_budget(graph), int(need.max()) if need.size else 0)


def planning_problem(graph: Graph, budget: int, model: Any, **options: Any) -> Problem:
    """The (possibly coarsened) problem the STR planners and the MILP baselines solve."""
    use = options.get("coarsen")
    if use is None:
        use = graph.num_stages > options.get("threshold", coarsen.THRESHOLD)
    groups = coarsen.coarsen_groups(graph, options.get("target", coarsen.TARGET)) if use else None
    return build_problem(graph, budget, model, groups=groups, bundle=groups is not None,
                         min_bytes=options.get("min_bytes"))


def source_available(p: Problem, j: int, t: int) -> bool | None:
    """Whether recompute source ``j`` (a graph tensor) is on the device before op ``t`` (a problem stage)
    without any decision: True (fixed or naturally live), False (gone), None (a candidate: the plan decides)."""
    k = p.index.get(j)
    if k is not None:
        c = p.candidates[k]
        return None if c.start <= t <= c.end else False
    tj = p.graph.tensors[j]
    if tj.producer < 0:
        return True
    s0 = p.groups[t][0]
    return bool(tj.producer < s0 <= p.live_until[j])


def early_recompute_stage(p: Problem, k: int, u: int) -> int | None:
    """Where a read ``u`` of candidate ``k`` cannot be recomputed for (a source of its producer is gone
    by then: on a coarse problem, often a source last read in the stage before), the latest earlier stage
    where it can be, the tensor then kept until ``u`` (Chen's checkpointing regenerates a segment so,
    in order, before the backward pass reaches it); None where a recompute at ``u`` is possible, or at
    no stage."""
    c = p.candidates[k]
    if not c.can_recompute or all(source_available(p, j, u) is not False for j in c.src):
        return None
    for t in range(u - 1, c.start, -1):
        if all(source_available(p, j, t) is not False for j in c.src):
            return t
    return None


# ---- a solver-neutral schedule ---------------------------------------------------------------------
@dataclass
class TensorSchedule:
    """What happens to one candidate: where it is on the device and how it got there.

    ``present[k]`` is for stage ``start + k`` (``k = 0 .. end - start``); ``present[0]`` is always True.
    ``recompute``: stages where it is recomputed before the op. ``swap_in``: ``(issue stage, first read)``.
    """

    tensor: int
    start: int
    present: np.ndarray
    recompute: list[int] = field(default_factory=list)
    swap_out: int | None = None
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    def is_present(self, t: int) -> bool:
        k = t - self.start
        return 0 <= k < len(self.present) and bool(self.present[k])


@dataclass
class Schedule:
    tensors: dict[int, TensorSchedule] = field(default_factory=dict)


def schedule_to_actions(p: Problem, sched: Schedule) -> list[Action]:
    """Actions that realise ``sched`` under the plan timing rules (plus early frees of other tensors).

    Problem stages map to graph stages: what happens *before* op t (recompute, swap-in) happens before
    the first graph stage of t, what happens *after* it (swap-out, free) after the last one. Every
    member of a bundle gets the same actions; a member is finally freed right after its own last reader.
    """
    actions: list[Action] = list(p.early_free)
    n = p.graph.num_stages
    first, last_of = p.first, p.last
    for c in p.candidates:
        members = c.members or (c.tensor,)
        ts = sched.tensors.get(c.tensor)
        ends = {x: p.live_until[x] for x in members}

        def final_frees() -> None:
            for x in members:
                if ends[x] < p.graph.tensors[x].last_stage(n):
                    actions.append(Action("free", x, int(ends[x])))

        if ts is None:
            final_frees()
            continue
        pres = ts.present
        rec = set(ts.recompute)
        arrivals = {u: q for q, u in ts.swap_in}
        if ts.swap_out is not None:
            actions.extend(Action("swap_out", x, last_of[ts.swap_out]) for x in members)
        for k in range(len(pres)):
            t = c.start + k
            if k > 0 and pres[k] and not pres[k - 1]:
                if t in rec:
                    actions.extend(Action("recompute", x, first[t]) for x in members)
                elif t in arrivals:
                    q = arrivals[t]
                    lo = max(q - c.start, 0)
                    held = np.flatnonzero(pres[lo:k])
                    if held.size:
                        # issued while still resident (a keep a time-limited MILP solution left in):
                        # the copy starts once the tensor is dropped; the simulator times the result
                        q = c.start + lo + int(held[-1]) + 1
                    actions.extend(Action("swap_in", x, first[q]) for x in members)
                else:
                    raise ValueError(f"schedule of tensor {c.tensor}: present at stage {t} with no source")
            if pres[k] and k + 1 < len(pres) and not pres[k + 1]:
                actions.extend(Action("free", x, last_of[t]) for x in members)     # dropped after op t
        final_frees()
    return actions


def make_plan(p: Problem, actions: list[Action], solver: str, info: dict[str, Any] | None = None) -> Plan:
    plan = Plan(actions=actions, graph_hash=p.graph_hash, device=p.device, budget_bytes=p.budget,
                solver=solver, info=dict(info or {}))
    plan.actions = plan.sorted_actions()
    return plan


def simulate(p: Problem, plan: Plan, *, strict: bool = True, budget: int | None | str = "problem"):
    b = p.budget if budget == "problem" else budget
    return sim(p.graph, plan, device=p.model if p.model is not None else p.device, budget=b, strict=strict)


@contextlib.contextmanager
def quiet_fd(enabled: bool = True):
    """Silence output written straight to file descriptors 1 and 2 (CLP prints its LP log there even at
    log level 0). A no-op when ``enabled`` is False or the descriptors cannot be duplicated."""
    if not enabled:
        yield
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
    except (OSError, ValueError, AttributeError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)
