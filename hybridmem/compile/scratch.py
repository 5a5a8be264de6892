"""Kernel scratch of a joint graph's library ops (convolutions, matrix products, attention), measured.

A compiled step calls the same library kernels as an eager one for its FLOP-heavy ops, and those
allocate scratch (im2col buffers, reordered weights) beyond their inputs and outputs. The graph's
``Stage.workspace`` gets it by running each such op once on zero-filled inputs of its shapes and
reading the allocator's peak inside the call: the native CPU meter (:mod:`hybridmem.native.cpumeter`)
on the CPU, the caching allocator's peak on CUDA. Ops with the same signature are measured once.

Where Inductor's layout optimization will run the convolutions in channels-last (on the CPU with oneDNN it
always does), they are measured so: a contiguous convolution's scratch on the CPU is the oneDNN reorder of
its input and weight, up to twice the input's bytes, where channels-last needs almost none (VGG-16 small:
4.2 MB against 18 KB for the backward of its second convolution).
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Iterable

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..graph.capture import scratch_meter
from .joint import JointGraph

__all__ = ["inductor_channels_last", "measure_scratch"]


# the ops whose inputs Inductor's convolution lowerings require channels-last under its layout optimization
# (joint.has_convolution's wider set names every convolution op, for the margin)
_CHANNELS_LAST_OPS = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)


def inductor_channels_last(gm: fx.GraphModule) -> bool:
    """Whether Inductor's layout optimization runs the convolutions of joint graph ``gm`` in channels-last
    (its own decision, ``GraphLowering.decide_layout_opt``; False where that cannot be asked)."""
    try:
        from torch._inductor.graph import GraphLowering
        return bool(GraphLowering.decide_layout_opt(gm, is_inference=False))
    except Exception:     # a private API: without it, the convolutions are measured as the graph gives them
        return False


def _real(v: Any, device: torch.device, channels_last: bool = False) -> Any:
    if isinstance(v, torch.Tensor):
        if any(not isinstance(s, int) for s in (*v.shape, *v.stride())):
            raise _Symbolic
        out = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=device).zero_()
        return out.contiguous(memory_format=torch.channels_last) if channels_last and out.dim() == 4 else out
    if isinstance(v, (tuple, list)):
        return type(v)(_real(x, device, channels_last) for x in v)
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Symbolic
    return v


class _Symbolic(Exception):
    """An argument with a symbolic size: not measurable."""


def _args(node: fx.Node, device: torch.device, channels_last: bool = False) -> tuple[tuple, dict]:
    def val(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return _real(a.meta.get("val"), device, channels_last)
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


def measure_scratch(jgs: Iterable[JointGraph], device: torch.device, channels_last: bool = False) -> str:
    """Set ``Stage.workspace`` of the FLOP-counted stages of the joint graphs ``jgs`` (counts of one region:
    each op is measured once, whichever graph has it); ``channels_last``: measure the convolutions on
    channels-last inputs (:func:`inductor_channels_last`). Returns where the figures come from."""
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
                    args, kwargs = _args(node, device, channels_last and node.target in _CHANNELS_LAST_OPS)
                except _Symbolic:
                    seen[key] = 0
                    continue
                peak, out = _peak_of(lambda: node.target(*args, **kwargs), device, meter)
                outs = out if isinstance(out, (tuple, list)) else (out,)
                out_bytes = sum(o.untyped_storage().nbytes() for o in outs if isinstance(o, torch.Tensor))
                seen[key] = max(0, int(peak) - out_bytes)
                del args, kwargs, out, outs
            s.workspace = max(s.workspace, seen[key])     # a fused stage's own buffers may be more
    return ("measured: the allocator's peak inside each library op beyond its inputs and outputs"
            + (" (convolutions in channels-last, as Inductor runs them)" if channels_last else ""))
