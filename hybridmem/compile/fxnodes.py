"""What the nodes of AOTAutograd's joint graph hold and do: their tensor values, bytes, storages and FLOPs, and
whether they draw random numbers or alias their input (read by :mod:`hybridmem.compile.joint`, what Inductor
fuses in :mod:`hybridmem.compile.fusion`, and the partition's accounting)."""
from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..graph.flops import op_flops
from .sizes import size_hint

__all__ = ["aliases", "draws_seeds", "is_random", "node_flops", "node_nbytes", "seeded", "storage_key", "tensor_vals"]


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


def storage_key(t: torch.Tensor) -> Any:
    try:
        return StorageWeakRef(t.untyped_storage())
    except Exception:
        return ("tensor", id(t))


def is_random(node: fx.Node) -> bool:
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


def seeded(n: fx.Node) -> bool:
    return n.op == "call_function" and str(n.target) in _SEEDED


def aliases(n: fx.Node) -> bool:
    """Whether ``n`` is a view op (its output shares its input's storage: ``detach``, ``t``, ``permute``)."""
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and bool(n.target.is_view)


def draws_seeds(n: fx.Node) -> bool:
    """Whether ``n`` draws the seeds Inductor's random ops are computed from (``inductor_seeds``)."""
    return n.op == "call_function" and str(n.target) == "prims.inductor_seeds.default"
