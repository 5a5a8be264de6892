"""Swap policy: bit-exact round trips, host checkpoints, released device bytes, stats, pool, and the
CUDA stream/event protocol (with a recording fake of torch.cuda here; for real where a GPU exists)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hybridmem.plugins.base import Policy
from hybridmem.runtime.entry import Entry
from hybridmem.plugins.swap import PinnedPool, SwapPolicy, _CudaTransport
from tests.helpers import bit_equal, entry_of
from tests.helpers.fakecuda import FakeCuda


def test_policy_protocol():
    p = SwapPolicy()
    assert isinstance(p, Policy) and p.name == "swap" and p.lossless


@pytest.mark.parametrize("make", [
    lambda: torch.randn(33, 17),
    lambda: torch.randn(40, 30).t()[2:, 5:25],                     # non-contiguous view with offset
    lambda: torch.rand(1001) < 0.5,
    lambda: torch.randn(64).half(),
    lambda: torch.arange(100, dtype=torch.int64),
    lambda: torch.tensor([-0.0, float("nan"), 1e-42, float("inf")]),
])
def test_round_trip_is_bit_exact(make):
    t = make()
    ref = t.clone()
    view_ref = (t.shape, t.stride(), t.storage_offset())
    p = SwapPolicy()
    e = entry_of(t)
    del t
    assert p.applicable(e) and p.savings(e) == e.nbytes
    p.evict(e)
    assert e.tensor is None and e.policy == "swap"
    out = p.regenerate(e)
    assert e.tensor is out and (out.shape, out.stride(), out.storage_offset()) == view_ref
    assert bit_equal(out, ref)


def test_evict_releases_the_device_bytes():
    t = torch.randn(1000)
    freed = []
    weakref.finalize(t.untyped_storage(), freed.append, True)   # fires when the storage is freed
    e = entry_of(t)
    del t
    SwapPolicy().evict(e)
    gc.collect()
    assert freed == [True]


def test_host_checkpoint_is_reused_on_second_eviction():
    p = SwapPolicy()
    x = torch.randn(256)
    e = entry_of(x.clone())
    p.evict(e)
    p.regenerate(e)
    assert p.has_checkpoint(e)
    p.evict(e)                                                   # no second D2H copy
    s = p.stats
    assert s["d2h_copies"] == 1 and s["d2h_reused"] == 1 and s["evictions"] == 2
    assert bit_equal(p.regenerate(e), x) and p.stats["h2d_copies"] == 2


def test_checkpoint_is_invalidated_by_an_in_place_write():
    p = SwapPolicy()
    e = entry_of(torch.zeros(16))
    p.evict(e)
    p.regenerate(e).add_(1.0)                                    # version bump: host copy is stale
    assert not p.has_checkpoint(e)
    p.evict(e)
    assert p.stats["d2h_copies"] == 2
    assert torch.equal(p.regenerate(e), torch.ones(16))


def test_prefetch_and_stats():
    p = SwapPolicy()
    x = torch.randn(1 << 16)
    e = entry_of(x.clone())
    p.evict(e)
    p.prefetch(e)
    p.prefetch(e)                                                # idempotent while in flight
    assert e.tensor is None
    assert bit_equal(p.regenerate(e), x)
    s = p.stats
    assert s["prefetched"] == 1 and s["h2d_copies"] == 1 and s["exposed_s"] == 0.0
    assert s["hidden_s"] == pytest.approx(s["h2d_s"]) and s["d2h_s"] > 0
    p.evict(e)
    p.regenerate(e)                                              # not prefetched: all of it exposed
    s = p.stats
    assert s["regenerations"] == 2 and s["prefetched"] == 1 and s["exposed_s"] > 0
    assert s["h2d_bytes"] == 2 * x.numel() * 4


def test_cost_counts_exposed_transfer_only():
    p = SwapPolicy()
    e = entry_of(torch.randn(1 << 20))
    full = p.cost(e)
    assert full == pytest.approx(p.copy_time(e.nbytes, "h2d", "cpu") + p.copy_time(e.nbytes, "d2h", "cpu"))
    assert p.cost(e, hidden_fraction=1.0) == pytest.approx(p.copy_time(e.nbytes, "d2h", "cpu"))
    p.evict(e)
    p.regenerate(e)
    assert p.cost(e) < full                                      # host checkpoint: swap-out is free

    class Model:
        def copy_time(self, nbytes, direction):
            return 1.0 if direction == "h2d" else 2.0

    assert SwapPolicy(cost_model=Model()).cost(entry_of(torch.ones(4)), hidden_fraction=0.25) == 0.75 + 2.0


def test_release_and_errors():
    p = SwapPolicy()
    e = entry_of(torch.ones(8))
    p.evict(e)
    p.release(e)
    assert e.policy is None and p.stats["host_checkpoints"] == 0
    with pytest.raises(KeyError):
        p.regenerate(e)
    with pytest.raises(ValueError):
        p.evict(entry_of(torch.empty(3, device="meta")))


def test_pool_buckets_and_reuse():
    assert [PinnedPool.bucket(n) for n in (1, 4096, 4097, 8193, 3 << 20)] == [4096, 4096, 5120, 10240, 3 << 20]
    for n in range(1, 100_000, 997):
        b = PinnedPool.bucket(n)
        assert n <= b <= max(4096, 1.25 * n)
    pool = PinnedPool(pin=False, max_cached_bytes=8192)
    a = pool.acquire(5000)
    pool.release(a)
    assert pool.acquire(4500) is a and pool.hits == 1 and pool.misses == 1
    b, c = pool.acquire(8000), pool.acquire(8000)
    pool.release(b)
    pool.release(c)                                              # over the cap: dropped
    assert pool.cached_bytes == 8192 and pool.total_bytes == 5120 + 8192
    pool.trim()
    assert pool.cached_bytes == 0


# ---- the CUDA protocol, against a recording fake of torch.cuda ---------------------------------------

def _fake_cuda_policy():
    fake = FakeCuda()
    p = SwapPolicy()
    pool = PinnedPool(pin=False)
    tr = _CudaTransport(torch.device("cpu"), p._c, pool, timing=True, cuda=fake)
    tr._record_stream = lambda t, s: fake.log.append(("record_stream", s.name, t.untyped_storage().data_ptr()))
    p._transports[torch.device("cpu")] = tr
    p.pool = pool
    return p, fake, tr


def _index(log, pred):
    return next(i for i, x in enumerate(log) if pred(x))


def test_cuda_protocol_orders_copies_with_events_not_host_syncs():
    p, fake, tr = _fake_cuda_policy()
    x = torch.randn(1000)
    t = x.clone()
    ptr = t.untyped_storage().data_ptr()
    e = entry_of(t)
    del t
    copy = p.evict(e)
    log = fake.log
    # D2H: waits for compute, copies on d2h; the source block is held (counted as allocated) until its copy
    # is done, not handed to the allocator early with record_stream
    assert log[0] == ("wait_stream", "d2h", "compute")
    i_enter = _index(log, lambda x: x == ("enter", "d2h"))
    assert _index(log, lambda x: x[0] == "record" and x[2] == id(copy.d2h_done)) > i_enter
    assert ("record_stream", "d2h", ptr) not in log and tr.outbound_bytes == 4000
    assert copy.lease.buf.last_use is copy.d2h_done

    fake.log.clear()
    p.prefetch(e)
    assert log[0] == ("wait_stream", "h2d", "compute")           # the new block was compute's
    assert log[1] == ("wait_event", "h2d", id(copy.d2h_done))     # host copy complete
    assert any(x[:2] == ("record_stream", "h2d") for x in log)
    h2d_done = copy.h2d_done

    fake.log.clear()
    out = p.regenerate(e)
    assert ("wait_event", "compute", id(h2d_done)) in log        # GPU-side wait, no host sync
    assert not any(x[0] == "event_sync" for x in log)
    assert bit_equal(out, x)
    s = p.stats
    assert s["exposed_s"] == pytest.approx(0.002) and s["h2d_s"] == pytest.approx(0.005)
    assert s["hidden_s"] == pytest.approx(0.003) and s["d2h_s"] == pytest.approx(0.005)
    assert p._hidden_fraction("cuda") == pytest.approx(0.6)

    # host checkpoint: no D2H traffic the second time
    fake.log.clear()
    p.evict(e)
    assert not any(x[:2] == ("wait_stream", "d2h") for x in log) and p.stats["d2h_reused"] == 1


def test_cuda_pool_buffer_reuse_waits_for_the_previous_copy():
    p, fake, tr = _fake_cuda_policy()
    e1 = entry_of(torch.randn(512))
    c1 = p.evict(e1)
    p.prefetch(e1)
    last = c1.h2d_done
    buf = c1.lease.buf
    p.release(e1)                                                # buffer back to the pool
    assert p.pool.cached_bytes == buf.tensor.numel()
    fake.log.clear()
    e2 = entry_of(torch.randn(500))
    c2 = p.evict(e2)
    assert c2.lease.buf is buf and p.pool.hits == 1
    assert ("wait_event", "d2h", id(last)) in fake.log           # ordered after the old H2D read


def test_cuda_buffer_returns_to_pool_when_the_entry_dies():
    p, fake, tr = _fake_cuda_policy()
    e = entry_of(torch.randn(300))
    p.evict(e)
    del e
    gc.collect()
    assert p.pool.cached_bytes == 4096


# ---- real CUDA ----------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_round_trip_overlap_and_memory():
    torch.cuda.synchronize()
    p = SwapPolicy()
    x = torch.randn(1 << 22, device="cuda")
    ref = x.clone()
    e = entry_of(x)
    del x
    before = torch.cuda.memory_allocated()
    p.evict(e)
    assert torch.cuda.memory_allocated() == before - e.nbytes   # released at once (record_stream)
    a = torch.randn(2048, 2048, device="cuda")
    p.prefetch(e)
    for _ in range(10):
        a = a @ a / 64                                           # compute the copy can hide behind
    out = p.regenerate(e)
    assert bit_equal(out, ref)
    p.evict(e)
    assert p.stats["d2h_reused"] == 1
    out = p.regenerate(e)                                        # not prefetched: exposed
    torch.cuda.synchronize()
    p.synchronize()
    s = p.stats
    assert bit_equal(out, ref) and s["h2d_copies"] == 2 and s["exposed_s"] > 0 and s["hidden_s"] > 0


def _adopt(e: Entry) -> torch.Tensor:
    """What the runtime's SavedStore.adopt does: its own flat tensor over the storage, vshift continued."""
    t = e.tensor
    base = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())
    e.tensor, e.vshift = base, e.version - base._version
    return base


def test_checkpoint_survives_the_runtimes_rewrapping():
    p = SwapPolicy()
    x = torch.randn(64)
    e = entry_of(x.clone())
    e.version = e.tensor._version + e.vshift        # SavedStore.before_evict
    p.evict(e)
    p.regenerate(e)
    base = _adopt(e)
    assert p.has_checkpoint(e) and p.cost(e) < p.cost(entry_of(x))
    base.mul_(2)                                    # written through the runtime's tensor: stale
    assert not p.has_checkpoint(e)


def test_swap_cost_from_the_shared_cost_model():
    from hybridmem.graph.costs import get_cost_model

    m = get_cost_model("h100")
    e = entry_of(torch.ones(1 << 10))
    p = SwapPolicy(cost_model="h100")
    assert p.cost(e) == pytest.approx(m.copy_time(e.nbytes, "h2d") + m.copy_time(e.nbytes, "d2h"))
