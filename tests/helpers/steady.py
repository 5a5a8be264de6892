"""Shared helpers of the steady-state tests (no tests here): train a zoo model for a few steps, unmanaged or
under a budget, and compare bit for bit."""
from __future__ import annotations

import copy
import gc
import math
from typing import Any, Callable

import torch
from torch import nn

import hybridmem
from hybridmem.runtime.meter import profiler_peak
from hybridmem.runtime.stats import PolicyStats
from hybridmem.zoo import build
from tests.helpers.runtime import raw


def train_steps(model: nn.Module, batches: list[tuple], loss_fn: Callable[..., torch.Tensor], *,
           session: dict | None = None, per_step: Callable[[int, Any], None] | None = None) -> tuple[list, Any]:
    """SGD steps over ``batches``; returns (losses, grads, params and buffers as bytes) and the stats."""
    model = copy.deepcopy(model)
    torch.manual_seed(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses: list[float] = []
    stats = None
    ctx = hybridmem.session(**session) if session is not None else None
    s = ctx.__enter__() if ctx is not None else None
    try:
        for i, batch in enumerate(batches):
            loss = loss_fn(model, *batch)
            loss.backward()
            losses.append(loss.item())
            if per_step is not None and s is not None:
                per_step(i, s.stats())
            if i < len(batches) - 1:
                opt.step()
                opt.zero_grad()
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
            stats = s.stats()
    grads = [raw(p.grad) for p in model.parameters() if p.grad is not None]
    state = [raw(t) for t in (*model.parameters(), *model.buffers())]
    return [losses, grads, state], stats


def recompute_stats(stats: Any) -> PolicyStats:
    return stats.policies.get("recompute", PolicyStats())


def monitor_peak(model: nn.Module, batches: list[tuple], loss_fn: Callable[..., torch.Tensor]) -> tuple[int, int]:
    _, st = train_steps(model, batches[:2], loss_fn, session={"budget": None})
    return st.peak_bytes, st.saved_bytes


def zoo_batches(name: str, steps: int = 4, size: str = "small") -> tuple[nn.Module, list[tuple],
                                                                         Callable[..., torch.Tensor]]:
    e = build(name, size, seed=0)
    args, kwargs = e.args_kwargs()

    def loss_fn(model: nn.Module, *a: Any) -> torch.Tensor:
        return e.loss_fn(model(*a, **kwargs))
    return e.model, [tuple(args)] * steps, loss_fn


def budget_run(model: nn.Module, batches: list[tuple], loss_fn: Callable[..., torch.Tensor], cut: float,
                **extra: Any) -> tuple[list, Any, int, list[Any]]:
    """Train under peak - cut * saved (raised to the minimum an OOM names, as a user would)."""
    peak, saved = monitor_peak(model, batches, loss_fn)
    budget = int(peak - cut * saved)
    per: list[Any] = []
    for _ in range(6):
        per.clear()
        try:
            got, st = train_steps(model, batches, loss_fn, per_step=lambda i, s: per.append(s),
                             session={"budget": budget, "policies": ("recompute",), **extra})
            return got, st, budget, per
        except torch.OutOfMemoryError as e:
            floor = getattr(e, "min_budget_bytes", 0)
            assert floor > budget, f"an OOM at {budget} must name a larger minimum: {e}"
            budget = math.ceil(floor * 1.01)
        gc.collect()  # the failed try's step (a user retries in a new process)
    raise AssertionError("no feasible budget in 6 tries")


def steady_real_bytes(name: str, cut: float, policy: str) -> tuple[int, int, Any]:
    """Zoo ``name`` trained 3 steps under the monitor's peak - ``cut`` * saved with ``policy``, then a 4th
    measured independently of hybridmem (torch.profiler's memory events, plus the training state):
    ``(real bytes, budget, stats)``."""
    gc.collect()  # earlier tests' garbage freed meanwhile would move the monitor's peak, hence the budget
    model, batches, loss_fn = zoo_batches(name, steps=4)
    peak, saved = monitor_peak(model, batches, loss_fn)
    budget = int(peak - cut * saved)
    model = copy.deepcopy(model)
    with hybridmem.session(budget=budget, policies=(policy,)) as s:
        for _ in range(3):
            loss_fn(model, *batches[0]).backward()
        state = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers(),
                                                               *(p.grad for p in model.parameters())))
        step = profiler_peak(lambda: loss_fn(model, *batches[0]).backward())
        st = s.stats()
    return state + step, budget, st
