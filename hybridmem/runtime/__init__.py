"""Train under a hard device-memory budget, with no change to the model code.

    import hybridmem
    hybridmem.enable(budget="8GiB")            # or: HYBRIDMEM_BUDGET=8GiB python train.py
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step(); opt.zero_grad()
    print(hybridmem.stats())

    with hybridmem.session(budget="512MiB", policies=("recompute",)) as s:
        ...
    s.stats().peak_bytes

While enabled, every tensor autograd saves for backward on the managed device goes through a
saved-tensor hooks pair, and every op through a dispatch mode that meters device bytes. Before an op
would take the live bytes over the budget, saved activations are evicted (swapped to the host,
dropped for recomputation, or compressed) and regenerated when backward reads them, bit-identical
for the lossless policies. ``budget=None`` only measures: by default through the allocator's counters
with no dispatch mode (:mod:`.monitor`: CUDA's caching allocator, the native meter on the CPU;
``monitor="ops"`` meters every op). Hooks and
the mode are thread-local: enable on the thread that trains (the allocator meter is process-wide); a
module trained on another thread warns once. A runtime whose thread exited is released by the next
call here, and a forked child (DataLoader workers, multiprocessing) starts unmanaged. Only the innermost
``saved_tensors_hooks`` pair runs, so tensors saved inside ``torch.utils.checkpoint`` or ``save_on_cpu``
regions are left to them; under a budget ``torch.utils.checkpoint`` regions run plainly and their
tensors are managed (:mod:`.ckpt`).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ..config import DEFAULT_POLICIES, Config
from ..graph.plan import Plan
from . import current
from .compose import Runtime, resolve_plan
from .stats import PolicyStats, Stats

__all__ = ["enable", "disable", "session", "stats", "reset_stats", "enabled", "Session", "Stats", "PolicyStats"]

def enable(budget: int | str | None = None, policies: Sequence[str] | str = DEFAULT_POLICIES,
           plan: "Plan | str | Path | None" = None, device: str | None = None,
           config: "str | Path | Mapping[str, Any] | Config | None" = None, *, monitor: str | None = None,
           compile: bool | None = None) -> None:
    """Start managing saved activations on this thread; replaces a runtime already enabled.

    ``budget``: bytes the managed device may hold (an int, ``"512MiB"``, ``"8GB"``, ``"8GiB"``; on CUDA
    also ``"60%"`` of device memory), or None to only measure. ``policies``: which of ``swap``,
    ``recompute``, ``compress`` (or registered plugins) may evict; ``plan``: a Plan or plan file to
    follow (its evictions at its stages, the online scorer for the rest). ``device``: ``"cpu"``
    (a simulated device: the meter counts live bytes) or ``"cuda[:N]"``; default CUDA if available.
    ``config``: YAML file or mapping. Precedence: arguments > ``HYBRIDMEM_*`` variables > YAML > defaults
    (``policies`` left at its default does not override ``HYBRIDMEM_POLICIES``). ``monitor`` (without a
    budget or plan): ``"allocator"`` reads the allocator's counters, nothing per op (on the CPU the native
    meter of :mod:`hybridmem.native.cpumeter`); ``"ops"`` meters every op (the cap's units, stages,
    ``min_budget_bytes``); ``"auto"`` (default): allocator on CUDA, and on the CPU where the native meter
    builds, else ops. ``compile`` (or ``HYBRIDMEM_COMPILE=1``): instead of the eager runtime, ``torch.compile`` calls
    that name no backend plan each compiled region under the budget (:mod:`hybridmem.compile.session`);
    ``stats()`` then returns its :class:`~hybridmem.compile.CompileStats`. Raises ValueError on a malformed
    budget or setting, UnknownNameError (a ValueError) on an unknown policy.
    """
    plan_obj = plan if isinstance(plan, Plan) else None
    cfg = Config.resolve(config, budget=budget, device=device, monitor=monitor, compile=compile,
                         policies=None if policies is DEFAULT_POLICIES else policies,
                         plan=None if plan is None or plan_obj is not None else str(plan))
    if cfg.compile:
        if plan_obj is not None:
            raise ValueError("plan: a Plan is for the eager runtime; a compiled step is planned when it compiles: "
                             "leave plan unset with compile=True")
        from ..compile.session import CompileSession  # torch._dynamo is imported only when compile is asked for
        rt: Any = CompileSession(cfg)
    else:
        rt = Runtime(cfg, plan_obj if plan_obj is not None else resolve_plan(cfg.plan))
    if current.live() is not None:
        disable()
    rt.install()
    current.rt = rt


def disable() -> None:
    """Stop managing new saved tensors. Entries already evicted are still regenerated when read.
    Called on another thread than the enabling one, that thread's hooks pass everything through until
    it next calls ``enable()``, ``disable()``, ``enabled()`` or ``stats()``, which removes them."""
    rt, current.rt, current.orphan = current.live(), None, None
    if rt is not None:
        try:
            rt.uninstall()
        except Exception:
            current.rt = rt
            raise
        err, rt.survey_error = getattr(rt, "survey_error", None), None
        if err is not None and sys.exc_info()[0] is None:  # a step over the budget, measured (runtime.survey):
            try:                                          # reported unless an exception is on its way already
                raise err
            finally:
                err = None  # no cycle through this frame (see Residency.refuse)


def enabled() -> bool:
    return current.live() is not None


def stats() -> Stats:
    """Measurements since ``enable()`` or the last ``reset_stats()`` (see :class:`Stats`); after the
    enabling thread exited, those it left. Under ``enable(compile=True)``: the compiled regions' plans
    (:class:`~hybridmem.compile.CompileStats`)."""
    rt = current.live() or current.orphan
    if rt is None:
        raise RuntimeError("hybridmem is not enabled: call hybridmem.enable() (or set HYBRIDMEM_BUDGET) first")
    return rt.snapshot()


def reset_stats() -> None:
    """Restart the peak at the current level and zero the counters."""
    rt = current.live()
    if rt is not None:
        rt.reset_stats()


class Session:
    """Handle of a :func:`session`; ``stats()`` works during and after it."""

    def __init__(self, runtime: Any):
        self.runtime = runtime

    def stats(self) -> Stats:
        return self.runtime.snapshot()

    def reset_stats(self) -> None:
        self.runtime.reset_stats()


@contextmanager
def session(budget: int | str | None = None, policies: Sequence[str] | str = DEFAULT_POLICIES,
            plan: "Plan | str | Path | None" = None, device: str | None = None,
            config: "str | Path | Mapping[str, Any] | Config | None" = None, *,
            monitor: str | None = None, compile: bool | None = None) -> Iterator[Session]:
    """``enable(...)`` for the duration of a ``with`` block; the runtime enabled before (if any) comes back."""
    outer = current.live()
    if outer is not None:
        outer.uninstall()
        current.rt = None
    try:
        enable(budget=budget, policies=policies, plan=plan, device=device, config=config, monitor=monitor,
               compile=compile)
        s = Session(current.rt)
        try:
            yield s
        finally:
            disable()
    finally:
        if outer is not None:
            outer.install(reset_peak=False)
            current.rt = outer
