"""Swap policy: copy a saved storage to host memory, release the device bytes, copy it back on demand.

On CUDA the copies run on two side streams (device-to-host and host-to-device) into pinned host buffers
from a size-bucketed pool, ordered by events, never by host synchronization:

- evict: the D2H stream waits for the compute stream (the producer's kernels are queued there), copies
  ``non_blocking``, records an event. The source stays referenced (*outbound*) until its copy is done: its
  bytes count as allocated, as they are (the budget and the allocator's callback see them), and the block
  goes back to the allocator only when it is reusable at once. Finished copies are found by ``query()``
  at each swap-out and swap-in and at the step's end (no host wait). Bytes outbound are bounded
  (``max_inflight_bytes``): past the bound, the compute stream waits on the device for the oldest copy,
  after which its block is safe to reuse on the compute stream (the stream it was produced on). No
  ``record_stream`` on the source: the allocator would hold the block until every copy queued on the D2H
  stream before its free had run, and a cache miss meanwhile makes it synchronise on those events.
- prefetch: allocates the device buffer on the compute stream, makes the H2D stream wait for the compute
  stream (the block may have just been freed there) and for the D2H event, and copies. Called a few
  stages before the backward op that needs the tensor, the copy hides behind compute.
- regenerate: the compute stream waits for the H2D event (a GPU-side wait) and the tensor is returned.
  Timing events measure the time the compute stream really stalled (``exposed_s``) against the copy
  time (``h2d_s``); ``hidden_s`` is the difference.

The host copy is kept after a swap-in (*host checkpoint*): evicting the same bytes again releases the
device copy without a second D2H copy. On the CPU (the simulated device) the same steps run
synchronously: the host copy is a separate CPU tensor and dropping the "device" tensor frees its bytes.

While the current CUDA stream captures a graph nothing is swapped (``applicable`` is False: pinned
allocation and event queries are illegal there) and no event is queried (:mod:`hybridmem.native.capture`).
"""
from __future__ import annotations

import collections
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from hybridmem.graph.costs import get_cost_model
from hybridmem.graph.units import parse_bytes
from hybridmem.native.capture import capturing

from .base import EntryView as Entry, PolicyHints  # Entry: the policy's view of the runtime's record
from .codecs import Geometry, Stamp, entry_version, flat_view, supported

# Copy-time estimates when no cost model is given: (bytes/s, latency s). CPU: allocate + copy on the
# development machine (16 MiB: 1.6 GB/s median, 6.8 best; fresh pages fault in); CUDA: pinned PCIe.
_LINK = {"cpu": (2e9, 20e-6), "cuda": (20e9, 10e-6)}
# Bytes of swap-outs in flight by default: a share of the budget, within bounds (without a budget: the
# upper bound). More lets compute run further ahead of the copies; all of it is held as allocated meanwhile.
INFLIGHT_SHARE, INFLIGHT_MIN, INFLIGHT_MAX = 1 / 16, 64 << 20, 1 << 30


# --------------------------------------------------------------------------------------------------
# Pinned host buffer pool
# --------------------------------------------------------------------------------------------------

@dataclass(eq=False)
class HostBuffer:
    """A pooled host buffer; ``last_use`` is the event of the last copy that touched it (CUDA)."""

    tensor: torch.Tensor              # uint8, bucket size
    last_use: Any = None


class PinnedPool:
    """Host buffers bucketed by size and reused across steps (pinned allocation is slow: ~ms per MB).

    Buckets: 4 KiB minimum, then 4 sizes per power of two (at most 25 % slack). A released buffer
    keeps its ``last_use`` event: whoever gets it next orders its copy after that event on the GPU.
    ``max_cached_bytes`` caps what idle buffers may hold (None: no cap); ``trim()`` frees them all.
    """

    def __init__(self, pin: bool = True, max_cached_bytes: int | None = None):
        self.pin, self.max_cached_bytes = pin, max_cached_bytes
        self._free: dict[int, list[HostBuffer]] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.cached_bytes = 0        # idle, in the pool
        self.total_bytes = 0         # idle + handed out

    @staticmethod
    def bucket(nbytes: int) -> int:
        if nbytes <= 4096:
            return 4096
        step = 1 << max(0, nbytes.bit_length() - 3)      # quarter of the power of two below
        return -(-nbytes // step) * step

    def acquire(self, nbytes: int) -> HostBuffer:
        size = self.bucket(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                self.hits += 1
                self.cached_bytes -= size
                return free.pop()
            self.misses += 1
            self.total_bytes += size
        return HostBuffer(self._new(size))

    def _new(self, size: int) -> torch.Tensor:
        if self.pin and capturing():
            raise RuntimeError("hybridmem swap: no pinned host buffer can be allocated while a CUDA graph is "
                               "captured (cudaHostAlloc is not capturable); nothing is swapped during capture")
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def release(self, buf: HostBuffer) -> None:
        size = buf.tensor.numel()
        with self._lock:
            if self.max_cached_bytes is not None and self.cached_bytes + size > self.max_cached_bytes:
                self.total_bytes -= size        # dropped: torch's host allocator still orders reuse
                return
            self._free.setdefault(size, []).append(buf)
            self.cached_bytes += size

    def trim(self) -> None:
        with self._lock:
            self._free.clear()
            self.total_bytes -= self.cached_bytes
            self.cached_bytes = 0


@dataclass(eq=False)
class _Lease:
    """One hand-out of a pool buffer; gives it back exactly once (explicit release or finalizer)."""

    pool: PinnedPool
    buf: HostBuffer | None

    def give_back(self) -> None:
        buf, self.buf = self.buf, None
        if buf is not None:
            self.pool.release(buf)


# --------------------------------------------------------------------------------------------------
# Per-entry state
# --------------------------------------------------------------------------------------------------

@dataclass(eq=False)
class HostCopy:
    """The host checkpoint of one storage, and the state of its copies."""

    geom: Geometry
    host: torch.Tensor                    # uint8 view, geom.nbytes long
    lease: _Lease | None = None           # pooled buffer behind ``host`` (CUDA)
    d2h_done: Any = None                  # event: host copy complete
    inflight: torch.Tensor | None = None  # device uint8 buffer being (or already) swapped in
    h2d_done: Any = None                  # event: ``inflight`` complete
    prefetched: bool = False              # the in-flight copy was issued by prefetch()
    version: int = 0                      # entry_version() when the host copy was taken
    resident: Stamp | None = None         # the swapped-in bytes, while they match the host copy


@dataclass
class _Counters:
    evictions: int = 0
    d2h_copies: int = 0
    d2h_bytes: int = 0
    d2h_reused: int = 0                   # evictions served by a host checkpoint: no copy
    h2d_copies: int = 0
    h2d_bytes: int = 0
    prefetched: int = 0                   # regenerations whose copy prefetch() had issued
    regenerations: int = 0
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    exposed_s: float = 0.0                # time the compute stream waited for swap-ins
    throttled: int = 0                    # swap-outs past max_inflight_bytes: compute waited for an older one
    inflight_peak: int = 0                # largest bytes of swap-outs in flight at once


# --------------------------------------------------------------------------------------------------
# Transports: how bytes move for one device kind
# --------------------------------------------------------------------------------------------------

def host_empty_like(src: torch.Tensor) -> torch.Tensor:
    """An uninitialised CPU tensor shaped like ``src`` in host memory that is not the device's: on the CPU
    the device is PyTorch's CPU allocator (what a budget caps), so the host copy comes from numpy's
    allocator instead, the way pinned host memory is a separate pool beside a GPU."""
    if not src.is_contiguous():
        return torch.empty_like(src, pin_memory=False)
    nbytes = src.numel() * src.element_size()
    flat = torch.from_numpy(np.empty(max(nbytes, 1), dtype=np.uint8))[:nbytes]
    return flat.view(src.dtype).view(src.shape) if nbytes else torch.empty_like(src)


class _SyncTransport:
    """CPU as the simulated device: copies are plain synchronous clones, timed on the host clock."""

    def __init__(self, counters: _Counters):
        self.c = counters

    def store(self, src: torch.Tensor, geom: Geometry) -> HostCopy:
        t0 = time.perf_counter()
        host = host_empty_like(src)
        host.copy_(src)
        self.c.d2h_s += time.perf_counter() - t0
        return HostCopy(geom, host)

    def load(self, copy: HostCopy) -> None:
        t0 = time.perf_counter()
        dev = torch.empty_like(copy.host)
        dev.copy_(copy.host)
        dt = time.perf_counter() - t0
        self.c.h2d_s += dt
        if not copy.prefetched:
            self.c.exposed_s += dt            # issued by regenerate(): the caller waited for all of it
        copy.inflight = dev

    def wait(self, copy: HostCopy) -> None:
        pass

    def free(self, copy: HostCopy) -> None:
        pass

    def poll(self, block: bool = False) -> None:
        pass

    def retire(self) -> None:
        pass

    outbound_bytes = 0


class _CudaTransport:
    """Side streams, events and pinned buffers for one CUDA device. ``cuda`` is injectable (tests).
    ``max_inflight``: bytes of swap-outs in flight past which the compute stream waits for the oldest."""

    def __init__(self, device: torch.device, counters: _Counters, pool: PinnedPool, timing: bool,
                 cuda: Any = None, max_inflight: int = INFLIGHT_MAX):
        self.cuda = cuda if cuda is not None else torch.cuda
        self.device, self.c, self.pool, self.timing = device, counters, pool, timing
        self.max_inflight = max_inflight
        self.d2h = self.cuda.Stream(device)
        self.h2d = self.cuda.Stream(device)
        self._timers: list[tuple[str, Any, Any]] = []   # (counter, start event, end event)
        # swap-outs in flight, oldest first: (copy done, the source it reads, its bytes, the compute stream)
        self._outbound: collections.deque[tuple[Any, torch.Tensor, int, Any]] = collections.deque()
        self.outbound_bytes = 0
        self._lock = threading.Lock()

    def _event(self, timing: bool = False) -> Any:
        return self.cuda.Event(enable_timing=timing)

    def _timed(self, counter: str, stream: Any, fn) -> Any:
        """Run ``fn`` with ``stream`` current; record its end event (and start, when timing)."""
        timing = self.timing and not capturing()  # a timed event cannot be queried in a captured graph
        start = self._event(True) if timing else None
        end = self._event(timing)
        with self.cuda.stream(stream):
            if start is not None:
                start.record(stream)
            fn()
            end.record(stream)
        if start is not None:
            with self._lock:
                self._timers.append((counter, start, end))
            if len(self._timers) > 512:
                self.poll()                        # fold finished timings in: keep the list short
        return end

    def store(self, src: torch.Tensor, geom: Geometry) -> HostCopy:
        self.retire()                              # sources of finished copies: their blocks free again
        buf = self.pool.acquire(geom.nbytes)
        host = buf.tensor[: geom.nbytes]
        compute = self.cuda.current_stream(self.device)
        self.d2h.wait_stream(compute)              # the producer's kernels are queued on compute
        if buf.last_use is not None:
            self.d2h.wait_event(buf.last_use)      # a previous owner's copy may still read the buffer
        done = self._timed("d2h_s", self.d2h, lambda: host.copy_(src, non_blocking=True))
        # the source stays allocated until its copy is done (see module doc): no record_stream
        self._outbound.append((done, src, geom.nbytes, compute))
        self.outbound_bytes += geom.nbytes
        self.c.inflight_peak = max(self.c.inflight_peak, self.outbound_bytes)
        self._throttle()
        buf.last_use = done
        copy = HostCopy(geom, host, _Lease(self.pool, buf), d2h_done=done)
        weakref.finalize(copy, copy.lease.give_back)   # dropped without release(): recycle the buffer
        return copy

    def retire(self) -> None:
        """Let go of the sources whose copies are done (``query()``, oldest first: one D2H stream runs them
        in order). No host wait."""
        q = self._outbound
        if not q or capturing():                   # no event may be queried during capture
            return
        while q and q[0][0].query():
            self.outbound_bytes -= q.popleft()[2]

    def _throttle(self) -> None:
        """Past ``max_inflight`` bytes outbound (the newest copy aside), the compute stream waits on the device
        for the oldest copy; its source is then free to reuse on that stream, which produced it."""
        q = self._outbound
        while self.outbound_bytes > self.max_inflight and len(q) > 1:
            done, _, nbytes, compute = q.popleft()
            compute.wait_event(done)
            self.outbound_bytes -= nbytes
            self.c.throttled += 1

    def load(self, copy: HostCopy) -> None:
        self.retire()
        compute = self.cuda.current_stream(self.device)
        dev = torch.empty(copy.geom.nbytes, dtype=torch.uint8, device=self.device)  # compute-stream block
        self.h2d.wait_stream(compute)              # the block may have been freed by queued compute work
        self.h2d.wait_event(copy.d2h_done)
        done = self._timed("h2d_s", self.h2d, lambda: dev.copy_(copy.host, non_blocking=True))
        self._record_stream(dev, self.h2d)         # if dropped before use, not reused under the copy
        if copy.lease is not None and copy.lease.buf is not None:
            copy.lease.buf.last_use = done
        copy.inflight, copy.h2d_done = dev, done

    @staticmethod
    def _record_stream(t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def wait(self, copy: HostCopy) -> None:
        """Make the compute stream wait for the swap-in (no host sync); time the stall."""
        compute = self.cuda.current_stream(self.device)
        timing = self.timing and not capturing()
        if timing:
            before = self._event(True)
            before.record(compute)
        compute.wait_event(copy.h2d_done)
        if timing:
            after = self._event(True)
            after.record(compute)
            with self._lock:
                self._timers.append(("exposed_s", before, after))

    def free(self, copy: HostCopy) -> None:
        if copy.lease is not None:
            copy.lease.give_back()                 # keeps last_use: the next owner waits on it

    def poll(self, block: bool = False) -> None:
        """Add finished timings to the counters (all of them when ``block``: synchronizes); let go of the
        sources of finished swap-outs. Nothing during graph capture (no event may be queried there)."""
        if capturing():
            return
        if block:
            for done, *_ in self._outbound:
                done.synchronize()
        self.retire()
        with self._lock:
            timers, self._timers = self._timers, []
        keep = []
        for counter, start, end in timers:
            if block:
                end.synchronize()
            if end.query():
                setattr(self.c, counter, getattr(self.c, counter) + start.elapsed_time(end) / 1e3)
            else:
                keep.append((counter, start, end))
        with self._lock:
            self._timers[:0] = keep


# --------------------------------------------------------------------------------------------------
# Policy
# --------------------------------------------------------------------------------------------------

class SwapPolicy:
    """Evict to host memory; regenerate by copying back (prefetched ahead of use where possible).

    ``hidden_fraction``: share of a swap-in expected to hide behind compute, for :meth:`cost`
    (default: measured so far on CUDA, 0 on the CPU where copies are synchronous); the runtime may
    pass its own per call. ``cost_model``: a :mod:`hybridmem.graph.costs` model (``copy_time(nbytes,
    direction)``) or its name; default: the local estimates above. ``timing``: CUDA
    timing events for hidden/exposed statistics. ``pool``: a shared :class:`PinnedPool`.
    """

    name = "swap"
    lossless = True
    hints = PolicyHints(moves_to_host=True)  # the runtime's meter: a host copy is not device memory

    def __init__(self, hidden_fraction: float | None = None, cost_model: Any = None, timing: bool = True,
                 pool: PinnedPool | None = None, max_cached_bytes: int | None = None,
                 max_inflight_bytes: int | str | None = None):
        self.hidden_fraction = hidden_fraction
        self.cost_model = _resolve_cost_model(cost_model)
        self.timing = timing
        self.pool = pool
        self._max_cached = max_cached_bytes
        # bytes of swap-outs in flight before compute waits for the oldest (CUDA); None: from the budget (bind)
        self.max_inflight_bytes = (None if max_inflight_bytes is None
                                   else parse_bytes(max_inflight_bytes, what="swap: max_inflight_bytes"))
        self._c = _Counters()
        self._copies: weakref.WeakKeyDictionary[Entry, HostCopy] = weakref.WeakKeyDictionary()
        self._transports: dict[torch.device, Any] = {}
        self._lock = threading.Lock()

    def bind(self, runtime: Any) -> None:
        """The runtime using this policy: the in-flight bound follows its budget unless one was given."""
        if self.max_inflight_bytes is None and getattr(runtime, "budget", None):
            self.max_inflight_bytes = inflight_bound(runtime.budget)

    # ---- Policy protocol -------------------------------------------------------------------------
    def applicable(self, entry: Entry) -> bool:
        if capturing():
            return False                          # no pinned allocation nor event during graph capture
        return supported(entry.tensor) and entry.tensor.untyped_storage().nbytes() > 0

    def savings(self, entry: Entry) -> int:
        return entry.nbytes

    def cost(self, entry: Entry, hidden_fraction: float | None = None) -> float:
        """Seconds the compute stream is expected to lose: the exposed part of the swap-in, plus the
        swap-out where it is synchronous (CPU) and no host checkpoint makes it free."""
        kind = entry.device.type
        hf = hidden_fraction if hidden_fraction is not None else self._hidden_fraction(kind)
        cost = (1.0 - min(max(hf, 0.0), 1.0)) * self.copy_time(entry.nbytes, "h2d", kind)
        if kind != "cuda" and not self.has_checkpoint(entry):
            cost += self.copy_time(entry.nbytes, "d2h", kind)
        return cost

    def evict(self, entry: Entry) -> HostCopy:
        t = entry.tensor
        if not supported(t):
            raise ValueError(f"swap: entry {entry.uid} is not a resident dense tensor")
        copy = self._copies.get(entry)
        if copy is not None and copy.resident is not None and copy.resident.matches(entry):
            self._c.d2h_reused += 1               # host checkpoint still matches the bytes: no copy
        else:
            if copy is not None:
                self._transport(copy.geom.device).free(copy)
            geom = Geometry.of(t)
            src = flat_view(t.untyped_storage(), torch.uint8, t.device)
            copy = self._transport(t.device).store(src, geom)
            copy.version = entry_version(entry)
            self._copies[entry] = copy
            self._c.d2h_copies += 1
            self._c.d2h_bytes += geom.nbytes
            del src
        copy.inflight, copy.h2d_done, copy.prefetched, copy.resident = None, None, False, None
        del t
        entry.tensor, entry.handle, entry.policy = None, copy, self.name
        self._c.evictions += 1
        return copy

    def prefetch(self, entry: Entry) -> None:
        """Issue the swap-in now (asynchronous on CUDA, synchronous on the CPU)."""
        copy = self._copies.get(entry)
        if entry.tensor is not None or copy is None or copy.inflight is not None:
            return
        copy.prefetched = True
        self._load(copy)

    def regenerate(self, entry: Entry) -> torch.Tensor:
        if entry.tensor is not None:
            return entry.tensor
        copy = self._copies.get(entry)
        if copy is None:
            raise KeyError(f"swap: entry {entry.uid} was not evicted by this policy")
        if copy.inflight is None:
            copy.prefetched = False
            self._load(copy)
        transport = self._transport(copy.geom.device)
        transport.wait(copy)
        t = copy.geom.rebuild(copy.inflight.untyped_storage())
        self._c.regenerations += 1
        self._c.prefetched += int(copy.prefetched)
        copy.inflight, copy.h2d_done, copy.prefetched = None, None, False
        _hand_over(entry, t, copy.version)
        copy.resident = Stamp.of(entry)            # lets the next eviction skip the D2H copy
        return t

    # ---- extras for the runtime --------------------------------------------------------------------
    def in_flight(self, entry: Entry) -> bool:
        """True when ``entry``'s swap-in was issued already (prefetched): its device buffer is allocated."""
        copy = self._copies.get(entry)
        return copy is not None and copy.inflight is not None

    def has_checkpoint(self, entry: Entry) -> bool:
        """True when evicting ``entry`` now needs no device-to-host copy."""
        copy = self._copies.get(entry)
        return copy is not None and copy.resident is not None and copy.resident.matches(entry)

    def release(self, entry: Entry) -> None:
        """Drop ``entry``'s host copy (its pinned buffer returns to the pool)."""
        copy = self._copies.pop(entry, None)
        if copy is not None:
            tr = self._transport(copy.geom.device)
            tr.free(copy)
            tr.retire()                            # entries die as backward ends: sources done by then go too
        if entry.policy == self.name:
            entry.handle, entry.policy = None, None

    def copy_time(self, nbytes: int, direction: str, device_type: str = "cuda") -> float:
        if self.cost_model is not None:
            return float(self.cost_model.copy_time(nbytes, direction))
        bw, lat = _LINK.get(device_type, _LINK["cuda"])
        return lat + nbytes / bw

    def step_ended(self) -> None:
        """The runtime's step ended: fold the copies' finished timings in (event queries, no wait), so that the
        next step's costs use the share of swap-in time the last ones hid (``_hidden_fraction``), and let go
        of the sources of finished swap-outs."""
        for tr in list(self._transports.values()):
            tr.poll()

    def retire(self) -> None:
        """Let go of the sources of finished swap-outs (one event query each, no wait): call it at each pack."""
        for tr in self._transports.values():
            tr.retire()

    @property
    def inflight_bytes(self) -> int:
        """Bytes of swap-outs whose copy may still run: allocated on the device until it is done."""
        return sum(tr.outbound_bytes for tr in self._transports.values())

    def synchronize(self) -> None:
        """Wait for every copy in flight and fold their timings into ``stats`` (tests, step end)."""
        for tr in list(self._transports.values()):
            tr.poll(block=True)

    @property
    def stats(self) -> dict[str, float]:
        """Counts, bytes and seconds so far; hidden_s = h2d_s - exposed_s (finished copies only)."""
        for tr in list(self._transports.values()):
            tr.poll()
        out: dict[str, float] = asdict(self._c)
        out["hidden_s"] = max(0.0, self._c.h2d_s - self._c.exposed_s)
        out["host_checkpoints"] = len(self._copies)
        if self.pool is not None:
            out.update(pool_hits=self.pool.hits, pool_misses=self.pool.misses,
                       pool_bytes=self.pool.total_bytes, pool_cached_bytes=self.pool.cached_bytes)
        return out

    # ---- helpers ---------------------------------------------------------------------------------
    def _load(self, copy: HostCopy) -> None:
        self._transport(copy.geom.device).load(copy)
        self._c.h2d_copies += 1
        self._c.h2d_bytes += copy.geom.nbytes

    def _transport(self, device: torch.device) -> Any:
        tr = self._transports.get(device)
        if tr is None:
            with self._lock:
                tr = self._transports.get(device)
                if tr is None:
                    tr = self._make_transport(device)
                    self._transports[device] = tr
        return tr

    def _make_transport(self, device: torch.device) -> Any:
        if device.type == "cuda":
            if self.pool is None:
                self.pool = PinnedPool(pin=True, max_cached_bytes=self._max_cached)
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            bound = INFLIGHT_MAX if self.max_inflight_bytes is None else self.max_inflight_bytes
            return _CudaTransport(device, self._c, self.pool, self.timing, max_inflight=bound)
        return _SyncTransport(self._c)

    def _hidden_fraction(self, kind: str) -> float:
        if self.hidden_fraction is not None:
            return self.hidden_fraction
        if kind != "cuda":
            return 0.0                          # CPU: copies run on the caller's thread
        c = self._c
        return 0.5 if c.h2d_s <= 0 else max(0.0, 1.0 - c.exposed_s / c.h2d_s)


def inflight_bound(budget: int) -> int:
    """The default bound on swap-out bytes in flight under ``budget``."""
    return int(min(INFLIGHT_MAX, max(INFLIGHT_MIN, budget * INFLIGHT_SHARE)))


def _hand_over(entry: Entry, t: torch.Tensor, version: int) -> None:
    """Make ``t`` the entry's tensor, keeping ``tensor._version + vshift`` equal to the version the
    packs saw (what the runtime's ``SavedStore.adopt`` does too, and then redoes on its own tensor)."""
    entry.tensor, entry.handle, entry.policy = t, None, None
    if hasattr(entry, "vshift"):
        entry.vshift = version - t._version


def _resolve_cost_model(spec: Any) -> Any:
    if spec is None or not isinstance(spec, str):
        return spec
    return get_cost_model(spec)
