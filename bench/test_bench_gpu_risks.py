"""bench/gpu_risks.py's dry run on the CPU: every check runs or says why it is skipped, and the report is written.

    pytest bench/test_bench_gpu_risks.py -m slow
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import gpu_risks


@pytest.mark.slow
def test_the_dry_run_runs_what_the_cpu_can_and_says_why_it_skips_the_rest(tmp_path: Path) -> None:
    assert gpu_risks.main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_risks.json").read_text())
    checks = {r["name"]: r for r in report["checks"]}
    assert list(checks) == list(gpu_risks.CHECKS) and report["dry_run"]
    assert checks["compile-r2"]["passed"] is True, checks["compile-r2"]
    # the probe of the generated code sees the hazard the fence removes
    assert checks["compile-r2"]["variants"]["fence=False,reuse=True"]["reused_early"]
    for r in checks.values():
        assert r["passed"] is not None or r["detail"].startswith("skipped: needs CUDA"), r
    md = (tmp_path / "gpu_risks.md").read_text()
    assert all(f"| {name} |" in md for name in checks)


def test_only_names_checks_or_sections_and_refuses_others() -> None:
    assert gpu_risks.select("compile-r2") == ["compile-r2"]
    assert gpu_risks.select("compile") == [n for n, (s, _) in gpu_risks.CHECKS.items() if s == "compile"]
    with pytest.raises(SystemExit, match="unknown nope; known checks: compile-r1"):
        gpu_risks.select("nope")
