"""State from before the session that only the loss reads (a per-pixel target held by the loss function,
not passed to the model): counted when first saved, after room is made for it, so the count never reads
over the budget in step 1; the stats say that step's count missed it until then."""
from __future__ import annotations

import re

import numpy as np
import torch
from torch import nn

from hybridmem.graph.units import parse_bytes
from tests.helpers.runtime import Case, budget_for, run, run_feasible

torch.set_num_threads(1)


def _case() -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(4) for m in (nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())),
                          nn.Conv2d(16, 10, 1))
    x = torch.randn(8, 16, 48, 48)
    # 144 KiB of int64 made before the session, in memory numpy allocated: never through the allocator a
    # session (or an earlier test's meter) counts
    target = torch.from_numpy(np.random.default_rng(0).integers(0, 10, (8, 48, 48), dtype=np.int64))

    def loss(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, target)

    return Case("late-target", model, (x,), loss_fn=loss)


def test_a_target_first_read_by_the_loss_keeps_the_count_within_the_budget() -> None:
    case = _case()
    ref, _ = run(case)
    mon, mstats = run(case, budget=None, policies=("recompute",))
    assert mon == ref and mstats is not None
    # a budget the forward fills: the target's 144 KiB arrive when the count is at the budget
    got, st, budget = run_feasible(case, budget_for(mstats, 0.4), policies=("recompute",))
    assert st.peak_bytes <= budget, f"peak {st.peak_bytes} > budget {budget}"
    assert st.cap_overruns == 0
    assert st.evicted_bytes > 0
    assert got == ref, "loss, gradients or RNG differ from the unmanaged run"
    # the count before the loss held the budget without the target's bytes: the stats say by how much the
    # real bytes may have been higher (what was counted late, less the room the count had left)
    late = [n for n in st.notes if "first counted mid-step" in n]
    assert len(late) == 1 and "after _log_softmax" in late[0], st.notes
    m = re.search(r"up to ([\d.]+) (\w+) low", late[0])
    assert m is not None and 0 < parse_bytes(m.group(1) + m.group(2)) <= 147456, late[0]
