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

from ..graph.ir import Graph, Stage, TensorInfo
from .fusion import computes_inputs, fusion_groups, kernels, materialized, recomputed_reads
from .fxnodes import aliases, draws_seeds, is_random, node_flops, node_nbytes, storage_key, tensor_vals
from .sizes import size_hint

__all__ = ["JointGraph", "concatenates_feature_maps", "has_convolution", "is_tangent", "joint_graph"]


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
    (None: costs stay 0). ``fuse``: one stage per forward pointwise chain
    (:func:`~hybridmem.compile.fusion.fusion_groups`), as a fusing compiler runs it: its inner values take no
    memory, and recomputing its output replays the chain; ``fuse_backward``: the backward's chains too.
    ``saved``: the forward values PyTorch's own partition saves
    (:func:`hybridmem.compile.defaults.saved_by_partition`; with ``fuse``): a forward value it leaves out is
    recomputed in the backward, inside the pointwise or reduction kernel that reads it, so
    those read what it is recomputed from (:func:`~hybridmem.compile.fusion.recomputed_reads`; another
    reader, a matrix product, reads it as the forward made it), and a saved value is never fused away.

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
        if phase == "backward" and aliases(n) and _as_view(n, tt):
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
        key = storage_key(val)
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
    tids = [tt.by_storage.get(storage_key(v)) for v in tensor_vals(n.meta.get("val"))]
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
    random = is_random(n)
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
        if draws_seeds(n) and n in fw:
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
