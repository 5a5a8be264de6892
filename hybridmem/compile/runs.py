"""Runs of a compiled region in flight: forwards whose backward has not begun.

A block compiled once and called in a loop (regional compilation: Dynamo compiles one graph for all
instances of a module class) runs its compiled forward several times before the first of their backwards
begins; each run holds its saved tensors until then. A region's plan is made for the number of runs
``compile_backend(calls_per_step=)`` says (1 by default); this counter notices more and says so.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

__all__ = ["InFlight"]


class _Ticket:
    """One run: leaves the count when its backward begins or when its graph is freed without one."""

    __slots__ = ("counter", "done")

    def __init__(self, counter: "InFlight") -> None:
        self.counter, self.done = counter, False

    def leave(self, *_: Any) -> None:
        if not self.done:
            self.done = True
            self.counter.left()

    def __del__(self) -> None:  # the autograd node holding the hook died: the graph was freed
        self.leave()


class InFlight:
    """Counts a region's runs in flight. ``on_more(most)`` is called once, when the first backward begins
    (or a graph is freed) after more than ``planned`` runs were in flight: ``most`` is how many."""

    def __init__(self, planned: int, on_more: Callable[[int], None]) -> None:
        self.planned, self.on_more = planned, on_more
        self.live = 0
        self.most = 0
        self.told = False

    def left(self) -> None:
        self.live -= 1
        if self.most > self.planned and not self.told:
            self.told = True
            self.on_more(self.most)

    def wrap(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(compiled)
        def run(*args: Any) -> Any:
            out = compiled(*args)
            node = _grad_node(out)
            if node is not None:
                ticket = _Ticket(self)
                # the hook holds the ticket: it dies with the node if no backward ever runs
                node.register_prehook(lambda grads, t=ticket: t.leave())
                self.live += 1
                self.most = max(self.most, self.live)
            return out

        if getattr(compiled, "_boxed_call", False):
            run._boxed_call = True  # type: ignore[attr-defined]
        return run


def _grad_node(out: Any) -> Any:
    for t in (out if isinstance(out, (list, tuple)) else (out,)):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            return t.grad_fn
    return None
