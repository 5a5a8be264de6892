"""During CUDA graph capture nothing is swapped, no event is queried, no pinned buffer is allocated and no
CUDA generator state is read (CUDA review R8), with the capture state stood in for on the CPU."""
from __future__ import annotations

import timeit

import pytest
import torch

from hybridmem.plugins.swap import PinnedPool, SwapPolicy, _CudaTransport
from hybridmem.native import capture
from hybridmem.runtime import rng
from tests.helpers import entry_of
from tests.helpers.fakecuda import FakeCuda, FakeEvent, HostPool


class CountingEvent(FakeEvent):
    queried = 0

    def query(self):
        CountingEvent.queried += 1
        return True


class CountingCuda(FakeCuda):
    def Event(self, enable_timing=False):
        return CountingEvent(self.log, enable_timing)


@pytest.fixture
def capturing(monkeypatch) -> None:
    """CUDA initialised and the current stream capturing."""
    monkeypatch.setattr(torch.cuda, "_initialized", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def test_the_check_is_free_where_cuda_was_never_initialised(monkeypatch) -> None:
    def raises() -> bool:
        raise AssertionError("asked CUDA before it was initialised")
    monkeypatch.setattr(torch.cuda, "_initialized", False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", raises)
    assert capture.capturing() is False
    assert timeit.timeit(capture.capturing, number=10_000) / 10_000 < 5e-6


def test_the_check_says_when_the_stream_captures(capturing) -> None:
    assert capture.capturing() is True


def test_swap_keeps_tensors_and_queries_no_event_during_capture(monkeypatch) -> None:
    fake = CountingCuda()
    p = SwapPolicy()
    pool = HostPool()
    tr = _CudaTransport(torch.device("cpu"), p._c, pool, timing=True, cuda=fake)
    tr._record_stream = lambda t, s: None
    p._transports[torch.device("cpu")], p.pool = tr, pool
    e = entry_of(torch.randn(1000))
    p.evict(e)                                   # before capture: one copy out, its timing events pending
    assert p.applicable(entry_of(torch.randn(10)))
    monkeypatch.setattr(torch.cuda, "_initialized", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    CountingEvent.queried = 0
    assert not p.applicable(entry_of(torch.randn(10)))  # nothing is evicted by swap while capturing
    p.step_ended()
    p.retire()
    _ = p.stats
    assert CountingEvent.queried == 0            # cudaEventQuery is illegal during capture
    with pytest.raises(RuntimeError, match="captured"):
        PinnedPool(pin=True).acquire(1 << 20)    # cudaHostAlloc neither
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    p.step_ended()
    assert CountingEvent.queried > 0 and p.inflight_bytes == 0


def test_no_cuda_generator_state_is_read_during_capture(capturing, monkeypatch) -> None:
    def refuse(*a, **k):
        raise RuntimeError("get_rng_state during capture")
    monkeypatch.setattr(torch.cuda, "get_rng_state", refuse)
    cpu_state, cuda_state = rng.rng_state(torch.device("cuda", 0))
    assert cuda_state == rng.CAPTURED and cpu_state == rng.host_state(torch.get_rng_state())
    assert rng.rng_state(torch.device("cpu"))[1] is None
    with pytest.raises(RuntimeError, match="recorded during CUDA graph capture"):
        with rng._ForkedRNG((cpu_state, cuda_state), torch.device("cuda", 0)):
            pass
