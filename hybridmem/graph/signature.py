"""A step's op signature and the runtime annotation a plan carries (what :mod:`hybridmem.runtime.follow`
checks and follows).

The *op signature* is a hash of the step's stage op names, in order. It does not depend on module names,
tensor lifetimes or evictions, so the runtime can compute it from the very first step, even while the
online scorer is evicting. :func:`annotate`, done when a plan is made, adds per action tensor its producer
stage and output index (and size), the number of ops per stage (module-granularity plans) and the signature.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from .merge import MAX_OP_CHARS as _MAX_OP_CHARS  # merged stage names
from .plan import Plan

if TYPE_CHECKING:
    from .ir import Graph

__all__ = ["op_signature", "graph_signature", "step_stages", "annotate"]


def op_signature(ops: list[str], group_sizes: list[int] | None = None) -> str:
    """Hash of a step's stage op names, in order; with ``group_sizes``, of the merged stages (runs of
    that many ops) named as ``merge_stages`` names them. Phases are left out: ``backward()`` makes the
    gradient seed (``ones_like``) before the autograd engine starts, so where the backward begins is a
    matter of definition, not of the program."""
    h = hashlib.sha256()
    if group_sizes is None:
        for op in ops:
            h.update(f"{op}\n".encode())
    else:
        i = 0
        for n in group_sizes:
            h.update(f"{_merged_name(ops[i:i + n])}|{n}\n".encode())
            i += n
        if i != len(ops):
            h.update(f"extra {len(ops) - i}".encode())
    return h.hexdigest()[:16]


def _merged_name(names: list[str]) -> str:
    ops = list(dict.fromkeys(names))
    op = "+".join(ops)
    if len(op) > _MAX_OP_CHARS:
        op = op[:_MAX_OP_CHARS].rsplit("+", 1)[0] + f"+...({len(ops)} ops)"
    return op


def step_stages(graph: "Graph") -> list[Any]:
    """The stages a training step runs, forward and backward: a graph captured with ``optimizer_step=True``
    ends with the optimizer's, which run between steps, where the runtime observes no stage."""
    return [s for s in graph.stages if s.phase != "optimizer"]


def graph_signature(graph: "Graph") -> str:
    """The op signature of a captured graph's step (op or module granularity)."""
    stages = step_stages(graph)
    if all(s.ops == 1 for s in stages):
        return op_signature([s.op for s in stages])
    h = hashlib.sha256()
    for s in stages:
        h.update(f"{s.op}|{s.ops}\n".encode())
    return h.hexdigest()[:16]


def annotate(plan: Plan, graph: "Graph") -> Plan:
    """Add what the runtime needs to follow ``plan`` (made for ``graph``) to ``plan.info["runtime"]``."""
    stages = step_stages(graph)
    tensors: dict[str, list[int]] = {}
    for a in plan.actions:
        t = graph.tensors[a.tensor]
        if t.producer < 0 or t.producer >= len(stages):
            continue
        outs = graph.stages[t.producer].outputs
        tensors[str(a.tensor)] = [t.producer, outs.index(t.id), t.nbytes]
    ann: dict[str, Any] = {"signature": graph_signature(graph), "stages": len(stages), "tensors": tensors}
    groups = [s.ops for s in stages]
    if any(n != 1 for n in groups):
        ann["ops_per_stage"] = groups
    plan.info["runtime"] = ann
    return plan
