"""Compress policy and codecs: bit-exact lossless round trips, expected sizes, lossy bounds, config."""
from __future__ import annotations

import math

import pytest
import torch

from hybridmem.errors import UnknownNameError
from hybridmem.plugins import codecs
from hybridmem.plugins.base import EvictionDeclined, Policy
from hybridmem.runtime.entry import Entry
from hybridmem.plugins.codecs import Analysis, bits_dtype, flat_view
from hybridmem.plugins.compress import CompressPolicy
from tests.helpers import bit_equal, entry_of


def round_trip(policy: CompressPolicy, t: torch.Tensor) -> tuple[torch.Tensor, str, int]:
    ref = t.clone()
    e = entry_of(t)
    assert policy.applicable(e)
    handle = policy.evict(e)
    assert e.tensor is None and e.policy == "compress"
    out = policy.regenerate(e)
    assert e.tensor is out and out.device == ref.device and out.shape == ref.shape
    if policy.lossless:
        assert bit_equal(out, ref)
    return out, handle.enc.codec, handle.enc.nbytes


def relu_like(n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).relu().to(dtype)
    x[3], x[11] = -0.0, torch.finfo(dtype).tiny / 4          # negative zero and a denormal
    if dtype == torch.float32:
        x[17:19] = torch.tensor([0x7FC00123, 0x7F800001], dtype=torch.int32).view(torch.float32)  # NaN payloads
    return x


@pytest.fixture(params=[False, True], ids=["numba", "torch"])
def force_torch(request):
    return request.param


def test_policy_protocol():
    assert isinstance(CompressPolicy(), Policy) and CompressPolicy().lossless
    assert not CompressPolicy(lossy=("bf16",)).lossless


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_sparse_round_trip_is_bit_exact(dtype, force_torch):
    x = relu_like(10_001, dtype)
    out, codec, nbytes = round_trip(CompressPolicy(force_torch=force_torch), x.clone())
    assert codec == "sparse" and bit_equal(out, x)
    nnz = int((x.view(bits_dtype(dtype)) != 0).sum())
    assert nbytes == (x.numel() + 7) // 8 + (nnz + 1) * x.element_size()


def test_negative_zero_is_kept_not_dropped(force_torch):
    x = torch.zeros(64)
    x[::2] = -0.0
    x[1] = 1.0
    out, codec, _ = round_trip(CompressPolicy(force_torch=force_torch), x.clone())
    assert bit_equal(out, x) and torch.signbit(out[::2]).all()


@pytest.mark.parametrize("n", [2, 7, 8, 9, 4099])
def test_bitmask_round_trip_and_size(n, force_torch):
    g = torch.Generator().manual_seed(n)
    m = torch.rand(n, generator=g) < 0.3
    out, codec, nbytes = round_trip(CompressPolicy(force_torch=force_torch), m.clone())
    assert codec == "bitmask" and torch.equal(out, m) and nbytes == (n + 7) // 8


def test_binary_codec_for_float_dropout_masks(force_torch):
    g = torch.Generator().manual_seed(1)
    mask = (torch.rand(1000, 3, generator=g) < 0.9).float() / 0.9      # what CPU dropout saves
    out, codec, nbytes = round_trip(CompressPolicy(force_torch=force_torch), mask.clone())
    assert codec == "binary" and bit_equal(out, mask) and nbytes == (3000 + 7) // 8
    zeros = torch.zeros(100, dtype=torch.float64)
    out, codec, _ = round_trip(CompressPolicy(force_torch=force_torch), zeros.clone())
    assert codec == "binary" and bit_equal(out, zeros)


def test_views_keep_their_geometry(force_torch):
    base = torch.randn(64, 48).relu()
    view = base.t()[5:, 3:40]                         # non-contiguous, storage offset, whole storage kept
    out, _, _ = round_trip(CompressPolicy(force_torch=force_torch), view)
    assert out.stride() == view.stride() and out.storage_offset() == view.storage_offset()
    assert bit_equal(out, view) and bit_equal(flat_view(out.untyped_storage(), torch.float32, out.device),
                                              base.view(-1))


def test_numba_and_torch_kernels_produce_the_same_encoding():
    x = relu_like(5003)
    bits = x.view(torch.int32)
    info = Analysis.of(bits)
    assert info == Analysis.of(bits, force_torch=True)
    for name in ("sparse", "binary") if info.binary else ("sparse",):
        c = codecs.LOSSLESS[name]
        a, b = c.encode(bits, info, False), c.encode(bits, info, True)
        assert all(torch.equal(p, q) for p, q in zip(a.parts, b.parts))
        out = torch.empty_like(bits)
        c.decode(a, out, force_torch=True)                # cross-decode
        assert torch.equal(out, bits)


def test_torch_path_in_chunks(monkeypatch):
    monkeypatch.setattr(codecs, "_CHUNK", 64)         # many chunks, including a ragged last one
    x = relu_like(1000)
    out, codec, _ = round_trip(CompressPolicy(force_torch=True), x.clone())
    assert codec == "sparse" and bit_equal(out, x)
    m = torch.rand(1001) < 0.5
    out, _, _ = round_trip(CompressPolicy(force_torch=True), m.clone())
    assert torch.equal(out, m)


def test_sparse_ints_and_relu_ratio():
    idx = torch.zeros(4096, dtype=torch.int64)
    idx[::4] = torch.arange(1024)
    sparse_only = CompressPolicy(lossless_codecs=("bitmask", "binary", "sparse"))
    out, codec, nbytes = round_trip(sparse_only, idx.clone())
    assert codec == "sparse" and torch.equal(out, idx) and nbytes < 0.6 * idx.numel() * 8
    out, codec, nbytes = round_trip(CompressPolicy(), idx.clone())    # 2 bytes each beat 1/8 + 1/4 x 8
    assert codec == "narrow" and torch.equal(out, idx) and nbytes == idx.numel() * 2
    e = entry_of(torch.randn(1 << 16).relu())
    ratio = CompressPolicy().ratio(e)
    assert 0.5 < ratio < 0.56                         # ~50 % zeros: 1/32 + nnz/n


def test_dense_tensors_are_not_applicable_and_decisions_are_cached():
    p = CompressPolicy()
    e = entry_of(torch.randn(1000))
    assert not p.applicable(e) and p.savings(e) == 0 and p.cost(e) == math.inf
    assert not p.applicable(e) and p.stats["analyses"] == 1          # cached negative decision
    with pytest.raises(ValueError, match="no codec applies"):
        p.evict(e)
    r = entry_of(torch.randn(1000).relu())
    assert p.applicable(r) and p.savings(r) > 0 and p.cost(r) > 0 and p.stats["analyses"] == 2
    p.savings(r), p.cost(r)
    assert p.stats["analyses"] == 2
    r.tensor.add_(1.0)                                # written in place: decided again
    assert not p.applicable(r) and p.stats["analyses"] == 3


def test_savings_match_the_encoding():
    p = CompressPolicy()
    e = entry_of(torch.rand(10_000) < 0.5)
    s = p.savings(e)
    handle = p.evict(e)
    assert s == e.nbytes - handle.enc.nbytes == 10_000 - 1250


def test_prefetch_then_regenerate():
    p = CompressPolicy()
    x = relu_like(777)
    e = entry_of(x.clone())
    p.evict(e)
    p.prefetch(e)
    assert p.stats["prefetches"] == 1 and e.tensor is None
    assert bit_equal(p.regenerate(e), x)
    assert p.stats["exposed_s"] == 0.0 and p.stats["regenerations"] == 1


def test_meta_and_empty_tensors_are_skipped():
    p = CompressPolicy()
    assert not p.applicable(entry_of(torch.empty(10, device="meta")))
    assert not p.applicable(entry_of(torch.empty(0)))


# ---- lossy -----------------------------------------------------------------------------------------

def wide_range(n: int = 20_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    mant = torch.rand(n, generator=g) * 2 - 1
    exp = torch.randint(-140, 100, (n,), generator=g).float()
    return (mant * torch.exp2(exp)).float()


def test_lossy_only_when_configured():
    x = torch.randn(1000)
    assert not CompressPolicy().applicable(entry_of(x.clone()))
    p = CompressPolicy(lossy=("bf16",))
    out, codec, nbytes = round_trip(p, x.clone())
    assert codec == "bf16" and nbytes == 2000
    # a lossless codec that pays wins over a configured lossy one
    relu = torch.randn(1000).relu()
    _, codec, _ = round_trip(CompressPolicy(lossy=("int8",)), relu.clone())
    assert codec == "sparse"
    _, codec, _ = round_trip(CompressPolicy(lossy=("int8",), prefer_lossless=False), relu.clone())
    assert codec == "int8"                          # smaller wins when lossless is not preferred


def test_bf16_bound():
    x = wide_range()
    x = x[x.abs() < 3e38]
    out, _, _ = round_trip(CompressPolicy(lossy=("bf16",)), x.clone())
    err = (out.double() - x.double()).abs()
    assert (err <= 2.0 ** -8 * x.double().abs() + 2.0 ** -134).all()


def test_fp16_bound_and_overflow_guard():
    x = wide_range()
    x = x[x.abs() <= 65504]
    out, _, _ = round_trip(CompressPolicy(lossy=("fp16",)), x.clone())
    err = (out.double() - x.double()).abs()
    assert (err <= 2.0 ** -11 * x.double().abs() + 2.0 ** -25).all()
    big = torch.tensor([1.0, 70000.0])
    assert not CompressPolicy(lossy=("fp16",)).applicable(entry_of(big))
    inf_ok = torch.tensor([1.0, float("inf"), float("nan"), -2.0])
    assert CompressPolicy(lossy=("fp16",)).applicable(entry_of(inf_ok))


def test_int8_bound():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(50_000, generator=g) * 3
    out, codec, nbytes = round_trip(CompressPolicy(lossy=("int8",)), x.clone())
    a = x.abs().max().double()
    assert codec == "int8" and nbytes == x.numel()
    assert ((out.double() - x.double()).abs() <= a / 254 + a * 2.0 ** -22).all()
    assert not CompressPolicy(lossy=("int8",)).applicable(entry_of(torch.tensor([1.0, float("nan")])))
    zeros = torch.zeros(10)                          # handled by the lossless binary codec anyway
    assert CompressPolicy(lossy=("int8",)).applicable(entry_of(zeros))


def test_unknown_codec_lists_the_known_ones():
    with pytest.raises(UnknownNameError, match="unknown codec 'fp4'.*bf16.*bitmask.*fp8.*int8.*sparse"):
        CompressPolicy(lossy=("fp4",))
    with pytest.raises(UnknownNameError):
        codecs.get_codec("zstd")


def test_decision_carries_over_a_regeneration_and_the_runtimes_rewrapping():
    p = CompressPolicy()
    e = entry_of(torch.randn(4096).relu())
    e.version = e.tensor._version + e.vshift        # SavedStore.before_evict
    p.evict(e)
    t = p.regenerate(e)
    base = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())   # SavedStore.adopt
    e.tensor, e.vshift = base, e.version - base._version
    assert p.applicable(e) and p.stats["analyses"] == 1               # no second analysis pass
    assert p.device_tensors(p.evict(e)) and p.stats["evictions"] == 2


class _RecordedNode:
    """Stands for a recorded program's lineage node (weakly referenceable), which a steady-state step binds
    each save of the same tensor to."""


def test_a_later_save_of_the_same_recorded_node_is_offered_without_reading_its_bytes():
    """The scorer asks every candidate's policies at each eviction pass; on the CPU an analysis reads every byte.
    A save of a node decided before is offered that decision; evicting decides on its own bytes, and declines
    (the runtime then picks another victim) where the offer no longer holds."""
    p = CompressPolicy()
    node = _RecordedNode()
    first = entry_of(torch.randn(4096).relu())
    first.lineage = node
    assert p.applicable(first) and p.stats["analyses"] == 1
    again = entry_of(relu_like(4096, seed=1))
    again.lineage = node
    assert p.applicable(again) and p.savings(again) > 0 and p.cost(again) < math.inf
    assert p.stats["analyses"] == 1                                   # offered without an analysis
    ref = again.tensor.clone()
    p.evict(again)
    assert p.stats["analyses"] == 2 and bit_equal(p.regenerate(again), ref)  # encoded from its own analysis
    dense = entry_of(torch.randn(4096))
    dense.lineage = node
    assert p.applicable(dense) and p.stats["analyses"] == 2           # the node's earlier choice
    with pytest.raises(EvictionDeclined, match="no codec pays"):
        p.evict(dense)
    assert dense.tensor is not None and dense.policy is None          # still resident
    assert not p.applicable(dense) and p.stats["analyses"] == 3       # decided on its bytes now
    other = entry_of(torch.randn(4096))                               # no recorded node: decided at once
    assert not p.applicable(other) and p.stats["analyses"] == 4
    with pytest.raises(ValueError, match="no codec applies"):
        p.evict(other)


def test_cost_from_the_shared_cost_model():
    e = entry_of(torch.randn(1 << 14).relu())
    local, shared = CompressPolicy().cost(e), CompressPolicy(cost_model="h100").cost(e)
    assert 0 < shared < local                                         # HBM-speed codecs on an H100


def test_fp8_bound():
    x = wide_range()
    x = x[x.abs() > 0]
    out, codec, nbytes = round_trip(CompressPolicy(lossy=("fp8",)), x.clone())
    a = x.abs().max().double()
    err = (out.double() - x.double()).abs()
    assert codec == "fp8" and nbytes == x.numel()
    assert (err <= 2.0 ** -4 * x.double().abs() + a * 2.0 ** -10 / 448 + a * 2.0 ** -22).all()


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64])
@pytest.mark.parametrize("span", [1, 255, 256, 65535, 65536, (1 << 32) - 1])
def test_narrow_round_trip_is_bit_exact_at_every_width(dtype, span):
    """Spans right below and at each width's limit, anywhere in the dtype's range (both ends, zero)."""
    width = torch.empty(0, dtype=dtype).element_size()
    bits = bits_dtype(dtype)
    info = torch.iinfo(bits)
    g = torch.Generator().manual_seed(span)
    for lo in (info.min, -span // 2, 0, info.max - span):
        if lo < info.min or lo + span > info.max:
            continue
        vals = torch.randint(0, span + 1, (999,), generator=g, dtype=torch.int64)
        vals[0], vals[1] = 0, span                                # both ends present: the span is exact
        x = (vals + lo).to(bits).view(dtype) if width < 8 else (vals + lo).view(dtype)
        p = CompressPolicy()
        e = entry_of(x.clone())
        want = next((k for k in (1, 2, 4) if k < width and span < 1 << (8 * k)), None)
        if want is None or want > 0.6 * width:
            assert p.choose(e) is None or p.choose(e).codec.name != "narrow"
            continue
        out, codec, nbytes = round_trip(p, x.clone())
        assert bit_equal(out, x)
        if codec != "narrow":                                      # {-1, 0}: binary's bit per element wins
            assert nbytes < x.numel() * want, (lo, span, codec)
            continue
        assert nbytes == x.numel() * want, (lo, span)


def test_narrow_max_pool_indices_and_what_it_leaves_alone():
    x = torch.randn(2, 3, 32, 32)
    _, idx = torch.nn.functional.max_pool2d(x, 2, return_indices=True)
    out, codec, nbytes = round_trip(CompressPolicy(), idx.clone())
    assert codec == "narrow" and torch.equal(out, idx) and nbytes == idx.numel() * 2    # indices < 1024
    _, torch_codec, _ = round_trip(CompressPolicy(force_torch=True), idx.clone())
    flat = idx.view(-1)
    span = codecs.Span.of(flat)
    a, b = (codecs.NarrowCodec().encode(flat, span, force_torch=f) for f in (False, True))
    assert torch_codec == "narrow" and torch.equal(a.parts[0], b.parts[0])   # either kernel decodes the other's
    out, codec, nbytes = round_trip(CompressPolicy(), torch.arange(-70, 70, dtype=torch.int32))
    assert codec == "narrow" and nbytes == 140
    for t in (torch.randint(-2**40, 2**40, (512,)),            # too wide a span
              torch.randint(-100, 100, (512,), dtype=torch.int8),   # nothing narrower than a byte
              torch.rand(512) + 1.0):                           # floats: bit patterns, never narrowed
        c = CompressPolicy().choose(entry_of(t))
        assert c is None or c.codec.name != "narrow"
    with pytest.raises(UnknownNameError):
        CompressPolicy(lossless_codecs=("narow",))
    assert CompressPolicy(lossless_codecs=("narrow",)).choose(entry_of(torch.randn(64).relu())) is None
