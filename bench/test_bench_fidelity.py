"""The fidelity table as a check (``python -m pytest bench/test_bench_fidelity.py -m slow``): on every zoo model
at ``small`` size and the three models built from configs (:mod:`bench.fidelity_models`), the simulated keep-all
peak of a step (forward, backward, SGD with momentum) is the CPU allocator's real peak within 2 %, with the
gradients of the step before kept and freed. About 2 minutes on one thread (transformers' import included)."""
from __future__ import annotations

import importlib.util

import pytest

from bench.fidelity import GRADS, measure
from bench.fidelity_models import BUILDERS
from hybridmem.native import cpumeter
from hybridmem.zoo import MODELS

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(cpumeter.load() is None, reason="native allocator device unavailable")]

NAMES = [*MODELS, *(n for n in BUILDERS if n != "hf-gpt2-tiny" or importlib.util.find_spec("transformers"))]


@pytest.mark.parametrize("grads", GRADS)
@pytest.mark.parametrize("name", NAMES)
def test_simulated_keep_all_peak_is_the_real_peak(name: str, grads: str, one_thread) -> None:
    row = measure(name, "small", grads, watch=False)
    assert 0.98 <= row.simulated_ratio <= 1.02, row
