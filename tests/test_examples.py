"""The Hugging Face Trainer and PyTorch Lightning examples, run as users run them: with HYBRIDMEM_BUDGET
set (no change to the script), under a budget that makes the runtime evict, bit-identical to the
unmanaged run. Each skips where its library is not installed (both are in the ``test`` extra)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, envs: list[dict[str, str]], *args: str) -> list[dict]:
    """Run ``script`` once per environment, all at once (one core each); the JSON line each printed last."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDMEM_")}
    procs = [subprocess.Popen([sys.executable, str(EXAMPLES / script), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**base, "OMP_NUM_THREADS": "1", **env})
             for env in envs]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _check(script: str, module: str, cut: float, *args: str) -> dict:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[test]')")
    # The unmanaged run, and the monitor-only one the budget comes from: its peak (in the cap's units)
    # less a share of the saved activations.
    ref, mon = _run(script, [{}, {"HYBRIDMEM_BUDGET": "none", "HYBRIDMEM_MONITOR": "ops", "HYBRIDMEM_DEVICE": "cpu"}],
                    *args)
    budget = mon["hybridmem"]["peak"] - int(cut * mon["hybridmem"]["saved"])
    [got] = _run(script, [{"HYBRIDMEM_BUDGET": str(budget), "HYBRIDMEM_DEVICE": "cpu"}], *args)
    assert {k: got[k] for k in ("losses", "params")} == ref
    assert got["hybridmem"]["peak"] <= budget and got["hybridmem"]["evicted"] > 0
    return got


def test_hf_trainer_example_under_a_budget_is_bit_identical() -> None:
    got = _check("hf_trainer.py", "transformers", 0.4, "--gradient-checkpointing")
    assert got["hybridmem"]["steps"] == 4


def test_lightning_example_under_a_budget_is_bit_identical() -> None:
    got = _check("lightning_train.py", "lightning", 0.2)
    assert got["hybridmem"]["steps"] == 4
