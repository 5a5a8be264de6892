"""The managed device and its budget in bytes: what the eager runtime, the compile backend and the settings
share, below all of them.

A run-time budget is read in two steps. :func:`parse_device_budget` checks it as given, before the device
is known (a setting, ``enable(budget=)``, ``compile_backend(budget)``): bytes, or a percentage kept as the
string. :func:`device_budget_bytes` resolves it on a device: on CUDA a percentage is of the device's total
memory, on the CPU it is refused. Planning reads a percentage differently, as one of the step's keep-all
peak (:func:`hybridmem.graph.units.plan_budget_bytes`).
"""
from __future__ import annotations

from typing import Any

import torch

from .graph.costs import get_cost_model
from .graph.units import BUDGET_FORMS, check_capacity, host_memory, parse_budget

__all__ = ["resolve_device", "cost_model_for", "parse_device_budget", "device_budget_bytes", "budget_needs_cuda",
           "NO_BUDGET", "BARE_MIN"]

NO_BUDGET = ("none", "off", "monitor")   # a setting's words for "only measure"
# a bare number (no unit) below this is refused: bytes that few are a unit left off ("--budget 12"), no budget
BARE_MIN = 2**20


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``: the current CUDA device if there is one, else the CPU (a simulated device)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"invalid device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available here; use 'cpu' (a simulated device)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r} is not supported: expected 'cpu', 'cuda' or 'cuda:N'")
    return dev


def cost_model_for(device: torch.device, name: str | None = None) -> Any:
    """The cost model recompute costs come from: ``name`` (the config's ``plugins: {cost_model: NAME}``),
    else the CPU model, or on CUDA the model named like the GPU (H100, H200, A100, V100; else H100)."""

    if name is None and device.type == "cuda":
        gpu = torch.cuda.get_device_name(device).lower()
        name = next((n for n in ("h200", "h100", "a100", "v100") if n in gpu), "h100")
    return get_cost_model(name or "cpu")


def parse_device_budget(value: Any, *, setting: bool = True) -> int | str | None:
    """A run-time budget checked before its device is known: a positive whole number of bytes, or a
    percentage in (0, 100] returned as the string (:func:`device_budget_bytes` resolves it).

    ``setting`` (``enable()``, ``HYBRIDMEM_BUDGET``, YAML, ``--budget``): ``'none'``, ``'off'`` and ``'monitor'``
    mean only measure (None), and a bare number of bytes under 1 MiB is refused as a unit left off.
    Otherwise (the compile backend, which plans for a budget) only bytes or a percentage are accepted."""
    if not setting:
        if value is None or isinstance(value, bool):
            raise ValueError("budget: expected bytes (an int, '8GiB'; on CUDA also '60%' of device memory), "
                             f"got {value!r}")
        return parse_budget(value, forms=BUDGET_FORMS[:-1])
    if value is None or isinstance(value, str) and value.strip().lower() in NO_BUDGET:
        return None
    if isinstance(value, str) and value.strip().isdigit() and 0 < int(value) < BARE_MIN:
        n = int(value)
        raise ValueError(f"a bare number is bytes, and {n} bytes is less than any training step holds: give a "
                         f"unit, e.g. '{n}MiB' or '{n}GiB' (bare numbers of bytes start at {BARE_MIN}, 1 MiB)")
    return parse_budget(value)


def budget_needs_cuda(value: Any, why: str = "") -> ValueError:
    """The error for a percentage budget where no CUDA device is (``why``: which device there is instead)."""
    return ValueError(f"invalid budget {value!r}: a percentage needs a CUDA device (of its memory)"
                      f"{', and ' + why if why else ''}; on the CPU give bytes: {', '.join(BUDGET_FORMS[:2])}")


def device_budget_bytes(value: Any, device: torch.device, *, capacity: bool = True,
                        what: str = "the runtime") -> int | None:
    """``value`` (as :func:`parse_device_budget` takes it) in bytes on ``device`` (None: measure only). On
    CUDA a percentage is of the device's total memory; on the CPU it is refused (``what`` runs there).
    ``capacity``: at most the device's memory (on the CPU, the host's), else a ValueError naming both."""
    if value is None:
        return None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        n = int(parse_budget(value, total=total))
        return check_capacity(n, total, str(device), value) if capacity else n
    n = parse_budget(value)
    if isinstance(n, str):
        raise budget_needs_cuda(value, f"{what} runs on {device}")
    host = host_memory() if capacity else None
    return n if host is None else check_capacity(n, host, "host", value)
