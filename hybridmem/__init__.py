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
    "capture": ("hybridmem.capture", "capture"),
    "Graph": ("hybridmem.graph", "Graph"),
    "Plan": ("hybridmem.plan", "Plan"),
    "Action": ("hybridmem.plan", "Action"),
    "Config": ("hybridmem.config", "Config"),
    "Meter": ("hybridmem.meter", "Meter"),
    "get_cost_model": ("hybridmem.costs", "get_cost_model"),
    "parse_bytes": ("hybridmem.units", "parse_bytes"),
}

__all__ = sorted([*_API, "plan", "simulate"]) + ["__version__"]


# ``plan`` and ``simulate`` are both public functions and submodules (hybridmem/plan.py, simulate.py).
# Importing a submodule sets the package attribute to the module, which would shadow the function, so
# these two are bound eagerly, after their modules are imported, and stay functions from then on.
from . import plan as _plan_module, simulate as _simulate_module  # noqa: E402  (order matters, see above)
from .simulate import simulate  # noqa: E402


def plan(*args: Any, **kwargs: Any) -> Any:
    """Solve an eviction Plan for a Graph: see :func:`hybridmem.solvers.plan`."""
    from .solvers import plan as solve

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
