"""The command line as a newcomer meets it: a factory beside the user, the loss contract, capture on
meta for device models, the summary `hybridmem run` prints, and help texts that say the defaults."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridmem.cli import main
from hybridmem.graph.units import fmt_bytes

MYMODELS = '''
import torch
from torch import nn

SEEN = []  # the device of every forward's input: "meta" only when no real step ran


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        conv = lambda cin, cout: [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
        self.body = nn.Sequential(*conv(3, 32), *conv(32, 32), nn.MaxPool2d(2), *conv(32, 64), *conv(64, 64),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        SEEN.append(x.device.type)
        return self.head(self.body(x))


def factory():
    torch.manual_seed(0)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    return dict(model=Net(), inputs=x, targets=y, loss_fn=nn.CrossEntropyLoss())


def by_shape(batch, seq):  # for --shapes BATCHxSEQ: seq is the image side here
    x, y = torch.randn(batch, 3, seq, seq), torch.randint(0, 10, (batch,))
    return dict(model=Net(), inputs=x, targets=y, loss_fn=nn.CrossEntropyLoss())


def one_argument_loss():
    model, x = Net(), torch.randn(4, 3, 8, 8)
    return model, x, nn.CrossEntropyLoss()


def targets_with_one_argument_loss():
    return dict(model=Net(), inputs=torch.randn(4, 3, 8, 8), targets=torch.zeros(4, dtype=torch.long),
                loss_fn=lambda out: out.sum())


def typo_key():
    return dict(model=Net(), inputs=torch.randn(4, 3, 8, 8), loss=None)
'''


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A working directory holding mymodels.py, as a user's project folder would; imported fresh."""
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "mymodels", raising=False)
    yield tmp_path
    sys.modules.pop("mymodels", None)


def test_factory_beside_the_user_is_planned_on_meta_for_a_device_model(user_dir: Path, capsys) -> None:
    assert str(user_dir) not in sys.path and "" not in sys.path
    assert main(["plan", "--model", "mymodels:factory", "--budget", "60%", "--device", "h100-80gb", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["peak_bytes"] <= summary["budget_bytes"] == int(0.6 * summary["keep_all_peak_bytes"])
    assert sys.modules["mymodels"].SEEN == ["meta"]  # the factory's model never ran a real step
    assert str(user_dir) not in sys.path  # the working directory was on the path for the command only


def test_planning_for_the_cpu_captures_a_real_cpu_step(user_dir: Path, capsys) -> None:
    assert main(["capture", "--model", "mymodels:factory", "--device", "cpu"]) == 0
    assert sys.modules["mymodels"].SEEN == ["cpu", "cpu", "cpu"]  # two warm-up steps, then the step captured
    out = capsys.readouterr().out
    assert out.startswith("captured Net on cpu:") and "op times: the cpu cost model" in out


def test_capture_says_which_cost_model_set_the_op_times(user_dir: Path, capsys) -> None:
    assert main(["capture", "--model", "mymodels:factory"]) == 0
    assert sys.modules["mymodels"].SEEN == ["meta"]
    out = capsys.readouterr().out
    assert out.startswith("captured Net on meta:") and "op times: the h100-80gb cost model" in out
    summaries = {}
    for device in ("h100-80gb", "v100-16gb"):
        assert main(["capture", "--model", "mymodels:factory", "--device", device, "--json"]) == 0
        summaries[device] = json.loads(capsys.readouterr().out)
        assert (summaries[device]["capture_device"], summaries[device]["cost_model"]) == ("meta", device)
    assert f"compute {summaries['h100-80gb']['compute_s'] * 1e3:.2f} ms" in out
    assert summaries["v100-16gb"]["compute_s"] > summaries["h100-80gb"]["compute_s"]  # the older chip is slower


@pytest.mark.parametrize("factory,message", [
    ("one_argument_loss", r"loss_fn CrossEntropyLoss\(input: torch\.Tensor, target: torch\.Tensor\).*is called as "
                          r"loss_fn\(output\).*targets=y\), which calls loss_fn\(output, targets\)"),
    ("targets_with_one_argument_loss", r"loss_fn <lambda>\(out\) is called as loss_fn\(output, targets\)"),
    ("typo_key", r"unknown key\(s\) \['loss'\]; FACTORY\(\) must return .* or a dict with keys model, inputs"),
    ("nope", r"mymodels has no callable 'nope'"),
])
def test_factory_contract_errors_show_what_is_expected(user_dir: Path, capsys, factory: str, message: str) -> None:
    assert main(["capture", "--model", f"mymodels:{factory}"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert sys.modules["mymodels"].SEEN == []  # refused before anything ran


def test_missing_module_says_where_it_is_looked_for(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["capture", "--model", "not_here_models:factory"]) == 2
    assert "working directory or on PYTHONPATH" in capsys.readouterr().err


def test_simulate_prints_the_same_numbers_with_and_without_json(tmp_path: Path, capsys) -> None:
    graph, plan = tmp_path / "g.yaml", tmp_path / "p.yaml"
    assert main(["capture", "--model", "vgg16", "--size", "tiny", "-o", str(graph)]) == 0
    assert main(["plan", "--graph", str(graph), "--budget", "97%", "--solver", "checkmate", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--graph", str(graph), "--plan", str(plan), "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert main(["simulate", "--graph", str(graph), "--plan", str(plan)]) == 0
    out, counted = capsys.readouterr().out.strip().split("\n  the peak counts:\n")
    table = dict(line.split(None, 1) for line in out.splitlines())
    assert "gradients before the step:" in counted and "optimizer state:" in counted   # full["counted"], in words
    assert table["budget_bytes"] == fmt_bytes(full["budget_bytes"]) and full["budget_bytes"] > 0
    assert table["peak_bytes"] == fmt_bytes(full["peak_bytes"])
    assert table["time_s"] == f"{full['time_s'] * 1e3:.3f} ms"
    assert table["device"] == full["device"] == "h100-80gb"
    scalars = {k for k, v in full.items() if v is None or isinstance(v, (int, float, str))}
    assert set(table) == scalars


TRAIN = '''
import json, sys
import torch
from torch import nn
import hybridmem

torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.Tanh())])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(1024, 256)
for _ in range(3):
    model(x).square().mean().backward()
    opt.step(); opt.zero_grad()
st = hybridmem.stats()
json.dump({**st.to_dict(), "regen_seconds": st.regen_seconds, "stall_seconds": st.stall_seconds},
          open(sys.argv[1], "w"))
'''


def _run(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    out = subprocess.run([sys.executable, "-m", "hybridmem.cli", "run", *flags, str(script), str(tmp_path / "st.json")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return out, json.loads((tmp_path / "st.json").read_text())


def test_run_ends_with_a_summary_of_stats(tmp_path: Path) -> None:
    budget = 12 << 20
    out, st = _run(tmp_path, "--budget", str(budget), "--policies", "recompute")
    summary = out.stderr[out.stderr.index("hybridmem run on"):]
    evicted = st["policies"]["recompute"]["evicted_bytes"]
    assert evicted > 0 and st["peak_bytes"] <= budget
    assert summary.splitlines()[0] == (f"hybridmem run on {st['device']}: peak {fmt_bytes(st['peak_bytes'])} of a "
                                       f"{fmt_bytes(budget)} budget ({st['peak_bytes'] / budget:.0%}, within), "
                                       f"3 step(s), {st['step_seconds'] * 1e3:.1f} ms per step")
    assert re.search(rf"^  recompute +evicted +{re.escape(fmt_bytes(evicted))} \({st['policies']['recompute']['evicted']}"
                     rf" tensors\), regenerated {re.escape(fmt_bytes(st['policies']['recompute']['regenerated_bytes']))}",
                     summary, re.M), summary
    assert (f"  regeneration {st['regen_seconds'] * 1e3:.1f} ms, stalls {st['stall_seconds'] * 1e3:.1f} ms in all"
            in summary)
    assert f"  plan: {st['plan']}" in summary


def test_run_without_budget_measures_and_quiet_silences(tmp_path: Path) -> None:
    out, st = _run(tmp_path)
    assert f"peak {fmt_bytes(st['peak_bytes'])} (measure only: no budget)" in out.stderr
    out, _ = _run(tmp_path, "--quiet")
    assert "hybridmem run on" not in out.stderr


@pytest.mark.parametrize("argv,expected", [
    (["plan", "--help"], r"\(default:\s+h100-80gb\)"),
    (["capture", "--help"], r"\(default:\s+h100-80gb\)"),
    (["bench", "--help"], r"hybridmem-approx .*\n(.*\n)*\s+ckpt-block +torch checkpoint per block"),
    (["report", "--help"], r"results\.json\s+written by `hybridmem bench`"),
])
def test_help_says_defaults_and_names(capsys, argv: list[str], expected: str) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    out = capsys.readouterr().out
    assert re.search(expected, out), out


def test_profiler_start_stop_lines_are_dropped(capfd) -> None:
    import torch

    try:
        from bench.measure import alloc_peak
    except ImportError:
        from hybridmem.bench.measure import alloc_peak  # type: ignore[no-redef]
    assert alloc_peak(lambda: torch.ones(1 << 12).sum()) >= 4 << 12
    assert "USDT" not in capfd.readouterr().err


def test_run_summary_flags_a_peak_over_budget_and_names_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridmem.cli import run_summary
    from hybridmem.runtime.stats import Stats

    st = Stats(device="cpu", budget_bytes=100 << 20, peak_bytes=120 << 20, current_bytes=0, policies={},
               plan="diverged", plan_note="stage 7: expected mm, saw addmm")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    lines = run_summary(st).splitlines()
    assert lines[0] == "hybridmem run (rank 1) on cpu: peak 120.00 MiB of a 100.00 MiB budget (120%, OVER), 0 step(s)"
    assert "  evicted nothing" in lines and lines[-2] == "  plan: diverged (stage 7: expected mm, saw addmm)"
    assert lines[-1].startswith("  steady state: 0 of 0 step(s) without per-op work")


def test_a_shape_the_zoo_model_cannot_take_is_refused_before_any_plan_is_written(tmp_path: Path, capsys) -> None:
    book = tmp_path / "plans"
    assert main(["plan", "--model", "transformer", "--size", "small", "--budget", "70%", "--shapes", "8x32", "8x128",
                 "-o", str(book)]) == 2
    assert "--shapes 8x128: transformer: seq 128 exceeds max_positions 64; nothing was planned" in capsys.readouterr().err
    assert not book.exists()


def test_shapes_take_the_same_factory_contract(user_dir: Path, capsys) -> None:
    assert main(["plan", "--model", "mymodels:by_shape", "--budget", "100%", "--shapes", "4x8", "4x16",
                 "-o", "plans", "--json"]) == 0
    buckets = json.loads(capsys.readouterr().out)["buckets"]
    assert [b["shape_key"].split(",")[0] for b in buckets] == ["4x3x8x8:float32", "4x3x16x16:float32"]
    assert sys.modules["mymodels"].SEEN == ["meta", "meta"]
