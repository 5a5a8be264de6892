"""torch.compile with ``compress``: saved tensors held losslessly encoded from the forward to the backward.

The ops round-trip every layout and dtype bit for bit and free their encodings with the autograd graph; a
network of convolutions and ReLUs without BatchNorm (its ReLU outputs half zeros, its max-pool indices
narrow) trains under a budget only compression meets, bit-identical to the unmanaged compiled step and
within the budget in real bytes, under AOTAutograd's eager runner and under Inductor; the compile's probe
of the saved tensors leaves the user's random stream and BatchNorm statistics as they were; where the plan
may also recompute, the backend takes the variant its cost model predicts fastest and says so.
"""
from __future__ import annotations

import copy
import gc
import re
from typing import Any

import pytest
import torch
from torch import nn

from hybridmem.compile import codec_ops, compile_backend
from hybridmem.native import cpumeter
from tests.helpers import bit_equal
from tests.helpers.peaks import real_peak

pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator meter unavailable: {cpumeter.unavailable_reason()}")


# ---- the ops -------------------------------------------------------------------------------------------

def _cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    relu = torch.randn(64, 33, generator=g).relu()
    signed = torch.tensor([0.0, -0.0, float("nan"), float("-inf"), 1e-42, 0.0] * 50)   # -0.0, NaN, denormals
    return [
        ("relu output (sparse)", relu),
        ("zeros with -0.0, NaN and denormals", signed),
        ("channels-last ReLU output",
         torch.randn(2, 3, 8, 8, generator=g).relu().to(memory_format=torch.channels_last)),
        ("transposed", torch.randn(40, 6, generator=g).relu().t()),
        ("bool mask (bitmask)", torch.rand(1001, generator=g) > 0.3),
        ("max-pool indices (narrow)", torch.randint(0, 4096, (3, 300), generator=g)),
        ("dense floats (nothing shrinks them)", torch.randn(10, 10, generator=g)),
        ("float64 dropout-style mask (binary)", (torch.rand(500, generator=g, dtype=torch.float64) > 0.5) * 2.0),
        ("empty", torch.zeros(0, 4)),
    ]


@pytest.mark.parametrize("what, x", _cases(), ids=[c[0] for c in _cases()])
def test_pack_and_unpack_round_trip_bit_for_bit_and_free_the_encoding_with_the_token(what: str,
                                                                                     x: torch.Tensor) -> None:
    codec_ops.register()
    region = codec_ops.new_region()
    before = codec_ops.live_payloads()
    token = torch.ops.hybridmem.pack_saved(x, region, 0)
    assert token.shape == (1,) and token.dtype == torch.int64
    assert codec_ops.live_payloads() == before + 1
    for _ in range(2):             # a backward run twice (retain_graph=True) decodes twice
        y = torch.ops.hybridmem.unpack_saved(token, list(x.shape), list(x.stride()), x.dtype, x.device, region)
        assert y.shape == x.shape and y.stride() == x.stride() and y.dtype == x.dtype
        assert bit_equal(y, x), what
    st = codec_ops.stats_for(region)
    assert st.packed == 1 and st.bytes_in == x.numel() * x.element_size()
    if "nothing shrinks" in what or what == "empty":
        assert st.raw == 1 and st.bytes_out == st.bytes_in
    else:
        assert st.raw == 0 and st.bytes_out < st.bytes_in
    del token
    gc.collect()
    assert codec_ops.live_payloads() == before


def test_a_token_whose_encoding_was_freed_says_so() -> None:
    codec_ops.register()
    region = codec_ops.new_region()
    x = torch.randn(100).relu()
    stale = torch.ops.hybridmem.pack_saved(x, region, 0).clone()   # the clone outlives the packed token
    gc.collect()
    with pytest.raises(RuntimeError, match="no encoding for token"):
        torch.ops.hybridmem.unpack_saved(stale, [100], [1], x.dtype, x.device, region)


# ---- compiled training -----------------------------------------------------------------------------------

class _PlainConvNet(nn.Module):
    """Convolutions and ReLUs without BatchNorm, max-pools between stages (a VGG-like net from widths)."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), classes: int = 10, image: int = 64) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for w in widths:
            layers += [nn.Conv2d(cin, w, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(w, w, 3, padding=1),
                       nn.ReLU(inplace=True), nn.MaxPool2d(2)]
            cin = w
        side = image >> len(widths)
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin * side * side, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, backend: Any, steps: int = 3
           ) -> tuple[list[int], list[list[torch.Tensor]], list[torch.Tensor]]:
    torch._dynamo.reset()
    gc.collect()
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    peaks, grads, losses = [], [], []
    for _ in range(steps):
        opt.zero_grad()
        box: list[torch.Tensor] = []

        def step() -> None:
            loss = nn.functional.cross_entropy(compiled(x), y)
            loss.backward()
            box.append(loss.detach())
        peaks.append(real_peak(step, model, opt, [x]))
        grads.append([p.grad.clone() for p in model.parameters()])
        losses.append(box[0])
        opt.step()
    return peaks, grads, losses


def _case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return _PlainConvNet(), torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))


def _mlp_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """An MLP of ReLU layers, batch larger than width: its saved activations are most of its step's memory.
    (Under Inductor the count of a convolution network's step is well above its real peak on this CPU.)"""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.ReLU())], nn.Linear(256, 10))
    return model, torch.randn(2048, 256), torch.randint(0, 10, (2048,))


@pytest.mark.parametrize("compiler, case, ratio", [("eager", _case, 0.97), ("inductor", _mlp_case, 0.9)],
                         ids=["conv-eager", "mlp-inductor"])
def test_a_budget_only_compression_meets_trains_bit_identical_within_it(compiler: str, case: Any, ratio: float) -> None:
    model, x, y = case()
    ref_peaks, ref_grads, ref_losses = _train(copy.deepcopy(model), x, y,
                                              "aot_eager" if compiler == "eager" else "inductor")
    # under the unmanaged real peak: compression alone (no recompute) must free the difference
    budget = int(ratio * ref_peaks[-1])
    b = compile_backend(budget, compiler=compiler, policies=("compress",))
    peaks, grads, losses = _train(copy.deepcopy(model), x, y, b)
    st = b.stats()
    (region,) = st.regions
    assert region.recomputed == 0 and region.compressed > 0, str(st)
    assert region.compressed_to_bytes < 0.75 * region.compressed_bytes
    assert {d["codec"] for d in region.decisions} >= {"sparse"}, region.decisions   # the ReLU outputs
    assert region.codec is not None and region.codec.packed == 3 * region.compressed   # each step packs each
    assert "compressed" in str(st) and "compress" in st.report()
    assert all(p <= budget for p in peaks), (peaks, budget, str(st))
    assert max(peaks) < ref_peaks[-1]
    assert all(bit_equal(a, c) for ga, gc_ in zip(grads, ref_grads) for a, c in zip(ga, gc_))
    assert all(bit_equal(a, c) for a, c in zip(losses, ref_losses))
    gc.collect()
    assert codec_ops.live_payloads() == 0        # every step's encodings went with its saved tensors


def test_without_compress_or_recompute_the_same_budget_has_no_plan() -> None:
    """The budget of the test above needs eviction: swap alone (which frees nothing on the CPU) has no plan
    for it, and the error says which policies could."""
    model, x, y = _case()
    ref_peaks, _, _ = _train(copy.deepcopy(model), x, y, "aot_eager", steps=1)
    b = compile_backend(int(0.97 * ref_peaks[-1]), compiler="eager", policies=("swap",))
    with pytest.raises(Exception, match=r"no plan within the budget .* evict nothing on cpu .*add recompute or compress"):
        _train(copy.deepcopy(model), x, y, b, steps=1)


class _BNDropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.3)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16 * 32 * 32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv2(self.drop(torch.relu(self.bn(self.conv(x))))))
        return self.head(h.flatten(1))


def test_the_probe_leaves_the_random_stream_and_batchnorm_statistics_alone() -> None:
    """Measuring what compresses runs the forward once at compile time, on a copy of the random stream and
    of every buffer it would write: a compiled step then leaves the generator and the running statistics
    where an unmanaged compiled step leaves them, with the same dropout mask and gradients."""
    torch.manual_seed(0)
    model, x, y = _BNDropNet(), torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))

    def step(backend: Any) -> tuple[Any, ...]:
        m = copy.deepcopy(model)
        torch._dynamo.reset()
        compiled = torch.compile(m, backend=backend)
        torch.manual_seed(7)
        peak = real_peak(lambda: nn.functional.cross_entropy(compiled(x), y).backward(), m, None, [x])
        return (peak, torch.random.get_rng_state(), m.bn.running_mean.clone(), m.bn.running_var.clone(),
                int(m.bn.num_batches_tracked), [p.grad.clone() for p in m.parameters()])

    peak, rng0, mean0, var0, n0, g0 = step("aot_eager")
    b = compile_backend(int(0.96 * peak), compiler="eager", policies=("compress",))
    peak1, rng1, mean1, var1, n1, g1 = step(b)
    assert b.stats().regions[0].compressed > 0, str(b.stats())
    assert peak1 <= int(0.96 * peak)
    assert torch.equal(rng0, rng1)
    assert bit_equal(mean0, mean1) and bit_equal(var0, var1) and n0 == n1 == 1
    assert all(bit_equal(p, q) for p, q in zip(g0, g1))


@pytest.mark.parametrize("case, ratio", [(_case, 0.97), (_mlp_case, 0.85)], ids=["conv", "mlp"])
def test_with_recompute_allowed_the_predicted_fastest_variant_is_taken_and_named(case: Any, ratio: float) -> None:
    """Beside recompute, compression is one more count to plan on. Where the region has a plan without it,
    the backend plans again with what that plan keeps compressed, unless those tensors' codecs alone cost
    more than the plan adds (the conv net: recomputing a max-pool is cheaper than any codec); where it has
    none (the MLP under AOTAutograd's eager runner, whose chains of a matrix product and a ReLU the planners
    cannot replay), with everything and with half compressed. It takes the plan predicted fastest and the
    region's note gives each variant's prediction."""
    model, x, y = case()
    ref_peaks, ref_grads, _ = _train(copy.deepcopy(model), x, y, "aot_eager", steps=1)
    budget = int(ratio * ref_peaks[-1])
    b = compile_backend(budget, compiler="eager", policies=("recompute", "compress"))
    peaks, grads, _ = _train(copy.deepcopy(model), x, y, b, steps=2)
    (region,) = b.stats().regions
    assert all(p <= budget for p in peaks), (peaks, budget, region.note)
    assert all(bit_equal(a, c) for a, c in zip(grads[0], ref_grads[0]))
    if "compression not tried" in region.note:
        assert case is _case and region.compressed == 0 and region.recomputed > 0, region.note
        return
    m = re.search(r"compression (chosen|not chosen) \(predicted ([^)]*)\)", region.note)
    assert m, region.note
    predicted = {name.strip(): float(v) for name, v in re.findall(r"([a-z ]+) ([+-][0-9.]+) %", m.group(2))}
    fastest = min(predicted, key=predicted.__getitem__)
    assert (m.group(1) == "chosen") == (fastest != "no compression"), (m.group(0), predicted)
    assert abs(100 * region.predicted_overhead - predicted[fastest]) < 0.06
    assert case is _mlp_case and m.group(1) == "chosen" and region.compressed > 0, region.note


def test_only_a_count_that_may_be_the_last_tried_searches_for_its_least_budget(monkeypatch: Any) -> None:
    """Where a count has no plan, finding the least budget it has one for takes a bisection of solves (16 at
    most: 32 s on ResNet-50 small's count with compression). The error needs it only from the count
    without compression and the one with everything compressed; the variants tried besides (compress
    half, compress what the first plan keeps) fail without it."""
    from hybridmem.compile.planner import Planner

    calls: list[tuple[str, bool]] = []
    mins: list[str] = []
    plan_variant, solve = Planner._plan_variant, Planner._solve

    def spy_variant(self: Any, v: Any, *args: Any, least: bool = True) -> Any:
        calls.append((v.name, least))
        return plan_variant(self, v, *args, least=least)

    def spy_solve(self: Any, g: Any, budget: Any, model: Any) -> Any:
        if budget == "min":
            mins.append(calls[-1][0])
        return solve(self, g, budget, model)

    monkeypatch.setattr(Planner, "_plan_variant", spy_variant)
    monkeypatch.setattr(Planner, "_solve", spy_solve)
    model, x, y = _mlp_case()
    ref_peaks, _, _ = _train(copy.deepcopy(model), x, y, "aot_eager", steps=1)
    b = compile_backend(int(0.85 * ref_peaks[-1]), compiler="eager", policies=("recompute", "compress"))
    _train(copy.deepcopy(model), x, y, b, steps=1)
    assert calls == [("", True), ("compress all", True), ("compress half", False)], calls
    assert "compress half" not in mins and "" in mins, mins        # the count without compression had no plan


def test_compression_is_not_planned_where_no_recompute_it_could_spare_pays_for_it() -> None:
    """Before the probe and a second plan: the least recompute time a compressed count still pays (its
    recomputes' bytes beyond those the codecs free, the cheapest per byte first), and whether any recompute
    costs more per byte than the fastest lossless codec."""
    from types import SimpleNamespace as NS

    from hybridmem.compile.variants import codecs_could_pay, recompute_left_s

    stages = [NS(seconds=1e-3), NS(seconds=4e-3)]                      # two producers
    tensors = {0: NS(nbytes=1000, producer=0), 1: NS(nbytes=1000, producer=1)}   # 1 us/B and 4 us/B
    first = NS(decisions=NS(recompute=[0, 1], swap=[]), jg=NS(graph=NS(stages=stages, tensors=tensors)))
    model = NS(op_time=lambda stage: stage.seconds)
    assert recompute_left_s(first, model, 0) == pytest.approx(5e-3)      # frees nothing: both recomputes stay
    # 500 B freed: 1500 B still recomputed, the cheapest per byte first (a bound): 1000 B at 1 us/B, 500 B at 4
    assert recompute_left_s(first, model, 500) == pytest.approx(1e-3 + 2e-3)
    assert recompute_left_s(first, model, 1000) == pytest.approx(1e-3)
    assert recompute_left_s(first, model, 5000) == 0.0
    assert codecs_could_pay(first, model, "cpu")                         # microseconds a byte: any codec is faster
    cheap = NS(decisions=NS(recompute=[0], swap=[]),
               jg=NS(graph=NS(stages=[NS(seconds=1e-12)], tensors={0: NS(nbytes=1 << 20, producer=0)})))
    assert not codecs_could_pay(cheap, model, "cpu")                    # a picosecond for a MiB: no codec is
    assert codecs_could_pay(NS(decisions=NS(recompute=[0], swap=[3]), jg=cheap.jg), model, "cpu")  # swaps: not judged
