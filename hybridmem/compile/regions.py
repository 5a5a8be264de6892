"""What the backend knows of each compiled region (:class:`RegionState`), kept in one dict by the region's key
(the names of its tensor inputs), in the order the regions were first planned: a region is planned for what
the regions planned before it keep through their backward (:mod:`hybridmem.compile.room`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .room import Replannable
from .runs import InFlight
from .sizes import PlannedSizes
from .stats import RegionStats

__all__ = ["Key", "RegionState", "planned_keys", "mark_planned"]

Key = tuple[str, ...]


@dataclass(eq=False)
class RegionState:
    """One compiled region's state across its compiles (new shapes, plans made again)."""

    stats: RegionStats | None = None       # its plan's figures; None until a joint graph of it was planned
    held: int = 0                          # bytes it keeps through its backward (what later regions plan beside)
    kept: int = 0                          # of those, what a plan may evict (saved and compressed tensors)
    extra: int = 0                         # bytes more its margin leaves free (trial runs of earlier plans)
    # graph breaks (hybridmem.compile.room): bytes it leaves where its backward begins for the regions compiled
    # after it; a budget it is planned at, above the budget, while the earlier ones make room; whether it asked
    # for room; whether it is planned again at its next call but one, after them
    room: int = 0
    lift: int | None = None
    asked: bool = False
    renew: bool = False
    replannable: Replannable | None = None  # its compiled function, to plan again at its next call
    runs: InFlight | None = None            # its runs in flight (shared by its recompiles)
    sizes: PlannedSizes | None = None       # the sizes it is planned at, where compiled for dynamic shapes
    largest: dict[tuple[str, int], int] = field(default_factory=dict)  # (input, dim) -> largest size compiled
    size_replans: int = 0                   # compiles for sizes above its plan's


def planned_keys(regions: dict[Key, RegionState]) -> list[Key]:
    """The regions planned so far, in the order they were first planned."""
    return [k for k, r in regions.items() if r.stats is not None]


def mark_planned(regions: dict[Key, RegionState], key: Key, stats: RegionStats) -> None:
    """Record ``stats`` as region ``key``'s plan. A region planned for the first time moves to the end of
    ``regions``, so that their order is the order they were first planned in (a region may be compiled
    before it is planned: an inference graph first, or a compile that had no plan)."""
    r = regions[key]
    if r.stats is None:
        regions[key] = regions.pop(key)
    r.stats = stats
