"""Compiled steps: hybridmem's compile backend against PyTorch's activation memory budget (pytest-benchmark).

    pytest bench/test_bench_compile.py -s                                   # resnet50 and gpt, small
    HYBRIDMEM_BENCH_MODELS=resnet50,mobilenet,transformer,gpt pytest bench/test_bench_compile.py -s
    python -m bench.compiled --models resnet50 --ratios 0.5,0.2             # the same, as a table

For each model (``bench.compiled.compare``): Inductor unmanaged, ``activation_memory_budget`` at each
ratio of ``HYBRIDMEM_BENCH_RATIOS`` (default 0.5), and hybridmem's backend with that variant's real peak
as its budget. Asserted: hybridmem's real peak within its budget and its gradients within rounding of the
unmanaged compiled step's; reported: step-time ratios (interleaved medians), real peaks, compile and
planning seconds. ``HYBRIDMEM_BENCH_ASSERT_FASTER=1`` also asserts hybridmem is no slower than PyTorch's
budget at the same peak.
"""
from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is not installed (pip install 'hybridmem[test]')")

from bench import compiled  # noqa: E402

SIZE = os.environ.get("HYBRIDMEM_BENCH_SIZE", "small")
MODELS = tuple(os.environ.get("HYBRIDMEM_BENCH_MODELS", "resnet50,gpt").split(","))
RATIOS = tuple(float(r) for r in os.environ.get("HYBRIDMEM_BENCH_RATIOS", "0.5").split(","))
ROUNDS = int(os.environ.get("HYBRIDMEM_BENCH_ROUNDS", "10"))

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in the root conftest.py


@pytest.mark.parametrize("name", MODELS)
def test_compiled_at_pytorchs_budget_peak(benchmark: Any, name: str) -> None:
    holder: dict[str, Any] = {}
    rounds = 1 if getattr(benchmark, "disabled", False) else ROUNDS

    def run() -> None:
        holder["res"] = compiled.compare(name, SIZE, RATIOS, rounds)

    benchmark.group = f"torch.compile at PyTorch's activation budget's real peak ({SIZE})"
    benchmark.pedantic(run, rounds=1, iterations=1)
    res = {r.variant: r for r in holder["res"]}
    benchmark.extra_info.update({k: asdict(v) for k, v in res.items()})
    print("\n" + compiled.table(holder["res"]))
    for r in RATIOS:
        hm, amb = res[f"hybridmem@amb={r}"], res[f"amb={r}"]
        assert not hm.note, hm.note
        assert hm.real_peak_bytes <= hm.budget_bytes, (hm.real_peak_bytes, hm.budget_bytes)
        assert hm.max_grad_diff <= 1e-4, hm.max_grad_diff
        if os.environ.get("HYBRIDMEM_BENCH_ASSERT_FASTER") and rounds > 1:
            assert hm.step_ratio <= amb.step_ratio, (hm.step_ratio, amb.step_ratio)
