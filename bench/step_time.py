"""A CPU plan's predicted step time against the measured one: ``python -m bench.step_time [MODELS] [--size bench]``.

For each zoo model: one warm-up step, a capture of the step with its optimizer's step on this CPU (after a timed
plain step, as ``hybridmem plan`` captures), a plan for ``--device cpu`` at ``--budget`` of the keep-all peak (as
``hybridmem plan --model M --device cpu --budget 70%`` makes it: the capture's own op times, copies on the
compute stream; where no plan fits that budget, the least budget with one, + 1 %). Then ``--rounds`` rounds of: a fresh capture, whose op times give this round's
prediction of the same plan; ``--steps`` unmanaged steps; ``--steps`` + 2 steps under the runtime following the
plan (SGD, one thread; the first two record the step and build the steady state). Prints the round with the
median measured / predicted (and every round's), its unmanaged step and what the plan predicts for its
recomputes, copies and codecs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import hybridmem
from hybridmem import solvers
from hybridmem.errors import BudgetInfeasibleError
from hybridmem.graph.costs import apply_costs, planning_model
from hybridmem.runtime.compose import Runtime
from hybridmem.runtime.replay import Replayer
from hybridmem.zoo import MODELS, build


def _step(e, opt) -> None:
    opt.zero_grad(set_to_none=True)
    e.loss().backward()
    opt.step()


def _capture(e, opt):
    """The step captured on this CPU with its optimizer's step (after a timed plain step: what a step spends
    outside its ops), and the cost model a ``cpu`` plan uses for it."""
    g = hybridmem.capture(e.model, e.inputs, e.loss_fn, device="cpu", optimizer=opt, optimizer_step=True, warmup=1)
    model = planning_model(g, "cpu")
    return apply_costs(g, model), model


def _timed(e, opt, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        _step(e, opt)
        out.append(time.perf_counter() - t0)
    return out


class HookClock:
    """Times the runtime's saved-tensor hooks (less the replays run inside an unpack) of a session entered
    while it is active (the session binds its hooks when it starts): the host cost the ``cpu`` model charges
    per save (``host_save_s``)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.hooks_s = self.replay_s = 0.0
        self.saves = 0

    def __enter__(self) -> "HookClock":
        self._saved = (Runtime._pack_hook, Runtime._unpack_hook, Replayer._call)
        pack, unpack, call = self._saved
        clock = self

        def timed(fn, field, saves):
            def wrapper(self, *args):
                t0 = time.perf_counter()
                try:
                    return fn(self, *args)
                finally:
                    setattr(clock, field, getattr(clock, field) + time.perf_counter() - t0)
                    clock.saves += saves
            return wrapper

        Runtime._pack_hook = timed(pack, "hooks_s", 1)
        Runtime._unpack_hook = timed(unpack, "hooks_s", 0)
        Replayer._call = timed(call, "replay_s", 0)
        return self

    def __exit__(self, *exc: object) -> None:
        Runtime._pack_hook, Runtime._unpack_hook, Replayer._call = self._saved

    def per_save_s(self) -> float:
        return (self.hooks_s - self.replay_s) / max(self.saves, 1)


def measure(name: str, size: str, budget: str, steps: int, rounds: int = 3) -> dict:
    """Plan once, then ``rounds`` rounds of: a capture (this round's op times, the prediction of the same plan),
    ``steps`` unmanaged steps, ``steps`` + 2 steps following the plan. Each round's ratio pairs a prediction and
    a measurement a few seconds apart (this machine's load moves a step by up to 20 % over minutes)."""
    e = build(name, size)
    opt = torch.optim.SGD(e.model.parameters(), lr=0.01)
    _step(e, opt)  # warm-up: first-call effects out of the captured op times
    opt.zero_grad(set_to_none=True)
    g, model = _capture(e, opt)
    try:
        plan = solvers.plan(g, budget, device=model, time_limit=10)
    except BudgetInfeasibleError as err:  # VGG-16's largest stage: planned at the least budget that has a plan
        if err.minimum_bytes is None:
            raise
        plan = solvers.plan(g, int(err.minimum_bytes * 1.01), device=model, time_limit=10)
    rows = []
    for r in range(rounds):
        if r:
            opt.zero_grad(set_to_none=True)
            g, model = _capture(e, opt)
        sim = hybridmem.simulate(g, plan, device=model)  # the plan's graph: the structure hash is checked
        plain = statistics.median(_timed(e, opt, steps))
        with HookClock() as hooks, hybridmem.session(budget=plan.budget_bytes, plan=plan):
            _timed(e, opt, 2)  # the first records the step, the second builds the steady state
            hooks.reset()
            managed = statistics.median(_timed(e, opt, steps))
            st = hybridmem.stats()
        rows.append({"predicted_s": sim.time_s, "measured_s": managed, "unmanaged_s": plain,
                     "ratio": managed / sim.time_s, "extra_s": sim.recompute_s + sim.copy_s + sim.compress_s,
                     "host_s": sim.host_s, "hooks_per_save_s": hooks.per_save_s()})
    mid = sorted(rows, key=lambda x: x["ratio"])[len(rows) // 2]
    return {"model": name, **mid, "ratios": [x["ratio"] for x in rows], "plan": st.plan, "note": st.plan_note,
            "budget_share": plan.budget_bytes / g.peak_bytes()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_time", description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(MODELS), help="zoo names (default: all)")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--budget", default="70%", help="of the keep-all peak (default 70%%)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per round and kind (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per model; the median round is printed")
    args = ap.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--rounds", args.rounds)):
        if value < 1:
            ap.error(f"{flag} {value}: expected 1 or more")
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        ap.error(f"unknown zoo model(s) {unknown}; accepted: {', '.join(MODELS)}")
    torch.set_num_threads(1)
    print("| model | budget / keep-all | predicted | measured | measured/predicted (each round) | unmanaged "
          "| predicted recompute + copies + codecs | predicted hooks | measured hooks a save |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.models:
        r = measure(name, args.size, args.budget, args.steps, args.rounds)
        each = ", ".join(f"{x:.2f}" for x in r["ratios"])
        print(f"| {name} | {r['budget_share']:.0%} | {r['predicted_s'] * 1e3:.1f} ms | {r['measured_s'] * 1e3:.1f} ms | "
              f"{r['ratio']:.2f} ({each}) | {r['unmanaged_s'] * 1e3:.1f} ms | {r['extra_s'] * 1e3:.1f} ms | "
              f"{r['host_s'] * 1e3:.1f} ms | {r['hooks_per_save_s'] * 1e6:.0f} us |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
