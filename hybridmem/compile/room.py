"""Room a compiled region leaves for the regions compiled after it (graph breaks).

Dynamo compiles a model with graph breaks as several regions, each when a step first reaches it: region 1's
forward has run, and holds what it saves for its backward, before region 2 is compiled; region 2's forward
and backward then run between region 1's forward and backward (a language model's loss after a break:
the logits in, their gradient out). A region is planned for what the regions compiled before it keep
through their backward; it cannot know the regions after it. Where a later region has no plan beside what
the earlier ones keep, it is planned for this once at the least budget it has a plan for (the step that
compiles it may hold more than the budget, by what the earlier regions kept beyond that), and each earlier
region is planned again at its next call with room for it at the point where its backward begins
(:func:`reserve`); the later region is then planned again too, after them, with what they leave.
"""
from __future__ import annotations

from typing import Any, Callable

from ..graph.ir import Graph

__all__ = ["Replannable", "reserve"]


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
