"""The benchmark's method names and labels, importable without torch (``hybridmem bench --help`` lists them)."""
from __future__ import annotations

# measured on this CPU (bench.measure runs them)
METHODS: tuple[str, ...] = ("unmanaged", "hybridmem-monitor", "hybridmem-online", "hybridmem-recompute",
                            "hybridmem-recompute-mode", "hybridmem-plan",
                            "ckpt-sqrt", "ckpt-block", "ckpt-selective", "save-on-cpu")
LABELS: dict[str, str] = {
    "unmanaged": "unmanaged (plain PyTorch)",
    "hybridmem-monitor": "hybridmem monitor-only (budget=None)",
    "hybridmem-monitor-ops": "hybridmem monitor-only, every op metered (monitor='ops')",
    "hybridmem-online": "hybridmem online",
    "hybridmem-recompute": "hybridmem online, recompute only",
    "hybridmem-recompute-mode": "hybridmem online, recompute only, every step under the dispatch mode",
    "hybridmem-plan": "hybridmem with plan",
    "hybridmem-plan-recompute": "hybridmem with a recompute-only plan, recompute only",
    "ckpt-sqrt": "torch checkpoint_sequential sqrt(n)",
    "ckpt-block": "torch checkpoint per block",
    "ckpt-selective": "torch selective activation checkpointing per block (matmul/conv/attention outputs kept)",
    "save-on-cpu": "torch save_on_cpu",
}

# simulated: planned for a device model and judged by the simulator (bench.runner)
SIM_METHODS: tuple[str, ...] = ("hybridmem-milp", "hybridmem-approx", "chen", "checkmate", "swap-vdnn",
                                "swap-opt", "capuchin", "dtr")
# bench method name -> solver name given to hybridmem.solvers.plan
SOLVER_OF = {"hybridmem-milp": "milp", "hybridmem-approx": "approx"}


def methods_help() -> str:
    """The ``--methods`` names, one per line with what each is, for ``hybridmem bench --help``."""
    from hybridmem.cli import solver_descriptions

    descriptions = solver_descriptions()
    sim = [(m, descriptions.get(SOLVER_OF.get(m, m), "")) for m in SIM_METHODS]
    measured = [(m, LABELS[m]) for m in METHODS]
    width = max(len(m) for m, _ in sim + measured)
    lines = ["methods (--methods), simulated on a device model:"]
    lines += [f"  {m:<{width}}  {d}" for m, d in sim]
    lines.append("measured on this CPU (small zoo sizes):")
    lines += [f"  {m:<{width}}  {d}" for m, d in measured]
    return "\n".join(lines)
