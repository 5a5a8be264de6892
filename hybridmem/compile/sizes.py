"""Sizes of a region compiled for dynamic shapes: what its plan is made at, and each call's.

Dynamo compiles a region again for any size once a call brings new sizes (the smaller last batch of a
``DataLoader``, a longer sequence): the graph's sizes are then symbols. Reading one with ``int()`` would
add a guard that fixes the region to that size (and Inductor then failed to lower such a partition's
backward, torch 2.13: "Cannot convert expression to float"); :func:`size_hint` reads the size without a
guard. A plan is made at the largest size the region was compiled for before (:func:`planned_at`: the full
batch, where a smaller last batch made Dynamo compile it for any size), else at the sizes of the call that
compiled it. A later call with larger sizes runs the same compiled step and holds more than the plan
counted: :class:`PlannedSizes` reads the sizes each call passes (plain ints, one per symbol the graph
takes as an input) and says so once per region.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = ["PlannedSizes", "planned_at", "planning_at", "size_hint"]

# symbol -> the value plans are made at, while a region is planned (:func:`planning_at`)
_AT: contextvars.ContextVar[dict[Any, int]] = contextvars.ContextVar("hybridmem_planned_sizes", default={})


def size_hint(x: Any, planned: bool = True) -> int:
    """An int from a size that may be symbolic: the value plans are made at (``planned``), else the size
    of the call that compiled the region (its hint); never a guard."""
    if not isinstance(x, torch.SymInt):
        return int(x)
    at = _AT.get() if planned else None
    if at:
        expr = x.node.expr
        if expr.free_symbols and all(s in at for s in expr.free_symbols):
            return int(expr.xreplace(at))
    from torch.fx.experimental import symbolic_shapes
    # optimization_hint (a hint for decisions, no guard) where torch has it; hint_int in older releases
    fn = getattr(symbolic_shapes, "optimization_hint", None) or getattr(symbolic_shapes, "hint_int")
    return int(fn(x))


@contextlib.contextmanager
def planning_at(at: dict[Any, int]) -> Iterator[None]:
    """:func:`size_hint` gives ``at``'s values for its symbols (sympy symbols -> ints) inside."""
    token = _AT.set(dict(at))
    try:
        yield
    finally:
        _AT.reset(token)


def planned_at(inputs: Sequence[tuple[str, Any]], largest: dict[tuple[str, int], int]) -> dict[Any, int]:
    """The sizes to plan a compile at: for each symbol that stands alone as a size of a tensor input (``inputs``:
    its name and example value), the larger of its hint and the largest size compiled for before at that input
    and dimension (``largest``: (name, dim) -> size, updated here with this compile's sizes)."""
    at: dict[Any, int] = {}
    for name, x in inputs:
        for d, s in enumerate(x.shape):
            if isinstance(s, torch.SymInt):
                expr = s.node.expr
                if expr.is_Symbol:
                    at[expr] = max(at.get(expr, 0), largest.get((name, d), 0), size_hint(s, planned=False))
    for name, x in inputs:
        for d, s in enumerate(x.shape):
            v = at.get(s.node.expr, 0) if isinstance(s, torch.SymInt) else int(s)
            largest[(name, d)] = max(largest.get((name, d), 0), v)
    return at


class PlannedSizes:
    """The symbolic sizes among a region's inputs and the values its plan was made at; ``on_larger(sizes)``
    is called once, at the first call with a size above them (``sizes``: symbol -> that call's value)."""

    def __init__(self, example_inputs: Sequence[Any], on_larger: Callable[[dict[str, int]], None]) -> None:
        from torch.fx.experimental.symbolic_shapes import free_symbols
        # a symbol Dynamo specialized stands as its value (its str is a number): no size to check there
        self.at = [(i, str(x), size_hint(x)) for i, x in enumerate(example_inputs)
                   if isinstance(x, torch.SymInt) and free_symbols(x)]
        self.compiled_at = {str(x): size_hint(x, planned=False) for _, x in
                            ((i, example_inputs[i]) for i, _, _ in self.at)}
        self.on_larger = on_larger
        self.largest: dict[str, int] = {}      # symbol -> the largest value a call had above the plan's

    @property
    def planned(self) -> dict[str, int]:
        return {name: hint for _, name, hint in self.at}

    def wrap(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        if not self.at:
            return compiled

        @functools.wraps(compiled)
        def run(*args: Any) -> Any:
            # read before the call: a boxed call empties its argument list
            flat = args[0] if len(args) == 1 and isinstance(args[0], list) else args
            above = {name: v for i, name, hint in self.at
                     if i < len(flat) and isinstance(v := flat[i], int) and v > max(hint, self.largest.get(name, 0))}
            if above:
                first = not self.largest
                self.largest.update(above)
                if first:
                    self.on_larger(dict(above))
            return compiled(*args)

        if getattr(compiled, "_boxed_call", False):
            run._boxed_call = True  # type: ignore[attr-defined]
        return run
