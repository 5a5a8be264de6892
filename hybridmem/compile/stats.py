"""What the compiled backend decided and measured: per region (:class:`RegionStats`) and for the whole
backend (:class:`CompileStats`, ``backend.stats()``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..graph.units import fmt_bytes
from . import codec_ops


@dataclass
class RegionStats:
    """What was decided for one compiled region (one joint forward-backward graph)."""

    name: str
    stages: int                       # ops of the joint graph (forward + backward)
    forward_stages: int
    keep_all_peak_bytes: int          # the graph's peak with every saved tensor kept, op by op
    min_budget_bytes: int             # no budget below this can fit the region (outside bytes included)
    budget_bytes: int                 # this region's share of the budget
    margin_bytes: int                 # of the share, left free for the compiler's own buffers (tuning.INDUCTOR_MARGIN)
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
    # graph breaks (hybridmem.compile.regions): bytes left where its backward begins for the regions compiled after
    # it, and the times it was planned again at a later call for them
    room_bytes: int = 0
    room_replans: int = 0
    note: str = ""
    # saved tensors its forward hands the backward as host tokens (offload, compress ops): CUDA graphs
    # (cudagraph trees) skip a graph that holds one
    host_tokens: int = 0
    # what the compress ops did in the steps run so far (None: nothing compressed)
    codec: codec_ops.CodecStats | None = None
    codec_region: int = 0             # the compress ops' region id (0: none)
    # compiled for dynamic shapes: the sizes (symbol -> value) the plan was made at (a call with a larger size
    # makes Dynamo compile the region again, planned at that size: hybridmem.compile.sizes), and how many
    # times the region was compiled again so
    planned_sizes: dict[str, int] = field(default_factory=dict)
    compiled_sizes: dict[str, int] = field(default_factory=dict)   # ... the sizes of the call that compiled it
    size_replans: int = 0
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
                + (f"; compiled for dynamic shapes, planned at {sizes_line(r.planned_sizes)}"
                   + (f" (the largest compiled for; this compile's call had {sizes_line(r.compiled_sizes)})"
                      if r.compiled_sizes != r.planned_sizes else "") if r.planned_sizes else "")
                + (f"; compiled again for larger sizes {r.size_replans} time(s)" if r.size_replans else "")
                + (f"\n    {r.name}: compressed {codec_line(r.codec)}"
                   if r.codec is not None and r.codec.packed else ""))
        return "\n".join(lines)


def codec_line(c: codec_ops.CodecStats) -> str:
    """What the compress ops did: tensors, bytes before and after, time, and bytes over the plan's count."""
    codecs = ", ".join(f"{k} {v}" for k, v in sorted(c.codecs.items()))
    raw = f", {c.raw} left as they were" if c.raw else ""
    over = (f"; {fmt_bytes(c.over_plan_bytes)} more than the plan counted (the data compressed worse than when "
            "the region compiled)") if c.over_plan_bytes else ""
    return (f"{c.packed} saved tensor(s) in the steps so far ({codecs}{raw}): {fmt_bytes(c.bytes_in)} to "
            f"{fmt_bytes(c.bytes_out)}, encode {c.encode_s * 1e3:.1f} ms, decode {c.decode_s * 1e3:.1f} ms{over}")


def sizes_line(sizes: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())
