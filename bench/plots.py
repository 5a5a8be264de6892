"""PNG plots of a bench results file (matplotlib, the optional ``plot`` extra).

Each function takes the plain dicts of the results JSON (see :mod:`bench.runner`) and a path, and
writes one small PNG (about 100 dpi, a few tens of KiB) fit to commit under ``docs/img/``.
:func:`available` says whether matplotlib can be imported; callers skip plots with a message if not.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

GIB = 2**30
# One colour and marker per method across every plot, so a method is recognisable from plot to plot.
STYLE: dict[str, tuple[str, str]] = {
    "hybridmem-milp": ("#d62728", "o"),
    "hybridmem-approx": ("#ff7f0e", "s"),
    "chen": ("#1f77b4", "^"),
    "checkmate": ("#2ca02c", "v"),
    "swap-vdnn": ("#9467bd", "D"),
    "swap-opt": ("#e377c2", "d"),
    "capuchin": ("#8c564b", "P"),
    "dtr": ("#7f7f7f", "X"),
    "keep-all": ("#000000", "."),
}
MEASURED_STYLE: dict[str, str] = {
    "unmanaged": "#000000", "hybridmem-monitor": "#ffbb78", "hybridmem-online": "#ff7f0e",
    "hybridmem-plan": "#d62728", "ckpt-sqrt": "#1f77b4", "ckpt-block": "#2ca02c", "save-on-cpu": "#9467bd",
}
_DPI = 100


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.titlesize": 10, "axes.grid": True, "grid.alpha": 0.3,
                         "legend.fontsize": 8, "figure.dpi": _DPI})
    return plt


def _pct_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:g}")


def _style(method: str) -> tuple[str, str]:
    return STYLE.get(method, ("#17becf", "*"))


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else math.nan


def overhead_vs_budget(runs: Sequence[dict[str, Any]], path: Path, *, title: str = "",
                       x: str = "percent") -> Path:
    """One panel per simulated run (model on a device): overhead % against budget, a line per method.

    ``x``: ``"percent"`` (budget as % of the keep-all peak, comparable across models) or ``"gib"``.
    Infeasible points are left out, so a line starting further right shows a method that needs more memory.
    """
    plt = _plt()
    n = len(runs)
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    size = (6.4, 4.2) if n == 1 else (3.4 * cols, 2.7 * rows + 0.9)
    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
    methods: list[str] = []
    for ax, run in zip(axes.flat, runs):
        peak = run.get("keep_all_peak_bytes") or 1
        by_method: dict[str, list[tuple[float, float]]] = {}
        for r in run.get("results", []):
            if r.get("status") != "ok":
                continue
            b = _num(r.get("budget_bytes"))
            xv = 100 * b / peak if x == "percent" else b / GIB
            by_method.setdefault(r["method"], []).append((xv, 100 * _num(r.get("overhead"))))
        for m, pts in by_method.items():
            pts.sort()
            color, marker = _style(m)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, ms=4, lw=1.3,
                    label=m, alpha=0.9)
            if m not in methods:
                methods.append(m)
        lb = [(100 * _num(r["budget_bytes"]) / peak if x == "percent" else _num(r["budget_bytes"]) / GIB,
               100 * _num(r.get("lower_bound_overhead"))) for r in run.get("bounds", [])]
        lb = [p for p in lb if not math.isnan(p[1])]
        if lb:
            ax.plot(*zip(*sorted(lb)), color="#444444", ls=":", lw=1, label="best lower bound")
            if "best lower bound" not in methods:
                methods.append("best lower bound")
        mf = _num(run.get("min_feasible_bytes"))
        xs = [p[0] for pts in by_method.values() for p in pts]
        if not math.isnan(mf):
            xm = 100 * mf / peak if x == "percent" else mf / GIB
            # When the sweep starts at a searched minimum far above the simulator's bound, the bound's
            # line would squeeze the data into the right edge: the table states it instead.
            span = (max(xs) - min(xs)) if xs else 0.0
            if not xs or not run.get("solver_minimum_bytes") or xm >= min(xs) - 0.1 * span:
                ax.axvline(xm, color="#999999", lw=0.8, ls="--", label="min. feasible (lower bound)")
        batch = f" b{run['batch']}" if run.get("batch") else ""
        ax.set_title(f"{run.get('model')}{batch} on {run.get('device')}")
        ax.set_xlabel("budget (% of keep-all peak)" if x == "percent" else "budget (GiB)")
        ax.set_ylabel("overhead vs keep-all (%)")
        # Symmetric-log y: a 0.3 % vs 3 % difference between good plans stays visible next to a
        # baseline at +170 %; linear below 1 %.
        ax.set_yscale("symlog", linthresh=1.0, linscale=0.6)
        ys = [y for line in ax.get_lines() for y in line.get_ydata() if not math.isnan(y)]
        ax.set_ylim(0, max([*ys, 1.0]) * 1.8 + 0.5)
        ax.yaxis.set_major_formatter(_pct_formatter())
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if n == 1:
        # One panel: the legend fits inside it, and its title already names the model and device.
        axes[0][0].legend(loc="best")  # the data's corner varies (lines start where plans start)
        axes[0][0].set_title(f"{title or 'Simulated overhead'}\n{axes[0][0].get_title()}")
        fig.tight_layout()
        return _save(fig, path, plt)
    handles, labels = [], []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    ncol = min(len(labels), 4 if cols < 3 else 8)
    legend_rows = math.ceil(len(labels) / ncol) if labels else 0
    fig.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False)
    fig.suptitle(title or "Simulated step-time overhead against the memory budget")
    bottom = (0.25 * legend_rows + 0.1) / fig.get_size_inches()[1]
    fig.tight_layout(rect=(0, bottom, 1, 0.96))
    return _save(fig, path, plt)


def memory_timeline(timeline: dict[str, Any], path: Path, *, title: str = "") -> Path:
    """Device bytes per stage of one step under a plan, against the budget, with host checkpoint bytes."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    mem = [v / GIB for v in timeline.get("memory", [])]
    host = [v / GIB for v in timeline.get("host_memory", [])]
    keep = [v / GIB for v in timeline.get("keep_all_memory", [])]
    xs = list(range(len(mem)))
    if keep:
        ax.plot(range(len(keep)), keep, color="#999999", lw=1, ls="--", label="keep-all (no plan)")
    ax.fill_between(xs, mem, color="#ff7f0e", alpha=0.35, lw=0)
    ax.plot(xs, mem, color="#d62728", lw=1.2, label=f"device resident ({timeline.get('method', '')})")
    if host and any(host):
        ax.plot(range(len(host)), host, color="#1f77b4", lw=1.2, label="host (swapped-out copies)")
    b = timeline.get("budget_bytes")
    if b:
        ax.axhline(b / GIB, color="#000000", lw=1.2, label=f"budget {b / GIB:.2f} GiB")
    top = max([*mem, *keep, *host, (b or 0) / GIB, 1e-9]) * 1.12  # headroom for the legend
    ax.set_ylim(0, top)
    nf = timeline.get("num_forward")
    n_stages = timeline.get("stages") or len(mem)
    if nf and len(mem):
        xnf = nf * len(mem) / n_stages  # arrays may be max-pooled: scale the stage index
        ax.axvline(xnf - 0.5, color="#666666", lw=0.8, ls=":")
        ax.text(xnf, top * 0.02, " backward →", va="bottom", fontsize=8, color="#444444")
        ax.text(xnf, top * 0.02, "← forward ", va="bottom", ha="right", fontsize=8, color="#444444")
    pooled = " (max over windows)" if timeline.get("pooled") else ""
    ax.set_xlabel(f"stage (op of the training step, in execution order){pooled}")
    ax.set_ylabel("memory (GiB)")
    ax.set_xlim(0, max(1, len(mem) - 1))
    ax.legend(loc="upper right", ncol=2)
    ax.set_title(title or f"Memory over one step: {timeline.get('model')} on {timeline.get('device')}")
    fig.tight_layout()
    return _save(fig, path, plt)


def solver_time_vs_size(rows: Sequence[dict[str, Any]], path: Path, *, title: str = "") -> Path:
    """Solver wall time (log) against graph size in stages: one series per method."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    by: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        s, t = _num(r.get("stages")), _num(r.get("solve_s"))
        if not (math.isnan(s) or math.isnan(t)):
            by.setdefault(r["method"], []).append((s, max(t, 1e-4)))
    for m, pts in sorted(by.items()):
        color, marker = _style(m)
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, s=22, label=m, alpha=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("graph size (stages)")
    ax.set_ylabel("solver time per plan (s)")
    ax.legend(loc="upper left", ncol=2)
    ax.set_title(title or "Planning time against graph size (2-core CPU)")
    fig.tight_layout()
    return _save(fig, path, plt)


def measured_overview(runs: Sequence[dict[str, Any]], path: Path, *, title: str = "") -> Path:
    """All measured models in one figure: overhead (top) and peak as % of unmanaged (bottom), a bar per
    method, grouped by model; the budget is a black tick on each model's group."""
    plt = _plt()
    methods: list[str] = []
    for run in runs:
        for r in run.get("results", []):
            if r.get("status") == "ok" and r["method"] not in methods:
                methods.append(r["method"])
    order = [m for m in MEASURED_STYLE if m in methods] + [m for m in methods if m not in MEASURED_STYLE]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(6.0, 1.25 * len(runs) + 2.5), 6.2), sharex=True)
    width = 0.8 / max(1, len(order))
    for j, m in enumerate(order):
        xs, over, peak = [], [], []
        for i, run in enumerate(runs):
            by = {r["method"]: r for r in run.get("results", [])}
            r, un = by.get(m), by.get("unmanaged")
            if not r or r.get("status") != "ok":
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            over.append(100 * _num(r.get("overhead")))
            up = _num((un or {}).get("peak_bytes"))
            peak.append(100 * _num(r.get("peak_bytes")) / up if up else math.nan)
        color = MEASURED_STYLE.get(m, "#17becf")
        a1.bar(xs, over, width, color=color, label=m)
        a2.bar(xs, peak, width, color=color)
    for i, run in enumerate(runs):
        by = {r["method"]: r for r in run.get("results", [])}
        up = _num((by.get("unmanaged") or {}).get("peak_bytes"))
        if run.get("budget_bytes") and up:
            y = 100 * run["budget_bytes"] / up
            a2.plot([i - 0.42, i + 0.42], [y, y], color="#000000", lw=1.5, label="budget" if i == 0 else None)
    a1.set_ylabel("step-time overhead\nvs unmanaged (%)")
    a2.set_ylabel("peak memory\n(% of unmanaged)")
    a2.set_ylim(0, 115)
    a2.set_xticks(range(len(runs)))
    a2.set_xticklabels([f"{r.get('model')}\n(b{r.get('batch')})" for r in runs])
    handles, labels = a1.get_legend_handles_labels()
    h2, l2 = a2.get_legend_handles_labels()
    fig.legend(handles + h2, labels + l2, loc="lower center", ncol=min(4, len(labels) + len(l2)), frameon=False)
    fig.suptitle(title or "Measured on this CPU (small sizes, 1 thread): time paid and memory saved")
    fig.tight_layout(rect=(0, 0.1, 1, 0.97))
    return _save(fig, path, plt)


def _save(fig: Any, path: Path, plt: Any) -> Path:
    """Write a PNG; palette-quantised (line plots need few colours) so it stays small enough to commit."""
    import io

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=_DPI, format="png")
    plt.close(fig)
    try:
        from PIL import Image

        img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
        img.quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    except Exception:  # Pillow missing or too old: the plain PNG is fine, only larger
        path.write_bytes(buf.getvalue())
    return path
