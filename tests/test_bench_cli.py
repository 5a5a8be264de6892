"""`hybridmem bench --quick` and `hybridmem report`: the README's demo and the report renderer.

The quick demo runs once (about a minute on 2 cores) in a subprocess, as a user would run it; the rest
use small hand-made results files and tiny models.
"""
from __future__ import annotations

import io
import re
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridmem.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]

try:
    import matplotlib  # noqa: F401
    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False

try:
    import bench.report as report
    import bench.runner as runner
    from bench import measure, progress
except ImportError:  # installed layout
    import hybridmem.bench.report as report  # type: ignore[no-redef]
    import hybridmem.bench.runner as runner  # type: ignore[no-redef]
    from hybridmem.bench import measure, progress  # type: ignore[no-redef]


# ---- the demo --------------------------------------------------------------------------------------
def test_quick_writes_json_markdown_and_prints_tables_which_report_rerenders(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """One demo run (about 40 s on 2 cores) checked whole, then rendered again by ``hybridmem report``."""
    out = tmp_path / "quick"
    env = {**os.environ, "HYBRIDMEM_PROGRESS": "0"}
    proc = subprocess.run([sys.executable, "-m", "hybridmem.cli", "bench", "--quick", "-o", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = report.load_results(out / "results.json")
    assert data["quick"] is True and data["schema"] == report.SCHEMA
    assert data["measured"], "the demo measures at least one model on the CPU"
    run = data["measured"][0]
    methods = {r["method"]: r for r in run["results"]}
    assert methods["unmanaged"]["status"] == "ok" and methods["unmanaged"]["peak_bytes"] > 0
    assert run["budget_bytes"] and run["budget_bytes"] < methods["unmanaged"]["peak_bytes"]
    for r in run["results"]:
        if r["status"] == "ok" and r["method"] != "unmanaged":
            assert r["losses_identical"], f"{r['method']}: losses differ from the unmanaged run"
    md = (out / "results.md").read_text()
    assert "Measured on this CPU" in md
    assert "Measured on this CPU" in proc.stdout and "| method" in proc.stdout
    if data["simulated"]:
        assert "Simulated on device models" in md and "simulated" in proc.stdout
    if HAVE_MPL:
        assert list(out.glob("*.png")), "matplotlib is installed but no plot was written"
    else:
        assert "matplotlib is not installed" in proc.stderr

    again = tmp_path / "again"
    assert cli_main(["report", str(out / "results.json"), "-o", str(again)]) == 0
    assert "| method" in capsys.readouterr().out
    assert (again / "results.md").exists()


# ---- report on a small hand-made file --------------------------------------------------------------
LONG_NOTE = ("fell back: the MILP found no solution within the time limit, so the approximation's plan is "
             "reported instead and the bytes no policy could evict are listed in the plan's info")


def _results() -> dict:
    gib = 2**30
    budgets = [2 * gib, 3 * gib, 4 * gib]
    sim_results = []
    for m, base in (("hybridmem-approx", 0.02), ("chen", 0.20), ("swap-opt", 0.05)):
        for i, b in enumerate(budgets):
            ok = not (m == "swap-opt" and i == 0)
            sim_results.append({"method": m, "solver": m.removeprefix("hybridmem-"), "budget_bytes": b,
                                "status": "ok" if ok else "infeasible", "time_s": 1 + base / (i + 1),
                                "overhead": base / (i + 1), "gap_to_bound": base / (i + 2), "solve_s": 0.1 * (i + 1),
                                "peak_bytes": b - 1000})
    sim_results[0]["note"] = LONG_NOTE  # longer than a cell: must appear whole, as a footnote
    return {
        "schema": report.SCHEMA, "created": "2026-01-01T00:00:00", "command": "hybridmem bench", "quick": False,
        "wall_s": 12.0, "env": {"hybridmem": "0.1.0", "torch": torch.__version__, "cpu": "test", "cores": 2},
        "missing": ["simulated method dtr: solver 'dtr' is not registered"],
        "measured": [{"model": "resnet50", "size": "small", "batch": 8, "steps": 3, "rounds": 4, "threads": 1,
                      "peak_source": "hybridmem meter", "monitor_peak_bytes": 23 << 20, "saved_bytes": 13 << 20,
                      "budget_bytes": 18 << 20, "notes": [],
                      "results": [
                          {"method": "unmanaged", "status": "ok", "step_s": 0.1, "overhead": 0.0,
                           "peak_bytes": 23 << 20, "losses_identical": True},
                          {"method": "hybridmem-online", "status": "ok", "step_s": 0.11, "overhead": 0.1,
                           "peak_bytes": 17 << 20, "budget_ok": True, "losses_identical": True,
                           "grads_identical": True, "buffers_identical": True,
                           "evicted_bytes": {"swap": 3 << 20, "recompute": 2 << 20}},
                          {"method": "ckpt-sqrt", "status": "skipped", "reason": "not a chain"}]}],
        "simulated": [{"model": "resnet50", "size": "paper", "batch": 64, "device": "h100-80gb", "stages": 461,
                       "keep_all_peak_bytes": 5 * gib, "keep_all_time_s": 1.0, "min_feasible_bytes": 1 * gib,
                       "budgets": budgets, "results": sim_results,
                       "bounds": [{"budget_bytes": b, "lower_bound_s": 1.01, "lower_bound_overhead": 0.01}
                                  for b in budgets],
                       "timeline": {"method": "hybridmem-approx", "budget_bytes": 2 * gib, "num_forward": 5,
                                    "memory": [1 * gib, 2 * gib, 2 * gib, gib, gib, gib, gib, gib, gib, 0],
                                    "host_memory": [0, 0, gib, gib, gib, gib, 0, 0, 0, 0],
                                    "keep_all_memory": [gib, 2 * gib, 3 * gib, 4 * gib, 5 * gib, 4 * gib, 3 * gib,
                                                        2 * gib, gib, 0]}}],
    }


def test_report_renders_tables_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_results()))
    assert cli_main(["report", str(path)]) == 0
    printed = capsys.readouterr()
    md = (tmp_path / "run.md").read_text()
    for text in ("Measured on this CPU", "Simulated on device models", "hybridmem-approx", "inf.", "Solver time",
                 "+2.0 %", "skipped (see the notes)", "- torch checkpoint_sequential, sqrt(n): skipped: not a chain",
                 "swap/recompute bound of the full graph", f"[1] {LONG_NOTE}\n"):
        assert text in md, text
    assert re.search(r"^\| hybridmem-approx .*\| \[1\] +\|$", md, re.M), "the cell names the footnote"
    assert "Measured on this CPU" in printed.out
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    if HAVE_MPL:
        assert pngs == ["measured.png", "memory_resnet50_h100-80gb.png", "overhead_h100-80gb.png",
                        "solver_time.png"]
        assert all((tmp_path / p).stat().st_size < 200_000 for p in pngs), "plots should stay small"
        assert "![overhead_h100-80gb](overhead_h100-80gb.png)" in md
    else:
        assert not pngs and "matplotlib is not installed" in printed.err


def test_report_bad_input_gives_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["report", str(tmp_path / "nope.json")]) == 2
    assert "no such results file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "hybridmem-bench/1", "measured": [')
    assert cli_main(["report", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": 1, "stages": []}))
    assert cli_main(["report", str(other)]) == 2
    assert "not a hybridmem bench results file" in capsys.readouterr().err
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"schema": report.SCHEMA, "measured": {"a": 1}}))
    assert cli_main(["report", str(wrong)]) == 2
    assert "'measured' must be a list" in capsys.readouterr().err


def test_bench_bad_options_give_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["bench", "--quick", "--models", "alexnet", "-o", str(tmp_path)]) == 2
    assert "unknown model(s) ['alexnet']" in capsys.readouterr().err
    assert cli_main(["bench", "--quick", "--devices", "tpu9", "-o", str(tmp_path)]) == 2
    assert "tpu9" in capsys.readouterr().err


# ---- pieces ----------------------------------------------------------------------------------------
def test_budget_points_span_minimum_to_peak() -> None:
    pts = runner.budget_points(100, 700, 6)
    assert pts[0] == 100 and pts[-1] == 700 and len(pts) == 6
    assert runner.budget_points(5, 5, 6) == [5]


@pytest.fixture(scope="module")
def tiny_graph():
    from hybridmem.graph.costs import apply_costs, get_cost_model

    torch.set_num_threads(1)
    # planned for an H100: captured on meta (a CPU capture measures the CPU kernels' scratch, which
    # dominates this tiny graph's peak: no budget below it would fit)
    return apply_costs(runner.capture_graph("vgg16", "tiny", "meta"), get_cost_model("h100-80gb"))


def test_minimum_search_finds_where_plans_start(tiny_graph) -> None:
    from hybridmem.errors import BudgetInfeasibleError
    from hybridmem.graph.simulate import min_feasible_budget, simulate
    from hybridmem.solvers import plan

    g, peak, lower = tiny_graph, tiny_graph.peak_bytes(), min_feasible_budget(tiny_graph)
    probes = ("dtr", "capuchin")  # the deterministic ones (approx has a time limit: its reach varies with load)
    r = runner.find_minimum(g, "h100-80gb", lower, peak, solvers=probes, tolerance=0.01)
    m, tol = r["minimum_bytes"], r["tolerance_bytes"]
    assert lower <= m <= peak and r["lower_bound_bytes"] == lower and tol == int(0.01 * peak)
    assert r["found_by"] in probes and r["solvers"] == list(probes)
    p = plan(g, m, device="h100-80gb", solver=r["found_by"])  # a plan at the minimum, within it
    assert simulate(g, p, device="h100-80gb", budget=m).peak_bytes <= m
    if m - tol > lower:  # and none a tolerance below it, from any probe planner
        for s in probes:
            with pytest.raises(BudgetInfeasibleError):
                plan(g, m - tol, device="h100-80gb", solver=s)
    assert {"budget_bytes", "solver", "status", "solve_s"} <= set(r["probes"][0])


def test_sweep_starts_at_a_budget_with_a_plan(tiny_graph, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "MIN_PROBES", ("dtr", "capuchin"))  # deterministic probes (see above)
    run = runner.simulate_model(tiny_graph, "h100-80gb", ["dtr", "chen"], 3, 5.0)
    assert run["min_feasible_bytes"] <= run["solver_minimum_bytes"] == run["budgets"][0]
    assert run["budgets"][-1] == run["keep_all_peak_bytes"] and len(run["budgets"]) == 3
    lowest = [r for r in run["results"] if r["budget_bytes"] == run["budgets"][0]]
    assert any(r["status"] == "ok" for r in lowest)
    assert run["minimum_search"]["found_by"] in ("dtr", "capuchin")
    assert "lowest budget found with a plan" in report.simulated_markdown(run)


def test_pool_max_keeps_peaks() -> None:
    xs = [0] * 5000
    xs[1234] = 99
    pooled = runner._pool_max(xs, 100)
    assert len(pooled) <= 100 and max(pooled) == 99


def test_progress_is_quiet_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDMEM_PROGRESS", raising=False)
    buf = io.StringIO()
    with progress.Progress(3, "x", stream=buf) as bar:
        bar.update()
        bar.note("working")
    assert buf.getvalue() == ""
    monkeypatch.setenv("HYBRIDMEM_PROGRESS", "1")
    buf = io.StringIO()
    with progress.Progress(2, "plans", stream=buf) as bar:
        bar.note("resnet50")
        bar.update(2)
    last = buf.getvalue().split("\r")[-1]
    assert last.startswith("plans: 100%") and "2/2" in last and "resnet50" in last


def test_progress_log_mode_writes_one_line_per_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDMEM_PROGRESS", "log")
    buf = io.StringIO()
    with progress.Progress(2, "plans", stream=buf) as bar:
        bar.note("a")
        bar.update()
        bar.note("b")
    assert [line.split("]")[0] for line in buf.getvalue().splitlines()] == ["[0/2 plans", "[1/2 plans"]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


def _chain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Sequential(_Block(), _Block()),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Sequential(nn.Linear(4 * 4 * 4, 10)))


def test_torch_checkpoint_comparators_match_unmanaged() -> None:
    model, x = _chain(), torch.randn(2, 3, 8, 8)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    res, _ = measure.run_methods(model, x, loss_fn, ["ckpt-sqrt", "ckpt-block", "save-on-cpu"], budget=None,
                                 steps=1, warmup=1, measure_peaks=False)
    by = {r.method: r for r in res}
    for m in ("ckpt-sqrt", "ckpt-block", "save-on-cpu"):
        assert by[m].status == "ok", by[m].reason
        assert by[m].losses_identical and by[m].grads_identical, m
    # torch.utils.checkpoint re-runs BatchNorm forward: its running statistics move twice (DESIGN.md)
    assert by["ckpt-block"].buffers_identical is False


def test_sequential_view_refuses_models_that_are_not_chains() -> None:
    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) + x

    with pytest.raises(measure.Unavailable, match="not a plain chain"):
        measure.sequential_view(Skip(), torch.randn(2, 4))
    with pytest.raises(measure.Unavailable, match="keyword inputs"):
        measure.sequential_view(Skip(), {"x": torch.randn(2, 4)})


# ---- pytest-benchmark baseline -------------------------------------------------------------------------
def test_benchmark_baseline_storage_is_in_the_repository() -> None:
    pytest.importorskip("pytest_benchmark")
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_conftest", ROOT / "bench" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    # left at pytest-benchmark's default: the repository's bench/baseline, whatever the working directory
    from pytest_benchmark.plugin import add_global_options

    defaults = {}
    add_global_options(lambda name, *a, **kw: defaults.setdefault(name, kw.get("default")))
    assert defaults["--benchmark-storage"] == conftest.PLUGIN_DEFAULT_STORAGE
    assert conftest.storage_uri(conftest.PLUGIN_DEFAULT_STORAGE) == f"file://{ROOT / 'bench' / 'baseline'}"
    assert conftest.storage_uri("file:///elsewhere") == "file:///elsewhere"  # an explicit choice is kept
    assert (ROOT / "bench" / "baseline").is_dir()


BENCH_TEST = """
def test_tiny(benchmark):
    benchmark(sum, range(100))
"""


def test_benchmark_save_then_compare(tmp_path: Path) -> None:
    """The documented save / compare commands, on a trivial benchmark (the real suites take minutes)."""
    pytest.importorskip("pytest_benchmark")
    (tmp_path / "test_tiny_bench.py").write_text(BENCH_TEST)
    store = tmp_path / "store"
    base = [sys.executable, "-m", "pytest", "test_tiny_bench.py", "-q", "-p", "no:cacheprovider",
            f"--benchmark-storage={store}", "--benchmark-max-time=0.01", "--benchmark-min-rounds=3"]
    # a run of its own: under pytest-xdist the worker's variables would make pytest-benchmark disable itself
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    saved = subprocess.run([*base, "--benchmark-autosave"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env=env)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    files = list(store.glob("*/0001_*.json"))
    assert len(files) == 1
    run = json.loads(files[0].read_text())
    assert run["benchmarks"][0]["name"] == "test_tiny"
    # A baseline 1000 times faster than anything real, saved as run 0002: comparing against it must fail
    # the run, so the comparison is enforced (with a real baseline, a >25 % slower mean fails the same way).
    for k in ("min", "max", "mean", "median"):
        run["benchmarks"][0]["stats"][k] /= 1000
    files[0].with_name("0002_faster.json").write_text(json.dumps(run))
    compared = subprocess.run([*base, "--benchmark-compare=0002", "--benchmark-compare-fail=mean:25%"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    out = compared.stdout + compared.stderr
    assert compared.returncode != 0 and "Performance has regressed" in out and "0002" in out, out


# ---- bench.rebound: the valid swap/recompute bound added to a saved run ------------------------------
def _rebound_module():
    try:
        import bench.rebound as rebound
    except ImportError:  # installed layout
        import hybridmem.bench.rebound as rebound  # type: ignore[no-redef]
    return rebound


def test_rebound_raises_bounds_only_where_higher_and_recomputes_gaps(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridmem.graph.costs import apply_costs, get_cost_model
    from hybridmem.graph.simulate import min_feasible_budget, simulate
    from hybridmem.solvers.bound import lower_bound

    rebound = _rebound_module()
    torch.set_num_threads(1)
    dev = "v100-16gb"  # VGG16 (small) on V100: the host link makes the bound exceed the compute time
    g0 = runner.capture_graph("vgg16", "small", "meta")
    g = apply_costs(g0, get_cost_model(dev))
    base = simulate(g, None, device=dev)
    ka, peak = base.time_s, int(base.peak_bytes)
    lo = int(min_feasible_budget(g))
    tight = int(lo + 0.1 * (peak - lo))
    valid = lower_bound(g, tight, dev)
    assert valid.kind == "swap/recompute" and valid.time_s > ka * 1.001  # the test needs a non-trivial bound
    lp = 1.5 * ka  # a recorded LP bound above the valid one (at the peak): it must stay
    run = {"model": "vgg16", "size": "small", "batch": g0.meta["batch"], "device": dev, "stages": g0.num_stages,
           "tensors": len(g0.tensors), "keep_all_peak_bytes": peak, "keep_all_time_s": ka, "budgets": [tight, peak],
           "bounds": [{"budget_bytes": tight, "lower_bound_s": ka, "lower_bound_overhead": 0.0, "source": "compute time"},
                      {"budget_bytes": peak, "lower_bound_s": lp, "lower_bound_overhead": 0.5,
                       "source": "LP relaxation"}],
           "results": [
               {"method": "hybridmem-approx", "budget_bytes": tight, "status": "ok", "time_s": 1.1 * valid.time_s,
                "gap_to_bound": 1.1 * valid.time_s / ka - 1},
               {"method": "capuchin", "budget_bytes": tight, "status": "ok", "time_s": 0.99 * valid.time_s,
                "gap_to_bound": 0.99 * valid.time_s / ka - 1},  # faster than the valid bound: must be flagged
               {"method": "chen", "budget_bytes": tight, "status": "infeasible"},
               {"method": "dtr", "budget_bytes": peak, "status": "ok", "time_s": 1.6 * ka, "gap_to_bound": 1.6 / 1.5 - 1}]}
    data = {"schema": report.SCHEMA, "command": "hybridmem bench", "measured": [], "missing": [], "simulated": [run]}
    src, dst = tmp_path / "in.json", tmp_path / "out.json"
    src.write_text(json.dumps(data))
    assert rebound.main([str(src), "-o", str(dst)]) == 0
    out = json.loads(dst.read_text())
    new = out["simulated"][0]
    b0, b1 = new["bounds"]
    # raised at the tight budget: the bound, its overhead and source, and every plan's gap there
    assert b0["lower_bound_s"] == pytest.approx(valid.time_s) and b0["source"] == "swap/recompute bound"
    assert b0["lower_bound_overhead"] == pytest.approx(valid.time_s / ka - 1)
    assert b0["valid_bound_s"] == pytest.approx(valid.time_s) and b0["valid_bound_kind"] == "swap/recompute"
    rows = {r["method"]: r for r in new["results"]}
    assert rows["hybridmem-approx"]["gap_to_bound"] == pytest.approx(0.1)
    assert rows["capuchin"]["gap_to_bound"] == pytest.approx(-0.01)
    assert "gap_to_bound" not in rows["chen"]
    # kept at the peak, where the recorded bound is higher; the valid bound is still stored
    assert (b1["lower_bound_s"], b1["lower_bound_overhead"], b1["source"]) == (lp, 0.5, "LP relaxation")
    assert b1["valid_bound_kind"] == "compute" and b1["valid_bound_s"] == pytest.approx(ka)
    assert rows["dtr"]["gap_to_bound"] == pytest.approx(1.6 / 1.5 - 1)
    # everything else as it was; what was done is recorded, with the plan below the valid bound
    assert {k: v for k, v in out.items() if k not in ("simulated", "rebound")} == \
        {k: v for k, v in data.items() if k != "simulated"}
    assert {k: v for k, v in new.items() if k not in ("bounds", "results")} == \
        {k: v for k, v in run.items() if k not in ("bounds", "results")}
    rec = out["rebound"]
    assert (rec["raised"], rec["budgets"], rec["below_valid_bound"]) == (1, 2, 1)
    assert rec["runs"][0]["below_valid_bound"][0]["method"] == "capuchin"

    # a graph that is not the run's (here: the stage count differs) is refused, naming what differs
    monkeypatch.setattr(rebound, "capture_graph", lambda *a, **k: g0)  # no second capture
    data["simulated"][0]["stages"] += 1
    with pytest.raises(ValueError, match="stages"):
        rebound.rebound(data)
    with pytest.raises(ValueError, match="schema"):
        rebound.rebound({"schema": "other"})


def test_compiled_bench_margins_are_checked_and_restored() -> None:
    from bench import compiled
    from hybridmem.compile import tuning

    assert compiled._margins(None) == (None,) and compiled._margins("0.11,0.08") == (0.11, 0.08)
    for bad in ("lots", "1.5", ","):
        with pytest.raises(SystemExit, match=r"--margins .*\[0, 1\)"):
            compiled._margins(bad)
    before = tuning.INDUCTOR_MARGIN
    with compiled._margin(0.05):
        assert tuning.INDUCTOR_MARGIN == 0.05
    assert tuning.INDUCTOR_MARGIN == before
    assert compiled._label(None, 0.5, 0.08) == "hybridmem@amb=0.5 margin=0.08"


def test_gpu_check_knapsack_ratios_are_checked() -> None:
    import argparse

    from bench.gpu_check import _ratios

    assert _ratios("0.5,0.2") == (0.5, 0.2)
    assert _ratios("") == ()
    for bad in ("half", "0", "1.5", "0.5,-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="ratio"):
            _ratios(bad)


@pytest.mark.slow
def test_gpu_check_sets_the_knapsack_beside_the_backend_on_a_dry_run(one_thread) -> None:
    """bench/gpu_check.py's compiled rows on the CPU (no budget binds there): the knapsack's row and
    hybridmem's at its peak, timed interleaved, with the gradients compared."""
    from bench.gpu_check import check_compiled

    lines = [ln for ln in check_compiled("gpt", "tiny", torch.device("cpu"), ambs=(0.5,))
             if not ln.startswith("  ")]
    assert len(lines) == 2 and all(ln.endswith("  ok") for ln in lines), lines
    row = lines[1]
    assert row.startswith("compiled gpt amb=0.5") and "knapsack: peak" in row and "median of 10 interleaved" in row
    assert re.search(r"step x\d\.\d{3}  \|", row) and re.search(r"\), step x\d\.\d{3}  \(unmanaged", row), row


@pytest.mark.slow
def test_gpu_bench_dry_run_on_the_cpu(tmp_path, one_thread) -> None:
    """bench/gpu_bench.py's rows on the CPU (the GPU command, prepared): every row ran, hybridmem's within its
    budget and bit-identical to the unmanaged row, and the markdown and JSON written."""
    import json

    from bench.gpu_bench import main

    rows = "unmanaged,checkpoint,selective,save_on_cpu,watch,online@ckpt,planned@ckpt"
    assert main(["--device", "cpu", "--size", "tiny", "--models", "gpt", "--rows", rows, "--steps", "4",
                 "--md", str(tmp_path / "g.md"), "--json", str(tmp_path / "g.json")]) == 0
    results = json.loads((tmp_path / "g.json").read_text())["results"]
    assert [r["row"] for r in results] == rows.split(",")
    assert not [r for r in results if r["error"]], results
    for r in results[1:]:
        assert r["same"] == "yes", r
    for r in results:
        if r["budget"]:
            assert r["peak"] <= r["budget"] and r["steady"] > 0, r
    assert "| gpt | online@ckpt |" in (tmp_path / "g.md").read_text()
    with pytest.raises(SystemExit):
        main(["--rows", "unmanaged,nope"])


def test_host_cost_runs_each_variant_beside_plain_and_checks_its_options(capsys: pytest.CaptureFixture,
                                                                         one_thread) -> None:
    from bench import host_cost

    assert host_cost.main(["resnet50", "--blocks", "1", "--steps", "3", "--skip", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"resnet50 \(tiny\): plain step [\d.]+ ms\n  watch: [\d.]+x .*\n  far: [\d.]+x ", out), out
    with pytest.raises(SystemExit):
        host_cost.main(["resnet50", "--variants", "watch,fast"])
    assert "unknown: fast (variants: watch, far;" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        host_cost.main(["resnet50", "--skip", "5", "--steps", "5"])
    assert "--skip must be at least 0 and below --steps (5), got 5" in capsys.readouterr().err
