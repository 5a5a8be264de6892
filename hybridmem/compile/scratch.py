"""Kernel scratch of a joint graph's library ops (convolutions, matrix products, attention), measured.

A compiled step calls the same library kernels as an eager one for its FLOP-heavy ops, and those
allocate scratch (im2col buffers, reordered weights) beyond their inputs and outputs. The graph's
``Stage.workspace`` gets it by running each such op once on zero-filled inputs of its shapes and
reading the allocator's peak inside the call: the native CPU meter (:mod:`hybridmem.runtime.cpumeter`)
on the CPU, the caching allocator's peak on CUDA. Ops with the same signature are measured once.
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Iterable

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..graph.capture import scratch_meter
from .joint import JointGraph

__all__ = ["measure_scratch"]


def _real(v: Any, device: torch.device) -> Any:
    if isinstance(v, torch.Tensor):
        if any(not isinstance(s, int) for s in (*v.shape, *v.stride())):
            raise _Symbolic
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=device).zero_()
    if isinstance(v, (tuple, list)):
        return type(v)(_real(x, device) for x in v)
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Symbolic
    return v


class _Symbolic(Exception):
    """An argument with a symbolic size: not measurable."""


def _args(node: fx.Node, device: torch.device) -> tuple[tuple, dict]:
    def val(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return _real(a.meta.get("val"), device)
        if isinstance(a, (tuple, list)):
            return type(a)(val(x) for x in a)
        return a
    return tuple(val(a) for a in node.args), {k: val(v) for k, v in node.kwargs.items()}


def _signature(node: fx.Node) -> Any:
    def sig(a: Any) -> Any:
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):     # sizes as text: a symbolic size is not hashable
                return (tuple(map(str, v.shape)), tuple(map(str, v.stride())), v.dtype)
            return repr(v)
        if isinstance(a, (tuple, list)):
            return tuple(sig(x) for x in a)
        return repr(a)
    return (node.target, sig(node.args), sig(tuple(sorted(node.kwargs.items()))))


def _peak_of(call: Any, device: torch.device, meter: Any) -> tuple[int, Any]:
    """Bytes the allocator held at its peak inside ``call()`` beyond its level before it, and what it returned."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = call()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, out
    base = meter.current_bytes
    meter.window_reset()
    out = call()
    return meter.window_peak - base, out


def measure_scratch(jgs: Iterable[JointGraph], device: torch.device) -> str:
    """Set ``Stage.workspace`` of the FLOP-counted stages of the joint graphs ``jgs`` (counts of one region:
    each op is measured once, whichever graph has it); return where the figures come from."""
    seen: dict[Any, int] = {}
    with ExitStack() as stack:
        meter = None
        if device.type == "cpu":
            meter, note = scratch_meter(stack)
            if meter is None:
                return note
        elif device.type != "cuda":
            return f"not measured on {device.type}"
        # the partition runs under the compile's fake mode: real tensors need it set aside
        stack.enter_context(unset_fake_temporarily())
        stack.enter_context(torch.no_grad())
        for s, node in ((s, node) for jg in jgs for s, node in zip(jg.graph.stages, jg.stage_node)):
            if s.flops <= 0 or not isinstance(node.target, torch._ops.OpOverload):
                continue
            key = _signature(node)
            if key not in seen:
                try:
                    args, kwargs = _args(node, device)
                except _Symbolic:
                    seen[key] = 0
                    continue
                peak, out = _peak_of(lambda: node.target(*args, **kwargs), device, meter)
                outs = out if isinstance(out, (tuple, list)) else (out,)
                out_bytes = sum(o.untyped_storage().nbytes() for o in outs if isinstance(o, torch.Tensor))
                seen[key] = max(0, int(peak) - out_bytes)
                del args, kwargs, out, outs
            s.workspace = max(s.workspace, seen[key])     # a fused stage's own buffers may be more
    return "measured: the allocator's peak inside each library op beyond its inputs and outputs"
