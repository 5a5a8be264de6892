"""What the CUDA caching allocator holds, read the cheap way.

``torch.cuda.memory_allocated()`` builds the allocator's whole statistics dict in C++, converts it to
Python and flattens it in Python: about 0.25 ms a read on an H100's host, where the runtime reads the
allocated bytes around each op it meters. :func:`cuda_counters` reads each counter with one C call
through hybridmem's native library (:meth:`~.cpumeter.CpuAllocatorMeter.cuda_reader`, built against the
caching allocator where torch has CUDA), and falls back to ``torch._C._cuda_memoryStats`` (the nested
dict without its flattening) where the library has no CUDA hook; ``source`` says which.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .cpumeter import load

Reader = Callable[[], int]


@dataclass(frozen=True)
class CudaCounters:
    """One CUDA device's caching-allocator counters, each a function of no argument."""

    allocated: Reader     # bytes of live allocations (``memory_allocated``)
    peak: Reader          # their peak since the last reset (``max_memory_allocated``)
    reserved: Reader      # bytes the allocator holds from the driver, cached blocks included
    ooms: Reader          # allocations it refused so far (``num_ooms``)
    source: str           # "native" or "torch._C._cuda_memoryStats"


def cuda_counters(device: torch.device, native: object | None = None) -> CudaCounters:
    """The counters of CUDA ``device`` (an index is required), natively where the library has its CUDA hook."""
    index = device.index
    if index is None:
        raise ValueError(f"cuda_counters({device}): expected a device with an index, e.g. cuda:0")
    lib = native if native is not None else load()
    if lib is not None and getattr(lib, "cuda_hook", False):
        read = lib.cuda_reader  # type: ignore[attr-defined]
        return CudaCounters(read("allocated", index), read("peak", index), read("reserved", index),
                            read("ooms", index), "native")
    return torch_counters(index)


def torch_counters(index: int) -> CudaCounters:
    """The counters read through ``torch._C._cuda_memoryStats`` (no flattening, still a dict per read)."""
    stats = torch._C._cuda_memoryStats  # type: ignore[attr-defined]

    def bytes_of(key: str, field: str) -> Reader:
        return lambda: stats(index)[key]["all"][field]

    return CudaCounters(bytes_of("allocated_bytes", "current"), bytes_of("allocated_bytes", "peak"),
                        bytes_of("reserved_bytes", "current"), lambda: stats(index)["num_ooms"],
                        "torch._C._cuda_memoryStats")
