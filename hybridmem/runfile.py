"""Run files (JSON, schema ``hybridmem-run/1``): a run's stats with the plan and graph it followed, written
at exit (``HYBRIDMEM_REPORT=run.json``, ``hybridmem run --report``) and rendered by ``hybridmem report``.

A run that followed a plan file (``HYBRIDMEM_PLAN``, ``--plan``) gets that plan and the graph it was made for
(:func:`graph_file_of`: written beside the plan by ``hybridmem plan -o``), so that the report sets the plan's
predictions beside what was measured, per tensor."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Mapping

from .errors import PlanFormatError
from .graph.ir import Graph
from .graph.plan import Plan
from .report import Report, build_report, stats_dict
from .runtime.stats import Stats

__all__ = ["save_run", "load_run", "is_run_file", "main", "RUN_SCHEMA"]

RUN_SCHEMA = "hybridmem-run/1"


def save_run(path: str | Path, stats: Stats | Mapping[str, Any], plan: Plan | None = None,
             graph: Graph | None = None, *, device: str | None = None, step_time_s: float | None = None,
             extra: Mapping[str, Any] | None = None) -> Path:
    """Write a run file (JSON, schema ``hybridmem-run/1``): the stats, and the plan and graph if given,
    for ``hybridmem report RUN.json`` to render later."""
    d: dict[str, Any] = {"schema": RUN_SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                         "stats": stats_dict(stats), "device": device, "step_time_s": step_time_s}
    if plan is None and graph is None:
        plan, graph, note = followed_plan(extra)
        if note:
            d["plan_note"] = note
    if plan is not None:
        d["plan"] = plan.to_dict()
    if graph is not None:
        d["graph"] = graph.to_dict()
    if extra:
        d["extra"] = dict(extra)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, default=_json_default))
    return path


def graph_file_of(plan_path: str | Path) -> Path:
    """Where ``hybridmem plan -o PLAN`` writes the graph the plan was made for: ``PLAN.graph.json``."""
    p = Path(plan_path)
    return p.with_name(p.name + ".graph.json")


def followed_plan(extra: Mapping[str, Any] | None) -> tuple[Plan | None, Graph | None, str]:
    """The plan file a run followed (``HYBRIDMEM_PLAN`` in ``extra["environment"]``) and its graph, or why not."""
    env = (extra or {}).get("environment") or {}
    name = env.get("HYBRIDMEM_PLAN")
    if not name:
        return None, None, ""
    path = Path(name)
    if not path.is_file():
        return None, None, f"the plan {name} is not a file here (a plan book, or moved): predictions left out"
    gpath = graph_file_of(path)
    if not gpath.is_file():
        return None, None, (f"the plan's graph {gpath} is missing (`hybridmem plan -o {name}` writes it): "
                            "predictions left out")
    try:
        return Plan.load(path), Graph.load(gpath), ""
    except Exception as e:  # at exit: the report loses its predictions, the run file is still written
        return None, None, f"could not read the plan {name} or its graph: {type(e).__name__}: {e}"


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return str(o)


def is_run_file(path: str | Path) -> bool:
    """Whether ``path`` is a run file (``hybridmem report`` dispatches on this, else bench results)."""
    p = Path(path)
    if not p.is_file() or p.suffix.lower() != ".json":
        return False
    try:
        with p.open() as f:
            head = f.read(200)
    except OSError:
        return False
    return f'"schema": "{RUN_SCHEMA}"' in head or f'"schema":"{RUN_SCHEMA}"' in head


def load_run(path: str | Path) -> Report:
    """Read a run file and build its report."""
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: not a readable run file: {e}") from None
    if not isinstance(d, dict) or d.get("schema") != RUN_SCHEMA:
        raise ValueError(f"{p}: schema {d.get('schema') if isinstance(d, dict) else None!r} is not {RUN_SCHEMA!r}")
    plan = Plan.from_dict(d["plan"], source=f"{p}: plan") if d.get("plan") else None
    graph = Graph.from_dict(d["graph"], source=f"{p}: graph") if d.get("graph") else None
    if plan is not None and graph is None:
        raise PlanFormatError(f"{p}: has a plan but not the graph it was made for")
    rep = build_report(d.get("stats") or None, plan, graph, d.get("device"), step_time_s=d.get("step_time_s"),
                       title=f"hybridmem decision report: {p.name}")
    if d.get("plan_note"):
        rep.meta["plan_note"] = d["plan_note"]
    return rep


def main(args: Any) -> int:
    """``hybridmem report RUN.json``: print the decision report (``--json``: as JSON)."""
    rep = load_run(args.results)
    if getattr(args, "json", False):
        print(json.dumps(rep.to_dict(), default=_json_default))
    else:
        print(rep.render())
    out = getattr(args, "output", None)
    if out:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.txt").write_text(rep.render(top=10**9) + "\n")
        (out / "report.json").write_text(json.dumps(rep.to_dict(), default=_json_default))
    return 0
