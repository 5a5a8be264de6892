"""STR's weighted graph coarsening: plan on ~100 super-stages, act on the full graph.

Grouping (:func:`coarsen_groups`): each stage weighs the bytes it produces (STR: node weight = activation
size). Repeatedly the lightest pair of stages adjacent in execution order is merged, never across the
forward/backward boundary and never into the loss stage (the last forward stage), until ``target``
groups remain. Graphs at or below ``threshold`` stages are planned as they are.

Planning on the groups does not go through :func:`hybridmem.graph.merge.merge_stages`: that function makes a
new graph whose merged stages read only the tensors produced outside them, which is right for running a
coarse graph but loses what a plan on the *full* graph needs: which fine stage produces each tensor
(a recompute replays that stage, whose inputs must be live at fine level) and which fine stages read it.
So :func:`solvers._common.build_problem` builds the coarse problem straight from the full graph and the
groups, with the same memory semantics as ``merge_stages`` (a group's memory is the maximum over its
stages), tensors made in one group and last read in one group evicted together as a bundle, and
recompute costs and sources taken from the fine producers. The plan found is written in fine-stage
actions (before a group's first stage / after its last) and validated by the simulator on the full graph.
:func:`coarse_graph` gives the merged graph itself (via ``merge_stages``) for inspection and reports.
"""
from __future__ import annotations

import heapq

from hybridmem.graph.ir import Graph
from hybridmem.graph.merge import merge_stages

THRESHOLD = 150      # graphs with more stages are coarsened
TARGET = 100         # super-stages to aim for (STR: 80-120)


def stage_weights(graph: Graph) -> list[int]:
    """Bytes each stage produces (its new output storages)."""
    return [sum(graph.tensors[x].nbytes for x in set(s.outputs)) for s in graph.stages]


def coarsen_groups(graph: Graph, target: int = TARGET) -> list[list[int]]:
    """Groups of consecutive stages: lightest adjacent pair merged first, phases and the loss kept apart."""
    n = graph.num_stages
    if n <= target:
        return [[i] for i in range(n)]
    w = stage_weights(graph)
    phase = [s.phase for s in graph.stages]
    loss = graph.num_forward - 1          # the last forward stage computes the loss
    # groups as a doubly linked list over their first stage
    first = list(range(n))
    last = list(range(n))
    weight = list(map(float, w))
    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    alive = [True] * n
    version = [0] * n

    def mergeable(a: int, b: int) -> bool:
        return phase[a] == phase[b] and loss not in (a, last[a], first[b], last[b]) and \
            not (first[a] <= loss <= last[a]) and not (first[b] <= loss <= last[b])

    heap: list[tuple[float, int, int, int, int]] = []

    def push(a: int) -> None:
        b = nxt[a]
        if b < n and mergeable(a, b):
            heapq.heappush(heap, (weight[a] + weight[b], first[a], a, version[a], version[b]))

    for a in range(n - 1):
        push(a)
    groups = n
    while groups > target and heap:
        _, _, a, va, vb = heapq.heappop(heap)
        if not alive[a] or version[a] != va:
            continue
        b = nxt[a]
        if b >= n or not alive[b] or version[b] != vb:
            continue
        # merge b into a
        last[a] = last[b]
        weight[a] += weight[b]
        alive[b] = False
        nxt[a] = nxt[b]
        if nxt[b] < n:
            prv[nxt[b]] = a
        version[a] += 1
        groups -= 1
        push(a)
        if prv[a] >= 0:
            push(prv[a])
    out = []
    a = 0
    while a < n:
        out.append(list(range(first[a], last[a] + 1)))
        a = nxt[a]
    return out


def coarse_graph(graph: Graph, groups: list[list[int]]) -> Graph:
    """The merged graph of ``groups`` (``hybridmem.graph.merge.merge_stages``), for inspection and reports."""

    return merge_stages(graph, groups)
