"""The budget at run time: bytes the managed device may hold (``enable(budget=...)``, ``HYBRIDMEM_BUDGET``)."""
from __future__ import annotations

from typing import Any

import torch

from ..graph.units import BUDGET_FORMS, check_capacity, host_memory, parse_budget

__all__ = ["device_budget_bytes"]


def device_budget_bytes(value: Any, device: torch.device) -> int | None:
    """A budget at run time, in bytes (None: measure only), at most the device's memory (on the CPU, the
    host's); on CUDA a percentage is of the device's total memory. When planning a percentage means
    something else (:func:`hybridmem.graph.units.plan_budget_bytes`: of the step's keep-all peak)."""
    if value is None:
        return None
    if device.type == "cuda":
        capacity, of = torch.cuda.get_device_properties(device).total_memory, str(device)
        return check_capacity(int(parse_budget(value, total=capacity)), capacity, of, value)
    n = parse_budget(value)
    if isinstance(n, str):
        raise ValueError(f"invalid budget {value!r}: a percentage is of CUDA device memory; on the CPU "
                         f"expected {', '.join(BUDGET_FORMS[:2])}")
    capacity = host_memory()
    return n if capacity is None else check_capacity(n, capacity, "host", value)
