"""What a new user meets choosing a budget from the command line: one clear message for a budget too small, bad
values refused naming the flag they came from, the range a watching run prints, and a planned run's report
with the plan's predictions beside the measurements."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hybridmem
from hybridmem.cli import main, run_summary
from hybridmem.config import Config
from hybridmem.runfile import graph_file_of, load_run, save_run
from hybridmem.runtime.stats import PolicyStats, Stats
from hybridmem.zoo import build

MiB = 2**20


def _err(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    return capsys.readouterr().err


def test_a_bare_number_below_a_mebibyte_is_refused_naming_the_flag(capsys) -> None:
    err = _err(capsys, "run", "--budget", "12", "potatoes", "train.py")
    assert err.startswith("hybridmem run: error: --budget '12': a bare number is bytes")
    assert "'12MiB' or '12GiB'" in err and "potatoes" not in err
    with pytest.raises(ValueError, match=r"HYBRIDMEM_BUDGET='12': a bare number is bytes"):
        Config.resolve(env={"HYBRIDMEM_BUDGET": "12"})
    assert Config.resolve(env={"HYBRIDMEM_BUDGET": str(MiB)}).budget == MiB  # bytes written out still work


def test_a_bad_flag_value_names_the_flag_not_the_environment(capsys) -> None:
    err = _err(capsys, "run", "--budget", "12 potatoes", "train.py")
    assert err.startswith("hybridmem run: error: --budget '12 potatoes': invalid budget '12 potatoes' (not a size)")
    assert "HYBRIDMEM_BUDGET" not in err and "environment" not in err


def test_the_command_prefix_is_said_once(capsys) -> None:
    assert _err(capsys, "run", "no-such-script.py") == "hybridmem run: error: no such script: no-such-script.py\n"


TOO_SMALL = '''
import torch
from torch import nn
model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for _ in range(2):
    model(torch.randn(64, 512)).sum().backward()
    opt.step()
    opt.zero_grad()
'''


def test_a_budget_too_small_is_one_message_naming_the_least_and_the_command(tmp_path: Path) -> None:
    script = tmp_path / "mytrain.py"
    script.write_text(textwrap.dedent(TOO_SMALL))
    out = subprocess.run([sys.executable, "-m", "hybridmem.cli", "run", "--budget", "1MiB", "mytrain.py"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("hybridmem run:") == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("hybridmem run: mytrain.py stopped"), out.stderr
    assert "the budget of 1.00 MiB (1048576 bytes) is too small" in lines[0]
    assert lines[1].startswith("  The step ran on without the cap to measure what it needs: ")
    command = lines[2].split(": ", 1)[1]
    assert lines[2].startswith("  Train with it") and command.startswith("hybridmem run --budget ")
    # the command it names trains
    again = subprocess.run([sys.executable, "-m", "hybridmem.cli", *command.split()[1:]], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "within" in again.stderr


def _stats(**kw) -> Stats:
    base = dict(device="cpu", budget_bytes=None, peak_bytes=30 * MiB, current_bytes=MiB,
                policies={}, steps=2, saved_bytes=24 * MiB)
    return Stats(**{**base, **kw})


def test_a_watching_run_prints_the_range_to_choose_a_budget_from() -> None:
    text = run_summary(_stats())
    assert ("  choose a budget: at most 30.00 MiB (the peak: nothing to evict) and more than 6.00 MiB (the peak "
            "less the 24.00 MiB of saved activations a step can evict: no budget below works)") in text
    capped = run_summary(_stats(budget_bytes=20 * MiB, min_budget_bytes=7 * MiB,
                                policies={"recompute": PolicyStats(1, MiB, 1, MiB)}))
    assert "no budget below 7.00 MiB can work" in capped and "choose a budget" not in capped


def test_a_planned_runs_report_sets_the_plan_beside_the_measurements(tmp_path: Path, one_thread) -> None:
    e = build("resnet50", "tiny")
    g = hybridmem.capture(e.model, e.inputs, e.loss_fn, device="cpu", optimizer=None)
    p = hybridmem.plan(g, "95%", device="cpu", solver="chen")
    plan_file = tmp_path / "plan.yaml"
    p.save(plan_file)
    g.save(graph_file_of(plan_file))   # as `hybridmem plan -o plan.yaml` writes it
    t = next(g.tensors[a.tensor] for a in p.actions if a.kind == "recompute")
    stats = {**_stats(budget_bytes=p.budget_bytes).to_dict(),
             "tensors": [{"stage": t.producer, "nbytes": t.nbytes, "op": "x", "decision": "recompute",
                          "regen_s": 0.001, "stall_s": 0.001}]}
    run = save_run(tmp_path / "run.json", stats, extra={"environment": {"HYBRIDMEM_PLAN": str(plan_file)}})
    rep = load_run(run)
    assert rep.predicted["peak_bytes"] == p.predicted_peak_bytes
    [row] = [r for r in rep.rows if r.source == "measured"]
    assert row.tensor == t.id and row.planned == "recompute" and row.planned_regen_s is not None
    assert row.module == g.stages[t.producer].module != ""
    text = rep.render()
    assert "plan regen" in text and f"{p.predicted_peak_bytes} B" in text
    missing = load_run(save_run(tmp_path / "r2.json", stats, extra={"environment": {"HYBRIDMEM_PLAN": "gone.yaml"}}))
    assert "the plan gone.yaml is not a file here" in missing.render()
