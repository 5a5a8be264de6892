"""FLOPs of one aten op: the one counter that capture (the planner's graph) and the runtime's op costs
(:class:`hybridmem.runtime.lineage.OpCost`) both use, so the planner and the runtime price a recompute
alike.

The numbers are ``torch.utils.flop_counter``'s formulas. Its formulas map every argument to its shape
before counting (30-45 us an op on these CPUs), too slow for the runtime, so the ops that carry the
FLOPs of a forward pass (matrix products, convolutions, attention) have closed forms here that give the
same numbers in under 1 us (``tests/test_flops.py`` checks them against torch's). Every other op torch
has a formula for (backward convolutions and attention, ``_scaled_mm``, flex attention) goes through
torch's; the rest count 0 and a cost model prices them by the bytes they move.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

Tensor = torch.Tensor
aten = torch.ops.aten


def _out(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) and out else out


def _mm(args: tuple, kwargs: dict, out: Any) -> float:          # mm(a, b), bmm(a, b): 2 * out * k
    o, a = _out(out), args[0]
    return 2.0 * o.numel() * a.shape[-1]


def _addmm(args: tuple, kwargs: dict, out: Any) -> float:       # addmm(c, a, b), baddbmm(c, a, b)
    o, a = _out(out), args[1]
    return 2.0 * o.numel() * a.shape[-1]


def _convolution(args: tuple, kwargs: dict, out: Any) -> float:
    # convolution(x, w, bias, stride, padding, dilation, transposed, ...): torch's conv_flop_count
    x, w, o = args[0], args[1], _out(out)
    transposed = bool(args[6]) if len(args) > 6 else bool(kwargs.get("transposed", False))
    spatial = x.shape[2:] if transposed else o.shape[2:]
    n = 1
    for d in spatial:
        n *= d
    return 2.0 * x.shape[0] * n * w.numel()


def _sdpa(args: tuple, kwargs: dict, out: Any) -> float:
    # (..., L, E) x (..., S, E)^T, then (..., L, S) x (..., S, Ev): torch's sdpa_flop_count
    q, k, v = args[0], args[1], args[2]
    rows = q.numel() // max(q.shape[-1], 1)
    return 2.0 * rows * k.shape[-2] * (q.shape[-1] + v.shape[-1])


_FAST: dict[Any, Callable[[tuple, dict, Any], float]] = {
    aten.mm: _mm, aten.bmm: _mm, aten.addmm: _addmm, aten.baddbmm: _addmm, aten.convolution: _convolution,
}
for _name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
    if hasattr(aten, _name):
        _FAST[getattr(aten, _name)] = _sdpa

_TORCH: dict[Any, Any] | None = None  # torch's formulas, built on the first op that needs one


def _torch_table() -> dict[Any, Any]:
    """torch's FLOP formulas, plus the CPU flash-attention kernels (same maths as the CUDA ones)."""
    global _TORCH
    if _TORCH is None:
        # lazy: torch.utils.flop_counter imports torch._dynamo in some torch releases (seconds at import),
        # and the runtime only needs it for ops without a closed form above
        from torch.utils import flop_counter as fc

        table = dict(fc.flop_registry)
        for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", "sdpa_flop"),
                              ("_scaled_dot_product_flash_attention_for_cpu_backward", "sdpa_backward_flop")):
            if hasattr(aten, name) and hasattr(fc, formula):
                table.setdefault(getattr(aten, name), getattr(fc, formula))
        _TORCH = table
    return _TORCH


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """FLOPs of one call of the aten op ``func`` (an OpOverload) with these arguments and output; 0 for
    ops without a formula, or whose arguments a formula does not know."""
    packet = getattr(func, "overloadpacket", None)
    fast = _FAST.get(packet)
    try:
        if fast is not None:
            return fast(args, kwargs, out)
        f = _torch_table().get(packet)
        return 0.0 if f is None else float(f(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not know this overload's arguments: no FLOP estimate
        return 0.0
