"""Swap and compress in the steady state: the recorded step's evictions by them become evictions at pack time.

Each run trains a model unmanaged and under a budget with the same seeds and compares losses, gradients,
parameters and buffers bit for bit; steady steps must evict by the recorded policies, stay within the budget
in the allocator's bytes (measured independently by torch.profiler too), and rebuild what they evicted.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem.native import cpumeter
from hybridmem.plugins.swap import _CudaTransport
from tests.helpers.fakecuda import FakeCuda, HostPool
from tests.helpers.steady import (monitor_peak as _monitor_peak, steady_real_bytes, train_steps as _train,
                                  zoo_batches as _zoo)

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator device unavailable: {cpumeter.unavailable_reason()}")


def _watch_offloads(calls: list[tuple[bool, str]], prefetch: bool = False) -> Any:
    """An ``on_enable`` that records (in a steady step, policy) of each eviction at pack time; ``prefetch``:
    prefetch in the steady state as on CUDA (off on the CPU, where a swap-in is synchronous)."""
    def watch(rt: Any) -> None:
        evict_early = rt.residency.evict_early

        def watched(e: Any, name: str) -> bool:
            calls.append((rt._steady is not None, name))
            return evict_early(e, name)
        rt._steady_parts.offload = watched
        if prefetch:
            rt._steady_parts.prefetch = rt._prefetch_one
    return watch


def _run(name: str, cut: float, policies: tuple[str, ...], on_enable: Any = None, steps: int = 5) -> tuple:
    model, batches, loss_fn = _zoo(name, steps=steps)
    ref, _ = _train(model, batches, loss_fn)
    peak, saved = _monitor_peak(model, batches, loss_fn)
    budget = int(peak - cut * saved)
    for _ in range(4):  # raised to the minimum an OOM names + 1 %, as a user would
        try:
            got, st = _train(model, batches, loss_fn, session={"budget": budget, "policies": policies},
                             per_step=(lambda i, s: on_enable(hybridmem.runtime.current.rt)) if on_enable else None)
            return ref, got, st, budget
        except torch.OutOfMemoryError as e:
            budget = int(e.min_budget_bytes * 1.01)
    raise AssertionError(f"no budget found for {name} in 4 tries")


@pytest.mark.parametrize("name,cut,policies", [("resnet50", 0.3, ("swap",)), ("transformer", 0.2, ("compress",)),
                                               ("gpt", 0.2, ("swap", "compress"))])
def test_steady_steps_evict_by_swap_and_compress_as_they_save(name: str, cut: float, policies: tuple) -> None:
    calls: list[tuple[bool, str]] = []
    seen: dict[str, Any] = {}

    def once(rt: Any) -> None:  # per_step runs after each step: install the watch after the first
        if seen.get("rt") is not rt:  # a new session (a retry at a larger budget): watch it
            seen["rt"] = rt
            calls.clear()
            _watch_offloads(calls)(rt)
    ref, got, st, budget = _run(name, cut, policies, once)
    assert got == ref
    assert st.steady_steps == 3, st.notes
    assert st.peak_bytes <= budget
    assert calls and all(steady for steady, _ in calls) and {p for _, p in calls} <= set(policies)
    assert set(policies) <= {p for _, p in calls}
    assert any("as they are saved" in n for n in st.notes), st.notes


def test_a_steady_step_with_evictions_at_pack_holds_the_budget_in_real_bytes() -> None:
    """Measured independently of hybridmem: torch.profiler's memory events in a steady step, plus the state."""
    real, budget, st = steady_real_bytes("resnet50", 0.3, "swap")
    assert st.steady_steps == 2, st.notes
    assert st.policies["swap"].evicted > 0
    assert real <= budget, (real, budget)


def test_steady_prefetch_follows_the_recorded_read_order() -> None:
    """With prefetch on (as on CUDA), the steady steps' swap-ins start before the reads that need them, in the
    order the recorded backward read them, and only where the budget has room."""
    events: list[tuple[str, int]] = []
    seen: dict[str, Any] = {}

    def once(rt: Any) -> None:
        if seen.get("rt") is rt:
            return
        seen["rt"] = rt
        events.clear()
        _watch_offloads([], prefetch=True)(rt)
        prefetch_one, unpack = rt._prefetch_one, rt.store.unpack

        def watched_prefetch(e: Any) -> bool:
            started = prefetch_one(e)
            if started:
                events.append(("prefetch", e.uid))
            return started

        def watched_unpack(h: Any) -> torch.Tensor:
            if rt._steady is not None and type(h).__name__ == "Saved" and h.entry.policy == "swap":
                events.append(("read", h.entry.uid))
            return unpack(h)
        rt._steady_parts.prefetch = watched_prefetch
        rt.store.unpack = watched_unpack
    ref, got, st, budget = _run("resnet50", 0.3, ("swap",), once)
    assert got == ref
    assert st.steady_steps == 3 and st.peak_bytes <= budget, st.notes
    prefetched = [uid for what, uid in events if what == "prefetch"]
    assert prefetched, "nothing was prefetched"
    for uid in prefetched:  # each started before its read: found on its way
        assert events.index(("prefetch", uid)) < events.index(("read", uid))
    first_reads = list(dict.fromkeys(uid for what, uid in events if what == "read"))
    assert [u for u in first_reads if u in set(prefetched)] == list(dict.fromkeys(prefetched))  # in read order


def test_steady_swaps_follow_the_cuda_protocol() -> None:
    """The steady steps' swaps through the CUDA transport (a recording stand-in for torch.cuda on the CPU):
    each copy out is queued on its side stream behind the compute stream, each prefetched copy in on the
    other, the compute stream waits for it on the device; the host never waits for an event."""
    seen: dict[str, Any] = {}

    def once(rt: Any) -> None:
        if seen.get("rt") is rt:
            return
        seen["rt"] = rt
        fake = seen["fake"] = FakeCuda()  # a retry's session: a transport of its own
        swap = rt.policies["swap"]
        pool = HostPool()
        tr = _CudaTransport(torch.device("cpu"), swap._c, pool, timing=True, cuda=fake)
        tr._record_stream = lambda t, s: fake.log.append(("record_stream", s.name))
        swap._transports[torch.device("cpu")], swap.pool = tr, pool
        rt._steady_parts.prefetch = rt._prefetch_one
        fake.log.append(("watching",))
    ref, got, st, budget = _run("resnet50", 0.3, ("swap",), once)
    assert got == ref
    assert st.steady_steps == 3 and st.peak_bytes <= budget, st.notes
    log = seen["fake"].log
    assert not [x for x in log if x[0] == "event_sync"]          # the host never waits
    def after_compute(stream: str) -> bool:
        """Every copy on ``stream`` is queued after the stream waited for the compute stream."""
        enters = [i for i, x in enumerate(log) if x == ("enter", stream)]
        return bool(enters) and all(("wait_stream", stream, "compute") in log[max(0, i - 3):i] for i in enters)
    assert after_compute("d2h") and after_compute("h2d")
    assert ("wait_event", "compute") in {x[:2] for x in log}     # a device-side wait for each swap-in
    swap = seen["rt"].policies["swap"]
    assert swap.stats["prefetched"] > 0 and swap.stats["d2h_reused"] >= 0


class _WritesLater(nn.Module):
    """Six blocks that save a large activation each; from step ``write_at`` on, the first writes its saved
    activation in place after the save (the oldest: the first to be evicted)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.ModuleList(nn.Linear(256, 256) for _ in range(6))
        self.out = nn.Linear(256, 1)
        self.step, self.write_at = 0, 10**9

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        for i, lin in enumerate(self.lin):
            h = lin(x)
            x = h.sin()              # saves h
            if i == 0 and self.step >= self.write_at:
                h.mul_(2.0)          # after its save: backward would read other values
        return self.out(x)


def test_a_tensor_written_in_place_after_its_steady_eviction_is_refused() -> None:
    """PyTorch refuses a saved tensor modified in place; a swap at pack time still sees the write."""
    torch.manual_seed(0)
    model = _WritesLater()
    x = torch.randn(2048, 256)
    with hybridmem.session(budget=None) as s:
        model(x).sum().backward()
        peak, saved = s.stats().peak_bytes, s.stats().saved_bytes
    budget = int(peak - 0.4 * saved)
    for _ in range(4):
        try:
            with hybridmem.session(budget=budget, policies=("swap",)) as s:
                for _ in range(3):
                    model(x).sum().backward()
                assert s.stats().steady_steps >= 1 and s.stats().policies["swap"].evicted > 0, s.stats().notes
                model.write_at = model.step + 1
                with pytest.raises(RuntimeError, match="modified by an in-place operation"):
                    model(x).sum().backward()
            return
        except torch.OutOfMemoryError as e:
            budget = int(e.min_budget_bytes * 1.01)
    raise AssertionError("no budget found in 4 tries")
