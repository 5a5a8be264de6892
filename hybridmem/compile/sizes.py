"""Sizes of a region compiled for dynamic shapes: what its plan is made at, and each call's.

Dynamo compiles a region again for any size once a call brings new sizes (the smaller last batch of a
``DataLoader``, a longer sequence): the graph's sizes are then symbols. Reading one with ``int()`` would
add a guard that fixes the region to that size (and Inductor then failed to lower such a partition's
backward, torch 2.13: "Cannot convert expression to float"); :func:`size_hint` reads the size without a
guard. A plan is made at the largest size the region was compiled for before (:func:`planned_at`: the full
batch, where a smaller last batch made Dynamo compile it for any size), else at the sizes of the call that
compiled it. :func:`bound` then guards each symbol at most its planned value: a later call with a larger
size fails Dynamo's guards, and Dynamo compiles the region again, planned at that size, rather than run a
step that holds more than its plan counted. The guard is checked by Dynamo's guard code, with the guards
it checks anyway: nothing per call in Python. :meth:`PlannedSizes.inputs` gives the run at compile time
(:mod:`hybridmem.compile.trial`) inputs at the planned sizes, so that it measures the sizes planned for.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import free_symbols, guard_bool

__all__ = ["PlannedSizes", "bound", "planned_at", "planning_at", "size_hint"]

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


def bound(inputs: Sequence[tuple[str, Any]], at: dict[Any, int]) -> None:
    """Guard each symbol of ``at`` that stands alone as a size of a tensor input (``inputs``: name and fake
    value) at most its planned value. Called while Dynamo compiles the region (its backend call), the guard
    joins the region's: a call with a larger size does not run this compile, Dynamo compiles the region
    again. An upper bound only: the region still serves every smaller size (no specialization)."""
    done: set[Any] = set()
    for _, x in inputs:
        for s in x.shape:
            if isinstance(s, torch.SymInt) and (expr := s.node.expr).is_Symbol and expr in at and expr not in done:
                done.add(expr)
                guard_bool(s <= at[expr])     # the call's own size is at most ``at``'s: a guard that holds now


class PlannedSizes:
    """The symbolic sizes among a region's inputs (``example_inputs``, as the backend got them; ``fakes``: each
    one's placeholder value, where its sizes are symbols), the values its plan was made at (``planned``) and
    those of the call that compiled it (``compiled_at``)."""

    def __init__(self, example_inputs: Sequence[Any], fakes: Sequence[Any]) -> None:
        # a symbol Dynamo specialized stands as its value (its str is a number): no size to check there
        self.at = [(i, str(x), size_hint(x)) for i, x in enumerate(example_inputs)
                   if isinstance(x, torch.SymInt) and free_symbols(x)]
        self.compiled_at = {str(example_inputs[i]): size_hint(example_inputs[i], planned=False)
                            for i, _, _ in self.at}
        self.fakes = list(fakes)
        # Dynamo passes a symbolic size as a SymInt; a plan made again outside Dynamo (hybridmem.compile.regions)
        # gets a call's ints, and compiles for that call's sizes
        self.symbolic = any(isinstance(x, torch.SymInt) for x in example_inputs)

    @property
    def planned(self) -> dict[str, int]:
        return {name: hint for _, name, hint in self.at}

    def above(self, planned: dict[str, int]) -> bool:
        """Whether this compile's call had a size above an earlier plan's ``planned`` sizes (Dynamo compiled it
        again because that plan's :func:`bound` failed)."""
        return any(v > planned[k] for k, v in self.compiled_at.items() if k in planned)

    def inputs(self, example_inputs: Sequence[Any]) -> list[Any]:
        """The example inputs at the planned sizes: a symbolic size as a plain int (the compiled step reads
        ints), and a tensor whose symbolic sizes are planned above the call's as a copy that large, its values
        repeated from the call's along those dimensions (real values: token ids stay in range). Raises
        ValueError where a tensor has no values to repeat."""
        if not self.symbolic:
            return list(example_inputs)
        out: list[Any] = []
        for x, fake in zip(example_inputs, self.fakes):
            if isinstance(x, torch.SymInt):
                out.append(size_hint(x))
            elif isinstance(x, torch.Tensor) and isinstance(fake, torch.Tensor) and \
                    any(isinstance(s, torch.SymInt) for s in fake.shape):
                out.append(_grown(x, fake))
            else:
                out.append(x)
        return out


def _grown(x: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """``x`` at the planned sizes of its placeholder value ``fake`` (strides too: the compiled step checks
    them), its values repeated along the dimensions that grew; ``x`` itself where nothing grows."""
    shape = [size_hint(s) for s in fake.shape]
    if list(x.shape) == shape:
        return x
    if any(n == 0 for n in x.shape):
        raise ValueError(f"an input of sizes {tuple(x.shape)} has no values to repeat to {tuple(shape)}")
    with torch.no_grad(), unset_fake_temporarily():
        src = x.detach()
        for d, n in enumerate(shape):
            if n != src.shape[d]:
                src = src.index_select(d, torch.arange(n, device=src.device) % src.shape[d])
        grown = torch.empty_strided(shape, [size_hint(s) for s in fake.stride()], dtype=x.dtype, device=x.device)
        grown.copy_(src)
    return grown.requires_grad_(x.requires_grad)
