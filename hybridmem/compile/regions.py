"""What the backend knows of its compiled regions, and the room they leave one another at graph breaks.

:class:`RegionState` is one region's state across its compiles; :class:`Regions` keeps them by the region's
key (the names of its tensor inputs), in the order the regions were first planned.

**Graph breaks.** Dynamo compiles a model with graph breaks as several regions, each when a step first
reaches it: region 1's forward has run, and holds what it saves for its backward, before region 2 is
compiled; region 2's forward and backward then run between region 1's forward and backward (a language
model's loss after a break: the logits in, their gradient out). A region is planned for what the regions
compiled before it keep through their backward; it cannot know the regions after it. Where a later region
has no plan beside what the earlier ones keep, it is planned for this once at the least budget it has a
plan for (the step that compiles it may hold more than the budget, by what the earlier regions kept beyond
that), and each earlier region is planned again at its next call (:class:`Replannable`) with room for it at
the point where its backward begins (:func:`reserve`); the later region is then planned again too, after
them, with what they leave.

**Runs in flight** (:class:`InFlight`): a block compiled once and called in a loop (regional compilation:
Dynamo compiles one graph for all instances of a module class) runs its compiled forward several times
before the first of their backwards begins; each run holds its saved tensors until then. A region's plan is
made for the number of runs ``compile_backend(calls_per_step=)`` says (1 by default); the counter notices
more and says so.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import BudgetInfeasibleError
from ..graph.ir import Graph
from ..graph.units import fmt_bytes
from .sizes import PlannedSizes
from .stats import RegionStats

__all__ = ["Key", "RegionState", "Regions", "Replannable", "InFlight", "reserve"]

Key = tuple[str, ...]


@dataclass(eq=False)
class RegionState:
    """One compiled region's state across its compiles (new shapes, plans made again)."""

    stats: RegionStats | None = None       # its plan's figures; None until a joint graph of it was planned
    held: int = 0                          # bytes it keeps through its backward (what later regions plan beside)
    kept: int = 0                          # of those, what a plan may evict (saved and compressed tensors)
    extra: int = 0                         # bytes more its margin leaves free (trial runs of earlier plans)
    # graph breaks: bytes it leaves where its backward begins for the regions compiled after it; a budget it
    # is planned at, above the budget, while the earlier ones make room; whether it asked for room; whether
    # it is planned again at its next call but one, after them
    room: int = 0
    lift: int | None = None
    asked: bool = False
    renew: bool = False
    replannable: Replannable | None = None  # its compiled function, to plan again at its next call
    runs: InFlight | None = None            # its runs in flight (shared by its recompiles)
    sizes: PlannedSizes | None = None       # the sizes it is planned at, where compiled for dynamic shapes
    largest: dict[tuple[str, int], int] = field(default_factory=dict)  # (input, dim) -> largest size compiled
    size_replans: int = 0                   # compiles for sizes above its plan's


class Regions(dict[Key, RegionState]):
    """The backend's regions by key, in the order they were first planned, and the graph-break room between
    them (see the module docstring). ``budget_bytes(device)``: the backend's budget; ``state_bytes``: what
    is held outside every region (the optimizer's state); ``calls_per_step``: runs of a region in flight."""

    def __init__(self, budget_bytes: Callable[[torch.device], int], state_bytes: int, calls_per_step: int) -> None:
        super().__init__()
        self.budget_bytes, self.state_bytes, self.calls_per_step = budget_bytes, state_bytes, calls_per_step

    def planned(self) -> list[Key]:
        """The regions planned so far, in the order they were first planned."""
        return [k for k, r in self.items() if r.stats is not None]

    def mark_planned(self, key: Key, stats: RegionStats) -> None:
        """Record ``stats`` as region ``key``'s plan. A region planned for the first time moves to the end, so
        that their order is the order they were first planned in (a region may be compiled before it is
        planned: an inference graph first, or a compile that had no plan)."""
        r = self[key]
        if r.stats is None:
            self[key] = self.pop(key)
        r.stats = stats

    def earlier(self, key: Key) -> list[Key]:
        """The regions compiled before ``key`` (all of them while it compiles for the first time)."""
        order = self.planned()
        return order[:order.index(key)] if key in order else order

    def outside(self, key: Key) -> int:
        """Bytes held outside region ``key`` while it runs: the optimizer's state, what the earlier regions keep."""
        return self.state_bytes + sum(self[k].held for k in self.earlier(key))

    def budget_for(self, key: Key, dev: torch.device) -> int:
        """The budget region ``key`` is planned at: the budget, or above it while earlier regions make room."""
        return self[key].lift or self.budget_bytes(dev)

    def may_lift(self, key: Key, e: BudgetInfeasibleError, budget: int) -> bool:
        """Whether region ``key``, which has no plan within ``budget`` beside the earlier regions (``e`` names the
        least budget it has one for), is planned at that budget while they make room: once, and only where
        what they keep and a plan may evict covers the difference."""
        if self[key].asked or e.minimum_bytes is None or self.calls_per_step > 1:
            return False
        short = int(e.minimum_bytes) - budget
        return 0 < short <= sum(self[k].kept for k in self.earlier(key))

    def ask_room(self, key: Key, st: RegionStats, dev: torch.device) -> None:
        """Region ``key`` was planned at a share ``st`` above what the earlier regions leave: each of them leaves
        that share, and what the regions between hold, where its backward begins, planned again at its next
        call; ``key`` is planned again after them."""
        self[key].asked = True
        earlier = self.earlier(key)
        # what its plan counts or, where more, what it held as run at compile time (its share holds a margin for
        # what Inductor holds beyond the count: the run says how much that was): planned again after them, it
        # has a plan within the count, its margin lowered as far as its run allows
        need = (min(st.budget_bytes, max(st.predicted_peak_bytes, st.trial_peak_bytes))
                if st.trial_peak_bytes else st.budget_bytes)
        for i, k in enumerate(earlier):
            room = need + sum(self[j].held for j in earlier[i + 1:])
            r = self[k]
            r.room = max(r.room, room)
            if r.replannable is not None:
                r.replannable.renew()
        self[key].renew = True
        over = st.budget_bytes - (self.budget_bytes(dev) - self.outside(key))
        st.add_note(f"planned {fmt_bytes(over)} above its share of the budget this once: the regions compiled before "
                    f"it keep more beside it; they are planned again at their next call, leaving it "
                    f"{fmt_bytes(need)} where their backward begins, and it after them")

    def pending(self) -> int:
        """Regions to be planned and compiled again at their next call; 0 once the steps run the plans that fit."""
        return sum(1 for r in self.values() if r.replannable is not None and r.replannable.pending) \
            + sum(1 for r in self.values() if r.renew)


def reserve(g: Graph, room: int) -> int:
    """Make ``g`` hold ``room`` bytes more than it holds for itself where its backward begins (its tangents'
    stage): the bytes the regions compiled after it hold while they run there. Its outputs its backward does
    not read (where held) and its tangents, the values those regions read and the gradients they give back,
    are in their count and part of the room already: only the rest is added, as the stage's workspace.
    Returns the bytes added."""
    start = next((s.index for s in g.stages if s.phase != "forward"), None)
    if start is None or room <= 0:
        return 0
    n = g.num_stages
    made = set(g.stages[start].outputs)            # the tangents
    there = sum(t.nbytes for t in g.tensors
                if (t.id in made or (t.kind == "other" and 0 <= t.producer < start
                                     and all(c < start for c in t.consumers)))
                and t.first_stage() <= start <= t.last_stage(n))
    add = max(0, room - there)
    g.stages[start].workspace += add
    return add


class Replannable:
    """A compiled region whose compiled function is made again, by ``replan(example_inputs)``, at its next call
    once :meth:`renew` is asked (on that call's inputs, outside Dynamo: the region's graph is the one Dynamo
    gave the backend)."""

    def __init__(self, compiled: Callable[..., Any], replan: Callable[[list[Any]], Callable[..., Any]]) -> None:
        self.compiled, self.replan = compiled, replan
        self.pending = False
        self._skip = 0
        # AOTAutograd's boxed calling convention (one list argument, emptied by the call) must survive
        self._boxed_call = bool(getattr(compiled, "_boxed_call", False))

    def renew(self, skip: int = 0) -> None:
        """Plan and compile the region again at its next call but ``skip`` (1: the call the compile was made for,
        which runs the plan it has)."""
        self.pending, self._skip = True, skip

    def __call__(self, *args: Any) -> Any:
        if self.pending and self._skip:
            self._skip -= 1
        elif self.pending:
            self.pending = False
            # a boxed call passes one list (which the call empties), a plain one the inputs
            flat = list(args[0]) if len(args) == 1 and isinstance(args[0], list) else list(args)
            self.compiled = self.replan(flat)
        return self.compiled(*args)


class _Ticket:
    """One run: leaves the count when its backward begins or when its graph is freed without one."""

    __slots__ = ("counter", "done")

    def __init__(self, counter: "InFlight") -> None:
        self.counter, self.done = counter, False

    def leave(self, *_: Any) -> None:
        if not self.done:
            self.done = True
            self.counter.left()

    def __del__(self) -> None:  # the autograd node holding the hook died: the graph was freed
        self.leave()


class InFlight:
    """Counts a region's runs in flight. ``on_more(most)`` is called once, when the first backward begins
    (or a graph is freed) after more than ``planned`` runs were in flight: ``most`` is how many."""

    def __init__(self, planned: int, on_more: Callable[[int], None]) -> None:
        self.planned, self.on_more = planned, on_more
        self.live = 0
        self.most = 0
        self.told = False

    def left(self) -> None:
        self.live -= 1
        if self.most > self.planned and not self.told:
            self.told = True
            self.on_more(self.most)

    def wrap(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(compiled)
        def run(*args: Any) -> Any:
            out = compiled(*args)
            node = _grad_node(out)
            if node is not None:
                ticket = _Ticket(self)
                # the hook holds the ticket: it dies with the node if no backward ever runs
                node.register_prehook(lambda grads, t=ticket: t.leave())
                self.live += 1
                self.most = max(self.most, self.live)
            return out

        if getattr(compiled, "_boxed_call", False):
            run._boxed_call = True  # type: ignore[attr-defined]
        return run


def _grad_node(out: Any) -> Any:
    for t in (out if isinstance(out, (list, tuple)) else (out,)):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            return t.grad_fn
    return None
