"""Planning without re-scanning the heap that was there before it.

Planning a region allocates a few million short-lived Python objects (copies of the joint FX graph,
simulator states, solver tables). They make the cyclic collector run its collections of the oldest
generation, which walk every object of the process, Dynamo's and Inductor's included. :func:`frozen_heap`
moves the objects that exist when planning starts into the collector's permanent generation
(``gc.freeze``) and back after it: the garbage planning makes is still collected, the heap from before is
not walked again: a compiled region's planning took about 15 % less (docs/benchmarks.md, "Measured constants and design choices"); the eager runtime's plans, with
no compiler's heap around them, gain nothing from it.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["frozen_heap"]


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the objects that exist now for the block; where some are frozen already (the caller's own
    ``gc.freeze``) or the collector is off, do nothing: unfreezing would undo the caller's freeze."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
