"""Saved tensors a compiled graph holds on the host, moved by hybridmem's own ops: the partition's rewrite.

A saved tensor the plan swaps is saved by the partition as it is (``MUST_SAVE``). Where PyTorch's own
offloading pass cannot copy beside the compute stream (its stream ops do not trace: torch 2.11), the backend
rewrites the partition instead: the forward offloads the value right after its last forward read
(``hybridmem::offload``, which returns a token) and saves the token in its place; the backward starts its
reload one kernel before its first read (``hybridmem::reload_start``) and waits for it right before
(``hybridmem::reload_wait``) (:mod:`hybridmem.compile.offload_ops`), so that the copy runs beside that
kernel. A fence (``hybridmem::offload_wait``) a few nodes after the offload, where the copy out is predicted
done, reads the value: Inductor keeps its buffer (does not hand it to a later kernel) until the compute
stream has waited for the copy; the forward saves the fence's token. The codec ops' rewrite
(:func:`hybridmem.compile.compressed.rewrite_partition`) is the same one (:mod:`hybridmem.compile.rewrite`).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable

import torch
from torch import fx

from . import offload_ops
from .compressed import storage_of
from .copies import node_ms
from .rewrite import covers, rewrite_saved

__all__ = ["FENCE_NODES", "host_tokens", "rewrite_partition"]

FENCE_NODES = 3     # without a cost model: the copy out runs beside this many forward nodes before its fence
# the ops whose output is a host token a forward saves in a tensor's place
TOKEN_OPS = ("offload", "offload_wait", "pack_saved")


def rewrite_partition(fw: fx.GraphModule, bw: fx.GraphModule, storages: Iterable[Any], model: Any = None) -> list[str]:
    """Offload the forward's saved values whose storage is one of ``storages`` (:func:`~hybridmem.compile.
    compressed.storage_of` of the nodes the plan swaps) after their last forward read and reload them in the
    backward (the module docstring). ``model``: a device model (:class:`hybridmem.graph.costs.DeviceModel`)
    that places each fence after the nodes its copy out is predicted to take; without one, after
    :data:`FENCE_NODES` nodes. Returns the names of the saved values rewritten; one saved in a form that
    does not cover its storage densely is left as it is (held on the device)."""
    offload_ops.register()
    how = _Offload(storages, model)
    rewrite_saved(fw, bw, how)
    return how.done


class _Offload:
    """The offload ops (:mod:`hybridmem.compile.offload_ops`) as a :class:`~hybridmem.compile.rewrite.SavedRewrite`."""

    def __init__(self, storages: Iterable[Any], model: Any) -> None:
        self.wanted = {s for s in storages if s is not None}
        self.model = model
        self.done: list[str] = []

    def wants(self, node: fx.Node, val: Any) -> bool:
        return storage_of(node) in self.wanted and covers(val)

    def reads(self, reader: fx.Node) -> bool:
        return not _hybridmem_op(reader)      # an earlier fence may read the value to order itself (not its data)

    def pack(self, fw: fx.Graph, node: fx.Node, last: fx.Node, meta: dict[str, Any], views: Any) -> fx.Node:
        with fw.inserting_after(last):
            off = fw.call_function(torch.ops.hybridmem.offload.default, (node,), name=f"hybridmem_offload_{node.name}")
        off.meta.update(meta)
        point, after = _fence_point(off, views, _copy_done(self.model, node.meta["val"]))
        with fw.inserting_before(point):
            fence = fw.call_function(torch.ops.hybridmem.offload_wait.default, (off, node, after),
                                     name=f"hybridmem_offload_wait_{node.name}")
        fence.meta.update(off.meta)
        self.done.append(node.name)
        return fence

    def unpack(self, bw: fx.Graph, token: fx.Node, first: fx.Node, nodes: list[fx.Node], node: fx.Node, val: Any,
               views: Any) -> fx.Node:
        # one kernel early: the copy runs beside the call before the first read (a view is no kernel)
        before = [n for n in nodes[:nodes.index(first)] if n.op == "call_function" and not views.is_view(n)]
        early = before[-1] if before else first
        geometry = (list(val.shape), list(val.stride()), val.dtype, val.device)
        with bw.inserting_before(early):
            start = bw.call_function(torch.ops.hybridmem.reload_start.default, (token, *geometry),
                                     name=f"hybridmem_reload_start_{node.name}")
        start.meta.update(token.meta)
        with bw.inserting_before(first):
            return bw.call_function(torch.ops.hybridmem.reload_wait.default, (start, *geometry),
                                    name=f"hybridmem_reload_{node.name}")


def _copy_done(model: Any, val: torch.Tensor) -> Callable[[fx.Node], bool]:
    """A clock for one offload of ``val``: given each forward node that runs after it, in turn, whether the
    nodes so far cover its copy out (by ``model``'s estimate of both, else :data:`FENCE_NODES` of them)."""
    if model is None or not hasattr(model, "copy_time"):
        count = itertools.count(1)
        return lambda node: next(count) >= FENCE_NODES
    ms = node_ms(model)
    left = [model.copy_time(val.numel() * val.element_size(), "d2h") * 1e3]

    def ran(node: fx.Node) -> bool:
        left[0] -= ms(node)
        return left[0] <= 0
    return ran


def _fence_point(off: fx.Node, views: Any, covers: Callable[[fx.Node], bool]) -> tuple[fx.Node, list[fx.Node]]:
    """The node an offload's fence goes before: the one after the kernel with which ``covers`` says the
    kernels since the offload cover its copy (views and hybridmem's ops are none), else the output; and the
    last of those kernels with a tensor value, for the fence to read: Inductor's scheduler orders by data,
    and would otherwise run the fence right after the offload, with nothing beside the copy."""
    ran: list[fx.Node] = []
    node = off.next
    while node.op != "output":
        here, node = node, node.next
        if here.op == "call_function" and not views.is_view(here) and not _hybridmem_op(here):
            ran.append(here)
            if covers(here):
                break
    anchor = next((n for n in reversed(ran) if isinstance(n.meta.get("val"), torch.Tensor)), None)
    return node, [anchor] if anchor is not None else []


def _hybridmem_op(node: fx.Node) -> bool:
    return getattr(node.target, "namespace", None) == "hybridmem"


def host_tokens(fw: fx.GraphModule) -> int:
    """The values the forward ``fw`` saves for its backward as host tokens (hybridmem's offload and codec
    ops): CUDA graphs (cudagraph trees) skip a graph that holds one."""
    ops = {getattr(torch.ops.hybridmem, name).default for name in TOKEN_OPS if hasattr(torch.ops.hybridmem, name)}
    out = next(iter(fw.graph.find_nodes(op="output")))
    saved = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    return sum(1 for n in saved if isinstance(n, fx.Node) and n.target in ops)
