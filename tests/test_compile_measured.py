"""The measured peak of compiled steps (``CompileStats.measured_peak_bytes``) against the real peak that
``shared/tools/real_peak.py`` measures independently (torch.profiler's memory events plus the state), on
a network built before hybridmem was enabled (its parameters predate the allocator meter)."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem.compile import compile_backend
from hybridmem.native import cpumeter
from tests.helpers.models import BasicBlock
from tests.helpers.peaks import real_peak

pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator meter unavailable: {cpumeter.unavailable_reason()}")


def _net() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                              BasicBlock(8, 8, 1), BasicBlock(8, 16, 2), BasicBlock(16, 16, 1),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
        return model, torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))


def _steps(compiled: nn.Module, model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int,
           read: object) -> list[tuple[int, int | None]]:
    """(real peak, measured peak) of each of ``n`` SGD steps; the measurement restarts before each."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(n):
        opt.zero_grad()
        gc.collect()  # the allocator holds garbage of earlier tests until collected: not this step's
        hybridmem.reset_stats() if read is None else read.reset_stats()  # type: ignore[attr-defined]
        real = real_peak(lambda: nn.functional.cross_entropy(compiled(x), y).backward(), model, opt, [x])
        st = hybridmem.stats() if read is None else read.stats()  # type: ignore[attr-defined]
        out.append((real, st.measured_peak_bytes))
        opt.step()
    return out


def test_the_measured_peak_is_the_real_peak() -> None:
    model, x, y = _net()
    torch._dynamo.reset()
    probe = compile_backend(1 << 40, compiler="eager", measure=False)
    nn.functional.cross_entropy(torch.compile(copy.deepcopy(model), backend=probe)(x), y).backward()
    (region,) = probe.stats().regions
    assert probe.stats().measured_peak_bytes is None and "measure=False" in probe.stats().measured
    budget = (region.min_budget_bytes + region.keep_all_peak_bytes) // 2
    torch._dynamo.reset()
    b = compile_backend(budget, compiler="eager")
    steps = _steps(torch.compile(model, backend=b), model, x, y, 3, b)
    st = b.stats()
    assert st.regions[0].recomputed > 0, st
    for real, measured in steps:
        assert measured is not None and abs(measured - real) <= 0.01 * real, (steps, str(st))
        assert measured <= budget
    assert "measured peak" in str(st) and st.measured == "CPU allocator"
    b.close()
    assert b.stats().measured_peak_bytes == steps[-1][1]   # the figure stays once measuring stops


def test_a_session_measures_and_gives_the_allocator_back() -> None:
    """Through ``enable(compile=True)``: ``reset_stats()`` restarts the window, ``disable()`` uninstalls the
    meter the session installed, and the figure stays readable."""
    native = cpumeter.load()
    before = native.installed
    model, x, y = _net()
    torch._dynamo.reset()
    with hybridmem.session(budget="1GiB", compile=True) as s:
        compiled = torch.compile(model)  # no backend named: hybridmem's, with Inductor
        steps = _steps(compiled, model, x, y, 3, None)
        assert native.installed
    for real, measured in steps[1:]:  # the first step compiles with Inductor: its real peak includes that
        assert measured is not None and abs(measured - real) <= 0.01 * real, steps
    assert native.installed == before
    assert s.stats().measured_peak_bytes == steps[-1][1]


def test_what_a_compile_allocates_is_left_out() -> None:
    """The scratch measurement and the compiler's own tensors are not a step: a window closes when a compile
    begins (what it held is kept) and a new one starts when the compile ends."""
    from hybridmem.compile.measured import StepPeak

    p = StepPeak()
    p.start(torch.device("cpu"))
    try:
        base = cpumeter.load().current_bytes
        held = torch.ones(1 << 18)                  # 1 MiB, allocated in a "step"
        del held
        step = p.peak_bytes
        assert step is not None and step >= base + (1 << 20)
        p.compiling()
        scratch = torch.ones(1 << 20)               # 4 MiB, allocated while compiling
        del scratch
        p.compiled()
        assert p.peak_bytes == step
        after = torch.ones(1 << 19)                 # 2 MiB in a later step
        del after
    finally:
        p.stop()
    assert p.peak_bytes is not None and base + (2 << 20) <= p.peak_bytes < base + (4 << 20)


@pytest.mark.parametrize("budget", [None, "1GiB"])  # the allocator monitor, and the runtime's native device
def test_an_eager_runtime_in_between_leaves_the_measurement_its_meter(budget: str | None) -> None:
    """The allocator meter is one per process and each user holds it until the last lets go: an eager runtime
    enabled and disabled while a compiled step's measurement is on leaves the meter installed for it (before,
    its disable() uninstalled it, and every later measurement in the process read nothing)."""
    from hybridmem.compile.measured import StepPeak

    native = cpumeter.load()
    was = native.installed
    p = StepPeak()
    p.start(torch.device("cpu"))
    try:
        model, x, y = _net()
        with hybridmem.session(budget=budget, device="cpu"):
            nn.functional.cross_entropy(model(x), y).backward()
        assert native.installed
        base = native.current_bytes
        held = torch.ones(1 << 18)                  # 1 MiB
        del held
        assert p.peak_bytes is not None and p.peak_bytes >= base + (1 << 20)
    finally:
        p.stop()
    assert native.installed == was  # the last user leaves it as the first found it


def test_a_measurement_dropped_unstopped_lets_go_of_the_meter() -> None:
    """A backend that is dropped without ``stop()`` (``torch._dynamo.reset()``, a script that ends) no longer
    holds the meter: left installed, it counted every later allocation of the process against later budgets."""
    from hybridmem.compile.measured import StepPeak

    native = cpumeter.load()
    was = native.installed
    p = StepPeak()
    p.start(torch.device("cpu"))
    assert native.installed
    del p
    gc.collect()
    assert native.installed == was
