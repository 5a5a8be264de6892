"""hybridmem: train PyTorch models under a hard device-memory budget.

Saved activations are evicted and regenerated per tensor by swap (to host memory), recompute (replay of
the producing ops) or compress, following an offline STR plan or an online scorer::

    import hybridmem
    hybridmem.enable(budget="8GiB")          # or: HYBRIDMEM_BUDGET=8GiB python train.py
    ...train as usual...
    print(hybridmem.stats())

The module imports nothing heavy until an attribute is used, so the start-up hook stays cheap.
"""
from __future__ import annotations

import importlib
TYPE_CHECKING = False  # typing costs every process start milliseconds: annotations only
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute)
_API = {
    "enable": ("hybridmem.runtime", "enable"),
    "disable": ("hybridmem.runtime", "disable"),
    "session": ("hybridmem.runtime", "session"),
    "stats": ("hybridmem.runtime", "stats"),
    "reset_stats": ("hybridmem.runtime", "reset_stats"),
    "enabled": ("hybridmem.runtime", "enabled"),
    "Stats": ("hybridmem.runtime", "Stats"),
    "Session": ("hybridmem.runtime", "Session"),
    "capture": ("hybridmem.graph.capture", "capture"),
    "Graph": ("hybridmem.graph.ir", "Graph"),
    "Plan": ("hybridmem.graph.plan", "Plan"),
    "Action": ("hybridmem.graph.plan", "Action"),
    "Config": ("hybridmem.config", "Config"),
    "Meter": ("hybridmem.runtime.meter", "Meter"),
    "get_cost_model": ("hybridmem.graph.costs", "get_cost_model"),
    "parse_bytes": ("hybridmem.graph.units", "parse_bytes"),
    "simulate": ("hybridmem.graph.simulate", "simulate"),
    "compile_backend": ("hybridmem.compile.backend", "compile_backend"),
    "CompileBackend": ("hybridmem.compile.backend", "CompileBackend"),
    "HybridMemError": ("hybridmem.errors", "HybridMemError"),
    "BudgetInfeasibleError": ("hybridmem.errors", "BudgetInfeasibleError"),
}

__all__ = sorted([*_API, "plan"]) + ["__version__"]


def plan(*args: Any, **kwargs: Any) -> Any:
    """Solve an eviction Plan for a Graph: see :func:`hybridmem.solvers.plan`."""
    from .solvers import plan as solve  # lazy: the start-up hook imports this package (no torch, no numpy)

    return solve(*args, **kwargs)


def __getattr__(name: str) -> Any:
    try:
        module, attr = _API[name]
    except KeyError:
        raise AttributeError(f"module 'hybridmem' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
