"""The partition of a joint graph by a hybridmem plan.

PyTorch's own partitioner (``min_cut_rematerialization_partition``) decides which forward values the
backward reads as saved tensors and which it recomputes. It honours per-node checkpoint policies, so a
plan is applied by tagging nodes before it runs:

- **recompute** -> ``CheckpointPolicy.MUST_RECOMPUTE``: the backward replays the producing op (and, where
  PyTorch finds it cheaper, the pointwise ops before it);
- **swap** -> ``MUST_SAVE`` plus ``should_offload``: PyTorch's activation-offloading pass moves the saved
  tensor to the host after its last forward use and back before its first backward use, on a side
  stream with prefetch (CUDA only);
- **compress** -> ``MUST_SAVE`` on the node whose value the backward reads; after the partition the forward
  encodes it after its last read and saves the encoding's token instead (:mod:`hybridmem.compile.compressed`);
- **keep** -> no tag: the partitioner keeps its own choice, which never saves more than keeping does;
- what PyTorch's partition of the untagged graph recomputes (:mod:`hybridmem.compile.defaults`), which the
  plan counted as recomputed -> ``MUST_RECOMPUTE``, so that the plan's tags do not make it saved.

Nothing runs per op at run time: the compiled forward and backward are the partitioned graphs.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from ..graph.plan import Plan
from .joint import JointGraph

__all__ = ["Decisions", "apply_plan", "decisions", "remove_tags"]

TAG = "recompute"               # the node.meta key PyTorch's partitioner reads
OFFLOAD = "should_offload"      # the node.meta key its activation-offloading pass reads


@dataclass
class Decisions:
    """What a plan asked of one joint graph's saved tensors (ids of the hybridmem Graph)."""

    recompute: list[int] = field(default_factory=list)
    swap: list[int] = field(default_factory=list)

    def bytes_of(self, jg: JointGraph, which: str) -> int:
        return sum(jg.graph.tensors[t].nbytes for t in getattr(self, which))


def decisions(plan: Plan) -> Decisions:
    """The tensors ``plan`` recomputes and swaps (a tensor both swapped and recomputed counts as swapped:
    its host copy is what the backward reads first)."""
    swapped = sorted({a.tensor for a in plan.actions if a.kind == "swap_out"})
    rec = sorted({a.tensor for a in plan.actions if a.kind == "recompute"} - set(swapped))
    return Decisions(recompute=rec, swap=swapped)


def apply_plan(jg: JointGraph, d: Decisions) -> list[tuple[fx.Node, str]]:
    """Tag ``jg``'s nodes with ``d``'s decisions (see the module docstring). A node the user's own
    checkpointing tagged (``torch.utils.checkpoint`` inside the compiled code) keeps its tag. Returns the
    ``(node, meta key)`` pairs it set (:func:`remove_tags` takes them off again).

    With anything recomputed, the forward's random ops (Inductor's ``inductor_seeds``: the seeds its
    dropout masks are drawn from) are ``MUST_SAVE``: a recomputed mask is drawn again from the saved
    seed, so it equals the forward's bit for bit, where a seed drawn again would give another mask."""
    set_: list[tuple[fx.Node, str]] = []

    def tag(n: fx.Node, key: str, value: object, replace: bool = False) -> None:
        if key in n.meta and not replace:
            return
        if key not in n.meta:
            set_.append((n, key))
        n.meta[key] = value

    for n in jg.recomputed:      # what PyTorch's own partition recomputes, as the plan counted it
        tag(n, TAG, CheckpointPolicy.MUST_RECOMPUTE)
    if d.recompute:
        for s, n in zip(jg.graph.stages, jg.stage_node):
            if s.rng and s.phase == "forward":
                tag(n, TAG, CheckpointPolicy.MUST_SAVE)
    for tid in d.recompute:
        for n in jg.forward_nodes_of(tid):
            tag(n, TAG, CheckpointPolicy.MUST_RECOMPUTE)
    for n in jg.compressed.values():     # saved as it is: the partition's rewrite encodes it
        tag(n, TAG, CheckpointPolicy.MUST_SAVE)
    for tid in d.swap:
        for n in jg.forward_nodes_of(tid):
            tag(n, TAG, CheckpointPolicy.MUST_SAVE)
            # the offload pass moves the value the backward reads: the getitem for a multi-output op
            if n.target is operator.getitem or len(jg.forward_nodes_of(tid)) == 1:
                tag(n, OFFLOAD, True, replace=True)
    return set_


def remove_tags(tags: list[tuple[fx.Node, str]]) -> None:
    """Take off the tags :func:`apply_plan` set."""
    for n, key in tags:
        n.meta.pop(key, None)
