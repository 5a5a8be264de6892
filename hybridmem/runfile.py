"""Run files (JSON, schema ``hybridmem-run/1``): a run's stats with the plan and graph it followed, written
at exit (``HYBRIDMEM_REPORT=run.json``, ``hybridmem run --report``) and rendered by ``hybridmem report``."""
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
    return build_report(d.get("stats") or None, plan, graph, d.get("device"), step_time_s=d.get("step_time_s"),
                        title=f"hybridmem decision report: {p.name}")


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
