"""The custom ops that hold a compiled graph's saved tensor on the host from the forward to the backward,
copied beside the compute stream.

    token = torch.ops.hybridmem.offload(x)                                   # forward, after x's last read
    ready = torch.ops.hybridmem.reload_start(token, size, stride, dtype, device)  # backward, a kernel early
    x = torch.ops.hybridmem.reload_wait(ready, size, stride, dtype, device)       # backward, before its first read

On CUDA ``offload`` records an event on the current stream; a side stream of its own waits for it and
copies ``x`` into a pinned host buffer (:class:`hybridmem.plugins.swap.PinnedPool`), and ``x``'s memory is
kept from reuse until that copy has read it (``record_stream``). ``reload_start`` allocates ``x``'s device
tensor and, on the side stream, waits for the offload's copy and copies back; ``reload_wait`` makes the
current stream wait for that copy (on the device: the host goes on) and hands the tensor out. Between the
two the compute stream runs the kernels before the first read. On the CPU each op copies at once: the
same graph, the same bits. Inductor sees the ops as opaque calls, as it sees the codec ops
(:mod:`hybridmem.compile.codec_ops`); the host copy lives as long as a token names it (autograd frees
offload's with the backward's other saved tensors; a backward run twice reloads twice). PyTorch's own offloading pass does this where its stream ops trace
(torch 2.11's do not); these ops do it on every torch the backend supports.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..plugins.swap import PinnedPool, host_empty_like
from .codec_ops import dense
from .oplib import define_once

__all__ = ["held", "register"]


@dataclass(eq=False)
class _Held:
    host: torch.Tensor                  # uint8, the saved tensor's bytes
    lease: Any = None                   # the pinned pool's buffer behind ``host`` (CUDA)
    copied: Any = None                  # event: the host copy is complete (CUDA)
    out: torch.Tensor | None = None     # the device tensor reload_start fills
    landed: Any = None                  # event: ``out`` is complete (CUDA)


_LOCK = threading.Lock()
_KEYS = itertools.count(1)
_HELD: dict[int, _Held] = {}
_TOKENS: dict[int, int] = {}            # key -> tokens alive that name its host copy
_POOL: PinnedPool | None = None
_SIDE: dict[int, Any] = {}              # CUDA device index -> its copy stream


def held() -> int:
    """Host copies held now (tokens alive): 0 once every step's backward has freed its saved tensors."""
    return len(_HELD)


def _side(device: torch.device) -> Any:
    with _LOCK:
        s = _SIDE.get(device.index or 0)
        if s is None:
            s = _SIDE[device.index or 0] = torch.cuda.Stream(device)
        return s


def _pool() -> PinnedPool:
    global _POOL
    with _LOCK:
        if _POOL is None:
            _POOL = PinnedPool(pin=True)
        return _POOL


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """``x``'s elements in memory order as bytes (``x`` is dense: its elements fill one block of its storage)."""
    return x.as_strided((x.numel(),), (1,), x.storage_offset()).view(torch.uint8)


def _drop(key: int) -> None:
    with _LOCK:
        _TOKENS[key] -= 1
        if _TOKENS[key]:
            return                  # another token of this copy is alive (reload_start's, or offload's)
        del _TOKENS[key]
        h = _HELD.pop(key, None)
    if h is not None and h.lease is not None:
        if h.landed is not None:
            h.lease.buf.last_use = h.landed           # the pool orders the buffer's next copy after this one
        h.lease.give_back()


def _token(key: int) -> torch.Tensor:
    token = torch.full((1,), key, dtype=torch.int64)
    with _LOCK:
        _TOKENS[key] = _TOKENS.get(key, 0) + 1
    weakref.finalize(token.untyped_storage(), _drop, key)   # the host copy goes with the token
    return token


def _offload(x: torch.Tensor) -> torch.Tensor:
    if not dense(x):        # the graph rewrite offloads dense tensors only
        raise RuntimeError(f"hybridmem::offload: a tensor of size {tuple(x.shape)} and strides {x.stride()} is not dense")
    src = _bytes(x)
    if x.device.type == "cuda":
        from ..plugins.swap import _Lease
        pool = _pool()
        lease = _Lease(pool, pool.acquire(src.numel()))
        host = lease.buf.tensor[:src.numel()]
        ready = torch.cuda.Event()
        ready.record()                                  # x is complete on the current stream
        side = _side(x.device)
        with torch.cuda.stream(side):
            side.wait_event(ready)
            if lease.buf.last_use is not None:
                side.wait_event(lease.buf.last_use)     # the buffer's last copy is done with it
            host.copy_(src, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        x.record_stream(side)                           # its memory is not reused before the copy read it
        h = _Held(host, lease, copied)
    else:
        host = host_empty_like(src)                     # host memory that is not the budgeted allocator's
        host.copy_(src)
        h = _Held(host)
    key = next(_KEYS)
    with _LOCK:
        _HELD[key] = h
    return _token(key)


def _get(token: torch.Tensor, op: str) -> tuple[int, _Held]:
    key = int(token.item())
    with _LOCK:
        h = _HELD.get(key)
    if h is None:
        raise RuntimeError(f"hybridmem::{op}: no host copy for token {key}: its forward's saved tensors were freed "
                           "already (a second backward through a graph without retain_graph=True?)")
    return key, h


def _reload_start(token: torch.Tensor, size: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    key, h = _get(token, "reload_start")
    out = torch.empty_strided(tuple(size), tuple(stride), dtype=dtype, device=device)
    if out.device.type == "cuda":
        side = _side(out.device)
        with torch.cuda.stream(side):
            side.wait_event(h.copied)
            _bytes(out).copy_(h.host, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(side)
        out.record_stream(side)
        h.landed = landed
    else:
        _bytes(out).copy_(h.host)
    h.out = out
    return _token(key)          # the backward frees offload's token once read: this one keeps the copy


def _reload_wait(token: torch.Tensor) -> torch.Tensor:
    _, h = _get(token, "reload_wait")
    out, h.out = h.out, None
    if out is None:
        raise RuntimeError("hybridmem::reload_wait: its reload_start did not run")
    if h.landed is not None:
        torch.cuda.current_stream(out.device).wait_event(h.landed)   # on the device: the host goes on
    return out


def _token_fake(token: torch.Tensor, *_: Any) -> torch.Tensor:
    return token.new_empty((1,), dtype=torch.int64, device="cpu")


def _offload_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((1,), dtype=torch.int64, device="cpu")


def register() -> None:
    """Define ``hybridmem::offload``, ``hybridmem::reload_start`` and ``hybridmem::reload_wait`` (once per
    process). ``reload_wait``'s fake tensor comes from the size, strides, dtype and device ``reload_start``
    was given, which the graph rewrite (:func:`hybridmem.compile.offload.rewrite_partition`) puts in its
    node's value."""
    define_once("offload", _define)


def _define(lib: torch.library.Library) -> None:
    lib.define("offload(Tensor x) -> Tensor")
    lib.define("reload_start(Tensor token, SymInt[] size, SymInt[] stride, ScalarType dtype, Device device) "
               "-> Tensor")
    lib.define("reload_wait(Tensor token, SymInt[] size, SymInt[] stride, ScalarType dtype, Device device) "
               "-> Tensor")
    lib.impl("offload", _offload, "CompositeExplicitAutograd")
    lib.impl("reload_start", _reload_start, "CompositeExplicitAutograd")
    lib.impl("reload_wait", lambda token, size, stride, dtype, device: _reload_wait(token),
             "CompositeExplicitAutograd")
    torch.library.register_fake("hybridmem::offload", _offload_fake, lib=lib)
    torch.library.register_fake("hybridmem::reload_start", _token_fake, lib=lib)
    torch.library.register_fake("hybridmem::reload_wait", _wait_fake, lib=lib)


def _wait_fake(token: torch.Tensor, size: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    return token.new_empty_strided(tuple(size), tuple(stride), dtype=dtype, device=device)
