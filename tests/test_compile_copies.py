"""What a compiled graph's swaps cost where they copy (:mod:`hybridmem.compile.copies`): beside the compute
stream the simulator's count holds; on it each copy is paid in full, and a plan that swaps stands only where
it beats the plan made without swapping. A transformer captured on meta, planned for an H100 model."""
from __future__ import annotations

import pytest
import torch

import hybridmem
from hybridmem import solvers
from hybridmem.compile.copies import cheaper, no_swap, overlap, serial_time
from hybridmem.compile.partition import decisions
from hybridmem.graph.costs import apply_costs, get_cost_model
from hybridmem.graph.simulate import simulate
from hybridmem.zoo import build


@pytest.fixture(scope="module")
def graph_and_model():
    e = build("transformer", "small")
    model = get_cost_model("h100")
    return apply_costs(hybridmem.capture(e.model, e.inputs, e.loss_fn, device="meta"), model), model


def test_copies_on_the_compute_stream_are_charged_in_full(graph_and_model) -> None:
    g, model = graph_and_model
    p = solvers.plan(g, int(0.8 * g.peak_bytes()), device=model)
    swapped = decisions(p).swap
    assert swapped                                   # beside the compute stream, swapping is the cheapest
    r = simulate(g, p, model, budget=None, check_hash=False)
    copies = sum(model.copy_time(g.tensors[t].nbytes, "d2h") + model.copy_time(g.tensors[t].nbytes, "h2d")
                 for t in swapped)
    assert serial_time(g, p, model) == pytest.approx(r.compute_s + r.recompute_s + r.compress_s + copies)
    assert serial_time(g, p, model) > r.time_s       # the simulator hid most of those copies


def test_the_planner_recomputes_where_serial_copies_cost_more(graph_and_model) -> None:
    g, model = graph_and_model
    budget = int(0.8 * g.peak_bytes())
    p = solvers.plan(g, budget, device=model)
    q, seconds, note = cheaper(g, p, model, lambda m: solvers.plan(g, budget, device=m))
    d = decisions(q)
    assert not d.swap and d.recompute, note          # recomputing is cheaper than copying on the compute stream
    assert seconds < serial_time(g, p, model) and "recomputes rather than swaps" in note
    assert simulate(g, q, model, budget=budget, check_hash=False).peak_bytes <= budget


def test_a_plan_that_only_fits_by_swapping_keeps_its_swaps_charged_in_full(graph_and_model) -> None:
    g, model = graph_and_model
    budget = int(0.5 * g.peak_bytes())
    p = solvers.plan(g, budget, device=model)
    with pytest.raises(hybridmem.BudgetInfeasibleError):
        solvers.plan(g, budget, device=no_swap(model))
    q, seconds, note = cheaper(g, p, model, lambda m: solvers.plan(g, budget, device=m))
    assert q is p and seconds == pytest.approx(serial_time(g, p, model)) and "charged in full" in note


def test_only_cuda_copies_beside_the_compute_stream() -> None:
    assert overlap(torch.device("cuda", 0)) and not overlap(torch.device("cpu"))
