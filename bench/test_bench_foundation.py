"""Speed targets of the foundation (issue 2): capture, simulator, meter, zoo on meta.

    python -m pytest bench/test_bench_foundation.py --benchmark-only        # measure
    python -m pytest bench/test_bench_foundation.py --benchmark-disable     # just run once

Targets are asserted on the best round (the machine is shared: the minimum is the least noisy).
"""
from __future__ import annotations

import pytest
import torch

from hybridmem import zoo
from hybridmem.graph.capture import capture
from hybridmem.graph.costs import get_cost_model
from hybridmem.runtime.meter import Meter
from hybridmem.graph.simulate import simulate
from tests.helpers import big_graph


def _best(benchmark) -> float:
    stats = getattr(benchmark, "stats", None)
    return stats.stats.min if stats is not None else 0.0  # 0 when benchmarks are disabled


@pytest.fixture(scope="module")
def warm_meta():
    # torch imports its meta BatchNorm machinery on first use (~2-3 s once per process): not capture's cost
    capture(zoo.build("resnet50", "tiny", device="meta").model, torch.randn(2, 3, 32, 32), device="meta")


def test_capture_resnet50_paper_on_meta(benchmark, warm_meta):
    e = zoo.build("resnet50", "paper", device="meta")
    g = benchmark.pedantic(capture, args=(e.model, e.inputs, e.loss_fn), kwargs={"device": "meta"},
                           rounds=3, iterations=1)
    assert g.num_stages > 400
    assert _best(benchmark) <= 5.0, "issue 2: ResNet-50 b64 224x224 capture on meta must take <= 5 s"


def test_simulate_1000_stages(benchmark):
    g, plan = big_graph()
    dev = get_cost_model("h100-80gb")
    r = benchmark(simulate, g, plan, dev, check_hash=False)
    assert r.feasible
    assert _best(benchmark) <= 0.05, "the solvers call simulate() in loops: keep it under 50 ms at 1000 stages"


def test_meter_mode_per_op(benchmark):
    x, w = torch.randn(4), torch.randn(4)

    def ops() -> None:
        with Meter("cpu"):
            for _ in range(1000):
                torch.add(x, w)

    benchmark.pedantic(ops, rounds=5, iterations=1)
    assert _best(benchmark) / 1000 <= 50e-6, "MeterMode must stay a few microseconds per op"


def test_zoo_paper_build_on_meta(benchmark):
    benchmark.pedantic(zoo.build, args=("resnet152", "paper"), kwargs={"device": "meta"}, rounds=3, iterations=1)
    assert _best(benchmark) <= 1.0
