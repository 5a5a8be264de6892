"""A CPU plan's predicted step time as a check (``python -m pytest bench/test_bench_step_time.py -m slow``): on every
zoo model at bench size, the runtime following a plan for ``--device cpu`` at 70 % of the keep-all peak (VGG-16:
the least budget with a plan, + 1 %) takes within 10 % of the step time the plan predicts: the median of three
rounds, each pairing a fresh capture's prediction with steps measured right after it (:mod:`bench.step_time`).
About 10 minutes on one thread of this 2-core machine; its load moves a step by up to 20 % over minutes, which
the rounds are paired against."""
from __future__ import annotations

import pytest

from bench.step_time import measure
from hybridmem.native import cpumeter
from hybridmem.zoo import MODELS

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(cpumeter.load() is None, reason="native allocator device unavailable")]


@pytest.mark.parametrize("name", MODELS)
def test_a_cpu_plans_predicted_step_time_is_the_measured_one(name: str, one_thread) -> None:
    row = measure(name, "bench", "70%", steps=3, rounds=3)
    assert row["plan"] == "following", row
    assert 0.9 <= row["ratio"] <= 1.1, row
