"""A batch a data loader stacks between steps, from a dataset made after ``enable()`` (as under ``hybridmem run``),
is an input of its step like one made before: a recompute's chain starts at it. Followed back through the
loader's ops it reached the dataset, whose lineage the first step's end drops, so every chain was refused
(the plan's recomputes left to the online scorer); and a chain through the loader's ops is one a steady-state
program cannot replay."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem import solvers
from hybridmem.graph.costs import apply_costs, planning_model, without_swaps
from hybridmem.native import cpumeter
from tests.helpers.runtime import snapshot

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator device unavailable: {cpumeter.unavailable_reason()}")


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = [m for c in (3, 16, 16, 16) for m in (nn.Conv2d(c, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def _train(model: nn.Module, epochs: int) -> list:
    """The README's loop: a dataset and loader made inside it, SGD with momentum, zero_grad after the step."""
    torch.manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 3, 24, 24), torch.randint(0, 10, (64,)))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    out = []
    for _ in range(epochs):
        for images, labels in loader:
            loss = loss_fn(model(images), labels)
            loss.backward()
            out.append(snapshot(model, loss))
            opt.step()
            opt.zero_grad()
    return out


def test_a_plan_is_followed_on_batches_a_loader_made_in_the_run() -> None:
    model = _model()
    x, y = torch.randn(16, 3, 24, 24), torch.randint(0, 10, (16,))
    loss_fn = lambda out: nn.functional.cross_entropy(out, y)  # noqa: E731
    g = hybridmem.capture(copy.deepcopy(model), x, loss_fn, device="cpu", warmup=1)
    m = planning_model(g, "cpu")
    p = solvers.plan(apply_costs(g, m), "85%", device=without_swaps(m))
    assert any(a.kind == "recompute" for a in p.actions)
    ref = _train(copy.deepcopy(model), 3)
    with hybridmem.session(plan=p, budget=int(p.budget_bytes * 1.2), device="cpu") as s:
        got = _train(copy.deepcopy(model), 3)  # the dataset too is made under the runtime
    st = s.stats()
    assert got == ref
    assert st.plan == "following", st.plan_note
    assert not [n for n in st.notes if "not applicable" in n], st.notes
    assert st.steady_steps >= len(ref) - 3, (st.steady_steps, st.notes)
    assert st.policies["recompute"].evicted > 0 and "swap" not in st.policies
