"""The ``approx`` portfolio (and the ``milp`` / ``greedy`` STR planners that share its steps): heuristic
starts, the STR LP relaxation + source tracing on the (coarsened) planning problem, a full-graph polish,
and the MILP where it pays: exact on small graphs, a fallback where no start fits on large ones.

:func:`solve` is what :func:`hybridmem.solvers.plan` calls for ``approx``, ``milp`` and ``greedy``; every
candidate plan is judged by the simulator on the full graph (:class:`Pool`), and the winner's simulation
is kept with it so that the entry point need not replay it again.
"""
from __future__ import annotations

import itertools
import time
from typing import Any

from hybridmem.errors import BudgetInfeasibleError
from hybridmem.graph.ir import Graph
from hybridmem.graph.plan import Plan
from hybridmem.graph.simulate import min_feasible_budget, simulate
from hybridmem.graph.units import fmt_bytes

from . import lp as lp_relaxation
from . import coarsen, milp, relax
from ._common import Problem, build_problem, make_plan, memory_floor, planning_problem, schedule_to_actions
from .baselines import NO_BUDGET, chen_plan, dtr_plan, numpy_victims, vdnn_plan
from .bound import lower_bound
from .relax import schedule_of_actions

DEFAULT_MILP_TIME_LIMIT = 60.0
STAGE_START_S = 2.0        # seconds, at most, to make the MILP's warm start satisfy its stage link rows
MILP_FALLBACK_S = 30.0     # approx without a time limit, no plan found on a large graph: the MILP's seconds
EXACT_SHARE = 0.5          # of approx's time after its heuristic starts, kept for its exact MILP (small graphs)
EXACT_IMPROVE_S = 5.0      # approx without a time limit: the exact MILP's seconds when a plan is in hand
MIN_EXACT_S = 0.3          # seconds left below which approx does not start its exact MILP
SHRINK_ATTEMPTS = 4
EARLY_POLISH_SHARE = 0.6   # large graphs: of the time left after the starts, for polishing the best of them

# ---- the STR planners ----------------------------------------------------------------------------
DEFAULT_TIME = {"approx": 24.0, "greedy": 16.0}


class _Pool:
    """The best plan seen so far under the simulator on the full graph, and the lowest budget any
    start reached (a start whose plan was valid but over this budget: its peak is a budget it fits)."""

    def __init__(self, graph: Graph, budget: int, model: Any):
        self.graph, self.budget, self.model = graph, budget, model
        self.best: tuple[float, Plan | None, Any, str] = (float("inf"), None, None, "")
        self.reached: tuple[int, str] | None = None
        self.tried: list[str] = []
        self.exact: dict[str, Any] = {}

    def offer(self, name: str, plan: Plan) -> float | None:
        """Simulate ``plan``; keep it if it fits and is the fastest yet. Its time if it fits, else None."""
        res = simulate(self.graph, plan, device=self.model, budget=NO_BUDGET, strict=False)
        if res.violations:
            return None
        if res.peak_bytes > self.budget:
            self.note_reached(int(res.peak_bytes), name)
            return None
        if res.time_s < self.best[0] - 1e-12:
            self.best = (res.time_s, plan, res, name)
        return float(res.time_s)

    def note_reached(self, peak: int | None, name: str) -> None:
        if peak is not None and peak > self.budget and (self.reached is None or peak < self.reached[0]):
            self.reached = (int(peak), name)


def _seed(pool: _Pool, fine: Problem) -> list[tuple[float, str, Any]]:
    """The cheap heuristic starts on the full graph, each judged by the simulator: the DTR replay (with
    the online scorer's victim choice, as the ``dtr`` baseline, and with plain greedy), Chen's sqrt(n)
    checkpointing, vDNN's swaps and Capuchin's construction. Each costs a few simulations (Capuchin's a
    few hundred realisations on the gap model); together they make the portfolio never worse than
    these baselines, whatever happens to the LP later, and even when the time limit is short (they are
    what such a plan falls back on). Returns the starts for the polish, as
    ``(simulated seconds or inf, name, actions or GapPlanner)``."""
    budget = pool.budget
    out: list[tuple[float, str, Any]] = []
    for name, make in (("dtr", lambda: dtr_plan(fine, budget)),
                       ("dtr-greedy", lambda: dtr_plan(fine, budget, numpy_victims)),
                       ("chen", lambda: chen_plan(fine, budget)),
                       ("swap-vdnn", lambda: vdnn_plan(fine, budget))):
        pool.tried.append(name)
        try:
            plan = make()
        except BudgetInfeasibleError as e:
            pool.note_reached(e.minimum_bytes, name)
            continue
        t = pool.offer(name, plan)
        if t is not None:
            out.append((t, name, plan.actions))
    gp = relax.GapPlanner(fine)
    r, swapped, recomputed = gp.capuchin_fill()
    pool.tried.append("capuchin")
    if gp.feasible(r):
        plan = make_plan(fine, schedule_to_actions(fine, gp.schedule(r)), "capuchin",
                         {"swapped_gaps": swapped, "recomputed_gaps": recomputed})
        t = pool.offer("capuchin", plan)
        out.append((float("inf") if t is None else t, "capuchin", gp))
    else:
        out.append((float("inf"), "capuchin", gp))          # the polish repairs what is left over
    return out


RECOMPUTE_LP_SHARE = 0.35   # of the time left after the seeds, at most, for the recompute-only LP start
RECOMPUTE_LP_GATE = 1.25    # rounded only if its LP overhead is below this times the best start's overhead
RECOMPUTE_LP_MIN_S = 1.0  # seconds, at least, for it (building its model alone takes about a second on ResNet-152)


def _recompute_start(pool: _Pool, p: Problem, seeds: list[tuple[float, str, Any]], time_limit: float | None,
                     notes: list[str]) -> None:
    """Checkmate's recompute-only LP relaxation on the planning problem, rounded by dropped mass
    (:meth:`solvers.relax.GapPlanner.load_lp` ``rule="drop"``; the repair may add swaps). Where recompute
    is what pays (a slow host link, cheap-to-recompute tensors: MobileNet on v100) the STR LP spreads
    its mass over swaps and recomputes that its rounding cannot follow, and this plan (one LP, no
    branching) is as fast as Checkmate's MILP or faster. Offered to ``pool`` and added to ``seeds`` for
    the polish. Not rounded when the LP value says recompute-only plans are far slower than the best
    start (ResNets: the time goes to the polish). Its LP value bounds recompute-only plans only: it is
    not reported as the plan's bound."""
    t0 = time.perf_counter()
    pool.tried.append("recompute-lp")
    try:
        sm = milp.build_model(p, relax=True, swap=False, compact=relax.is_large(p))
        left = None if time_limit is None else max(time_limit - (time.perf_counter() - t0), 0.05)
        res = milp.solve(sm, relax=True, time_limit=left)
        if res.objective is None or res.status != "optimal":
            notes.append(f"recompute-only LP start: LP {res.status}")
            return
        best = pool.best[0]
        lower = p.compute_s + max(res.objective, 0.0)
        if best < float("inf") and lower - p.compute_s > RECOMPUTE_LP_GATE * (best - p.compute_s):
            return                 # recompute-only plans cannot come near the best start: not worth rounding
        left = 8.0 if time_limit is None else max(time_limit - (time.perf_counter() - t0), 0.1)
        sched, info = relax.round_schedule(p, lp_relaxation.lp_values(sm), time_budget=left, rules=("lp-drop",),
                                           variants=({}, {"allow_swap": False}))
    except Exception as e:           # an extra start: the portfolio goes on without it
        notes.append(f"recompute-only LP start failed: {type(e).__name__}: {e}")
        return
    if sched is None:
        notes.append(f"recompute-only LP start: {info.get('rounding')}")
        return
    plan = make_plan(p, schedule_to_actions(p, sched), "recompute-lp",
                     {"recompute_lp_bound_s": lower, "rounding": info.get("rounding")})
    t = pool.offer("recompute-lp", plan)
    seeds.append((float("inf") if t is None else t, "recompute-lp", plan.actions))


def solve(graph: Graph, budget: int, model: Any, solver: str, time_limit: float | None, verbose: bool,
          options: dict[str, Any]) -> tuple[Plan, Any]:
    """A portfolio on the full graph, in STR's spirit (the LP rounding warm-started and polished from
    heuristic plans); the fastest plan under the simulator wins.

    0. Cheap starts (:func:`_seed`: DTR replays, Chen, vDNN, Capuchin's construction) are planned on the
       full graph and kept if they fit, whatever the later steps do (they run even when the time limit is
       short: a plan is then never slower than these baselines'); then the rounding of the recompute-only
       LP (:func:`_recompute_start`, not for greedy; option ``recompute_lp=False`` turns it off).
    1. STR on the planning problem (coarsened above the threshold). If the full-graph simulation finds the
       plan over budget (the coarse model is conservative but not exact), plan again for a budget smaller
       by the excess.
    2. Polish on the full graph (approx/greedy, and milp on coarsened graphs): the STR plan, the two best
       cheap starts and Capuchin's construction, each repaired where it does not fit and
       improved gap by gap, then by exchanges (:func:`solvers.relax.refine`).

    ``plan.info["plan_from"]`` names the winner (``str``, a start such as ``dtr`` or ``capuchin``, or
    ``polish:<start>+improve|+exchange``); ``phases_s`` has the wall seconds of each phase.

    ``time_limit`` (default ``DEFAULT_TIME``) bounds the whole for approx/greedy, as wall time; for milp
    it is the MILP's own limit. Returns the plan and its simulation on the full graph (it fits ``budget``).
    """
    t0 = time.perf_counter()
    total = time_limit if time_limit is not None else DEFAULT_TIME.get(solver)
    # the plan's final simulation and annotation come after the deadline: keep a little for them
    deadline = None if total is None else t0 + max(total * 0.95 - 0.3, 0.5 * total)
    inner = budget
    notes: list[str] = []
    p = planning_problem(graph, inner, model, **options)
    coarse = p.T != graph.num_stages
    minimum = _fine_floor(graph, p, model, options)
    pool = _Pool(graph, budget, model)
    fine = p if not coarse else build_problem(graph, budget, model, min_bytes=options.get("min_bytes"))
    exact = solver == "approx" and options.get("exact", not coarse and not relax.is_large(fine))
    str_share = 0.45 if solver != "milp" else 1.0
    lp_job = None
    if solver != "greedy" and relax.is_large(p) and options.get("background_lp", True):
        # the STR LP of the first attempt solves in a child process while the starts are planned here
        lp_s = None if deadline is None or (solver == "milp" and time_limit is None) else \
            (deadline - time.perf_counter()) * str_share
        lp_job = lp_relaxation.Background(p, lp_s, verbose=verbose, compact=True)
    seeds = _seed(pool, fine) if options.get("seed", True) else []
    t_starts = time.perf_counter()
    stop = deadline                       # for the phases before the exact MILP, which gets the rest
    if exact and deadline is not None:
        reserve = EXACT_SHARE * (deadline - time.perf_counter())
        stop = deadline - (min(reserve, EXACT_IMPROVE_S) if time_limit is None else reserve)
    polished: dict[str, Any] = {}
    if seeds and solver != "milp" and relax.is_large(fine) and options.get("early_polish", True):
        # the best start (Capuchin's construction where none fits) polished now: on large graphs that is
        # most often the plan that wins, and a short time limit then ends with it rather than a raw start
        left = options.get("polish_s", 12.0) * EARLY_POLISH_SHARE
        if stop is not None:
            left = min(left, (stop - time.perf_counter()) * EARLY_POLISH_SHARE)
        _polish(pool, fine, None, seeds, solver, time.perf_counter() + left, options, best_of=1, planners=polished,
                repair=False)
    t_early = time.perf_counter()
    if solver != "greedy" and options.get("recompute_lp", True):
        left = None if stop is None else (stop - time.perf_counter()) * RECOMPUTE_LP_SHARE
        if left is None or left >= RECOMPUTE_LP_MIN_S:
            _recompute_start(pool, p, seeds, left, notes)
    t_seed = time.perf_counter()
    str_plan: Plan | None = None
    for attempt in range(SHRINK_ATTEMPTS):
        if inner < int(p.min_bytes().max()):
            break
        left = None if stop is None else (stop - time.perf_counter()) * str_share
        if solver == "milp":
            left = time_limit        # the MILP's own limit, whatever the starts took (None: its default)
        if left is not None and left < 0.3:
            notes.append(f"no time left for {solver} on the {'coarse ' if coarse else ''}problem")
            break
        seed_plan = pool.best[1]
        out = _solve_problem(p, solver, left, verbose, options, None if seed_plan is None else seed_plan.actions,
                             lp_job if attempt == 0 else None,
                             _more_starts(fine, seeds, seed_plan) if solver == "milp" else None)
        if out is None:
            notes.append(f"{solver} found no plan on the {'coarse ' if coarse else ''}problem at {inner} B")
            break
        res = simulate(graph, out, device=model, budget=None, strict=False)
        if not res.violations and res.peak_bytes <= budget:
            if attempt:
                out.info["planning_budget_bytes"] = inner
                notes.append(f"planned for {inner} B so that the full graph fits {budget} B")
            str_plan = out
            if res.time_s <= pool.best[0] * (1 + 1e-9):      # ties go to the STR plan (MILP facts in its info)
                pool.best = (res.time_s, out, res, "str")
            break
        str_plan = str_plan or out          # over budget on the full graph: still a start for the repair
        if not res.violations:
            pool.note_reached(int(res.peak_bytes), "str")
        last_err = res.violations[0] if res.violations else None
        notes.append(f"attempt {attempt + 1}: " + (str(last_err) if last_err else f"peak {res.peak_bytes} B"))
        if res.violations and not any("exceeds the budget" in v.reason for v in res.violations):
            break
        inner -= max(int(res.peak_bytes) - budget, budget // 200) + 1
        p = planning_problem(graph, inner, model, **options)
    if lp_job is not None:
        lp_job.close()                     # not waited for (no time, or no attempt): stop the child
    t_str = time.perf_counter()
    polish = options.get("polish", solver != "milp" or coarse)
    best = pool.best
    if best[2] is not None and best[0] <= float(best[2].compute_s) * (1 + 1e-12):
        polish = False                     # nothing to gain: the step already runs at compute speed
    if polish:
        # the MILP's time limit is its own: the polish after it gets its usual share
        # the starts polished early go on from where that polish left them
        again = [(t, name, polished.get(name, arg)) for t, name, arg in seeds]
        _polish(pool, fine, str_plan, again, solver, None if solver == "milp" else stop, options)
    t_polish = time.perf_counter()
    if exact:
        _exact_start(pool, fine, deadline, verbose, options, notes, seeds, capped=time_limit is None)
    elif solver == "approx" and pool.best[1] is None and time_limit is None and options.get("milp_fallback", True):
        _milp_fallback(pool, p, str_plan, seeds, verbose, options, notes)
    _, out, res, source = pool.best
    phases = (f"setup {t_seed - t0:.2f} (seeds {','.join(pool.tried)}: starts {t_starts - t0:.2f}, "
              f"their polish {t_early - t_starts:.2f}, recompute-only LP {t_seed - t_early:.2f}), "
              f"{solver} {t_str - t_seed:.2f}, "
              f"polish {t_polish - t_str:.2f}, exact milp {time.perf_counter() - t_polish:.2f}")
    if out is None:
        upper, by = pool.reached if pool.reached else (graph.peak_bytes(), "keep-all")
        err = BudgetInfeasibleError(
            f"solver {solver!r} found no plan within {fmt_bytes(budget)} ({budget} B)"
            + (f": at least {fmt_bytes(minimum)} ({minimum} B) is needed with every saved activation evicted "
               "where it is not read" if budget < minimum else
               f"; the least budget with a plan lies between {fmt_bytes(minimum)} ({minimum} B, the memory floor: "
               f"no plan fits less) and {fmt_bytes(upper)} ({upper} B, the least peak of a plan found, by {by}); "
               "budget='min' (`hybridmem plan --budget min`) finds it")
            + (f"; {'; '.join(notes)}" if notes else ""), minimum)
        # minimum_bytes stays a lower bound; what a start reached is an upper bound on the least budget
        err.reached_bytes = pool.reached[0] if pool.reached else None  # type: ignore[attr-defined]
        raise err
    if out is not str_plan:
        # a start or polish won: its own info (a baseline's, or the STR plan's it was refined from) plus
        # the STR facts that still hold (the LP bound is a bound within the STR model)
        info = dict(out.info)
        if str_plan is not None:
            for k in ("lp_bound_s", "lp_status", "lp_s", "lp_vars", "lp_constraints", "status", "milp_vars",
                      "milp_constraints", "milp_s", "objective_s", "bound_s", "mip_gap", "compact", "warm_start"):
                if k in str_plan.info:
                    info.setdefault(k, str_plan.info[k])
        out.info = info
    out.solver = solver
    if notes:
        out.info["notes"] = "; ".join(notes)
    out.info["plan_from"] = source
    out.info.update(pool.exact)
    out.info["phases_s"] = phases
    out.info["coarse_stages"] = p.T if coarse else None
    out.info["candidates"] = len(p.candidates)
    return out, res


def _fine_floor(graph: Graph, p: Problem, model: Any, options: dict[str, Any]) -> int:
    """The memory floor of the full graph (a coarse problem's own floor is higher than the graph's)."""
    if p.T == graph.num_stages:
        return max(int(p.min_bytes().max()), min_feasible_budget(graph))
    return memory_floor(graph, model, options.get("min_bytes"))


def _polish(pool: _Pool, fine: Problem, str_plan: Plan | None, seeds: list[tuple[float, str, Any]], solver: str,
            deadline: float | None, options: dict[str, Any], best_of: int = 2,
            planners: dict[str, Any] | None = None, repair: bool = True) -> None:
    """Full-graph polish: starts (the STR plan, the ``best_of`` best seeds, Capuchin's construction) repaired
    where they do not fit and improved gap by gap (:func:`solvers.relax.refine`), best start first;
    every result is offered to ``pool``; ``planners`` gets each start's planner as the polish left it.
    Without ``repair`` STR and Capuchin are added only where no start fits."""
    left = options.get("polish_s", 12.0)
    if deadline is not None:
        left = min(left, max(deadline - time.perf_counter(), 0.0))
    if left <= 0.1:
        return
    ranked = sorted(seeds, key=lambda s: s[0])
    if str_plan is not None:
        t_str = pool.best[0] if pool.best[3] == "str" else float("inf")
        ranked.insert(0, (t_str, "str", str_plan.actions))
        ranked.sort(key=lambda s: s[0])
    fitting = [s for s in ranked if s[0] < float("inf")]
    starts = [(name, arg) for _, name, arg in fitting[:best_of]]
    for _, name, arg in ranked:
        if name in ("str", "capuchin") and name not in [n for n, _ in starts] and (repair or not starts):
            starts.append((name, arg))     # STR and Capuchin are repaired even when they do not fit
    info = dict(str_plan.info) if str_plan is not None else {}
    # each result is written as a plan and simulated after refine returns: keep time for that
    for name, sched, _ in relax.refine(fine, starts, time_budget=0.85 * left, keep_improved_only=True,
                                       planners=planners):
        cand = make_plan(fine, schedule_to_actions(fine, sched), solver, dict(info))
        pool.offer(f"polish:{name}", cand)


def _exact_start(pool: _Pool, fine: Problem, deadline: float | None, verbose: bool, options: dict[str, Any],
                 notes: list[str], seeds: list[tuple[float, str, Any]], capped: bool = False) -> None:
    """The exact MILP on a small uncoarsened problem, warm-started from the best plan so far (and the other
    starts, as the ``milp`` solver is), with the time left: on such graphs ``approx`` finds a plan wherever
    ``milp`` does, and one as fast when the solve ends. Past ``milp.FIFO_MAX_STAGES`` stages it solves
    twice, half the time each, the second from the best plan after the first. With ``capped`` (no time
    limit given) and a plan in hand, it gets at most ``EXACT_IMPROVE_S`` (none in hand: the MILP's default
    limit). Skipped when the best plan already runs at the valid lower bound. Its result is
    offered to ``pool``; ``pool.exact`` records the MILP's status and whether it improved on the rest."""
    best_s, best_plan, _, _ = pool.best
    if best_plan is not None and best_s <= lower_bound(fine.graph, fine.budget, fine.model).time_s * (1 + 1e-9):
        return                                  # nothing can be faster
    left = None if deadline is None else deadline - time.perf_counter()
    if capped and best_plan is not None:
        left = EXACT_IMPROVE_S if left is None else min(left, EXACT_IMPROVE_S)
    if left is not None and left < MIN_EXACT_S:
        notes.append("no time left for the exact MILP")
        return
    pool.tried.append("milp")
    t0 = time.perf_counter()
    # the warm starts the milp solver gets (_solve_milp): the best plan so far, then the other starts; where
    # the MILP's link rows are per stage (past milp.FIFO_MAX_STAGES), each is first made to satisfy them
    more = _more_starts(fine, seeds, best_plan)
    opts = {**options, "compact": False}
    # Past milp.FIFO_MAX_STAGES the model's link rows are conservative: a longer solve can end on a solution
    # the simulator times slower than one it passed on its way (CBC keeps no pool to read them back from).
    # Two solves, the second from the best plan after the first, give the simulator two to choose from.
    halves = 2 if (fine.T > milp.FIFO_MAX_STAGES and left is not None and left >= 4 * MIN_EXACT_S) else 1
    info: dict[str, Any] = {}
    for i in range(halves):
        limit = None if left is None else left / halves if i == 0 else left - (time.perf_counter() - t0)
        start = pool.best[1]
        res = _solve_milp(fine, None, None, limit, verbose, opts, None if start is None else start.actions, more)
        if res is None:
            info.setdefault("exact_status", "no solution")
            continue
        info["exact_status"] = res.info.get("status")
        pool.offer("milp", make_plan(fine, res.actions, "approx", {}))
        if info["exact_status"] == "optimal":
            break
    info["exact_s"] = round(time.perf_counter() - t0, 4)
    info["exact_improved"] = pool.best[3] == "milp" and pool.best[0] < best_s - 1e-12
    pool.exact = info


def _milp_fallback(pool: _Pool, p: Problem, str_plan: Plan | None, seeds: list[tuple[float, str, Any]],
                   verbose: bool, options: dict[str, Any], notes: list[str]) -> None:
    """Where no start fits (large graphs, no exact MILP in the portfolio): the MILP on the planning
    problem for ``MILP_FALLBACK_S``, its warm start the best start that does not fit, made to satisfy the
    MILP's rows and repaired by regenerating bytes where memory is over (:func:`_solve_milp`). Its plan,
    if any, is offered to ``pool`` as ``milp-fallback``."""
    start = str_plan.actions if str_plan is not None else next(
        (arg for _, _, arg in seeds if isinstance(arg, list)), None)
    pool.tried.append("milp-fallback")
    out = _solve_milp(p, None, None, MILP_FALLBACK_S, verbose, options, start)
    if out is None or pool.offer("milp-fallback", out) is None:
        notes.append(f"the MILP fallback found no plan ({out.info.get('status') if out else 'no solution'})")


def _unfit_start(fine: Problem, seeds: list[tuple[float, str, Any]]) -> list | None:
    """The actions of the best start that does not fit (Capuchin's construction, left over budget), for
    a MILP that has no plan to start from: made to satisfy its rows and repaired, it may fit."""
    for _, _, arg in sorted(seeds, key=lambda s: s[0]):
        if isinstance(arg, relax.GapPlanner):
            try:
                return schedule_to_actions(fine, arg.schedule(arg.realize()))
            except ValueError:         # a polished construction whose schedule the plan rules refuse
                return None
        if isinstance(arg, list):
            return arg
    return None


def _more_starts(fine: Problem, seeds: list[tuple[float, str, Any]], best: Plan | None) -> list[list]:
    """Further plans a MILP may start from, after the rounded LP schedule and the best plan: the other
    starts that fit, fastest first (a recompute-only one such as Chen's needs no link rows at all), then
    the best one that does not fit (:func:`_unfit_start`)."""
    out = [arg for t, _, arg in sorted(seeds, key=lambda s: s[0])
           if t < float("inf") and isinstance(arg, list) and (best is None or arg is not best.actions)]
    unfit = _unfit_start(fine, seeds)
    if unfit is not None and all(unfit is not a for a in out):
        out.append(unfit)
    return out


def _solve_problem(p: Problem, solver: str, time_limit: float | None, verbose: bool,
                   options: dict[str, Any], seed_actions: list | None = None,
                   lp_job: lp_relaxation.Background | None = None, more_starts: list | None = None) -> Plan | None:
    """The STR planner on ``p``; for the MILP, ``seed_actions`` (the best start's plan) and then
    ``more_starts`` (other plans' actions) are its warm starts where the LP rounding gives none that
    satisfies its rows. ``lp_job``: the LP of ``p``, started in the background."""
    if solver == "greedy":
        sched, info = relax.round_schedule(p, None, time_budget=time_limit or 10.0)
        return None if sched is None else make_plan(p, schedule_to_actions(p, sched), "greedy", info)
    sched, info = relax.solve_relaxed(p, time_limit=time_limit, verbose=verbose, lp_job=lp_job)
    approx = None if sched is None else make_plan(p, schedule_to_actions(p, sched), "approx", info)
    if solver == "approx":
        return approx
    return _solve_milp(p, approx, sched, time_limit, verbose, options, seed_actions, more_starts)


START_SHARE = 0.4          # of the MILP's time limit, at most, for making starts that satisfy its rows


def _finer(p: Problem, options: dict[str, Any]) -> Problem:
    """``p``'s graph coarsened to twice ``p``'s stages (the graph itself past half of its stages)."""
    g, min_bytes = p.graph, options.get("min_bytes")
    if 2 * p.T >= g.num_stages:
        return build_problem(g, p.budget, p.model, min_bytes=min_bytes)
    return build_problem(g, p.budget, p.model, groups=coarsen.coarsen_groups(g, 2 * p.T), bundle=True,
                         min_bytes=min_bytes)


def _solve_milp(p: Problem, approx: Plan | None, start: Any, time_limit: float | None, verbose: bool,
                options: dict[str, Any], seed_actions: list | None = None,
                more_starts: list | None = None) -> Plan | None:
    limit = DEFAULT_MILP_TIME_LIMIT if time_limit is None else time_limit
    t0 = time.perf_counter()

    def compact_of(q: Problem) -> bool:
        return options.get("compact", relax.is_large(q))
    compact = compact_of(p)
    # starts to try, best first: the rounded LP schedule, the best plan so far, the other plans (those
    # that fit, then the best that does not): the model is built and each start checked against its rows
    # before CBC runs, and the first that satisfies them all is the one CBC gets (and the solution
    # returned if CBC ends with none of its own)
    tries = [a for a in (schedule_to_actions(p, start) if start is not None else None, seed_actions,
                         *(more_starts or ())) if a is not None]
    refined = ""
    if tries and milp.default_link(p, compact) == "stage":
        # the rounding queues copies FIFO, which the stage link rows refuse: starts CBC keeps
        end = t0 + min(3 * STAGE_START_S, START_SHARE * limit)

        def starts(q: Problem, stop: float):
            for i, actions in enumerate(tries):
                # the first two get a few tenths of a second at least, even once the others have taken theirs
                left = max((stop - time.perf_counter()) / (len(tries) - i), min(0.5, 0.05 * limit) if i < 2 else 0.0)
                yield relax.stage_link_start(q, actions, compact_of(q), time_budget=left) if left > 0.05 else None
        made = starts(p, end)
        first = next((s_ for s_ in made if s_ is not None), None)
        coarse = p
        while first is None and p.T < p.graph.num_stages:
            # No start satisfies the coarse model's rows: its stages hold whole runs of the graph's and its
            # candidates are bundles, so at low budgets it can refuse every plan the graph admits. A
            # finer coarsening is less conservative; the MILP is posed there once a start fits it.
            left = t0 + START_SHARE * limit - time.perf_counter()
            if left < 0.2:
                break
            p = _finer(p, options)
            made = starts(p, time.perf_counter() + left)
            first = next((s_ for s_ in made if s_ is not None), None)
        if p is not coarse:
            if first is None:
                # none fits any: the MILP searches on the coarse problem, the smallest model
                refined = (f"no start satisfies the MILP's rows on {coarse.T} to {p.T} stages: it searches on "
                           f"{coarse.T} without one")
                p, made = coarse, iter(())
            else:
                refined = (f"no start satisfies the MILP's rows on {coarse.T} stages: the MILP is posed on "
                           f"{p.T} stages, where one does")
                start = None                  # the rounded schedule is one of the coarse problem's
        candidates: Any = itertools.chain([] if first is None else [first], made,
                                          [] if start is None else [start])
        compact = compact_of(p)
    elif tries and start is None and p.T == p.graph.num_stages:
        candidates = [schedule_of_actions(p, tries[0])]   # an uncoarsened problem: the plan is a schedule of it
    else:
        candidates = [start]
    res = milp.solve_problem(p, time_limit=limit - (time.perf_counter() - t0), starts=candidates,
                             isolate=options.get("isolate", True), solver=options.get("solver_backend", "cbc"),
                             verbose=verbose, compact=compact)
    info = milp.result_info(p, res, milp_s=round(time.perf_counter() - t0, 4), compact=relax.is_large(p))
    if refined:
        info["milp_stages"] = p.T
        info["milp_refined"] = refined
    if res.bound is not None:
        info["mip_gap"] = (res.objective - res.bound) / (p.compute_s + res.objective) if res.objective is not None else None
    if approx is not None:
        for k in ("lp_bound_s",):
            if k in approx.info:
                info[k] = approx.info[k]
    if res.schedule is None:
        if approx is None:
            return None
        approx.solver = "milp"
        approx.info.update(info)
        why = (f"the MILP solver crashed or hung (status {res.status})" if res.status.startswith(("crashed", "error"))
               else f"the MILP found no solution within {limit:g} s (status {res.status}"
               + (f"; {res.start_note.split(' (')[0]}: see warm_start" if "breaks" in res.start_note else "") + ")")
        approx.info["fallback"] = f"{why}: this is the approx plan"
        return approx
    try:
        out = make_plan(p, schedule_to_actions(p, res.schedule), "milp", info)
    except ValueError as e:
        out = None
        info["fallback"] = f"the MILP solution could not be written as a plan ({e}): this is the approx plan"
    if out is not None and approx is not None:
        a = simulate(p.graph, approx, device=p.model, budget=None, strict=False)
        b = simulate(p.graph, out, device=p.model, budget=None, strict=False)
        ok_a = not a.violations and a.peak_bytes <= p.budget
        ok_b = not b.violations and b.peak_bytes <= p.budget
        if ok_a and (not ok_b or a.time_s < b.time_s - 1e-12):
            why = "the simulator rejects the MILP plan" if not ok_b else \
                "the simulator times the approx plan faster (the MILP's link model is stricter)"
            approx.solver = "milp"
            approx.info.update(info)
            approx.info["fallback"] = f"{why}: this is the approx plan"
            return approx
    if out is None:
        if approx is None:
            return None
        approx.solver = "milp"
        approx.info.update(info)
        return approx
    return out
