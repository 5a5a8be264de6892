"""An OOM names a budget that works: the step the budget could not hold goes on uncapped to measure what it
needs (hybridmem.runtime.survey), and a retry at that budget + 1 % trains, in the same process, with SGD
momentum in the loop, bit-identical to an unmanaged run, every step within the budget.
"""
from __future__ import annotations

import copy
import gc
from typing import Any, Callable

import pytest
import torch

import hybridmem
from bench.fidelity_models import gpt2_tiny, mobilenet_v2, resnet18
from hybridmem.native import cpumeter
from hybridmem.zoo import MODELS, build
from tests.helpers.runtime import raw

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator device unavailable: {cpumeter.unavailable_reason()}")
STEPS = 4


def _zoo(name: str) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    e = build(name, "small", seed=0)
    args, kwargs = e.args_kwargs()
    return e.model, lambda m: e.loss_fn(m(*args, **kwargs))


def _built(builder: Callable[..., Any], **kw: Any) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    model, inputs, loss_fn = builder(**kw)
    if isinstance(inputs, dict):
        return model, lambda m: loss_fn(m(**inputs))
    return model, lambda m: loss_fn(m(inputs))


CASES: dict[str, Callable[[], tuple]] = {
    **{n: (lambda n=n: _zoo(n)) for n in MODELS},
    "tv-resnet18": lambda: _built(resnet18, batch=4, pixels=64, classes=100, width=16),
    "tv-mobilenet_v2": lambda: _built(mobilenet_v2, batch=4, pixels=64, classes=100),
    "hf-gpt2-tiny": lambda: _built(gpt2_tiny, batch=2, seq=64, vocab=2048),
}
FAST = ("gpt", "tv-resnet18")


def _train(model: torch.nn.Module, loss_of: Callable, session: dict | None = None,
           peaks: list[int] | None = None) -> list[bytes]:
    """STEPS SGD-momentum steps on a copy (made inside the session, as a training script would); the losses and
    final parameters as bytes, each step's peak into ``peaks``."""
    ctx = hybridmem.session(**session) if session is not None else None
    s = ctx.__enter__() if ctx is not None else None
    try:
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        torch.manual_seed(5)
        out = []
        for _ in range(STEPS):
            if s is not None:
                s.reset_stats()
            loss = loss_of(m)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(raw(loss))
            if s is not None and peaks is not None:
                peaks.append(s.stats().peak_bytes)
        out += [raw(p) for p in m.parameters()]
    except BaseException:
        if ctx is not None:
            ctx.__exit__(None, None, None)
        raise
    if ctx is not None:
        ctx.__exit__(None, None, None)
    return out


def _named_budget_trains(name: str) -> None:
    model, loss_of = CASES[name]()
    ref = _train(model, loss_of)
    gc.collect()
    peaks: list[int] = []
    _train(model, loss_of, {"budget": None}, peaks)
    budget = max(peaks) // 4  # far below the peak: the step cannot fit
    with pytest.raises(torch.OutOfMemoryError) as e:
        _train(model, loss_of, {"budget": budget})
    named = e.value.min_budget_bytes
    assert budget < named <= max(peaks), (budget, named, max(peaks))
    assert "holds every op of it" in str(e.value), str(e.value)
    del e  # its traceback holds the failed attempt's model and optimizer, which the next budget would count
    retry = int(named * 1.01)
    peaks.clear()
    got = _train(model, loss_of, {"budget": retry}, peaks)
    assert got == ref
    assert max(peaks) <= retry, (peaks, retry)


@pytest.mark.parametrize("name", FAST)
def test_the_budget_an_oom_names_trains(name: str) -> None:
    _named_budget_trains(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if n not in FAST])
def test_the_budget_an_oom_names_trains_on_every_model(name: str) -> None:
    _named_budget_trains(name)


def test_without_the_survey_the_cap_holds_even_in_the_failing_step() -> None:
    """``plugins: {survey: false}``: the OOM comes at the first op the budget cannot hold, the cap never lifted
    (the allocator's peak stays within it), naming a lower bound only."""
    model, loss_of = _zoo("gpt")
    peaks: list[int] = []
    _train(model, loss_of, {"budget": None}, peaks)
    budget = max(peaks) // 4
    with hybridmem.session(budget=budget, config={"plugins": {"survey": False}}) as s:
        m = copy.deepcopy(model)
        with pytest.raises(torch.OutOfMemoryError) as e:
            loss_of(m).backward()
        assert s.stats().peak_bytes <= budget
    assert "Smallest budget that could work: at least" in str(e.value)
    assert "holds every op of it" not in str(e.value)
    del e  # its traceback holds the model copy: the next test's budget would count it
    with pytest.raises(ValueError, match="survey: expected true or false"):
        hybridmem.enable(budget="1GiB", config={"plugins": {"survey": "sometimes"}})


def test_a_step_with_larger_inputs_names_its_inputs_beside_the_budget() -> None:
    """Inputs that change size (a batch padded to its own length): the error says which inputs the budget it
    names was measured on, and that a step with larger ones may need more; that budget trains those inputs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(128, 128), torch.nn.Tanh())])
    sizes = [4, 4, 512]
    batches = [torch.randn(n, 128) for n in sizes]

    def run(budget: int | None, upto: int) -> int:
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        with hybridmem.session(budget=budget) as s:
            for x in batches[:upto]:
                m(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            return s.stats().peak_bytes

    # the peaks count what else the process holds (the CPU allocator's bytes): the budget lies between them
    small = run(None, 2)                      # the steps on 4 rows
    large = run(None, 3)                      # ... and the step on 512 rows, which holds 3 MiB more
    assert large > small + 2**20, (small, large)
    with pytest.raises(torch.OutOfMemoryError) as e:
        run(small + (large - small) // 4, 3)
    text = str(e.value)
    assert "It was measured on a step whose inputs were [512, 128]: a step with larger ones" in text, text
    named = e.value.min_budget_bytes
    del e
    gc.collect()
    assert run(int(named * 1.01), 3) <= int(named * 1.01)
