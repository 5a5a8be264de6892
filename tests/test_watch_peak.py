"""The watching runtime's peak is the allocator's real peak of the step: the state from before ``enable()``
(parameters, buffers, the gradients kept from the step before, an optimizer's state) counted with what the
step allocates, so that a budget chosen below it is in the units the cap counts.

The real peak is measured independently (``tests.helpers.peaks.real_peak``: the training state's storages
plus torch.profiler's memory events in the step), with an SGD-momentum step in the loop, with the step
before's gradients kept (gradient accumulation) and freed (``zero_grad(set_to_none=True)``).
"""
from __future__ import annotations

import gc
from typing import Any, Callable

import pytest
import torch

import hybridmem
from bench.fidelity_models import gpt2_tiny, mobilenet_v2, resnet18
from hybridmem.native import cpumeter
from hybridmem.zoo import MODELS, build
from tests.helpers.peaks import real_peak

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator device unavailable: {cpumeter.unavailable_reason()}")


def _zoo(name: str) -> tuple[torch.nn.Module, Callable[[], torch.Tensor], tuple]:
    e = build(name, "small", seed=0)
    args, kwargs = e.args_kwargs()
    return e.model, lambda: e.loss_fn(e.model(*args, **kwargs)), tuple(args) + tuple(kwargs.values())


def _built(builder: Callable[..., Any], **kw: Any) -> tuple[torch.nn.Module, Callable[[], torch.Tensor], tuple]:
    model, inputs, loss_fn = builder(**kw)
    if isinstance(inputs, dict):
        return model, lambda: loss_fn(model(**inputs)), tuple(inputs.values())
    return model, lambda: loss_fn(model(inputs)), (inputs,)


CASES: dict[str, Callable[[], tuple]] = {
    **{n: (lambda n=n: _zoo(n)) for n in MODELS},
    "tv-resnet18": lambda: _built(resnet18, batch=4, pixels=64, classes=100, width=16),
    "tv-mobilenet_v2": lambda: _built(mobilenet_v2, batch=4, pixels=64, classes=100),
    "hf-gpt2-tiny": lambda: _built(gpt2_tiny, batch=2, seq=64, vocab=2048),
}
FAST = ("resnet50", "hf-gpt2-tiny")


def _watched_and_real(name: str, zero_grad: bool) -> tuple[int, int]:
    model, loss, inputs = CASES[name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        loss().backward()

    def full() -> None:
        step()
        opt.step()
        if zero_grad:
            opt.zero_grad(set_to_none=True)
    full()
    full()  # the optimizer's state exists, as in every step but the first
    gc.collect()
    real = real_peak(step, model, opt, inputs)
    opt.step()
    if zero_grad:
        opt.zero_grad(set_to_none=True)
    gc.collect()
    # what earlier code left alive that was allocated through the native meter (the process's allocator bytes,
    # which the watched peak counts as they are): not this step's, and not in real_peak's count
    left = cpumeter.load().current_bytes
    with hybridmem.session(budget=None, device="cpu") as s:  # enabled after the model, the optimizer and its state
        step()
        watched = s.stats().peak_bytes
    return watched - left, real


def _check(name: str) -> None:
    for zero_grad in (False, True):
        watched, real = _watched_and_real(name, zero_grad)
        assert 0.99 <= watched / real <= 1.01, (name, zero_grad, watched, real)


@pytest.mark.parametrize("name", FAST)
def test_the_watched_peak_is_the_allocators(name: str) -> None:
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if n not in FAST])
def test_the_watched_peak_is_the_allocators_on_every_model(name: str) -> None:
    _check(name)
