"""The runtime never touches the program's random stream: every random factory and in-place random op,
drawn inside and outside the step, gives what it gives unmanaged; a random-heavy training loop (noise,
random flips, dropout, randperm shuffles) is bit-identical under a budget with each policy."""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem.runtime import estimate
from tests.helpers.runtime import Case, check_managed, raw

torch.set_num_threads(1)

Tensor = torch.Tensor

# Every random factory and in-place random op of torch, each as f(x) -> tensor (x: a 32x64 activation).
# Integer draws are turned into float noise so they reach the loss.
RANDOM_OPS: dict[str, Callable[[Tensor], Tensor]] = {
    "rand": lambda x: x + torch.rand(32, 64),
    "randn": lambda x: x + torch.randn(32, 64),
    "randint": lambda x: x + torch.randint(0, 5, (32, 64)),
    "randint_low": lambda x: x + torch.randint(3, (32, 64), dtype=torch.float32),
    "randperm": lambda x: x[torch.randperm(32)],
    "rand_like": lambda x: x + torch.rand_like(x),
    "randn_like": lambda x: x + torch.randn_like(x),
    "randint_like": lambda x: x + torch.randint_like(x, 7),
    "normal": lambda x: x + torch.normal(0.0, 1.0, (32, 64)),
    "normal_tensor": lambda x: torch.normal(x, 0.5),
    "bernoulli": lambda x: x * torch.bernoulli(torch.full_like(x, 0.3).detach()),
    "bernoulli_p": lambda x: x * torch.bernoulli(x.detach().sigmoid()),
    "multinomial": lambda x: x[:, torch.multinomial(torch.ones(64), 64, replacement=True)],
    "poisson": lambda x: x + torch.poisson(torch.full((32, 64), 2.0)),
    "empty_uniform_": lambda x: x + torch.empty(32, 64).uniform_(-1, 1),
    "normal_": lambda x: x + torch.empty(32, 64).normal_(),
    "bernoulli_": lambda x: x * torch.empty(32, 64).bernoulli_(0.5),
    "random_": lambda x: x + torch.empty(32, 64).random_(0, 4),
    "exponential_": lambda x: x + torch.empty(32, 64).exponential_(),
    "geometric_": lambda x: x + torch.empty(32, 64).geometric_(0.3),
    "log_normal_": lambda x: x + torch.empty(32, 64).log_normal_(),
    "cauchy_": lambda x: x + torch.empty(32, 64).cauchy_().clamp(-5, 5),
    "dropout": lambda x: nn.functional.dropout(x, 0.3),
    "alpha_dropout": lambda x: nn.functional.alpha_dropout(x, 0.3, training=True),
    "feature_alpha_dropout": lambda x: nn.functional.feature_alpha_dropout(x.view(32, 8, 8), 0.3, True).view(32, 64),
    "dropout1d": lambda x: nn.functional.dropout1d(x.view(32, 8, 8), 0.3).view(32, 64),
    "rrelu": lambda x: nn.functional.rrelu(x, training=True),
    "gumbel_softmax": lambda x: nn.functional.gumbel_softmax(x, tau=0.5),
    "generator": lambda x: x + torch.randn(32, 64, generator=_GEN),
    "rand_generator_double": lambda x: x + torch.rand(32, 64, generator=_GEN, dtype=torch.float64).float(),
    "binomial": lambda x: x + torch.binomial(torch.full((32, 64), 5.0), torch.full((32, 64), 0.3)),
    "gamma_rsample": lambda x: x * torch.distributions.Gamma(torch.full((32, 64), 2.0), 1.0).rsample(),
    "dirichlet": lambda x: x * torch.distributions.Dirichlet(torch.ones(32, 64)).sample(),
    "trunc_normal_": lambda x: x + nn.init.trunc_normal_(torch.empty(32, 64)),
    "kaiming_uniform_": lambda x: x + nn.init.kaiming_uniform_(torch.empty(32, 64)),
    "native_dropout": lambda x: torch.native_dropout(x, 0.3, True)[0],
}
_GEN = torch.Generator().manual_seed(7)


torch.manual_seed(0)
_MODEL = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))


def _steps(model: nn.Module, op: Callable[[Tensor], Tensor], steps: int = 2) -> list[bytes]:
    """Two steps of ``model`` whose step draws with ``op``; every loss, gradient and the final RNG states."""
    torch.manual_seed(1)
    _GEN.manual_seed(7)
    out: list[bytes] = []
    for _ in range(steps):
        x = torch.randn(32, 64)
        loss = model[2](op(model[1](model[0](x)))).square().mean()
        loss.backward()
        out += [raw(loss), *(raw(p.grad) for p in model.parameters())]
    return out + [raw(torch.get_rng_state()), raw(_GEN.get_state())]


@pytest.fixture(autouse=True)
def _disabled():
    # Size estimates are cached per op and argument shapes across runtimes: start each test without them,
    # so every test's random ops are estimated afresh.
    estimate._META.clear()
    yield
    hybridmem.disable()


@pytest.mark.parametrize("name", sorted(RANDOM_OPS))
def test_random_op_under_a_budget_with_nothing_to_evict(name: str) -> None:
    # The model is copied before enable(): the step's first draw is the first op the runtime sees.
    ref = _steps(copy.deepcopy(_MODEL), RANDOM_OPS[name])
    model = copy.deepcopy(_MODEL)
    hybridmem.enable(budget="1GiB", device="cpu")
    got = _steps(model, RANDOM_OPS[name])
    assert got == ref, f"{name}: the runtime changed the random stream"


@pytest.mark.parametrize("name", sorted(RANDOM_OPS))
def test_random_op_under_a_budget_at_its_peak(name: str) -> None:
    # At the peak every op is close to the budget, so the size of each (the random ones included) is
    # estimated before it runs.
    ref = _steps(copy.deepcopy(_MODEL), RANDOM_OPS[name])
    with hybridmem.session(budget=None, monitor="ops", device="cpu") as s:
        _steps(copy.deepcopy(_MODEL), RANDOM_OPS[name])
    estimate._META.clear()
    model = copy.deepcopy(_MODEL)
    hybridmem.enable(budget=s.stats().peak_bytes, device="cpu")
    got = _steps(model, RANDOM_OPS[name])
    assert got == ref, f"{name}: the runtime changed the random stream"


class RandomHeavy(nn.Module):
    """A step that draws everywhere: input noise, random flips, a randperm shuffle, dropout, a Bernoulli
    mask and in-place noise on an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Sequential(nn.GELU(), nn.Dropout(0.2), nn.Linear(256, 256), nn.Tanh())
        self.c = nn.Sequential(nn.Dropout(0.1), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))

    def forward(self, x: Tensor) -> Tensor:
        x = x + 0.1 * torch.randn_like(x)
        flip = torch.rand(x.shape[0], 1) < 0.5
        x = torch.where(flip, x.flip(-1), x)
        x = x[torch.randperm(x.shape[0])]
        h = self.b(self.a(x))
        h = h * torch.bernoulli(torch.full_like(h, 0.9))
        h = h + torch.empty_like(h).normal_(0, 0.01)
        return self.c(h)


# Lossless compression applies only to compressible tensors (masks, ReLU outputs): a smaller cut for it.
@pytest.mark.parametrize("policies,cut", [(("swap",), 0.5), (("recompute",), 0.5), (("compress",), 0.3),
                                          (("swap", "recompute", "compress"), 0.5)])
def test_random_heavy_loop_is_bit_identical_under_a_budget(policies: tuple[str, ...], cut: float) -> None:
    torch.manual_seed(0)
    case = Case("random-heavy", RandomHeavy(), (torch.randn(512, 64),))
    st = check_managed(case, policies, cut=cut)
    assert st.evicted_bytes > 0 and st.steps == 3
