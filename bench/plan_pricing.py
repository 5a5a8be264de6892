"""A CPU recompute plan priced two ways, side by side: ``python -m bench.plan_pricing MODEL [--size bench] [--rounds 10]``.

At the real peak of ``torch.utils.checkpoint`` around every block, a Checkmate (recompute-only MILP, 30 s)
plan of this CPU's captured graph priced by the nominal ``cpu`` device model (the capture's first step)
and one priced by the op times measured in a capture after a warm-up step (``MeasuredCostModel``, what
the benchmarks plan with). It prints the forward op times of the two pricings per op type, then runs
each plan beside checkpoint and plain PyTorch (``bench.measure``, interleaved rounds, one thread), twice
each in alternating order, and prints each run's plan step / checkpoint step, whether the results were
bit-identical and the real peak against the budget.
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any


def _op_table(measured: Any, nominal: Any) -> list[str]:
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for s, t in zip(measured.stages[:measured.num_forward], nominal.stages):
        r = rows[s.op]
        r[0] += 1
        r[1] += s.cost_s
        r[2] += t.cost_s
    top = sorted(rows.items(), key=lambda kv: -kv[1][1])[:6]
    return [f"  {op:24s} x{int(n):4d}: measured {me / n * 1e3:7.3f} ms, cpu model {no / n * 1e3:7.3f} ms per op"
            for op, (n, me, no) in top]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plan_pricing", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a zoo model (resnet50, mobilenet, unet, vgg16, transformer, gpt)")
    ap.add_argument("--size", default="bench", help="zoo size (default bench)")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved rounds per run (default 10)")
    args = ap.parse_args(argv)

    import torch

    from hybridmem.factory import zoo
    from hybridmem.graph.costs import MeasuredCostModel, apply_costs, get_cost_model
    from hybridmem.solvers import plan

    from . import measure
    from .runner import capture_graph

    torch.set_num_threads(1)
    e = zoo().build(args.model, args.size)
    state = measure.state_bytes(e.model, e.inputs)
    budget, why = measure.checkpoint_real_peak(e.model, e.inputs, e.loss_fn)
    if budget is None:
        print(f"checkpoint per block is not applicable to {args.model}: {why}")
        return 1
    warm = capture_graph(args.model, args.size, "cpu", warm=True)
    nominal = apply_costs(capture_graph(args.model, args.size, "cpu"), get_cost_model("cpu"))
    print(f"{args.model} ({args.size}), budget {budget} B (checkpoint's real peak); forward ops:")
    print("\n".join(_op_table(warm, nominal)))
    plans = {"cpu model": plan(nominal, budget, device="cpu", solver="checkmate", time_limit=30),
             "measured": plan(warm, budget, device=MeasuredCostModel.from_graph(warm), solver="checkmate",
                              time_limit=30)}
    for label, p in plans.items():
        chosen = sum(warm.stages[warm.tensors[a.tensor].producer].cost_s for a in p.actions if a.kind == "recompute")
        print(f"plan priced by {label}: predicted {p.info.get('overhead', 0.0):+.1%}; its recomputes cost "
              f"{chosen * 1e3:.0f} ms measured (a step: {warm.compute_time() * 1e3:.0f} ms)")
    order = list(plans)
    for run in range(4):
        label = order[(run + run // 2) % 2]       # a, b, b, a
        res, _ = measure.run_methods(e.model, e.inputs, e.loss_fn, ["ckpt-block", "hybridmem-plan-recompute"],
                                     budget=budget, warmup=1, steps=args.rounds, allocator_peak=True, plan=plans[label])
        by = {r.method: r for r in res}
        h, c = by["hybridmem-plan-recompute"], by["ckpt-block"]
        if h.status != "ok":
            print(f"run {run + 1}, plan priced by {label}: {h.status}: {h.reason}")
            continue
        real = state + (h.alloc_peak_bytes or 0)
        same = h.losses_identical and h.grads_identical and h.buffers_identical
        print(f"run {run + 1}, plan priced by {label}: plan x{1 + h.overhead:.3f}, checkpoint x{1 + c.overhead:.3f}, "
              f"plan / checkpoint {(1 + h.overhead) / (1 + c.overhead):.3f}; bit-identical {same}; real peak "
              f"{real} B {'<=' if real <= budget else '>'} budget", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
