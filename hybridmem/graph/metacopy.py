"""Meta copies for a capture on ``device="meta"``: a parameter-free copy of the model and meta
stand-ins for its inputs (shapes and dtypes only, no memory)."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from ..errors import CaptureError

Tensor = torch.Tensor


def meta_like(t: Tensor) -> Tensor:
    if t.device.type == "meta":
        return t
    m = torch.empty_like(t, device="meta")
    return m.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else m


def meta_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model itself if it already lives on meta, else a copy whose tensors are meta stand-ins
    (deepcopy with a memo, so no parameter data is copied and tied weights stay tied)."""
    if all(t.device.type == "meta" for t in (*model.parameters(), *model.buffers())):
        return model
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    for m in model.modules():  # plain tensor attributes (masks, tables): meta too, without copying
        for v in vars(m).values():
            if isinstance(v, Tensor) and id(v) not in memo:
                memo[id(v)] = torch.empty_like(v, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:
        raise CaptureError(f"capture(device='meta') could not copy {type(model).__name__} "
                           f"({type(e).__name__}: {e}); build the model under `with torch.device('meta'):` "
                           "and pass that instead") from e


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj
