"""A solver's plan, executed by the runtime on the CPU, does what the simulator said it would (issue 4).

Each zoo model (``tiny``, batch 8) is captured for one step on the CPU, costed with the ``cpu`` model
and planned by a hybrid solver (``approx``), a swap-heavy baseline (``capuchin``) and a
recompute-only one (``checkmate``) at two budgets: ``tight`` (the simulator's lower bound plus 30 %
of the way to the keep-all peak) and ``80%`` of the keep-all peak. Three plain-SGD steps follow the
plan (no optimizer state). With a stateful optimizer (momentum SGD) the graph is captured with
``optimizer=``, so that the plan budgets the momentum buffers (resident from the end of step 1 on;
the last tests). The runtime verifies the plan on step 1 (under the online scorer) and
follows it from step 2, here under the dispatch mode in every step (``steady: false``: the steady state,
from step 3 by default, has the allocator free the plan's recomputes first and is tested in
``tests/test_steady_plan.py``), so:

- losses, gradients, BatchNorm buffers and the RNG stream are bit-identical to an unmanaged run;
- ``stats().plan == "following"``: the plan was followed to the end, not abandoned;
- the whole run's measured peak is within the plan's budget;
- the peak of the followed steps (2 and 3) is within 5 % of ``plan.predicted_peak_bytes``.

Size: the default run keeps two zoo cases (the transformer: a small graph) and a small
Conv-BN-ReLU6 stack; the rest are ``slow`` (ResNet-50 and MobileNet take 10-20 s each to capture and
plan on two busy cores).

Without ``optimizer=`` a plan leaves no room for the momentum buffers: ResNet-50 at 80 % then ran out
of its budget (``torch.OutOfMemoryError``) on step 2.

Two runtime faults these tests found (both in the plan follower): a tensor autograd saves only after
its producer op returns (the ``clone`` under an in-place ``ReLU6``) was never evicted, because the
plan's ``free`` right after that op found no saved entry yet (MobileNet, Capuchin plan at 80 %: 5.9 %
over the prediction); and the plan's recomputations never ran at their stages (the evicted storage's slot
no longer knew its entry), so recomputed tensors were regenerated lazily when backward read them.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np
import pytest
import torch

import hybridmem
from hybridmem.errors import BudgetInfeasibleError
from hybridmem.graph.costs import get_cost_model
from hybridmem.graph.plan import Plan
from hybridmem.runtime import Stats
from tests.helpers.runtime import Case, train

torch.set_num_threads(1)

TOLERANCE = 0.05  # measured peak vs the simulator's prediction, as a share of the prediction


def _matches_prediction(c: "Captured", p: Plan, measured: int) -> bool:
    """The followed steps' real peak within ``TOLERANCE`` of the prediction, or below it by no more than the
    kernel scratch counted at the predicted peak's stage: capture measures an op's scratch in the unmanaged
    step, and a kernel may take less of it in the managed step (on an AMD EPYC with torch 2.13 the small
    stack's followed peak, at a convolution backward with 128 KiB of measured scratch, came out 64 KiB
    under the prediction). Under the prediction is never over the budget; over it stays within TOLERANCE."""
    pred = p.predicted_peak_bytes
    if pred is None:
        return False
    if abs(measured - pred) <= TOLERANCE * pred:
        return True
    from hybridmem.graph.simulate import simulate

    mem = np.asarray(simulate(c.graph, p, device=OVERLAPPED_CPU, budget=None, strict=False).memory)
    scratch = c.graph.stages[int(np.argmax(mem))].workspace
    return pred - scratch - TOLERANCE * pred <= measured <= pred
STEPS = 3
SOLVERS = ("approx", "capuchin", "checkmate")
# (model, solver, budget level) run by default; every other combination is marked slow.
FAST = {("transformer", "approx", "tight"), ("transformer", "capuchin", "tight")}
MODELS = ("transformer", "vgg16", "unet", "mobilenet", "resnet50")
LEVELS = ("tight", "80%")
# No plan exists for these (checked 2026-12-01): VGG-16's peak is its first convolution's backward, where
# no saved activation is left to evict, so 80 % of its keep-all peak is below what any plan needs; Checkmate
# recomputes only and cannot meet the transformer's tight budget (swap can).
INFEASIBLE = {("transformer", "checkmate", "tight"), *(("vgg16", s, "80%") for s in SOLVERS)}
# The training step's optimizer, by name: "sgd" has no state; "momentum" one buffer per parameter.
OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.05),
              "momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)}


@dataclass
class Captured:
    case: Case
    graph: Any
    keep_all: int      # the simulator's keep-everything peak
    minimum: int       # min_feasible_budget: no plan can go below it
    reference: list    # the unmanaged run: per step loss, grads, buffers; then the RNG state
    optimizer: str = "sgd"  # OPTIMIZERS key the graph was captured with and the runs train with


def _capture(case: Case, inputs: Any, optimizer: str) -> Any:
    """The case's step on the CPU, costed with the ``cpu`` model; with ``optimizer=`` where it has state."""
    from hybridmem.graph.capture import capture
    from hybridmem.graph.costs import apply_costs, get_cost_model

    model = copy.deepcopy(case.model)
    opt = OPTIMIZERS[optimizer](model.parameters()) if optimizer != "sgd" else None
    return apply_costs(capture(model, inputs, case.loss_fn, device="cpu", optimizer=opt), get_cost_model("cpu"))


@lru_cache(maxsize=None)
def _captured(name: str, optimizer: str = "sgd") -> Captured:
    pytest.importorskip("hybridmem.zoo")
    from hybridmem.zoo import build
    from hybridmem.graph.simulate import min_feasible_budget

    e = build(name, "tiny", batch=8)
    args, kwargs = e.args_kwargs()
    case = Case(name, e.model, args, kwargs, e.loss_fn)
    g = _capture(case, e.inputs, optimizer)
    ref, _ = _train(case, None, optimizer)
    return Captured(case, g, int(g.memory_profile().max()), min_feasible_budget(g), ref, optimizer)


def _budget(c: Captured, level: str) -> int:
    if level == "tight":
        return c.minimum + int(0.3 * (c.keep_all - c.minimum))
    return int(0.8 * c.keep_all)


def _train(case: Case, plan: Plan | None, optimizer: str = "sgd") -> tuple[list, tuple[Stats, Stats] | None]:
    """``STEPS`` SGD steps (``OPTIMIZERS[optimizer]``) of a fresh copy of the model, unmanaged or following
    ``plan``. Managed: the stats of the whole run and of the followed steps (2 on: the peak is reset
    after step 1)."""
    model = copy.deepcopy(case.model)
    if plan is None:
        return train(case, model, STEPS, OPTIMIZERS[optimizer]), None
    # under the dispatch mode in every step: what these tests check is the follower's per-stage actions
    # against the simulator (tests/test_steady_plan.py: steps after that in the steady state)
    with hybridmem.session(plan=plan, device="cpu", config={"plugins": {"steady": False}}) as s:
        whole: list[Stats] = []

        def first_done() -> None:
            whole.append(s.stats())
            s.reset_stats()

        out = train(case, model, STEPS, OPTIMIZERS[optimizer], after_first=first_done)
    followed = s.stats()
    first = whole[0]
    whole_peak = max(first.peak_bytes, followed.peak_bytes)
    return out, (replace(first, peak_bytes=whole_peak), followed)


# The CPU with its copies beside the compute at 10 GB/s: plans that swap where the `cpu` model's copies, on the
# compute stream at 2 GB/s, would recompute instead. What these tests check is the follower against the
# simulator for every kind of action, swaps included.
OVERLAPPED_CPU = replace(get_cost_model("cpu"), h2d_bw=10e9, d2h_bw=10e9, copies_overlap=True)


def _plan(c: Captured, budget: int, solver: str) -> Plan:
    from hybridmem.runtime.follow import annotate
    from hybridmem.solvers import plan as solve

    p = solve(c.graph, budget, device=OVERLAPPED_CPU, solver=solver)
    if "runtime" not in p.info:
        annotate(p, c.graph)
    return p


def _cases() -> list[Any]:
    out = []
    for name in MODELS:
        for solver in SOLVERS:
            for level in LEVELS:
                marks = () if (name, solver, level) in FAST else (pytest.mark.slow,)
                out.append(pytest.param(name, solver, level, marks=marks, id=f"{name}-{solver}-{level}"))
    return out


@pytest.mark.parametrize("name,solver,level", _cases())
def test_plan_followed_on_cpu_matches_simulator(name: str, solver: str, level: str) -> None:
    c = _captured(name)
    budget = _budget(c, level)
    if (name, solver, level) in INFEASIBLE:
        with pytest.raises(BudgetInfeasibleError):
            _plan(c, budget, solver)
        return
    assert budget >= c.minimum, f"{name}: the {level} budget {budget} is below the lower bound {c.minimum}"
    p = _plan(c, budget, solver)
    pred = p.predicted_peak_bytes
    assert p.budget_bytes == budget and pred is not None and pred <= budget
    assert p.actions, f"{name} {solver}: the plan evicts nothing at {budget} B"

    followed = _check_followed(c, p, budget, label=f"{name} {solver} {level}")
    assert followed.steps == STEPS - 1 and followed.evicted_bytes > 0


# ---- a small stack, run by default: the two follower faults ---------------------------------------------
def _stack(optimizer: str = "sgd") -> Captured:
    """Six Conv-BN-ReLU6(inplace) blocks: each ReLU6 saves a clone made right before it, packed after
    the clone's op returns."""
    from torch import nn
    from hybridmem.graph.simulate import min_feasible_budget

    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=True))
                  for _ in range(6)]
        model = nn.Sequential(*blocks, nn.Flatten(), nn.Linear(8 * 16 * 16, 10))
    x = torch.randn(8, 8, 16, 16, generator=gen)
    y = torch.randint(0, 10, (8,), generator=gen)
    loss_fn = lambda out: torch.nn.functional.cross_entropy(out, y)  # noqa: E731
    case = Case("stack", model, (x,), {}, loss_fn)
    g = _capture(case, x, optimizer)
    ref, _ = _train(case, None, optimizer)
    return Captured(case, g, int(g.memory_profile().max()), min_feasible_budget(g), ref, optimizer)


@pytest.fixture(scope="module")
def stack() -> Captured:
    return _stack()


@pytest.mark.parametrize("solver,level", [("capuchin", "tight"), ("checkmate", "80%")])
def test_small_stack_plan_matches_simulator(stack: Captured, solver: str, level: str) -> None:
    """The Capuchin plan at the tight budget swaps the late-packed clones: before the fix the run
    held them all and measured 7 % over the prediction."""
    budget = _budget(stack, level)
    p = _plan(stack, budget, solver)
    got, stats = _train(stack.case, p)
    assert stats is not None
    whole, followed = stats
    assert got == stack.reference
    assert followed.plan == "following" and whole.peak_bytes <= budget
    pred = p.predicted_peak_bytes
    assert _matches_prediction(stack, p, followed.peak_bytes), (followed.peak_bytes, pred)


def test_plan_regenerations_run_at_their_stages(stack: Captured, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every regeneration action of a followed step finds the tensor the plan evicted and brings it
    back then, not later when backward reads it (a recomputed tensor's slot forgets its entry when
    the bytes go, so the follower keeps it)."""
    from hybridmem.runtime.follow import PlanFollower

    p = _plan(stack, _budget(stack, "80%"), "checkmate")
    assert any(a.kind == "recompute" for a in p.actions)
    outcomes: list[tuple[int, str]] = []
    original = PlanFollower._regenerate

    def regenerate(self: PlanFollower, a: Any) -> None:
        original(self, a)
        if self.rt.steps.steps >= 1:  # steps 2 and 3: following
            e = self._entry(a.tensor)
            outcomes.append((a.tensor, "missing" if e is None else "resident" if e.tensor is not None else "evicted"))

    monkeypatch.setattr(PlanFollower, "_regenerate", regenerate)
    got, stats = _train(stack.case, p)
    assert got == stack.reference and stats is not None and stats[1].plan == "following"
    n_regen = sum(a.kind in ("swap_in", "recompute", "decompress") for a in p.actions)
    assert len(outcomes) == (STEPS - 1) * n_regen
    assert all(o == "resident" for _, o in outcomes), [x for x in outcomes if x[1] != "resident"][:5]


# ---- optimizer state: plans made with capture(optimizer=) --------------------------------------------------
def _check_followed(c: Captured, p: Plan, budget: int, label: str | None = None) -> Stats:
    """Follow ``p`` for ``STEPS`` steps with the case's optimizer: bit-identical to unmanaged, followed to the
    end, the whole run within the budget, steps 2-3 within ``TOLERANCE`` of the prediction."""
    label = label or c.case.name
    got, stats = _train(c.case, p, c.optimizer)
    assert stats is not None
    whole, followed = stats
    for i, (a, b) in enumerate(zip(got, c.reference)):
        assert a == b, f"{label}: step {i} (loss, gradients, buffers or RNG) differs from unmanaged"
    assert followed.plan == "following", f"{label}: plan {followed.plan} ({followed.plan_note})"
    assert whole.peak_bytes <= budget, f"{label}: peak {whole.peak_bytes} > budget {budget}"
    pred = p.predicted_peak_bytes
    assert _matches_prediction(c, p, followed.peak_bytes), (
        f"{label}: measured peak {followed.peak_bytes} B vs predicted {pred} B ({followed.peak_bytes / pred:.4f}; "
        f"budget {budget} B)")
    return followed


def _momentum_bytes(c: Captured) -> int:
    return sum(p.numel() * p.element_size() for p in c.case.model.parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def stack_momentum() -> Captured:
    return _stack("momentum")


def test_momentum_state_is_in_the_graph_and_the_plan(stack: Captured, stack_momentum: Captured) -> None:
    """The momentum buffers are in the graph (one parameter's worth of bytes, resident at every stage), so the
    keep-all peak, the lower bound and the plan's prediction all include them, and the runtime following a
    plan made at 80 % of that peak with momentum SGD stays within the budget and the prediction."""
    c = stack_momentum
    state = _momentum_bytes(c)
    opt = c.graph.meta["optimizer"]
    assert opt["class"] == "SGD" and opt["state_bytes"] == state > 0
    assert [t for t in c.graph.tensors if t.kind == "optimizer"]
    assert all(t.producer == -1 and t.freed_after is None and not t.evictable
               for t in c.graph.tensors if t.kind == "optimizer")
    assert c.keep_all == stack.keep_all + state and c.minimum == stack.minimum + state
    budget = _budget(c, "80%")
    p = _plan(c, budget, "approx")
    assert p.actions and p.predicted_peak_bytes is not None and p.predicted_peak_bytes <= budget
    followed = _check_followed(c, p, budget)
    assert followed.steps == STEPS - 1


@pytest.mark.slow
def test_resnet50_momentum_plan_with_optimizer_state_is_followed() -> None:
    """The issue's case: ResNet-50 (tiny, batch 8), momentum SGD, a plan at 80 % of the keep-all peak made
    with the optimizer's state (0.39 MB of momentum buffers, 19 % of the 1.99 MB keep-all peak: the tiny
    model's parameters are large next to its activations). Without ``optimizer=`` this run raised
    torch.OutOfMemoryError on step 2."""
    c = _captured("resnet50", "momentum")
    assert c.graph.meta["optimizer"]["state_bytes"] == _momentum_bytes(c)
    budget = _budget(c, "80%")
    p = _plan(c, budget, "approx")
    assert p.actions and p.predicted_peak_bytes is not None and p.predicted_peak_bytes <= budget
    _check_followed(c, p, budget)
