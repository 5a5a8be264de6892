"""The command line: capture -> plan -> simulate on a tiny zoo model, and its error messages."""
import json

import pytest

from hybridmem.cli import main


@pytest.fixture(scope="module")
def graph_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "g.yaml"
    # planned for GPUs below: captured on meta (a CPU capture adds the CPU kernels' scratch)
    assert main(["capture", "--model", "vgg16", "--size", "tiny", "--capture-device", "meta", "-o", str(path)]) == 0
    return path


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("capture", "plan", "simulate", "run", "bench", "report"):
        assert cmd in out


def test_capture_plan_simulate_round_trip(graph_file, tmp_path, capsys):
    capsys.readouterr()
    plan_file = tmp_path / "p.yaml"
    assert main(["plan", "--graph", str(graph_file), "--budget", "97%", "--device", "v100-16gb",
                 "--solver", "checkmate", "--json", "-o", str(plan_file)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["peak_bytes"] <= summary["budget_bytes"] < summary["keep_all_peak_bytes"]
    assert summary["bytes_recomputed"] > 0
    assert main(["simulate", "--graph", str(graph_file), "--plan", str(plan_file), "--device", "v100-16gb",
                 "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["peak_bytes"] == summary["peak_bytes"] and sim["time_s"] == pytest.approx(summary["time_s"])


@pytest.mark.parametrize("argv,message", [
    (["simulate", "--graph", "{g}", "--device", "tpu-v9"], "unknown device"),
    (["plan", "--graph", "{g}", "--budget", "lots"], "invalid budget"),
    (["plan", "--graph", "{g}", "--budget", "50%", "--solver", "magic"], "unknown solver"),
    (["simulate", "--graph", "{missing}"], "cannot read"),
    (["capture", "--model", "alexnet"], "unknown model"),
])
def test_errors_name_the_problem(graph_file, tmp_path, capsys, argv, message):
    argv = [a.format(g=graph_file, missing=tmp_path / "nope.yaml") for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_stale_plan_is_refused(graph_file, tmp_path, capsys):
    other = tmp_path / "other.yaml"
    assert main(["capture", "--model", "resnet50", "--size", "tiny", "-o", str(other)]) == 0
    plan_file = tmp_path / "p.yaml"
    assert main(["plan", "--graph", str(other), "--budget", "100%", "--solver", "keep-all", "-o", str(plan_file)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--graph", str(graph_file), "--plan", str(plan_file)]) == 2
    assert "capture and plan again" in capsys.readouterr().err


def test_bench_options_reach_the_runner(tmp_path, capsys):
    # an unknown method is refused by the runner: proof that --methods got there
    assert main(["bench", "--quick", "--methods", "teleport", "--no-simulated", "-o", str(tmp_path)]) == 2
    assert "unknown method(s) ['teleport']" in capsys.readouterr().err
    assert main(["bench", "--quick", "--points", "1", "-o", str(tmp_path)]) == 2
    assert "--points must be at least 2" in capsys.readouterr().err
    # refused before anything runs
    assert main(["bench", "--quick", "--compiled", "0.5,half", "-o", str(tmp_path)]) == 2
    assert "--compiled '0.5,half': expected comma-separated ratios in [0, 1]" in capsys.readouterr().err


def test_list_solvers_describes_every_solver(capsys):
    from hybridmem.solvers import SOLVERS

    with pytest.raises(SystemExit) as e:
        main(["plan", "--list-solvers"])  # needs no --model or --budget, like --version
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == list(SOLVERS)
    assert all("(no description)" not in ln for ln in lines)


def test_unknown_solver_lists_the_known_ones(capsys):
    from hybridmem.solvers import SOLVERS

    # refused before any capture: the model name is never looked at
    assert main(["plan", "--model", "no_such_model", "--budget", "50%", "--solver", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown solver 'nope'" in err and "--list-solvers" in err
    assert all(s in err for s in SOLVERS)


def test_coarsen_target_plans_on_super_stages(graph_file, capsys):
    capsys.readouterr()
    assert main(["plan", "--graph", str(graph_file), "--budget", "95%", "--coarsen", "--target", "6",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["stages"] > 6 and summary["coarse_stages"] == 6  # the LP ran on 6 super-stages
    assert summary["peak_bytes"] <= summary["budget_bytes"]         # and the full-graph plan fits


@pytest.mark.parametrize("flags,options", [
    ([], {}),
    (["--coarsen"], {"coarsen": True}),
    (["--no-coarsen"], {"coarsen": False}),
    (["--target", "40"], {"coarsen": True, "target": 40}),
    (["--coarsen", "--target", "40", "--solver-backend", "highs"],
     {"coarsen": True, "target": 40, "solver_backend": "highs"}),
    (["--trace-sources"], {"trace_sources": True}),
])
def test_plan_options_reach_the_solver(graph_file, monkeypatch, capsys, flags, options):
    import hybridmem.solvers as solvers

    seen = {}
    real = solvers.plan

    def spy(graph, budget, **kwargs):
        seen.update(kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("coarsen", "target", "solver_backend")}
        return real(graph, budget, **kwargs)

    monkeypatch.setattr(solvers, "plan", spy)
    assert main(["plan", "--graph", str(graph_file), "--budget", "100%", "--solver", "keep-all", *flags]) == 0
    keys = ("coarsen", "target", "solver_backend", "trace_sources")
    assert {k: seen[k] for k in keys if k in seen} == options


@pytest.mark.parametrize("argv,message", [
    (["--no-coarsen", "--target", "5"], "--no-coarsen forbids them"),
    (["--shapes", "8x16", "--target", "5", "-o", "book"], "cannot be combined with --shapes"),
    (["--shapes", "8x16", "--trace-sources", "-o", "book"], "--trace-sources cannot be combined with --shapes"),
])
def test_contradictory_plan_options_are_refused(graph_file, capsys, argv, message):
    assert main(["plan", "--graph", str(graph_file), "--budget", "95%", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("target", ["1", "many"])
def test_bad_target_is_refused(graph_file, capsys, target):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--graph", str(graph_file), "--budget", "95%", "--target", target])
    assert e.value.code == 2
    assert "--target" in capsys.readouterr().err


@pytest.fixture(scope="module")
def small_graph_file(tmp_path_factory):
    from hybridmem.solvers._synth import random_graph

    path = tmp_path_factory.mktemp("cli") / "small.json"
    random_graph(8, seed=12, n_forward=3, mb=(2, 32)).save(path)
    return path


def test_plan_budget_min_names_the_least_budget(small_graph_file, capsys):
    from hybridmem.graph.ir import Graph
    from hybridmem.solvers import plan

    capsys.readouterr()
    assert main(["plan", "--graph", str(small_graph_file), "--budget", "min", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    least = summary["min_budget_bytes"]
    assert summary["peak_bytes"] <= summary["budget_bytes"] == least < summary["keep_all_peak_bytes"]
    assert summary["min_no_plan_bytes"] < least
    with pytest.raises(Exception, match="lies between"):
        plan(Graph.load(small_graph_file), summary["min_no_plan_bytes"])


def test_plan_sweep_prints_a_falling_curve_from_the_least_budget(small_graph_file, tmp_path, capsys):
    capsys.readouterr()
    assert main(["plan", "--graph", str(small_graph_file), "--sweep", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    points = out["points"]
    assert len(points) == 3 and points[-1]["budget_bytes"] == out["keep_all_peak_bytes"]
    assert [p["budget_bytes"] for p in points] == sorted(p["budget_bytes"] for p in points)
    times = [p["time_s"] for p in points]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]
    assert main(["plan", "--graph", str(small_graph_file), "--sweep", "2"]) == 0
    assert "step time" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    ([], "give --budget"),
    (["--budget", "min", "--sweep"], "give --budget"),
    (["--budget", "min", "--plot", "x.png"], "--plot draws the curve of --sweep"),
    (["--sweep", "-o", "p.yaml"], "--sweep makes one plan per budget"),
])
def test_sweep_and_budget_errors(small_graph_file, capsys, argv, message):
    assert main(["plan", "--graph", str(small_graph_file), *argv]) == 2
    assert message in capsys.readouterr().err


def test_sweep_point_count_is_checked(small_graph_file, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--graph", str(small_graph_file), "--sweep", "1"])
    assert e.value.code == 2
    assert "expected an int of at least 2" in capsys.readouterr().err


def test_a_baseline_is_declared_in_one_place(monkeypatch):
    """The baselines' registry is what ``baselines.run``, ``SOLVERS`` and ``--list-solvers`` read."""
    from hybridmem.solvers import DESCRIPTIONS, SOLVERS, baselines

    assert list(DESCRIPTIONS) == list(SOLVERS)
    assert list(SOLVERS[3:]) == list(baselines.REGISTRY) == list(baselines.BASELINES)
    assert all(DESCRIPTIONS[b.name] == b.description for b in baselines.REGISTRY.values())
    monkeypatch.setattr(baselines, "REGISTRY", dict(baselines.REGISTRY))
    baselines.baseline("dummy", "evict nothing, again")(baselines.keep_all)
    assert baselines.REGISTRY["dummy"].run is baselines.keep_all
    with pytest.raises(ValueError, match="registered twice"):
        baselines.baseline("dummy", "again")(baselines.keep_all)


@pytest.mark.parametrize("argv,expected", [
    (["--budget", "100%"], "sized"),
    (["--budget", "100%", "--solver", "greedy"], "sized"),
    (["--budget", "100%", "--time-limit", "5"], 5.0),
    (["--budget", "min"], None),
    (["--budget", "100%", "--solver", "milp"], None),
])
def test_plan_time_limit_is_sized_to_end_the_command_in_ten_seconds(small_graph_file, monkeypatch, argv, expected):
    """Without --time-limit, approx and greedy at one budget get what is left of the command's ten
    seconds (the process's age counts), at least MIN_PLAN_S; the others keep their solver's default."""
    import hybridmem.cli as cli
    import hybridmem.solvers as solvers

    seen = {}
    real = solvers.plan

    def spy(graph, budget, **kwargs):
        seen["time_limit"] = kwargs["time_limit"]
        return real(graph, budget, **kwargs)

    monkeypatch.setattr(solvers, "plan", spy)
    monkeypatch.setattr(cli, "process_age_s", lambda: 4.0)
    assert main(["plan", "--graph", str(small_graph_file), *argv]) == 0
    if expected == "sized":
        assert seen["time_limit"] == pytest.approx(cli.COMMAND_S - 4.0 - cli.FINISH_S)
        monkeypatch.setattr(cli, "process_age_s", lambda: 9.5)
        assert main(["plan", "--graph", str(small_graph_file), *argv]) == 0
        assert seen["time_limit"] == cli.MIN_PLAN_S
    else:
        assert seen["time_limit"] == expected


def test_process_age_counts_from_the_process_start():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5); from hybridmem.cli import process_age_s; "
                          "print(process_age_s())"], capture_output=True, text=True, timeout=120)
    assert 0.5 <= float(out.stdout) < 60
