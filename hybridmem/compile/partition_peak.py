"""The partition PyTorch makes of a joint graph under a plan's tags, and the peak it holds.

A plan keeps some saved tensors with no tag ("keep": the partitioner's own choice). Given the
``MUST_RECOMPUTE`` tags around them, PyTorch's min-cut often recomputes a kept tensor as well, from
values it saves anyway; Inductor then computes it inside the backward kernel that reads it, and it is
never stored (on the zoo's GPT, a third of what a plan kept: docs/benchmarks.md, "Measured constants and design choices"). :func:`realized_peak`
partitions a copy of the tagged joint graph and counts the plan as that partition runs it: a kept
tensor the partition does not save is live in the forward only and, where it is made by pointwise ops and
views only and read in the backward by pointwise or reduction kernels (what Inductor fuses), never stored
in the backward; one made or read otherwise (a matrix product) is counted again from the backward's start
(on the transformer Inductor computed such recomputes of all layers in the backward's first kernel). One
a recompute of the plan replays from stays counted as kept.
"""
from __future__ import annotations

import copy
from typing import Any

from torch import fx

from ..graph.ir import Graph, TensorInfo
from ..graph.plan import Plan
from ..graph.simulate import simulate
from .defaults import saved_by_partition
from .fusion import computes_inputs, fusible
from .joint import JointGraph
from .partition import Decisions, apply_plan, remove_tags

__all__ = ["realized_peak"]


def realized_peak(gm: fx.GraphModule, joint_inputs: Any, kwargs: dict[str, Any], jg: JointGraph, plan: Plan,
                  d: Decisions, model: Any) -> int | None:
    """The peak of ``plan`` (decisions ``d``) on ``jg``'s graph as PyTorch's partition of ``gm`` under its tags
    runs it; None if that partition fails (the plan's own count then stands)."""
    tags = apply_plan(jg, d)
    try:
        saved = saved_by_partition(gm, joint_inputs, kwargs)
    finally:
        remove_tags(tags)
    if saved is None:
        return None
    g = jg.graph
    evicted = set(d.recompute) | set(d.swap)
    # what the plan's own recomputes replay from stays as counted (resident when they run)
    sources = {x for t in d.recompute for x in g.stages[g.tensors[t].producer].inputs}
    inlined: list[int] = []
    remade: list[int] = []
    for t in g.tensors:
        if (not t.saved or not t.evictable or t.id in evicted or t.id in sources
                or any(n in saved for n in jg.tensor_nodes.get(t.id, ()))):
            continue
        fused = all(fusible(n) for n in jg.forward_nodes_of(t.id)) and all(
            computes_inputs(jg.stage_node[c]) for c in t.consumers if g.stages[c].phase == "backward")
        (inlined if fused else remade).append(t.id)
    if inlined or remade:
        g = _as_partitioned(g, inlined, remade)
    return int(simulate(g, plan, model, budget=None, check_hash=False).peak_bytes)


def _as_partitioned(g: Graph, inlined: list[int], remade: list[int]) -> Graph:
    """A copy of ``g`` where the backward no longer reads the forward's tensors ``inlined`` (it recomputes
    them inside the kernels that read them) and reads the tensors ``remade`` from a copy made at its start
    (Inductor may compute such recomputes in one kernel before the first backward op: on the transformer it
    did); both are freed after their last forward read."""
    out = copy.deepcopy(g)
    start = next(s.index for s in out.stages if s.phase == "backward")
    fused = set(inlined)
    for tid in [*inlined, *remade]:
        t = out.tensors[tid]
        back = [c for c in t.consumers if out.stages[c].phase == "backward"]
        t.consumers = [c for c in t.consumers if c not in back]
        t.freed_after = max([t.producer, *t.consumers])
        t.saved = False
        if tid in fused:
            for c in back:
                out.stages[c].inputs = [x for x in out.stages[c].inputs if x != tid]
            continue
        new = TensorInfo(id=len(out.tensors), nbytes=t.nbytes, dtype=t.dtype, shape=t.shape, kind="activation",
                         producer=start, consumers=back, freed_after=back[-1], name=f"{t.name}.remade")
        out.tensors.append(new)
        out.stages[new.producer].outputs.append(new.id)
        for c in back:
            out.stages[c].inputs = [new.id if x == tid else x for x in out.stages[c].inputs]
    return out
