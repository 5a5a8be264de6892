"""The decision report: a zoo run's table and reasons, figures that agree with ``hybridmem simulate``
and ``hybridmem.stats()``, the reason rules one by one, the runtime's tensor log, run files and the
report command's dispatch between run files and bench results."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridmem.graph.plan import Action, Plan
from hybridmem.report import build_report
from hybridmem.runfile import is_run_file, load_run, main, save_run
from hybridmem.runtime.stats import TensorLog
from hybridmem.graph.simulate import min_feasible_budget, simulate

from tests.helpers import chain_graph


# ---- a zoo run, end to end -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """ResNet-50 (tiny, batch 8: activations dominate) captured, planned at 80 % of its keep-all peak
    on the CPU cost model, and trained for 2 steps following the plan under a budget."""
    import hybridmem
    from hybridmem.zoo import build
    from hybridmem.graph.capture import capture
    from hybridmem.graph.costs import apply_costs, planning_model
    from hybridmem.runtime.follow import annotate
    from hybridmem.solvers import plan as solve

    torch.set_num_threads(1)
    e = build("resnet50", "tiny", batch=8)
    g = capture(e.model, e.inputs, e.loss_fn, device="cpu")
    model = planning_model(g, "cpu")   # as `hybridmem plan --device cpu`: the capture's own op times
    g = apply_costs(g, model)
    p = solve(g, "80%", device=model, solver="approx")
    if "runtime" not in p.info:
        annotate(p, g)
    d = tmp_path_factory.mktemp("report")
    g.save(d / "graph.json")
    p.save(d / "plan.yaml")

    def train(budget: int | None, plan: Plan | None) -> tuple:
        e = build("resnet50", "tiny", batch=8)
        opt = torch.optim.SGD(e.model.parameters(), lr=0.05)
        with hybridmem.session(budget=budget, plan=plan, device="cpu") as s:
            for _ in range(2):
                opt.zero_grad(set_to_none=True)
                e.loss().backward()
                opt.step()
        return s.stats()

    mon = train(None, None)
    st = train(int(mon.peak_bytes - 0.3 * mon.saved_bytes), p)
    return {"graph": g, "plan": p, "stats": st, "dir": d}


def test_zoo_report_table_and_reasons(zoo_run: dict) -> None:
    g, p, st = zoo_run["graph"], zoo_run["plan"], zoo_run["stats"]
    rep = build_report(st, p, g, "cpu", step_time_s=0.1)
    saved = [t for t in g.tensors if t.saved and t.evictable]
    assert len(rep.rows) == len(saved)
    by_id = {r.tensor: r for r in rep.rows}
    for t in saved:
        r = by_id[t.id]
        assert r.planned == p.policy_of(t.id) and r.nbytes == t.nbytes and r.stage == t.producer
        assert r.module == g.stages[t.producer].module
        if r.source == "plan":  # no measured eviction of it: the plan's decision and predicted cost
            assert r.decision == r.planned and (r.regen_s is not None) == (r.decision != "keep")
    assert {r.decision for r in rep.rows} - {"keep"}, "the plan evicts something"
    text = rep.render()
    for head in ("predicted (simulator) vs measured (runtime)", "saved tensors", "why memory was not saved",
                 "stage", "module", "bytes", "decision", "regen", "stalled"):
        assert head in text
    assert rep.reasons, "a run under a budget always has something to say"
    assert all(r.code and r.message for r in rep.reasons)


def test_zoo_report_agrees_with_simulate_and_stats(zoo_run: dict) -> None:
    """Predicted figures are the simulator's (what `hybridmem simulate` prints for the same graph,
    plan and device: for `--device cpu` and a CPU capture, the capture's op times, the plan's `measured`
    model); measured figures are the runtime's ``stats()``."""
    from hybridmem.cli import main as cli

    g, p, st, d = zoo_run["graph"], zoo_run["plan"], zoo_run["stats"], zoo_run["dir"]
    assert p.device == "measured"
    rep = build_report(st, p, g)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(["simulate", "--graph", str(d / "graph.json"), "--plan", str(d / "plan.yaml"),
                    "--device", "cpu", "--json"]) == 0
    sim_cli = json.loads(out.getvalue())
    sim = simulate(g, p, device="measured")
    for key in ("peak_bytes", "time_s", "stall_s", "compute_s", "recompute_s", "bytes_h2d", "bytes_d2h", "host_s"):
        assert rep.predicted[key] == sim_cli[key] == getattr(sim, key), key
    assert rep.predicted["min_budget_bytes"] == min_feasible_budget(g)
    assert rep.measured["peak_bytes"] == st.peak_bytes and rep.measured["budget_bytes"] == st.budget_bytes
    assert rep.measured["evicted_bytes"] == st.evicted_bytes
    assert rep.measured["stall_s"] == pytest.approx(st.stall_seconds)
    assert st.peak_bytes <= st.budget_bytes
    peak_row = next(r for r in rep.comparison() if r[0] == "peak")
    assert peak_row[1] == sim.peak_bytes and peak_row[2] == st.peak_bytes


def test_stats_report_method(zoo_run: dict) -> None:
    """``hybridmem.stats().report()`` (Stats.report: the one-line hook-up) gives the measured report."""
    st = zoo_run["stats"]
    if not hasattr(st, "report"):
        pytest.fail("Stats.report() is not wired up yet (see the hook-up in the report of issue 6)")
    rep = st.report()
    assert rep.measured["peak_bytes"] == st.peak_bytes
    assert "why memory was not saved" in str(rep)
    full = st.report(plan=zoo_run["plan"], graph=zoo_run["graph"], device="cpu")
    assert full.predicted["peak_bytes"] == simulate(zoo_run["graph"], zoo_run["plan"], device="cpu").peak_bytes


def test_zoo_report_measured_rows(zoo_run: dict) -> None:
    """With the runtime's tensor log, each eviction of the run lands on its graph tensor's row
    (producer stage and size match): measured decision, regeneration time, stall."""
    g, p, st = zoo_run["graph"], zoo_run["plan"], zoo_run["stats"]
    assert getattr(st, "tensors", ()), "the runtime's tensor log is not wired up (see the hook-up in the report)"
    assert st.step_seconds and st.step_seconds > 0
    rep = build_report(st, p, g, "cpu")
    measured = [r for r in rep.rows if r.source == "measured"]
    assert measured and all(r.decision in ("swap", "recompute", "compress", "hybrid") for r in measured)
    assert any(r.regen_s is not None for r in measured)  # evicted and never read again: no regeneration
    matched = [r for r in measured if r.tensor is not None]
    assert len(matched) >= 0.9 * len(measured), "evictions should land on the graph's tensors"
    assert sum(r.nbytes for r in measured) <= st.evicted_bytes
    assert rep.measured["step_time_s"] == st.step_seconds


# ---- run files and the command ------------------------------------------------------------------------
def test_run_file_round_trip_and_dispatch(zoo_run: dict, tmp_path: Path) -> None:
    g, p, st = zoo_run["graph"], zoo_run["plan"], zoo_run["stats"]
    path = save_run(tmp_path / "run.json", st, p, g, device="cpu", step_time_s=0.25)
    assert is_run_file(path)
    bench = tmp_path / "results.json"
    bench.write_text(json.dumps({"schema": "hybridmem-bench/1", "measured": [], "simulated": []}))
    assert not is_run_file(bench) and not is_run_file(tmp_path / "missing.json")
    rep = load_run(path)
    direct = build_report(st, p, g, "cpu", step_time_s=0.25)
    assert rep.predicted == direct.predicted
    assert rep.measured == json.loads(json.dumps(direct.measured))
    assert [r.decision for r in rep.rows] == [r.decision for r in direct.rows]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argparse.Namespace(results=path, json=False, output=tmp_path / "out")) == 0
    assert "predicted (simulator) vs measured (runtime)" in out.getvalue()
    assert (tmp_path / "out" / "report.txt").is_file() and (tmp_path / "out" / "report.json").is_file()


def test_stats_only_run_file(tmp_path: Path) -> None:
    stats = {"device": "cpu", "budget_bytes": None, "peak_bytes": 1000, "current_bytes": 10, "policies": {},
             "steps": 2, "saved_bytes": 100, "notes": []}
    rep = load_run(save_run(tmp_path / "run.json", stats))
    assert rep.predicted == {} and rep.rows == []
    assert {r.code for r in rep.reasons} >= {"monitor-only", "parameters-dominate"}
    assert "no per-tensor source" in rep.render()


# ---- reason rules ----------------------------------------------------------------------------------------
def _stats(**kw) -> dict:
    base = {"device": "cpu", "budget_bytes": 1000, "peak_bytes": 990, "current_bytes": 0, "steps": 1,
            "saved_bytes": 800, "saved_tensors": 8, "min_budget_bytes": 0, "cap_overruns": 0, "plan": "none",
            "plan_note": "", "notes": [],
            "policies": {"swap": {"evicted": 3, "evicted_bytes": 300, "regenerated": 3, "regenerated_bytes": 300,
                                  "regen_seconds": 0.01, "stall_seconds": 0.01}}}
    base.update(kw)
    return base


def codes(rep) -> list[str]:
    return [r.code for r in rep.reasons]


def test_reason_budget_below_minimum() -> None:
    g = chain_graph(4, nbytes=100)
    rep = build_report(_stats(budget_bytes=150, min_budget_bytes=0, peak_bytes=150), None, g, "cpu")
    assert codes(rep)[0] == "budget-below-minimum"
    assert str(min_feasible_budget(g) - 150) in str(rep.reasons[0].bytes)


def test_reason_parameters_dominate() -> None:
    g = chain_graph(4, nbytes=10, param_bytes=10_000)
    rep = build_report(None, Plan.keep_all(g), g, "cpu")
    assert "parameters-dominate" in codes(rep)
    assert "parameters" in next(r.message for r in rep.reasons if r.code == "parameters-dominate")


def test_reason_transfers_not_hidden_predicted() -> None:
    # A swap-in issued right before its reader on a slow link cannot be hidden.
    g = chain_graph(4, nbytes=1 << 28, cost=1e-6)
    p = Plan(actions=[Action("swap_out", 1, 0), Action("free", 1, 0), Action("swap_in", 1, 7)],
             graph_hash=g.structure_hash(), solver="test")
    rep = build_report(None, p, g, "v100-16gb")
    assert rep.predicted["stall_s"] > 0 and "transfers-not-hidden" in codes(rep)
    row = next(r for r in rep.rows if r.tensor == 1)
    assert row.decision == "swap" and row.stalled and row.stall_s > 0


def test_reason_non_deterministic_producer() -> None:
    g = chain_graph(4)
    g.stages[1].deterministic = False
    rep = build_report(None, None, g, "cpu")
    assert "non-deterministic-op" in codes(rep)


def test_reasons_from_the_runtime() -> None:
    rep = build_report(_stats(plan="diverged", plan_note="stage 7: the plan expects mm, the program ran addmm",
                              cap_overruns=2, notes=["12 saved tensors also referenced by the program"]))
    c = codes(rep)
    assert {"plan-diverged", "cap-overruns", "referenced-by-program"} <= set(c)
    assert "monitor-only" in codes(build_report(_stats(budget_bytes=None)))
    idle = build_report(_stats(peak_bytes=500, policies={}))
    assert "budget-not-binding" in codes(idle)


# ---- the runtime's tensor log ------------------------------------------------------------------------------
def test_tensor_log_rows_merge_with_the_plan() -> None:
    g = chain_graph(4, nbytes=100)
    p = Plan(actions=[Action("swap_out", 1, 0), Action("free", 1, 0), Action("swap_in", 1, 7)],
             graph_hash=g.structure_hash(), solver="test")
    log = TensorLog(limit=3)
    e1 = SimpleNamespace(uid=1, stage=0, origin="mm", nbytes=100)
    e2 = SimpleNamespace(uid=2, stage=2, origin="mm", nbytes=100)
    for step in range(2):  # the same tensor evicted in two steps: one row, summed
        log.evicted(e1, "swap", 1)
        log.regenerated(e1, 0.001, 0.0005)
    log.evicted(e2, "recompute", 3)
    log.regenerated(e2, 0.002, 0.0)
    rep = build_report(_stats(), p, g, "cpu", tensors=log.records())
    r1 = next(r for r in rep.rows if r.tensor == 1)
    assert r1.source == "measured" and r1.decision == "swap"
    assert r1.regen_s == pytest.approx(0.002) and r1.stalled and r1.stall_s == pytest.approx(0.001)
    r3 = next(r for r in rep.rows if r.tensor == 3)
    assert r3.decision == "recompute" and r3.stalled is False
    assert len(log.records()) == 3
    log.evicted(SimpleNamespace(uid=3, stage=1, origin="relu", nbytes=8), "compress", 4)
    assert len(log.records()) == 3  # bounded


def test_cli_report_dispatches_run_files(zoo_run: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``hybridmem report`` renders a run file as the decision report (bench results go to bench.report)."""
    from hybridmem.cli import main as cli

    path = save_run(tmp_path / "run.json", zoo_run["stats"], zoo_run["plan"], zoo_run["graph"], device="cpu")
    assert cli(["report", str(path)]) == 0
    assert "why memory was not saved" in capsys.readouterr().out
    assert cli(["report", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted"]["peak_bytes"] == zoo_run["plan"].predicted_peak_bytes
