"""A managed step never makes a CUDA host wait for its device, and reads no allocator statistics per op.

On a GPU every device synchronisation stops the host from running ahead of the kernels it queues, and a
``torch.cuda.memory_allocated()`` per op costs a quarter of a millisecond of Python. The CPU cannot feel
either, so :class:`tests.helpers.syncs.SyncCounter` counts them: ``.item()``-like reads, ``nonzero`` and
boolean indexing, ``tolist()``, ``torch.cuda.synchronize`` and the Python allocator-statistics calls, in
every op the runtime runs as well as the model's. The compress policy runs its torch kernels here (the ones
CUDA runs) with its statistics queued, as on CUDA.
"""
from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch

import hybridmem
from hybridmem.plugins import codecs
from hybridmem.plugins.compress import CompressPolicy
from hybridmem.native import cpumeter
from hybridmem.runtime.entry import Entry
from hybridmem.runtime.meter import Meter
from hybridmem.runtime.dispatch_mode import RuntimeMode
from hybridmem.zoo import build
from tests.helpers.syncs import SyncCounter

torch.set_num_threads(1)


class _Copy:
    """The event of a queued copy: arrived once the test says so."""

    def __init__(self, arrived: bool = False) -> None:
        self.arrived = arrived

    def query(self) -> bool:
        return self.arrived


def _entry(t: torch.Tensor) -> Entry:
    return Entry(tensor=t, nbytes=t.untyped_storage().nbytes(), dtype=t.dtype, device=t.device)


def _saved_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 15, generator=g)
    return {"sparse": x.relu(),                                          # ReLU output: half zeros
            "binary": (torch.rand(1 << 15, generator=g) > 0.3).float() / 0.7,  # a CPU dropout's mask
            "bitmask": x > 0,                                            # a bool mask
            "narrow": torch.randint(0, 200, (1 << 14,), generator=g),   # max-pool indices, token ids
            "fp16": x * 3, "int8": x * 5}


@pytest.mark.parametrize("kind", list(_saved_tensors()))
def test_compress_decides_from_statistics_it_never_waits_for(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Statistics queued (as on CUDA): not compressible until their copy has arrived, then the codec the
    statistics call for; deciding, encoding and decoding read no device value on the host."""
    t = _saved_tensors()[kind]
    lossy = (kind,) if kind in ("fp16", "int8") else ()
    p = CompressPolicy(lossy=lossy, force_torch=True, wait_for_stats=False, max_ratio=0.75)
    copy = _Copy()
    monkeypatch.setattr(codecs, "_DONE", copy)
    e = _entry(t.clone())
    expected = t.clone()
    with SyncCounter(monkeypatch) as sync:
        first = p.applicable(e)
        if kind != "bitmask":  # a bool mask's codec reads no statistics: decided at once
            assert not first and not p.applicable(e)  # queued, then not arrived yet
            assert p.stats["analyses_pending"] == 2
        copy.arrived = True
        assert p.applicable(e)
        choice = p.choose(e)
        assert choice is not None and choice.codec.name == kind
        p.evict(e)
        got = p.regenerate(e)
        counts, _ = sync.take()
    assert not counts, f"host reads of device values: {dict(counts)}"
    if kind in ("fp16", "int8"):
        assert torch.allclose(got, expected, rtol=1e-2, atol=expected.abs().max().item() / 100)
    else:
        assert got.view(torch.uint8).equal(expected.view(torch.uint8))


def test_queued_statistics_are_dropped_when_the_bytes_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decision queued for one version of the bytes is not used for another."""
    p = CompressPolicy(force_torch=True, wait_for_stats=False)
    copy = _Copy()
    monkeypatch.setattr(codecs, "_DONE", copy)
    e = _entry(torch.randn(1 << 12).relu())
    assert not p.applicable(e)
    e.tensor.copy_(torch.randn(1 << 12))  # written in place: no zeros left, nothing pays
    copy.arrived = True
    assert not p.applicable(e)  # decided from the new bytes' statistics, not from the half zeros queued before
    assert p.stats["analyses"] == 1 and p.stats["analyses_pending"] == 1


pytestmark_native = pytest.mark.skipif(cpumeter.load() is None,
                                       reason=f"native allocator device unavailable: {cpumeter.unavailable_reason()}")


def _gpt() -> tuple[torch.nn.Module, tuple, Any]:
    e = build("gpt", "small", seed=0)
    args, kwargs = e.args_kwargs()
    return e.model, tuple(args), lambda m: e.loss_fn(m(*args, **kwargs))


def _steps(model: torch.nn.Module, loss_of: Any, n: int, sync: SyncCounter) -> list[tuple[Any, int]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(3)
    per = []
    for _ in range(n):
        loss_of(model).backward()
        per.append(sync.take())
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync.take()
    return per


@pytestmark_native
@pytest.mark.parametrize("policies", [("swap", "compress"), ("recompute", "compress")])
def test_managed_steps_never_wait_for_the_device(policies: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every policy evicting (the recorded step's swaps and compressions become evictions at pack time in
    the steady steps): no op or call that would synchronise a CUDA device beyond the model's own, in the
    dispatch-mode steps and in the steady ones; steady steps run no op through the runtime's mode and read
    the device's bytes per saved tensor, not per op."""
    model, _, loss_of = _gpt()
    steps = 5
    gc.collect()
    with SyncCounter(monkeypatch) as sync:
        plain = _steps(copy.deepcopy(model), loss_of, steps, sync)
        with hybridmem.session(budget=None, device="cpu") as s:
            _steps(copy.deepcopy(model), loss_of, 2, sync)
            peak, saved = s.stats().peak_bytes, s.stats().saved_bytes
        dispatched = reads = hooks = 0
        real_dispatch, real_reads = RuntimeMode.__torch_dispatch__, Meter.current_bytes.fget

        def dispatch(mode: RuntimeMode, *a: Any, **k: Any) -> Any:
            nonlocal dispatched
            # this session's mode (a runtime disabled from another thread leaves a quiet one on this thread's
            # stack, passing everything through: tests/test_runtime_threads.py)
            if not mode.quiet_depth:
                dispatched += 1
            return real_dispatch(mode, *a, **k)

        def read(m: Meter) -> int:
            nonlocal reads
            reads += 1
            return real_reads(m)
        monkeypatch.setattr(RuntimeMode, "__torch_dispatch__", dispatch)
        monkeypatch.setattr(Meter, "current_bytes", property(read))
        config = {"plugins": {"compress": {"force_torch": True, "wait_for_stats": False}}}
        with hybridmem.session(budget=int(peak - 0.2 * saved), device="cpu", policies=policies, config=config) as s:
            from hybridmem.runtime.current import rt
            from hybridmem.runtime.saved import SavedStore
            real_unpack = SavedStore.unpack

            def unpack(store: SavedStore, h: Any) -> torch.Tensor:
                nonlocal hooks
                hooks += 1
                return real_unpack(store, h)
            monkeypatch.setattr(SavedStore, "unpack", unpack)
            opt = torch.optim.SGD((m := copy.deepcopy(model)).parameters(), lr=0.05, momentum=0.9)
            torch.manual_seed(3)
            managed = []
            for i in range(steps):
                dispatched = reads = hooks = 0
                loss_of(m).backward()
                hooks += len(rt.program.saves) if rt.program is not None else 0  # the packs
                managed.append((sync.take(), dispatched, reads, hooks, rt._steady is not None or i >= 2))
                opt.step()
                opt.zero_grad(set_to_none=True)
                sync.take()
            st = s.stats()
    assert st.steady_steps == steps - 2, st.notes
    evicted = {n: p.evicted for n, p in st.policies.items()}
    assert all(evicted.get(n) for n in policies), evicted
    for i, ((counts, ops), dispatched, reads, hooks, steady) in enumerate(managed):
        assert counts == plain[i][0], f"step {i + 1}: {dict(counts - plain[i][0])} beyond the model's own"
        if i >= 2:  # steady: no op through the runtime's mode; the device's bytes read per saved tensor
            assert dispatched == 0, (i, [m[1] for m in managed])
            assert reads <= 3 * hooks < ops, (reads, hooks, ops)
