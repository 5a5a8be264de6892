"""Which of hybridmem's modules run from pack to unpack: ``python bench/pack_path.py [MODEL] [--share 0.75]``.

Trains a zoo model (``small``) three steps under ``--share`` of its measured peak with swap, recompute and
compress, then profiles two more steps: every function of this repository that runs inside the runtime's
pack or unpack hook (a saved tensor kept, evicted, rebuilt) counts for its module. Prints the modules with
their call counts, and how many there are: what a reader opens to follow one saved tensor.
"""
from __future__ import annotations

import argparse
import collections
import copy
import sys
from pathlib import Path

import torch

import hybridmem
from hybridmem.factory import zoo

ROOT = str(Path(__file__).resolve().parents[1]) + "/"
HOOKS = {"_pack_hook", "_unpack_hook"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="resnet50")
    ap.add_argument("--share", type=float, default=0.75, help="of the measured peak (default 0.75)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    e = zoo().build(args.model, "small")
    model = copy.deepcopy(e.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    call = e.args_kwargs()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        e.loss_fn(model(*call[0], **call[1])).backward()
        opt.step()

    with hybridmem.session(budget=None) as s:
        for _ in range(3):
            step()
        peak = s.stats().peak_bytes
    modules: collections.Counter[str] = collections.Counter()

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        if event != "call" or not frame.f_code.co_filename.startswith(ROOT):
            return
        f = frame
        while f is not None:
            if f.f_code.co_name in HOOKS and f.f_code.co_filename.endswith("step_hooks.py"):
                modules[frame.f_code.co_filename[len(ROOT):]] += 1
                return
            f = f.f_back

    with hybridmem.session(budget=int(peak * args.share), policies=("swap", "recompute", "compress")) as s:
        for _ in range(3):
            step()
        sys.setprofile(profile)
        try:
            step()
            step()
        finally:
            sys.setprofile(None)
        st = s.stats()
    print(f"{args.model} (small) at {args.share:.0%} of its peak: {st.steady_steps} of {st.steps} steps in the steady "
          f"state; evicted {', '.join(f'{n} {p.evicted}' for n, p in st.policies.items())}")
    for name, calls in modules.most_common():
        print(f"{calls:8d}  {name}")
    print(f"{len(modules)} modules from pack to unpack")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
