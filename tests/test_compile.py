"""torch.compile under hybridmem's backend: each compiled region's joint graph planned under the budget.

Every zoo model (small, batch 2) trains 3 SGD steps compiled by AOTAutograd's eager runner with hybridmem's
partition, beside the same model compiled unmanaged (``backend="aot_eager"``, PyTorch's own
partition): losses and gradients are bit-identical (a recompute replays the same kernels on the same
inputs; random ops are never recomputed, so dropout draws the same numbers), the plan recomputes
something, and the CPU allocator's real peak (``shared/tools/real_peak.py``) stays within the budget in
every step. Inductor is checked on a small torchvision-style network the zoo does not build; graph
breaks, the optimizer's state and bad arguments have their own tests.
"""
from __future__ import annotations

import copy
import gc
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem.compile import CompileStats, compile_backend
from hybridmem.errors import BudgetInfeasibleError, UnknownNameError
from hybridmem.native import cpumeter
from hybridmem.zoo import MODELS, build
from tests.helpers import bit_equal
from tests.helpers.models import BasicBlock
from tests.helpers.peaks import real_peak

pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator meter unavailable: {cpumeter.unavailable_reason()}")

STEPS = 3
# -m slow: ResNet-50's structure, deeper (80-90 s each on 2 cores); ResNet-50 and MobileNetV2 (30-45 s):
# their ops (convolutions, grouped ones the same aten op, batch norms, residual adds) are planned in the
# default run on vgg16, unet and the ResNet-18-like _BasicNet below
SLOW = ("resnet101", "resnet152", "resnet50", "mobilenet")


def _train(model: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable[[Any], torch.Tensor], backend: Any,
           *, steps: int = STEPS, optim: str = "sgd") -> tuple[list[int], list[list[torch.Tensor]], list[torch.Tensor]]:
    """Train ``steps`` steps of ``torch.compile(model, backend=backend)``; the real peak of each step,
    the gradients after each, the losses."""
    torch._dynamo.reset()
    gc.collect()  # garbage of earlier tests freed during a measured step would lower its peak
    compiled = torch.compile(model) if backend is None else torch.compile(model, backend=backend)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1) if optim == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-3))
    peaks, grads, losses = [], [], []
    torch.manual_seed(1234)
    for _ in range(steps):
        opt.zero_grad()
        box: list[torch.Tensor] = []

        def step() -> None:
            loss = loss_fn(compiled(*args, **kwargs))
            loss.backward()
            box.append(loss.detach())
        peaks.append(real_peak(step, model, opt, [*args, *kwargs.values()]))
        grads.append([p.grad.clone() for p in model.parameters()])
        losses.append(box[0])
        opt.step()
    return peaks, grads, losses


def _probe(model: nn.Module, args: tuple, kwargs: dict, loss_fn: Any) -> Any:
    """The region stats of a backend whose budget holds everything: the keep-all peak and the floor."""
    torch._dynamo.reset()
    b = compile_backend(1 << 40, compiler="eager")
    loss_fn(torch.compile(copy.deepcopy(model), backend=b)(*args, **kwargs)).backward()
    return b.stats()


def _same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(bit_equal(x, y) for ga, gb in zip(a, b) for x, y in zip(ga, gb))


def _assert_rounding_close(losses: list[torch.Tensor], grads: list[list[torch.Tensor]],
                           ref_losses: list[torch.Tensor], ref_grads: list[list[torch.Tensor]]) -> None:
    """Losses and gradients equal to rounding. Where Inductor recomputes inside a fused backward kernel its
    sums may run in another order, and which kernels it fuses depends on the plan (measured: bit-identical,
    or 4.7e-10 apart in a third step's gradients, CPU, 2026-12-02); another dropout mask would differ by
    about 0.1, as the knapsack's do."""
    for x, y in zip(losses, ref_losses):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    for ga, gb in zip(grads, ref_grads):
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in MODELS])
def test_zoo_model_trains_bit_identical_within_the_budget(name: str) -> None:
    e = build(name, "small", batch=2)
    args, kwargs = e.args_kwargs()
    base = copy.deepcopy(e.model)
    ref_peaks, ref_grads, ref_losses = _train(copy.deepcopy(base), args, kwargs, e.loss_fn, "aot_eager")
    probe = _probe(base, args, kwargs, e.loss_fn)
    (region,) = probe.regions
    # halfway between the least budget any plan fits and the unmanaged step's real peak
    budget = (region.min_budget_bytes + ref_peaks[-1]) // 2
    b = compile_backend(budget, compiler="eager")
    peaks, grads, losses = _train(copy.deepcopy(base), args, kwargs, e.loss_fn, b)
    st = b.stats()
    r = st.regions[0]
    assert r.recomputed > 0, st
    assert len(r.decisions) == r.recomputed + r.swapped + r.compressed       # one record per evicted tensor
    assert "recompute" in st.report()
    assert all(p <= budget for p in peaks), (peaks, budget, str(st))
    assert max(peaks) < ref_peaks[-1]
    assert _same(grads, ref_grads)
    assert all(bit_equal(x, y) for x, y in zip(losses, ref_losses))


class _BasicNet(nn.Module):
    """A small ResNet-18-like network from a config of stage widths."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 32), classes: int = 10, breaks: bool = False) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
            cin = w
        half = len(blocks) // 2
        self.front, self.back = nn.Sequential(*blocks[:half]), nn.Sequential(*blocks[half:])
        self.head = nn.Linear(cin, classes)
        self.breaks = breaks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.front(self.stem(x))
        if self.breaks:
            torch._dynamo.graph_break()       # two compiled regions
        return self.head(self.back(x).mean((2, 3)))


def _basic_case(breaks: bool = False) -> tuple[nn.Module, tuple, dict, Callable[[Any], torch.Tensor]]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _BasicNet(breaks=breaks)
        x = torch.randn(8, 3, 32, 32)
        y = torch.randint(0, 10, (8,))
    return model, (x,), {}, lambda out: nn.functional.cross_entropy(out, y)


# -m slow (40 s on 2 cores): the default run trains Inductor with the convolutions' margin on VGG-16 (the margin
# test) and ConvNets with BatchNorm (the dynamic-shape and replan tests), and enable(compile=True) on HF GPT-2
# (test_compile_lengths)
@pytest.mark.slow
def test_inductor_trains_a_network_the_zoo_does_not_build_within_the_budget() -> None:
    """Through ``enable(compile=True)``: ``torch.compile(model)`` names no backend and gets hybridmem's."""
    model, args, kwargs, loss_fn = _basic_case()
    ref_peaks, ref_grads, _ = _train(copy.deepcopy(model), args, kwargs, loss_fn, "inductor")
    budget = int(0.8 * ref_peaks[-1])
    original = torch.compile
    with hybridmem.session(budget=budget, compile=True) as s:
        assert torch.compile is not original
        peaks, grads, _ = _train(copy.deepcopy(model), args, kwargs, loss_fn, None)
        st = s.stats()
        assert hybridmem.stats().regions == st.regions
    assert torch.compile is original
    assert isinstance(st, CompileStats) and st.budget_bytes == budget
    assert st.regions[0].recomputed > 0 and st.regions[0].margin_bytes > 0, st
    assert all(p <= budget for p in peaks), (peaks, budget, str(st))
    # Inductor recomputes inside its fused kernels: the same values here, checked to rounding in general
    for ga, gb in zip(grads, ref_grads):
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def _vgg_like(cfg: tuple[Any, ...] = (16, 16, "M", 32, 32, "M", 64, 64, "M"), image: int = 64,
              batch: int = 8) -> tuple[nn.Module, tuple, dict, Callable[[Any], torch.Tensor]]:
    """A VGG-style stack from torchvision's config notation (channels, ``"M"`` a max-pool), no BatchNorm."""
    layers: list[nn.Module] = []
    cin = 3
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(cin, int(v), 3, padding=1), nn.ReLU()]
            cin = int(v)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(cin * (image // 8) ** 2, 10))
        x = torch.randn(batch, 3, image, image)
        y = torch.randint(0, 10, (batch,))
    return model, (x,), {}, lambda out: nn.functional.cross_entropy(out, y)


def test_inductor_convolutions_are_counted_in_the_layout_inductor_runs_them() -> None:
    """On the CPU Inductor runs convolutions channels-last, where oneDNN needs almost no scratch; measured
    contiguous (oneDNN's reorders of the inputs), this VGG-style stack's keep-all count was 22 % above the
    unmanaged step's real peak (CPU, 2026-12-03). Measured channels-last it is within 3 % above it and no
    more than the margin below it."""
    from hybridmem.compile.tuning import INDUCTOR_MARGIN

    model, args, kwargs, loss_fn = _vgg_like()
    ref_peaks, _, _ = _train(copy.deepcopy(model), args, kwargs, loss_fn, "inductor", steps=2)
    b = compile_backend(1 << 40)
    _train(copy.deepcopy(model), args, kwargs, loss_fn, b, steps=1)
    (region,) = b.stats().regions
    count, real = region.keep_all_peak_bytes, ref_peaks[-1]
    assert count <= 1.03 * real, (count, real)
    assert real <= count * (1 + INDUCTOR_MARGIN), (count, real)


def test_concatenated_feature_maps_get_the_wider_margin() -> None:
    """U-Net's skips: Inductor's layout optimization held 14 % of the keep-all count beyond the plan's count
    there, above the 11 % kept around other convolutions; a region that concatenates feature maps keeps the
    wider margin."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hybridmem.compile.tuning import INDUCTOR_MARGIN, INDUCTOR_MARGIN_CONCAT
    from hybridmem.compile.joint import concatenates_feature_maps

    a, b, w = torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8), torch.randn(3, 4, 3, 3)
    skips = make_fx(lambda a, b, w: nn.functional.conv2d(torch.cat([a, b], 1), w))(a, b, w)
    stacked = make_fx(lambda a, b, w: nn.functional.conv2d(torch.cat([a, b], 1).relu(), w))(a, b, w)
    plain = make_fx(lambda a, b, w: nn.functional.conv2d(a.repeat(1, 2, 1, 1), w))(a, b, w)
    flat = make_fx(lambda a, b: torch.cat([a.flatten(1), b.flatten(1)], 1))(a, b)
    assert concatenates_feature_maps(skips.graph.nodes)
    assert concatenates_feature_maps(stacked.graph.nodes)      # a DenseNet's BatchNorm and ReLU between
    assert not concatenates_feature_maps(plain.graph.nodes)
    assert not concatenates_feature_maps(flat.graph.nodes)
    assert INDUCTOR_MARGIN_CONCAT > INDUCTOR_MARGIN


def _dynamic_case() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10))


def _dynamic_step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).square().mean()


def test_a_region_compiled_for_dynamic_shapes_is_planned_at_its_largest_size() -> None:
    """A smaller batch (a DataLoader's last) makes Dynamo compile the region again, for any batch size,
    and the full batches after it run that compile. It is planned at the largest size the region was
    compiled for (32, not the 20 of the call that compiled it: planned at 20, these steps of 32 held 1.16
    of their budget, CPU, 2026-12-03), without specializing the graph to a size (planning read sizes
    with int() once: the region was then fixed to that size, and Inductor failed on its backward, torch
    2.13: "Cannot convert expression to float"), and measured at 32 when it compiles. Steps match
    PyTorch's compiled ones within the budget; a call larger than the plan's sizes fails the region's guard
    and Dynamo compiles it again, planned at that size."""
    # which sizes a compile for any size serves is bounded by guards Inductor adds while it generates code:
    # 16 <= batch <= 4096 where it compiled at 20 (5 <= batch <= 15 at 8, where a batch of 16 runs its own
    # compile)
    batches = [32, 20, 32, 32]
    xs = [torch.randn(b, 3, 32, 32, generator=torch.Generator().manual_seed(k)) for k, b in enumerate(batches)]
    ref_model = _dynamic_case()
    torch._dynamo.reset()
    ref = torch.compile(_dynamic_step)
    ref_grads = []
    for x in xs:
        ref_model.zero_grad(set_to_none=True)
        ref(ref_model, x).backward()
        ref_grads.append([p.grad.clone() for p in ref_model.parameters()])

    model = _dynamic_case()
    budget = 12_000_000      # batch 32's keep-all count is 12.9 MiB: its plan recomputes
    backend = compile_backend(budget)
    compiles: list[int] = []
    inner = backend._compile
    backend._compile = lambda gm, ex: (compiles.append(1), inner(gm, ex))[1]   # type: ignore[method-assign]
    torch._dynamo.reset()
    gc.collect()
    step = torch.compile(_dynamic_step, backend=backend)
    peaks, grads = [], []
    for x in xs:
        model.zero_grad(set_to_none=True)
        peaks.append(real_peak(lambda: step(model, x).backward(), model, None, [x]))
        grads.append([p.grad.clone() for p in model.parameters()])
    assert len(compiles) == 2, "batch 32, then batch 20 for any size, which the batches of 32 after it run"
    (region,) = backend.stats().regions
    assert region.recomputed > 0, backend.stats()
    assert list(region.planned_sizes.values()) == [32] and list(region.compiled_sizes.values()) == [20]
    assert region.size_replans == 0 and region.trial_peak_bytes is not None, backend.stats()
    assert max(peaks) <= budget, (peaks, backend.stats())
    _assert_rounding_close([], grads, [], ref_grads)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="hybridmem", category=RuntimeWarning)   # none from hybridmem
        model.zero_grad(set_to_none=True)
        x = torch.randn(33, 3, 32, 32)
        peak = real_peak(lambda: step(model, x).backward(), model, None, [x])
    assert len(compiles) == 3, "33 is above the plan's 32: compiled again"
    (region,) = backend.stats().regions
    assert list(region.planned_sizes.values()) == [33] and region.size_replans == 1, backend.stats()
    assert peak <= budget, (peak, backend.stats())


def test_a_compiled_step_that_holds_more_than_its_share_is_planned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's kernels hold more than the op-by-op count (on this ConvNet it computes a recomputed
    BatchNorm-ReLU inside the next BatchNorm's backward kernel). With no margin for that, the plans that
    fit the count exceed the budget when run; the backend runs each compiled region once when it compiles
    and plans it again until its real peak fits. The trial leaves the model's buffers, the random stream
    and the gradients as they were."""
    from hybridmem.compile import tuning

    monkeypatch.setattr(tuning, "INDUCTOR_MARGIN", 0.0)
    budget = 11 << 20      # keep-all: 12.9 MiB counted, 13.3 MiB real; recomputing 4 MiB: 8.9 counted, 10.8 real
    x = torch.randn(32, 3, 32, 32, generator=torch.Generator().manual_seed(0))

    def train(backend: Any) -> tuple[list[int], list[list[torch.Tensor]], nn.Module, torch.Tensor]:
        model = _dynamic_case()
        torch._dynamo.reset()
        gc.collect()
        step = torch.compile(_dynamic_step, backend=backend, dynamic=False)
        peaks, grads = [], []
        torch.manual_seed(7)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            peaks.append(real_peak(lambda: step(model, x).backward(), model, None, [x]))
            grads.append([p.grad.clone() for p in model.parameters()])
        return peaks, grads, model, torch.rand(4)

    ref_peaks, ref_grads, ref_model, ref_draw = train("inductor")
    unchecked = compile_backend(budget, verify=False)
    peaks, _, _, _ = train(unchecked)
    assert max(peaks) > budget, (peaks, str(unchecked.stats()))       # the count alone does not hold it
    backend = compile_backend(budget)
    peaks, grads, model, draw = train(backend)
    (region,) = backend.stats().regions
    assert region.replans >= 1 and region.trial_peak_bytes is not None, str(backend.stats())
    assert region.trial_peak_bytes <= region.budget_bytes
    assert max(peaks) <= budget, (peaks, str(backend.stats()))
    assert "planned" in str(backend.stats()) and "times" in str(backend.stats())
    _assert_rounding_close([], grads, [], ref_grads)
    assert bit_equal(draw, ref_draw)        # the trial drew from a copy of the random stream
    for a, b in zip(model.buffers(), ref_model.buffers()):    # one update per step: none from the trial
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_budget_inside_the_margin_is_planned_with_less_and_checked_by_the_run(one_thread) -> None:
    """Where no plan fits with the share left for Inductor's buffers (a guess: 11 % of the keep-all count
    beside convolutions) but one fits with less, the region is planned with what the budget leaves and its
    run at compile time checks it (VGG-16 small at PyTorch's knapsack's 0.5 peak: 0.7 % under the least
    budget with the margin; its step then peaked at 0.907 of the budget, CPU, one thread, 2026-12-04; with
    two threads its run held 17.81 MiB of a 16.89 MiB share and the compile failed naming 17.81 MiB).
    Without the run (``verify=False``) the margin stands and the compile fails as before."""
    e = build("vgg16", "small")
    args, kwargs = e.args_kwargs()
    least = _least_budget(e.model, args, kwargs, e.loss_fn).minimum_bytes   # every activation off (VGG-16: a
    assert least is not None                                                # plan fits there)
    budget = least - (100 << 10)
    assert _least_budget(e.model, args, kwargs, e.loss_fn, budget, verify=False).minimum_bytes == least
    torch._dynamo.reset()
    gc.collect()
    backend = compile_backend(budget)
    peaks, grads, losses = _train(copy.deepcopy(e.model), args, kwargs, e.loss_fn, backend, steps=2)
    (region,) = backend.stats().regions
    assert "less left for Inductor's buffers than the margin" in region.note, str(backend.stats())
    assert region.trial_peak_bytes is not None and region.trial_peak_bytes <= region.budget_bytes
    assert all(p <= budget for p in peaks), (peaks, budget, str(backend.stats()))
    import torch._inductor.config as iconfig
    with iconfig.patch(layout_optimization=False):   # Inductor's VGG-16 step returns all-zero convolution
        ref_peaks, ref_grads, ref_losses = _train(    # gradients with it (docs/benchmarks.md)
            copy.deepcopy(e.model), args, kwargs, e.loss_fn, "inductor", steps=2)
    _assert_rounding_close(losses, grads, ref_losses, ref_grads)


class _TokenMLP(nn.Module):
    """A token-MLP language model whose forward returns the logits and the loss (a log-softmax over the
    vocabulary inside the compiled graph, which PyTorch's partition recomputes from the logits)."""

    def __init__(self, vocab: int = 1024, dim: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                                  nn.Linear(4 * dim, dim)) for _ in range(depth))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.emb(ids)
        for b in self.blocks:
            x = x + b(x)
        logits = self.head(x)
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_inductor_counts_the_partition_pytorch_makes() -> None:
    """Where the op-by-op count has no plan, the partition that runs is counted: what PyTorch's partition
    recomputes in the backward on its own (the log-softmax, from the logits) is not held from the
    forward, and a plan is judged by the partition its tags get. The op-by-op count's keep-all peak is
    30 % above the unmanaged step's real peak and has no plan at 90 % of it (CPU, 2026-12-02); the
    partition's count is that peak within 1 % (the budget that holds it gets PyTorch's own partition), and
    at 88 % of it the step trains within the budget, as predicted within 5 %."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _TokenMLP()
        args = (torch.randint(0, 1024, (8, 32)), torch.randint(0, 1024, (8, 32)))
    loss_fn: Callable[[Any], torch.Tensor] = lambda out: out[1]
    ref_peaks, ref_grads, _ = _train(copy.deepcopy(model), args, {}, loss_fn, "inductor")
    roomy = compile_backend(2 * ref_peaks[-1])
    _train(copy.deepcopy(model), args, {}, loss_fn, roomy, steps=1)
    assert abs(roomy.stats().regions[0].keep_all_peak_bytes / ref_peaks[-1] - 1) < 0.01, (ref_peaks, roomy.stats())
    budget = int(0.88 * ref_peaks[-1])
    b = compile_backend(budget)
    peaks, grads, _ = _train(copy.deepcopy(model), args, {}, loss_fn, b)
    (region,) = b.stats().regions
    assert region.recomputed > 0, b.stats()
    assert all(p <= budget for p in peaks), (peaks, budget, str(b.stats()))
    assert abs(region.predicted_peak_bytes / peaks[-1] - 1) < 0.05, (peaks, str(b.stats()))
    for ga, gb in zip(grads, ref_grads):
        for x, y in zip(ga, gb):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def _least_budget(model: nn.Module, args: tuple, kwargs: dict, loss_fn: Any, budget: int = 1,
                  **options: Any) -> BudgetInfeasibleError:
    """The error a budget no plan fits raises (1 byte by default): it names the least budget with every
    evictable activation off the device (``minimum_bytes``); the partition fails before Inductor
    generates any kernel."""
    torch._dynamo.reset()
    b = compile_backend(budget, **options)
    with pytest.raises(Exception) as info:
        loss_fn(torch.compile(copy.deepcopy(model), backend=b)(*args, **kwargs)).backward()
    err = info.value
    while err is not None and not isinstance(err, BudgetInfeasibleError):
        err = err.__cause__ or getattr(err, "inner_exception", None)
    assert isinstance(err, BudgetInfeasibleError), info.value
    return err


@pytest.mark.slow   # three Inductor compiles of the GPT (small, batch 8): 2-5 minutes on 2 shared cores
def test_inductor_trains_the_gpt_at_the_knapsacks_peak() -> None:
    """The GPT under Inductor at the real peak PyTorch's own knapsack reaches with
    ``activation_memory_budget=0.5`` (0.658 of the unmanaged compiled step's). The least budget with a plan
    was 0.99 of the unmanaged peak with the op-by-op count, 0.80 with the backward's pointwise values
    inlined as Inductor inlines them, 0.695 with the loop's dropped outputs not counted, and is below 0.658
    now that a dropout mask is computed from its seed (which stays for the step) and an attention's scores
    and softmax fold into the masked probabilities they make (CPU, 2026-12-02). Every step's real peak
    stays within the budget; a recomputed dropout mask is the forward's own (Inductor's
    ``inductor_random`` of the saved seed)."""
    import torch._inductor.config as iconfig
    from torch._functorch import config as fconfig

    e = build("gpt", "small")
    args, kwargs = e.args_kwargs()
    with iconfig.patch(fx_graph_cache=False), fconfig.patch(enable_autograd_cache=False):
        ref_peaks, ref_grads, ref_losses = _train(copy.deepcopy(e.model), args, kwargs, e.loss_fn, "inductor")
        with fconfig.patch(activation_memory_budget=0.5):
            knapsack, _, _ = _train(copy.deepcopy(e.model), args, kwargs, e.loss_fn, "inductor", steps=1)
        budget = knapsack[0]
        b = compile_backend(budget, hold_outputs=False)       # _train drops the logits before the backward
        peaks, grads, losses = _train(copy.deepcopy(e.model), args, kwargs, e.loss_fn, b)
    st = b.stats()
    (region,) = st.regions
    assert budget < 0.7 * ref_peaks[-1], (budget, ref_peaks)
    assert region.recomputed > 0, st
    assert region.margin_bytes == int(0.02 * region.keep_all_peak_bytes), st     # no convolution
    assert all(p <= budget for p in peaks), (peaks, budget, str(st))
    _assert_rounding_close(losses, grads, ref_losses, ref_grads)


class _GPT2Block(nn.Module):
    """A GPT-2 block as Hugging Face writes it: one fused q/k/v projection, a causal ``bias`` buffer applied with
    ``torch.where`` and the dtype's minimum, softmax, attention and residual dropout, a ``gelu_new`` MLP."""

    def __init__(self, d: int, heads: int, positions: int, p: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.attn_dropout, self.resid_dropout = nn.Dropout(p), nn.Dropout(p)
        self.register_buffer("bias", torch.tril(torch.ones(positions, positions, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        w = torch.matmul(q, k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        w = torch.where(self.bias[:t, :t], w, torch.finfo(w.dtype).min)
        a = torch.matmul(self.attn_dropout(torch.softmax(w, dim=-1)), v)
        x = x + self.resid_dropout(self.c_proj(a.transpose(1, 2).reshape(b, t, d)))
        h = self.c_fc(self.ln_2(x))
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * h.pow(3))))
        return x + self.resid_dropout(self.mlp_proj(h))


class _TinyGPT2(nn.Module):
    """A GPT-2-style language model from a config (vocabulary, positions, width, heads, layers, dropout),
    tied input and output embeddings, the loss of the next token."""

    def __init__(self, vocab: int = 512, positions: int = 32, d: int = 64, heads: int = 4, layers: int = 2,
                 p: float = 0.1) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.drop = nn.Dropout(p)
        self.h = nn.ModuleList(_GPT2Block(d, heads, positions, p) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device)))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def test_inductor_trains_a_gpt2_near_the_knapsacks_peak_recomputing_dropout_masks() -> None:
    """A GPT-2-style model the zoo does not build, under Inductor, at 0.69 of the unmanaged compiled step's
    real peak, about where PyTorch's own knapsack (``activation_memory_budget=0.5``) reaches on it (0.687,
    CPU, 2026-12-07; the knapsack's own compile is run against the zoo's GPT in the slow
    ``test_inductor_trains_the_gpt_at_the_knapsacks_peak``). A dropout mask is Inductor's random numbers of a
    seed the forward draws: the graph computes it from the seeds, which stay for the step, so a plan
    recomputes it, and the recomputed mask is the forward's own. Each step stays within the budget; losses and
    gradients equal the unmanaged compiled step's to rounding (:func:`_assert_rounding_close`)."""
    import torch._inductor.config as iconfig
    from torch._functorch import config as fconfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _TinyGPT2(vocab=1024, positions=64, d=96, heads=4, layers=3)
        args = (torch.randint(0, 1024, (8, 64)),)
    loss_fn: Callable[[Any], torch.Tensor] = lambda loss: loss
    with iconfig.patch(fx_graph_cache=False), fconfig.patch(enable_autograd_cache=False):
        ref_peaks, ref_grads, ref_losses = _train(copy.deepcopy(model), args, {}, loss_fn, "inductor")
        budget = int(0.69 * ref_peaks[-1])
        b = compile_backend(budget)
        peaks, grads, losses = _train(copy.deepcopy(model), args, {}, loss_fn, b)
    st = b.stats()
    (region,) = st.regions
    ops = [d["op"] for d in region.decisions if d["policy"] == "recompute"]
    assert any("inductor_random" in op for op in ops), st.report(50)
    assert all(p <= budget for p in peaks), (peaks, budget, str(st))
    _assert_rounding_close(losses, grads, ref_losses, ref_grads)


def test_a_loop_that_drops_the_outputs_gives_the_plan_their_bytes() -> None:
    """The token-MLP returns its logits (1 MiB) beside the loss. Held to the step's end (the default), they
    put its least budget above 80 % of the unmanaged step's real peak; with ``hold_outputs=False`` they
    count until the forward ends, the keep-all count is that real peak within a few bytes (7,159,040
    against 7,159,048 B, CPU, 2026-12-02), and a loop that drops them trains within 80 % of it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _TokenMLP()
        args = (torch.randint(0, 1024, (8, 32)), torch.randint(0, 1024, (8, 32)))
    loss_fn: Callable[[Any], torch.Tensor] = lambda out: out[1]     # the logits are dropped before backward
    ref_peaks, ref_grads, _ = _train(copy.deepcopy(model), args, {}, loss_fn, "aot_eager")
    logits = 8 * 32 * 1024 * 4
    held = _least_budget(model, args, {}, loss_fn, compiler="eager").minimum_bytes
    dropped = _least_budget(model, args, {}, loss_fn, compiler="eager", hold_outputs=False).minimum_bytes
    assert held - dropped == logits + 4          # and the loss's 4 bytes
    budget = int(0.8 * ref_peaks[-1])
    assert dropped < budget < held
    _least_budget(model, args, {}, loss_fn, budget, compiler="eager")       # held: no plan
    b = compile_backend(budget, compiler="eager", hold_outputs=False)
    peaks, grads, _ = _train(copy.deepcopy(model), args, {}, loss_fn, b)
    (region,) = b.stats().regions
    assert region.recomputed > 0, b.stats()
    assert all(p <= budget for p in peaks), (peaks, budget, str(b.stats()))
    assert _same(grads, ref_grads)
    with pytest.raises(ValueError, match="hold_outputs 'no': expected True"):
        compile_backend(budget, hold_outputs="no")


def test_compile_mode_settings() -> None:
    from hybridmem.config import Config
    assert Config.resolve(env={"HYBRIDMEM_BUDGET": "1GiB", "HYBRIDMEM_COMPILE": "1"}).compile is True
    with pytest.raises(ValueError, match="HYBRIDMEM_COMPILE='maybe': compile must be true or false"):
        Config.resolve(env={"HYBRIDMEM_COMPILE": "maybe"})
    with pytest.raises(ValueError, match="compile needs a budget"):
        hybridmem.enable(compile=True)
    hybridmem.enable(budget="1GiB", policies=("recompute", "compress"), compile=True)
    try:
        assert torch.compile.__hybridmem_original__ is not None      # type: ignore[attr-defined]
        assert hybridmem.stats().regions == []
    finally:
        hybridmem.disable()
    assert not hybridmem.enabled()


def test_deterministic_mode_times_the_reloads_by_the_cost_model() -> None:
    """torch.use_deterministic_algorithms sets Inductor's deterministic mode, which forbids PyTorch's offloading
    pass to time the backward's nodes on the device (it raised on an H200): the cost model times them."""
    from torch._functorch._activation_offloading import activation_offloading as ao
    from torch.fx.experimental.proxy_tensor import make_fx

    from hybridmem.compile.copies import reload_timing as _reload_timing
    from hybridmem.graph.costs import get_cost_model

    gm = make_fx(lambda a, b: torch.relu(a @ b), tracing_mode="fake")(torch.randn(256, 128), torch.randn(128, 64))
    mm = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default)
    model = get_cost_model("h100")
    timed = ao.benchmark_node
    with _reload_timing(model) as note:          # not deterministic: PyTorch's own timing stays
        assert note is None and ao.benchmark_node is timed
    with torch._inductor.config.patch(deterministic=True), _reload_timing(model) as note:
        assert "deterministic" in note and ao.benchmark_node is not timed
        flops, nbytes = 2 * 256 * 128 * 64, 4 * (256 * 128 + 128 * 64 + 256 * 64)
        want = max(flops / (model.peak("float32") * model.efficiency),
                   nbytes / (model.hbm_bw * model.hbm_efficiency)) + model.launch_s
        assert ao.benchmark_node(mm) == pytest.approx(want * 1e3)
    assert ao.benchmark_node is timed


def test_stream_ops_that_do_not_trace_are_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's streams::record_stream traced with another op's fake implementation (a TypeError inside
    Inductor): the backend's swaps then copy by hybridmem's offload ops (tests/test_compile_offload.py) instead
    of failing the compile."""
    import types

    import torch._dynamo.variables.streams  # noqa: F401

    from hybridmem.compile import copies as backend

    backend.stream_ops_work.cache_clear()
    try:
        assert backend.stream_ops_work()             # this torch's op traces

        def broken(wait_event_index: int, src_stream_index: int, to_dealloc: torch.Tensor) -> None:
            return None
        monkeypatch.setattr(torch.ops.streams, "record_stream", types.SimpleNamespace(default=broken))
        backend.stream_ops_work.cache_clear()
        assert not backend.stream_ops_work()
    finally:
        monkeypatch.undo()
        backend.stream_ops_work.cache_clear()


def test_graph_breaks_share_the_budget() -> None:
    model, args, kwargs, loss_fn = _basic_case(breaks=True)
    ref_peaks, ref_grads, _ = _train(copy.deepcopy(model), args, kwargs, loss_fn, "aot_eager")
    # the least budget the second region can take while the first keeps everything it saves
    least = _probe(model, args, kwargs, loss_fn).regions[1].min_budget_bytes
    budget = max(int(0.7 * ref_peaks[-1]), int(1.02 * least))
    assert budget < ref_peaks[-1]
    b = compile_backend(budget, compiler="eager")
    peaks, grads, _ = _train(copy.deepcopy(model), args, kwargs, loss_fn, b)
    st = b.stats()
    assert len(st.regions) == 2, str(st)
    assert sum(r.recomputed for r in st.regions) > 0, str(st)
    first, second = st.regions
    # the second region plans for what the first keeps through its backward: a smaller share
    assert second.budget_bytes < budget and first.budget_bytes == budget
    assert all(p <= budget for p in peaks), (peaks, budget, str(st))
    assert _same(grads, ref_grads)
    assert "2 region(s)" in str(st)


def test_the_optimizer_state_counts_against_the_budget() -> None:
    model, args, kwargs, loss_fn = _basic_case()
    ref_peaks, ref_grads, _ = _train(copy.deepcopy(model), args, kwargs, loss_fn, "aot_eager", optim="adam")
    budget = int(0.85 * ref_peaks[-1])
    managed = copy.deepcopy(model)
    opt = torch.optim.Adam(managed.parameters(), lr=1e-3)
    b = compile_backend(budget, compiler="eager", optimizer=opt)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    state = b.stats().outside_bytes                 # Adam's two moments and a step counter per parameter
    assert state == 2 * param_bytes + 4 * len(list(model.parameters()))
    peaks, grads, _ = _train(managed, args, kwargs, loss_fn, b, optim="adam")
    assert b.stats().regions[0].budget_bytes == budget - state
    assert all(p <= budget for p in peaks), (peaks, budget, str(b.stats()))
    assert _same(grads, ref_grads)


def test_a_budget_below_the_floor_names_the_least_budget_that_compiles() -> None:
    """Far below what any plan needs, the error names the least budget a plan exists for (not the floor, a
    bound no plan reaches; 1 % less has no plan). Where the step's run at compile time holds more than that
    plan counted (here 5 KB: the run is stopped at the share), that run's error names a budget it held, and
    that one trains within itself: two tries, where the floor took three (the floor, the least plan, the
    run's)."""
    model, args, kwargs, loss_fn = _basic_case()
    floor = _probe(model, args, kwargs, loss_fn).regions[0].min_budget_bytes
    err = _least_budget(model, args, kwargs, loss_fn, floor // 2, compiler="eager")
    named = err.minimum_bytes
    assert named is not None and named > floor
    assert "the least budget it has a plan for is" in str(err) and str(named) in str(err)
    _least_budget(model, args, kwargs, loss_fn, int(0.99 * named), compiler="eager")
    ref_peaks, ref_grads, _ = _train(copy.deepcopy(model), args, kwargs, loss_fn, "aot_eager")
    try:
        b = compile_backend(named, compiler="eager")
        peaks, grads, _ = _train(copy.deepcopy(model), args, kwargs, loss_fn, b)
    except Exception as e:  # noqa: BLE001  (torch.compile wraps the backend's error)
        ran: Any = e
        while ran is not None and not isinstance(ran, BudgetInfeasibleError):
            ran = ran.__cause__ or getattr(ran, "inner_exception", None)
        assert ran is not None and "run once when it compiled" in str(ran), e
        assert named < ran.minimum_bytes < 1.02 * named, str(ran)
        named = ran.minimum_bytes
        b = compile_backend(named, compiler="eager")
        peaks, grads, _ = _train(copy.deepcopy(model), args, kwargs, loss_fn, b)
    assert all(p <= named for p in peaks), (peaks, named, str(b.stats()))
    assert _same(grads, ref_grads)


def test_nothing_to_evict_keeps_pytorchs_partition() -> None:
    model, args, kwargs, loss_fn = _basic_case()
    ref_peaks, ref_grads, _ = _train(copy.deepcopy(model), args, kwargs, loss_fn, "aot_eager", steps=1)
    b = compile_backend(4 * ref_peaks[-1], compiler="eager")
    peaks, grads, _ = _train(copy.deepcopy(model), args, kwargs, loss_fn, b, steps=1)
    (region,) = b.stats().regions
    assert region.recomputed == 0 and "keep-all" in region.note
    assert abs(peaks[0] - ref_peaks[0]) <= 0.01 * ref_peaks[0] and _same(grads, ref_grads)


@pytest.mark.parametrize("kwargs, match", [
    ({"budget": None}, "budget: expected bytes"),
    ({"budget": "lots"}, "budget"),
    ({"budget": "60%", "device": "cpu"}, "percentage needs a CUDA device"),
    ({"budget": "1GiB", "policies": ("teleport",)}, "unknown policy 'teleport'"),
    ({"budget": "1GiB", "policies": ()}, "at least one of"),
    ({"budget": "1GiB", "solver": "magic"}, "unknown solver 'magic'"),
    ({"budget": "1GiB", "compiler": "tvm"}, "unknown compiler 'tvm'"),
    ({"budget": "1GiB", "time_limit": -1}, "time_limit -1"),
    ({"budget": "1GiB", "device": "tpu"}, "expected 'cpu', 'cuda' or 'cuda:N'"),
    ({"budget": "1GiB", "device": "mps"}, "not supported"),
    ({"budget": "1GiB", "cost_model": "abacus"}, "unknown device model 'abacus'"),
    ({"budget": "1GiB", "optimizer": "adam"}, "expected a torch.optim.Optimizer"),
    ({"budget": 0}, r"invalid budget 0 \(not positive\): expected a positive int of bytes"),
    ({"budget": -1}, r"invalid budget -1 \(not a size\): expected a positive int"),
    ({"budget": 3.5}, "invalid budget 3.5 \\(a float\\)"),
    ({"budget": "150%"}, r"a percentage must be in \(0, 100\]"),
    ({"budget": "1GiB", "bugdet_mode": 1}, "unknown option\\(s\\) 'bugdet_mode'; accepted: calls_per_step, compiler"),
])
def test_bad_arguments_say_what_is_accepted(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError, UnknownNameError), match=match):
        compile_backend(**kwargs)


def test_the_backend_is_public_api() -> None:
    import inspect

    from hybridmem.compile.backend import _OPTIONS, CompileBackend
    from hybridmem.errors import BudgetInfeasibleError as Infeasible

    assert hybridmem.compile_backend is compile_backend
    assert hybridmem.BudgetInfeasibleError is Infeasible
    # every keyword CompileBackend takes beyond compile_backend's own is an option it passes on, and no other
    own = {"self", "budget", "device", "policies", "solver"}
    assert _OPTIONS == set(inspect.signature(CompileBackend.__init__).parameters) - own


@pytest.mark.skipif(torch.cuda.is_available(), reason="a percentage is a budget where CUDA is")
def test_a_percentage_without_cuda_fails_when_the_backend_is_made() -> None:
    with pytest.raises(ValueError, match="a percentage needs a CUDA device .*none is available here"):
        compile_backend("60%")
    assert "'none'" not in str(pytest.raises(ValueError, compile_backend, "lots").value)


def test_hybridmem_run_compile_routes_torch_compile(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    from hybridmem.cli import main
    for var in ("HYBRIDMEM_BUDGET", "HYBRIDMEM_COMPILE", "HYBRIDMEM_POLICIES", "HYBRIDMEM_CONFIG", "HYBRIDMEM_PLAN"):
        monkeypatch.setenv(var, "")        # restored after the test: the run writes them
    script = tmp_path / "script.py"
    script.write_text("import torch\n"
                      "backend = torch.compile.__hybridmem_original__ and torch.compile.__wrapped__\n"
                      "print('compile routed')\n")
    original = torch.compile
    try:
        assert main(["run", "--compile", "--budget", "64MiB", str(script)]) == 0
        out, err = capsys.readouterr()
        assert "compile routed" in out
        assert "budget 64.00 MiB, 0 region(s)" in err and "did the script call torch.compile?" in err
    finally:
        hybridmem.disable()
    assert torch.compile is original
