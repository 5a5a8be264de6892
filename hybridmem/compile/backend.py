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
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import torch
from torch import fx

from ..errors import BudgetInfeasibleError, UnknownNameError
from ..graph.costs import DeviceModel, get_cost_model
from ..graph.units import BUDGET_FORMS, fmt_bytes, parse_budget, parse_bytes
from ..plugins.codecs import LOSSLESS
from ..plugins.compress import codec_seconds
from ..runtime.core import cost_model_for, resolve_device
from .defaults import saved_by_partition, saved_bytes
from .heap import frozen_heap
from .joint import concatenates_feature_maps, has_convolution, joint_graph
from . import codec_ops, probe
from . import compressed as compressed_mod
from .compressed import rewrite_partition
from ..runtime import cpumeter
from .measured import StepPeak
from .runs import InFlight
from .sizes import PlannedSizes, planned_at, planning_at
from . import trial as trial_mod
from .partition import Decisions, apply_plan, decisions
from .copies import cheaper, no_swap, overlap, reload_timing, stream_ops_work
from . import offload as offload_mod
from .realized import realized_peak
from .room import Replannable, reserve
from .scratch import inductor_channels_last, measure_scratch

__all__ = ["CompileBackend", "CompileStats", "RegionStats", "compile_backend", "POLICIES", "COMPILERS"]

POLICIES = ("swap", "recompute", "compress")   # what a compiled graph can do with a saved tensor
COMPILERS = ("inductor", "eager")     # what compiles the partitioned graphs
# Inductor's compiled step holds more at its peak than the joint graph counts op by op (its kernels'
# buffers live by kernel, not by op, and it orders the backward and the recomputed ops its own way):
# 0.7-1.6 MiB on ResNet-50 small (4.3-6.4 % of the keep-all peak) at 0.79 of its unmanaged peak, 3.3 % on a
# ResNet-18-like net (CPU, 2026-12-01), and 2.3 MiB (9.3 %) at 0.76, where a plan recomputes 6-7 MiB
# (2026-12-03). Its plans leave this share of the keep-all peak free (of the lower of the region's two counts).
INDUCTOR_MARGIN = 0.11
# Where a region that convolves concatenates feature maps (a U-Net's skips), Inductor's layout optimization
# holds more:
# U-Net small's compiled step peaked 4.3 % over a plan made with the 11 % margin, 14 % of its keep-all count
# beyond the plan's count (its unmanaged step: 55.8 MB with the layout optimization, 49.6 MB without, the
# count 49.9 MB; CPU, 2026-12-03).
INDUCTOR_MARGIN_CONCAT = 0.17
# Without convolutions (transformers, MLPs) the graph fuses the backward's pointwise chains as Inductor
# does, and Inductor's step stayed below the count: on the transformer (small, batch 8) at 0.765 of the
# unmanaged peak the real peak was 1.27 MiB (4.0 % of the keep-all peak) below the predicted one (CPU,
# 2026-12-01). A smaller share is left free there.
INDUCTOR_MARGIN_NO_CONV = 0.02
# plans judged by the partition they get (realized_peak), beyond the first, bisecting for the highest
# budget that fits: each costs a plan and a partition of a copy of the joint graph (GPT small: 1.1 s)
REALIZED_PROBES = 4
REALIZED_HEADROOM = 0.02    # ... only where the first plan's judged peak leaves this share of the budget free
REALIZED_TIME_SHARE = 2.0   # ... and for at most twice the time the first plan and its judgement took


# a compiled region whose step, run once at compile time (hybridmem.compile.trial), holds more than its share is
# planned again with the margin raised by the excess and this share of its keep-all peak, up to this many times;
# where the run was stopped at the share (CPU: it would have held more), the excess is only a least, and the
# share added doubles with each stopped run
REPLANS = 3
REPLAN_SLACK = 0.01
# where no plan fits with the margin but the least budget named is within it, the region is planned with the
# margin lowered by the difference (its run at compile time checks it), at most this many times
SHRINKS = 3

# compress a saved tensor only where its lossless encoding, measured on the example inputs, is at most this
# share of its bytes: a ReLU's output with half its elements zero encodes to 0.53 of a float32 tensor
COMPRESS_MAX_RATIO = 0.75


@dataclass
class RegionStats:
    """What was decided for one compiled region (one joint forward-backward graph)."""

    name: str
    stages: int                       # ops of the joint graph (forward + backward)
    forward_stages: int
    keep_all_peak_bytes: int          # the graph's peak with every saved tensor kept, op by op
    min_budget_bytes: int             # no budget below this can fit the region (outside bytes included)
    budget_bytes: int                 # this region's share of the budget
    margin_bytes: int                 # of the share, left free for the compiler's own buffers (INDUCTOR_MARGIN)
    predicted_peak_bytes: int         # the plan's peak under the simulator
    saved_bytes: int                  # bytes the forward saves for the backward, kept
    recomputed: int = 0               # saved tensors the backward recomputes ...
    recomputed_bytes: int = 0
    swapped: int = 0                  # ... those it reloads from the host ...
    swapped_bytes: int = 0
    compressed: int = 0               # ... and those it holds compressed (lossless) from forward to backward
    compressed_bytes: int = 0
    compressed_to_bytes: int = 0      # ... their encodings' bytes, measured on the first call's inputs
    predicted_overhead: float = 0.0   # predicted step time / compute time - 1
    gap_to_lower_bound: float | None = None
    runs_planned: int = 1             # runs in flight the plan holds (calls_per_step)
    runs_in_flight: int = 0           # the most runs seen in flight: forwards whose backward had not begun
    solver: str = ""
    plan_from: str = ""
    plan_s: float = 0.0               # seconds spent turning the graph into a plan and tags, of which:
    scratch_s: float = 0.0            # ... measuring the library ops' scratch
    probe_s: float = 0.0              # ... partitioning once with no plan (what PyTorch saves on its own)
    solve_s: float = 0.0              # ... in the solver
    codec_probe_s: float = 0.0        # ... measuring what compresses (one forward on the inputs) and its counts
    # the compiled step run once at compile time on the first call's inputs (hybridmem.compile.trial): its real
    # peak (with the other runs in flight as counted), the seconds that took, and the plans made before
    # one fit (each a compile of its own)
    trial_peak_bytes: int | None = None
    trial_s: float = 0.0
    replans: int = 0
    # graph breaks (hybridmem.compile.room): bytes left where its backward begins for the regions compiled after
    # it, and the times it was planned again at a later call for them
    room_bytes: int = 0
    room_replans: int = 0
    note: str = ""
    # what the compress ops did in the steps run so far (None: nothing compressed)
    codec: codec_ops.CodecStats | None = None
    codec_region: int = 0             # the compress ops' region id (0: none)
    # compiled for dynamic shapes: the sizes (symbol -> value) the plan was made at, and the largest values
    # calls had above them (the step then holds more than the plan counted)
    planned_sizes: dict[str, int] = field(default_factory=dict)
    compiled_sizes: dict[str, int] = field(default_factory=dict)   # ... the sizes of the call that compiled it
    sizes_above_plan: dict[str, int] = field(default_factory=dict)
    # one record per evicted tensor: the node that makes it, its op, bytes and policy, largest first
    decisions: list[dict[str, Any]] = field(default_factory=list)

    def add_note(self, text: str) -> None:
        """Append ``text`` to the region's note."""
        self.note = "; ".join(x for x in (self.note, text) if x)


@dataclass
class CompileStats:
    """The compiled regions one backend planned, in the order they were first compiled."""

    device: str
    budget_bytes: int
    outside_bytes: int                # bytes counted outside the regions (the optimizer's state)
    regions: list[RegionStats] = field(default_factory=list)
    measured_peak_bytes: int | None = None  # the device's real peak while compiled steps ran (compiles left out)
    measured: str = ""                # what measured it, or why nothing did

    @property
    def plan_seconds(self) -> float:
        return sum(r.plan_s for r in self.regions)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def report(self, top: int = 10) -> str:
        """The regions and, for each, its ``top`` largest evicted tensors with what was decided."""
        lines = [str(self)]
        for r in self.regions:
            for d in r.decisions[:top]:
                lines.append(f"    {r.name}: {d['policy']:9s} {fmt_bytes(d['bytes']):>11s}  {d['node']} ({d['op']})")
            if len(r.decisions) > top:
                lines.append(f"    {r.name}: ... {len(r.decisions) - top} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        lines = [f"hybridmem compiled on {self.device}: budget {fmt_bytes(self.budget_bytes)}, "
                 f"{len(self.regions)} region(s), planning {self.plan_seconds:.2f} s"
                 + (f" (solver {sum(r.solve_s for r in self.regions):.2f} s, scratch "
                    f"{sum(r.scratch_s for r in self.regions):.2f} s, default partition "
                    f"{sum(r.probe_s for r in self.regions):.2f} s)" if self.regions else "")
                 + (f", run once when compiled {sum(r.trial_s for r in self.regions):.2f} s"
                    if any(r.trial_peak_bytes is not None for r in self.regions) else "")
                 + (f", optimizer state {fmt_bytes(self.outside_bytes)}" if self.outside_bytes else "")]
        if self.measured_peak_bytes is not None:
            # the allocator's peak is the process's: what the loop holds beside the steps (gradients it
            # copies, an evaluation) counts too, which the line says, as the figure can pass the budget
            lines.append(f"  measured peak {fmt_bytes(self.measured_peak_bytes)} ({self.measured}: all the process "
                         f"held while compiled steps ran, the loop's own tensors too), "
                         f"{100 * self.measured_peak_bytes / max(self.budget_bytes, 1):.1f} % of the budget")
        elif self.measured:
            lines.append(f"  measured peak: {self.measured}")
        for r in self.regions:
            lines.append(
                f"  {r.name}: {r.stages} ops, keep-all peak {fmt_bytes(r.keep_all_peak_bytes)}, share "
                f"{fmt_bytes(r.budget_bytes)}, predicted peak {fmt_bytes(r.predicted_peak_bytes)}; saved "
                f"{fmt_bytes(r.saved_bytes)}, recomputed {r.recomputed} ({fmt_bytes(r.recomputed_bytes)}), "
                f"swapped {r.swapped} ({fmt_bytes(r.swapped_bytes)})"
                + (f", compressed {r.compressed} ({fmt_bytes(r.compressed_bytes)} to "
                   f"{fmt_bytes(r.compressed_to_bytes)})" if r.compressed else "")
                + f"; predicted step time +{100 * r.predicted_overhead:.1f} %"
                + (f"; measured {fmt_bytes(r.trial_peak_bytes)} when compiled"
                   + (f" (planned {r.replans + 1} times: the first plans' steps held more than the share)"
                      if r.replans else "") if r.trial_peak_bytes is not None else "")
                + (f"; planned for {r.runs_planned} runs in flight" if r.runs_planned > 1 else "")
                + (f"; {r.runs_in_flight} runs were in flight (calls_per_step={r.runs_in_flight} plans for them)"
                   if r.runs_in_flight > r.runs_planned else "")
                + (f"; {r.note}" if r.note else "")
                + (f"; compiled for dynamic shapes, planned at {_sizes(r.planned_sizes)}"
                   + (f" (the largest compiled for; this compile's call had {_sizes(r.compiled_sizes)})"
                      if r.compiled_sizes != r.planned_sizes else "") if r.planned_sizes else "")
                + (f"; calls had {_sizes(r.sizes_above_plan)}: the step held more than the plan counted"
                   if r.sizes_above_plan else "")
                + (f"\n    {r.name}: compressed {_codec_line(r.codec)}"
                   if r.codec is not None and r.codec.packed else ""))
        return "\n".join(lines)


@dataclass(eq=False)
class _Variant:
    """One count of a region (and its partition's count) the planners may plan on."""

    name: str                                     # "", "compress half", "compress" or "compress all"
    jg: Any
    part: Any
    compressed: dict[str, compressed_mod.Compressed] = field(default_factory=dict)  # node name -> measured


class _Codecs:
    """What compresses in a region's counts (:meth:`CompileBackend._codec_choices`), and the counts that hold a
    choice of it compressed."""

    def __init__(self, model: Any, device_type: str) -> None:
        self.model, self.device_type = model, device_type
        # id(count) -> (its compressible tensors, most worth it first; what the probe measured; their nodes)
        self.counts: dict[int, tuple[list[int], dict[int, compressed_mod.Compressed], dict[int, fx.Node]]] = {}

    def variant(self, name: str, jg: Any, part: Any, select: Any) -> _Variant | None:
        """``jg`` and ``part`` with the tensors ``select(count, ranked ids)`` returns held compressed; None where
        that is nothing."""
        made, specs = [], {}
        for j in (jg, part):
            got = self.counts.get(id(j)) if j is not None else None
            chosen = select(j, got[0]) if got is not None else []
            if not chosen:
                made.append(None)
                continue
            _, picks, found = got               # type: ignore[misc]
            made.append(compressed_mod.with_compression(j, {t: picks[t] for t in chosen}, found, self.model,
                                                        self.device_type))
            specs.update({picks[t].node: picks[t] for t in chosen})
        if not specs:
            return None
        return _Variant(name, made[0] if made[0] is not None else jg, made[1], specs)

    def pick(self, j: Any, select: Any) -> list[int]:
        """``select(ranked ids)`` of count ``j`` (empty where nothing of it compresses)."""
        got = self.counts.get(id(j))
        return select(got[0]) if got is not None else []

    def seconds(self, j: Any, tids: list[int]) -> float:
        """Encode and decode seconds of ``tids`` of count ``j`` (:func:`~hybridmem.plugins.compress.codec_seconds`)."""
        picks = self.counts[id(j)][1]
        return sum(sum(codec_seconds(picks[t].codec, picks[t].nbytes, self.device_type)) for t in tids)

    def freed(self, j: Any, tids: list[int]) -> int:
        """Bytes compressing ``tids`` of count ``j`` frees (their bytes less their encodings')."""
        picks = self.counts[id(j)][1]
        return sum(picks[t].nbytes - picks[t].size for t in tids)

    def half(self, j: Any, order: list[int]) -> list[int]:
        """The most worth it of ``order`` that save half the bytes all of them would."""
        _, picks, _ = self.counts[id(j)]
        total = self.freed(j, order)
        out, saved = [], 0
        for t in order:
            if saved >= total / 2:
                break
            out.append(t)
            saved += picks[t].nbytes - picks[t].size
        return out


def _recompute_costs(first: "_Planned", model: Any) -> list[tuple[float, int]]:
    """(seconds, bytes) of each tensor ``first``'s plan recomputes: its producer's time, its bytes."""
    g = first.jg.graph
    return [(model.op_time(g.stages[g.tensors[t].producer]), g.tensors[t].nbytes) for t in first.decisions.recompute]


def _codecs_could_pay(first: "_Planned", model: Any, device_type: str) -> bool:
    """Whether compressing what a plan keeps could spare any of its recomputes at a profit, before measuring
    anything (the probe runs the forward eagerly, and a second plan may be solved: seconds on ResNet-50): a
    recompute is spared by freeing its bytes, and no lossless codec frees a byte for less than its encode and
    decode time of that byte. A plan that swaps is not judged here."""
    if first.decisions.swap:
        return True
    per_byte = min(sum(codec_seconds(name, 1 << 30, device_type)) for name in LOSSLESS) / (1 << 30)
    return any(seconds > per_byte * nbytes for seconds, nbytes in _recompute_costs(first, model))


def _recompute_left_s(first: "_Planned", model: Any, freed: int) -> float:
    """The least recompute time a plan that frees ``freed`` more bytes by compression still pays beside
    ``first``'s: its recomputes' bytes beyond ``freed``, the cheapest per byte first (their producers' times;
    a bound: bytes freed anywhere are counted as if freed at the peak)."""
    costs = _recompute_costs(first, model)
    left = sum(nbytes for _, nbytes in costs) - freed
    seconds = 0.0
    for rate, nbytes in sorted((s / max(n, 1), n) for s, n in costs):
        if left <= 0:
            break
        seconds += rate * min(nbytes, left)
        left -= nbytes
    return seconds


@dataclass
class _Planned:
    variant: _Variant
    jg: Any                                       # the count the plan was made on
    plan: Any                                     # None: the share holds the keep-all peak
    decisions: Decisions
    peak: int                                     # that count's keep-all peak
    predicted: int
    time_s: float                                 # predicted step time
    solve_s: float
    note: str
    others_bytes: int = 0                         # of ``predicted``, what the other runs in flight hold


@dataclass
class _Prepared:
    """What the partition function needs after planning: whether to offload, what to compress."""

    offload: bool = False
    compressed: list[compressed_mod.Compressed] = field(default_factory=list)
    region: int = 0
    stats: RegionStats | None = None
    model: Any = None            # the cost model the region was planned with (times the offloading's reloads)
    key: tuple[str, ...] = ()
    held_beside: int = 0         # of what the region holds through its backward, all but its saved tensors
    offloaded: list[Any] = field(default_factory=list)   # the storages of the values the plan swaps


def _codec_line(c: codec_ops.CodecStats) -> str:
    """What the compress ops did: tensors, bytes before and after, time, and bytes over the plan's count."""
    codecs = ", ".join(f"{k} {v}" for k, v in sorted(c.codecs.items()))
    raw = f", {c.raw} left as they were" if c.raw else ""
    over = (f"; {fmt_bytes(c.over_plan_bytes)} more than the plan counted (the data compressed worse than when "
            "the region compiled)") if c.over_plan_bytes else ""
    return (f"{c.packed} saved tensor(s) in the steps so far ({codecs}{raw}): {fmt_bytes(c.bytes_in)} to "
            f"{fmt_bytes(c.bytes_out)}, encode {c.encode_s * 1e3:.1f} ms, decode {c.decode_s * 1e3:.1f} ms{over}")


def _sizes(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())


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


def _cost_model(device: torch.device, name: str | None, can_swap: bool) -> DeviceModel:
    model = cost_model_for(device, name)
    return model if can_swap else no_swap(model)


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
            stack.enter_context(frozen_heap())     # planning and the partition: hybridmem.compile.heap
            prep = self.backend._prepare(gm, joint_inputs, kwargs)
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
            moved = offload_mod.rewrite_partition(fw, bw, prep.offloaded)
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
    with that much more left free and compile it again (up to :data:`REPLANS` times; default on).
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
        if budget is None or isinstance(budget, bool):
            raise ValueError("budget: expected bytes (an int, '8GiB'; on CUDA also '60%' of device memory), "
                             f"got {budget!r}")
        self.budget = budget
        self._budget_b: int | None = None
        # the eager runtime's checks (a positive whole number of bytes, a percentage in (0, 100]), but
        # 'none': a compiled region is planned for a budget or not compiled by this backend
        parsed = parse_budget(budget, forms=BUDGET_FORMS[:-1])
        if not isinstance(parsed, str):
            self._budget_b = parsed
        elif self.device.type != "cuda" if self.device is not None else not torch.cuda.is_available():
            raise ValueError(f"budget {budget!r}: a percentage needs a CUDA device (of its memory)"
                             + ("" if self.device is not None else ", and none is available here")
                             + "; give bytes, e.g. '2GiB'")
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
        self._margin_now = 0                         # what the last plan left free for Inductor's buffers
        self._slack_now = 0                          # ... and how far below nothing it may go (REPLAN_SLACK)
        self._extra: dict[tuple[str, ...], int] = {}  # region -> bytes more its margin leaves free (trials)
        self._planned_now: _Planned | None = None     # the plan of the compile in progress
        self._runs: dict[tuple[str, ...], InFlight] = {}
        self._sizes: dict[tuple[str, ...], PlannedSizes] = {}    # regions compiled for dynamic shapes
        self._largest: dict[tuple[str, ...], dict[tuple[str, int], int]] = {}  # region -> (input, dim) -> size
        self.peak = StepPeak()
        self._held: dict[tuple[str, ...], int] = {}      # region key -> bytes it keeps through its backward
        self._regions: dict[tuple[str, ...], RegionStats] = {}
        self._kept: dict[tuple[str, ...], int] = {}      # region key -> of its held bytes, what a plan may evict
        # graph breaks (hybridmem.compile.room): bytes a region leaves where its backward begins for the regions
        # compiled after it; a budget a region is planned at, above the budget, while the earlier ones make room;
        # the regions that asked for room; each region's compiled function, to plan again at its next call
        self._room: dict[tuple[str, ...], int] = {}
        self._lift: dict[tuple[str, ...], int] = {}
        self._asked: set[tuple[str, ...]] = set()
        self._replannable: dict[tuple[str, ...], Replannable] = {}
        self._renew: set[tuple[str, ...]] = set()
        self._current: tuple[str, ...] = ()
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
        compiled, sizes = self._build(key, tensors, gm, example_inputs)
        holder = self._replannable[key] = Replannable(compiled, lambda flat: self._replan(key, gm, flat))
        if key in self._renew:          # planned above the budget: again once the earlier regions made room
            self._renew.discard(key)
            holder.renew(skip=1)
        compiled = holder
        runs = self._runs.get(key)
        if runs is None:  # a recompile of a region (new shapes, an input that needs no grad) shares its count
            runs = self._runs[key] = InFlight(self.calls_per_step, lambda n: self._more_runs(key, n))
        if sizes.at:
            self._sizes[key] = sizes
        else:
            self._sizes.pop(key, None)
        return self.peak.wrap(runs.wrap(sizes.wrap(compiled)))

    def _build(self, key: tuple[str, ...], tensors: list[tuple[str, Any]], gm: fx.GraphModule,
               example_inputs: list[Any]) -> tuple[Any, PlannedSizes]:
        """Plan and compile region ``key`` (graph ``gm``) on ``example_inputs``; the compiled function and the
        sizes it was planned at."""
        self._current = key
        # compiled for any size: planned at the largest sizes compiled for before (the full batch, where a
        # smaller last batch made Dynamo compile the region again), which later calls are likely to bring
        at = planned_at(tensors, self._largest.setdefault(key, {}))
        self.peak.compiling()
        self._examples = example_inputs     # what the compress probe measures on; held while compiling only
        try:
            with planning_at(at):
                sizes = PlannedSizes(example_inputs, lambda above: self._larger(key, above))
                compiled = self._compile_checked(key, gm, example_inputs, sizes)
        finally:
            self._examples = None
            self.peak.compiled()
        return compiled, sizes

    def _replan(self, key: tuple[str, ...], gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        """Region ``key`` planned and compiled again on a call's inputs (:mod:`hybridmem.compile.room`): the
        regions compiled after it asked for room, or it was planned above the budget while they made it."""
        _, tensors = _region_key(gm, example_inputs)
        before = self._regions.get(key)
        compiled, _ = self._build(key, tensors, gm, example_inputs)
        st = self._regions.get(key)
        if st is not None and before is not None and st is not before:
            # planning time counts every plan made for the region
            st.plan_s += before.plan_s
            st.trial_s += before.trial_s
            st.room_replans = before.room_replans + 1
        return compiled

    def _larger(self, key: tuple[str, ...], above: dict[str, int]) -> None:
        st = self._regions.get(key)
        sizes = self._sizes.get(key)
        planned = _sizes(sizes.planned) if sizes is not None else "the sizes of the call that compiled it"
        warnings.warn(f"hybridmem compile: {st.name if st is not None else 'a region'} is compiled for dynamic "
                      f"shapes and was planned at {planned}; this call has {_sizes(above)}, so its step holds more "
                      "than the plan counted and may exceed the budget. Compile with static shapes "
                      "(torch.compile(..., dynamic=False)): each size then gets a plan of its own",
                      RuntimeWarning, stacklevel=2)

    def _more_runs(self, key: tuple[str, ...], n: int) -> None:
        st = self._regions.get(key)
        name = st.name if st is not None else "a region"
        held = f" of {fmt_bytes(st.saved_bytes)}" if st is not None else ""
        warnings.warn(f"hybridmem compile: {name} had {n} runs in flight (forwards whose backward had not "
                      f"begun: a block compiled once and called in a loop); its plan holds {self.calls_per_step}, "
                      f"so the step holds about {n - self.calls_per_step} more runs' saved tensors{held} each "
                      f"and may exceed the budget: compile_backend(calls_per_step={n}) plans for them",
                      RuntimeWarning, stacklevel=2)

    def _compile_checked(self, key: tuple[str, ...], gm: fx.GraphModule, example_inputs: list[Any],
                         sizes: PlannedSizes) -> Any:
        """:meth:`_compile_fitted`; where the region was planned above the budget, beside earlier regions that
        keep too much (:mod:`hybridmem.compile.room`), those are asked to make room, and it to plan again after
        them, at their next calls."""
        self._lift.pop(key, None)
        try:
            compiled = self._compile_fitted(key, gm, example_inputs, sizes)
        finally:
            lifted = self._lift.pop(key, None)
        st = self._regions.get(key)
        if lifted is not None and st is not None:
            self._ask_room(key, st)
        return compiled

    def _earlier(self, key: tuple[str, ...]) -> list[tuple[str, ...]]:
        """The regions compiled before ``key`` (all of them while it compiles for the first time)."""
        order = list(self._held)
        return order[:order.index(key)] if key in order else order

    def _may_lift(self, key: tuple[str, ...], e: BudgetInfeasibleError, budget: int) -> bool:
        """Whether region ``key``, which has no plan within ``budget`` beside the earlier regions (``e`` names the
        least budget it has one for), is planned at that budget while they make room: once, and only where
        what they keep and a plan may evict covers the difference."""
        if key in self._asked or e.minimum_bytes is None or self.calls_per_step > 1:
            return False
        short = int(e.minimum_bytes) - budget
        return 0 < short <= sum(self._kept.get(k, 0) for k in self._earlier(key))

    def _ask_room(self, key: tuple[str, ...], st: RegionStats) -> None:
        """Region ``key`` was planned at a share ``st`` above what the earlier regions leave: each of them leaves
        that share, and what the regions between hold, where its backward begins, planned again at its next
        call; ``key`` is planned again after them."""
        self._asked.add(key)
        earlier = self._earlier(key)
        # what its plan counts or, where more, what it held as run at compile time (its share holds a margin for
        # what Inductor holds beyond the count: the run says how much that was): planned again after them, it
        # has a plan within the count, its margin lowered as far as its run allows
        need = (min(st.budget_bytes, max(st.predicted_peak_bytes, st.trial_peak_bytes))
                if st.trial_peak_bytes else st.budget_bytes)
        for i, k in enumerate(earlier):
            room = need + sum(self._held.get(j, 0) for j in earlier[i + 1:])
            self._room[k] = max(self._room.get(k, 0), room)
            holder = self._replannable.get(k)
            if holder is not None:
                holder.renew()
        self._renew.add(key)
        over = st.budget_bytes - (self._budget_bytes(self._dev or torch.device("cpu")) - self._outside(key))
        st.add_note(f"planned {fmt_bytes(over)} above its share of the budget this once: the regions compiled before "
                    f"it keep more beside it; they are planned again at their next call, leaving it "
                    f"{fmt_bytes(need)} where their backward begins, and it after them")

    def _outside(self, key: tuple[str, ...]) -> int:
        """Bytes held outside region ``key`` while it runs: the optimizer's state, what the earlier regions keep."""
        return self.optimizer_bytes + sum(self._held.get(k, 0) for k in self._earlier(key))

    def _budget_for(self, key: tuple[str, ...], dev: torch.device) -> int:
        """The budget region ``key`` is planned at: the budget, or above it while earlier regions make room."""
        return self._lift.get(key) or self._budget_bytes(dev)

    def _compile_fitted(self, key: tuple[str, ...], gm: fx.GraphModule, example_inputs: list[Any],
                        sizes: PlannedSizes) -> Any:
        """Compile the region and, with ``verify``, run it once (:mod:`hybridmem.compile.trial`); where its real
        peak exceeds its share, plan and compile it again with the excess (and :data:`REPLAN_SLACK` of its
        keep-all peak) more left free, up to :data:`REPLANS` times; where that leaves the count no plan, once
        more with the count's least plan."""
        self._extra[key] = 0
        dev = self._dev or torch.device("cpu")
        native = cpumeter.load() if dev.type == "cpu" else None
        level = native.current_bytes if native is not None and native.installed else None   # before compiling
        runs: list[trial_mod.Trial] = []        # the runs of the plans tried, their real peaks with the other runs'
        compiled: Any = None
        st: RegionStats | None = None
        before = others = 0                      # the extra margin of the plan tried last; its other runs' bytes
        earlier_s = 0.0                          # the planning seconds of the plans made before this one
        least_tried = False
        shrunk = shrinks = 0                     # bytes the margin was lowered by to find a plan (the run checks it)
        unshrunk: BudgetInfeasibleError | None = None   # the error with the whole margin, raised where unchecked
        while True:
            self._planned_now = None
            if st is not None:
                earlier_s = st.plan_s           # the last plan's, which holds those before it
            try:
                compiled = self._compile(gm, example_inputs)
            except BudgetInfeasibleError as e:
                short = (e.minimum_bytes or 0) - self._budget_for(key, dev)
                if not runs and self.verify and shrinks < SHRINKS and e.minimum_bytes is not None \
                        and 0 < short <= self._margin_now + self._slack_now:
                    # a plan may fit with less left free for Inductor's buffers than the margin (a guess): plan
                    # with what the budget leaves (the least named is a bound: again with what the next error
                    # names, a few times); the run below measures the step and plans again where it holds more
                    shrinks += 1
                    shrunk, unshrunk = shrunk + short, unshrunk or e
                    self._extra[key] -= short
                    self._revision += 1
                    continue
                if not runs or st is None:
                    err = unshrunk or e
                    if self._may_lift(key, err, self._budget_bytes(dev)):
                        # the earlier regions keep too much beside it: planned at the least budget it has a plan
                        # for, with the whole margin, while they make room (_ask_room)
                        self._lift[key] = int(err.minimum_bytes)          # type: ignore[arg-type]
                        self._extra[key], shrunk, shrinks, unshrunk = 0, 0, SHRINKS, None
                        self._revision += 1
                        continue
                    if unshrunk is not None:
                        raise unshrunk from None
                    raise
                room = self._budget_for(key, dev) - st.min_budget_bytes   # above the least, with the last margin
                if not least_tried and room > 0:
                    # more left free than the count allows: its least plan, the one that recomputes most
                    least_tried = True
                    self._extra[key] = before + room
                    self._revision += 1
                    continue
                raise self._no_fit(st, key, dev, runs, compiled, example_inputs, level, others) from None
            st, planned = self._regions.get(key), self._planned_now
            if st is not None and earlier_s:
                st.plan_s += earlier_s          # every plan made for this compile counts as its planning
            if st is not None and shrunk and not runs:
                st.add_note(f"planned with {fmt_bytes(shrunk)} less left for Inductor's buffers than the margin "
                            f"(the budget leaves no more), checked by its run when compiled")
            if planned is None or st is None or not self.verify:
                return compiled          # no joint graph was planned (an inference region), or not asked
            if sizes.planned != sizes.compiled_at:
                if unshrunk is not None:
                    raise unshrunk         # a plan with less than the margin stands only where its run checks it
                st.add_note("not run at compile time (planned at larger sizes than the call that compiled it)")
                return compiled
            mutated = trial_mod.mutated_inputs(len(example_inputs))
            try:
                got = trial_mod.run(compiled, example_inputs, dev, mutated, cap_bytes=st.budget_bytes - planned.others_bytes,
                                    level=level, hold_outputs=self.hold_outputs)
            except Exception as e:      # a region that cannot run here: its plan stands as counted
                if unshrunk is not None:
                    raise unshrunk from e
                reason = str(e) if isinstance(e, trial_mod.NotMeasurable) else f"{type(e).__name__}: {str(e)[:160]}"
                st.add_note(f"not run at compile time ({reason})")
                warnings.warn(f"hybridmem compile: {st.name}: its compiled step could not be run once to measure its "
                              f"real peak ({reason}); the plan stands as counted, and the step may exceed the "
                              "budget by what Inductor holds beyond the count", RuntimeWarning, stacklevel=3)
                return compiled
            if st.codec_region:
                codec_ops.reset_stats(st.codec_region)     # a run at compile time is not a step
            others = planned.others_bytes
            if got.device_other_bytes and not any(k != key for k in self._held):
                # CUDA, the first region: the budget caps the allocator's bytes, and what it held besides this
                # region's inputs (library workspaces, other tensors) is in every step's peak. (A later region
                # runs beside the earlier ones' saved tensors, which its share already leaves out.)
                others += got.device_other_bytes
                if not runs:
                    st.add_note(f"the device held {fmt_bytes(got.device_other_bytes)} besides its inputs when it "
                                f"ran (CUDA workspaces, other tensors): counted in its peak")
            got = replace(got, peak_bytes=got.peak_bytes + others)
            runs.append(got)
            st.replans = len(runs) - 1
            st.trial_peak_bytes, st.trial_s = got.peak_bytes, sum(r.seconds for r in runs)
            if got.peak_bytes <= st.budget_bytes:
                return compiled
            if len(runs) > REPLANS:
                break
            before = self._extra[key]
            stopped = sum(r.refused for r in runs[:-1])
            slack = REPLAN_SLACK * (2 ** stopped if got.refused else 1)
            self._extra[key] += got.peak_bytes - st.budget_bytes + int(slack * st.keep_all_peak_bytes)
            self._revision += 1
        over = got.peak_bytes - st.budget_bytes
        st.add_note(f"its compiled step held {'more than ' if got.refused else ''}{fmt_bytes(got.peak_bytes)}, more "
                    f"than its share {fmt_bytes(st.budget_bytes)}, after {len(runs)} plans")
        warnings.warn(f"hybridmem compile: {st.name}'s compiled step, run once when it compiled, held "
                      f"{'more than ' if got.refused else ''}{fmt_bytes(got.peak_bytes)}, more than its share of the "
                      f"budget ({fmt_bytes(st.budget_bytes)}), after {len(runs)} plans each with more left free for "
                      f"Inductor's buffers: the steps will exceed the budget by {'more than ' if got.refused else ''}"
                      f"{fmt_bytes(over)}; a larger budget fits", RuntimeWarning, stacklevel=3)
        return compiled

    def _no_fit(self, st: RegionStats, key: tuple[str, ...], dev: torch.device, runs: list[Any], compiled: Any,
                example_inputs: list[Any], level: int | None, others: int) -> BudgetInfeasibleError:
        """The error for a region whose plans each held more than its share when run, and that has no plan
        with more left free. It names a budget a plan was measured to fit: the least a run held, with what is
        held outside the region; where every run was stopped at the share, the last plan's run to its end
        (at compile time, more than the budget: no step follows) says it."""
        budget = self._budget_for(key, dev)
        outside = budget - st.budget_bytes
        measured = [r.peak_bytes for r in runs if not r.refused]
        if not measured and compiled is not None:
            try:
                got = trial_mod.run(compiled, example_inputs, dev, trial_mod.mutated_inputs(len(example_inputs)),
                                    level=level, hold_outputs=self.hold_outputs)
                measured.append(got.peak_bytes + others)
            except Exception:     # the error then names the least the stopped runs needed
                pass
        lowest = min(r.peak_bytes for r in runs)
        if measured:
            need = min(measured) + outside
            says = f"A budget of {fmt_bytes(need)} ({need} B) fits: the least a plan held, with what is held outside it"
        else:
            need = lowest + outside
            says = (f"Its plans' runs were stopped at the share: a budget of at least {fmt_bytes(need)} ({need} B) "
                    "is needed")
        return BudgetInfeasibleError(
            f"hybridmem compile: {st.name} does not fit the budget {fmt_bytes(budget)} ({budget} B) as Inductor "
            f"compiles it: run once when it compiled, its plans' steps held {fmt_bytes(lowest)} at least (the last "
            f"plan counted {fmt_bytes(st.predicted_peak_bytes)} of the region's {fmt_bytes(st.budget_bytes)} share), "
            f"and with {fmt_bytes(self._extra[key])} more left free for Inductor's buffers it has no plan. "
            f"{says}", need)

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
        after them asked for room, :mod:`hybridmem.compile.room`); 0 once the steps run the plans that fit."""
        return sum(1 for h in self._replannable.values() if h.pending) + len(self._renew)

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
        for key, st in self._regions.items():
            runs = self._runs.get(key)
            st.runs_in_flight = runs.most if runs is not None else 0
            sizes = self._sizes.get(key)
            if sizes is not None:
                st.planned_sizes, st.sizes_above_plan = sizes.planned, dict(sizes.largest)
                st.compiled_sizes = dict(sizes.compiled_at)
            if st.codec_region:
                now = codec_ops.stats_for(st.codec_region)
                st.codec = replace(now, codecs=dict(now.codecs))
        return list(self._regions.values())

    # ---- planning ----------------------------------------------------------------------------
    def _solve(self, g: Any, budget: int | str, model: Any) -> Any:
        from .. import solvers
        return solvers.plan(g, budget, device=model, solver=self.solver, time_limit=self.time_limit)

    def _least_planned(self, variants: list["_Variant"], model: Any) -> int | None:
        """The least budget the solver has a plan for on any count of ``variants`` (the region's bytes: no
        margin, nothing held outside it); None where it finds none."""
        found = []
        for v in variants:
            for j in (v.jg, v.part):
                if j is None:
                    continue
                try:
                    found.append(int(self._solve(j.graph, "min", model).budget_bytes))
                except BudgetInfeasibleError:
                    continue
        return min(found) if found else None

    def _plan_realized(self, g: Any, share: int, model: Any, judge: Any) -> tuple[Any, int]:
        """A plan that fits ``share`` by its count or by its peak as PyTorch's partition runs it (``judge``:
        :func:`~hybridmem.compile.realized.realized_peak`). The partition recomputes some of what a plan
        keeps, so a plan for a budget above ``share`` may fit it as partitioned, and recomputes less. The
        plan at ``share`` (or, where the count has none, at the least budget it has one for) is taken
        where it fits; where that leaves :data:`REALIZED_HEADROOM` of ``share`` free, a bisection above it
        (:data:`REALIZED_PROBES` plans, for :data:`REALIZED_TIME_SHARE` times the first one's time at most)
        keeps the highest budget whose plan fits as partitioned. Returns the plan and the peak it was
        taken by; on failure the error names the least peak found."""
        def judged(b: int | str) -> tuple[Any, int, int] | None:
            try:
                p = self._solve(g, b, model)
            except BudgetInfeasibleError:
                return None
            count = int(p.predicted_peak_bytes)
            real = judge(p)
            return p, count, count if real is None else real

        t0 = time.perf_counter()
        first = judged(share)
        if first is None:
            first = judged("min")          # the count has no plan at the share: its least plan may fit
            if first is None:
                raise BudgetInfeasibleError("no plan", None)
            if first[2] > share:
                raise BudgetInfeasibleError("no plan fits as the partition runs it", min(first[1], first[2]))
        p, count, real = first
        best = (p, min(count, real))       # at the share the count fits, whatever the partition does
        if share - best[1] < REALIZED_HEADROOM * share:
            return best                    # nothing to gain above it
        lo, hi = int(p.budget_bytes) + 1, g.peak_bytes()
        stop = time.perf_counter() + REALIZED_TIME_SHARE * (time.perf_counter() - t0)
        for _ in range(REALIZED_PROBES):
            if lo > hi or time.perf_counter() > stop:
                break
            b = (lo + hi) // 2
            got = judged(b)
            if got is not None and got[2] <= share:
                best, lo = (got[0], got[2]), b + 1
            else:
                hi = b - 1
        return best

    def _plan_runs(self, g: Any, share: int, others: int, grads: int, model: Any) -> tuple[Any, int]:
        """A plan, and its peak with ``others`` more runs in flight beside it, that fits ``share``: each other
        run holds what the plan keeps for the backward beyond the ``grads`` bytes already set aside for it.

        The planners see one run. To make them weigh what the other runs hold, they plan a copy of the
        graph whose saved tensors are ``others + 1`` times their size (keeping one costs that much); each
        plan is then judged on the real graph with the other runs added, and a bisection over the copy's
        budget finds the highest one whose plan fits (6 plans at most). On failure the error names the
        least total any of those plans needs."""
        import copy

        from .. import solvers
        from ..graph.simulate import simulate

        if not others:
            p = self._solve(g, share, model)
            return p, int(p.predicted_peak_bytes)
        heavy = copy.deepcopy(g)
        for t in heavy.tensors:
            if t.saved and t.evictable:
                t.nbytes *= others + 1
        best: tuple[Any, int] | None = None
        least: int | None = None
        lo, hi = solvers.memory_floor(heavy, model), heavy.peak_bytes()
        for _ in range(6):
            if lo > hi:
                break
            b = (lo + hi) // 2
            try:
                p = self._solve(heavy, b, model)
            except BudgetInfeasibleError:
                lo = b + 1
                continue
            peak = simulate(g, p, model, budget=None, check_hash=False).peak_bytes
            need = int(peak) + others * max(_kept_bytes(g, p) - grads, 0)
            least = need if least is None else min(least, need)
            if need <= share:
                best, lo = (p, need), b + 1
            else:
                hi = b - 1
        if best is None:
            raise BudgetInfeasibleError("no plan of one run fits beside the other runs in flight", least)
        return best

    def _budget_bytes(self, dev: torch.device) -> int:
        if self._budget_b is None:
            if dev.type != "cuda":
                raise ValueError(f"budget {self.budget!r}: a percentage needs a CUDA device; this region runs "
                                 f"on {dev}: give bytes, e.g. '2GiB'")
            total = torch.cuda.get_device_properties(dev).total_memory
            return parse_bytes(self.budget, what="budget", total=total)
        return self._budget_b

    def _prepare(self, gm: fx.GraphModule, joint_inputs: Any, kwargs: dict[str, Any]) -> _Prepared:
        """Plan the joint graph ``gm`` and tag it; return what the partition's rewrite needs."""
        from torch._functorch import config as fconfig
        from torch._functorch.compile_utils import fx_graph_cse
        from torch._functorch.partitioners import classify_nodes

        from .. import solvers

        t0 = time.perf_counter()
        dev = self._dev or torch.device("cpu")
        can_swap = "swap" in self.policies and dev.type == "cuda"
        model = _cost_model(dev, self.cost_model_name, can_swap)
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

        def joint(saved_: set[fx.Node] | None) -> Any:
            return joint_graph(gm, forward, [p for i, p in enumerate(placeholders) if i in static_idx],
                               [a for a in out.args[0][:nfwd] if isinstance(a, fx.Node)], model,
                               name=f"region {len(self._regions) + 1}", fuse=fuse,
                               fuse_backward=fuse and not conv, saved=saved_, outputs_held=self.hold_outputs)

        # two counts of the region: every forward value the backward reads held from the forward (the
        # count plans are made on first), and the count of the partition PyTorch makes (what it
        # recomputes on its own read from its sources): closer to the real peak, tried where the first
        # has no plan (hybridmem.compile.defaults)
        jg = joint(None)
        jg_part = joint(saved) if saved is not None else None
        if "recompute" not in self.policies:
            for j in (jg, jg_part):      # no stage may be replayed: the planners keep, swap (or it compresses)
                for st_ in (j.graph.stages if j is not None else ()):
                    st_.deterministic = False
        t_scratch = time.perf_counter()
        if self.scratch:
            counts = [j for j in (jg, jg_part) if j is not None]
            note = measure_scratch(counts, dev, channels_last=fuse and conv and inductor_channels_last(gm))
            for j in counts:
                j.graph.meta["workspace"] = note
        t_scratch = time.perf_counter() - t_scratch
        g = jg.graph
        key = self._current
        budget = self._budget_for(key, dev)
        outside = self._outside(key)
        share = budget - outside
        # the margin scales with the step as it runs: the keep-all peak of the partition PyTorch makes where
        # that count is the lower (MobileNetV2: 40.6 MiB, where the first count's 56 MiB holds every forward
        # value the backward reads from the forward on)
        peak = min(j.graph.peak_bytes() for j in (jg, jg_part) if j is not None)
        share_free = (INDUCTOR_MARGIN_CONCAT if conv and concatenates_feature_maps(gm.graph.nodes)
                      else INDUCTOR_MARGIN if conv else INDUCTOR_MARGIN_NO_CONV)
        # and what a trial run of an earlier plan of this compile held beyond its share (_compile_checked)
        margin = (int(share_free * peak) if self.compiler == "inductor" else 0) + self._extra.get(key, 0)
        self._margin_now = margin
        # a count a little above the step as it runs (the partition recomputes some of what it keeps) may be
        # planned a little beyond the share: the run at compile time checks it
        self._slack_now = int(REPLAN_SLACK * peak) if self.compiler == "inductor" else 0
        name = f"region {list(self._regions).index(key) + 1 if key in self._regions else len(self._regions) + 1}"
        room = self._room.get(key, 0)
        if room:
            # the regions compiled after it run where its backward begins: their share is left free there (their
            # share holds their own margin: this region's is not counted twice; a margin lowered to find a plan,
            # which its run checks, lowers the room alike)
            for j in (jg, jg_part):
                if j is not None:
                    reserve(j.graph, room - (margin - self._extra.get(key, 0)))
        # each other run in flight (calls_per_step - 1) holds its inputs and parameters, and either what the
        # plan keeps for its backward (before it) or the gradients that backward made (after it)
        others = self.calls_per_step - 1
        fixed = g.fixed_bytes()
        grads = sum(t.nbytes for t in g.tensors if t.producer < 0 and t.kind == "param")
        outside += others * (fixed + grads)
        share -= others * (fixed + grads)
        base_s = float(model.op_times(g).sum())
        plain = _Variant("", jg, jg_part)
        variants = [plain]
        notes: list[str] = []
        t_codec = 0.0
        lazy: dict[str, Any] = {}

        def codecs() -> "_Codecs | None":
            """What compresses (measured once, where compress is allowed and the budget binds)."""
            nonlocal t_codec
            if "codecs" not in lazy:
                t1 = time.perf_counter()
                lazy["codecs"] = (self._codec_choices(gm, forward, jg, jg_part, model, notes)
                                  if "compress" in self.policies else None)
                t_codec += time.perf_counter() - t1
            return lazy["codecs"]

        def every() -> _Variant | None:
            """The counts with every candidate compressed (made once, where asked for)."""
            nonlocal t_codec
            if "every" not in lazy:
                t1 = time.perf_counter()
                c = codecs()
                lazy["every"] = c.variant("compress all", jg, jg_part, lambda j, order: order) if c else None
                t_codec += time.perf_counter() - t1
            return lazy["every"]

        def floor(v: _Variant) -> int:
            f = solvers.memory_floor(v.jg.graph, model)
            if v.part is not None and not others:
                f = min(f, solvers.memory_floor(v.part.graph, model))
            return f
        least_plain = floor(plain) + margin + outside
        least = least_plain
        if budget < least_plain and every() is not None:
            least = min(least, floor(every()) + margin + outside)
        if budget < least:
            # the floor is a bound no plan goes below; the error names the least budget a plan exists for
            # (a bisection of solves), so that the budget it names compiles
            region = None if others else self._least_planned([v for v in (plain, lazy.get("every")) if v], model)
            named = least if region is None else max(least, region + margin + outside)
            raise BudgetInfeasibleError(
                f"hybridmem compile: {name} has no plan within the budget {fmt_bytes(budget)} ({budget} B); "
                + (f"it needs at least {fmt_bytes(named)} ({named} B) with every evictable activation "
                   + ("recomputed, swapped or compressed" if lazy.get("every") else "recomputed or swapped")
                   if region is None else f"the least budget it has a plan for is {fmt_bytes(named)} ({named} B)")
                + f" ({fmt_bytes(named - outside)} in the region"
                + (f", of which {fmt_bytes(margin)} left for Inductor's buffers" if margin else "")
                + f"; {fmt_bytes(outside)} held outside it: the optimizer's state, the regions compiled "
                f"before" + (", the other runs' inputs, parameters and gradients" if others else "")
                + "); the compiled step's run at compile time checks that budget and names more where Inductor "
                "holds more than the plan counts", named)
        planned: list[_Planned] = []
        failures: list[BudgetInfeasibleError] = []

        def attempt(v: _Variant | None, least: bool = True) -> _Planned | None:
            """Plan count ``v``; ``least``: where it has no plan, find the least budget it has one for (a
            bisection of solves) for the error, which only a count that may be the last one tried needs."""
            nonlocal t_codec
            if v is None or any(v is w for w in variants[1:]):
                return None
            if v is not plain:
                variants.append(v)
            t_v = time.perf_counter()
            try:
                r = self._plan_variant(v, gm, joint_inputs, kwargs, share, margin, others, grads, model, name,
                                       least=least)
                planned.append(r)
                return r
            except BudgetInfeasibleError as e:
                failures.append(e)
                return None
            finally:
                if v is not plain:
                    t_codec += time.perf_counter() - t_v

        # below the floor of the count without compression no plan of it fits: only compression may
        first = attempt(plain) if budget >= least_plain else None
        hopeless = first is not None and first.plan is not None and not _codecs_could_pay(first, model, dev.type)
        if hopeless and "compress" in self.policies:
            notes.append("compression not tried: no recompute of the plan costs more per byte than the fastest "
                         "lossless codec would to free it")
        elif (first is None or first.plan is not None) and codecs() is not None:
            if first is not None:
                # hold compressed what that plan keeps, but the sources its recomputes replay from: the same
                # recomputes still fit, and the bytes compression frees may spare some of them. Not where the
                # codecs and the recomputes those bytes cannot spare cost more than that plan adds (it could
                # not be faster)
                d, ga = first.decisions, first.jg.graph
                sources = {x for t in d.recompute for x in ga.stages[ga.tensors[t].producer].inputs}
                evicted = set(d.recompute) | set(d.swap) | sources
                pick = lazy["codecs"].pick(first.jg, lambda order: [t for t in order if t not in evicted])
                if pick and lazy["codecs"].seconds(first.jg, pick) + _recompute_left_s(
                        first, model, lazy["codecs"].freed(first.jg, pick)) < first.time_s - base_s:
                    # the first plan stands if this one has none: no least budget to find for an error
                    attempt(lazy["codecs"].variant("compress what it keeps", first.jg, None, lambda j, order: pick),
                            least=False)
                elif pick:
                    notes.append("compression not tried: its codecs, with the recomputes the bytes they free cannot "
                                 "spare, would cost more than the recompute plan adds")
            else:
                attempt(every())
                # the most worth it, for about half the bytes compressing all would save: the plan recomputes
                # around them (compressing a recompute's source takes that recompute away). Compressing all
                # needs the least budget of the two: the error names it from there
                attempt(lazy["codecs"].variant("compress half", jg, jg_part, lazy["codecs"].half), least=False)
        if not planned:
            needs = [int(e.minimum_bytes) for e in failures if e.minimum_bytes is not None]
            if not needs:
                raise failures[0]
            least_need = min(needs)
            need = least_need + margin + outside
            raise BudgetInfeasibleError(
                f"hybridmem compile: {name} has no plan within the budget {fmt_bytes(budget)} ({budget} B); "
                f"the least budget it has a plan for is {fmt_bytes(need)} ({need} B): "
                f"{fmt_bytes(least_need)} in the region"
                + (f" with the other {others} runs' kept tensors" if others else "")
                + (f", {fmt_bytes(margin)} left for Inductor's buffers" if margin else "")
                + f", {fmt_bytes(outside)} held outside it (the optimizer's state, the regions compiled "
                f"before" + (", the other runs' inputs, parameters and gradients)" if others else ")")
                + ("" if self._can_evict() else f"; policies {list(self.policies)} evict nothing on {dev} (swap "
                   "needs CUDA): add recompute or compress"),
                need) from None
        best = min(planned, key=lambda r: r.time_s)     # the fastest plan; the first (less compressed) on a tie
        if len(variants) > 1:
            times = ", ".join(f"{v.name or 'no compression'} " + next(
                (f"{100 * (r.time_s / base_s - 1):+.1f} %" for r in planned if r.variant is v), "no plan")
                for v in variants)
            notes.append(f"compression {'chosen' if best.variant.compressed else 'not chosen'} (predicted {times})")
        st = self._region_stats_of(best, name, least, margin, share, base_s)
        if notes:
            st.note = "; ".join([*(x for x in [st.note] if x), *notes])
        jg, g = best.jg, best.jg.graph
        if best.plan is not None:
            apply_plan(jg, best.decisions)
        elif jg.compressed:
            apply_plan(jg, Decisions())
        beside = (fixed + st.compressed_to_bytes + (st.swapped_bytes if dev.type != "cuda" else 0)
                  + others * (fixed + max(st.saved_bytes, grads)))
        self._held[key] = beside + st.saved_bytes
        self._kept[key] = st.saved_bytes + st.compressed_to_bytes
        st.room_bytes = room
        if room:
            st.add_note(f"left {fmt_bytes(room)} where its backward begins for the regions compiled after it")
        st.runs_planned = self.calls_per_step
        st.plan_s = time.perf_counter() - t0
        st.scratch_s = t_scratch
        st.probe_s = t_probe
        st.codec_probe_s = t_codec
        st.solve_s = best.solve_s
        region = codec_ops.new_region() if best.variant.compressed else 0
        st.codec_region = region
        self._regions[key] = st
        self._planned_now = best
        return _Prepared(offload=bool(best.decisions.swap), region=region, stats=st, model=model, key=key,
                         held_beside=beside,
                         offloaded=[compressed_mod.storage_of(n) for t in best.decisions.swap
                                    for n in jg.forward_nodes_of(t)],
                         compressed=[best.variant.compressed[n.name] for n in jg.compressed.values()])

    def _held_as_partitioned(self, prep: _Prepared, fw: fx.GraphModule, bw: fx.GraphModule) -> None:
        """What region ``prep.key`` holds through its backward, by the tensors its partition's backward reads
        from its forward (:func:`~hybridmem.compile.defaults.saved_bytes`) rather than by the plan's count: the
        partition recomputes some of what a plan keeps (:mod:`hybridmem.compile.realized`), and the regions
        compiled after it plan beside what it really keeps."""
        dev = self._dev or torch.device("cpu")
        saved = saved_bytes(fw, bw, dev)
        self._held[prep.key] = prep.held_beside + saved
        self._kept[prep.key] = saved + (prep.stats.compressed_to_bytes if prep.stats is not None else 0)

    def _codec_choices(self, gm: fx.GraphModule, forward: list[fx.Node], jg: Any, jg_part: Any, model: Any,
                       notes: list[str]) -> "_Codecs | None":
        """The saved tensors of the region's counts a lossless codec shrinks to :data:`COMPRESS_MAX_RATIO` of
        their bytes or less, measured on the example inputs (:mod:`hybridmem.compile.probe`), most worth it
        first (recomputing their producer costs most more than the codec, per byte saved); None (``notes``
        says why) where none does or the forward cannot be measured."""
        fw = set(forward)
        found_in = {id(j): compressed_mod.candidates(j, fw) for j in (jg, jg_part) if j is not None}
        cands = {n for found in found_in.values() for n in found.values()}
        if not cands:
            return None
        if self._examples is None:
            notes.append("compression: no example inputs to measure the saved tensors on")
            return None
        try:
            measured = probe.measure(gm, forward, self._examples, cands)
        except Exception as e:     # an op the probe cannot run eagerly: plan without compression
            notes.append(f"compression: the forward could not be measured ({type(e).__name__}: {str(e)[:120]})")
            return None
        dev_type = (self._dev or torch.device("cpu")).type
        out = _Codecs(model, dev_type)
        for j in (jg, jg_part):
            if j is None:
                continue
            found = found_in[id(j)]
            picks: dict[int, compressed_mod.Compressed] = {}
            worth: dict[int, float] = {}
            for tid, n in found.items():
                got = measured.get(n.name)
                t = j.graph.tensors[tid]
                if got is None or got[1] > COMPRESS_MAX_RATIO * t.nbytes:
                    continue
                c = picks[tid] = compressed_mod.Compressed(n.name, got[0], t.nbytes, got[1],
                                                           compressed_mod.storage_of(n))
                codec_s = sum(codec_seconds(c.codec, c.nbytes, dev_type))
                worth[tid] = (model.op_time(j.graph.stages[t.producer]) - codec_s) / max(t.nbytes - c.size, 1)
            if picks:
                out.counts[id(j)] = (sorted(picks, key=lambda t: -worth[t]), picks, found)
        if not out.counts:
            notes.append(f"compression: no saved tensor compresses to {COMPRESS_MAX_RATIO:.0%} or less of its bytes")
            return None
        return out

    def _plan_variant(self, v: "_Variant", gm: fx.GraphModule, joint_inputs: Any, kwargs: dict[str, Any], share: int,
                      margin: int, others: int, grads: int, model: Any, name: str, least: bool = True) -> "_Planned":
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
            return _Planned(v, jg, None, Decisions(), peak, peak, time_s, 0.0,
                            "the share holds the keep-all peak: PyTorch's own partition"
                            + (" with the compressed tensors" if v.compressed else ""), others_keep_all)
        if not self._can_evict():
            # nothing but keeping (and the compression this count holds): its keep-all peak is the least
            raise BudgetInfeasibleError("no plan", peak + others_keep_all)
        try:
            try:
                p, predicted = self._plan_runs(g, share - margin, others, grads, model)
            except BudgetInfeasibleError:
                if jg_part is None or others:
                    raise
                part = jg_part

                def judge(p: Any) -> int | None:
                    return realized_peak(gm, joint_inputs, kwargs, part, p, decisions(p), model)
                p, predicted = self._plan_realized(part.graph, share - margin, model, judge)
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
        dev = self._dev or torch.device("cpu")
        note = ""
        if d.swap and not overlap(dev):
            # its copies would run on the compute stream: charged in full, against the plan without swaps
            p, time_s, note = cheaper(g, p, model, lambda m: self._solve(g, share - margin, m))
            p.predicted_time_s = time_s
            d = decisions(p)
            predicted = int(p.predicted_peak_bytes)
        if d.swap and not ("swap" in self.policies and dev.type == "cuda"):
            raise BudgetInfeasibleError(
                f"hybridmem compile: {name} fits {fmt_bytes(share)} only by swapping {len(d.swap)} tensor(s), "
                f"which a compiled graph on {dev} cannot (policies {list(self.policies)}); "
                + ("a larger budget lets recompute alone fit" if "recompute" in self.policies
                   else "policies with recompute or compress, or a larger budget, may fit"), None)
        time_s = float(p.predicted_time_s or 0.0)
        return _Planned(v, jg, p, d, peak, predicted, time_s, float(p.info.get("solve_s") or 0.0), note,
                        others * max(_kept_bytes(g, p) - grads, 0))

    def _can_evict(self) -> bool:
        """Whether a plan may evict anything: recompute, or swap on CUDA (compression is a count of its own)."""
        dev = self._dev or torch.device("cpu")
        return "recompute" in self.policies or ("swap" in self.policies and dev.type == "cuda")

    def _region_stats_of(self, r: "_Planned", name: str, least: int, margin: int, share: int,
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


def _kept_bytes(g: Any, p: Any) -> int:
    """Bytes of saved activations plan ``p`` keeps for the backward (neither recomputed nor swapped)."""
    d = decisions(p)
    evicted = set(d.recompute) | set(d.swap)
    return sum(t.nbytes for t in g.tensors if t.saved and t.evictable and t.id not in evicted)


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
