"""How many new bytes an op is about to allocate, known before it runs (the cap acts before the op).

Sources, cheapest first:

1. *The previous step*: the bytes the op at the same stage index allocated, if it was the same op
   (training steps repeat; a changed input shape changes the op's arguments, not its name, so the
   record is used only while the step's stage count and op names keep matching, and the post-op
   check catches the rest).
2. *Shape inference on meta*: the op run on meta copies of its arguments (tens of microseconds), in
   the first step (no record yet) or when the record does not match, unless the device is far below
   the budget: less than half of it used and 8x the largest allocation seen so far still free.
3. Far below the budget an op without a record is assumed to allocate nothing: it cannot matter. If
   the meta kernel fails, the largest input's size is the guess. An op that still overruns is counted
   in ``Stats.cap_overruns`` and the runtime evicts right after it.

Meta results are cached by the op and its arguments' metadata (shapes, strides, dtypes and the
other arguments): the ops a recompute replays have no stage, so without the cache every replay of
every step would run the meta kernel again, and many meta kernels are Python decompositions
(BatchNorm's takes milliseconds).
"""
from __future__ import annotations

from typing import Any

import torch

from ..graph.outputs import walk_outputs
from .lineage import replay_info

Tensor = torch.Tensor


class OutputEstimator:
    """Per-stage allocation records of the last step, and meta inference near the budget."""

    def __init__(self) -> None:
        self.prev: list[tuple[Any, Any, int]] = []   # stage -> (func, first tensor arg's shape, bytes)
        self.cur: list[tuple[Any, Any, int]] = []
        self.largest = 0                        # most new bytes one op allocated so far

    def learn(self, stage: int, func: Any, nbytes: int, args: tuple = ()) -> None:
        if nbytes > self.largest:
            self.largest = nbytes
        if stage >= 0:
            cur = self.cur
            if stage == len(cur):
                cur.append((func, _first_shape(args), nbytes))
            elif stage < len(cur):
                cur[stage] = (func, _first_shape(args), nbytes)

    def new_step(self) -> None:
        if self.cur:
            self.prev, self.cur = self.cur, []

    def estimate(self, stage: int, func: Any, args: tuple, kwargs: dict, headroom: int, budget: int) -> int:
        """New bytes ``func`` will allocate; cheap unless ``headroom`` (budget - live) is small."""
        # Same op at the same stage is not enough: DDP changes its backward ops in step 2 (bucket
        # rebuild) and a new input shape keeps op names; the first tensor argument's shape must match.
        if 0 <= stage < len(self.prev):
            f, s, nbytes = self.prev[stage]
            if f is func and s == _first_shape(args):
                return nbytes
        if 2 * headroom > budget and headroom > 8 * self.largest > 0:
            return 0  # far below the budget: nothing one op allocates can matter
        return cached_meta_bytes(func, args, kwargs)


_META: dict[Any, int] = {}
_META_MAX = 1 << 14  # entries; a program whose shapes never repeat clears it now and then


def cached_meta_bytes(func: Any, args: tuple, kwargs: dict) -> int:
    """:func:`meta_bytes` (else the largest input's size), cached by the op and its arguments'
    metadata; arguments that cannot be keyed (unhashable) skip the cache."""
    try:
        key = (id(func), _key(args), _key(tuple(kwargs.items())) if kwargs else None)
        got = _META.get(key)
    except TypeError:
        key = got = None
    if got is not None:
        return got
    est = meta_bytes(func, args, kwargs)
    if est is None:
        est = _largest_input(args, kwargs)
    if key is not None:
        if len(_META) >= _META_MAX:
            _META.clear()
        _META[key] = est
    return est


def _key(a: Any) -> Any:
    """Hashable stand-in of an argument: a tensor by its geometry and dtype (what output sizes depend
    on), sequences element-wise, anything else as itself."""
    if isinstance(a, Tensor):
        return (a.shape, a.stride(), a.dtype, a.device.type)
    if type(a) is tuple or type(a) is list:
        return tuple(_key(b) for b in a)
    return a


def _first_shape(args: tuple) -> Any:
    for a in args:
        if isinstance(a, Tensor):
            return a.shape
    return None


def meta_bytes(func: Any, args: tuple, kwargs: dict) -> int | None:
    """Bytes of the new storages ``func`` returns, from its meta kernel (None if it has none)."""
    fresh = replay_info(func).fresh
    if not any(fresh):
        return 0
    try:
        with torch._C._DisableTorchDispatch():
            margs = tuple(_meta(a) for a in args)
            mkw = _meta_kwargs(func, kwargs)
            out = func(*margs, **mkw)
    except Exception:
        return None
    total = 0
    for i, _, t in walk_outputs(out):
        if isinstance(t, Tensor) and not (i < len(fresh) and not fresh[i]):
            total += _storage_bytes(t)
    return total


def _meta_kwargs(func: Any, kwargs: dict) -> dict:
    """Keyword arguments for the meta run. A factory op's ``device`` is replaced by meta even where the
    call leaves it at its default (the CPU): run for real, ``randn`` and friends would draw from the
    program's generator and change its data. Generators are dropped (meta draws nothing)."""
    out = {k: _meta(v) for k, v in kwargs.items()}
    for arg in _factory_args(func):
        out[arg] = "meta" if arg == "device" else None
    return out


_FACTORY_ARGS: dict[int, tuple[str, ...]] = {}


def _factory_args(func: Any) -> tuple[str, ...]:
    """The keyword-only ``device`` and ``pin_memory`` arguments of ``func``'s schema (cached)."""
    got = _FACTORY_ARGS.get(id(func))
    if got is None:
        schema = getattr(func, "_schema", None)
        names = [a.name for a in schema.arguments if a.kwarg_only] if schema is not None else []
        got = _FACTORY_ARGS[id(func)] = tuple(n for n in ("device", "pin_memory") if n in names)
    return got


def _meta(a: Any) -> Any:
    if isinstance(a, torch.Generator):
        return None
    if isinstance(a, Tensor):
        if a.device.type == "meta":
            return a
        return torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device="meta")
    if type(a) in (list, tuple):
        return type(a)(_meta(b) for b in a)
    return a


def _storage_bytes(t: Tensor) -> int:
    if t.numel() == 0:
        return 0
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return (t.storage_offset() + span) * t.element_size()


def _largest_input(args: tuple, kwargs: dict) -> int:
    best = 0
    for a in (*args, *kwargs.values()):
        for t in (a if type(a) in (list, tuple) else (a,)):
            if isinstance(t, Tensor):
                best = max(best, t.numel() * t.element_size())
    return best
