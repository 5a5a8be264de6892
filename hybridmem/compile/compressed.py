"""Saved tensors a compiled graph holds compressed: which ones can be, the graph the planners see, and the
partition's rewrite.

A saved tensor the backend compresses is saved by the partition as it is (``MUST_SAVE``); then the
forward graph encodes it right after its last forward read (``hybridmem::pack_saved``, which returns a
token) and saves the token in its place, and the backward graph decodes it right before its first read
(``hybridmem::unpack_saved``) (:mod:`hybridmem.compile.codec_ops`). PyTorch's own activation-offloading
pass rewrites the partition the same way, with copies to the host where these ops encode.

The planners see the compressed tensors in the hybridmem Graph (:func:`with_compression`): each is freed
after an *encode* stage that follows its last forward reader, its encoding (the bytes the probe measured,
:mod:`hybridmem.compile.probe`) lives from there to a *decode* stage just before its first backward reader,
and the decoded tensor from there to its last backward reader. Both stages cost the codec's measured
time (:func:`hybridmem.plugins.compress.codec_seconds`). Compression is decided before the plan: the
planners may recompute or swap the other saved tensors around it.
"""
from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import fx

from ..graph.ir import Graph, Stage, TensorInfo
from ..plugins.compress import codec_seconds
from . import codec_ops
from .fxnodes import node_nbytes
from .joint import JointGraph
from .rewrite import covers, rewrite_saved, static

__all__ = ["Compressed", "candidates", "rewrite_partition", "storage_of", "with_compression"]


@dataclass(frozen=True)
class Compressed:
    """A saved tensor the plan holds compressed: its node in the joint graph, the codec and encoded bytes
    the probe measured on the example inputs; ``storage``: its value's storage (what the partition's saved
    values are matched by: it may save a view of the node, a ``detach``, in its place)."""

    node: str
    codec: str
    nbytes: int
    size: int
    storage: Any = field(default=None, compare=False, repr=False)

    @property
    def ratio(self) -> float:
        return self.size / self.nbytes if self.nbytes else 1.0


def _whole(n: fx.Node, nbytes: int) -> bool:
    """Whether ``n``'s value covers its whole storage of ``nbytes``, densely, with static sizes."""
    v = n.meta.get("val")
    return (isinstance(v, torch.Tensor) and v.layout == torch.strided and static(v) and codec_ops.dense(v)
            and v.numel() * v.element_size() == nbytes == node_nbytes(v))


def candidates(jg: JointGraph, forward: set[fx.Node]) -> dict[int, fx.Node]:
    """The saved tensors of ``jg`` that a compiled graph can hold compressed -> the node whose value the
    backward reads: a tensor made in the forward (``forward``: the forward's nodes) whose node covers its
    whole storage, densely, with static sizes, and that the backward reads through no view that does not
    (the partition may save a view in the node's place: one that covers the storage is compressed instead,
    :func:`rewrite_partition`, one that does not would keep the storage alive; a symbolic size has no
    encoding size)."""
    g = jg.graph
    nf = g.num_forward
    out: dict[int, fx.Node] = {}
    for t in g.tensors:
        if not (t.saved and t.evictable and t.producer < nf and t.nbytes > 0):
            continue
        producer = jg.producer_node[t.id]
        nodes = jg.tensor_nodes.get(t.id, ())
        named = [n for n in nodes if n is producer or n.target is operator.getitem]
        read_back = [m for m in nodes if m not in forward or any(u not in forward for u in m.users)]
        if any(m not in named and not _whole(m, t.nbytes) for m in read_back):
            continue
        for n in named:
            if _whole(n, t.nbytes):
                out[t.id] = n
                break
    return out


def _codec_bytes(model: Any, c: Compressed, device_type: str, decode: bool) -> int:
    """Bytes an encode (or decode) stage of ``c`` moves, such that the cost model's roofline charges it the
    codec's measured time (:func:`hybridmem.plugins.compress.codec_seconds`); its traffic alone where the
    model has no memory bandwidth to convert by."""
    seconds = codec_seconds(c.codec, c.nbytes, device_type)[1 if decode else 0]
    bw = getattr(model, "hbm_bw", None)
    if bw is None:
        return int(c.nbytes + c.size)
    return int(seconds * bw * getattr(model, "hbm_efficiency", 1.0))


def with_compression(jg: JointGraph, chosen: dict[int, Compressed], nodes: dict[int, fx.Node], model: Any,
                     device_type: str = "cpu") -> JointGraph:
    """A copy of ``jg`` whose graph holds the tensors ``chosen`` (tensor id -> what the probe measured)
    compressed between the forward and the backward (see the module docstring); ``nodes``: tensor id -> the
    node whose value the backward reads (:func:`candidates`). Tensor ids are kept (the encodings and decoded
    tensors are appended); stage indices shift by the stages added."""
    g = jg.graph
    after: dict[int, list[int]] = {}      # old stage -> tensors encoded after it
    before: dict[int, list[int]] = {}     # old stage -> tensors decoded before it
    for tid in chosen:
        t = g.tensors[tid]
        fwd = [c for c in t.consumers if g.stages[c].phase == "forward"]
        bwd = [c for c in t.consumers if g.stages[c].phase != "forward"]
        after.setdefault(max([t.producer, *fwd]), []).append(tid)
        before.setdefault(bwd[0], []).append(tid)

    tensors = copy.deepcopy(g.tensors)
    old_stages = copy.deepcopy(g.stages)
    stages: list[Stage] = []
    stage_node: list[fx.Node] = []
    index: dict[int, int] = {}             # old stage -> new
    encoded: dict[int, TensorInfo] = {}
    decoded: dict[int, TensorInfo] = {}

    def add(stage: Stage, node: fx.Node) -> int:
        stage.index = len(stages)
        stages.append(stage)
        stage_node.append(node)
        return stage.index

    def new_tensor(like: TensorInfo, nbytes: int, producer: int, name: str, encoded_: bool) -> TensorInfo:
        # an encoding: bytes; a decoded tensor: the tensor again
        t = TensorInfo(id=len(tensors), nbytes=nbytes, dtype="uint8" if encoded_ else like.dtype,
                       shape=(nbytes,) if encoded_ else like.shape, kind="other" if encoded_ else "activation",
                       producer=producer, name=name)
        tensors.append(t)
        return t

    for s in old_stages:
        old = s.index
        for tid in before.get(old, ()):
            c, t = chosen[tid], tensors[tid]
            i = add(Stage(index=0, id=f"backward/decode:{t.name}", op="hybridmem.unpack_saved", phase="backward",
                          bytes_accessed=_codec_bytes(model, c, device_type, True), inputs=[encoded[tid].id]),
                    jg.stage_node[old])
            d = decoded[tid] = new_tensor(t, t.nbytes, i, f"{t.name}.decoded", False)
            stages[i].outputs = [d.id]
        index[old] = add(s, jg.stage_node[old])
        for tid in after.get(old, ()):
            c, t = chosen[tid], tensors[tid]
            i = add(Stage(index=0, id=f"forward/encode:{t.name}", op="hybridmem.pack_saved", phase="forward",
                          bytes_accessed=_codec_bytes(model, c, device_type, False), inputs=[tid]),
                    jg.producer_node[tid])
            e = encoded[tid] = new_tensor(t, c.size, i, f"{t.name}.{c.codec}", True)
            stages[i].outputs = [e.id]

    _relink(stages, tensors, index, encoded, decoded)
    out = Graph(stages=stages, tensors=tensors, meta=dict(g.meta))
    if model is not None:
        for s, sec in zip(out.stages, model.op_times(out)):
            s.cost_s = float(sec)
    out.validate()
    producer_node = dict(jg.producer_node)
    tensor_nodes = dict(jg.tensor_nodes)
    for tid, node in ((tid, jg.producer_node[tid]) for tid in chosen):
        for extra in (encoded[tid], decoded[tid]):
            producer_node[extra.id] = node
            tensor_nodes[extra.id] = [node]
    return JointGraph(graph=out, producer_node=producer_node, stage_node=stage_node, tensor_nodes=tensor_nodes,
                      fused=jg.fused, recomputed=jg.recomputed,
                      compressed={**jg.compressed, **{t: nodes[t] for t in chosen}})


def _relink(stages: list[Stage], tensors: list[TensorInfo], index: dict[int, int], encoded: dict[int, TensorInfo],
            decoded: dict[int, TensorInfo]) -> None:
    """The backward's reads of the compressed tensors turned to their decoded copies, and every tensor's
    consumers, producer and lifetime counted again in the new stage order (``index``: old stage -> new)."""
    for s in stages:
        if s.id.startswith(("backward/decode:", "forward/encode:")):
            continue
        s.inputs = [decoded[x].id if x in decoded and s.phase != "forward" else x for x in s.inputs]
    for t in tensors:
        t.consumers = []
    for s in stages:
        for x in s.inputs:
            tensors[x].consumers.append(s.index)
    added = {x.id for x in (*encoded.values(), *decoded.values())}
    for t in tensors:
        if t.producer >= 0 and t.id not in added:
            t.producer = index[t.producer]
        t.consumers = sorted(set(t.consumers))
        if t.id in added:
            # an encoding is no planner's to move (only its encode and decode stages make and read it); a decoded
            # tensor is made in the backward, as the backward's own values are
            t.freed_after, t.saved = max([t.producer, *t.consumers]), False
        elif t.kind == "activation" and t.producer >= 0:
            t.freed_after = max([t.producer, *t.consumers])
            t.saved = stages[t.producer].phase == "forward" and any(stages[c].phase != "forward" for c in t.consumers)
        elif t.freed_after is not None:
            t.freed_after = max([index[t.freed_after], t.producer, *t.consumers])


def storage_of(node: fx.Node) -> Any:
    """The storage of ``node``'s value (its fake tensor's), as a key."""
    from torch.multiprocessing.reductions import StorageWeakRef
    v = node.meta.get("val")
    return StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None


def rewrite_partition(fw: fx.GraphModule, bw: fx.GraphModule, chosen: Iterable[Compressed], region: int) -> list[str]:
    """Encode the saved values of the storages in ``chosen`` in ``fw`` after their last forward read and decode
    them in ``bw`` before their first read (the module docstring): the node itself, or what the partition saves
    in its place (a view of it that covers its storage). Returns the ``chosen`` nodes whose storage it rewrote
    (one the partition did not save, or saved only in a form that is not dense, is left as it is)."""
    codec_ops.register()
    how = _Encode(chosen, region)
    rewrite_saved(fw, bw, how)
    return [n for n, ok in how.done.items() if ok]


class _Encode:
    """The codec ops (:mod:`hybridmem.compile.codec_ops`) as a :class:`~hybridmem.compile.rewrite.SavedRewrite`."""

    def __init__(self, chosen: Iterable[Compressed], region: int) -> None:
        self.wanted = {c.storage: c for c in chosen if c.storage is not None}
        self.region = region
        self.fence = getattr(torch.ops.hybridmem, "offload_wait", None)     # defined where a graph offloads
        self.done: dict[str, bool] = {}          # chosen node -> whether its storage was rewritten

    def wants(self, node: fx.Node, val: Any) -> bool:
        c = self.wanted.get(storage_of(node))
        if c is None:
            return False
        if not covers(val, c.nbytes):
            self.done[c.node] = False          # saved in a form that does not cover the storage: it stays alive
            return False
        return True

    def reads(self, reader: fx.Node) -> bool:
        # an offload's fence may read the value to order itself after it (hybridmem.compile.offload): no read
        # of its data
        return self.fence is None or reader.target is not self.fence.default

    def pack(self, fw: fx.Graph, node: fx.Node, last: fx.Node, meta: dict[str, Any], views: Any) -> fx.Node:
        c = self.wanted[storage_of(node)]
        with fw.inserting_after(last):
            pack = fw.call_function(torch.ops.hybridmem.pack_saved.default, (node, self.region, c.size),
                                    name=f"hybridmem_pack_{node.name}")
        pack.meta.update(meta)
        self.done.setdefault(c.node, True)
        return pack

    def unpack(self, bw: fx.Graph, token: fx.Node, first: fx.Node, nodes: list[fx.Node], node: fx.Node, val: Any,
               views: Any) -> fx.Node:
        with bw.inserting_before(first):
            return bw.call_function(torch.ops.hybridmem.unpack_saved.default,
                                    (token, list(val.shape), list(val.stride()), val.dtype, val.device, self.region),
                                    name=f"hybridmem_unpack_{node.name}")
