"""Coarsen a :class:`Graph`: merge runs of consecutive stages into one stage (``capture(granularity=
"module")``, and the solvers' coarsening for inspection)."""
from __future__ import annotations

import copy
import math
from typing import Sequence

from .ir import Graph, Stage, TensorInfo, link_consumers

MAX_OP_CHARS = 96  # a merged stage's op name: its ops joined by "+", cut to this length


def module_groups(graph: Graph) -> list[list[int]]:
    """Runs of consecutive stages with the same (phase, module): the ``granularity="module"`` groups."""
    groups: list[list[int]] = []
    prev: tuple[str, str] | None = None
    for s in graph.stages:
        key = (s.phase, s.module)
        if key != prev:
            groups.append([])
            prev = key
        groups[-1].append(s.index)
    return groups


def merge_stages(graph: Graph, groups: Sequence[Sequence[int]]) -> Graph:
    """Merge each group of consecutive stages into one stage; return a new, densely indexed Graph.

    ``groups`` must cover every stage once, in order, each a run of consecutive indices within one
    phase. A merged stage reads the tensors its ops read that were produced outside it and produces
    those its ops produced that are still alive after it; tensors produced and freed inside it
    disappear, their memory kept as ``workspace``: the merged stage's memory (``memory_profile``)
    is the maximum of its ops' memory. (It can be higher when the group holds an input that an early op
    frees together with an output of a late op: an atomic stage needs both.) Costs, FLOPs and bytes
    add up; ``rng`` and ``side_effect`` are OR-ed and ``deterministic`` AND-ed; ``writes`` keeps the in-place
    writes into tensors produced outside the group.
    """
    n = graph.num_stages
    flat = [i for g in groups for i in g]
    if flat != list(range(n)) or any(len(g) == 0 for g in groups):
        raise ValueError(f"groups must cover stages 0..{n - 1} once, in order, as non-empty runs")
    group_of = [0] * n
    for gi, g in enumerate(groups):
        for i in g:
            group_of[i] = gi
        if len({graph.stages[i].phase for i in g}) > 1:
            raise ValueError(f"group {gi} (stages {g[0]}..{g[-1]}) mixes phases")

    # which tensors survive, and their new lifetimes
    new_id: dict[int, int] = {}
    tensors: list[TensorInfo] = []
    for t in graph.tensors:
        if t.producer >= 0:
            pg = group_of[t.producer]
            if t.freed_after is not None and group_of[t.freed_after] == pg:
                continue  # produced and freed inside one group: becomes workspace
        nt = copy.copy(t)
        nt.id = len(tensors)
        nt.producer = group_of[t.producer] if t.producer >= 0 else -1
        nt.freed_after = None if t.freed_after is None else group_of[t.freed_after]
        nt.consumers = []
        new_id[t.id] = nt.id
        tensors.append(nt)

    stages: list[Stage] = []
    counts: dict[tuple[str, str, str], int] = {}
    for gi, g in enumerate(groups):
        members = [graph.stages[i] for i in g]
        inputs: dict[int, None] = {}
        outputs: dict[int, None] = {}
        writes: dict[int, None] = {}
        for s in members:
            for old in s.inputs:
                j = new_id.get(old)
                if j is not None and tensors[j].producer != gi:
                    inputs[j] = None
            for old in s.outputs:
                j = new_id.get(old)
                if j is not None:
                    outputs[j] = None
            for old in s.writes:
                # a write into a tensor made inside the group is part of making it (replaying the group
                # replays it); one into a tensor from outside is a write of the merged stage
                j = new_id.get(old)
                if j is not None and tensors[j].producer != gi:
                    writes[j] = None
        ops = list(dict.fromkeys(s.op for s in members))
        op = "+".join(ops)
        if len(op) > MAX_OP_CHARS:
            op = op[:MAX_OP_CHARS].rsplit("+", 1)[0] + f"+...({len(ops)} ops)"
        module = _common_module([s.module for s in members])
        phase = members[0].phase
        key = (phase, module, op)
        k = counts.get(key, 0)
        counts[key] = k + 1
        stages.append(Stage(
            index=gi, id=f"{phase}/{module}/{op}#{k}", op=op, module=module, phase=phase,
            cost_s=math.fsum(s.cost_s for s in members), flops=math.fsum(s.flops for s in members),
            bytes_accessed=sum(s.bytes_accessed for s in members), inputs=list(inputs), outputs=list(outputs),
            writes=list(writes),
            rng=any(s.rng for s in members), side_effect=any(s.side_effect for s in members),
            deterministic=all(s.deterministic for s in members), ops=sum(s.ops for s in members)))

    meta = dict(graph.meta)
    if isinstance(meta.get("measured_cost_s"), list) and len(meta["measured_cost_s"]) == n:
        m = meta["measured_cost_s"]
        meta["measured_cost_s"] = [math.fsum(m[i] for i in g) for g in groups]
    if isinstance(meta.get("mutations"), list):
        meta["mutations"] = [[group_of[s], new_id[t]] for s, t in meta["mutations"] if t in new_id]
    meta["merged_from_stages"] = n
    meta["granularity"] = "merged"
    merged = Graph(stages, tensors, meta)
    link_consumers(merged.stages, tensors)

    # workspace: make each merged stage's memory the maximum of its members' memory
    before = graph.memory_profile()
    base = merged.memory_profile()  # workspaces are still 0 here
    for gi, g in enumerate(groups):
        merged.stages[gi].workspace = max(0, int(before[g[0]:g[-1] + 1].max()) - int(base[gi]))
    return merged.validate()


def _common_module(paths: list[str]) -> str:
    first = paths[0]
    if all(p == first for p in paths):
        return first
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for level in zip(*parts):
        if any(x != level[0] for x in level):
            break
        common.append(level[0])
    return ".".join(common)
