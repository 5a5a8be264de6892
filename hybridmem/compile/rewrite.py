"""The partition's rewrite for a saved value a compiled graph holds as a host token (:func:`rewrite_saved`).

The forward hands the value to one of hybridmem's ops after its last forward read and saves the token the op
returns in its place; the backward gets the value back from the token before its first read. What the ops
are is a :class:`SavedRewrite`: compression (:mod:`hybridmem.compile.compressed`, the codec ops) and
offloading (:mod:`hybridmem.compile.offload`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
from torch import fx

from .codec_ops import dense

__all__ = ["SavedRewrite", "covers", "effective_users", "rewrite_saved", "static"]


class SavedRewrite(Protocol):
    """The ops that hold one kind of saved value as a token."""

    def wants(self, node: fx.Node, val: Any) -> bool:
        """Whether to rewrite ``node``, a value the forward saves (``val``: its fake value)."""

    def reads(self, reader: fx.Node) -> bool:
        """Whether forward node ``reader`` (one of the value's, or its views', users) reads its data."""

    def pack(self, fw: fx.Graph, node: fx.Node, last: fx.Node, meta: dict[str, Any], views: Any) -> fx.Node:
        """Insert the forward's op(s) on ``node`` after ``last``; the node whose token the forward saves
        (``meta``: a token's ``val`` and ``tensor_meta``)."""

    def unpack(self, bw: fx.Graph, token: fx.Node, first: fx.Node, nodes: list[fx.Node], node: fx.Node, val: Any,
               views: Any) -> fx.Node:
        """Insert the backward's op(s) that make ``node``'s value again from placeholder ``token`` before
        ``first`` (its first reader; ``nodes``: the backward's nodes); the node that stands for it."""


def rewrite_saved(fw: fx.GraphModule, bw: fx.GraphModule, how: SavedRewrite) -> int:
    """Rewrite the values forward ``fw`` saves for backward ``bw`` that ``how`` wants; the number rewritten."""
    from torch._functorch.partitioners import get_default_op_list
    from torch._subclasses.fake_tensor import extract_tensor_metadata

    out_node = next(iter(fw.graph.find_nodes(op="output")))
    outs = list(out_node.args[0])
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    views = get_default_op_list()
    bw_inputs = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    rewritten = 0
    for k, node in enumerate(outs):
        if not isinstance(node, fx.Node) or node.name not in bw_inputs or outs.index(node) != k:
            continue
        val = node.meta.get("val")
        if not how.wants(node, val):
            continue
        readers = [r for r in effective_users(node, views) if how.reads(r)]
        last = max(readers, key=order.__getitem__) if readers else node
        fake = getattr(val, "fake_mode", None)
        with fake if fake is not None else contextlib.nullcontext():
            token = torch.empty((1,), dtype=torch.int64, device="cpu")
        meta = {"val": token, "tensor_meta": extract_tensor_metadata(token)}
        saved = how.pack(fw.graph, node, last, meta, views)
        outs[k] = saved
        # the backward reads the token in the value's place, and gets the value back before its first read
        old = bw_inputs[node.name]
        with bw.graph.inserting_after(old):
            ph = bw.graph.placeholder(saved.name)
        ph.meta.update(saved.meta)
        nodes = list(bw.graph.nodes)
        first = min(old.users, key=nodes.index) if old.users else next(iter(bw.graph.find_nodes(op="output")))
        back = how.unpack(bw.graph, ph, first, nodes, node, val, views)
        back.meta.update({key: v for key, v in old.meta.items() if key in ("val", "tensor_meta")})
        old.replace_all_uses_with(back)
        bw.graph.erase_node(old)
        rewritten += 1
    if rewritten:
        out_node.update_arg(0, tuple(outs))
        for g in (fw, bw):
            g.graph.lint()
            g.recompile()
    return rewritten


def covers(val: Any, nbytes: int | None = None) -> bool:
    """Whether ``val`` is a tensor of static sizes that fills ``nbytes`` (default: its storage's) densely."""
    return (isinstance(val, torch.Tensor) and static(val) and dense(val)
            and val.numel() * val.element_size() == (val.untyped_storage().nbytes() if nbytes is None else nbytes))


def static(v: torch.Tensor) -> bool:
    return all(isinstance(x, int) for x in (*v.shape, *v.stride(), v.storage_offset()))


def effective_users(node: fx.Node, op_types: Any) -> list[fx.Node]:
    """``node``'s readers in its graph, the readers of its views included (a view keeps the storage)."""
    out: list[fx.Node] = []
    for u in node.users:
        if u.op == "output":
            continue
        out.append(u)
        if op_types.is_view(u):
            out.extend(effective_users(u, op_types))
    return out
