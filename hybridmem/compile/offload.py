"""Saved tensors a compiled graph holds on the host, moved by hybridmem's own ops: the partition's rewrite.

A saved tensor the plan swaps is saved by the partition as it is (``MUST_SAVE``). Where PyTorch's own
offloading pass cannot copy beside the compute stream (its stream ops do not trace: torch 2.11), the backend
rewrites the partition instead: the forward offloads the value right after its last forward read
(``hybridmem::offload``, which returns a token) and saves the token in its place; the backward starts its
reload one kernel before its first read (``hybridmem::reload_start``) and waits for it right before
(``hybridmem::reload_wait``) (:mod:`hybridmem.compile.offload_ops`), so that the copy runs beside that
kernel. The codec ops' rewrite (:func:`hybridmem.compile.compressed.rewrite_partition`) is the same shape.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch
from torch import fx

from . import offload_ops
from .compressed import _effective_users, _static, storage_of

__all__ = ["rewrite_partition"]


def rewrite_partition(fw: fx.GraphModule, bw: fx.GraphModule, storages: Iterable[Any]) -> list[str]:
    """Offload the forward's saved values whose storage is one of ``storages`` (:func:`~hybridmem.compile.
    compressed.storage_of` of the nodes the plan swaps) after their last forward read and reload them in the
    backward (the module docstring). Returns the names of the saved values rewritten; one saved in a form
    that does not cover its storage densely is left as it is (held on the device)."""
    from torch._functorch.partitioners import get_default_op_list
    from torch._subclasses.fake_tensor import extract_tensor_metadata

    offload_ops.register()
    wanted = {s for s in storages if s is not None}
    out_node = next(iter(fw.graph.find_nodes(op="output")))
    outs = list(out_node.args[0])
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    views = get_default_op_list()
    bw_inputs = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    done: list[str] = []
    for k, node in enumerate(outs):
        if not isinstance(node, fx.Node) or node.name not in bw_inputs or outs.index(node) != k:
            continue
        if storage_of(node) not in wanted:
            continue
        val = node.meta.get("val")
        if not (isinstance(val, torch.Tensor) and _static(val) and offload_ops.dense(val)
                and val.numel() * val.element_size() == val.untyped_storage().nbytes()):
            continue
        readers = _effective_users(node, views)
        last = max(readers, key=order.__getitem__) if readers else node
        with fw.graph.inserting_after(last):
            off = fw.graph.call_function(torch.ops.hybridmem.offload.default, (node,),
                                         name=f"hybridmem_offload_{node.name}")
        fake = getattr(val, "fake_mode", None)
        with fake if fake is not None else contextlib.nullcontext():
            token = torch.empty((1,), dtype=torch.int64, device="cpu")
        off.meta["val"], off.meta["tensor_meta"] = token, extract_tensor_metadata(token)
        outs[k] = off
        old = bw_inputs[node.name]
        with bw.graph.inserting_after(old):
            ph = bw.graph.placeholder(off.name)
        ph.meta.update(off.meta)
        nodes = list(bw.graph.nodes)
        first = min(old.users, key=nodes.index) if old.users else next(iter(bw.graph.find_nodes(op="output")))
        # one kernel early: the copy runs beside the call before the first read (a view is no kernel)
        before = [n for n in nodes[:nodes.index(first)] if n.op == "call_function" and not views.is_view(n)]
        early = before[-1] if before else first
        geometry = (list(val.shape), list(val.stride()), val.dtype, val.device)
        with bw.graph.inserting_before(early):
            start = bw.graph.call_function(torch.ops.hybridmem.reload_start.default, (ph, *geometry),
                                           name=f"hybridmem_reload_start_{node.name}")
        start.meta.update(off.meta)
        with bw.graph.inserting_before(first):
            wait = bw.graph.call_function(torch.ops.hybridmem.reload_wait.default, (start, *geometry),
                                          name=f"hybridmem_reload_{node.name}")
        wait.meta.update({key: v for key, v in old.meta.items() if key in ("val", "tensor_meta")})
        old.replace_all_uses_with(wait)
        bw.graph.erase_node(old)
        done.append(node.name)
    if done:
        out_node.update_arg(0, tuple(outs))
        for g in (fw, bw):
            g.graph.lint()
            g.recompile()
    return done

