"""Soak test (opt-in, slow): 1,000 training steps under a budget with each policy, looking for leaks.

    python -m pytest bench/test_soak.py -m slow -s          # a few minutes on 2 cores; -s shows the figures
    HYBRIDMEM_SOAK_STEPS=200 python -m pytest bench/test_soak.py -m slow -s

Per step it records the managed device's live bytes after the step (``stats().current_bytes``, the cap's
units on the simulated CPU device), the step's peak, the saved-tensor entries still alive, and the
process's resident set size (RSS). After a warm-up (the first 10 % of the steps: the swap pool's host
buffers, numba's compile, the estimator's caches fill up) the managed bytes and entries must be exactly
flat and the peak within the budget; the RSS may wander with the C allocator but must not grow: the
median of the last tenth of the steps is at most ``HYBRIDMEM_SOAK_RSS_MIB`` (default 8 MiB) above the
median of the tenth after the warm-up. Each policy's series is printed as a small text figure.
"""
from __future__ import annotations

import copy
import os
import statistics
from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

STEPS = int(os.environ.get("HYBRIDMEM_SOAK_STEPS", "1000"))
RSS_SLACK = float(os.environ.get("HYBRIDMEM_SOAK_RSS_MIB", "8")) * 2**20
POLICIES = (("swap",), ("recompute",), ("compress",), ("swap", "recompute", "compress"))

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.1), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    return model, torch.randn(256, 64)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


def _budget(policies: tuple[str, ...]) -> int:
    """Monitor-only peak of two steps (the optimizer's state included) minus a share of the saved
    activations (less for lossless compress, which only applies to compressible tensors)."""
    import hybridmem

    model, x = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    with hybridmem.session(budget=None, monitor="ops", device="cpu") as s:
        for _ in range(2):
            _step(model, x, opt)
    cut = 0.2 if policies == ("compress",) else 0.4
    return s.stats().peak_bytes - int(cut * s.stats().saved_bytes / 2)


def _soak(policies: tuple[str, ...]) -> dict[str, Any]:
    import hybridmem

    budget = _budget(policies)
    model, x = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    series: dict[str, list[int]] = {"managed": [], "peak": [], "entries": [], "rss": []}
    with hybridmem.session(budget=budget, policies=policies, device="cpu") as s:
        rt = hybridmem.runtime.current.rt
        for _ in range(STEPS):
            hybridmem.reset_stats()
            _step(model, x, opt)
            st = s.stats()
            series["managed"].append(st.current_bytes)
            series["peak"].append(st.peak_bytes)
            series["entries"].append(len(rt.store.resident))
            series["rss"].append(_rss())
        evicted = sum(p.evicted for p in s.stats().policies.values())
    return {"budget": budget, "evicted": evicted, **series}


def _figure(name: str, values: list[int], unit: float, label: str, width: int = 60, height: int = 6) -> str:
    """A text plot of ``values`` (bucketed to ``width`` columns, ``height`` rows)."""
    cols = [statistics.median(values[i * len(values) // width:(i + 1) * len(values) // width] or [values[-1]])
            for i in range(width)]
    lo, hi = min(cols), max(cols)
    span = (hi - lo) or 1
    rows = []
    for r in range(height, 0, -1):
        level = lo + span * (r - 1) / height  # a flat series is one full bottom row
        rows.append("".join("#" if c >= level else " " for c in cols))
    return (f"{name} {label}: {lo / unit:.2f} .. {hi / unit:.2f} (step 1 .. {len(values)})\n"
            + "\n".join("  |" + row for row in rows) + "\n  +" + "-" * width)


@pytest.mark.parametrize("policies", POLICIES, ids="+".join)
def test_soak_flat_memory(policies: tuple[str, ...]) -> None:
    r = _soak(policies)
    name = "+".join(policies)
    print()
    print(_figure(name, r["managed"], 2**20, "managed MiB after each step"))
    print(_figure(name, r["rss"], 2**20, "RSS MiB"))
    warm = max(1, STEPS // 10)
    tenth = max(1, STEPS // 10)
    assert r["evicted"] > 0, f"{name}: nothing was evicted: the soak exercised no policy"
    assert max(r["peak"][warm:]) <= r["budget"], f"{name}: a step went over the budget"
    assert len(set(r["managed"][warm:])) == 1, f"{name}: managed bytes after the step vary: {set(r['managed'][warm:])}"
    assert len(set(r["entries"][warm:])) == 1, f"{name}: live entries after the step vary"
    early = statistics.median(r["rss"][warm:warm + tenth])
    late = statistics.median(r["rss"][-tenth:])
    print(f"{name}: RSS median {early / 2**20:.1f} MiB after warm-up, {late / 2**20:.1f} MiB at the end")
    assert late - early <= RSS_SLACK, f"{name}: RSS grew by {(late - early) / 2**20:.1f} MiB"
