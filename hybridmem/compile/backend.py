"""``torch.compile`` backend: an STR plan inside the compiled graph.

    backend = hybridmem.compile_backend(budget="8GiB")
    model = torch.compile(model, backend=backend)
    ...train as usual...
    print(backend.stats())

For each compiled region AOTAutograd traces the joint forward-backward graph; the backend turns it
into a hybridmem Graph (:mod:`hybridmem.compile.joint`), plans it under the region's share of the
budget with the hybridmem solvers, and hands the plan to PyTorch's partitioner as checkpoint policies
(:mod:`hybridmem.compile.partition`). Inductor (or, with ``compiler="eager"``, AOTAutograd's eager
runner) then compiles the partitioned forward and backward as usual: nothing of hybridmem runs per op;
per call of a compiled region, a counter of its runs in flight and (on the CPU, measuring) a look at
the tensors it reads.

What the budget covers: the bytes the device holds while a compiled step runs: the regions'
parameters, buffers and inputs, the gradients they produce, their saved and temporary activations,
and the optimizer's state when ``optimizer=`` is given. Regions (graph breaks) share it in the order
they are first compiled: a region plans for what the regions before it keep through their backward.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import threading
import time
import warnings
from dataclasses import replace
from typing import Any, Sequence

import torch
from torch import fx

from ..devices import budget_needs_cuda, device_budget_bytes, parse_device_budget, resolve_device
from ..errors import UnknownNameError
from ..graph.costs import get_cost_model
from ..graph.units import fmt_bytes
from . import codec_ops, fit
from .compressed import rewrite_partition
from .copies import reload_timing, stream_ops_work
from .defaults import saved_bytes
from .gc_freeze import frozen_heap
from .measured import StepPeak
from . import offload as offload_mod
from .planner import PlanOptions, Planner
from .regions import InFlight, Key, RegionState, Regions, Replannable
from .sizes import PlannedSizes, bound, planned_at, planning_at
from .stats import CompileStats, RegionStats
from .variants import Prepared


__all__ = ["CompileBackend", "CompileStats", "RegionStats", "compile_backend", "POLICIES", "COMPILERS"]

POLICIES = ("swap", "recompute", "compress")   # what a compiled graph can do with a saved tensor
COMPILERS = ("inductor", "eager")     # what compiles the partitioned graphs


def _region_key(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[tuple[str, ...], list[tuple[str, Any]]]:
    """A region's identity across recompiles (new shapes, guards): the names of its tensor inputs; and those
    inputs, each as its placeholder's value where that is a tensor (the example inputs are real tensors: the
    symbols stand in the placeholders' fake values)."""
    tensors = [(str(n.target), v if isinstance(v := n.meta.get("example_value"), torch.Tensor) else x)
               for n, x in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs)
               if isinstance(x, torch.Tensor)]
    return tuple(name for name, _ in tensors), tensors


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _optimizer_bytes(optimizer: Any) -> int:
    if optimizer is None:
        return 0
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer (its state counts against the budget), "
                        f"got {type(optimizer).__name__}")
    from ..graph.optstate import optimizer_state
    states, _ = optimizer_state(optimizer)
    return sum(s.nbytes for s in states if s.on_device)


class _Partitioner:
    """The partition function AOTAutograd (or Inductor) calls with each region's joint graph."""

    def __init__(self, backend: "CompileBackend") -> None:
        self.backend = backend
        # unique to this backend: a cached partition made under another budget is never reused
        self.token = f"hybridmem-partition:{os.getpid()}:{id(backend)}:{time.time_ns()}"

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        from torch._functorch import config as fconfig
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        with contextlib.ExitStack() as stack:
            stack.enter_context(frozen_heap())     # planning and the partition: hybridmem.compile.gc_freeze
            b = self.backend
            prep = b.planner.prepare(gm, joint_inputs, kwargs, b._current, b._dev or torch.device("cpu"), b._examples)
            if prep.offload and stream_ops_work():
                stack.enter_context(fconfig.patch(
                    enable_activation_offloading=True, activation_offload_separate_stream=True,
                    activation_offload_sink_wait=True, activation_reload_prefetch=True))
                note = stack.enter_context(reload_timing(prep.model))
                if note and prep.stats is not None:
                    prep.stats.add_note(note)
            fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        if prep.offload and not stream_ops_work():
            # torch's stream ops do not trace (torch 2.11): hybridmem's own offload ops copy beside the compute
            # stream instead (hybridmem.compile.offload)
            moved = offload_mod.rewrite_partition(fw, bw, prep.offloaded, prep.model)
            if prep.stats is not None:
                prep.stats.add_note(f"swaps copied by hybridmem's offload ops beside the compute stream (torch "
                                    f"{torch.__version__}'s stream ops do not trace)"
                                    + (f"; {prep.stats.swapped - len(moved)} swapped tensor(s) not saved as "
                                       "planned stay on the device" if len(moved) < prep.stats.swapped else ""))
        if prep.stats is not None:
            self.backend._held_as_partitioned(prep, fw, bw)
        if prep.compressed:
            done = set(rewrite_partition(fw, bw, prep.compressed, prep.region))
            missed = [c for c in prep.compressed if c.node not in done]
            if missed and prep.stats is not None:
                # the partition saved them in another form (a view, a recompute): they stay as they are
                st = prep.stats
                lost = sum(c.nbytes - c.size for c in missed)
                gone = {c.node for c in missed}
                st.compressed -= len(missed)
                st.compressed_bytes -= sum(c.nbytes for c in missed)
                st.compressed_to_bytes -= sum(c.size for c in missed)
                st.decisions = [d for d in st.decisions if not (d["policy"] == "compress" and d["node"] in gone)]
                st.add_note(f"{len(missed)} tensor(s) the plan compressed were not saved as planned and stay "
                            f"uncompressed ({fmt_bytes(lost)} more than the plan counted)")
                warnings.warn(f"hybridmem compile: {prep.stats.name}: {len(missed)} tensor(s) the plan compressed were "
                              f"not saved as planned: the step may hold {fmt_bytes(lost)} more than the plan counted",
                              RuntimeWarning, stacklevel=2)
        if prep.stats is not None:
            _note_host_tokens(prep.stats, offload_mod.host_tokens(fw))
        return fw, bw

    def uuid(self) -> str:
        # a region planned again (a larger margin) must not get the partition cached for its first plan
        return f"{self.token}:{self.backend._revision}"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Inductor pickles its config into cache keys: this object stands there as its token
        return (str, (self.uuid(),))


class CompileBackend:
    """A ``torch.compile`` backend that plans each compiled region under a byte budget.

    ``budget``: bytes (``8 << 30``, ``"8GiB"``; on CUDA also ``"60%"`` of the device's memory).
    ``device``: where the compiled step runs (default: the device of the region's inputs).
    ``policies``: which of ``swap`` and ``recompute`` may evict (swap needs CUDA: on the CPU a swap
    frees nothing). ``solver``: a hybridmem solver (``approx`` by default; see ``hybridmem plan
    --list-solvers``), with ``time_limit`` seconds per region. ``optimizer``: the training loop's
    optimizer, whose state then counts against the budget. ``cost_model``: a hybridmem device model
    name (default: the CPU model, or the GPU's). ``compiler``: ``inductor`` (default) or ``eager``
    (AOTAutograd's eager runner: the same partition, no kernel generation). ``scratch``: measure the
    library ops' scratch by running each once on zeros (:mod:`hybridmem.compile.scratch`; default on).
    ``calls_per_step``: how many times a compiled region runs its forward before the first of those
    runs' backwards begins: a block compiled once and called in a loop (regional compilation) holds that
    many runs' saved tensors; the plan leaves room for them (default 1; the stats and a warning say
    when more were in flight).
    ``measure``: read the device's real peak while compiled steps run (``stats().measured_peak_bytes``,
    :mod:`hybridmem.compile.measured`; default on; on the CPU this installs the native allocator meter
    until :meth:`close`). ``hold_outputs``: the compiled forward's outputs count until the step ends
    (default: the training loop may hold them through the backward, as ``logits, loss = model(x)`` does);
    ``False`` for a loop that drops them before calling backward (``loss = model(x)[1]``): their bytes
    then count only until the forward ends, and a loop that holds them after all holds that much more
    than the plan counted. ``verify``: run each compiled region once when it compiles, forward and backward
    on the first call's inputs (:mod:`hybridmem.compile.trial`; the user's random stream, buffers and
    ``.grad`` are left as they were), and where its real peak exceeds the region's share, plan it again
    with that much more left free and compile it again (up to :data:`tuning.REPLANS` times; default on).
    """

    def __init__(self, budget: int | str, device: str | torch.device | None = None,
                 policies: Sequence[str] | str = POLICIES, solver: str = "approx",
                 time_limit: float | None = None, optimizer: Any = None, cost_model: str | None = None,
                 compiler: str = "inductor", scratch: bool = True, calls_per_step: int = 1,
                 measure: bool = True, hold_outputs: bool = True, verify: bool = True) -> None:
        from .. import solvers
        self.policies = _policies(policies)
        if solver not in solvers.SOLVERS:
            raise UnknownNameError("solver", solver, solvers.SOLVERS)
        if compiler not in COMPILERS:
            raise UnknownNameError("compiler", compiler, COMPILERS)
        if time_limit is not None and not (isinstance(time_limit, (int, float)) and time_limit > 0):
            raise ValueError(f"time_limit {time_limit!r}: expected seconds > 0, or None")
        self.device = None if device is None else resolve_device(device)
        # the eager runtime's checks, but no 'none': a compiled region is planned for a budget or not
        # compiled by this backend
        parsed = parse_device_budget(budget, setting=False)
        self.budget = budget
        self._budget_b: int | None = None
        if not isinstance(parsed, str):
            self._budget_b = parsed
        elif self.device is not None and self.device.type != "cuda":
            raise budget_needs_cuda(budget, f"this backend's device is {self.device}")
        elif self.device is None and not torch.cuda.is_available():
            raise budget_needs_cuda(budget, "none is available here")
        self.solver, self.time_limit, self.compiler, self.scratch = solver, time_limit, compiler, bool(scratch)
        self.cost_model_name = cost_model
        if cost_model is not None:
            get_cost_model(cost_model)          # an unknown name fails here, naming the known ones
        self.optimizer_bytes = _optimizer_bytes(optimizer)
        self._optimizer = optimizer
        self.measure = bool(measure)
        if isinstance(calls_per_step, bool) or not isinstance(calls_per_step, int) or calls_per_step < 1:
            raise ValueError(f"calls_per_step {calls_per_step!r}: expected an int >= 1 (the runs of a compiled "
                             "region in flight at once, e.g. the number of blocks that share one compiled graph)")
        self.calls_per_step = calls_per_step
        if not isinstance(hold_outputs, bool):
            raise ValueError(f"hold_outputs {hold_outputs!r}: expected True (the loop may hold the compiled forward's "
                             "outputs through the backward) or False (it drops them before calling backward)")
        self.hold_outputs = hold_outputs
        if not isinstance(verify, bool):
            raise ValueError(f"verify {verify!r}: expected True (run each compiled region once when it compiles and "
                             "plan it again where its real peak exceeds its share) or False")
        self.verify = verify
        self._revision = 0                           # plans made again after a trial (partition cache keys)
        self.peak = StepPeak()
        # each region's state, in the order the regions were first planned (hybridmem.compile.regions)
        self.regions = Regions(self._budget_bytes, self.optimizer_bytes, calls_per_step)
        self.planner = Planner(PlanOptions(self.policies, solver, time_limit, compiler, self.scratch, cost_model,
                                           hold_outputs, calls_per_step), self.regions)
        self._current: Key = ()
        self._dev: torch.device | None = self.device
        self._examples: list[Any] | None = None
        self.partitioner = _make_partitioner(self)
        if "compress" in self.policies and (self.device is None or self.device.type == "cpu"):
            # the compression probe analyses on the CPU with a Numba kernel: it loads while Dynamo and
            # AOTAutograd trace (ctypes calls into LLVM release the GIL), not inside the planning
            from ..plugins.codecs import load_analysis_kernel
            threading.Thread(target=load_analysis_kernel, name="hybridmem-codec-load", daemon=True).start()

    # ---- torch.compile calls this ----------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        key, tensors = _region_key(gm, example_inputs)
        if self._dev is None:
            self._dev = _device_of(example_inputs)
        if self.measure:
            self.peak.start(self._dev, self._optimizer)
        r = self.regions.setdefault(key, RegionState())
        earlier = r.sizes
        compiled, sizes = self._build(key, tensors, gm, example_inputs)
        if earlier is not None and sizes.above(earlier.planned):
            # Dynamo compiled it again because a call was larger than the plan's sizes (sizes.bound)
            r.size_replans += 1
        holder = r.replannable = Replannable(compiled, lambda flat: self._replan(key, gm, flat))
        if r.renew:          # planned above the budget: again once the earlier regions made room
            r.renew = False
            holder.renew(skip=1)
        compiled = holder
        if r.runs is None:  # a recompile of a region (new shapes, an input that needs no grad) shares its count
            r.runs = InFlight(self.calls_per_step, lambda n: self._more_runs(key, n))
        r.sizes = sizes if sizes.at else None
        return self.peak.wrap(r.runs.wrap(compiled))

    def _build(self, key: Key, tensors: list[tuple[str, Any]], gm: fx.GraphModule,
               example_inputs: list[Any]) -> tuple[Any, PlannedSizes]:
        """Plan and compile region ``key`` (graph ``gm``) on ``example_inputs``; the compiled function and the
        sizes it was planned at."""
        self._current = key
        # compiled for any size: planned at the largest sizes compiled for before (the full batch, where a
        # smaller last batch made Dynamo compile the region again), which later calls are likely to bring; a
        # larger call fails the bound's guard and Dynamo compiles the region again, planned at its sizes
        at = planned_at(tensors, self.regions[key].largest)
        bound(tensors, at)
        self.peak.compiling()
        self._examples = example_inputs     # what the compress probe measures on; held while compiling only
        try:
            with planning_at(at):
                sizes = PlannedSizes(example_inputs, [n.meta.get("example_value") for n in gm.graph.nodes
                                                      if n.op == "placeholder"])
                compiled = self._compile_checked(key, gm, example_inputs, sizes)
        finally:
            self._examples = None
            self.peak.compiled()
        return compiled, sizes

    def _replan(self, key: Key, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        """Region ``key`` planned and compiled again on a call's inputs (:mod:`hybridmem.compile.regions`): the
        regions compiled after it asked for room, or it was planned above the budget while they made it."""
        _, tensors = _region_key(gm, example_inputs)
        before = self.regions[key].stats
        compiled, _ = self._build(key, tensors, gm, example_inputs)
        st = self.regions[key].stats
        if st is not None and before is not None and st is not before:
            # planning time counts every plan made for the region
            st.plan_s += before.plan_s
            st.trial_s += before.trial_s
            st.room_replans = before.room_replans + 1
        return compiled

    def _more_runs(self, key: Key, n: int) -> None:
        st = self.regions[key].stats
        name = st.name if st is not None else "a region"
        held = f" of {fmt_bytes(st.saved_bytes)}" if st is not None else ""
        warnings.warn(f"hybridmem compile: {name} had {n} runs in flight (forwards whose backward had not "
                      f"begun: a block compiled once and called in a loop); its plan holds {self.calls_per_step}, "
                      f"so the step holds about {n - self.calls_per_step} more runs' saved tensors{held} each "
                      f"and may exceed the budget: compile_backend(calls_per_step={n}) plans for them",
                      RuntimeWarning, stacklevel=2)

    def _compile_checked(self, key: Key, gm: fx.GraphModule, example_inputs: list[Any],
                         sizes: PlannedSizes) -> Any:
        """:func:`~hybridmem.compile.fit.compile_fitted`; where the region was planned above the budget, beside
        earlier regions that keep too much (:mod:`hybridmem.compile.regions`), those are asked to make room, and it
        to plan again after them, at their next calls."""
        r = self.regions[key]
        r.lift = None
        try:
            compiled = fit.compile_fitted(self, key, gm, example_inputs, sizes)
        finally:
            lifted, r.lift = r.lift, None
        st = r.stats
        if lifted is not None and st is not None:
            self.regions.ask_room(key, st, self._dev or torch.device("cpu"))
        return compiled

    def _budget_bytes(self, dev: torch.device) -> int:
        if self._budget_b is None:   # a percentage, of the region's device's memory
            return device_budget_bytes(self.budget, dev, capacity=False, what="this region")
        return self._budget_b

    def _held_as_partitioned(self, prep: Prepared, fw: fx.GraphModule, bw: fx.GraphModule) -> None:
        """What region ``prep.key`` holds through its backward, by the tensors its partition's backward reads
        from its forward (:func:`~hybridmem.compile.defaults.saved_bytes`) rather than by the plan's count: the
        partition recomputes some of what a plan keeps (:mod:`hybridmem.compile.partition_peak`), and the regions
        compiled after it plan beside what it really keeps."""
        dev = self._dev or torch.device("cpu")
        saved = saved_bytes(fw, bw, dev)
        r = self.regions[prep.key]
        r.held = prep.held_beside + saved
        r.kept = saved + (prep.stats.compressed_to_bytes if prep.stats is not None else 0)

    def _compile(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._functorch import config as fconfig
        # the backward compiled with the forward (AOTAutograd compiles it at its first call otherwise): a trial
        # run (verify) then measures the step, not the compile, and runs outside the compile's bookkeeping
        with fconfig.patch(force_non_lazy_backward_lowering=True):
            if self.compiler == "inductor":
                from torch._inductor.compile_fx import compile_fx
                return compile_fx(gm, example_inputs, config_patches={"custom_partitioner_fn": self.partitioner})
            from torch._dynamo.backends.common import aot_autograd
            from torch._dynamo.backends.debugging import boxed_nop
            return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=self.partitioner,
                                keep_inference_input_mutations=True)(gm, example_inputs)

    def pending(self) -> int:
        """Regions to be planned and compiled again at their next call (graph breaks: the regions compiled
        after them asked for room, :mod:`hybridmem.compile.regions`); 0 once the steps run the plans that fit."""
        return self.regions.pending()

    def reset_stats(self) -> None:
        """Restart the measured peak at the current level (the regions' plan figures stay)."""
        self.peak.reset()

    def close(self) -> None:
        """Stop measuring the real peak (on the CPU: uninstall the allocator meter if this backend
        installed it). The figure measured so far stays in :meth:`stats`."""
        self.peak.stop()

    # ---- what the user reads -------------------------------------------------------------------
    def stats(self) -> CompileStats:
        dev = self._dev or torch.device("cpu")
        return CompileStats(device=str(dev), budget_bytes=self._budget_bytes(dev),
                            outside_bytes=self.optimizer_bytes, regions=self._region_stats(),
                            measured_peak_bytes=self.peak.peak_bytes,
                            measured=self.peak.how if self.measure else "not measured (measure=False)")

    def _region_stats(self) -> list[RegionStats]:
        out = []
        for r in self.regions.values():
            st = r.stats
            if st is None:
                continue
            st.runs_in_flight = r.runs.most if r.runs is not None else 0
            if r.sizes is not None:
                st.planned_sizes, st.compiled_sizes = r.sizes.planned, dict(r.sizes.compiled_at)
            st.size_replans = r.size_replans
            if st.codec_region:
                now = codec_ops.stats_for(st.codec_region)
                st.codec = replace(now, codecs=dict(now.codecs))
            out.append(st)
        return out


def _note_host_tokens(st: RegionStats, tokens: int) -> None:
    """Record that the region's forward saves ``tokens`` values as host tokens: cudagraph trees skip such a
    graph, which torch does not say."""
    st.host_tokens = tokens
    if tokens:
        st.add_note(f"{tokens} saved tensor(s) held through host tokens (hybridmem's offload and compress ops): "
                    "CUDA graphs (mode='reduce-overhead', cudagraph trees) skip its graphs")


def _make_partitioner(backend: CompileBackend) -> Any:
    """The partition function, as the ``CustomPartitionerFn`` Inductor's config asks for (the class is
    made here so that importing this module does not import Inductor)."""
    global _PartitionerFn
    if _PartitionerFn is None:
        from torch._inductor.custom_graph_pass import CustomPartitionerFn

        class HybridmemPartitioner(_Partitioner, CustomPartitionerFn):
            pass

        _PartitionerFn = HybridmemPartitioner
    return _PartitionerFn(backend)


_PartitionerFn: Any = None


def _policies(policies: Sequence[str] | str) -> tuple[str, ...]:
    items = tuple(p.strip() for p in policies.split(",")) if isinstance(policies, str) else tuple(policies)
    if not items:
        raise ValueError(f"policies: expected at least one of {list(POLICIES)}")
    for p in items:
        if p not in POLICIES:
            raise UnknownNameError("policy", p, POLICIES)
    return items


def compile_backend(budget: int | str, device: str | torch.device | None = None,
                    policies: Sequence[str] | str = POLICIES, solver: str = "approx", **options: Any) -> CompileBackend:
    """A ``torch.compile`` backend that keeps each compiled training step under ``budget`` bytes
    (:class:`CompileBackend`; ``options``: ``time_limit``, ``optimizer``, ``cost_model``, ``compiler``,
    ``scratch``, ``calls_per_step``, ``measure``, ``hold_outputs``, ``verify``); an unknown option is a
    TypeError naming those."""
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise TypeError(f"compile_backend: unknown option(s) {', '.join(map(repr, unknown))}; accepted: "
                        f"{', '.join(sorted(_OPTIONS))} (besides budget, device, policies, solver)")
    return CompileBackend(budget, device=device, policies=policies, solver=solver, **options)


# the keyword options compile_backend passes on to CompileBackend: its keywords beyond compile_backend's own
_OPTIONS = frozenset(inspect.signature(CompileBackend.__init__).parameters) - {"self", "budget", "device", "policies",
                                                                               "solver"}
