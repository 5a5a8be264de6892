"""Shared helpers of the runtime tests (no tests here): train a few steps with or without the runtime
and compare bit for bit.

Snapshots are taken through numpy (``Tensor.numpy()`` runs no aten op), so keeping them costs the
simulated device nothing and the managed and unmanaged runs meter the same memory.
"""
from __future__ import annotations

import copy
import gc
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import hybridmem
from hybridmem.runtime import Stats
from hybridmem.graph.units import fmt_bytes


@dataclass
class Case:
    """A model, its inputs as (args, kwargs) and a loss of its output."""

    name: str
    model: torch.nn.Module
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    loss_fn: Callable[[Any], torch.Tensor] = lambda out: out.float().square().mean()

    def loss(self, model: torch.nn.Module) -> torch.Tensor:
        return self.loss_fn(model(*self.args, **self.kwargs))


def raw(t: torch.Tensor) -> bytes:
    return t.detach().numpy().tobytes()


def snapshot(model: torch.nn.Module, loss: torch.Tensor) -> tuple[bytes, list[bytes], list[bytes]]:
    grads = [raw(p.grad) if p.grad is not None else b"" for p in model.parameters()]
    return raw(loss), grads, [raw(b) for b in model.buffers()]


def train(case: Case, model: torch.nn.Module, steps: int = 3,
          optim: str | Callable[[Any], torch.optim.Optimizer] = "sgd", seed: int = 0,
          after_first: Callable[[], None] | None = None) -> list[Any]:
    """``steps`` training steps (``optim``: "sgd" with momentum, "sgd-plain", "adam", or a factory taking
    the parameters); per step the loss, every gradient and every buffer (bytes), and at the end the
    global RNG's state (a replay must not consume it). ``after_first`` runs after the first step."""
    if callable(optim):
        opt = optim(model.parameters())
    else:
        opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if optim == "adam"
               else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9 if optim == "sgd" else 0.0))
    torch.manual_seed(seed)
    out: list[Any] = []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = case.loss(model)
        loss.backward()
        out.append(snapshot(model, loss))
        opt.step()
        if i == 0 and after_first is not None:
            after_first()
    out.append(raw(torch.get_rng_state()))
    return out


def run(case: Case, *, steps: int = 3, optim: str = "sgd", **session: Any) -> tuple[list[Any], Stats | None]:
    """Train a fresh copy of the case's model, unmanaged (no ``session`` arguments) or in a session."""
    model = copy.deepcopy(case.model)
    if not session:
        return train(case, model, steps, optim), None
    # monitor-only runs measure what budgets derive from: the allocator's bytes, the units the cap enforces;
    # it counts every live allocation of the process, so first collect what earlier runs left in cycles
    gc.collect()
    with hybridmem.session(device="cpu", **session) as s:
        result = train(case, model, steps, optim)
    return result, s.stats()


def budget_for(stats: Stats, cut: float = 0.4) -> int:
    """The test budget: the monitor-only peak minus ``cut`` of the step's saved activations."""
    return stats.peak_bytes - int(cut * stats.saved_bytes)


def min_budget_of(e: torch.OutOfMemoryError) -> int:
    """The budget an OOM of the runtime names, in its text and as ``min_budget_bytes``: the one its step was
    measured to need (runtime.survey), or where the cap was not lifted a lower bound."""
    named = getattr(e, "min_budget_bytes", None)
    assert named is not None, f"the OOM names no minimum: {e}"
    said = (f"a budget of {fmt_bytes(named)} ({named} bytes) holds every op of it",
            f"Smallest budget that could work: at least {fmt_bytes(named)} ({named} bytes)")
    assert any(x in str(e) for x in said), str(e)
    return named


def run_feasible(case: Case, budget: int, *, tries: int = 6, **session: Any) -> tuple[list[Any], Stats, int]:
    """``run`` under ``budget``; where the runtime raises an OOM naming a minimum, that minimum must be
    above the budget that failed, and the run is retried at the minimum + 1 % (what a user does).
    Returns the results, the stats and the budget that worked."""
    for _ in range(tries):
        try:
            got, st = run(case, budget=budget, **session)
        except torch.OutOfMemoryError as e:
            named = min_budget_of(e)
            assert named > budget, f"{case.name}: the OOM names {named} bytes, not above the failed budget {budget}"
            budget = int(named * 1.01)
            del e
            gc.collect()  # the failed step's tensors, held in cycles through its traceback: the allocator counts them
            continue
        assert st is not None
        return got, st, budget
    raise AssertionError(f"{case.name}: no budget worked after {tries} tries (last {budget})")


def check_managed(case: Case, policies: tuple[str, ...], *, cut: float = 0.4, steps: int = 3,
                  optim: str = "sgd") -> Stats:
    """Unmanaged, monitor-only and managed runs: bit-identical results, managed peak within budget."""
    ref, _ = run(case, steps=steps, optim=optim)
    mon, mstats = run(case, steps=steps, optim=optim, budget=None, policies=policies)
    assert mon == ref, f"{case.name}: monitor-only run differs from the unmanaged run"
    assert mstats is not None and mstats.saved_bytes > 0
    got, st, budget = run_feasible(case, budget_for(mstats, cut), steps=steps, optim=optim, policies=policies)
    assert st.peak_bytes <= budget, f"{case.name}: peak {st.peak_bytes} > budget {budget}"
    assert sum(p.evicted for p in st.policies.values()) > 0, f"{case.name}: nothing was evicted"
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a == b, f"{case.name} {policies}: step {i} differs from the unmanaged run (loss, grads, buffers or RNG)"
    return st


def in_fresh_process(fn: Callable[[], Any], timeout: float = 600) -> Any:
    """``fn()`` (a module-level function returning plain data) in a spawned interpreter: no dispatch mode or
    saved-tensor hook an earlier test left on this thread (a runtime disabled from another thread leaves
    both) reaches it."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(fn).result(timeout=timeout)
