"""A CPU plan's predicted step time against the measured one: ``python -m bench.step_time [MODELS] [--size bench]``.

For each zoo model: one warm-up step, a capture on this CPU, a plan for ``--device cpu`` at ``--budget`` of the
keep-all peak (what ``hybridmem plan --model M --device cpu --budget 70%`` makes; where no plan fits that, the
least budget with one, + 1 %), then ``--steps`` steps under
the runtime following it (SGD, one thread). Prints the plan's predicted step time (the simulator's, under the
``cpu`` device model), the measured mean of the steps after the first two (the first records the step, the
second may still build the steady state), the unmanaged step, measured / predicted, and the same plan replayed
with the capture's own measured op times (``simulate(..., device="measured")``).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import hybridmem
from hybridmem import solvers
from hybridmem.errors import BudgetInfeasibleError
from hybridmem.graph.costs import apply_costs, get_cost_model
from hybridmem.zoo import MODELS, build


def _step(e, opt) -> None:
    opt.zero_grad(set_to_none=True)
    e.loss().backward()
    opt.step()


def measure(name: str, size: str, budget: str, steps: int) -> dict:
    e = build(name, size)
    opt = torch.optim.SGD(e.model.parameters(), lr=0.01)
    _step(e, opt)  # warm-up: first-call effects out of the captured op times
    opt.zero_grad(set_to_none=True)
    g = apply_costs(hybridmem.capture(e.model, e.inputs, e.loss_fn, device="cpu"), get_cost_model("cpu"))
    try:
        plan = solvers.plan(g, budget, device="cpu", time_limit=10)
    except BudgetInfeasibleError as err:  # VGG-16's largest stage: planned at the least budget that has a plan
        if err.minimum_bytes is None:
            raise
        plan = solvers.plan(g, int(err.minimum_bytes * 1.01), device="cpu", time_limit=10)
    t0 = time.perf_counter()
    for _ in range(steps):
        _step(e, opt)
    plain = (time.perf_counter() - t0) / steps
    times = []
    with hybridmem.session(budget=plan.budget_bytes, plan=plan):
        for _ in range(steps):
            t0 = time.perf_counter()
            _step(e, opt)
            times.append(time.perf_counter() - t0)
        st = hybridmem.stats()
    measured = sum(times[2:]) / max(len(times) - 2, 1)
    by_ops = hybridmem.simulate(g, plan, device="measured", check_hash=False).time_s  # the capture's own op times
    return {"model": name, "predicted_s": plan.predicted_time_s, "measured_s": measured, "unmanaged_s": plain,
            "ratio": measured / plan.predicted_time_s, "plan": st.plan, "note": st.plan_note,
            "budget_share": plan.budget_bytes / g.peak_bytes(),
            "predicted_measured_ops_s": by_ops}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_time", description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(MODELS), help="zoo names (default: all)")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--budget", default="70%", help="of the keep-all peak (default 70%%)")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print("| model | budget / keep-all | predicted | measured | measured/predicted | predicted from the capture's op times "
          "| unmanaged | plan |\n|---|---:|---:|---:|---:|---:|---:|---|")
    for name in args.models:
        r = measure(name, args.size, args.budget, args.steps)
        print(f"| {name} | {r['budget_share']:.0%} | {r['predicted_s'] * 1e3:.1f} ms | {r['measured_s'] * 1e3:.1f} ms | {r['ratio']:.2f} | "
              f"{r['predicted_measured_ops_s'] * 1e3:.1f} ms | {r['unmanaged_s'] * 1e3:.1f} ms | {r['plan']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
