"""The storages an aten op returned: one walk over an op's outputs for every place that needs it (the
capture recorder, the meter, the runtime's dispatch mode, the output-size estimate).

An op returns a Tensor, a tuple or list of them, or a tuple whose items are lists of tensors
(``Tensor[]`` returns, e.g. ``split``); anything else holds no tensor. ``walk_outputs`` yields each
tensor with its return index (the index that ``torch._C`` schema facts such as "fresh output" are about)
and its flat position (the order a replay maps outputs back in).

Fast path, for code that runs once per op: most ops return one plain ``Tensor``. Test
``type(out) is Tensor`` first (an exact type test, cheaper than ``isinstance``, and false for tensor
subclasses such as DTensor, which need their own handling) and call ``out.untyped_storage()`` directly:
:func:`storage_of` only adds the guard for tensors with no plain storage (sparse, nested, wrappers), which
raise there. The storage's Python object is the same for a tensor and all its views, so ``id(st)`` keys a
storage for as long as it lives.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

Tensor = torch.Tensor

__all__ = ["storage_of", "output_tensors", "flat_outputs", "walk_outputs"]


def storage_of(t: Tensor) -> torch.UntypedStorage | None:
    """``t``'s storage, or None for tensors without a plain one (sparse, nested or wrapper tensors)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def output_tensors(out: Any) -> tuple[Tensor, ...] | list[Tensor]:
    """The tensors an op returned, in return order (lists inside a tuple flattened)."""
    if isinstance(out, Tensor):
        return (out,)
    if type(out) is not tuple and type(out) is not list:
        return ()
    res: list[Tensor] = []
    for o in out:
        if isinstance(o, Tensor):
            res.append(o)
        elif type(o) is list or type(o) is tuple:
            res.extend(t for t in o if isinstance(t, Tensor))
    return res


def flat_outputs(out: Any) -> list[Any]:
    """Every item an op returned, in flat position order (lists inside a tuple flattened; non-tensors
    kept, so an item's index is its position)."""
    if isinstance(out, Tensor):
        return [out]
    return [t for _, _, t in walk_outputs(out)]


def walk_outputs(out: Any) -> Iterator[tuple[int, int, Any]]:
    """``(return index, flat position, item)`` for every item an op returned; items of a list return
    share its return index. ``item`` may be a non-tensor (None for an undefined optional output): it
    still takes a position."""
    if isinstance(out, Tensor):
        yield 0, 0, out
        return
    if type(out) is not tuple and type(out) is not list:
        return
    pos = 0
    for i, o in enumerate(out):
        for t in (o if type(o) is list or type(o) is tuple else (o,)):
            yield i, pos, t
            pos += 1
