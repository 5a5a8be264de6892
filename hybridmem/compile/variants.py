"""The counts of a region the planners may plan on (as traced, with half or all of what compresses
compressed), what a plan made on one is, and what the partition needs from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import fx

from ..plugins.codecs import LOSSLESS
from ..plugins.compress import codec_seconds
from . import compressed as compressed_mod
from .partition import Decisions
from .stats import RegionStats


@dataclass(eq=False)
class Variant:
    """One count of a region (and its partition's count) the planners may plan on."""

    name: str                                     # "", "compress half", "compress" or "compress all"
    jg: Any
    part: Any
    compressed: dict[str, compressed_mod.Compressed] = field(default_factory=dict)  # node name -> measured


class Codecs:
    """What compresses in a region's counts (:meth:`~hybridmem.compile.planner.Planner._codec_choices`), and the
    counts that hold a choice of it compressed."""

    def __init__(self, model: Any, device_type: str) -> None:
        self.model, self.device_type = model, device_type
        # id(count) -> (its compressible tensors, most worth it first; what the probe measured; their nodes)
        self.counts: dict[int, tuple[list[int], dict[int, compressed_mod.Compressed], dict[int, fx.Node]]] = {}

    def variant(self, name: str, jg: Any, part: Any, select: Any) -> Variant | None:
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
        return Variant(name, made[0] if made[0] is not None else jg, made[1], specs)

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


def recompute_costs(first: "Planned", model: Any) -> list[tuple[float, int]]:
    """(seconds, bytes) of each tensor ``first``'s plan recomputes: its producer's time, its bytes."""
    g = first.jg.graph
    return [(model.op_time(g.stages[g.tensors[t].producer]), g.tensors[t].nbytes) for t in first.decisions.recompute]


def codecs_could_pay(first: "Planned", model: Any, device_type: str) -> bool:
    """Whether compressing what a plan keeps could spare any of its recomputes at a profit, before measuring
    anything (the probe runs the forward eagerly, and a second plan may be solved: seconds on ResNet-50): a
    recompute is spared by freeing its bytes, and no lossless codec frees a byte for less than its encode and
    decode time of that byte. A plan that swaps is not judged here."""
    if first.decisions.swap:
        return True
    per_byte = min(sum(codec_seconds(name, 1 << 30, device_type)) for name in LOSSLESS) / (1 << 30)
    return any(seconds > per_byte * nbytes for seconds, nbytes in recompute_costs(first, model))


def recompute_left_s(first: "Planned", model: Any, freed: int) -> float:
    """The least recompute time a plan that frees ``freed`` more bytes by compression still pays beside
    ``first``'s: its recomputes' bytes beyond ``freed``, the cheapest per byte first (their producers' times;
    a bound: bytes freed anywhere are counted as if freed at the peak)."""
    costs = recompute_costs(first, model)
    left = sum(nbytes for _, nbytes in costs) - freed
    seconds = 0.0
    for rate, nbytes in sorted((s / max(n, 1), n) for s, n in costs):
        if left <= 0:
            break
        seconds += rate * min(nbytes, left)
        left -= nbytes
    return seconds


@dataclass
class Planned:
    variant: Variant
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
class Prepared:
    """What the partition function needs after planning: whether to offload, what to compress."""

    offload: bool = False
    compressed: list[compressed_mod.Compressed] = field(default_factory=list)
    region: int = 0
    stats: RegionStats | None = None
    model: Any = None            # the cost model the region was planned with (times the offloading's reloads)
    key: tuple[str, ...] = ()
    held_beside: int = 0         # of what the region holds through its backward, all but its saved tensors
    offloaded: list[Any] = field(default_factory=list)   # the storages of the values the plan swaps
