"""``hybridmem.enable(budget=..., compile=True)`` (or ``HYBRIDMEM_COMPILE=1``): ``torch.compile`` calls
that name no backend get hybridmem's, with the enabled budget.

    HYBRIDMEM_BUDGET=2GiB HYBRIDMEM_COMPILE=1 python train.py     # train.py calls torch.compile(model)

The compiled regions are planned under the budget (:mod:`hybridmem.compile.backend`); code outside
them runs unmanaged. ``hybridmem.stats()`` returns the backend's :class:`CompileStats`. ``disable()``
gives ``torch.compile`` back; models compiled before keep the backend they were compiled with.
"""
from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from ..config import Config
from .backend import POLICIES, CompileBackend, CompileStats

__all__ = ["CompileSession"]


class _Anywhere:
    """Compiled regions run on whichever thread calls them: the session belongs to none."""

    def here(self) -> bool:
        return True

    def alive(self) -> bool:
        return True


class CompileSession:
    """What ``enable(compile=True)`` installs: a backend, and ``torch.compile`` defaulting to it."""

    takes_regions = False
    mode = None

    def __init__(self, cfg: Config) -> None:
        if cfg.budget is None:
            raise ValueError(f"{cfg.source('compile')}: compile needs a budget (HYBRIDMEM_BUDGET or budget=)")
        if cfg.plan is not None:
            raise ValueError(f"{cfg.source('plan')}: a plan file is for the eager runtime; a compiled step is "
                             "planned when it compiles: leave plan unset with compile")
        # the eager default (swap, recompute, compress) is not a choice the user made: compile's own default
        policies = cfg.policies if "policies" in cfg.sources else POLICIES
        self.cfg = cfg
        self.backend = CompileBackend(cfg.budget, device=cfg.device, policies=policies,
                                      cost_model=cfg.extra.get("cost_model"))
        self.owner = _Anywhere()
        self._original: Any = None
        self._lock = threading.Lock()

    def install(self, reset_peak: bool = True) -> None:
        with self._lock:
            if self._original is not None:
                return
            original = torch.compile
            backend = self.backend

            @functools.wraps(original)
            def compile_with_budget(model: Any = None, **kwargs: Any) -> Any:
                kwargs.setdefault("backend", backend)
                return original(model, **kwargs)

            compile_with_budget.__hybridmem_original__ = original  # type: ignore[attr-defined]
            self._original = original
            torch.compile = compile_with_budget
            peak = self.backend.peak
            if peak.device is not None and self.backend.measure:  # enabled again (after an inner session)
                peak.start(peak.device)
                if reset_peak:
                    peak.reset()

    def uninstall(self) -> None:
        with self._lock:
            if self._original is not None:
                torch.compile = self._original
                self._original = None
            self.backend.close()  # regions compiled before keep running unmeasured

    def release(self) -> None:
        self.uninstall()

    def snapshot(self) -> CompileStats:
        return self.backend.stats()

    def reset_stats(self) -> None:
        """Restart the measured peak at the current level (a region's plan figures stay)."""
        self.backend.reset_stats()
