"""A block compiled once and called in a loop (regional compilation: Dynamo compiles one graph for every
instance of the block) holds several runs' saved tensors until their backwards: ``calls_per_step`` plans
for them, and the backend notices and says when more runs were in flight than its plan holds."""
from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from torch import nn

from hybridmem.compile import compile_backend
from hybridmem.native import cpumeter
from tests.helpers import bit_equal
from tests.helpers.peaks import real_peak

pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator meter unavailable: {cpumeter.unavailable_reason()}")

BLOCKS = 4


class _Block(nn.Module):
    """A pre-norm MLP block with a residual, as in a transformer."""

    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(BLOCKS))
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _Net(), torch.randn(256, 128), torch.randint(0, 10, (256,))


def _train(base: nn.Module, x: torch.Tensor, y: torch.Tensor, backend: object,
           steps: int = 3) -> tuple[list[int], list[torch.Tensor], list[str]]:
    """Each block compiled on its own (one graph for all four); real peaks, last gradients, warnings."""
    torch._dynamo.reset()
    gc.collect()
    model = copy.deepcopy(base)
    for b in model.blocks:
        b.compile(backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    peaks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt.zero_grad()
            peaks.append(real_peak(lambda: nn.functional.cross_entropy(model(x), y).backward(), model, opt, [x]))
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
    return peaks, grads, [str(w.message) for w in caught if "hybridmem" in str(w.message)]


def test_calls_per_step_plans_for_the_runs_in_flight() -> None:
    base, x, y = _case()
    ref_peaks, ref_grads, _ = _train(base, x, y, "aot_eager")
    budget = int(0.9 * ref_peaks[-1])

    one = compile_backend(budget, compiler="eager")
    peaks, _, told = _train(base, x, y, one)
    (region,) = one.stats().regions
    assert region.runs_in_flight == BLOCKS and region.runs_planned == 1
    assert len(told) == 1 and f"calls_per_step={BLOCKS}" in told[0], told
    assert max(peaks) > budget            # a plan for one run: the other three runs' tensors do not fit
    assert f"{BLOCKS} runs were in flight" in str(one.stats())

    four = compile_backend(budget, compiler="eager", calls_per_step=BLOCKS)
    peaks, grads, told = _train(base, x, y, four)
    (region,) = four.stats().regions
    assert not told and region.runs_planned == BLOCKS and region.runs_in_flight == BLOCKS
    assert region.recomputed > 0, four.stats()
    assert all(p <= budget for p in peaks), (peaks, budget, str(four.stats()))
    assert all(bit_equal(a, b) for a, b in zip(grads, ref_grads))


def test_forwards_without_a_backward_are_not_in_flight() -> None:
    """A forward under grad mode whose output is dropped (an evaluation without no_grad) frees its graph:
    its run leaves the count then."""
    base, x, _ = _case()
    backend = compile_backend(1 << 40, compiler="eager")
    torch._dynamo.reset()
    block = copy.deepcopy(base.blocks[0])
    block.compile(backend=backend)
    for _ in range(3):
        block(x.requires_grad_(False)).sum()          # output dropped: no backward
    block(x).sum().backward()
    (region,) = backend.stats().regions
    assert region.runs_in_flight == 1


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4"])
def test_calls_per_step_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="calls_per_step .*expected an int >= 1"):
        compile_backend("1GiB", calls_per_step=bad)
