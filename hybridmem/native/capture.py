"""Whether the current CUDA stream is capturing a graph (``torch.cuda.graph``, ``make_graphed_callables``).

While a stream captures, CUDA refuses what the runtime's hooks would otherwise do around a saved tensor:
pinned host allocation (``cudaHostAlloc``), event queries, reading the CUDA generator's state; and a
storage freed mid-capture may be an address the graph replays into. The hooks then keep every tensor as it
is (no eviction) and read no device state. :func:`capturing` is the one check, free where CUDA was never
initialised (every CPU run, a CPU-only build): one module attribute read before any call into CUDA.
"""
from __future__ import annotations

import torch

__all__ = ["capturing"]

_cuda = torch.cuda


def capturing() -> bool:
    """True while the current CUDA stream captures a graph; False where CUDA is not initialised."""
    # torch.cuda._initialized is set by lazy init: no capture can be under way before it
    return bool(_cuda._initialized) and _cuda.is_current_stream_capturing()
