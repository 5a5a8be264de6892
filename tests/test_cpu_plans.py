"""Plans for the CPU as they run there: a swap is a copy on the calling thread (the simulator charges it to the
compute stream, the planners keep swaps only where they beat recomputing), op times are the capture's own, and
a recompute of a tensor whose input a later op wrote in place replays what rebuilds that input, as the runtime
does (a clone before an in-place ReLU6 replays the BatchNorm before it)."""
from __future__ import annotations

import collections
import copy
import json
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem import solvers
from hybridmem.cli import main
from hybridmem.errors import BudgetInfeasibleError
from hybridmem.graph.costs import (MeasuredCostModel, apply_costs, copies_overlap, get_cost_model, planning_model,
                                   without_swaps)
from hybridmem.graph.simulate import simulate
from hybridmem.native import cpumeter
from hybridmem.zoo import build
from tests.helpers.runtime import Case, train

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def transformer() -> Any:
    """A transformer's step on meta with the H100 model: at 80 % of its peak the cheapest plan swaps."""
    e = build("transformer", "small")
    return apply_costs(hybridmem.capture(e.model, e.inputs, e.loss_fn, device="meta"), "h100")


def _swaps(plan: Any) -> list[int]:
    return [a.tensor for a in plan.actions if a.kind == "swap_out"]


def test_copies_on_the_compute_stream_are_charged_in_full(transformer: Any) -> None:
    g = transformer
    h100 = get_cost_model("h100")
    p = solvers.plan(g, "80%", device=h100)
    assert _swaps(p) and copies_overlap(h100)
    beside = simulate(g, p, h100, check_hash=False)
    serial_model = replace(h100, copies_overlap=False)
    on = simulate(g, p, serial_model, check_hash=False)
    copies = sum(h100.copy_time(g.tensors[a.tensor].nbytes, "d2h" if a.kind == "swap_out" else "h2d")
                 for a in p.actions if a.kind in ("swap_out", "swap_in"))
    assert on.copy_s == pytest.approx(copies) and on.stall_s == 0 and beside.copy_s == 0
    assert on.time_s == pytest.approx(on.compute_s + on.recompute_s + on.compress_s + on.copy_s)
    assert on.time_s > beside.time_s                   # beside the compute stream most of the copies hid
    assert on.peak_bytes <= beside.peak_bytes          # a copy that ends at once frees its bytes no later
    assert on.to_dict()["copy_s"] == on.copy_s


def test_a_plan_for_copies_on_the_compute_stream_swaps_only_where_that_is_faster(transformer: Any) -> None:
    g = transformer
    serial_model = replace(get_cost_model("h100"), copies_overlap=False, h2d_bw=2e9, d2h_bw=2e9)
    budget = int(0.8 * g.peak_bytes())
    p = solvers.plan(g, budget, device=serial_model)
    assert p.info.copies and p.predicted_time_s == pytest.approx(simulate(g, p, serial_model, check_hash=False).time_s)
    overlapped = solvers.plan(g, budget, device=replace(serial_model, copies_overlap=True))
    recomputing = solvers.plan(g, budget, device=without_swaps(serial_model))
    assert not _swaps(recomputing)
    for other in (overlapped, recomputing):       # each judged with its copies on the compute stream
        assert p.predicted_time_s <= simulate(g, other, serial_model, check_hash=False).time_s * (1 + 1e-9)


def test_without_swaps_no_plan_swaps_even_where_copies_end_on_the_compute_stream(transformer: Any) -> None:
    """A swap over the no-swap model's link would take years; on the compute stream it would still end and free
    its bytes, so the model counts its copies as beside the compute: a budget only swaps meet has no plan."""
    g = transformer
    serial_model = replace(get_cost_model("h100"), copies_overlap=False)
    budget = int(0.5 * g.peak_bytes())
    assert _swaps(solvers.plan(g, budget, device=serial_model))
    with pytest.raises(BudgetInfeasibleError):
        solvers.plan(g, budget, device=without_swaps(serial_model))


def test_the_cpu_model_copies_on_the_compute_stream() -> None:
    cpu = get_cost_model("cpu")
    assert not copies_overlap(cpu) and copies_overlap(get_cost_model("h100"))
    assert not copies_overlap(MeasuredCostModel([0.0], cpu)) and copies_overlap(without_swaps(cpu))


# ---- the capture's op times ---------------------------------------------------------------------------
def _stack() -> tuple[nn.Module, torch.Tensor, Any]:
    """Conv-BN-ReLU6(inplace) blocks: each ReLU6 saves a clone of the BatchNorm output made right before it
    writes that output in place."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                          nn.ReLU6(inplace=True)) for _ in range(4)],
                          nn.Flatten(), nn.Linear(8 * 16 * 16, 10))
    x = torch.randn(8, 8, 16, 16)
    y = torch.randint(0, 10, (8,))
    return model, x, lambda out: nn.functional.cross_entropy(out, y)


def test_a_cpu_capture_is_planned_with_its_own_op_times() -> None:
    model, x, loss_fn = _stack()
    g = hybridmem.capture(model, x, loss_fn, device="cpu")
    m = planning_model(g, "cpu")
    assert isinstance(m, MeasuredCostModel) and m.op_times(g).tolist() == g.meta["measured_cost_s"]
    assert not copies_overlap(m) and m.copy_time(1 << 20, "h2d") == get_cost_model("cpu").copy_time(1 << 20, "h2d")
    p = solvers.plan(apply_costs(g, m), "80%", device=m)
    assert p.device == "measured"           # what `simulate(device="measured")` and `hybridmem report` read back
    assert simulate(g, p, "measured").time_s == pytest.approx(p.predicted_time_s)
    meta = hybridmem.capture(model, x, loss_fn, device="meta")
    assert planning_model(meta, "cpu") is get_cost_model("cpu")       # no measured times: the device model
    assert planning_model(g, "h100") is get_cost_model("h100")        # another device: its own model


def test_plan_for_the_cpu_from_the_cli_uses_the_measured_op_times(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "stackmodel.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def factory():\n"
        "    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(inplace=True),\n"
        "                          nn.Flatten(), nn.Linear(8 * 16 * 16, 10))\n"
        "    return {'model': model, 'inputs': torch.randn(8, 8, 16, 16)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "stackmodel:factory", "--device", "cpu", "--budget", "min", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["device"] == "measured"


# ---- replays of inputs written in place after they were read ------------------------------------------------
def test_a_clone_before_an_in_place_write_replays_what_rebuilds_its_input() -> None:
    model, x, loss_fn = _stack()
    g = hybridmem.capture(model, x, loss_fn, device="cpu")
    writers = g.writers()
    clones = [s for s in g.stages if s.op == "clone" and s.phase == "forward"
              and any(s.index < w for w in writers.get(s.inputs[0], ()))]
    assert clones
    for s in clones:
        src = g.tensors[s.inputs[0]]
        replay = g.replay_stages(s.outputs[0])
        assert src.producer in replay and g.stages[src.producer].op == "native_batch_norm"
        assert not set(writers[s.inputs[0]]) & set(replay)            # the input as the clone read it
        assert g.replay_stages(s.outputs[0], trace=False) == replay   # not a traced source: always


@pytest.mark.skipif(cpumeter.load() is None, reason=f"native allocator device unavailable: {cpumeter.unavailable_reason()}")
def test_the_runtime_replays_the_ops_the_simulator_charges(monkeypatch) -> None:
    """A recompute-only plan followed op by op: the ops the runtime replays in a step are those the simulator
    replays for the plan's recomputes, by kind and number (the simulator had charged a clone's recompute the
    clone alone, while the runtime replays the BatchNorm too)."""
    from hybridmem.runtime.replay import Replayer

    model, x, loss_fn = _stack()
    g = apply_costs(hybridmem.capture(copy.deepcopy(model), x, loss_fn, device="cpu"), "cpu")
    p = solvers.plan(g, "75%", device=without_swaps(get_cost_model("cpu")), solver="checkmate")
    recomputes = [a for a in p.actions if a.kind == "recompute"]
    assert any(g.stages[g.tensors[a.tensor].producer].op == "clone" for a in recomputes)
    charged: collections.Counter[str] = collections.Counter()
    done: set[tuple[int, int]] = set()
    for a in recomputes:  # the simulator's replays: one per stage and producer (recompute() above)
        p_stage = g.tensors[a.tensor].producer
        if (a.stage, p_stage) in done:
            continue
        done.add((a.stage, p_stage))
        charged.update(g.stages[r].op for r in g.replay_stages(a.tensor, a.stage))
    replayed: collections.Counter[str] = collections.Counter()
    real = Replayer._call

    def call(self, func, args, kwargs, rng=None):
        replayed[str(func).removeprefix("aten.").split(".")[0]] += 1
        return real(self, func, args, kwargs, rng)

    monkeypatch.setattr(Replayer, "_call", call)
    case = Case("stack", model, (x,), {}, loss_fn)
    ref = train(case, copy.deepcopy(model), 3)
    # room beside the plan's budget: on a step of 0.5 MiB the few KiB the graph does not place exactly (the
    # loss's scalars, the linear layer's gradient) would have the allocator drop a tensor the plan keeps, which
    # a later replay rebuilds besides
    budget = int(p.budget_bytes * 1.25)
    with hybridmem.session(plan=p, budget=budget, device="cpu", config={"plugins": {"steady": False}}) as s:
        got = train(case, copy.deepcopy(model), 3, after_first=replayed.clear)  # steps 2 and 3 follow the plan
    assert s.stats().plan == "following" and got == ref
    assert replayed == collections.Counter({op: 2 * n for op, n in charged.items()})


# ---- the runtime's own host time ---------------------------------------------------------------------------
def test_a_cpu_plan_is_charged_the_runtimes_saved_tensor_hooks() -> None:
    """On the CPU one thread runs the ops and the runtime's pack / unpack hooks, so a plan's predicted step counts
    them: one per save autograd made in the captured step (counted as the hooks would see them)."""
    model, x, loss_fn = _stack()
    packs = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packs.append(1) or t, lambda t: t):
        loss_fn(copy.deepcopy(model)(x)).backward()
    g = hybridmem.capture(model, x, loss_fn, device="cpu")
    assert g.meta["saves"] == len(packs) > 0
    m = planning_model(g, "cpu")
    p = solvers.plan(apply_costs(g, m), "80%", device=m)
    r = simulate(g, p, m)
    assert r.host_s == pytest.approx(len(packs) * get_cost_model("cpu").host_save_s) and r.host_s > 0
    assert r.time_s == pytest.approx(r.compute_s + r.recompute_s + r.compress_s + r.copy_s + r.stall_s + r.host_s)
    assert p.predicted_time_s == pytest.approx(r.time_s)
    assert simulate(g, None, m).host_s == 0                           # no plan: no runtime
    assert simulate(g, p, "h100").host_s == 0                         # the GPU runs ahead of the host


def test_a_warm_capture_times_what_a_step_spends_outside_its_ops() -> None:
    """``capture(warmup=2)``: two plain steps first, unrecorded and without side effects (gradients, buffers and
    the RNG as they were); the second is timed, and what it spent outside the ops the capture timed is charged
    to every step of the graph's measured model, whatever the plan."""
    model, x, loss_fn = _stack()
    model[0][0].weight.grad = torch.ones_like(model[0][0].weight)
    grad = model[0][0].weight.grad
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    g = hybridmem.capture(model, x, loss_fn, device="cpu", grads="none", warmup=2)
    assert model[0][0].weight.grad is grad and all(p.grad is None for p in list(model.parameters())[1:])
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers())) and torch.equal(rng, torch.get_rng_state())
    ops = sum(t for t, s in zip(g.meta["measured_cost_s"], g.stages) if s.phase in ("forward", "backward"))
    assert g.meta["step_s"] > 0
    m = planning_model(g, "cpu")
    assert m.outside_s == pytest.approx(max(0.0, g.meta["step_s"] - ops))
    assert MeasuredCostModel.from_graph(g).outside_s == m.outside_s
    keep = simulate(g, None, m)
    assert keep.outside_s == m.outside_s and keep.time_s == pytest.approx(keep.compute_s + m.outside_s)
    assert keep.overhead == pytest.approx(0.0)                       # outside the ops whatever the plan
    p = solvers.plan(apply_costs(g, m), "80%", device=m)
    assert simulate(g, p, m).outside_s == m.outside_s
    assert without_swaps(m).outside_s == m.outside_s
    with pytest.raises(ValueError, match="needs a real device"):
        hybridmem.capture(model, x, loss_fn, device="meta", warmup=1)
    with pytest.raises(ValueError, match="warmup=-1"):
        hybridmem.capture(model, x, loss_fn, device="cpu", warmup=-1)
