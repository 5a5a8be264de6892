"""What Inductor runs as one kernel, as the joint graph's count sees it: pointwise chains fused into their
reader (:func:`fusion_groups`), values recomputed inside the kernels that read them (:func:`recomputed_reads`),
and what a fused stage launches and still stores (:func:`kernels`, :func:`materialized`)."""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from .fxnodes import aliases, is_random, seeded, storage_key, tensor_vals

__all__ = ["MAX_INLINED_USERS", "MAX_INLINED_READS", "computes_inputs", "fusible", "fusion_groups", "kernels",
           "materialized", "recomputed_reads", "reduction"]


def _pointwise(n: fx.Node) -> bool:
    return (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and (torch.Tag.pointwise in n.target.tags or seeded(n)) and not is_random(n))


# Reductions Inductor lowers by reading their input's inner function: a pointwise input is computed in
# the reduction's own loop, never stored
_REDUCTIONS = (torch.ops.aten.sum, torch.ops.aten.amax, torch.ops.aten.amin, torch.ops.aten.mean)
# Views Inductor indexes through: a pointwise value read through one of them is still inlined
_VIEWS = (torch.ops.aten.view, torch.ops.aten._unsafe_view, torch.ops.aten.reshape)
# Inductor inlines a pointwise value into each of several users unless it reads more than
# ``realize_reads_threshold`` (4) buffers; fewer users than that here, to stay on the safe side
MAX_INLINED_USERS = 3
MAX_INLINED_READS = 4


# Ops Inductor computes inside the kernel that reads them: pointwise ops and the layout ops it indexes through
_LAYOUT = (torch.ops.aten.clone, torch.ops.aten.permute, torch.ops.aten.expand, torch.ops.aten.transpose,
           torch.ops.aten.t, torch.ops.aten.squeeze, torch.ops.aten.unsqueeze, torch.ops.aten.slice,
           torch.ops.aten.select, *_VIEWS)


def fusible(n: fx.Node) -> bool:
    """Whether a recompute of ``n`` in the backward runs inside its reader's kernel (never stored)."""
    return _pointwise(n) or (n.op == "call_function" and getattr(n.target, "overloadpacket", None) in _LAYOUT)


def reduction(n: fx.Node) -> bool:
    """Whether ``n`` is a reduction Inductor computes its pointwise input inside (``sum``, ``amax``, ...)."""
    return n.op == "call_function" and getattr(n.target, "overloadpacket", None) in _REDUCTIONS


# Indexing ops Inductor lowers as a pointwise kernel that loads its input through the index (a loss's
# ``gather`` of the log-probabilities at the targets): a pointwise input is computed inside it
_LOADERS = (torch.ops.aten.gather,)


def computes_inputs(n: fx.Node) -> bool:
    """Whether the kernel of ``n`` computes a recomputed pointwise input inside itself (a pointwise, layout,
    reduction or gather kernel); another kernel (a matrix product, a library op) reads it stored."""
    return fusible(n) or reduction(n) or (n.op == "call_function"
                                          and getattr(n.target, "overloadpacket", None) in _LOADERS)


def kernels(members: list[fx.Node]) -> int:
    """Kernels a fused stage launches: one for its pointwise, layout and reduction nodes together (Inductor
    generates one loop nest for them), one for each other node (a matrix product, a library op); views
    none. Each launch is charged once (:meth:`hybridmem.graph.costs.DeviceModel.roofline`): counted per
    node, a BatchNorm's normalize-and-ReLU chain cost several times Inductor's one kernel, and the planners
    recomputed convolutions before it (docs/benchmarks.md, "Measured constants and design choices")."""
    fused = any(computes_inputs(m) and not aliases(m) for m in members)
    return max(1, int(fused) + sum(1 for m in members if not computes_inputs(m) and not aliases(m)))


def _view(n: fx.Node) -> bool:
    return (n.op == "call_function" and getattr(n.target, "overloadpacket", None) in _VIEWS
            and len(n.all_input_nodes) == 1)


def _through_views(n: fx.Node, returned: set[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """``n``'s users with the views between them looked through: (the users, the views), or None when a
    view between them is returned."""
    users: list[fx.Node] = []
    views: list[fx.Node] = []
    todo = list(n.users)
    while todo:
        u = todo.pop(0)
        if _view(u):
            if u in returned:
                return None
            views.append(u)
            todo.extend(u.users)
        elif u not in users:
            users.append(u)
    return users, views


def fusion_groups(nodes: list[fx.Node], fw: set[fx.Node], returned: set[fx.Node],
                  backward: bool = False, recomputed: set[fx.Node] | frozenset[fx.Node] = frozenset()
                  ) -> dict[fx.Node, list[fx.Node]]:
    """Pointwise chains a fusing compiler (Inductor) runs as one kernel: a pointwise node whose only user
    is a pointwise node of the same pass is fused into it (its value never materializes, and a recompute
    replays the chain). The forward's chains always; the backward's with ``backward`` (a region without
    convolutions: there Inductor fuses the backward's chains as well, while around convolutions the
    backward's peak, where the budget binds, held more than the fused count).

    With ``backward`` the forward inlines too: a forward pointwise value that neither the step's caller
    nor the partition's saved set (``returned``) holds, read by forward pointwise, reduction or gather
    kernels only (:func:`computes_inputs`), is computed inside each of up to :data:`MAX_INLINED_USERS` of
    them, as Inductor does; a backward reader may read it too where the partition recomputes it there
    (``recomputed``) inside that reader's kernel. A log-softmax's ``x - max(x)``, read by its ``exp``-sum
    and by the subtraction of the log-sum, and that subtraction, read by the loss's ``gather``, are never
    stored (counted stored, a language model's loss region held two logits-sized tensors more than its step:
    docs/benchmarks.md, "Measured constants and design choices").

    In the backward (with ``backward``) a pointwise node, or one made from no stored tensor (an ``iota``,
    a ``full``, views of them), is also inlined, as Inductor inlines it, into a
    reduction that reads it (``sum``, ``amax``, ``amin``, ``mean``), into each of up to
    :data:`MAX_INLINED_USERS` pointwise or reduction users (each computes it again: it reads at most
    :data:`MAX_INLINED_READS` stored tensors), and through the views (``view``, ``reshape``) between
    them. A user that is anything else (a matrix product, a library kernel, a view of another kind) makes
    Inductor store the value, and so does being returned. In the forward a value that only one stage's
    nodes read, and neither the backward nor the step's caller, also joins that stage, whatever its op
    (:func:`_fold_forward`: an attention's scores and softmax join the masked probabilities they make); what
    a fused stage still stores while it runs (a folded matrix product's output) is its workspace
    (:func:`materialized`). A value the backward reads stays a stage of its own: the partitioner may save
    it, and a saved value must be a stage of the graph; a plan that recomputes a stage tags its folded
    nodes ``MUST_RECOMPUTE`` with it, so the partition never saves them instead.

    Returns each kernel's last node -> the nodes fused into it, in graph order; a node inlined into
    several kernels is in each of their lists."""
    into: dict[fx.Node, list[fx.Node]] = {}
    reads: dict[fx.Node, set[fx.Node]] = {}     # an inlined node -> the stored values its kernel code reads
    for n in nodes:
        # a value made from no tensor (full, scalar_tensor, iota) or from such values only is a constant
        # or an index expression in the kernel: nothing read
        if n.op == "call_function" and all(a in reads and not reads[a] for a in n.all_input_nodes):
            reads.setdefault(n, set())
        # in the backward such a value (an iota and its expand, for a loss's one-hot) is an index
        # expression of the kernels that read it, as a pointwise value is
        const = backward and n not in fw and n in reads and not reads[n] and not is_random(n)
        if not (_pointwise(n) or const) or n in returned:
            continue
        ins: set[fx.Node] = set()
        for a in n.all_input_nodes:
            ins |= reads.get(a, {a})
        if n in fw:
            if len(n.users) == 1:
                (u,) = n.users
                if _pointwise(u) and u in fw:
                    into[n] = [u]
                    reads[n] = ins
                    continue
            if backward and _pointwise(n):
                _inline_forward(n, fw, returned, recomputed, ins, into, reads)
            continue
        if not backward:
            continue
        seen = _through_views(n, returned)
        if seen is None:
            continue
        users, views = seen
        if not users or any(u in fw or not (_pointwise(u) or reduction(u)) for u in users):
            continue
        if len(users) > 1 and (len(users) > MAX_INLINED_USERS or len(ins) > MAX_INLINED_READS):
            continue
        into[n] = users
        reads[n] = ins
        for v in views:
            into[v] = [w for w in _through_views(v, returned)[0]]   # type: ignore[index]
            reads[v] = ins

    _fold_forward(nodes, fw, returned, into)
    return _kernel_groups(nodes, into)


def _kernel_groups(nodes: list[fx.Node], into: dict[fx.Node, list[fx.Node]]) -> dict[fx.Node, list[fx.Node]]:
    """``into`` (a fused node -> the nodes it is fused into) as each kernel's last node -> its fused nodes."""
    def roots(n: fx.Node) -> list[fx.Node]:
        out: list[fx.Node] = []
        for u in into[n]:
            for r in (roots(u) if u in into else [u]):
                if r not in out:
                    out.append(r)
        return out

    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:                       # graph order: members before the node they fuse into
        if n in into:
            for r in roots(n):
                groups.setdefault(r, []).append(n)
    return groups


def _inline_forward(n: fx.Node, fw: set[fx.Node], stored: set[fx.Node], recomputed: set[fx.Node] | frozenset[fx.Node],
                    ins: set[fx.Node], into: dict[fx.Node, list[fx.Node]], reads: dict[fx.Node, set[fx.Node]]) -> None:
    """Inline forward pointwise value ``n`` (reading the stored values ``ins``) into its forward readers where
    each computes it inside its own kernel (:func:`fusion_groups`); its backward readers must recompute it
    (``recomputed``) inside theirs."""
    seen = _through_views(n, stored)
    if seen is None:
        return
    users, views = seen
    forward = [u for u in users if u in fw]
    if not forward or any(not computes_inputs(u) for u in users):
        return
    if len(forward) < len(users) and n not in recomputed:
        return                      # the backward reads it as the forward stored it
    if len(forward) > 1 and (len(forward) > MAX_INLINED_USERS or len(ins) > MAX_INLINED_READS):
        return
    through = {v: [w for w in _through_views(v, stored)[0] if w in fw] for v in views}   # type: ignore[index]
    if not all(through.values()):
        return                      # a view only the backward reads would be a forward stage of its own
    into[n] = forward
    reads[n] = ins
    for v, readers in through.items():
        into[v] = readers
        reads[v] = ins


def _fold_forward(nodes: list[fx.Node], fw: set[fx.Node], stored: set[fx.Node], into: dict[fx.Node, list[fx.Node]]) -> None:
    """Fold into ``into`` each forward value that only one kernel's nodes read: a value the backward does not
    read (nor a user of the step), all of whose users end up in one stage (an attention's scores, its
    softmax and the causal mask, all read by its masked probabilities only). Its op joins that stage, as a
    chain a recompute of the stage's output replays: otherwise the output could be recomputed only with
    the value held, which nothing holds (it is not saved). Values ``stored`` (returned, or saved by the
    partition) stay; so do random ops and multi-output ops (their ``getitem`` users)."""
    def root(u: fx.Node) -> fx.Node | None:
        while u in into:
            if len(into[u]) != 1:
                return None
            u = into[u][0]
        return u

    for n in reversed(nodes):
        if (n not in fw or n.op != "call_function" or n in into or n in stored or not n.users
                or is_random(n) or n.target is operator.getitem):
            continue
        if any(u not in fw or u.target is operator.getitem or u.op != "call_function" for u in n.users):
            continue
        rs = {root(u) for u in n.users}
        if len(rs) == 1 and None not in rs:
            into[n] = [next(iter(rs))]        # type: ignore[list-item]


def materialized(members: list[fx.Node]) -> list[torch.Tensor]:
    """Of a stage's fused members (its own node last), the values a fusing compiler still writes to memory
    while the stage runs: those of members but the last that are neither pointwise, layout nor reduction
    ops (which Inductor computes inside the kernel that reads them), a matrix product's output folded into
    its reader's stage, say; a value that is the storage of the stage's own output is not counted twice."""
    own = {storage_key(v) for v in tensor_vals(members[-1].meta.get("val"))}
    out: list[torch.Tensor] = []
    seen: set[Any] = set()
    for m in members[:-1]:
        if computes_inputs(m) or m.target is operator.getitem:
            continue
        for v in tensor_vals(m.meta.get("val")):
            k = storage_key(v)
            if k not in own and k not in seen:
                seen.add(k)
                out.append(v)
    return out


def recomputed_reads(nodes: list[fx.Node], fw: set[fx.Node], saved: set[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """Forward nodes the backward reads that ``saved`` (what PyTorch's partition saves) leaves out -> the
    saved values and inputs they are recomputed from in the backward (through the other such nodes)."""
    sources: dict[fx.Node, list[fx.Node]] = {}

    def of(n: fx.Node) -> list[fx.Node]:
        got = sources.get(n)
        if got is None:
            got = sources[n] = []
            for a in n.all_input_nodes:
                for x in ([a] if a in saved or a.op != "call_function" or a not in fw else of(a)):
                    if x not in got:
                        got.append(x)
        return got

    for n in nodes:
        if n in fw or n.op != "call_function":
            continue
        for a in n.all_input_nodes:
            if a in fw and a not in saved and a.op == "call_function":
                of(a)
    return sources
