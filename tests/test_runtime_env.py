"""No code change: ``HYBRIDMEM_BUDGET=... python script.py`` and ``hybridmem run`` behave like
``hybridmem.enable()`` inside the script (subprocesses: the start-up hook runs at interpreter start)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from torch import nn
    import hybridmem

    torch.set_num_threads(1)
    if os.environ.get("ENABLE_IN_SCRIPT"):
        hybridmem.enable(budget=int(os.environ["ENABLE_IN_SCRIPT"]), policies=("recompute",), device="cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(inplace=True), nn.Dropout(0.1), nn.Linear(128, 128),
                          nn.Tanh(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4))
    x = torch.randn(2048, 32)
    losses = []
    for _ in range(3):  # plain SGD by hand: torch.optim imports torch._dynamo (seconds per process)
        loss = model(x).square().mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.1)
                p.grad = None
        losses.append(loss.item().hex())
    try:
        s = hybridmem.stats()
        stats = {"peak": s.peak_bytes, "budget": s.budget_bytes, "steps": s.steps, "saved": s.saved_bytes,
                 "evicted": {k: v.evicted for k, v in s.policies.items()}}
    except RuntimeError:
        stats = None
    print(json.dumps({"losses": losses, "stats": stats, "args": sys.argv[1:]}))
""")


def _run(tmp_path: Path, env: dict[str, str], argv: list[str] | None = None, check: bool = True
         ) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    full = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDMEM_")}
    full.update(env, HYBRIDMEM_DEVICE="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    cmd = argv if argv is not None else [sys.executable, str(script), "--flag"]
    res = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    if check:
        assert res.returncode == 0, res.stderr
    return res


def _out(res: subprocess.CompletedProcess) -> dict:
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Monitor-only run through the environment: its peak (in the cap's units) sets the budget of the
    managed runs."""
    out = _out(_run(tmp_path_factory.mktemp("ref"), {"HYBRIDMEM_BUDGET": "none"}))  # the allocator: the cap's units
    assert out["stats"]["budget"] is None and out["stats"]["steps"] == 3
    return out


@pytest.fixture(scope="module")
def via_env(tmp_path_factory: pytest.TempPathFactory, reference: dict) -> dict:
    """The managed run through the environment, at the issue's budget."""
    budget = reference["stats"]["peak"] - int(0.4 * reference["stats"]["saved"])
    out = _out(_run(tmp_path_factory.mktemp("env"), {"HYBRIDMEM_BUDGET": str(budget),
                                                     "HYBRIDMEM_POLICIES": "recompute"}))
    assert out["stats"]["budget"] == budget
    return out


def test_environment_matches_enable_in_script(tmp_path: Path, reference: dict, via_env: dict,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import runpy

    import hybridmem

    budget = via_env["stats"]["budget"]
    (tmp_path / "train.py").write_text(SCRIPT)
    # enable() inside the script: run here, in this process (a subprocess costs seconds of imports)
    script = tmp_path / "train.py"
    monkeypatch.setenv("ENABLE_IN_SCRIPT", str(budget))
    monkeypatch.setattr(sys, "argv", [str(script), "--flag"])
    capsys.readouterr()
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        hybridmem.disable()
    in_script = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the same decisions and results; the peak is the allocator's, which also holds what the process
    # allocated lazily on the way (a fresh interpreter and this test process differ by a page or so)
    peaks = via_env["stats"]["peak"], in_script["stats"]["peak"]
    strip = lambda out: {**out, "stats": {k: v for k, v in out["stats"].items() if k != "peak"}}  # noqa: E731
    assert strip(via_env) == strip(in_script) and abs(peaks[0] - peaks[1]) <= 0.01 * budget, peaks
    assert via_env["losses"] == reference["losses"]
    assert via_env["stats"]["peak"] <= budget and via_env["stats"]["evicted"]["recompute"] > 0
    assert via_env["args"] == ["--flag"]


def test_hybridmem_run_matches_the_environment(tmp_path: Path, via_env: dict) -> None:
    budget = via_env["stats"]["budget"]
    (tmp_path / "train.py").write_text(SCRIPT)
    cli = [sys.executable, "-m", "hybridmem.cli", "run", "--budget", str(budget), "--policies", "recompute",
           "--report", str(tmp_path / "run.json"), str(tmp_path / "train.py"), "--flag"]
    assert _out(_run(tmp_path, {}, cli)) == via_env
    from hybridmem.runfile import load_run  # --report is HYBRIDMEM_REPORT: the run file is written at exit

    assert load_run(tmp_path / "run.json").measured["peak_bytes"] == via_env["stats"]["peak"]


def test_bad_environment_stops_with_a_message(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import torch  # noqa: F401  (already imported: the runtime is enabled at once, not deferred)

    from hybridmem import _autoload

    monkeypatch.setenv("HYBRIDMEM_BUDGET", "12XB")
    with pytest.raises(SystemExit) as e:
        _autoload.maybe_enable()  # torch is imported here: enables at once
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid budget '12XB'" in err and "512MiB" in err


def test_hook_imports_nothing_without_variables(tmp_path: Path) -> None:
    code = ("import sys, hybridmem._autoload as a; print(a.maybe_enable(), 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("HYBRIDMEM_")})
    assert res.stdout.split() == ["False", "False"], res.stderr


def test_report_is_saved_at_exit_and_renders(tmp_path: Path, via_env: dict,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from hybridmem.cli import main
    from hybridmem.runfile import is_run_file, load_run

    budget = via_env["stats"]["budget"]
    path = tmp_path / "out" / "run.json"
    res = _run(tmp_path, {"HYBRIDMEM_BUDGET": str(budget), "HYBRIDMEM_POLICIES": "recompute",
                          "HYBRIDMEM_REPORT": str(path)})
    assert _out(res) == via_env  # the report changes nothing about the run
    assert is_run_file(path)
    saved = json.loads(path.read_text())
    assert saved["extra"]["environment"]["HYBRIDMEM_REPORT"] == str(path)
    rep = load_run(path)
    # the figures are the run's own, as the script printed them from hybridmem.stats()
    assert rep.measured["peak_bytes"] == via_env["stats"]["peak"] <= budget == rep.measured["budget_bytes"]
    assert rep.measured["steps"] == 3 and rep.measured["policies"]["recompute"]["evicted"] > 0
    capsys.readouterr()
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "hybridmem decision report: run.json" in out and "recompute" in out


def test_report_path_must_be_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import torch  # noqa: F401  (already imported: enables at once)

    import hybridmem
    from hybridmem import _autoload

    monkeypatch.setenv("HYBRIDMEM_BUDGET", "none")
    monkeypatch.setenv("HYBRIDMEM_REPORT", "run.txt")
    with pytest.raises(SystemExit) as e:
        _autoload.maybe_enable()
    assert e.value.code == 2
    assert "HYBRIDMEM_REPORT='run.txt': give a .json file name" in capsys.readouterr().err
    assert not hybridmem.enabled()  # refused before anything was enabled


def test_report_path_per_rank_under_torchrun() -> None:
    from hybridmem._autoload import report_path

    assert report_path({}) is None
    assert report_path({"HYBRIDMEM_REPORT": "r/run.json"}) == "r/run.json"
    assert report_path({"HYBRIDMEM_REPORT": "run.json", "WORLD_SIZE": "2", "RANK": "1"}) == "run.rank1.json"


def test_startup_hook_imports_only_the_standard_library_before_torch() -> None:
    # With the variable set, a program that never imports torch loads nothing beyond the standard library
    # (and hybridmem's own hook); the runtime is enabled once the program imports torch.
    code = ("import sys; mods = [m for m in sys.modules if m.split('.')[0] not in sys.stdlib_module_names]; "
            "print(sorted(m for m in mods if not m.startswith(('hybridmem', '_distutils_hack', '__editable__')) "
            "and m != '__main__'))")
    bare = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDMEM_")}
    env = {**bare, "HYBRIDMEM_BUDGET": "1GiB"}
    # what the interpreter loads anyway (other packages' .pth start-up files) is not hybridmem's
    base = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=bare)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.stdout.strip() == base.stdout.strip(), res.stdout + res.stderr
    res = subprocess.run([sys.executable, "-c", "import sys; print('numpy' in sys.modules)"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.stdout.strip() == "False", res.stderr
    res = subprocess.run([sys.executable, "-c", "import torch, hybridmem; print(hybridmem.enabled())"],
                         capture_output=True, text=True, timeout=120, env={**env, "HYBRIDMEM_DEVICE": "cpu"})
    assert res.stdout.strip() == "True", res.stderr


@pytest.mark.parametrize("command", [
    ["-m", "hybridmem.cli", "run", "train.py"],             # hybridmem run: the CLI's imports bring torch in
    ["-c", "import hybridmem.solvers, torch, hybridmem; print('enabled', hybridmem.enabled())"],
    ["-c", "import hybridmem.runtime.compose, torch, hybridmem; print('enabled', hybridmem.enabled())"],
])
def test_torch_imported_by_hybridmem_enables_after_that_import(tmp_path: Path, command: list[str]) -> None:
    # torch imported first by a hybridmem module: enabling waits until that import has finished, instead of
    # importing the runtime while its own modules are half-initialized (a circular-import ImportError, exit 2)
    (tmp_path / "c.yaml").write_text("budget: 64MiB\n")
    (tmp_path / "train.py").write_text("import hybridmem\nprint('enabled', hybridmem.enabled())\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HYBRIDMEM_")}, "HYBRIDMEM_CONFIG": "c.yaml"}
    res = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "enabled True" in res.stdout and "cannot enable" not in res.stderr
