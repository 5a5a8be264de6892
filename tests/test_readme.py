"""The README as a newcomer follows it: every command, run in the order written, in a temporary folder.

Fenced ``bash`` blocks are commands, one per line (a trailing ``\\`` continues it). A ``python`` block
whose first line is ``# NAME.py`` is that file, written where it appears. A comment line
``<!-- docs-test: skip: WHY -->`` right before a block leaves it out (network, the test suite itself);
``<!-- docs-test: slow -->`` runs it only with ``-m slow``. In a slow or run block, ``pip install``
steps are not run (the environment under test is already installed) but must name extras that exist.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"(?:<!-- docs-test: (?P<mark>[^>]*?) -->\n)?^```(?P<lang>\w*)\n(?P<body>.*?)^```", re.S | re.M)
MAKING = re.compile(r"session [0-9]|the issue's|dev box|lent to the session", re.I)


@dataclass
class Step:
    kind: str        # "file" or "run"
    text: str        # file content, or the command line
    name: str = ""   # file name
    mark: str = ""   # "", "slow" or "skip: why"


def readme_steps(text: str) -> list[Step]:
    """The README's files and commands, in order."""
    steps = []
    for m in FENCE.finditer(text):
        lang, body, mark = m["lang"], m["body"], (m["mark"] or "").strip()
        if lang == "python":
            first = body.splitlines()[0]
            name = re.match(r"# (\S+\.py)\b", first)
            assert name, f"a python block must start with '# NAME.py' to be written and run: {first!r}"
            steps.append(Step("file", body, name[1], mark))
        elif lang == "bash":
            steps += [Step("run", line, mark=mark) for line in _lines(body)]
    return steps


def _lines(body: str) -> list[str]:
    """Command lines of a bash block: continuations joined, blank and comment-only lines dropped."""
    joined = re.sub(r"\s*\\\n\s*", " ", body)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _without_installs(command: str) -> str:
    """``command`` minus its ``pip install`` steps (checked to name existing extras instead)."""
    kept = []
    for part in (p.strip() for p in command.split("&&")):
        if part.startswith("pip install"):
            for extras in re.findall(r"\.\[([\w,]+)\]", part):
                assert set(extras.split(",")) <= _extras(), f"{part!r} names an extra pyproject.toml lacks"
            continue
        kept.append(part)
    return " && ".join(kept)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDMEM_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `python`, `hybridmem`
    return env


def run_readme(folder: Path, *, slow: bool) -> list[str]:
    """Write and run the README's steps in ``folder``; returns the commands run."""
    ran = []
    for step in readme_steps(README.read_text()):
        if step.mark.startswith("skip") or (step.mark == "slow" and not slow):
            continue
        if step.kind == "file":
            (folder / step.name).write_text(step.text)
            continue
        command = _without_installs(step.text)
        if not command:
            continue
        out = subprocess.run(["bash", "-c", command], cwd=folder, env=_env(), capture_output=True, text=True,
                             timeout=900)
        assert out.returncode == 0, (f"README command failed ({out.returncode}): {command}\n"
                                     f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}")
        ran.append(command)
    return ran


def test_readme_commands_run_in_order(tmp_path: Path) -> None:
    ran = run_readme(tmp_path, slow=False)
    assert any(c.startswith("hybridmem run --budget 20MiB train.py") for c in ran) and len(ran) >= 10


@pytest.mark.slow
def test_readme_commands_run_in_order_with_the_slow_ones(tmp_path: Path) -> None:
    ran = run_readme(tmp_path, slow=True)
    assert ran[0] == "hybridmem bench --quick"
    assert (tmp_path / "bench-results" / "results.json").is_file()
    assert sorted(p.name for p in (tmp_path / "bench-results").glob("*.png")), "the demo draws its plots"


def test_readme_marks_say_why_and_ci_runs_the_test_line() -> None:
    steps = readme_steps(README.read_text())
    marks = {s.mark for s in steps if s.mark}
    assert all(m == "slow" or re.fullmatch(r"skip: \S.*", m) for m in marks), marks
    test_line = next(s.text for s in steps if "python -m pytest" in s.text)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_line in ci, "the README's test command is the line CI runs"
    assert any(s.kind == "run" and s.text.endswith("hybridmem bench --quick") for s in steps[:3])


def test_readme_parser_reads_marks_files_and_continuations() -> None:
    text = ("<!-- docs-test: slow -->\n```bash\na && \\\n  b   # c\n# only a comment\n```\n"
            "```python\n# x.py: doc\nprint(1)\n```\n```text\nnot run\n```\n")
    assert readme_steps(text) == [Step("run", "a && b   # c", mark="slow"),
                                  Step("file", "# x.py: doc\nprint(1)\n", "x.py")]
    with pytest.raises(AssertionError, match="NAME.py"):
        readme_steps("```python\nprint(1)\n```\n")


def test_docs_speak_of_the_software_not_of_its_making() -> None:
    files = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [f"{f.name}:{i}: {line.strip()}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1)
             if MAKING.search(line)]
    assert found == []


def test_every_subpackage_is_in_the_wheel() -> None:
    """pyproject lists the packages a wheel holds by name: each one on disk must be there (a missing one
    installs fine and fails at import, e.g. ``hybridmem.compile`` for ``torch.compile(backend=...)``)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = {f"hybridmem.{k.split('.', 1)[1]}": v for k, v in cfg["package-dir"].items()}
    on_disk = {"hybridmem." + ".".join(p.parent.relative_to(ROOT / "hybridmem").parts)
               for p in (ROOT / "hybridmem").rglob("__init__.py") if p.parent != ROOT / "hybridmem"}
    on_disk |= {"hybridmem"} | {name for name, d in dirs.items() if (ROOT / d / "__init__.py").is_file()}
    assert on_disk <= listed, f"not in pyproject's [tool.setuptools] packages: {sorted(on_disk - listed)}"
