"""Runtime overhead benchmarks (pytest-benchmark), at the zoo's ``bench`` size on one CPU thread.

    pytest bench/test_bench_runtime.py                       # timings (a few minutes on 2 cores)
    pytest bench/test_bench_runtime.py --benchmark-autosave  # save a baseline under .benchmarks/
    pytest bench/test_bench_runtime.py --benchmark-compare   # compare with the last saved baseline
    pytest bench/test_bench_runtime.py --benchmark-disable   # a plain, quicker correctness test

Three families:

- ``test_monitor_overhead``: ``hybridmem.session(budget=None)`` (measure, never evict: on the CPU the
  native allocator meter, nothing per op) against plain PyTorch, interleaved step by step (the only fair
  way on shared cores) for 30 rounds (``HYBRIDMEM_BENCH_MONITOR_ROUNDS``); the median per-round ratio is
  in the test's ``extra_info``, beside the op-level monitor's (``monitor="ops"``, the cap's units). The
  issue's target is <= 5 %; set ``HYBRIDMEM_BENCH_MAX_OVERHEAD=0.05`` to assert it (off by default: a
  timing threshold on a busy 2-core machine would make the suite flaky).
- ``test_budget_above_peak_overhead``: a budget ten times the monitor-only peak (nothing to evict), same
  interleaving: what the runtime's per-op work costs on its own.
- ``test_budget_step``: one group per model, one benchmark per method at the budget "monitor-only peak
  minus 40 % of the saved activations": hybridmem, ``torch.utils.checkpoint`` (every block) and
  ``save_on_cpu``, side by side in pytest-benchmark's table, peaks in ``extra_info``. hybridmem must
  stay within the budget and give the unmanaged losses and gradients bit for bit.

Everything skips with the reason when a component it needs (runtime, meter, pytest-benchmark) is missing.
"""
from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is not installed (pip install 'hybridmem[test]')")

from bench import measure  # noqa: E402

MODELS = ("resnet50", "transformer")
SIZE = os.environ.get("HYBRIDMEM_BENCH_SIZE", "bench")
BUDGET_METHODS = ("unmanaged", "hybridmem-online", "ckpt-block", "save-on-cpu")


pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in the root conftest.py


def _need_runtime() -> Any:
    try:
        import hybridmem

        hybridmem.session  # noqa: B018  (lazy: imports the runtime)
        hybridmem.stats  # noqa: B018
    except (ImportError, AttributeError) as e:
        pytest.skip(f"hybridmem runtime not available: {e}")
    return hybridmem


def _entry(name: str) -> Any:
    try:
        from hybridmem.factory import zoo
    except ImportError as e:
        pytest.skip(f"model zoo not available: {e}")
    return zoo().build(name, SIZE)


_BUDGETS: dict[str, tuple[int, int, int]] = {}


def _budget(name: str, entry: Any) -> tuple[int, int, int]:
    """(budget, monitor-only peak, saved bytes) for one model, computed once per session."""
    if name not in _BUDGETS:
        from bench.runner import monitor_peak, saved_activation_bytes

        class _Notes:
            notes: list[str] = []

        peak = monitor_peak(entry.model, entry.inputs, entry.loss_fn, _Notes())
        if peak is None:
            pytest.skip("no meter to measure the monitor-only peak: " + "; ".join(_Notes.notes))
        saved = saved_activation_bytes(entry.model, entry.inputs, entry.loss_fn)
        _BUDGETS[name] = (int(peak - measure.BUDGET_SAVED_SHARE * saved), peak, saved)
    return _BUDGETS[name]


def _steps(benchmark: Any) -> int:
    return 1 if getattr(benchmark, "disabled", False) else 5


def _monitor_rounds(benchmark: Any) -> int:
    """Interleaved rounds for the overhead ratio. Single rounds on these shared cores scatter by +-15 %
    (an unmanaged-vs-unmanaged run gives medians of +-2 % over 12 rounds): a few % needs many rounds."""
    if getattr(benchmark, "disabled", False):
        return 1
    return int(os.environ.get("HYBRIDMEM_BENCH_MONITOR_ROUNDS", "30"))


def _interleaved(benchmark: Any, e: Any, methods: list[str], budget: int | None, group: str) -> dict[str, Any]:
    """``methods`` and plain PyTorch interleaved step by step for the overhead rounds; results by method."""
    holder: dict[str, Any] = {}

    def interleaved() -> None:
        holder["res"], _ = measure.run_methods(e.model, e.inputs, e.loss_fn, methods, budget=budget,
                                               steps=_monitor_rounds(benchmark), warmup=1)

    benchmark.group = group
    benchmark.pedantic(interleaved, rounds=1, iterations=1)
    return {r.method: r for r in holder["res"]}


@pytest.mark.parametrize("name", MODELS)
def test_monitor_overhead(benchmark: Any, name: str) -> None:
    _need_runtime()
    e = _entry(name)
    res = _interleaved(benchmark, e, ["hybridmem-monitor", "hybridmem-monitor-ops"], None,
                       f"monitor-only overhead ({SIZE})")
    mon = res["hybridmem-monitor"]
    assert mon.status == "ok", mon.reason
    assert mon.losses_identical and mon.grads_identical, "monitor-only mode changed the results"
    ops = res["hybridmem-monitor-ops"]
    assert ops.status == "ok", ops.reason
    assert ops.losses_identical and ops.grads_identical, "monitor-only mode (monitor='ops') changed the results"
    benchmark.extra_info.update(overhead=mon.overhead, step_s=mon.step_s, unmanaged_step_s=res["unmanaged"].step_s,
                                peak_bytes=mon.peak_bytes, ops_overhead=ops.overhead, ops_step_s=ops.step_s,
                                rounds=len(mon.times_s))
    print(f"\n{name}: monitor-only overhead {mon.overhead:+.2%} (allocator meter), {ops.overhead:+.2%} "
          f"(monitor='ops'), median of {len(mon.times_s)} interleaved rounds")
    limit = os.environ.get("HYBRIDMEM_BENCH_MAX_OVERHEAD")
    if limit is not None and not getattr(benchmark, "disabled", False):
        assert mon.overhead is not None and mon.overhead <= float(limit), \
            f"monitor-only overhead {mon.overhead:+.1%} > {float(limit):.0%} on {name}"


@pytest.mark.parametrize("name", MODELS)
def test_budget_above_peak_overhead(benchmark: Any, name: str) -> None:
    """A budget the step never reaches (ten times the monitor-only peak): what managing costs when there
    is nothing to evict (the per-op dispatch mode; nothing is registered with the allocator this far below
    the budget), interleaved with plain PyTorch like the monitor's overhead."""
    _need_runtime()
    e = _entry(name)
    _, peak, _ = _budget(name, e)
    res = _interleaved(benchmark, e, ["hybridmem-online"], 10 * peak, f"budget above the peak ({SIZE})")
    run = res["hybridmem-online"]
    assert run.status == "ok", run.reason
    assert run.losses_identical and run.grads_identical, "a budget above the peak changed the results"
    benchmark.extra_info.update(overhead=run.overhead, step_s=run.step_s, unmanaged_step_s=res["unmanaged"].step_s,
                                rounds=len(run.times_s))
    print(f"\n{name}: budget above the peak, overhead {run.overhead:+.2%}, median of {len(run.times_s)} "
          f"interleaved rounds")


@pytest.mark.parametrize("method", BUDGET_METHODS)
@pytest.mark.parametrize("name", MODELS)
def test_budget_step(benchmark: Any, name: str, method: str) -> None:
    if method.startswith("hybridmem"):
        _need_runtime()
    e = _entry(name)
    budget, peak, saved = _budget(name, e)
    try:
        v = measure.build_variant(method, e.model, e.inputs, budget=budget)
    except measure.Unavailable as why:
        pytest.skip(f"{method} not applicable to {name}: {why}")
    v.optimizer, v.inputs = None, e.inputs  # time forward + backward only: what the methods change
    ref = measure.build_variant("unmanaged", e.model, e.inputs)
    seed = iter(range(10**6))

    def step() -> float:
        loss, _ = measure.one_step(v, e.loss_fn, seed=next(seed))
        return loss

    benchmark.group = f"{name} ({SIZE}) at budget {budget / 2**20:.1f} MiB"
    benchmark.pedantic(step, rounds=_steps(benchmark), iterations=1, warmup_rounds=0 if _steps(benchmark) == 1 else 1)
    # Correctness and peak, outside the timing: one more step of each from the same seed.
    loss, _ = measure.one_step(v, e.loss_fn, seed=7)
    ref_loss, _ = measure.one_step(ref, e.loss_fn, seed=7)
    same = loss == ref_loss and measure._same(measure._grads(v.model), measure._grads(ref.model))
    source, probe = measure.peak_probe()
    v.model.zero_grad(set_to_none=True)
    with v.context():
        got = probe(v, lambda: measure._probe_step(v, e.loss_fn))
    benchmark.extra_info.update(peak_bytes=got, budget_bytes=budget, monitor_peak_bytes=peak, saved_bytes=saved,
                                peak_source=source, bit_identical=bool(same))
    assert same, f"{method}: loss or gradients differ from the unmanaged step"
    if method.startswith("hybridmem"):
        assert got <= budget, f"{method}: peak {got} > budget {budget}"
