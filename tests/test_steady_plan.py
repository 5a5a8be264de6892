"""A followed plan in the steady state: step 1 verifies it, step 2 follows it under the dispatch mode and
is recorded, and later steps run without the dispatch mode, the allocator freeing what the plan
recomputes before anything else (``hybridmem.runtime.steady_control.planned_first``).

The model is a torchvision-style inverted-residual network built here (expansion, depthwise convolution,
BatchNorm, ReLU6, dropout before the classifier), not a zoo model. Every run is compared with an
unmanaged one bit for bit: losses, gradients, BatchNorm buffers and the global RNG state at the end.
"""
from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem.native import cpumeter
from hybridmem.runtime.steady_control import PLAN_KEEPS_LAST, planned_first
from tests.helpers.runtime import Case, train

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator device unavailable: {cpumeter.unavailable_reason()}")

STEPS = 5


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.skip = stride == 1 and cin == cout
        self.body = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.skip else y


def _net(config: list[tuple[int, int, int, int]] = [(8, 8, 1, 4), (8, 12, 2, 4), (12, 12, 1, 4)]) -> nn.Module:
    """(in, out, stride, expansion) per block, a stem and a classifier with dropout."""
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=True)]
    layers += [InvertedResidual(*c) for c in config]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(config[-1][1], 10)]
    return nn.Sequential(*layers)


@pytest.fixture(scope="module")
def captured() -> tuple[Case, Any, list]:
    from hybridmem.graph.capture import capture
    from hybridmem.graph.costs import apply_costs, get_cost_model

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = _net()
        x = torch.randn(8, 3, 24, 24)
        y = torch.randint(0, 10, (8,))
    case = Case("inverted-residual", model, (x,), {}, lambda out: nn.functional.cross_entropy(out, y))
    g = apply_costs(capture(copy.deepcopy(model), (x,), case.loss_fn, device="cpu"), get_cost_model("cpu"))
    reference = train(case, copy.deepcopy(model), STEPS, "sgd-plain")
    return case, g, reference


@pytest.fixture(scope="module")
def measured(captured: tuple) -> Any:
    """The same step captured after a warm-up step, its op times (the stages' costs) measured."""
    from hybridmem.graph.capture import capture

    case = captured[0]
    model = copy.deepcopy(case.model)
    case.loss_fn(model(*case.args)).backward()
    model.zero_grad(set_to_none=True)
    g = capture(model, case.args, case.loss_fn, device="cpu")
    assert g.meta["cost_model"] == "measured"
    return g


def _plan(g: Any, share: float, solver: str, device: Any = "cpu") -> Any:
    from hybridmem.solvers import plan

    return plan(g, int(share * g.peak_bytes()), device=device, solver=solver, time_limit=20)


def test_a_plan_priced_by_measured_op_times_runs_in_the_steady_state(captured: tuple, measured: Any) -> None:
    """A plan made with this CPU's own op times (MeasuredCostModel, as the benchmarks plan) is followed
    like one made with a device model: bit-identical, in the steady state, within its budget."""
    from hybridmem.graph.costs import MeasuredCostModel

    case, _, reference = captured
    p = _plan(measured, 0.6, "checkmate", MeasuredCostModel.from_graph(measured))
    assert p.device == "measured" and any(a.kind == "recompute" for a in p.actions)
    got, stats = _follow(case, p)
    for i, (a, b) in enumerate(zip(got, reference)):
        assert a == b, f"step {i} (loss, gradients, buffers or the RNG state) differs from unmanaged"
    assert stats.plan == "following", stats.plan_note
    assert stats.steady_steps == STEPS - 2, stats.notes
    assert stats.peak_bytes <= p.budget_bytes
    assert stats.policies["recompute"].regenerated > 0


def _follow(case: Case, p: Any, registered: list | None = None, on_enable: Any = None,
            **config: Any) -> tuple[list, Any]:
    model = copy.deepcopy(case.model)
    gc.collect()  # the budget counts every live allocation of the process: earlier tests' cycles too
    with hybridmem.session(plan=p, device="cpu", config={"plugins": config}) as s:
        if registered is not None:
            _watch_registrations(registered)
        if on_enable is not None:
            from hybridmem.runtime.current import rt as _current
            on_enable(_current)
        got = train(case, model, STEPS, "sgd-plain")
    return got, s.stats()


def _watch_registrations(out: list) -> None:
    """Record ("registered", in a steady step, planned, priority) of every registration with the allocator
    and ("freed", in a steady step, planned, None) of every entry the allocator frees."""
    from hybridmem.runtime.current import rt

    store, register, dropped = rt.store, rt.store.register, rt.store.dropped

    def watch_register(e: Any, priority: float) -> None:
        out.append(("registered", rt._steady is not None, e.lineage in rt.plan_recomputes, priority))
        register(e, priority)

    def watch_dropped(e: Any) -> None:
        out.append(("freed", rt._steady is not None, e.lineage in rt.plan_recomputes, None))
        dropped(e)
    store.register, store.dropped = watch_register, watch_dropped


def test_a_recompute_plan_runs_in_the_steady_state_bit_identical_within_its_budget(captured: tuple) -> None:
    case, g, reference = captured
    p = _plan(g, 0.6, "checkmate")
    assert p.actions and all(a.kind in ("free", "recompute") for a in p.actions)
    registered: list = []
    got, stats = _follow(case, p, registered)
    for i, (a, b) in enumerate(zip(got, reference)):
        assert a == b, f"step {i} (loss, gradients, buffers or the RNG state) differs from unmanaged"
    assert stats.plan == "following", stats.plan_note
    assert stats.steady_steps == STEPS - 2, stats.notes
    assert "from step 3 in the steady state" in stats.plan_note
    assert stats.peak_bytes <= p.budget_bytes
    rc = stats.policies["recompute"]
    assert rc.evicted > 0 and rc.regenerated > 0
    # in steady steps the plan's recomputes come first in the allocator's order, the rest after them
    steady = [(planned, prio) for what, in_steady, planned, prio in registered if in_steady and what == "registered"]
    assert any(planned for planned, _ in steady) and any(not planned for planned, _ in steady)
    assert max(prio for planned, prio in steady if planned) < PLAN_KEEPS_LAST
    assert min(prio for planned, prio in steady if not planned) >= PLAN_KEEPS_LAST
    # what it frees is mostly what the plan recomputes; a tensor the plan keeps only where the bytes the
    # step holds need more than the plan frees at that moment (the plan counts no kernel scratch)
    freed = [planned for what, in_steady, planned, _ in registered if in_steady and what == "freed"]
    assert any(freed) and freed.count(True) >= 2 * freed.count(False), \
        f"the allocator freed {freed.count(False)} kept tensors of {len(freed)}"


def test_without_the_steady_state_the_plan_is_followed_under_the_dispatch_mode(captured: tuple) -> None:
    case, g, reference = captured
    p = _plan(g, 0.6, "checkmate")
    got, stats = _follow(case, p, steady=False)
    assert got == reference
    assert stats.plan == "following" and stats.steady_steps == 0
    assert "steady" not in stats.plan_note


def test_a_plan_that_swaps_runs_in_the_steady_state_swapping_as_it_saves(captured: tuple) -> None:
    """The recorded step's swaps (the plan's, and the scorer's) become evictions at pack time in the steady
    steps: bit-identical, within the budget, every step after the recorded one without the dispatch mode."""
    case, g, reference = captured
    p = _plan(g, 0.6, "capuchin")
    assert any(a.kind == "swap_out" for a in p.actions)
    early: list[tuple[bool, str]] = []

    def watch(rt: Any) -> None:
        evict_early = rt.residency.evict_early

        def watched(e: Any, name: str) -> bool:
            early.append((rt._steady is not None, name))
            return evict_early(e, name)
        rt.residency.evict_early = rt._steady_parts.offload = watched

    got, stats = _follow(case, p, on_enable=watch)
    assert got == reference
    assert stats.plan == "following" and stats.steady_steps == STEPS - 2, stats.notes
    assert stats.peak_bytes <= p.budget_bytes
    assert early and all(steady for steady, _ in early) and {n for _, n in early} == {"swap"}
    assert len(early) % (STEPS - 2) == 0  # the same saves in each steady step
    assert any("evicted by swap as they are saved" in n for n in stats.notes), stats.notes


def test_planned_first_orders_the_plans_recomputes_ahead_and_keeps_the_rest() -> None:
    class E:
        def __init__(self, lineage: object, nbytes: int):
            self.lineage, self.nbytes = lineage, nbytes

    a, b, c = object(), object(), object()
    base = {id(a): 3e-10, id(b): 1e-12, id(c): None}
    order = planned_first(lambda e: base[id(e.lineage)], {a})
    assert order(E(a, 8)) == 3e-10                     # the plan's recompute: its own priority
    assert order(E(b, 8)) == 1e-12 + PLAN_KEEPS_LAST   # kept by the plan: after every recompute, still freeable
    assert order(E(c, 8)) is None                      # recompute cannot rebuild it: never registered


def test_a_plan_tensor_the_allocator_freed_before_the_plans_action_is_no_divergence(captured: tuple) -> None:
    """Under pressure the allocator can free a registered entry (its storage then reads 0 bytes) before the
    plan's own eviction of it comes: the follower goes on (the eviction finds it evicted by recompute
    already). A storage of another size, or 0 bytes with no registered entry, is a different step."""
    from types import SimpleNamespace

    from hybridmem.runtime.follow import PlanFollower

    _, g, _ = captured
    p = _plan(g, 0.6, "checkmate")
    rt = SimpleNamespace(stats=SimpleNamespace(plan=None, plan_note=""))
    tensor, (stage, k, nbytes) = next((t, w) for t, w in PlanFollower(p, rt).where.items() if w[2] > 0)

    class Slot:
        def __init__(self, st: torch.UntypedStorage, registered: bool | None):
            self.st = st
            self.entry = None if registered is None else SimpleNamespace(registered=registered)

        def __call__(self) -> torch.UntypedStorage:
            return self.st

    for st, registered, follows in [(torch.UntypedStorage(0), True, True), (torch.UntypedStorage(0), False, False),
                                    (torch.UntypedStorage(0), None, False), (torch.UntypedStorage(nbytes + 8), True, False),
                                    (torch.UntypedStorage(nbytes), None, True)]:
        f = PlanFollower(p, rt)
        f.state = "following"
        f.outputs = [[] for _ in range(stage)] + [[None] * k + [Slot(st, registered)]]
        assert (f._slot(tensor) is not None) == follows and (f.state == "following") == follows, (st.nbytes(), registered)
