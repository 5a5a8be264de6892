"""AOTAutograd's joint forward-backward FX graph as a hybridmem :class:`~hybridmem.graph.ir.Graph`.

Every ``call_function`` node but ``getitem`` is a stage: the forward nodes (those the forward outputs
need) in graph order, then the rest in graph order, which is how the partitioned graphs run them. A
tensor is a storage: a view names its base's storage, the outputs of a multi-output op are its
``getitem`` nodes' storages. Sizes come from ``node.meta["val"]`` (fake tensors), costs from a hybridmem
cost model (FLOPs from :func:`hybridmem.graph.flops.op_flops`, bytes read and written).

Kinds: the partition's static inputs (parameters, buffers) are ``param``, the other placeholders
(step inputs, tangents) ``input``; the forward's user-visible outputs and everything the backward
returns (gradients) outlive the step and are not evictable (``other``, ``grad``). Forward tensors the
backward reads are ``saved``. Random ops are not recomputable (their replay would draw new numbers).
Under Inductor a dropout mask is ``inductor_random`` of a seed that ``inductor_seeds`` draws: only the
seeds are random, and a mask recomputed from the saved seed is the forward's own. The seeds stay for the
step (a few bytes) and the mask's stage computes the random numbers inside itself, so a plan can recompute
the mask from the seeds alone. The tangents (the
gradients of the forward's outputs) are made by a stage of their own before the backward's first op:
the autograd engine makes them once the forward has returned.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..graph.flops import op_flops
from ..graph.ir import Graph, Stage, TensorInfo
from .sizes import size_hint

__all__ = ["JointGraph", "computes_inputs", "fusible", "joint_graph", "node_nbytes", "reduction"]


@dataclass
class JointGraph:
    """A joint FX graph's hybridmem Graph and the map back to its nodes."""

    graph: Graph
    producer_node: dict[int, fx.Node] = field(default_factory=dict)   # tensor id -> the node that makes it
    stage_node: list[fx.Node] = field(default_factory=list)           # stage index -> its node
    tensor_nodes: dict[int, list[fx.Node]] = field(default_factory=dict)  # tensor id -> nodes naming it
    fused: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)  # stage node -> pointwise nodes fused into it
    # forward nodes the backward recomputes under PyTorch's own partition (see hybridmem.compile.defaults)
    recomputed: set[fx.Node] = field(default_factory=set)
    # saved tensors held compressed (hybridmem.compile.compressed): tensor id -> the node whose value the
    # backward reads, saved as it is and encoded after its last forward read
    compressed: dict[int, fx.Node] = field(default_factory=dict)

    def forward_nodes_of(self, tensor_id: int) -> list[fx.Node]:
        """The nodes a decision on ``tensor_id`` tags: its producer, the pointwise nodes fused into it
        and, for a multi-output op, the ``getitem`` nodes that name this output."""
        producer = self.producer_node[tensor_id]
        return [*self.fused.get(producer, ()), producer,
                *(n for n in self.tensor_nodes.get(tensor_id, ()) if n.target is operator.getitem)]


def tensor_vals(v: Any) -> list[torch.Tensor]:
    """The tensors of a node's value (a tensor, or a tuple or list holding some)."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [x for x in v if isinstance(x, torch.Tensor)]
    return []


def node_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage (its whole storage: a view keeps all of it alive)."""
    try:
        return size_hint(t.untyped_storage().nbytes())
    except Exception:
        return size_hint(t.numel()) * t.element_size()


def _storage_key(t: torch.Tensor) -> Any:
    try:
        return StorageWeakRef(t.untyped_storage())
    except Exception:
        return ("tensor", id(t))


def _is_random(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _arg_vals(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return _concrete(a.meta.get("val"))
    if isinstance(a, (tuple, list)):
        return type(a)(_arg_vals(x) for x in a)
    if isinstance(a, dict):
        return {k: _arg_vals(v) for k, v in a.items()}
    return _concrete(a)


def _concrete(v: Any) -> Any:
    """``v`` with symbolic sizes (dynamic shapes) replaced by their hints: a FLOP formula that compares or
    converts a symbolic size would add a guard, specializing the region to this call's sizes."""
    if isinstance(v, torch.SymInt):
        return size_hint(v)
    if isinstance(v, torch.SymFloat):
        hint = v.node.hint
        return float(hint) if hint is not None else 0.0
    if isinstance(v, (tuple, list)):
        return type(v)(_concrete(x) for x in v)
    if isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride())):
        return torch.empty_strided([size_hint(s) for s in v.shape], [size_hint(s) for s in v.stride()],
                                   dtype=v.dtype, device="meta")
    return v


def node_flops(node: fx.Node) -> float:
    """FLOPs of one aten node of the joint graph (0 for anything else), its symbolic sizes read as hints."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return 0.0
    return float(op_flops(node.target, _arg_vals(node.args), _arg_vals(node.kwargs),
                          _concrete(node.meta.get("val"))))


# Inductor's random numbers from a seed (``inductor_seeds`` draws the seeds): elementwise, computed inside
# the kernel that reads them, and the same numbers whenever they are computed again from the same seed
_SEEDED = ("prims.inductor_lookup_seed.default", "prims.inductor_random.default")


def _seeded(n: fx.Node) -> bool:
    return n.op == "call_function" and str(n.target) in _SEEDED


def _alias(n: fx.Node) -> bool:
    """Whether ``n`` is a view op (its output shares its input's storage: ``detach``, ``t``, ``permute``)."""
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and bool(n.target.is_view)


def _seeds(n: fx.Node) -> bool:
    """Whether ``n`` draws the seeds Inductor's random ops are computed from (``inductor_seeds``)."""
    return n.op == "call_function" and str(n.target) == "prims.inductor_seeds.default"


def _pointwise(n: fx.Node) -> bool:
    return (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and (torch.Tag.pointwise in n.target.tags or _seeded(n)) and not _is_random(n))


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
    node, a BatchNorm's normalize-and-ReLU chain (9 nodes) cost 111-188 us in the CPU model against
    34 us measured for Inductor's kernel, and the planners recomputed convolutions before it (ResNet-50
    small, 2026-12-04)."""
    fused = any(computes_inputs(m) and not _alias(m) for m in members)
    return max(1, int(fused) + sum(1 for m in members if not computes_inputs(m) and not _alias(m)))


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
    stored: counted stored, a language model's loss region at a 50,257-word vocabulary held two logits-sized
    tensors more than its step (GPT-2, 2026-12-06).

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
        const = backward and n not in fw and n in reads and not reads[n] and not _is_random(n)
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
                or _is_random(n) or n.target is operator.getitem):
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
    own = {_storage_key(v) for v in tensor_vals(members[-1].meta.get("val"))}
    out: list[torch.Tensor] = []
    seen: set[Any] = set()
    for m in members[:-1]:
        if computes_inputs(m) or m.target is operator.getitem:
            continue
        for v in tensor_vals(m.meta.get("val")):
            k = _storage_key(v)
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


def has_convolution(nodes: Iterable[fx.Node]) -> bool:
    """Whether a joint graph runs a convolution (forward or backward)."""
    return any(n.op == "call_function" and getattr(n.target, "overloadpacket", None) in _CONVOLUTIONS
               for n in nodes)


def concatenates_feature_maps(nodes: Iterable[fx.Node]) -> bool:
    """Whether a joint graph concatenates 4-D tensors (a U-Net's skips joined to its upsampled path, a
    DenseNet's features): where it also convolves, Inductor's layout optimization copies more there."""
    def maps(n: fx.Node) -> bool:
        v = n.meta.get("val")
        return isinstance(v, torch.Tensor) and v.dim() == 4
    return any(n.op == "call_function" and getattr(n.target, "overloadpacket", None) is torch.ops.aten.cat
               and maps(n) for n in nodes)


_CONVOLUTIONS = (torch.ops.aten.convolution, torch.ops.aten.convolution_backward, torch.ops.aten.cudnn_convolution,
                 torch.ops.aten.mkldnn_convolution, torch.ops.aten._convolution)


def is_tangent(n: fx.Node) -> bool:
    """Whether placeholder ``n`` is one of the joint graph's tangents (the gradients the backward
    receives; AOTAutograd names them ``tangents_<k>``)."""
    return n.op == "placeholder" and str(n.target).startswith("tangents")


def joint_graph(gm: fx.GraphModule, forward: Iterable[fx.Node], static_inputs: Iterable[fx.Node],
                fwd_outputs: Iterable[fx.Node], cost_model: Any = None, name: str = "",
                fuse: bool = False, fuse_backward: bool = False, saved: set[fx.Node] | None = None,
                outputs_held: bool = True) -> JointGraph:
    """The hybridmem Graph of joint graph ``gm``.

    ``forward``: the nodes the forward computes (``classify_nodes``' required forward nodes);
    ``static_inputs``: the placeholders that are parameters or buffers; ``fwd_outputs``: the nodes the
    forward returns to the user (not evictable). ``cost_model``: a hybridmem cost model for stage costs
    (None: costs stay 0). ``fuse``: one stage per forward pointwise chain (:func:`fusion_groups`), as a
    fusing compiler runs it: its inner values take no memory, and recomputing its output replays the
    chain; ``fuse_backward``: the backward's chains too. ``saved``: the forward values PyTorch's own
    partition saves (:func:`hybridmem.compile.defaults.saved_by_partition`; with ``fuse``): a forward value
    it leaves out is recomputed in the backward, inside the pointwise or reduction kernel that reads it, so
    those read what it is recomputed from (:func:`recomputed_reads`; another reader, a matrix product,
    reads it as the forward made it), and a saved value is never fused away.

    ``outputs_held``: the forward's user outputs live until the step ends (the training loop may hold them
    through the backward); False: until the forward ends or their last read, whichever is later (a loop
    that drops them before the backward, ``loss = model(x)[1]``).

    Tangents (the gradients of the forward's outputs, which the backward receives) exist from the
    backward's first stage on (the autograd engine makes them once the forward has returned) until their
    last read (the compiled backward owns them).
    """
    fw = set(forward)
    static = set(static_inputs)
    nodes = list(gm.graph.nodes)
    out_node = next(n for n in nodes if n.op == "output")
    returned = {a for a in out_node.all_input_nodes}
    stored = returned | saved if fuse and saved is not None else returned
    redirect = recomputed_reads(nodes, fw, saved) if fuse and saved is not None else {}
    groups = fusion_groups(nodes, fw, stored, backward=fuse_backward, recomputed=set(redirect)) if fuse else {}
    inner = {m for ms in groups.values() for m in ms}
    order = [n for n in nodes if n.op == "call_function" and n in fw] + \
            [n for n in nodes if n.op == "call_function" and n not in fw]
    order = [n for n in order if n.target is not operator.getitem and n not in inner]

    jg = JointGraph(graph=None, fused=groups, recomputed=set(redirect))  # type: ignore[arg-type]
    tt = _Tensors(jg)
    for n in nodes:
        if n.op == "placeholder":
            tt.of_node[n] = [tt.of(v, n, -1, "param" if n in static else "input")
                             for v in tensor_vals(n.meta.get("val"))]

    tangents = [n for n in nodes if is_tangent(n) and tt.of_node.get(n)]
    tangent_ids = {tid for t in tangents for tid in tt.of_node[t]}
    stages: list[Stage] = []
    for n in order:
        phase = "forward" if n in fw else "backward"
        if phase == "backward" and tangents:
            _add_tangents(stages, tangents, tt)
            tangents = []
        if phase == "backward" and _alias(n) and _as_view(n, tt):
            continue
        _add_stage(stages, n, phase, [*groups.get(n, ()), n], redirect, tt)

    _count_lifetimes(stages, tt, nodes, fw, returned, set(fwd_outputs), tangent_ids, outputs_held)
    # no tracing of a recompute's gone sources (Graph.replay_stages): the partitioner recomputes them on its
    # own, inside the kernels Inductor fuses, and the forward's single-reader values are folded above
    g = Graph(stages=stages, tensors=tt.tensors, meta={"source": "aot-joint", "model": name,
                                                        "writes_recorded": True, "trace_sources": False})
    if cost_model is not None:
        times = cost_model.op_times(g)
        for s, t in zip(g.stages, times):
            s.cost_s = float(t)
        g.meta["cost_model"] = cost_model.name
    jg.graph = g.validate()
    return jg


class _Tensors:
    """The Graph's tensors as :func:`joint_graph` meets the nodes that make them: one per storage."""

    def __init__(self, jg: JointGraph) -> None:
        self.jg = jg
        self.tensors: list[TensorInfo] = []
        self.by_storage: dict[Any, int] = {}
        self.of_node: dict[fx.Node, list[int]] = {}

    def of(self, val: torch.Tensor, node: fx.Node, producer: int, kind: str, op: fx.Node | None = None) -> int:
        """The tensor of ``val`` (``node``'s value; ``op`` makes it where ``node`` is a getitem of it)."""
        key = _storage_key(val)
        tid = self.by_storage.get(key)
        if tid is None:
            tid = len(self.tensors)
            self.by_storage[key] = tid
            self.tensors.append(TensorInfo(id=tid, nbytes=node_nbytes(val),
                                           dtype=str(val.dtype).replace("torch.", ""),
                                           shape=tuple(size_hint(s) for s in val.shape), kind=kind,
                                           producer=producer, name=node.name))
            self.jg.producer_node[tid] = op if op is not None else node
        self.jg.tensor_nodes.setdefault(tid, []).append(node)
        return tid


def _add_tangents(stages: list[Stage], tangents: list[fx.Node], tt: _Tensors) -> None:
    """The tangents exist from here on: a stage of their own, before the backward's first op."""
    idx = len(stages)
    made = [tid for t in tangents for tid in tt.of_node[t]]
    for tid in made:
        tt.tensors[tid].producer = idx
    stages.append(Stage(index=idx, id="backward/tangents", op="tangents", phase="backward",
                        inputs=[], outputs=list(dict.fromkeys(made))))
    tt.jg.stage_node.append(tangents[0])


def _as_view(n: fx.Node, tt: _Tensors) -> bool:
    """Whether backward view ``n`` is counted as the tensors it views (no stage of its own). A view in the
    backward (a ReLU's ``detach`` of its output, a ``t`` for a weight's gradient) is no kernel: it takes place
    where its readers run. As a stage of its own at the backward's start (where AOTAutograd traces a ReLU's
    detach) it would hold its base resident from there on."""
    tids = [tt.by_storage.get(_storage_key(v)) for v in tensor_vals(n.meta.get("val"))]
    if not tids or None in tids:
        return False
    tt.of_node[n] = tids              # type: ignore[assignment]
    for tid in tids:
        tt.jg.tensor_nodes.setdefault(tid, []).append(n)   # type: ignore[index]
    return True


def _add_stage(stages: list[Stage], n: fx.Node, phase: str, members: list[fx.Node],
               redirect: dict[fx.Node, Any], tt: _Tensors) -> None:
    """The stage of node ``n`` (with ``members``, the nodes fused into it, ``n`` last)."""
    idx = len(stages)
    ins: list[int] = []
    for m in members:
        # a value the backward recomputes is computed inside a pointwise or reduction kernel that reads
        # it; for another kernel (a matrix product) it is stored: counted here from the forward on
        inline = phase == "backward" and computes_inputs(m)
        for a in m.all_input_nodes:
            for r in (redirect.get(a, (a,)) if inline else (a,)):
                for tid in tt.of_node.get(r, ()):      # a fused member has no tensor: skipped
                    if tid not in ins:
                        ins.append(tid)
    outs: list[int] = []
    vals = tensor_vals(n.meta.get("val"))
    getitems = [u for u in n.users if u.target is operator.getitem]
    if getitems and not isinstance(n.meta.get("val"), torch.Tensor):
        produced = []
        for g in getitems:
            gv = tensor_vals(g.meta.get("val"))
            tids = [tt.of(v, g, idx, "activation", op=n) for v in gv]
            tt.of_node[g] = tids
            produced += tids
        tt.of_node[n] = produced
    else:
        tt.of_node[n] = [tt.of(v, n, idx, "activation") for v in vals]
    for tid in tt.of_node[n]:
        if tt.tensors[tid].producer == idx and tid not in outs:
            outs.append(tid)
    read = sum(tt.tensors[t].nbytes for t in ins)
    wrote = sum(tt.tensors[t].nbytes for t in outs)
    random = _is_random(n)
    op = "+".join(str(m.target) for m in members)
    # what a fused stage writes to memory inside itself (a folded matrix product's output)
    inner_bytes = sum(node_nbytes(v) for v in materialized(members))
    stages.append(Stage(index=idx, id=f"{phase}/{n.name}", op=op, phase=phase,
                        flops=sum(node_flops(m) for m in members), bytes_accessed=read + wrote, inputs=ins,
                        outputs=outs, rng=random, deterministic=not random, workspace=inner_bytes,
                        ops=kernels(members)))
    tt.jg.stage_node.append(n)


def _count_lifetimes(stages: list[Stage], tt: _Tensors, nodes: list[fx.Node], fw: set[fx.Node],
                     returned: set[fx.Node], user_out: set[fx.Node], tangent_ids: set[int],
                     outputs_held: bool) -> None:
    """Each tensor's readers, kind and last stage, once every stage is made."""
    tensors = tt.tensors
    for s in stages:
        for tid in s.inputs:
            tensors[tid].consumers.append(s.index)
    released: set[int] = set()     # user outputs freed once the forward ends (outputs_held=False)
    for n in returned:
        for tid in tt.of_node.get(n, ()):
            t = tensors[tid]
            if t.producer >= 0:
                t.freed_after = None
                t.kind = "other" if n in user_out or stages[t.producer].phase == "forward" else "grad"
                if n in user_out and not outputs_held:
                    released.add(tid)
    for n in nodes:
        if _seeds(n) and n in fw:
            # the backward computes random numbers again from these seeds where it recomputes a dropout
            # mask: they stay for the step (a few bytes; the partition saves them whenever anything is
            # recomputed, hybridmem.compile.partition)
            for tid in tt.of_node.get(n, ()):
                tensors[tid].kind, tensors[tid].freed_after = "other", None
    forward_end = max((s.index for s in stages if s.phase == "forward"), default=0)
    for t in tensors:
        t.consumers = sorted(set(t.consumers))
        if t.producer < 0:
            continue
        if t.kind == "activation":
            t.freed_after = max([t.producer, *t.consumers])
            t.saved = stages[t.producer].phase == "forward" and any(
                stages[c].phase == "backward" for c in t.consumers)
        elif t.id in released and t.kind == "other":
            t.freed_after = max([forward_end, t.producer, *t.consumers])
        elif t.id in tangent_ids and t.kind == "input":
            # the compiled backward owns its tangents (it clears its argument list): each is freed after
            # its last read, as the backward's saved tensors are
            t.freed_after = max([t.producer, *t.consumers])
