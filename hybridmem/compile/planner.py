"""A compiled region's planning: its joint graph turned into counts, a plan under its share of the budget, and
the partition's tags (:class:`Planner`, which the backend makes once with its options, its regions' state
and its budget rules)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ..devices import cost_model_for
from ..errors import BudgetInfeasibleError
from ..graph.costs import DeviceModel, copies_overlap
from ..graph.units import fmt_bytes
from ..plugins.compress import codec_seconds
from . import codec_ops, probe
from . import compressed as compressed_mod
from . import solving, tuning
from .copies import cheaper, no_swap, overlap
from .defaults import saved_by_partition
from .joint import concatenates_feature_maps, has_convolution, joint_graph
from .partition import Decisions, apply_plan, decisions
from .partition_peak import realized_peak
from .regions import Key, Regions, reserve
from .scratch import inductor_channels_last, measure_scratch
from .stats import RegionStats
from .variants import Codecs, Planned, Prepared, Variant, codecs_could_pay, recompute_left_s


def _cost_model(device: torch.device, name: str | None, can_swap: bool) -> DeviceModel:
    model = cost_model_for(device, name)
    return model if can_swap else no_swap(model)


@dataclass(eq=False)
class _Counts:
    """A region's joint graph as counted for planning (:meth:`Planner._count_region`)."""

    gm: fx.GraphModule
    joint_inputs: Any
    kwargs: dict[str, Any]
    key: Key
    dev: torch.device
    examples: list[Any] | None   # the call's inputs, which the compress probe measures on
    model: Any                   # the cost model it is planned with
    forward: list[fx.Node]
    conv: bool
    jg: Any                      # every forward value the backward reads held from the forward
    part: Any                    # the partition PyTorch makes; None with the eager compiler
    probe_s: float
    scratch_s: float


@dataclass
class _Share:
    """A region's share of the budget (:meth:`Planner._share_of`)."""

    key: tuple[str, ...]
    name: str
    budget: int                  # what the region is planned at (above the budget while earlier ones make room)
    outside: int                 # held outside it: the optimizer's state, earlier regions, the other runs
    share: int                   # budget - outside
    margin: int                  # left free for Inductor's buffers, ``extra`` included
    extra: int                   # of the margin, what trial runs of earlier plans held beyond their share
    slack: int                   # how far beyond the share a plan may go (the run at compile time checks it)
    room: int                    # left where its backward begins for the regions compiled after it
    others: int                  # the other runs in flight
    fixed: int
    grads: int
    base_s: float                # the step's time without evicting anything


def _floor(v: Variant, model: Any, others: int) -> int:
    """The least budget any plan of count ``v`` may fit (its partition's too, with no other runs in flight)."""
    from .. import solvers
    f = solvers.memory_floor(v.jg.graph, model)
    if v.part is not None and not others:
        f = min(f, solvers.memory_floor(v.part.graph, model))
    return f


class _Tries:
    """The counts of one region tried and what came of them. What compresses is measured once, where first
    asked; that time, and the compressed counts' planning, count as the codec probe's."""

    def __init__(self, planner: "Planner", c: _Counts, s: _Share) -> None:
        self.planner, self.c, self.s = planner, c, s
        self.plain = Variant("", c.jg, c.part)
        self.variants: list[Variant] = [self.plain]
        self.planned: list[Planned] = []
        self.failures: list[BudgetInfeasibleError] = []
        self.notes: list[str] = []
        self.codec_s = 0.0
        self.lazy: dict[str, Any] = {}           # "codecs", "every": made where first asked for

    def codecs(self) -> Codecs | None:
        """What compresses (measured once, where compress is allowed and the budget binds)."""
        if "codecs" not in self.lazy:
            t1 = time.perf_counter()
            c = self.c
            self.lazy["codecs"] = (self.planner._codec_choices(c, self.notes)
                                   if "compress" in self.planner.policies else None)
            self.codec_s += time.perf_counter() - t1
        return self.lazy["codecs"]

    def every(self) -> Variant | None:
        """The counts with every candidate compressed (made once, where asked for)."""
        if "every" not in self.lazy:
            t1 = time.perf_counter()
            codecs = self.codecs()
            self.lazy["every"] = (codecs.variant("compress all", self.c.jg, self.c.part, lambda j, order: order)
                                  if codecs else None)
            self.codec_s += time.perf_counter() - t1
        return self.lazy["every"]

    def attempt(self, v: Variant | None, least: bool = True) -> Planned | None:
        """Plan count ``v``; ``least``: where it has no plan, find the least budget it has one for (a
        bisection of solves) for the error, which only a count that may be the last one tried needs."""
        if v is None or any(v is w for w in self.variants[1:]):
            return None
        if v is not self.plain:
            self.variants.append(v)
        c, s = self.c, self.s
        t_v = time.perf_counter()
        try:
            r = self.planner._plan_variant(v, c.gm, c.joint_inputs, c.kwargs, s.share, s.margin, s.others, s.grads,
                                           c.model, s.name, c.dev, least=least)
            self.planned.append(r)
            return r
        except BudgetInfeasibleError as e:
            self.failures.append(e)
            return None
        finally:
            if v is not self.plain:
                self.codec_s += time.perf_counter() - t_v


@dataclass(frozen=True)
class PlanOptions:
    """The backend's options the planner reads (:class:`~hybridmem.compile.backend.CompileBackend`)."""

    policies: tuple[str, ...]
    solver: str
    time_limit: float | None
    compiler: str
    scratch: bool
    cost_model_name: str | None
    hold_outputs: bool
    calls_per_step: int


class Planner:
    """Plans a backend's compiled regions, one joint graph at a time (:meth:`prepare`). ``regions``: the
    backend's regions, which it reads (the budget a region is planned at, what is held outside it, the room
    asked of it) and records each plan in.

    The plan-compile-run loop (:mod:`hybridmem.compile.fit`) reads what the last :meth:`prepare` of a compile
    left: ``margin_now`` and ``slack_now`` (set before any error it raises), ``planned_now`` (the plan taken;
    the loop sets it to None before each compile)."""

    def __init__(self, options: PlanOptions, regions: Regions) -> None:
        self.options = options
        self.policies, self.compiler, self.calls_per_step = options.policies, options.compiler, options.calls_per_step
        self.regions = regions
        self.margin_now = 0                          # what the last plan left free for Inductor's buffers
        self.slack_now = 0                           # ... and how far below nothing it may go (tuning.REPLAN_SLACK)
        self.planned_now: Planned | None = None      # the plan of the compile in progress

    def _solve(self, g: Any, budget: int | str, model: Any) -> Any:
        from .. import solvers
        return solvers.plan(g, budget, device=model, solver=self.options.solver, time_limit=self.options.time_limit)

    def prepare(self, gm: fx.GraphModule, joint_inputs: Any, kwargs: dict[str, Any], key: Key, dev: torch.device,
                examples: list[Any] | None) -> Prepared:
        """Plan the joint graph ``gm`` and tag it; return what the partition's rewrite needs. By step: count
        the region, take its share of the budget, check the floor, plan the counts worth trying, record the
        fastest plan. ``key``: the region's; ``dev``: its device; ``examples``: the call's inputs (None: not
        held)."""
        t0 = time.perf_counter()
        c = self._count_region(gm, joint_inputs, kwargs, key, dev, examples)
        s = self._share_of(c)
        # read by the fit loop (hybridmem.compile.fit) when this compile has no plan
        self.margin_now, self.slack_now = s.margin, s.slack
        if s.room:
            # the regions compiled after it run where its backward begins: their share is left free there (their
            # share holds their own margin: this region's is not counted twice; a margin lowered to find a plan,
            # which its run checks, lowers the room alike)
            for j in (c.jg, c.part):
                if j is not None:
                    reserve(j.graph, s.room - (s.margin - s.extra))
        tries = _Tries(self, c, s)
        least_plain, least = self._floor_or_raise(c, s, tries)
        self._try_variants(c, s, tries, least_plain)
        best = self._best_or_raise(c, s, tries)
        return self._record(c, s, tries, best, least, t0)

    def _count_region(self, gm: fx.GraphModule, joint_inputs: Any, kwargs: dict[str, Any], key: Key,
                      dev: torch.device, examples: list[Any] | None) -> _Counts:
        """The region's two counts: every forward value the backward reads held from the forward (the count
        plans are made on first), and the count of the partition PyTorch makes (what it recomputes on its own
        read from its sources): closer to the real peak, tried where the first has no plan
        (:mod:`hybridmem.compile.defaults`)."""
        from torch._functorch import config as fconfig
        from torch._functorch.compile_utils import fx_graph_cse
        from torch._functorch.partitioners import classify_nodes

        can_swap = "swap" in self.policies and dev.type == "cuda"
        model = _cost_model(dev, self.options.cost_model_name, can_swap)
        # the same clean-up the partitioner starts with, so that the tags land on the nodes it keeps
        gm.graph.eliminate_dead_code()
        if fconfig.cse:
            gm.graph = fx_graph_cse(gm.graph)
        gm.recompile()
        nfwd = kwargs["num_fwd_outputs"]
        static_idx = list(kwargs.get("static_lifetime_input_indices") or [])
        info = classify_nodes(gm, static_idx, nfwd)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        out = next(n for n in gm.graph.nodes if n.op == "output")
        forward = [n for n in gm.graph.nodes if info.is_required_fw(n)]
        conv = has_convolution(gm.graph.nodes)
        fuse = self.compiler == "inductor"
        t_probe = time.perf_counter()
        saved = saved_by_partition(gm, joint_inputs, kwargs) if fuse else None
        t_probe = time.perf_counter() - t_probe
        joint = functools.partial(
            joint_graph, gm, forward, [p for i, p in enumerate(placeholders) if i in static_idx],
            [a for a in out.args[0][:nfwd] if isinstance(a, fx.Node)], model,
            name=f"region {len(self.regions.planned()) + 1}", fuse=fuse, fuse_backward=fuse and not conv,
            outputs_held=self.options.hold_outputs)
        jg = joint(saved=None)
        jg_part = joint(saved=saved) if saved is not None else None
        if "recompute" not in self.policies:
            for j in (jg, jg_part):      # no stage may be replayed: the planners keep, swap (or it compresses)
                for stage in (j.graph.stages if j is not None else ()):
                    stage.deterministic = False
        t_scratch = time.perf_counter()
        if self.options.scratch:
            counts = [j for j in (jg, jg_part) if j is not None]
            note = measure_scratch(counts, dev, channels_last=fuse and conv and inductor_channels_last(gm))
            for j in counts:
                j.graph.meta["workspace"] = note
        t_scratch = time.perf_counter() - t_scratch
        return _Counts(gm, joint_inputs, kwargs, key, dev, examples, model, forward, conv, jg, jg_part, t_probe,
                       t_scratch)

    def _share_of(self, c: _Counts) -> _Share:
        """Region ``c.key``'s share of the budget, the margin it leaves for Inductor's buffers, and
        what the other runs in flight hold beside it."""
        key = c.key
        budget = self.regions.budget_for(key, c.dev)
        outside = self.regions.outside(key)
        share = budget - outside
        # the margin scales with the step as it runs: the keep-all peak of the partition PyTorch makes where
        # that count is the lower (MobileNetV2: 40.6 MiB, where the first count's 56 MiB holds every forward
        # value the backward reads from the forward on)
        peak = min(j.graph.peak_bytes() for j in (c.jg, c.part) if j is not None)
        share_free = (tuning.INDUCTOR_MARGIN_CONCAT if c.conv and concatenates_feature_maps(c.gm.graph.nodes)
                      else tuning.INDUCTOR_MARGIN if c.conv else tuning.INDUCTOR_MARGIN_NO_CONV)
        inductor = self.compiler == "inductor"
        # and what a trial run of an earlier plan of this compile held beyond its share (hybridmem.compile.fit)
        r = self.regions[key]
        extra = r.extra
        margin = (int(share_free * peak) if inductor else 0) + extra
        # a count a little above the step as it runs (the partition recomputes some of what it keeps) may be
        # planned a little beyond the share: the run at compile time checks it
        slack = int(tuning.REPLAN_SLACK * peak) if inductor else 0
        order = self.regions.planned()
        name = f"region {order.index(key) + 1 if key in order else len(order) + 1}"
        # each other run in flight (calls_per_step - 1) holds its inputs and parameters, and either what the
        # plan keeps for its backward (before it) or the gradients that backward made (after it)
        others = self.calls_per_step - 1
        g = c.jg.graph
        fixed = g.fixed_bytes()
        grads = sum(t.nbytes for t in g.tensors if t.producer < 0 and t.kind == "param")
        outside += others * (fixed + grads)
        share -= others * (fixed + grads)
        return _Share(key, name, budget, outside, share, margin, extra, slack, r.room, others,
                      fixed, grads, float(c.model.op_times(g).sum()))

    def _floor_or_raise(self, c: _Counts, s: _Share, tries: "_Tries") -> tuple[int, int]:
        """The least budget a plan of the count without compression, and of any count, may fit (floors: no plan
        goes below them); the error, naming the least budget a plan exists for, where the budget is below."""
        least_plain = _floor(tries.plain, c.model, s.others) + s.margin + s.outside
        least = least_plain
        if s.budget < least_plain and tries.every() is not None:
            least = min(least, _floor(tries.every(), c.model, s.others) + s.margin + s.outside)
        if s.budget >= least:
            return least_plain, least
        # the floor is a bound no plan goes below; the error names the least budget a plan exists for (a
        # bisection of solves), so that the budget it names compiles
        region = None if s.others else solving.least_planned(
            self._solve, [v for v in (tries.plain, tries.lazy.get("every")) if v], c.model)
        named = least if region is None else max(least, region + s.margin + s.outside)
        budget, margin, outside, others = s.budget, s.margin, s.outside, s.others
        raise BudgetInfeasibleError(
            f"hybridmem compile: {s.name} has no plan within the budget {fmt_bytes(budget)} ({budget} B); "
            + (f"it needs at least {fmt_bytes(named)} ({named} B) with every evictable activation "
               + ("recomputed, swapped or compressed" if tries.lazy.get("every") else "recomputed or swapped")
               if region is None else f"the least budget it has a plan for is {fmt_bytes(named)} ({named} B)")
            + f" ({fmt_bytes(named - outside)} in the region"
            + (f", of which {fmt_bytes(margin)} left for Inductor's buffers" if margin else "")
            + f"; {fmt_bytes(outside)} held outside it: the optimizer's state, the regions compiled "
            f"before" + (", the other runs' inputs, parameters and gradients" if others else "")
            + "); the compiled step's run at compile time checks that budget and names more where Inductor "
            "holds more than the plan counts", named)

    def _try_variants(self, c: _Counts, s: _Share, tries: "_Tries", least_plain: int) -> None:
        """Plan the counts worth trying into ``tries``: without compression (where the budget is above its
        floor), then with what compresses where that may pay."""
        # below the floor of the count without compression no plan of it fits: only compression may
        first = tries.attempt(tries.plain) if s.budget >= least_plain else None
        hopeless = first is not None and first.plan is not None and not codecs_could_pay(first, c.model, c.dev.type)
        if hopeless and "compress" in self.policies:
            tries.notes.append("compression not tried: no recompute of the plan costs more per byte than the fastest "
                               "lossless codec would to free it")
            return
        if not ((first is None or first.plan is not None) and (codecs := tries.codecs()) is not None):
            return
        if first is None:
            tries.attempt(tries.every())
            # the most worth it, for about half the bytes compressing all would save: the plan recomputes
            # around them (compressing a recompute's source takes that recompute away). Compressing all
            # needs the least budget of the two: the error names it from there
            tries.attempt(codecs.variant("compress half", c.jg, c.part, codecs.half), least=False)
            return
        # hold compressed what that plan keeps, but the sources its recomputes replay from: the same
        # recomputes still fit, and the bytes compression frees may spare some of them. Not where the
        # codecs and the recomputes those bytes cannot spare cost more than that plan adds (it could
        # not be faster)
        d, ga = first.decisions, first.jg.graph
        sources = {x for t in d.recompute for x in ga.stages[ga.tensors[t].producer].inputs}
        evicted = set(d.recompute) | set(d.swap) | sources
        pick = codecs.pick(first.jg, lambda order: [t for t in order if t not in evicted])
        if pick and codecs.seconds(first.jg, pick) + recompute_left_s(
                first, c.model, codecs.freed(first.jg, pick)) < first.time_s - s.base_s:
            # the first plan stands if this one has none: no least budget to find for an error
            tries.attempt(codecs.variant("compress what it keeps", first.jg, None, lambda j, order: pick),
                          least=False)
        elif pick:
            tries.notes.append("compression not tried: its codecs, with the recomputes the bytes they free cannot "
                               "spare, would cost more than the recompute plan adds")

    def _best_or_raise(self, c: _Counts, s: _Share, tries: "_Tries") -> Planned:
        """The fastest plan tried (the first, less compressed, on a tie); the error naming the least budget any
        count has a plan for where none fits."""
        if not tries.planned:
            needs = [int(e.minimum_bytes) for e in tries.failures if e.minimum_bytes is not None]
            if not needs:
                raise tries.failures[0]
            least_need = min(needs)
            budget, margin, outside, others = s.budget, s.margin, s.outside, s.others
            need = least_need + margin + outside
            raise BudgetInfeasibleError(
                f"hybridmem compile: {s.name} has no plan within the budget {fmt_bytes(budget)} ({budget} B); "
                f"the least budget it has a plan for is {fmt_bytes(need)} ({need} B): "
                f"{fmt_bytes(least_need)} in the region"
                + (f" with the other {others} runs' kept tensors" if others else "")
                + (f", {fmt_bytes(margin)} left for Inductor's buffers" if margin else "")
                + f", {fmt_bytes(outside)} held outside it (the optimizer's state, the regions compiled "
                f"before" + (", the other runs' inputs, parameters and gradients)" if others else ")")
                + ("" if self._can_evict(c.dev) else f"; policies {list(self.policies)} evict nothing on {c.dev} (swap "
                   "needs CUDA): add recompute or compress"),
                need) from None
        best = min(tries.planned, key=lambda r: r.time_s)
        if len(tries.variants) > 1:
            times = ", ".join(f"{v.name or 'no compression'} " + next(
                (f"{100 * (r.time_s / s.base_s - 1):+.1f} %" for r in tries.planned if r.variant is v), "no plan")
                for v in tries.variants)
            tries.notes.append(f"compression {'chosen' if best.variant.compressed else 'not chosen'} "
                               f"(predicted {times})")
        return best

    def _record(self, c: _Counts, s: _Share, tries: "_Tries", best: Planned, least: int, t0: float) -> Prepared:
        """Tag the joint graph with ``best``'s decisions, record the region's stats and what it holds through its
        backward; what the partition's rewrite needs."""
        st = self._region_stats_of(best, s.name, least, s.margin, s.share, s.base_s)
        if tries.notes:
            st.note = "; ".join([*(x for x in [st.note] if x), *tries.notes])
        jg = best.jg
        if best.plan is not None:
            apply_plan(jg, best.decisions)
        elif jg.compressed:
            apply_plan(jg, Decisions())
        beside = (s.fixed + st.compressed_to_bytes + (st.swapped_bytes if c.dev.type != "cuda" else 0)
                  + s.others * (s.fixed + max(st.saved_bytes, s.grads)))
        r = self.regions[s.key]
        r.held = beside + st.saved_bytes
        r.kept = st.saved_bytes + st.compressed_to_bytes
        st.room_bytes = s.room
        if s.room:
            st.add_note(f"left {fmt_bytes(s.room)} where its backward begins for the regions compiled after it")
        st.runs_planned = self.calls_per_step
        st.plan_s = time.perf_counter() - t0
        st.scratch_s = c.scratch_s
        st.probe_s = c.probe_s
        st.codec_probe_s = tries.codec_s
        st.solve_s = best.solve_s
        region = codec_ops.new_region() if best.variant.compressed else 0
        st.codec_region = region
        self.regions.mark_planned(s.key, st)
        self.planned_now = best
        return Prepared(offload=bool(best.decisions.swap), region=region, stats=st, model=c.model, key=s.key,
                        held_beside=beside,
                        offloaded=[compressed_mod.storage_of(n) for t in best.decisions.swap
                                   for n in jg.forward_nodes_of(t)],
                        compressed=[best.variant.compressed[n.name] for n in jg.compressed.values()])

    def _codec_choices(self, c: _Counts, notes: list[str]) -> "Codecs | None":
        """The saved tensors of the region's counts a lossless codec shrinks to :data:`tuning.COMPRESS_MAX_RATIO` of
        their bytes or less, measured on the example inputs (:mod:`hybridmem.compile.probe`), most worth it
        first (recomputing their producer costs most more than the codec, per byte saved); None (``notes``
        says why) where none does or the forward cannot be measured."""
        gm, forward, jg, jg_part, model = c.gm, c.forward, c.jg, c.part, c.model
        fw = set(forward)
        found_in = {id(j): compressed_mod.candidates(j, fw) for j in (jg, jg_part) if j is not None}
        cands = {n for found in found_in.values() for n in found.values()}
        if not cands:
            return None
        if c.examples is None:
            notes.append("compression: no example inputs to measure the saved tensors on")
            return None
        try:
            measured = probe.measure(gm, forward, c.examples, cands)
        except Exception as e:     # an op the probe cannot run eagerly: plan without compression
            notes.append(f"compression: the forward could not be measured ({type(e).__name__}: {str(e)[:120]})")
            return None
        dev_type = c.dev.type
        out = Codecs(model, dev_type)
        for j in (jg, jg_part):
            if j is None:
                continue
            found = found_in[id(j)]
            picks: dict[int, compressed_mod.Compressed] = {}
            worth: dict[int, float] = {}
            for tid, n in found.items():
                got = measured.get(n.name)
                t = j.graph.tensors[tid]
                if got is None or got[1] > tuning.COMPRESS_MAX_RATIO * t.nbytes:
                    continue
                c = picks[tid] = compressed_mod.Compressed(n.name, got[0], t.nbytes, got[1],
                                                           compressed_mod.storage_of(n))
                codec_s = sum(codec_seconds(c.codec, c.nbytes, dev_type))
                worth[tid] = (model.op_time(j.graph.stages[t.producer]) - codec_s) / max(t.nbytes - c.size, 1)
            if picks:
                out.counts[id(j)] = (sorted(picks, key=lambda t: -worth[t]), picks, found)
        if not out.counts:
            notes.append(f"compression: no saved tensor compresses to {tuning.COMPRESS_MAX_RATIO:.0%} or less of its bytes")
            return None
        return out

    def _plan_variant(self, v: "Variant", gm: fx.GraphModule, joint_inputs: Any, kwargs: dict[str, Any], share: int,
                      margin: int, others: int, grads: int, model: Any, name: str, dev: torch.device,
                      least: bool = True) -> "Planned":
        """A plan for one count of the region (with or without compression) that fits ``share``; raises
        BudgetInfeasibleError whose ``minimum_bytes`` is the least the region needs (the margin and what is
        held outside it not included), or None where ``least`` is False (finding it takes a bisection of up
        to 16 solves: 32 s on ResNet-50 small's count with compression, where it had no plan)."""
        from ..graph.simulate import simulate

        jg, jg_part = v.jg, v.part
        g = jg.graph
        if jg_part is not None and not others and share >= jg_part.graph.peak_bytes() + margin:
            jg, g = jg_part, jg_part.graph     # PyTorch's own partition fits, as it runs
        peak = g.peak_bytes()
        others_keep_all = others * max(g.saved_bytes() - grads, 0)   # the other runs' bytes, keeping all
        if share >= peak + margin + others_keep_all:
            time_s = float(simulate(g, None, model, budget=None, check_hash=False).time_s)
            return Planned(v, jg, None, Decisions(), peak, peak, time_s, 0.0,
                            "the share holds the keep-all peak: PyTorch's own partition"
                            + (" with the compressed tensors" if v.compressed else ""), others_keep_all)
        if not self._can_evict(dev):
            # nothing but keeping (and the compression this count holds): its keep-all peak is the least
            raise BudgetInfeasibleError("no plan", peak + others_keep_all)
        try:
            try:
                p, predicted = solving.plan_runs(self._solve, g, share - margin, others, grads, model)
            except BudgetInfeasibleError:
                if jg_part is None or others:
                    raise
                part = jg_part

                def judge(p: Any) -> int | None:
                    return realized_peak(gm, joint_inputs, kwargs, part, p, decisions(p), model)
                p, predicted = solving.plan_realized(self._solve, part.graph, share - margin, model, judge)
                jg, g = part, part.graph
                peak = g.peak_bytes()
        except BudgetInfeasibleError as e:
            if not least:
                raise BudgetInfeasibleError("no plan", None) from None
            # the least budget this solver finds a plan for (bisection), so the error names it
            if others:  # the least total any of the plans tried needed, beside the other runs
                least_need = int(e.minimum_bytes if e.minimum_bytes is not None else g.peak_bytes())
            else:
                least_need = int(self._solve(g, "min", model).budget_bytes)
                if jg_part is not None and e.minimum_bytes is not None:
                    least_need = min(least_need, int(e.minimum_bytes))   # a plan as partitioned
            raise BudgetInfeasibleError("no plan", least_need) from None
        d = decisions(p)
        note = ""
        if d.swap and not overlap(dev):
            if copies_overlap(model):
                # its copies would run on the compute stream: charged in full, against the plan without swaps
                p, time_s, note = cheaper(g, p, model, lambda m: self._solve(g, share - margin, m))
                p.predicted_time_s = time_s
                d = decisions(p)
                predicted = int(p.predicted_peak_bytes)
            else:  # the model's copies are on the compute stream (`cpu`): solvers.plan charged and chose already
                note = str(p.info.get("copies") or "")
        if d.swap and not ("swap" in self.policies and dev.type == "cuda"):
            raise BudgetInfeasibleError(
                f"hybridmem compile: {name} fits {fmt_bytes(share)} only by swapping {len(d.swap)} tensor(s), "
                f"which a compiled graph on {dev} cannot (policies {list(self.policies)}); "
                + ("a larger budget lets recompute alone fit" if "recompute" in self.policies
                   else "policies with recompute or compress, or a larger budget, may fit"), None)
        time_s = float(p.predicted_time_s or 0.0)
        return Planned(v, jg, p, d, peak, predicted, time_s, float(p.info.get("solve_s") or 0.0), note,
                        others * max(solving.kept_bytes(g, p) - grads, 0))

    def _can_evict(self, dev: torch.device) -> bool:
        """Whether a plan may evict anything: recompute, or swap on CUDA (compression is a count of its own)."""
        return "recompute" in self.policies or ("swap" in self.policies and dev.type == "cuda")

    def _region_stats_of(self, r: "Planned", name: str, least: int, margin: int, share: int,
                         base_s: float) -> RegionStats:
        jg, g, d = r.jg, r.jg.graph, r.decisions
        comp = [(tid, n) for tid, n in jg.compressed.items()]
        specs = r.variant.compressed
        records = [{"node": jg.producer_node[t].name, "op": g.stages[g.tensors[t].producer].op,
                    "bytes": g.tensors[t].nbytes, "policy": policy}
                   for policy, ids in (("recompute", d.recompute), ("swap", d.swap)) for t in ids]
        records += [{"node": n.name, "op": str(n.target), "bytes": g.tensors[t].nbytes, "policy": "compress",
                     "codec": specs[n.name].codec, "to_bytes": specs[n.name].size} for t, n in comp]
        p = r.plan
        return RegionStats(
            name=name, stages=g.num_stages, forward_stages=g.num_forward, keep_all_peak_bytes=r.peak,
            min_budget_bytes=least, margin_bytes=margin, budget_bytes=share, predicted_peak_bytes=r.predicted,
            saved_bytes=g.saved_bytes() - d.bytes_of(jg, "recompute") - d.bytes_of(jg, "swap"),
            recomputed=len(d.recompute), recomputed_bytes=d.bytes_of(jg, "recompute"),
            swapped=len(d.swap), swapped_bytes=d.bytes_of(jg, "swap"),
            compressed=len(comp), compressed_bytes=sum(specs[n.name].nbytes for _, n in comp),
            compressed_to_bytes=sum(specs[n.name].size for _, n in comp),
            predicted_overhead=(r.time_s / base_s - 1.0) if base_s > 0 else 0.0,
            gap_to_lower_bound=p.info.get("gap_to_lower_bound") if p is not None else None,
            solver=p.solver if p is not None else "",
            plan_from=str(p.info.get("plan_from") or "") if p is not None else "",
            note=r.note, decisions=sorted(records, key=lambda x: -x["bytes"]))

