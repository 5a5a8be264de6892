"""The custom ops that hold a compiled graph's saved tensor on the host from the forward to the backward,
copied beside the compute stream.

    token = torch.ops.hybridmem.offload(x)                                   # forward, after x's last read
    token = torch.ops.hybridmem.offload_wait(token, x, after)                # forward, once the copy is likely done
    ready = torch.ops.hybridmem.reload_start(token, size, stride, dtype, device)  # backward, a kernel early
    x = torch.ops.hybridmem.reload_wait(ready, size, stride, dtype, device)       # backward, before its first read

On CUDA ``offload`` queues, on a copy-out stream that waits for the compute stream, a copy of ``x`` into a
pinned host buffer (:class:`hybridmem.plugins.swap.PinnedPool`), and ``x``'s memory is kept from the
allocator's reuse until that copy has read it (``record_stream``). ``offload_wait`` makes the compute stream
wait for the copy (on the device: the host goes on); it reads ``x``, so Inductor keeps ``x``'s buffer from
its own reuse (``buf2 = buf0  # reuse``) until then, where ``record_stream`` cannot reach, and the values
``after`` (the kernels the copy runs beside), so Inductor's scheduler does not move it before them. ``reload_start``
allocates ``x``'s device tensor and, on a copy-in stream of its own (a reload does not queue behind the
offloads), waits for the compute stream (the block may be one that queued kernels still read or write)
and for the offload's copy, and copies back; ``reload_wait`` makes the compute stream wait for that copy and
hands the tensor out. Between the two the compute stream runs the kernels before the first read. On the
CPU each op copies at once: the same graph, the same bits. Inductor sees the ops as opaque calls, as it
sees the codec ops (:mod:`hybridmem.compile.codec_ops`); the host copy lives as long as a token names it
(:class:`~hybridmem.compile.oplib.TokenTable`: autograd frees the forward's token with the backward's other
saved tensors; a backward run twice reloads twice). The tokens are host tensors: CUDA graphs
(cudagraph trees) skip a graph that holds them. PyTorch's own offloading pass does this where its stream
ops trace (torch 2.11's do not); these ops do it on every torch the backend supports.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..plugins.swap import PinnedPool, _Lease, host_empty_like
from .codec_ops import dense
from .oplib import TokenTable, define_once, tensor_fake, token_fake

__all__ = ["held", "register"]

# what queues the copies and events: torch.cuda, or a recording stand-in (tests)
_cuda: Any = torch.cuda


@dataclass(eq=False)
class _Held:
    host: torch.Tensor                  # uint8, the saved tensor's bytes
    lease: Any = None                   # the pinned pool's buffer behind ``host`` (CUDA)
    copied: Any = None                  # event: the host copy is complete (CUDA)
    out: torch.Tensor | None = None     # the device tensor reload_start fills
    landed: Any = None                  # event: ``out`` is complete (CUDA)


def _release(h: _Held) -> None:
    if h.lease is not None:
        # the pool orders the buffer's next copy after this one's last
        h.lease.buf.last_use = h.landed if h.landed is not None else h.copied
        h.lease.give_back()


_TABLE: TokenTable[_Held] = TokenTable("host copy", _release)
_LOCK = threading.Lock()
_POOL: PinnedPool | None = None
_STREAMS: dict[int, tuple[Any, Any]] = {}   # CUDA device index -> its (copy-out, copy-in) streams


def held() -> int:
    """Host copies held now (tokens alive): 0 once every step's backward has freed its saved tensors."""
    return len(_TABLE)


def _on_cuda(t: torch.Tensor) -> bool:
    """Whether ``t``'s copies are queued on streams (else they run at once)."""
    return t.device.type == "cuda"


def _record_stream(t: torch.Tensor, stream: Any) -> None:
    t.record_stream(stream)


def _streams(device: torch.device) -> tuple[Any, Any]:
    """The device's copy-out and copy-in streams: two, so that a reload runs beside the offloads queued
    before it rather than behind them."""
    with _LOCK:
        s = _STREAMS.get(device.index or 0)
        if s is None:
            s = _STREAMS[device.index or 0] = (_cuda.Stream(device), _cuda.Stream(device))
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


def _offload(x: torch.Tensor) -> torch.Tensor:
    if not dense(x):        # the graph rewrite offloads dense tensors only
        raise RuntimeError(f"hybridmem::offload: a tensor of size {tuple(x.shape)} and strides {x.stride()} is not dense")
    src = _bytes(x)
    if not _on_cuda(x):
        host = host_empty_like(src)                     # host memory that is not the budgeted allocator's
        host.copy_(src)
        return _TABLE.put(_Held(host))
    pool = _pool()
    lease = _Lease(pool, pool.acquire(src.numel()))
    host = lease.buf.tensor[:src.numel()]
    d2h, _ = _streams(x.device)
    d2h.wait_stream(_cuda.current_stream(x.device))     # x's producer is queued on the compute stream
    if lease.buf.last_use is not None:
        d2h.wait_event(lease.buf.last_use)              # the buffer's last copy is done with it
    with _cuda.stream(d2h):
        host.copy_(src, non_blocking=True)
        copied = _cuda.Event()
        copied.record(d2h)
    _record_stream(x, d2h)                              # its memory is not reused before the copy read it
    return _TABLE.put(_Held(host, lease, copied))


def _offload_wait(token: torch.Tensor, x: torch.Tensor, after: Sequence[torch.Tensor]) -> torch.Tensor:
    key, h = _TABLE.get(token, "offload_wait")
    if h.copied is not None:
        # from here the compute stream may write x's memory (Inductor reuses its buffer after its last read)
        _cuda.current_stream(x.device).wait_event(h.copied)
    return _TABLE.token(key)    # the forward frees offload's token: this one, saved, keeps the copy


def _reload_start(token: torch.Tensor, size: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    key, h = _TABLE.get(token, "reload_start")
    out = torch.empty_strided(tuple(size), tuple(stride), dtype=dtype, device=device)
    if _on_cuda(out):
        _, h2d = _streams(out.device)
        # out's block comes from the compute stream, whose queued kernels may still read or write it (under
        # deterministic algorithms, empty_strided's own NaN fill): the copy lands after them
        h2d.wait_stream(_cuda.current_stream(out.device))
        h2d.wait_event(h.copied)
        with _cuda.stream(h2d):
            _bytes(out).copy_(h.host, non_blocking=True)
            landed = _cuda.Event()
            landed.record(h2d)
        _record_stream(out, h2d)
        h.landed = landed
    else:
        _bytes(out).copy_(h.host)
    h.out = out
    return _TABLE.token(key)    # the backward frees the forward's token once read: this one keeps the copy


def _reload_wait(token: torch.Tensor) -> torch.Tensor:
    _, h = _TABLE.get(token, "reload_wait")
    out, h.out = h.out, None
    if out is None:
        raise RuntimeError("hybridmem::reload_wait: its reload_start did not run")
    if h.landed is not None:
        _cuda.current_stream(out.device).wait_event(h.landed)   # on the device: the host goes on
    return out


def register() -> None:
    """Define ``hybridmem::offload``, ``hybridmem::offload_wait``, ``hybridmem::reload_start`` and
    ``hybridmem::reload_wait`` (once per process). ``reload_wait``'s fake tensor comes from the size,
    strides, dtype and device ``reload_start`` was given, which the graph rewrite
    (:func:`hybridmem.compile.offload.rewrite_partition`) puts in its node's value."""
    define_once("offload", _define)


def _define(lib: torch.library.Library) -> None:
    lib.define("offload(Tensor x) -> Tensor")
    lib.define("offload_wait(Tensor token, Tensor x, Tensor[] after) -> Tensor")
    lib.define("reload_start(Tensor token, SymInt[] size, SymInt[] stride, ScalarType dtype, Device device) "
               "-> Tensor")
    lib.define("reload_wait(Tensor token, SymInt[] size, SymInt[] stride, ScalarType dtype, Device device) "
               "-> Tensor")
    lib.impl("offload", _offload, "CompositeExplicitAutograd")
    lib.impl("offload_wait", _offload_wait, "CompositeExplicitAutograd")
    lib.impl("reload_start", _reload_start, "CompositeExplicitAutograd")
    lib.impl("reload_wait", lambda token, size, stride, dtype, device: _reload_wait(token),
             "CompositeExplicitAutograd")
    torch.library.register_fake("hybridmem::offload", token_fake, lib=lib)
    torch.library.register_fake("hybridmem::offload_wait", token_fake, lib=lib)
    torch.library.register_fake("hybridmem::reload_start", token_fake, lib=lib)
    torch.library.register_fake("hybridmem::reload_wait", tensor_fake, lib=lib)
