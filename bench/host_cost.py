"""What hybridmem adds to a step that is mostly host work: ``python -m bench.host_cost [MODELS] [--blocks 12]``.

For each zoo model at ``--size`` (default ``tiny``: batch 2, 32 px, where a step is mostly per-op host work as
on a GPU), one thread, SGD: blocks of ``--steps`` steps, plain PyTorch and each variant in turn in one process,
a fresh session per block (``watch``: ``budget=None``; ``far``: a budget of 4 GiB, nothing to evict). A
block's figure is the median CPU time of its steps after the first ``--skip`` (a session's first steps record
and measure); printed per variant: the median over blocks of its ratio to the plain block beside it, and each
block's ratio. One process, so the variants share the allocator's and the caches' state; blocks alternate, so
the machine's drift is shared too.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch

import hybridmem
from hybridmem.zoo import MODELS, build

VARIANTS = {"watch": {"budget": None}, "far": {"budget": "4GiB"}}


def _blocks(name: str, size: str, variants: list[str], blocks: int, steps: int, skip: int) -> dict[str, list[float]]:
    e = build(name, size)
    model = e.model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    args, kwargs = e.args_kwargs()
    out: dict[str, list[float]] = {v: [] for v in ["plain", *variants]}
    for _ in range(blocks):
        for v in out:
            ctx: Any = hybridmem.session(device="cpu", **VARIANTS[v]) if v != "plain" else None
            if ctx is not None:
                ctx.__enter__()
            times = []
            try:
                for _ in range(steps):
                    gc.collect()
                    t0 = time.process_time()
                    opt.zero_grad(set_to_none=True)
                    e.loss_fn(model(*args, **kwargs)).backward()
                    opt.step()
                    times.append(time.process_time() - t0)
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
            out[v].append(statistics.median(times[skip:]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="?", default="resnet50,mobilenet", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--variants", default="watch,far", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=8)
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS] + [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"unknown: {', '.join(unknown)} (variants: {', '.join(VARIANTS)}; models: {', '.join(MODELS)})")
    if not 0 <= args.skip < args.steps:
        ap.error(f"--skip must be at least 0 and below --steps ({args.steps}), got {args.skip}")
    torch.set_num_threads(1)
    for name in args.models.split(","):
        got = _blocks(name, args.size, variants, args.blocks, args.steps, args.skip)
        plain = got["plain"]
        print(f"{name} ({args.size}): plain step {statistics.median(plain) * 1e3:.2f} ms")
        for v in variants:
            ratios = [a / b for a, b in zip(got[v], plain)]
            print(f"  {v}: {statistics.median(ratios):.3f}x  (blocks: {' '.join(f'{r:.3f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
