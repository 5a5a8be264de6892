"""Swap-outs in flight count as device bytes until their copy is done, and are bounded (CUDA review R3).

Against the recording stand-in for ``torch.cuda`` (tests/helpers/fakecuda.py) with events that finish when
the test says: a swap-out's source stays allocated until its D2H event reports done through ``query()``
(never a host wait), no ``record_stream`` hands the block to the allocator early, and past the in-flight
bound the compute stream waits on the device for the oldest copy. The free-memory callback's arithmetic
(reserved bytes plus an expandable segment's rounding against the budget less its headroom) is the native
library's own function, called on the CPU.
"""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from hybridmem.plugins.swap import INFLIGHT_MAX, INFLIGHT_MIN, SwapPolicy, _CudaTransport, inflight_bound
from hybridmem.native import cpumeter
from hybridmem.native.allocconf import EXPANDABLE_SLACK
from tests.helpers import bit_equal, entry_of
from tests.helpers.fakecuda import FakeCuda, FakeEvent, HostPool

MIB = 1 << 20


class LateEvent(FakeEvent):
    """An event whose work finishes only when the test says (``done``); counts its queries."""

    def __init__(self, log, enable_timing=False):
        super().__init__(log, enable_timing)
        self.done, self.queries = False, 0

    def query(self):
        self.queries += 1
        return self.done


class LateCuda(FakeCuda):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[LateEvent] = []

    def Event(self, enable_timing=False):
        ev = LateEvent(self.log, enable_timing)
        self.events.append(ev)
        return ev


def _policy(bound: int) -> tuple[SwapPolicy, LateCuda, _CudaTransport]:
    fake = LateCuda()
    p = SwapPolicy(timing=False, max_inflight_bytes=bound)
    pool = HostPool()
    tr = _CudaTransport(torch.device("cpu"), p._c, pool, timing=False, cuda=fake, max_inflight=bound)
    tr._record_stream = lambda t, s: fake.log.append(("record_stream", s.name, t.untyped_storage().data_ptr()))
    p._transports[torch.device("cpu")], p.pool = tr, pool
    return p, fake, tr


def _evicted(p: SwapPolicy, n: int) -> tuple[object, weakref.ref, torch.Tensor]:
    """An entry of ``n`` floats evicted by ``p``; a weak reference to its source storage; the original values."""
    t = torch.randn(n)
    ref_values = t.clone()
    storage = weakref.ref(t.untyped_storage())
    e = entry_of(t)
    del t
    p.evict(e)
    return e, storage, ref_values


def test_a_swap_out_holds_its_source_until_its_copy_is_done() -> None:
    p, fake, tr = _policy(64 * MIB)
    e1, src1, v1 = _evicted(p, 1000)
    gc.collect()
    assert src1() is not None                     # the copy may still read it: still allocated
    assert p.inflight_bytes == 4000 and tr.outbound_bytes == 4000
    assert not [x for x in fake.log if x[0] == "record_stream"]  # the allocator is not handed the block early
    d2h_done = e1.handle.d2h_done
    e2, src2, _ = _evicted(p, 500)                # a swap-out polls: the first copy is still running
    assert src1() is not None and p.inflight_bytes == 6000
    assert d2h_done.queries >= 1
    d2h_done.done = True
    p.retire()                                    # what the pack hook calls: one query, no wait
    gc.collect()
    assert src1() is None and src2() is not None and p.inflight_bytes == 2000
    assert not [x for x in fake.log if x[0] == "event_sync"]  # the host never waited
    for ev in fake.events:
        ev.done = True
    p.step_ended()                                # the step's end lets go of the rest
    gc.collect()
    assert src2() is None and p.inflight_bytes == 0
    assert bit_equal(p.regenerate(e1), v1)        # the host copy is what the source held
    assert p.stats["inflight_peak"] == 6000


def test_past_the_bound_compute_waits_on_the_device_for_the_oldest_copy() -> None:
    p, fake, tr = _policy(5000)
    e1, src1, _ = _evicted(p, 1000)               # 4000 bytes: within the bound
    first = e1.handle.d2h_done
    assert p.stats["throttled"] == 0
    fake.log.clear()
    e2, src2, _ = _evicted(p, 1000)               # 8000 in flight: the oldest is waited for, on the device
    assert ("wait_event", "compute", id(first)) in fake.log
    assert not [x for x in fake.log if x[0] == "event_sync"]
    gc.collect()
    assert src1() is None                         # reusable on compute, after the wait: given back
    assert src2() is not None and p.inflight_bytes == 4000 and p.stats["throttled"] == 1
    e3, _, _ = _evicted(p, 2000)                  # one copy larger than the bound alone is not waited for
    assert p.inflight_bytes == 8000 and p.stats["throttled"] == 2


def test_the_bound_follows_the_budget_unless_given() -> None:
    assert inflight_bound(1 << 30) == INFLIGHT_MIN
    assert inflight_bound(8 << 30) == 512 * MIB
    assert inflight_bound(1 << 40) == INFLIGHT_MAX
    p = SwapPolicy()
    p.bind(SimpleNamespace(budget=8 << 30))
    assert p.max_inflight_bytes == 512 * MIB
    q = SwapPolicy(max_inflight_bytes="96MiB")
    q.bind(SimpleNamespace(budget=8 << 30))
    assert q.max_inflight_bytes == 96 * MIB
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        SwapPolicy(max_inflight_bytes="lots")


native = cpumeter.load()
needs_native = pytest.mark.skipif(native is None, reason=f"native library unavailable: {cpumeter.unavailable_reason()}")


@needs_native
def test_the_callback_counts_reserved_bytes_and_a_segments_rounding() -> None:
    """The callback's arithmetic (hm_cuda_need): free what takes reserved bytes + one expandable segment's
    page rounding to the budget less the headroom; nothing while a new segment still fits."""
    b, room = 1000 * MIB, 60 * MIB
    assert native.cuda_need(b - room - EXPANDABLE_SLACK, b, room) == 0        # a new segment fits
    assert native.cuda_need(b - room - EXPANDABLE_SLACK + 1, b, room) == 1
    # at the cap with little allocated (cached blocks too small for the request): reserved decides
    assert native.cuda_need(b, b, room) == room + EXPANDABLE_SLACK
    assert native.cuda_need(b, None, room) == 0                                # no budget: never
    assert native.cuda_need(0, b, 0, slack=0) == 0
