"""The examples, run as users run them: the Hugging Face Trainer and Accelerate ones and PyTorch Lightning's with
HYBRIDMEM_BUDGET set (no change to the script), the peft LoRA one with ``--budget`` (its
``hybridmem.enable(budget=...)``), under a budget that makes the runtime evict: they train (finite losses),
hybridmem reports the peak within the budget, and the losses and parameters are bit-identical to the unmanaged
run. The Hugging Face examples pad every batch to its own length and accumulate gradients over 2
micro-batches in bf16 autocast. Each skips where its library is not installed (all are in the ``test``
extra)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, runs: list[tuple[dict[str, str], tuple[str, ...]]]) -> list[dict]:
    """Run ``script`` once per (environment, arguments), all at once (one core each); the JSON line each
    printed last."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDMEM_")}
    procs = [subprocess.Popen([sys.executable, str(EXAMPLES / script), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**base, "OMP_NUM_THREADS": "1", **env})
             for env, args in runs]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _by_env(budget: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """HYBRIDMEM_BUDGET: the documented way, no change to the script."""
    return {"HYBRIDMEM_BUDGET": budget, "HYBRIDMEM_DEVICE": "cpu"}, ()


def _by_arg(budget: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """The script's own ``hybridmem.enable(budget=...)``, given ``--budget``."""
    return {"HYBRIDMEM_DEVICE": "cpu"}, ("--budget", budget)


Launch = Callable[[str], tuple[dict[str, str], tuple[str, ...]]]  # a budget -> the run's environment and arguments


def _check(script: str, module: str, cut: float, *args: str, how: Launch = _by_env) -> dict:
    if importlib.util.find_spec(module) is None:
        hint = "pip install peft" if module == "peft" else "pip install -e '.[test]'"  # peft: not in the extra
        pytest.skip(f"{module} is not installed ({hint})")
    # The unmanaged run, and the monitor-only one the budget comes from: its peak (in the cap's units)
    # less a share of the saved activations.
    env, extra = how("none")
    ref, mon = _run(script, [({}, args), ({**env, "HYBRIDMEM_MONITOR": "ops"}, (*args, *extra))])
    assert ref["losses"] and all(math.isfinite(x) for x in ref["losses"])
    budget = mon["hybridmem"]["peak"] - int(cut * mon["hybridmem"]["saved"])
    env, extra = how(str(budget))
    [got] = _run(script, [(env, (*args, *extra))])
    assert {k: got[k] for k in ("losses", "params")} == ref
    assert got["hybridmem"]["within"] and got["hybridmem"]["peak"] <= budget and got["hybridmem"]["evicted"] > 0
    return got


def test_hf_trainer_example_under_a_budget_is_bit_identical() -> None:
    got = _check("hf_trainer.py", "transformers", 0.4)
    assert got["hybridmem"]["steps"] == 8  # 4 optimizer steps of 2 micro-batches


def test_hf_trainer_example_with_checkpointing_under_a_budget_is_bit_identical() -> None:
    got = _check("hf_trainer.py", "transformers", 0.4, "--gradient-checkpointing")
    assert got["hybridmem"]["steps"] == 8


def test_peft_lora_example_under_a_budget_is_bit_identical() -> None:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install -e '.[test]')")
    got = _check("peft_lora.py", "peft", 0.4, how=_by_arg)
    assert got["hybridmem"]["steps"] == 8


def test_accelerate_example_under_a_budget_is_bit_identical() -> None:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install -e '.[test]')")
    got = _check("accelerate_train.py", "accelerate", 0.4)
    assert got["hybridmem"]["steps"] == 8


def test_lightning_example_under_a_budget_is_bit_identical() -> None:
    got = _check("lightning_train.py", "lightning", 0.2)
    assert got["hybridmem"]["steps"] == 4
