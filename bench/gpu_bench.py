"""The eager runtime against what it must beat, on a GPU, side by side in one process.

    python bench/gpu_bench.py                           # CUDA: ResNet-50 b64 224 and GPT-2 small seq 1024 b8
    python bench/gpu_bench.py --device cpu --size tiny  # the same rows on the CPU in seconds (a dry run)
    python bench/gpu_bench.py --profile prof/           # and cProfile + torch.profiler of one managed step

For each model (the zoo's ``paper`` sizes by default: ``resnet50`` is torchvision's ResNet-50 at batch 64,
224 px; ``gpt`` a GPT-2 small, 12 x 768, sequence 1024, batch 8, vocabulary 50,257), fp32, SGD with momentum,
the same seeds in every row, each row's memory freed before the next:

==================  ==============================================================================
row                 what runs
==================  ==============================================================================
unmanaged           plain PyTorch
checkpoint          ``torch.utils.checkpoint`` (non-reentrant) around every block (bottleneck, GPT block)
selective           selective activation checkpointing: the same blocks, matrix products and convolutions
                    saved, the rest recomputed (``create_selective_checkpoint_contexts``)
save_on_cpu         ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: every saved tensor to the host
watch               ``hybridmem.session(budget=None)``: the runtime watching, evicting nothing
online@ckpt         hybridmem, default policies, budget = the checkpoint row's real peak
planned@ckpt        hybridmem following a plan made for that budget (``capture`` with this device's
                    measured op times, then ``hybridmem.solvers.plan``)
default@70          hybridmem, default policies, budget = 70 % of the unmanaged row's real peak
swap@70             hybridmem, swap only, the same budget
==================  ==============================================================================

Columns: ``step ms`` is the median wall time of the steps after the first three (a hybridmem step 1 runs
under the dispatch mode, step 2 records the program, the rest run in the steady state), with the device
synchronised at each step's end; ``x`` is that over the unmanaged step; ``peak`` the largest
``torch.cuda.max_memory_allocated`` of any step, the first included (reset before each); ``host ms`` the
time until the step's last call returned, before that synchronisation (below ``step ms``: the host ran
ahead of the device); ``dev ms`` the device's busy time in one more step, from ``torch.profiler`` (the sum
of its kernels and copies); ``syncs`` the synchronising CUDA calls per measured step
(``torch.cuda.set_sync_debug_mode``); ``same`` whether every loss and the last gradients are bit-identical to
the unmanaged row's, and so are the parameters after the steps (cuDNN's and cuBLAS's deterministic
algorithms are asked for: ``--no-deterministic`` not);
``copy`` for hybridmem's swap: the swap-in time per step hidden behind compute / exposed. The pinned host
link is measured first (one 256 MiB copy each way). The results go to ``--md`` (markdown, for
``docs/gpu-results.md``) and ``--json``; under ``$OUT`` by default when that is set.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import functools
import gc
import io
import json
import os
import pstats
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

# cuBLAS reads this when it creates its handle: deterministic matrix products
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing bench

import hybridmem  # noqa: E402
from hybridmem.zoo import build  # noqa: E402

ROWS = ("unmanaged", "checkpoint", "selective", "save_on_cpu", "watch", "online@ckpt", "planned@ckpt",
        "default@70", "swap@70")
WARMUP = 3      # steps not timed: the dispatch-mode step, the recorded step, the first steady one
SHARE = 0.7     # of the unmanaged peak, for the @70 rows
aten = torch.ops.aten
# selective checkpointing keeps what is costly to recompute
SAVED_BY_SAC = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default,
                aten._scaled_dot_product_efficient_attention.default,
                aten._scaled_dot_product_flash_attention.default,
                getattr(aten, "_scaled_dot_product_cudnn_attention", aten.mm).default}


@dataclass
class Result:
    model: str
    row: str
    budget: int = 0
    step_ms: float = 0.0
    host_ms: float = 0.0
    device_ms: float | None = None
    peaks: list[int] = field(default_factory=list)
    syncs: float = 0.0
    same: str = "-"
    steady: int = 0
    hidden_ms: float = 0.0
    exposed_ms: float = 0.0
    evicted: dict[str, int] = field(default_factory=dict)
    note: str = ""
    error: str = ""

    @property
    def peak(self) -> int:
        return max(self.peaks, default=0)

    @property
    def within(self) -> str:
        if not self.budget or not self.peaks:
            return "-"
        return "yes" if self.peak <= self.budget else "NO"


# ---- the step ---------------------------------------------------------------------------------------
class Runner:
    """Steps of one row: a copy of the model, SGD with momentum, the seeds reset per step."""

    def __init__(self, entry: Any, device: torch.device, wrap: Callable[[torch.nn.Module], None] | None = None):
        self.entry, self.device = entry, device
        self.model = copy.deepcopy(entry.model)
        if wrap is not None:
            wrap(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.args, self.kwargs = entry.args_kwargs()
        self.losses: list[torch.Tensor] = []
        self.k = 0
        self.snapshot: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def step(self) -> None:
        """One training step, as a user's loop runs it (no synchronisation of its own)."""
        torch.manual_seed(1000 + self.k)  # dropout: the same masks in every row
        self.k += 1
        loss = self.entry.loss_fn(self.model(*self.args, **self.kwargs))
        loss.backward()
        self.losses.append(loss.detach())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def snap(self) -> None:
        """The losses so far and the parameters now, on the host (after the timed steps: the extra steps a
        row may run after them are not compared). Equal parameters after the same steps: equal gradients."""
        self.snapshot = ([x.cpu() for x in self.losses], [p.detach().cpu() for p in self.model.parameters()])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device, session: Any = None) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return session.stats().peak_bytes if session is not None else 0


def timed_steps(r: Runner, steps: int, res: Result, session: Any = None) -> None:
    """``steps`` steps: each one's peak, and the median wall and host times and syncs of those after WARMUP."""
    dev = r.device
    walls, hosts, syncs = [], [], []
    for i in range(steps):
        _sync(dev)
        _reset_peak(dev)
        if session is not None and dev.type != "cuda":
            res.steady += session.stats().steady_steps  # what the reset below zeroes
            session.reset_stats()
        measured = i >= WARMUP
        t0 = time.perf_counter()
        n = _counting_syncs(r.step, dev) if measured else (r.step(), 0)[1]
        t1 = time.perf_counter()
        _sync(dev)
        t2 = time.perf_counter()
        res.peaks.append(_peak(dev, session))
        if measured:
            walls.append(t2 - t0)
            hosts.append(t1 - t0)
            syncs.append(n)
    if session is not None:
        res.steady += session.stats().steady_steps
    res.step_ms = statistics.median(walls) * 1e3 if walls else 0.0
    res.host_ms = statistics.median(hosts) * 1e3 if hosts else 0.0
    res.syncs = statistics.mean(syncs) if syncs else 0.0


def _counting_syncs(fn: Callable[[], None], device: torch.device) -> int:
    """Run ``fn``; the synchronising CUDA calls it made (``torch.cuda.set_sync_debug_mode``'s warnings)."""
    if device.type != "cuda":
        fn()
        return 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in seen)


def device_busy_ms(r: Runner) -> float | None:
    """The device's busy time in one more step: the sum of its kernels' and copies' own times."""
    if r.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r.step()
        _sync(r.device)
    return sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages()) / 1e3


# ---- the rows that wrap the model ----------------------------------------------------------------
def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks a user would checkpoint: ResNet bottlenecks, transformer blocks."""
    kinds = ("Bottleneck", "BasicBlock", "GPTBlock", "EncoderLayer", "TransformerEncoderLayer", "GPT2Block")
    return [m for m in model.modules() if type(m).__name__ in kinds]


def _checkpointed(context_fn: Callable[[], Any] | None = None) -> Callable[[torch.nn.Module], None]:
    def wrap(model: torch.nn.Module) -> None:
        blocks = _blocks(model)
        if not blocks:
            raise ValueError(f"no block to checkpoint in {type(model).__name__}")
        for b in blocks:
            fwd = b.forward
            extra = {} if context_fn is None else {"context_fn": context_fn}

            def forward(*a: Any, _fwd: Callable = fwd, **k: Any) -> Any:
                return checkpoint(_fwd, *a, use_reentrant=False, **extra, **k)
            b.forward = forward
    return wrap


def _sac_context() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SAC else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


# ---- one row ---------------------------------------------------------------------------------------
def run_row(name: str, row: str, entry: Any, device: torch.device, steps: int, budgets: dict[str, int],
            profile_dir: Path | None = None) -> tuple[Result, Runner | None]:
    res = Result(name, row)
    r: Runner | None = None
    try:
        if row in ("unmanaged", "checkpoint", "selective", "save_on_cpu"):
            wrap = {"checkpoint": _checkpointed(), "selective": _checkpointed(_sac_context)}.get(row)
            r = Runner(entry, device, wrap)
            ctx = (torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda") if row == "save_on_cpu"
                   else _nothing())
            # the CPU has no allocator statistics: the runtime watching (the native meter) reads the peak there
            watch = hybridmem.session(budget=None, device="cpu") if device.type != "cuda" else _nothing()
            with watch as w, ctx:
                timed_steps(r, steps, res, w)
                r.snap()
                res.device_ms = device_busy_ms(r)
            return res, r
        budget, policies, plan = _hybridmem_setting(row, entry, device, budgets, res)
        r = Runner(entry, device)
        with hybridmem.session(budget=budget, policies=policies, plan=plan, device=str(device)) as s:
            timed_steps(r, steps, res, s)
            r.snap()
            res.device_ms = device_busy_ms(r)
            if profile_dir is not None:
                profile_step(r, profile_dir, f"{name}-{row}")
            st = s.stats()
            swap = s.runtime.policies.get("swap")
            if swap is not None:
                swap.synchronize()
                c = swap.stats
                res.hidden_ms = c.get("hidden_s", 0.0) * 1e3 / max(r.k, 1)
                res.exposed_ms = c.get("exposed_s", 0.0) * 1e3 / max(r.k, 1)
        res.budget = budget or 0
        left = [n for n in st.notes if n.startswith(("steady state: not used", "steady state left"))]
        if left:
            res.note = (res.note + "; " if res.note else "") + left[0]
        res.evicted = {n: p.evicted for n, p in st.policies.items() if p.evicted}
        if device.type != "cuda":
            res.note = (res.note + "; " if res.note else "") + "peak: the runtime's (CPU)"
        return res, r
    except Exception as e:  # noqa: BLE001  (the row says what ended it; the next rows still run)
        traceback.print_exception(e, file=sys.stderr)
        res.error = f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"
        named = getattr(e, "min_budget_bytes", None)
        if named:
            res.error += f" (named minimum {named / 2**20:.1f} MiB)"
        return res, None


def _hybridmem_setting(row: str, entry: Any, device: torch.device, budgets: dict[str, int],
                       res: Result) -> tuple[int | None, tuple[str, ...], Any]:
    from hybridmem.config import DEFAULT_POLICIES

    if row == "watch":
        return None, DEFAULT_POLICIES, None
    if row in ("online@ckpt", "planned@ckpt"):
        budget = budgets.get("checkpoint")
        if not budget:
            raise RuntimeError("the checkpoint row has no peak to take the budget from")
    else:
        budget = int(SHARE * budgets["unmanaged"])
    if row == "planned@ckpt":
        return budget, DEFAULT_POLICIES, make_plan(entry, device, budget, res)
    return budget, ("swap",) if row == "swap@70" else DEFAULT_POLICIES, None


def make_plan(entry: Any, device: torch.device, budget: int, res: Result) -> Any:
    """A plan for ``budget``: the step captured on the device (its measured op times), planned by STR's
    approximation (python-mip installed) or else Capuchin's heuristic (the row says which)."""
    from hybridmem.graph.capture import capture
    from hybridmem.graph.costs import MeasuredCostModel
    from hybridmem.solvers import plan

    model = copy.deepcopy(entry.model)
    args, kwargs = entry.args_kwargs()
    inputs = kwargs if kwargs and not args else args
    t0 = time.perf_counter()
    g = capture(model, inputs, entry.loss_fn, device=device, optimizer=torch.optim.SGD(model.parameters(), lr=0.01,
                                                                                          momentum=0.9))
    try:
        import mip  # noqa: F401
        solver = "approx"
    except ImportError:
        solver = "capuchin"
    p = plan(g, budget, device=MeasuredCostModel.from_graph(g), solver=solver, time_limit=30,
             **({"exact": False} if solver == "approx" else {}))
    res.note = f"plan: {solver}, {time.perf_counter() - t0:.1f} s to capture and plan"
    del model, g
    gc.collect()
    return p


def profile_step(r: Runner, out: Path, label: str) -> None:
    """cProfile and torch.profiler of one more step (steady state where it applies), written under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    pr = cProfile.Profile()
    pr.enable()
    r.step()
    _sync(r.device)
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(30)
    (out / f"{label}.cprofile.txt").write_text(text.getvalue())
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if r.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        r.step()
        _sync(r.device)
    key = "self_cuda_time_total" if r.device.type == "cuda" else "self_cpu_time_total"
    (out / f"{label}.torchprof.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40))


class _nothing:
    def __enter__(self) -> None:
        return None  # as the session's value: no session

    def __exit__(self, *exc: Any) -> None:
        return None


def _same(a: Runner, b: Runner) -> str:
    """``yes`` where every loss and the parameters after the steps (so every gradient) are bit-identical, else
    the largest relative difference."""
    assert a.snapshot is not None and b.snapshot is not None
    pairs = list(zip(a.snapshot[0], b.snapshot[0])) + list(zip(a.snapshot[1], b.snapshot[1]))
    if all(torch.equal(x, y) for x, y in pairs):
        return "yes"
    worst = max(((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-30)).item()
                for x, y in pairs)
    return f"{worst:.0e}"


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


# ---- the link -----------------------------------------------------------------------------------------
def pinned_link(device: torch.device, nbytes: int = 256 << 20) -> tuple[float, float] | None:
    """Host-to-device and device-to-host GB/s of one pinned copy each way (median of 5)."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = []
    for dst, src in ((dev, host), (host, dev)):
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out.append(nbytes / statistics.median(times) / 1e9)
    del host, dev
    _free(device)
    return out[0], out[1]


# ---- report -------------------------------------------------------------------------------------------
def table(results: list[Result]) -> list[str]:
    base = {r.model: r for r in results if r.row == "unmanaged" and not r.error}
    head = (f"| model | row | budget MiB | peak MiB | within | step ms | x | host ms | dev ms | syncs | same | "
            f"steady | copy hidden/exposed ms | evicted | note |")
    lines = [head, "|" + "---|" * 15]
    for r in results:
        b = base.get(r.model)
        x = f"{r.step_ms / b.step_ms:.2f}" if b is not None and b.step_ms and r.step_ms else "-"
        if r.error:
            lines.append(f"| {r.model} | {r.row} | {r.budget / 2**20:.0f} | - | - | - | - | - | - | - | - | - | - | - | "
                         f"{r.error} |")
            continue
        copy_ms = f"{r.hidden_ms:.1f}/{r.exposed_ms:.1f}" if r.hidden_ms or r.exposed_ms else "-"
        lines.append(f"| {r.model} | {r.row} | {r.budget / 2**20:.0f} | {r.peak / 2**20:.0f} | {r.within} | "
                     f"{r.step_ms:.1f} | {x} | {r.host_ms:.1f} | "
                     f"{'-' if r.device_ms is None else f'{r.device_ms:.1f}'} | {r.syncs:g} | {r.same} | "
                     f"{r.steady} | {copy_ms} | {', '.join(f'{k} {v}' for k, v in r.evicted.items()) or '-'} | "
                     f"{r.note} |")
    return lines


def environment(device: torch.device, link: tuple[float, float] | None) -> list[str]:
    from hybridmem.runtime import cpumeter

    native = cpumeter.load()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    lines = [f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {name}, torch {torch.__version__}, "
             f"Python {sys.version.split()[0]}"]
    if native is None:
        lines.append(f"- native library: not available ({cpumeter.unavailable_reason()})")
    elif device.type == "cuda":
        lines.append(f"- CUDA caching-allocator hook: {'built' if native.cuda_hook else 'not built: ' + str(cpumeter.cuda_note())}")
    if link is not None:
        lines.append(f"- pinned link: {link[0]:.1f} GB/s host to device, {link[1]:.1f} GB/s device to host")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="resnet50,gpt", help="zoo names, comma-separated")
    ap.add_argument("--size", default=None, help="zoo size (default: paper on CUDA, tiny on the CPU)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=8, help=f"steps per row (the first {WARMUP} are not timed)")
    ap.add_argument("--deadline", type=float, default=330.0, help="no row starts after this many seconds")
    ap.add_argument("--no-deterministic", action="store_true", help="leave cuDNN/cuBLAS free to pick kernels")
    ap.add_argument("--profile", type=Path, default=None, help="write cProfile and torch.profiler tables here "
                    "(one more step of the online@ckpt rows)")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(".")
    ap.add_argument("--md", type=Path, default=out_dir / "gpu-bench.md")
    ap.add_argument("--json", type=Path, default=out_dir / "gpu-bench.json")
    a = ap.parse_args(argv)
    rows = [r for r in a.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"--rows: unknown {unknown}; accepted: {', '.join(ROWS)}")
    if a.steps <= WARMUP:
        ap.error(f"--steps {a.steps}: expected more than the {WARMUP} untimed steps")
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    size = a.size or ("paper" if device.type == "cuda" else "tiny")
    if not a.no_deterministic:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.use_deterministic_algorithms(True, warn_only=True)
    start = time.perf_counter()
    link = pinned_link(device)
    results: list[Result] = []
    for name in [m for m in a.models.split(",") if m]:
        entry = build(name, size, device=device)
        budgets: dict[str, int] = {}
        base: Runner | None = None
        for row in rows:
            if time.perf_counter() - start > a.deadline:
                results.append(Result(name, row, error=f"not run: past the {a.deadline:.0f} s deadline"))
                continue
            _free(device)
            prof = a.profile if a.profile is not None and row == "online@ckpt" else None
            res, r = run_row(name, row, entry, device, a.steps, budgets, prof)
            if not res.error:
                budgets[row] = res.peak
                if row == "unmanaged":
                    base = r
                elif base is not None and r is not None:
                    res.same = _same(r, base)
            if r is not None and r is not base:
                del r
            results.append(res)
            print(f"# {name} {row}: {res.step_ms:.1f} ms, peak {res.peak / 2**20:.0f} MiB"
                  + (f", {res.error}" if res.error else ""), flush=True)
        del base, entry
        _free(device)
    lines = ["## GPU benchmark (`python bench/gpu_bench.py`)", "", *environment(device, link), "", *table(results)]
    text = "\n".join(lines) + "\n"
    print(text)
    a.md.parent.mkdir(parents=True, exist_ok=True)
    a.md.write_text(text)
    a.json.write_text(json.dumps({"environment": environment(device, link), "size": size,
                                  "results": [asdict(r) | {"peak": r.peak} for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
