"""What the runtime does when a real allocator refuses memory outside an op (the CUDA caching allocator
caps its reserved bytes and refuses with live bytes under the budget), and ``plugins: {verify: true}``.

The CUDA paths ran on an H200 (docs/gpu-results.md); here each refusal is produced on the CPU."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import hybridmem
from hybridmem.plugins.base import EvictionDeclined
from hybridmem.plugins.compress import CompressPolicy
from hybridmem.plugins.swap import SwapPolicy
from hybridmem.native import cpumeter
from hybridmem.runtime.meter import Meter
from hybridmem.runtime.residency import RegenerationMismatch, Residency
from hybridmem.zoo import build
from tests.helpers import entry_of
from tests.helpers.runtime import Case, budget_for, min_budget_of, run, train

REFUSED = "CUDA out of memory. Tried to allocate 1.00 MiB. GPU 0 has a total capacity of 80 GiB"

native = pytest.mark.skipif(cpumeter.load() is None,
                            reason=f"native allocator device unavailable: {cpumeter.unavailable_reason()}")


def _case(name: str = "resnet50") -> Case:
    e = build(name, "small")
    args, kwargs = e.args_kwargs()
    return Case(name, e.model, args, kwargs, e.loss_fn)


def test_compress_analysis_refused_is_not_compressible_for_now() -> None:
    p = CompressPolicy()
    e = entry_of(torch.randn(1 << 14).relu())  # half zeros: a lossless codec pays
    real = p._decide
    calls = []

    def refused_once(t, stamp, passes=None):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError(REFUSED)
        return real(t, stamp, passes)

    p._decide = refused_once
    assert p.choose(e) is None                                   # refused: no codec now ...
    assert p.stats["analyses_refused"] == 1 and p.stats["analyses"] == 0
    assert p.choose(e) is not None                               # ... decided again when asked next
    assert len(calls) == 2 and p.stats["analyses"] == 1


def test_retry_oom_exhausted_names_a_budget() -> None:
    """An op refused every time although evicting freed memory each time ends in the runtime's OOM (the
    one naming a budget), not the allocator's."""
    m = Meter("cpu", on_pressure=lambda n: n)
    named = torch.OutOfMemoryError("hybridmem: the budget ... Smallest budget that could work: ...")
    asked = []
    m.on_exhausted = lambda need, what, held: asked.append((need, what)) or named

    def always():
        raise torch.OutOfMemoryError(REFUSED)

    with pytest.raises(torch.OutOfMemoryError) as got:
        m.retry_oom(always)
    assert got.value is named and asked == [(1 << 20, "op always")]


def test_prefetch_refused_is_left_to_the_read() -> None:
    refusing = SimpleNamespace(name="swap", prefetch=lambda e: (_ for _ in ()).throw(torch.OutOfMemoryError(REFUSED)))
    meter = SimpleNamespace(current_bytes=0)
    res = Residency(lambda keeper: SimpleNamespace(), {"swap": refusing}, meter, SimpleNamespace(), budget=1 << 30)
    e = SimpleNamespace(tensor=None, policy="swap", nbytes=1 << 20)
    res.prefetch([e])  # no error: the entry is regenerated when it is read
    assert e.tensor is None


@native
def test_regeneration_refused_once_is_retried(monkeypatch, one_thread) -> None:
    """A swap-in buffer the allocator refuses (the CUDA cap's fragments) is retried after making room:
    the step completes with the unmanaged run's gradients, bit for bit."""
    case = _case()
    ref, _ = run(case, steps=2)
    _, mon = run(case, steps=2, budget=None)
    real = SwapPolicy.regenerate
    refused = []

    def regenerate(self, entry):
        if not refused:
            refused.append(entry.uid)
            raise torch.OutOfMemoryError(REFUSED)
        return real(self, entry)

    monkeypatch.setattr(SwapPolicy, "regenerate", regenerate)
    got, st = run(case, steps=2, budget=budget_for(mon, 0.3), policies=("swap",))
    assert refused and st.policies["swap"].regenerated > 0
    assert got == ref


@native
def test_an_eviction_the_policy_declines_leaves_the_tensor_and_picks_another(monkeypatch, one_thread) -> None:
    """Compress offers the choice it made for a recorded node's earlier save; where the new bytes do not pay it
    declines at eviction (EvictionDeclined). The runtime keeps that tensor resident, evicts others, and the
    steps train bit for bit as unmanaged ones."""
    case = _case("gpt")
    ref, _ = run(case, steps=2)
    _, mon = run(case, steps=2, budget=None)
    real = CompressPolicy.evict
    declined = []

    def evict(self, entry):
        if len(declined) < 3:
            declined.append(entry.uid)
            raise EvictionDeclined("compress: no codec pays for these bytes now")
        return real(self, entry)

    monkeypatch.setattr(CompressPolicy, "evict", evict)
    got, st = run(case, steps=2, budget=budget_for(mon, 0.6), policies=("compress", "recompute"))
    assert len(declined) == 3 and sum(p.evicted for p in st.policies.values()) > 0
    assert got == ref


@native
@pytest.mark.parametrize("policies", [("swap",), ("recompute",), ("compress",), ("swap", "recompute", "compress")],
                         ids="+".join)
def test_verify_checks_every_regeneration(policies, one_thread) -> None:
    case = _case("gpt")
    ref, _ = run(case, steps=2)
    _, mon = run(case, steps=2, budget=None)
    budget = budget_for(mon, 0.3)
    for _ in range(6):
        model = copy.deepcopy(case.model)
        try:
            with hybridmem.session(budget=budget, policies=policies, device="cpu",
                                   config={"plugins": {"verify": True, "steady": False}}) as s:
                got = train(case, model, 2)
                pending = dict(s.runtime.residency.verify)
            break
        except torch.OutOfMemoryError as e:  # compress alone saves less: the budget it names + 1 %
            budget = int(min_budget_of(e) * 1.01)
    st = s.stats()
    assert got == ref
    evicted = sum(p.evicted for p in st.policies.values())
    assert evicted > 0 and not pending  # every eviction was hashed, and every hash checked and dropped


@native
def test_verify_names_a_regeneration_with_other_bytes(monkeypatch, one_thread) -> None:
    case = _case("gpt")
    _, mon = run(case, steps=1, budget=None)
    real = SwapPolicy.regenerate

    def corrupting(self, entry):
        t = real(self, entry)
        if t.is_floating_point():
            t.view(-1)[0] += 1  # what a copy read before it landed would give
        return t

    monkeypatch.setattr(SwapPolicy, "regenerate", corrupting)
    with pytest.raises(RegenerationMismatch, match=r"evicted by swap, came back with other bytes"):
        run(case, steps=1, budget=budget_for(mon, 0.3), policies=("swap",),
            config={"plugins": {"verify": True}})


def test_verify_is_a_boolean() -> None:
    with pytest.raises(ValueError, match="verify: expected true or false"):
        with hybridmem.session(budget="1GiB", device="cpu", config={"plugins": {"verify": "yes"}}):
            pass


def _residency(budget: int, current: int) -> Residency:
    meter = SimpleNamespace(current_bytes=current)
    return Residency(lambda keeper: SimpleNamespace(), {}, meter, SimpleNamespace(), budget=budget)


def test_refused_under_the_budget_frees_a_block_the_request_fits_in_first(monkeypatch) -> None:
    """CUDA: refused with the live bytes under the budget (the cap's free fragments too small): entries at
    least the request's size go first; any others only where none of those could."""
    res = _residency(budget=100 << 20, current=90 << 20)
    calls = []
    monkeypatch.setattr(res, "_fragmented", lambda: True)
    monkeypatch.setattr(res, "relieve", lambda need, extra=0, slack=0, min_bytes=0:
                        calls.append((need, min_bytes)) or (0 if min_bytes else need))
    assert res.relieve_oom(2 << 20) == 2 << 20
    assert calls == [(2 << 20, 2 << 20), (2 << 20, 0)]
    monkeypatch.setattr(res, "_fragmented", lambda: False)
    calls.clear()
    assert res.relieve_oom(2 << 20) == 1 and calls == []  # fits, nothing cached: retried as it is


def test_candidates_below_the_request_are_not_offered(monkeypatch) -> None:
    res = _residency(budget=100 << 20, current=90 << 20)
    small, large = SimpleNamespace(nbytes=1 << 20, last_access=0.0), SimpleNamespace(nbytes=4 << 20, last_access=0.0)
    policy = SimpleNamespace(cost=lambda e: 1.0)
    monkeypatch.setattr(res, "candidates", lambda: [small, large])
    monkeypatch.setattr(res, "_offers", lambda e: [(policy, 1.0, e.nbytes)])
    pairs, *_ = res._score_inputs(2 << 20)
    assert [e for e, _ in pairs] == [large]
    pairs, *_ = res._score_inputs()
    assert [e for e, _ in pairs] == [small, large]


def test_a_refusal_the_budget_holds_by_count_is_named_fragmentation(monkeypatch) -> None:
    """CUDA: the allocator refused 2 MiB with 14 MiB of the budget unallocated (MobileNetV2 compress on an H200,
    2026-12-04): the error says the cache's blocks were too small, not that nothing could be evicted."""
    res = _residency(budget=100 << 20, current=86 << 20)
    res.stats = SimpleNamespace(min_budget_bytes=0)
    res.store = SimpleNamespace(resident_bytes=lambda: 0)
    monkeypatch.setattr(res, "_evictable_bytes", lambda: 0)
    monkeypatch.setattr(res, "_resident_summary", lambda: ("no saved tensors", "0 in use", "0 shared"))
    err = res.out_of_memory(2 << 20, "op cudnn_batch_norm.default", held=86 << 20)
    assert "holds by count (14.00 MiB of it unallocated)" in str(err) and "expandable_segments" in str(err)
    assert "nothing more can be evicted" not in str(err)
    assert err.min_budget_bytes == (100 << 20) + 1          # above this budget: all that is known
    err = res.out_of_memory(20 << 20, "op convolution.default")   # over the budget by count
    assert "nothing more can be evicted" in str(err) and "by count" not in str(err)


def test_make_room_names_what_needs_the_bytes_only_where_it_refuses(monkeypatch) -> None:
    """A regeneration passes a function naming what it is for: it runs where the bytes do not fit, and
    its name is the one the refusal gives; where they fit, it never runs."""
    res = _residency(budget=100 << 20, current=90 << 20)
    monkeypatch.setattr(res, "relieve", lambda need, extra=0, slack=0, min_bytes=0: 0)
    refused: list[str] = []
    monkeypatch.setattr(res, "refuse", lambda extra, what, held=None: refused.append(what))
    named: list[int] = []

    def what() -> str:
        named.append(1)
        return "regenerating a saved float32 tensor (20.00 MiB) by swap"
    res.make_room(1 << 20, what)
    assert named == [] and refused == []
    res.make_room(20 << 20, what)
    assert named == [1] and refused == ["regenerating a saved float32 tensor (20.00 MiB) by swap"]
