"""STR's exact planner as a mixed-integer programme (python-mip; CBC by default, HiGHS on request).

Sets. Stages ``t = 0 .. T-1``; candidates ``i`` (forward activations saved for the backward pass, see
:func:`solvers._common.build_problem`) with producer ``p_i``, last reader ``e_i``, bytes ``b_i``. Every
variable of tensor ``i`` lives on its natural lifetime ``p_i < t <= e_i`` only; everything else keeps
the graph's natural lifetime and is a constant ``base[t]`` of the memory rows.

Variables (all binary)::

    S[t,i]    i is on the device, readable, at op t, kept from stage t-1 (or landed by a swap-in)
    R[t,i]    i is recomputed before op t (replay of stage p_i)
    X[t,p]    stage p is replayed before op t (only for producers with several candidate outputs:
              one replay serves them all, as in the simulator; otherwise X = R)
    P[t,f,i]  swap-out of i issued after op t, its device bytes held through stage f (the copy ends
              in f: fixed by the timing with link="stage", a choice with link="fifo"; f = t with
              link="exact", where the copy's end is a time variable)
    Y[q,u,i]  swap-in of i issued at the start of stage q, first read at stage u; u = ready(q) is a
              hidden copy, u < ready(q) stalls the compute stream for cum[q] + h2d_i - cum[u] seconds
              (link="exact": u is the first stage reading it, the stall follows from the clock)
    stall[q,u,i] >= 0 (continuous, link="fifo" only): the stall, bounded below by the FIFO arrival time

Constraint families (one block each in :func:`build_model`): dependencies (an op's candidate inputs
present), recompute sources (a replay's candidate inputs present, replayed first at the same stage if
need be), residency (kept only if present the stage before or landed now), host checkpoint (one
swap-out, issued while present, holding the bytes until it ends; swap-ins, any number, after it ended),
host link (one copy per direction at a time), memory (per stage, everything present + swap-in buffers in
flight + the constant part <= budget) and memory during replays (their workspace and other outputs).

Timing, three link models. ``"stage"`` and ``"fifo"`` (discrete, see :mod:`solvers._common`): compute
times without recomputes or stalls decide where copies end; recomputes and stalls only stretch the
compute stream, so every copy ends no later than the model says, which makes every solution a valid
plan, but the model cannot see what a stall buys (a swap-out that has ended by the delayed op, whose
freed bytes are then gone). ``"exact"`` (the default for uncoarsened problems of at most
``FIFO_MAX_STAGES`` stages; :mod:`solvers.exact_time`): the simulator's clock as variables equal to it,
its FIFO copy streams, deferred releases and a memory row at each stage's start as well as at its op;
its optimum is the simulator's optimum over these plans (tests/test_solvers_exact.py checks it
against exhaustive search).

Objective: iteration time = compute (constant) + recompute + swap-in stalls (modelled, not forbidden:
a copy that cannot land in time is charged its stall), plus a tiny charge per copy (1e-9 s) so that
useless transfers are never chosen; it is reported without that charge. Swap-outs never stall: a
swap-out that does not end inside the step is not offered, and the copy keeps its device bytes until
it ends (with link="exact": the step's end, all streams idle, less the compute time; a swap-out must
be read back). The objective is in microseconds and memory rows in MiB, so coefficients stay near 1.

Time limit (:func:`solve_problem`): wall time for building, solving and reading the solution. The model
is built and the warm start checked against its rows before the solver starts; CBC gets what is left,
less a reserve for its overrun; a child still running a second past the deadline is stopped. A start
that satisfies every row is then the solution (``status="feasible (the warm start)"``), else the result
is ``status="time limit"`` (the caller falls back to its own plan).

One concern, the MILP, from its model (:func:`build_model`, one function per row family) to its solve,
warm start and solution; hence its length.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Any

import mip
import numpy as np
from mip import xsum

from hybridmem.errors import BudgetInfeasibleError, HybridMemError

from ._common import (Problem, Schedule, TensorSchedule, early_recompute_stage, make_plan, quiet_fd,
                      schedule_to_actions, simulate, source_available)
from .exact_time import add_clock, replay_bytes

COPY_CHARGE = 1e-9         # seconds charged per transfer: breaks ties against useless copies
TIME_UNIT = 1e-6           # objective in microseconds and memory rows in MiB: coefficients near 1 keep
BYTE_UNIT = 2.0**20        # the solvers' tolerances meaningful (seconds and bytes span 1e-9 .. 1e10)
FIFO_MAX_STAGES = 12       # the exact and FIFO link models have O(copies^2) rows: small problems only
LINKS = ("exact", "fifo", "stage")
EXACT_TOL = 1e-9           # integrality and feasibility tolerance of link="exact" models (see _exact_link)
MEM_MARGIN = 0             # bytes kept free in each memory row (scaling by 2**20 is exact in binary)


class SolverUnavailableError(HybridMemError, RuntimeError):
    """The requested MILP backend is not installed."""


@dataclass
class StrModel:
    """The python-mip model and its variables, keyed by (stage, candidate position)."""

    problem: Problem
    m: Any
    S: dict[tuple[int, int], Any] = field(default_factory=dict)
    R: dict[tuple[int, int], Any] = field(default_factory=dict)
    X: dict[tuple[int, int], Any] = field(default_factory=dict)
    P: dict[tuple[int, int], Any] = field(default_factory=dict)
    Y: dict[tuple[int, int, int], Any] = field(default_factory=dict)
    stall: dict[tuple[int, int, int], float] = field(default_factory=dict)
    sigma: dict[tuple[int, int, int], Any] = field(default_factory=dict)   # fifo: stall variables (us)
    build_s: float = 0.0
    link: str = "stage"
    start_note: str = ""
    rows: Any = None          # the rows as arrays (:func:`_row_matrix`), read once for checking starts

    def present(self, t: int, k: int) -> Any:
        """1 if candidate k is readable at op t (kept, landed or recomputed); a constant at its producer."""
        if t == self.problem.candidates[k].start:
            return 1
        return self.S[t, k] + self.R[t, k] if (t, k) in self.R else self.S[t, k]

    @property
    def num_vars(self) -> int:
        return self.m.num_cols

    @property
    def num_constraints(self) -> int:
        return self.m.num_rows


def check_backend(solver: str = "cbc") -> str:
    """The python-mip solver name for ``solver`` (``cbc`` or ``highs``); a clear error if unavailable."""

    key = solver.lower()
    if key == "highs":
        try:
            import highspy  # noqa: F401  (lazy: the optional HiGHS backend, only asked for here)
        except ImportError:
            raise SolverUnavailableError(
                "solver 'highs' needs the highspy package: pip install 'hybridmem[highs]' "
                "(highspy<1.16; 1.16 does not load under python-mip 2.0)") from None
        return mip.HIGHS
    if key == "cbc":
        return mip.CBC
    raise ValueError(f"unknown MILP backend {solver!r}: cbc or highs")


def new_model(solver: str = "cbc", verbose: bool = False, name: str = "str"):

    m = mip.Model(name, sense=mip.MINIMIZE, solver_name=check_backend(solver))
    m.verbose = 1 if verbose else 0
    return m


def swap_in_options(p: Problem, k: int, max_stall_variants: int | None = None,
                    window: int | None = None, reads: set[int] | None = None) -> list[tuple[int, int, float]]:
    """``(issue q, first read u, stall seconds)`` of the swap-ins of candidate ``k`` worth offering.

    A swap-in needs a swap-out that has ended (the earliest possible one is issued after the producer).
    Only arrivals at a *read* matter (its op reads it, or a replay may start from it): landing earlier
    and waiting on the device holds the same bytes as the buffer in flight. So ``u`` is the first read
    at or after ``ready(q)`` (hidden) or, stalling, a read in ``q .. ready(q) - 1``. ``window`` (compact
    models) limits how many stages before the latest hidden issue stage a copy may start.
    """
    c = p.candidates[k]
    f0 = p.out_finish(c.start, c.d2h_s)
    if f0 is None:
        return []
    rd = sorted(reads if reads is not None else set(c.uses) | p.source_stages(k))
    out = []
    for q in range(f0 + 1, c.end + 1):
        ready = p.in_ready(q, c.h2d_s)
        later = [u for u in rd if u >= max(ready, q)]
        if later and (window is None or _latest_hidden(p, later[0], c.h2d_s) - q <= window):
            out.append((q, later[0], 0.0))
        stalled = [u for u in rd if q <= u < ready]
        if max_stall_variants is not None:
            stalled = stalled[:max_stall_variants] if max_stall_variants > 0 else []
        out.extend((q, u, p.in_stall(q, u, c.h2d_s)) for u in stalled)
    return out


COMPACT_WINDOW = 6         # compact models: swap-ins issued at most this many stages before the latest hidden one


def default_link(p: Problem, compact: bool = False, relax: bool = False) -> str:
    """The link model :func:`build_model` uses for ``p`` when none is given."""
    fine = all(len(g) == 1 for g in p.groups)
    small = p.T <= FIFO_MAX_STAGES and not compact
    return ("exact" if fine and not relax else "fifo") if small else "stage"


def replay_read_stages(p: Problem, rec_at: list[set[int]]) -> list[set[int]]:
    """Per candidate, the stages where some replay may read it: where a reader of it may be recomputed
    (``rec_at``: :func:`read_closure`)."""
    rec_src: list[set[int]] = [set() for _ in p.candidates]
    for kk, c in enumerate(p.candidates):
        for j in c.src:
            kj = p.index.get(j)
            if kj is not None and kj != kk:
                rec_src[kj] |= rec_at[kk]
    return rec_src


def stage_link_copies(p: Problem, compact: bool) -> list[tuple[dict[int, list[int]], list[tuple[int, int, float]]]]:
    """Per candidate, the copies a ``link="stage"`` model of ``p`` offers (:func:`copy_options` as
    :func:`build_model` calls it): what a warm start may use."""
    rec_src = replay_read_stages(p, read_closure(p)) if compact else None
    return [copy_options(p, k, compact=compact, window=COMPACT_WINDOW if compact else None,
                         max_stall_variants=1 if compact else None,
                         reads=(set(c.uses) | (p.source_stages(k) & rec_src[k])) if compact else None)
            for k, c in enumerate(p.candidates)]


def copy_options(p: Problem, k: int, *, compact: bool = False, fifo: bool = False, window: int | None = None,
                 max_stall_variants: int | None = None, reads: set[int] | None = None
                 ) -> tuple[dict[int, list[int]], list[tuple[int, int, float]]]:
    """The copies of candidate ``k`` the discrete-link MILP offers: swap-outs as ``{issue t: [finish
    stages f]}`` (one, fixed by the timing, unless ``fifo``: the copy may wait behind earlier ones) and
    swap-ins as ``(q, u, stall)`` (:func:`swap_in_options`, issued after the earliest swap-out ended).
    ``compact``: swap-outs only right after a read (``window``, ``max_stall_variants`` and ``reads`` as
    :func:`build_model` sets them for compact models)."""
    c = p.candidates[k]
    options = swap_in_options(p, k, max_stall_variants, window, reads)
    if not options:
        return {}, []
    last_q = max(q for q, _, _ in options)
    issue = [c.start, *c.uses] if compact else range(c.start, c.end)
    finish = {t: p.out_finish(t, c.d2h_s) for t in issue if t < c.end}
    outs = {t: list(range(f, last_q) if fifo else (f,)) for t, f in finish.items() if f is not None and f < last_q}
    first_done = min(finish[t] for t in outs) if outs else p.T
    return outs, [(q, u, st) for q, u, st in options if q > first_done]


def _latest_hidden(p: Problem, u: int, d: float) -> int:
    """The latest issue stage whose copy lands before op u."""
    q = int(np.searchsorted(p.cum, p.cum[u] - d + 1e-15, side="right")) - 1
    return max(q, 0)


def replay_readers(p: Problem) -> dict[int, list[int]]:
    """Candidate -> the candidates whose replay reads it (it is an input of their producers)."""
    readers: dict[int, list[int]] = {}
    for k, c in enumerate(p.candidates):
        for j in c.src:
            kj = p.index.get(j)
            if kj is not None and kj != k:
                readers.setdefault(kj, []).append(k)
    return readers


def read_closure(p: Problem) -> list[set[int]]:
    """Stages where a recompute of each candidate can matter: its reads (or, for a read it cannot be
    recomputed for, :func:`early_recompute_stage`), and (recursively) the stages where a candidate whose
    producer reads it may be recomputed."""
    C = p.candidates
    readers = replay_readers(p)
    out = [set(u for u in c.uses if u > c.start) for c in C]
    for k, c in enumerate(C):
        for u in list(out[k]):
            e = early_recompute_stage(p, k, u)
            if e is not None:
                out[k].add(e)
    order = sorted(range(len(C)), key=lambda k: -C[k].start)     # later producers first: one pass, except
    changed = True                                                # for bundles made in the same coarse stage
    while changed:
        changed = False
        for k in order:
            for r in readers.get(k, ()):
                add = {t for t in out[r] if C[k].start < t <= C[k].end} - out[k]
                if add:
                    out[k] |= add
                    changed = True
    return out


def build_model(p: Problem, *, solver: str = "cbc", verbose: bool = False, relax: bool = False,
                swap: bool = True, recompute: bool = True, compact: bool = False,
                max_stall_variants: int | None = None, window: int | None = None,
                link: str | None = None, name: str = "str") -> StrModel:
    """The STR MILP of ``p`` (``relax=True``: continuous variables in [0, 1], the LP relaxation).

    ``compact`` (large problems) offers fewer decisions, each restriction one that rarely costs anything:
    swap-outs only right after a read, recomputes only where the tensor (or, recursively, a tensor
    replayed from it) is read, swap-ins issued at most ``window`` stages (default 6) before the latest
    issue that still hides the copy, and one stalling arrival per issue stage.

    ``link`` is how time and the copy streams are modelled. ``"exact"`` (default up to
    ``FIFO_MAX_STAGES`` stages when the problem is not coarsened and ``relax`` is False): the simulator's
    clock (:mod:`solvers.exact_time`). ``"fifo"`` (the default there otherwise): copies in issue order
    as the simulator runs them, each starting when the previous one ends;
    a swap-out holds its device bytes through a chosen finish stage ``f`` and must end by then, a swap-in's
    stall is a variable bounded by its FIFO arrival time (big-M rows, one per earlier issue stage).
    ``"stage"`` (larger problems): a copy occupies every stage it overlaps alone, which needs one row per
    stage but wastes the rest of the stage in which a copy ends.

    The model, block by block (one function each, below): variables on each candidate's lifetime, one
    replay per stage and producer set, the objective, then the row families: uses, recompute sources,
    residency, host checkpoint, host link, memory, memory during replays.
    """
    t0 = time.perf_counter()
    fine = all(len(g) == 1 for g in p.groups)
    link = default_link(p, compact, relax) if link is None else link
    if link not in LINKS:
        raise ValueError(f"link model {link!r}: one of {', '.join(LINKS)}")
    if link == "exact" and not (fine and not compact):
        raise ValueError("link='exact' needs an uncoarsened problem and compact=False")
    sm = StrModel(p, new_model(solver, verbose, name), link=link)
    vtype = mip.CONTINUOUS if relax else mip.BINARY
    _add_variables(sm, vtype, swap=swap, recompute=recompute, compact=compact, window=window,
                   max_stall_variants=max_stall_variants)
    replay_cost = _add_replays(sm, vtype)
    copies = _set_objective(sm, replay_cost)
    _use_rows(sm)
    _source_rows(sm)
    _residency_rows(sm)
    _host_checkpoint_rows(sm)
    clock = None
    if link == "exact":
        clock = _exact_link(sm, sm.present, copies)
    elif link == "fifo":
        _fifo_link_rows(sm)
    else:
        _stage_link_rows(sm)
    mem, rhs = _memory_rows(sm, clock)
    if link == "exact":
        _exact_memory_rows(sm, clock, _mib(sm.problem), _inflight(sm), rhs)
    else:
        _replay_memory_rows(sm, mem, rhs)
    sm.build_s = time.perf_counter() - t0
    return sm


def _mib(p: Problem) -> list[float]:
    """Each candidate's size in the model's memory unit."""
    return [c.nbytes / BYTE_UNIT for c in p.candidates]


def _add_variables(sm: StrModel, vtype: Any, *, swap: bool, recompute: bool, compact: bool, window: int | None,
                   max_stall_variants: int | None) -> None:
    """Variables, only on each candidate's natural lifetime: S (kept), R (recomputed), P (swap-out issued
    after op t, ending by stage f), Y (swap-in issued at q, first read at u) and, fifo, its stall."""
    p, m = sm.problem, sm.m
    S, R, P, Y = sm.S, sm.R, sm.P, sm.Y
    fifo, exact = sm.link == "fifo", sm.link == "exact"
    if compact:
        window = COMPACT_WINDOW if window is None else window
        max_stall_variants = 1 if max_stall_variants is None else max_stall_variants
        rec_at = read_closure(p)
        rec_src = replay_read_stages(p, rec_at)
    for k, c in enumerate(p.candidates):
        for t in range(c.start + 1, c.end + 1):
            S[t, k] = m.add_var(f"S_{t}_{k}", var_type=vtype, ub=1)
        if recompute and c.can_recompute:
            stages = sorted(rec_at[k]) if compact else range(c.start + 1, c.end + 1)
            for t in stages:
                if all(source_available(p, j, t) is not False for j in c.src):
                    R[t, k] = m.add_var(f"R_{t}_{k}", var_type=vtype, ub=1)
        if swap and exact:
            options = exact_swap_in_options(p, k)
            for t in range(c.start, c.end):
                if any(q > t for q, _ in options):
                    P[t, t, k] = m.add_var(f"P_{t}_{k}", var_type=vtype, ub=1)
            for q, u in options:
                if any(t < q for (t, _, kk) in P if kk == k):
                    Y[q, u, k] = m.add_var(f"Y_{q}_{u}_{k}", var_type=vtype, ub=1)
                    sm.stall[q, u, k] = 0.0
        elif swap:
            reads = (set(c.uses) | (p.source_stages(k) & rec_src[k])) if compact else None
            outs, ins = copy_options(p, k, compact=compact, fifo=fifo, window=window,
                                     max_stall_variants=max_stall_variants, reads=reads)
            for t, fs in outs.items():
                for f in fs:
                    P[t, f, k] = m.add_var(f"P_{t}_{f}_{k}", var_type=vtype, ub=1)
            for q, u, st in ins:
                Y[q, u, k] = m.add_var(f"Y_{q}_{u}_{k}", var_type=vtype, ub=1)
                sm.stall[q, u, k] = st
                if fifo:
                    sm.sigma[q, u, k] = m.add_var(f"stall_{q}_{u}_{k}", lb=0.0)


def _add_replays(sm: StrModel, vtype: Any) -> list[tuple[float, Any]]:
    """One replay per (stage, producer set): outputs of the same producers recomputed together share it
    (X, with a row per output it serves). Returns the replays as ``(seconds, variable)``."""
    p, m, R, X = sm.problem, sm.m, sm.R, sm.X
    C = p.candidates
    R_of: dict[int, list[int]] = {}
    for (t, k) in R:
        R_of.setdefault(k, []).append(t)
    by_producer: dict[tuple[int, ...], list[int]] = {}
    for k, c in enumerate(C):
        by_producer.setdefault(p.producers(k), []).append(k)
    replay_cost: list[tuple[float, Any]] = []
    for prod, ks in by_producer.items():
        if len(ks) == 1:
            replay_cost += [(C[ks[0]].recompute_s, R[t, ks[0]]) for t in R_of.get(ks[0], ())]
            continue
        pid = prod[0]
        for t in sorted({t for kk in ks for t in R_of.get(kk, ())}):
            X[t, pid] = m.add_var(f"X_{t}_{pid}", var_type=vtype, ub=1)
            replay_cost.append((C[ks[0]].recompute_s, X[t, pid]))
            # a replay of these producers serves every output recomputed at t
            for kk in ks:
                if (t, kk) in R:
                    m += R[t, kk] <= X[t, pid], f"replay_{t}_{pid}_{kk}"
    return replay_cost


def _set_objective(sm: StrModel, replay_cost: list[tuple[float, Any]]) -> Any:
    """Objective: recompute + stalls (+ a tiny charge per transfer). Returns the copies' charge (the
    exact link model sets its own objective, the step's end, and adds it there)."""
    P, Y = sm.P, sm.Y
    exact = sm.link == "exact"
    if exact:      # the step's end is a variable (solvers.exact_time); the objective is set there
        stall_terms = 0.0
    elif sm.link == "fifo":     # stall seconds are variables (in microseconds), bounded below by FIFO arrival times
        stall_terms = xsum(sm.sigma.values()) + xsum(COPY_CHARGE / TIME_UNIT * v for v in Y.values())
    else:
        stall_terms = xsum((sm.stall[key] + COPY_CHARGE) / TIME_UNIT * v for key, v in Y.items())
    copies = xsum(COPY_CHARGE / TIME_UNIT * v for v in (*P.values(), *(Y.values() if exact else ())))
    if not exact:
        sm.m.objective = xsum(cost / TIME_UNIT * v for cost, v in replay_cost) + stall_terms + copies
    return copies


def _use_rows(sm: StrModel) -> None:
    """Dependencies: an op runs only with its candidate inputs on the device."""
    for k, c in enumerate(sm.problem.candidates):
        for t in c.uses:
            sm.m += sm.present(t, k) >= 1, f"use_{t}_{k}"


def _source_rows(sm: StrModel) -> None:
    """Recompute sources: a replay of p_i needs p_i's candidate inputs kept, landed or recomputed first at
    the same stage (sources are replayed before their readers: list order)."""
    p = sm.problem
    for (t, k), r in sm.R.items():
        for j in p.candidates[k].src:
            kj = p.index.get(j)
            if kj is not None and kj != k:
                sm.m += r <= sm.present(t, kj), f"src_{t}_{k}_{kj}"


def _residency_rows(sm: StrModel) -> None:
    """Residency: kept at t only if on the device at t-1 or landed by a swap-in read first at t."""
    C = sm.problem.candidates
    arrivals: dict[tuple[int, int], list[Any]] = {}
    for (q, u, k), y in sm.Y.items():
        arrivals.setdefault((u, k), []).append(y)
    for (t, k), s in sm.S.items():
        if t == C[k].start + 1:
            continue                       # produced at t-1: may be kept
        sm.m += s <= sm.present(t - 1, k) + xsum(arrivals.get((t, k), [])), f"keep_{t}_{k}"


def _host_checkpoint_rows(sm: StrModel) -> None:
    """Host checkpoint: one swap-out per tensor, issued while it is on the device; it keeps its device
    bytes until the copy ends; swap-ins (any number) only after the copy ended."""
    m, C, S = sm.m, sm.problem.candidates, sm.S
    outs_of: dict[int, list[tuple[int, int, Any]]] = {}
    for (t, f, k), v in sm.P.items():
        outs_of.setdefault(k, []).append((t, f, v))
    for k, outs in outs_of.items():
        for t in sorted({t for t, _, _ in outs}):
            at_t = [v for tt, _, v in outs if tt == t]
            if t > C[k].start:
                m += xsum(at_t) <= sm.present(t, k), f"out_resident_{t}_{k}"
        for t, f, v in outs:
            for s_ in range(t + 1, f + 1):
                m += S[s_, k] >= v, f"out_inflight_{t}_{f}_{s_}_{k}"
        if len(outs) > 1:
            m += xsum(v for _, _, v in outs) <= 1, f"out_once_{k}"
    ins_by_issue: dict[tuple[int, int], list[Any]] = {}
    for (q, u, k), y in sm.Y.items():
        ins_by_issue.setdefault((q, k), []).append(y)
    for (q, k), ys in ins_by_issue.items():
        done = [v for t, f, v in outs_of.get(k, []) if f < q]
        m += xsum(ys) <= xsum(done), f"in_after_out_{q}_{k}"


def _inflight(sm: StrModel) -> dict[tuple[int, int], list[Any]]:
    """The swap-ins whose device buffer is held at (stage, candidate): from issue to first read."""
    inflight: dict[tuple[int, int], list[Any]] = {}
    for (q, u, k), y in sm.Y.items():
        for s_ in range(q, u):
            inflight.setdefault((s_, k), []).append(y)
    return inflight


def _fifo_link_rows(sm: StrModel) -> None:
    """Host link, ``link="fifo"``: one copy per direction at a time, in issue order as the simulator runs
    them.

    d2h (after op t; same stage: candidate order): a copy ends by the end of its finish stage f if, for
    every earlier issue stage a, the copies issued from a on up to it fit between the end of op a and
    the end of stage f. h2d (start of stage q; same stage: candidate order): the stall at the first read
    u is at least the arrival time minus the start of u."""
    p, m, P, Y = sm.problem, sm.m, sm.P, sm.Y
    C = p.candidates
    cum = [float(x) for x in p.cum]
    order = sorted(P, key=lambda key: (key[0], key[2], key[1]))
    big = sum(c.d2h_s for c in C) + cum[-1]
    for j, (c_, f, k) in enumerate(order):
        for a in sorted({t for t, _, _ in order if t <= c_}):
            ahead = [(C[kk].d2h_s, P[t, ff, kk]) for (t, ff, kk) in order
                     if a <= t and (t, kk) < (c_, k)]
            m += (xsum(d / TIME_UNIT * v for d, v in ahead) + C[k].d2h_s / TIME_UNIT
                  <= (cum[f + 1] - cum[a + 1]) / TIME_UNIT + big / TIME_UNIT * (1 - P[c_, f, k])), \
                f"d2h_fifo_{c_}_{f}_{k}_{a}"
    order = sorted(Y, key=lambda key: (key[0], key[2], key[1]))
    big = sum(c.h2d_s for c in C) + cum[-1]
    for (q, u, k) in order:
        for a in sorted({qq for qq, _, _ in order if qq <= q}):
            ahead = [(C[kk].h2d_s, Y[qq, uu, kk]) for (qq, uu, kk) in order if a <= qq and (qq, kk) < (q, k)]
            m += (sm.sigma[q, u, k] >= xsum(d / TIME_UNIT * v for d, v in ahead)
                  + (cum[a] + C[k].h2d_s - cum[u]) / TIME_UNIT - big / TIME_UNIT * (1 - Y[q, u, k])), \
                f"h2d_fifo_{q}_{u}_{k}_{a}"


def _stage_link_rows(sm: StrModel) -> None:
    """Host link, ``link="stage"``: a copy holds its direction during every stage it overlaps, alone."""
    p, m = sm.problem, sm.m
    C = p.candidates
    d2h_busy: dict[int, list[Any]] = {}
    for (t, f, k), v in sm.P.items():
        for s_ in range(t + 1, f + 1):
            d2h_busy.setdefault(s_, []).append(v)
    h2d_busy: dict[int, list[Any]] = {}
    for (q, u, k), y in sm.Y.items():
        ready = p.in_ready(q, C[k].h2d_s)
        for s_ in range(q, max(q, min(u, ready - 1)) + 1):
            h2d_busy.setdefault(s_, []).append(y)
    for s_, vs in d2h_busy.items():
        if len(vs) > 1:
            m += xsum(vs) <= 1, f"d2h_link_{s_}"
    for s_, vs in h2d_busy.items():
        if len(vs) > 1:
            m += xsum(vs) <= 1, f"h2d_link_{s_}"


def _memory_rows(sm: StrModel, clock: Any) -> tuple[dict[int, Any], np.ndarray]:
    """Memory: at every stage, everything on the device (kept, recomputed, swap-in buffers in flight,
    swap-outs in flight via S) + the constant part (other tensors, the op's outputs and workspace) <=
    budget. Returns each stage's expression and right-hand side (the replay rows reuse them)."""
    p, m = sm.problem, sm.m
    mb = _mib(p)
    # (variable, MiB) per stage, made into one LinExpr per stage: summing per-term expressions with
    # xsum costs most of a large model's build, and the replay rows reuse the stage's sum
    terms: dict[int, list[tuple[Any, float]]] = {t: [] for t in range(p.T)}
    for (t, k), s in sm.S.items():
        terms[t].append((s, mb[k]))
    for (t, k), r in sm.R.items():
        terms[t].append((r, mb[k]))
    for (s, k), ys in _inflight(sm).items():
        terms[s].extend((y, mb[k]) for y in ys)
    mem = {t: mip.LinExpr([v for v, _ in ts], [c for _, c in ts]) for t, ts in terms.items()}
    slack = p.budget - p.base_mem
    rhs = (slack - MEM_MARGIN) / BYTE_UNIT
    ghost_op = clock.ghost_op if clock else {}
    for t in range(p.T):
        if ghost_op.get(t):
            m += mem[t] + xsum(mb[k] * g for k, g in ghost_op[t]) <= float(rhs[t]), f"mem_{t}"
        elif terms[t]:
            m += mem[t] <= float(rhs[t]), f"mem_{t}"
        elif slack[t] < 0:
            raise BudgetInfeasibleError(f"stage {t} needs {int(p.base_mem[t])} bytes without any candidate",
                                        int(p.base_mem.max()))
    return mem, rhs


def _replay_memory_rows(sm: StrModel, mem: dict[int, Any], rhs: np.ndarray) -> None:
    """Memory while a replay runs before op t: its other outputs and workspace are transient; only rows
    where that can exceed what op t itself adds are needed (``link="exact"``: :func:`_exact_memory_rows`,
    each check of the stage)."""
    p = sm.problem
    op_extra = p.op_extra()
    for (t, k), r in sm.R.items():
        extra = p.replay_extra(k)
        if extra > op_extra[t]:
            sm.m += mem[t] + (extra - op_extra[t]) / BYTE_UNIT * r <= float(rhs[t]), f"mem_replay_{t}_{k}"


def exact_swap_in_options(p: Problem, k: int) -> list[tuple[int, int]]:
    """``(issue q, first read u)`` of every swap-in of candidate ``k`` (``link="exact"``): the first op
    reading it at or after ``q``, or an earlier stage where a replay may read it (then one must)."""
    c = p.candidates[k]
    src = sorted(p.source_stages(k))
    out = []
    for q in range(c.start + 1, c.end + 1):
        first_op = min(u for u in c.uses if u >= q)     # c.end is a use
        out.append((q, first_op))
        out.extend((q, s) for s in src if q <= s < first_op)
    return out


def _exact_memory_rows(sm: StrModel, clock: Any, mb: list[float], inflight: dict[tuple[int, int], list[Any]],
                       rhs: np.ndarray) -> None:
    """``link="exact"``: the simulator's other memory checks of a stage. At its start (before the op's
    outputs and workspace, where a copy freed behind a swap-out may still be held that the op's check no
    longer sees), and at each replay: what is on the device then (the recomputes run before it
    included, not those after), the ghosts at that instant, every output of the replayed stages and
    their largest workspace. A replay that does not run has no row (its ghosts are then free, and the
    rest is the op's row minus its outputs)."""

    m, p = sm.m, sm.problem
    pre_rhs = rhs + p.op_extra() / BYTE_UNIT
    for t in range(p.T):
        pre = [mb[k] * s_ for (tt, k), s_ in sm.S.items() if tt == t]
        pre += [mb[k] * y for (s_, k), ys in inflight.items() if s_ == t for y in ys]
        gs = clock.ghost_pre.get(t, [])
        if gs:
            m += xsum(pre) + xsum(mb[k] * g for k, g in gs) <= float(pre_rhs[t]), f"mem_pre_{t}"
        done: list[Any] = []
        for rp in clock.replays.get(t, ()):
            m += (xsum(pre) + xsum(done) + xsum(mb[k] * g for k, g in rp.ghosts)
                  + replay_bytes(p, rp.ks, t) / BYTE_UNIT * rp.v <= float(pre_rhs[t])), f"mem_replay_{t}_{rp.pid}"
            done += [mb[k] * sm.R[t, k] for k in rp.ks]


def _exact_link(sm: StrModel, present: Any, copies: Any) -> Any:
    """``link="exact"``: the simulator's clock (:mod:`solvers.exact_time`), the rules it needs of the
    copies, and the objective (the step's end, less the compute time)."""

    m, p, C = sm.m, sm.problem, sm.problem.candidates
    # the clock's big-M rows reach 1e4 us: a selector 1e-6 short of integral would give a release credit
    # 10 ns of slack, against RELEASE_MARGIN's 0.1 ns
    m.infeas_tol, m.integer_tol = EXACT_TOL, EXACT_TOL
    # without preprocessing these small models solve faster (the exhaustive-search tests: 22 s against
    # 34 s), and its reductions returned plans a byte over the tightest budgets more often
    m.preprocess = 0
    # python-mip passes that to CBC only; with its presolve HiGHS (1.15) rejects its own solutions of the
    # big-M rows ("untransformed violations") and calls feasible models infeasible
    set_option = getattr(m.solver, "_set_string_option_value", None)
    if m.solver_name.lower() == "highs" and set_option is not None:
        set_option("presolve", "off")
    clock = add_clock(sm, present, TIME_UNIT)
    readers = replay_readers(p)
    # Every replay and every copy on the clock is one the plan does: a regeneration is a return to the
    # device, never a second copy, a replay serves a recompute, a swap-in lands what is read. A
    # redundant one would otherwise be worth its time (a replay or a copy the op waits for lets other
    # copies end), and the plan, which cannot express it, would not do it.
    for (t, k), r in sm.R.items():
        m += r + present(t - 1, k) <= 1, f"rec_returns_{t}_{k}"
        m += r + sm.S[t, k] <= 1, f"rec_alone_{t}_{k}"
    for rp in (rp for rps in clock.replays.values() for rp in rps if (rp.t, rp.pid) in sm.X):
        m += rp.v <= xsum(sm.R[rp.t, k] for k in rp.ks), f"replay_used_{rp.t}_{rp.pid}"
    landing: dict[tuple[int, int], list[Any]] = {}
    for (q, u, k), y in sm.Y.items():
        landing.setdefault((u, k), []).append(y)
        m += y <= sm.S[u, k], f"in_lands_{q}_{u}_{k}"      # the copy is what op u (or a replay) reads
        m += y + present(u - 1, k) <= 1, f"in_returns_{q}_{u}_{k}"
        # off the device while the copy is in flight (a swap-in of a resident tensor is refused)
        for s_ in range(q, u):
            m += present(s_, k) + y <= 1, f"in_absent_{q}_{u}_{k}_{s_}"
        if u not in C[k].uses:               # first read by a replay: one must run there
            m += y <= xsum(sm.R[u, kk] for kk in readers.get(k, ()) if (u, kk) in sm.R), f"in_read_{q}_{u}_{k}"
    for (u, k), ys in landing.items():
        if len(ys) > 1:
            m += xsum(ys) <= 1, f"in_once_{u}_{k}"
    for (t, _, k), v in sm.P.items():        # a host copy nobody reads back only costs link time
        m += v <= xsum(y for (q, _, kk), y in sm.Y.items() if kk == k and q > t), f"out_used_{t}_{k}"
    m.objective = clock.end - float(p.cum[-1]) / TIME_UNIT + copies
    return clock


# ---- solutions -----------------------------------------------------------------------------------
def extract_schedule(sm: StrModel, threshold: float = 0.5) -> Schedule:
    """The schedule of an integral solution (values rounded at ``threshold``)."""
    p = sm.problem
    sched = Schedule()
    val = _values(sm)
    for k, c in enumerate(p.candidates):
        n = c.end - c.start + 1
        pres = np.zeros(n, dtype=bool)
        pres[0] = True
        rec: list[int] = []
        for t in range(c.start + 1, c.end + 1):
            s = val(sm.S.get((t, k))) > threshold
            r = val(sm.R.get((t, k))) > threshold
            pres[t - c.start] = s or r
            if r and not s:
                rec.append(t)
        outs = [t for (t, _, kk), v in sm.P.items() if kk == k and val(v) > threshold]
        ins = [(q, u) for (q, u, kk), v in sm.Y.items() if kk == k and val(v) > threshold]
        sched.tensors[c.tensor] = TensorSchedule(c.tensor, c.start, pres, rec, outs[0] if outs else None, ins)
    return sched


def _values(sm: StrModel):
    def val(v) -> float:
        if v is None:
            return 0.0
        x = v.x
        return 0.0 if x is None else float(x)
    return val


def start_from_schedule(sm: StrModel, sched: Schedule) -> list[tuple[Any, float]]:
    """A python-mip start (``m.start``) that encodes ``sched``; variables not in it are 0."""
    p = sm.problem
    start: list[tuple[Any, float]] = []
    for k, c in enumerate(p.candidates):
        ts = sched.tensors.get(c.tensor)
        if ts is None:
            for t in range(c.start + 1, c.end + 1):
                start.append((sm.S[t, k], 1.0))
            continue
        rec = set(ts.recompute)
        pid = p.producers(k)[0]
        for t in range(c.start + 1, c.end + 1):
            here = ts.is_present(t)
            if here and t in rec and (t, k) in sm.R:
                start.append((sm.R[t, k], 1.0))
                if (t, pid) in sm.X:
                    start.append((sm.X[t, pid], 1.0))
            elif here:
                start.append((sm.S[t, k], 1.0))
        if ts.swap_out is not None:
            fs = sorted(f for (t, f, kk) in sm.P if kk == k and t == ts.swap_out)
            if fs:
                start.append((sm.P[ts.swap_out, fs[0], k], 1.0))
                for s_ in range(ts.swap_out + 1, fs[0] + 1):      # held while the copy runs
                    if (s_, k) in sm.S:
                        start.append((sm.S[s_, k], 1.0))
        ys = [key for key in sm.Y if key[2] == k]
        for q, u in ts.swap_in:
            if (q, u, k) in sm.Y:
                start.append((sm.Y[q, u, k], 1.0))
                continue
            near = [key for key in ys if key[1] == u and key[0] <= u]     # same read, nearest issue
            if near:
                start.append((sm.Y[min(near, key=lambda key: abs(key[0] - q))], 1.0))
    # X may be shared by several outputs: deduplicate
    seen: dict[int, tuple[Any, float]] = {}
    for v, x in start:
        seen[id(v)] = (v, x)
    return list(seen.values())


@dataclass
class SolveResult:
    status: str
    objective: float | None
    bound: float | None
    gap: float | None
    solve_s: float
    schedule: Schedule | None
    num_vars: int
    num_constraints: int
    build_s: float
    elapsed_s: float = 0.0     # wall seconds of the whole call: build + solve + reading the solution
    start_note: str = ""       # whether the warm start satisfies the model (check_start)


TIME_LIMIT_STATUS = "time limit"   # the deadline stopped the solve before the solver returned
NO_BOUND = 1e29            # objective bounds this large (in microseconds) are the solver's "none"


def solve(sm: StrModel, *, time_limit: float | None = None, start: Schedule | None = None,
          relax: bool = False, threads: int | None = None, deadline: float | None = None) -> SolveResult:
    """Optimise; the schedule is None when no integral solution was found.

    ``deadline`` (a :func:`time.monotonic` instant) caps ``time_limit`` by the time left until then,
    so that time already spent (building the model) counts against the caller's limit.
    """

    m = sm.m
    values = None
    if start is not None and not relax:
        values = start_from_schedule(sm, start)
        check_start(sm, start, values)
    if deadline is not None:
        left = deadline - time.monotonic()
        time_limit = left if time_limit is None else min(float(time_limit), left)
        if time_limit < MIN_SOLVE_S:     # nothing left to search with: the start if it is a solution
            return start_result(sm, start, values)
        if not relax:
            # CBC overruns max_seconds (root LP, preprocessing, cuts are not interrupted): stopping it
            # early enough that it returns by itself keeps its incumbent and bound, which a stop by
            # the parent at the deadline loses
            time_limit = max(time_limit - max(OVERRUN_RESERVE_S, OVERRUN_SHARE * time_limit), 0.5 * time_limit)
    if values is not None:
        m.start = values
    if not relax and sm.start_note != START_SATISFIES and m.solver_name.upper() == "CBC":
        # no start CBC keeps: its default search can spend the whole limit without an incumbent (UNet
        # on v100 at 37 % of the peak: none in 30 s), its feasibility emphasis finds one in seconds;
        # the caller keeps the approx plan wherever that is faster, so the MILP only ever adds a plan
        m.emphasis = mip.SearchEmphasis.FEASIBILITY
    if threads is not None:
        m.threads = threads
    t0 = time.perf_counter()
    kw: dict[str, Any] = {"relax": relax}
    if time_limit is not None:
        kw["max_seconds"] = max(float(time_limit), 0.01)
    with quiet_fd(not m.verbose):
        status = m.optimize(**kw)
        if sm.link == "exact" and not relax:
            status = _cut_plans_over_budget(sm, status, kw, t0)
    dt = time.perf_counter() - t0
    has = status in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE)
    obj = float(m.objective_value) * TIME_UNIT if has and m.objective_value is not None else None
    bound = m.objective_bound if not relax else (obj / TIME_UNIT if obj is not None else None)
    # CBC reports a bound of +-DBL_MAX (or 1e30s) where it has none: no bound
    bound = float(bound) * TIME_UNIT if bound is not None and abs(float(bound)) < NO_BOUND else None
    sched = extract_schedule(sm) if has and not relax else None
    if sched is not None and obj is not None:
        copies = sum(1 for v in (*sm.P.values(), *sm.Y.values()) if (v.x or 0.0) > 0.5)
        obj -= copies * COPY_CHARGE          # report seconds of step time only
    if obj is not None and bound is not None:
        bound = min(bound, obj)              # the bound includes copy charges the objective no longer has
    gap = max(0.0, obj - bound) if obj is not None and bound is not None else None
    name = status.name.lower()
    if sched is None and values is not None and sm.start_note == START_SATISFIES:
        # the start is a solution of the model: CBC stopped before it took it in (its root LP, its
        # preprocessing) or found none better, and says it has none
        sched, name, obj = start, START_STATUS, start_objective(sm, values)
        gap = max(0.0, obj - bound) if bound is not None else None
    return SolveResult(name, obj, bound, gap, dt, sched, m.num_cols, m.num_rows, sm.build_s,
                       start_note=sm.start_note)


START_SATISFIES = "the warm start satisfies the MILP"
START_STATUS = "feasible (the warm start)"   # the solver stopped with nothing of its own: the start it was given


def start_result(sm: StrModel, start: Schedule | None, values: list[tuple[Any, float]] | None = None,
                 solve_s: float = 0.0) -> SolveResult:
    """The result of a solve that did not run or was stopped with nothing: the start, with its objective,
    where it satisfies every row of the model (``status`` :data:`START_STATUS`), else ``time limit``."""
    if start is not None and sm.start_note == START_SATISFIES:
        values = values if values is not None else start_from_schedule(sm, start)
        return SolveResult(START_STATUS, start_objective(sm, values), None, None, solve_s, start,
                           sm.num_vars, sm.num_constraints, sm.build_s, start_note=sm.start_note)
    return SolveResult(TIME_LIMIT_STATUS, None, None, None, solve_s, None, sm.num_vars, sm.num_constraints,
                       sm.build_s, start_note=sm.start_note)


def pick_start(sm: StrModel, starts: Any) -> Schedule | None:
    """The first of ``starts`` (schedules, or None for a start that could not be made; an iterable that may
    make them as it goes) that satisfies every row of ``sm`` (:func:`check_start`), else the first given.
    ``sm.start_note`` then says what the start returned does. Models whose rows cannot be checked from a
    start's binaries (``fifo``, ``exact``) take the first start as it is."""
    first, first_note = None, ""
    for s_ in starts:
        if s_ is None:
            continue
        sm.start_note = ""
        note = check_start(sm, s_)
        if sm.link != "stage" or note == START_SATISFIES:
            return s_
        if first is None:
            first, first_note = s_, note
    sm.start_note = first_note
    return first


def start_objective(sm: StrModel, values: list[tuple[Any, float]]) -> float:
    """The objective at the start ``values`` (seconds of step time over the compute time, as
    :func:`solve` reports it: copy charges left out)."""
    by_id = {id(v): x for v, x in values}
    e = sm.m.objective
    obj = (e.const + sum(coef * by_id.get(id(v), 0.0) for v, coef in e.expr.items())) * TIME_UNIT
    copies = sum(1 for v in (*sm.P.values(), *sm.Y.values()) if by_id.get(id(v), 0.0) > 0.5)
    return obj - copies * COPY_CHARGE


def check_start(sm: StrModel, start: Schedule, values: list[tuple[Any, float]] | None = None) -> str:
    """Say whether the warm start ``start`` satisfies the model's rows (cached on ``sm``).

    CBC only uses a start it finds feasible, and a heuristic plan (queued FIFO on the full graph) often
    breaks the coarse ``stage`` link rows; the note says which rows, so that a plan falling back for
    want of a MILP solution says why. Models with continuous variables (``fifo``, ``exact``) cannot
    be checked from the start's binaries alone: the note then says nothing. ``values``: the start as
    :func:`start_from_schedule` encodes it, if the caller has it already.
    """
    if sm.start_note or sm.link != "stage":
        return sm.start_note
    x = np.zeros(sm.m.num_cols)
    for v, val in (values if values is not None else start_from_schedule(sm, start)):
        x[v.idx] = val
    broken: dict[str, int] = {}
    for i in np.flatnonzero(_row_violations(sm, x)):
        family = "_".join(w for w in sm.m.constrs[int(i)].name.split("_") if not w.isdigit())
        broken[family] = broken.get(family, 0) + 1
    if not broken:
        sm.start_note = START_SATISFIES
    else:
        rows = ", ".join(f"{k} {n}" for k, n in sorted(broken.items(), key=lambda kv: -kv[1]))
        sm.start_note = (f"the warm start breaks {sum(broken.values())} rows of the MILP ({rows}), so the "
                         "solver searches without it")
    return sm.start_note


ROW_TOL = 1e-6             # a start breaks a row by more than this (in the row's units: MiB, us, or 1)


def _row_violations(sm: StrModel, x: np.ndarray) -> np.ndarray:
    """Per row of ``sm``, whether the column values ``x`` break it (by more than ``ROW_TOL``)."""
    indptr, cols, coefs, rhs, sense = _row_matrix(sm)
    act = np.zeros(len(rhs))
    nz = np.flatnonzero(np.diff(indptr))
    if nz.size:
        act[nz] = np.add.reduceat(coefs * x[cols], indptr[nz])
    lhs = act - rhs
    return np.where(sense == 0, lhs > ROW_TOL, np.where(sense == 1, lhs < -ROW_TOL, np.abs(lhs) > ROW_TOL))


def _row_matrix(sm: StrModel) -> tuple[np.ndarray, ...]:
    """The model's rows as CSR arrays (``indptr, cols, coefs``), right-hand sides and senses (0: <=, 1: >=,
    2: =), read once per model (cached on ``sm``; read again if rows were added). From CBC's own matrix
    where the model is CBC's (reading each row as a python-mip expression takes seconds on coarse ResNets),
    else row by row."""
    m = sm.m
    if sm.rows is not None and len(sm.rows[3]) == m.num_rows:
        return sm.rows
    n = m.num_rows
    indptr = np.zeros(n + 1, dtype=np.int64)
    cols: list[np.ndarray] = []
    coefs: list[np.ndarray] = []
    rhs = np.zeros(n)
    sense = np.zeros(n, dtype=np.int8)
    senses = {"L": 0, "G": 1, "E": 2, "<": 0, ">": 1, "=": 2}
    solver = m.solver
    cbc = getattr(solver, "_model", None) is not None and m.solver_name.upper() == "CBC"
    if cbc:
        from mip.cbc import cbclib, ffi
        model = solver._model
        for i in range(n):
            nnz = cbclib.Cbc_getRowNz(model, i)
            if nnz == 0:
                sense[i] = senses[cbclib.Cbc_getRowSense(model, i).decode().upper()]
                rhs[i] = cbclib.Cbc_getRowRHS(model, i)
                indptr[i + 1] = indptr[i]
                continue
            cols.append(np.frombuffer(ffi.buffer(cbclib.Cbc_getRowIndices(model, i), 4 * nnz), dtype=np.int32))
            coefs.append(np.frombuffer(ffi.buffer(cbclib.Cbc_getRowCoeffs(model, i), 8 * nnz), dtype=np.float64))
            rhs[i] = cbclib.Cbc_getRowRHS(model, i)
            sense[i] = senses[cbclib.Cbc_getRowSense(model, i).decode().upper()]
            indptr[i + 1] = indptr[i] + nnz
    else:
        for i, c in enumerate(m.constrs):
            e = c.expr
            cols.append(np.array([v.idx for v in e.expr], dtype=np.int64))
            coefs.append(np.array(list(e.expr.values()), dtype=np.float64))
            rhs[i] = -e.const
            sense[i] = senses[e.sense]
            indptr[i + 1] = indptr[i] + len(e.expr)
    sm.rows = (indptr, np.concatenate(cols).astype(np.int64) if cols else np.zeros(0, dtype=np.int64),
               np.concatenate(coefs) if coefs else np.zeros(0), rhs, sense)
    return sm.rows


TOLERANCE_CUTS = 50        # plans a few bytes over the budget an exact model may cut off, at most


def _cut_plans_over_budget(sm: StrModel, status: Any, kw: dict[str, Any], t0: float) -> Any:
    """Refuse the solutions whose plan is a few bytes over the budget, and solve again.

    CBC keeps a row only to about 1e-7 of its largest coefficient (its row scaling sets the tolerance,
    whatever tolerance it is given), so on a memory row that is a byte or so per 10 MB tensor: at a
    budget a byte below some plan's peak, an exact model can return that plan. The simulator measures
    every plan to the byte; a plan over by no more than that tolerance is cut off (a no-good cut on
    its decisions) and the model is solved again, until a solution fits, none is left, time runs out or
    ``TOLERANCE_CUTS`` were added. A plan further over, or wrong for another reason, is left for the
    caller's own simulation to refuse.
    """
    m, p = sm.m, sm.problem
    slack = max((c.nbytes for c in p.candidates), default=0) * 1e-6 + 16
    decisions = [*sm.S.values(), *sm.R.values(), *sm.X.values(), *sm.P.values(), *sm.Y.values()]
    for i in range(TOLERANCE_CUTS):
        if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
            break
        res = simulate(p, make_plan(p, schedule_to_actions(p, extract_schedule(sm)), "milp"), strict=False)
        over = res.peak_bytes - p.budget
        if not res.violations or not 0 < over <= slack or \
                any("exceeds the budget" not in v.reason for v in res.violations):
            break
        on = [v for v in decisions if (v.x or 0.0) > 0.5]
        m += xsum(1 - v for v in on) + xsum(v for v in decisions if (v.x or 0.0) <= 0.5) >= 1, f"over_budget_{i}"
        if "max_seconds" in kw:
            left = kw["max_seconds"] - (time.perf_counter() - t0)
            if left < MIN_SOLVE_S:
                break
            kw = {**kw, "max_seconds": left}
        status = m.optimize(**kw)
    return status


def result_info(p: Problem, res: SolveResult, **extra: Any) -> dict[str, Any]:
    """What a MILP solve says in ``plan.info``: status and size (then ``extra``), whether the warm start
    satisfied the model, objective and bound in seconds of step time."""
    info: dict[str, Any] = {"status": res.status, "milp_vars": res.num_vars, "milp_constraints": res.num_constraints,
                            **extra}
    if res.start_note:
        info["warm_start"] = res.start_note
    if res.objective is not None:
        info["objective_s"] = p.compute_s + res.objective
    if res.bound is not None:
        info["bound_s"] = p.compute_s + res.bound
    return info


# ---- a crash-proof solve that keeps its time limit -----------------------------------------------
MIN_SOLVE_S = 0.05         # less time than this left after building the model: do not start the solver
OVERRUN_RESERVE_S = 0.5    # of the time left after the build, kept back from CBC for its overrun: at least
OVERRUN_SHARE = 0.1        # this many seconds or this share of it (at most half)
KILL_GRACE_S = 1.0         # past the deadline, before the parent stops a child still solving
NO_LIMIT_WAIT_S = 3600.0   # without a time limit, how long a silent child may run before it is presumed hung


def solve_problem(p: Problem, *, time_limit: float | None = None, start: Schedule | None = None,
                  starts: Any = (), isolate: bool = True, **build_options: Any) -> SolveResult:
    """Build and solve the MILP of ``p`` within ``time_limit`` wall seconds, build time included.

    The model is built here, and the warm start checked against its rows here, before any solver
    runs: ``start``, else the first of ``starts`` (schedules, or an iterable that makes them as it goes,
    within the time limit) that satisfies every row (:func:`pick_start`). A start that does is a solution
    of the model, returned (``status`` :data:`START_STATUS`) whenever the solver ends with nothing of its
    own, also when it is stopped at the deadline or crashes.

    The solve runs in a forked child process (``isolate``, default) that inherits the built model. CBC
    (as bundled with python-mip 2.0) can abort inside branch-and-bound ("double free or corruption" in
    ``babExecuteSearchAndPostprocess``) and its crash handler then deadlocks instead of exiting; and its
    ``max_seconds`` does not bound the root LP, preprocessing or cut generation, so a solve can overrun
    its limit many times over. The child gives the solver what is left of the limit; the parent stops it
    ``KILL_GRACE_S`` after the deadline. A child stopped so reports ``status="time limit"`` with no
    schedule unless the start is a solution (CBC's incumbent and progress callbacks crash this CBC
    build, so a solution found before the stop cannot be streamed out); a child that died reports
    ``status="crashed"``. Where ``fork`` is unavailable the solve runs in-process and the limit is only
    CBC's own.
    """
    check_backend(build_options.get("solver", "cbc"))
    t0 = time.monotonic()
    deadline = None if time_limit is None else t0 + max(float(time_limit), 0.0)
    sm = build_model(p, **build_options)
    if not build_options.get("relax"):
        start = pick_start(sm, [start] if start is not None else starts)
    if not isolate or "fork" not in mp.get_all_start_methods():
        res = solve(sm, time_limit=time_limit, start=start, deadline=deadline)
        res.elapsed_s = time.monotonic() - t0
        return res
    if deadline is not None and deadline - time.monotonic() < MIN_SOLVE_S:
        res = start_result(sm, start)          # no time left to search: the start if it is a solution
        res.elapsed_s = time.monotonic() - t0
        return res
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    t1 = time.monotonic()
    proc = ctx.Process(target=_solve_child, args=(send, sm, deadline, start), daemon=True)
    proc.start()
    send.close()
    stop_at = (deadline + KILL_GRACE_S if deadline is not None
               else t0 + NO_LIMIT_WAIT_S + 0.05 * len(p.candidates) * p.T / 100)
    res: SolveResult | None = None
    died = False
    try:
        wait = stop_at - time.monotonic()
        if wait > 0 and recv.poll(wait):
            res = recv.recv()
    except (EOFError, OSError):
        died = True                           # the child exited without a result: it crashed
    finally:
        if res is not None:
            proc.join(timeout=1.0)
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=1.0)
        recv.close()
    if res is None:
        res = start_result(sm, start, solve_s=time.monotonic() - t1)
        if res.schedule is None:
            res.status = "crashed" if died or deadline is None else TIME_LIMIT_STATUS
    elif res.schedule is None and res.status.startswith("error") and sm.start_note == START_SATISFIES:
        res = start_result(sm, start, solve_s=res.solve_s)
    res.elapsed_s = time.monotonic() - t0
    return res


def _solve_child(conn: Any, sm: StrModel, deadline: float | None, start: Schedule | None) -> None:
    try:
        conn.send(solve(sm, start=start, deadline=deadline))
    except BaseException as e:      # report, never hang the parent
        conn.send(SolveResult(f"error: {type(e).__name__}: {e}", None, None, None, 0.0, None, sm.num_vars,
                              sm.num_constraints, sm.build_s, start_note=sm.start_note))
    finally:
        conn.close()
