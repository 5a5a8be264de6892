"""What a swap's copies cost on this CPU: ``python -m bench.copy_rate [--sizes 1,4,16,64,256]`` (MiB).

The swap policy on the CPU copies on the calling thread: out into memory from numpy's allocator (the host
side), back into a new tensor from PyTorch's allocator (the budgeted device). Both land in newly allocated
pages, which the kernel maps on first touch, so the rate is well below a copy into a reused buffer. The
``cpu`` device model's ``h2d_bw`` / ``d2h_bw`` are set from this (docs/devices.md). Prints the median of 5
round trips per size (after 2 warm-ups), with a reused-buffer copy beside them.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from hybridmem.plugins.swap import host_empty_like


def rates(mib: int, rounds: int = 7) -> dict[str, float]:
    x = torch.randn(mib << 18)
    out, back, reused = [], [], []
    buf = torch.empty_like(x)
    for _ in range(rounds):
        t0 = time.perf_counter()
        host = host_empty_like(x)
        host.copy_(x)
        t1 = time.perf_counter()
        dev = torch.empty_like(host)
        dev.copy_(host)
        t2 = time.perf_counter()
        buf.copy_(x)
        t3 = time.perf_counter()
        out.append(t1 - t0)
        back.append(t2 - t1)
        reused.append(t3 - t2)
        del host, dev
    gbps = lambda ts: x.nbytes / statistics.median(ts[2:]) / 1e9  # noqa: E731
    return {"out": gbps(out), "back": gbps(back), "reused": gbps(reused)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.copy_rate", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,16,64,256", help="MiB, comma-separated")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        ap.error(f"--sizes {args.sizes!r}: expected MiB as whole numbers of 1 or more, comma-separated (e.g. 1,64)")
    torch.set_num_threads(1)
    print("| size | out (swap-out) | back (swap-in) | into a reused buffer |\n|---:|---:|---:|---:|")
    for mib in sizes:
        r = rates(mib)
        print(f"| {mib} MiB | {r['out']:.1f} GB/s | {r['back']:.1f} GB/s | {r['reused']:.1f} GB/s |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
