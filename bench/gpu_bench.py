"""The eager runtime against what it must beat, on a GPU, side by side, each row in a process of its own.

    python bench/gpu_bench.py                           # CUDA: ResNet-50 b64 224 and GPT-2 small seq 1024 b8
    python bench/gpu_bench.py --device cpu --size tiny  # the same rows on the CPU in seconds (a dry run)
    python bench/gpu_bench.py --profile prof/           # and cProfile + torch.profiler of one managed step
    python bench/gpu_bench.py --both-modes              # every row with and without deterministic algorithms

For each model (the zoo's ``paper`` sizes by default: ``resnet50`` is torchvision's ResNet-50 at batch 64,
224 px; ``gpt`` a GPT-2 small, 12 x 768, sequence 1024, batch 8, vocabulary 50,257), fp32, SGD with momentum,
the same seeds in every row. On CUDA each row runs in a subprocess of its own (``--no-isolate``: all in this
process): no row's allocator state (cached segments, settings, a registered callback) or leftover tensors
reach the next, and the rows compare through their results and CPU snapshots of their losses and parameters:

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

Columns: ``step ms`` is the min / median / p90 wall time of the steps after the first three (a hybridmem
step 1 runs under the dispatch mode, step 2 records the program, the rest run in the steady state; a
hybridmem row with fewer steady steps than that is flagged in its note: it measured the dispatch mode), with
the device synchronised at each step's end; ``x`` is the median over the unmanaged row's; ``alloc`` and
``reserved`` the largest ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` of any step, the
first included (reset before each): reserved bytes are what a smaller card must hold, and what the cap
(``within``) is checked against; the @ckpt budgets are the checkpoint row's *allocated* peak, the @70 ones
70 % of the unmanaged row's; ``host ms`` the time until the step's last call returned, before that
synchronisation (below ``step ms``: the host ran ahead of the device); ``device work ms`` the sum of the
kernels' and copies' own times in one more step, from ``torch.profiler`` (copies on side streams overlap
compute: it may exceed the wall time; it is not busy time); ``syncs`` the synchronising CUDA calls per
measured step that ``torch.cuda.set_sync_debug_mode`` sees, and ``allocator`` the caching allocator's own
per measured step, from ``torch.cuda.memory_stats`` deltas (which the debug mode misses): syncs of all
streams (``num_sync_all_streams``: its cache flushes) / retries after a flush (``num_alloc_retries``) /
``cudaMalloc`` and ``cudaFree`` calls (``num_device_alloc``, ``num_device_free``) / refusals (``num_ooms``),
then hybridmem's free-memory callback calls; ``same`` whether every loss and the parameters after the
steps (so every gradient) are bit-identical to the unmanaged row's in the same mode; ``det`` whether
cuDNN's and cuBLAS's deterministic algorithms were asked for (``--deterministic``, the default;
``--no-deterministic`` is production speed; ``--both-modes`` runs every row both ways); ``copy`` for
hybridmem's swap: the swap-in time per step hidden behind compute / exposed. The pinned host link is
measured first (one 256 MiB copy each way). The results go to ``--md`` (markdown, for
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
import math
import statistics
import subprocess
import sys
import tempfile
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
STEPS = 20      # steps per row by default: medians and p90s of 17 timed steps
SHARE = 0.7     # of the unmanaged peak, for the @70 rows
# the caching allocator's counters whose per-step deltas are reported (torch.cuda.memory_stats keys)
ALLOCATOR = ("num_sync_all_streams", "num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")
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
    deterministic: bool = True
    budget: int = 0
    step_ms: float = 0.0           # median
    step_min_ms: float = 0.0
    step_p90_ms: float = 0.0
    host_ms: float = 0.0
    device_work_ms: float | None = None
    peaks: list[int] = field(default_factory=list)           # max_memory_allocated per step
    reserved_peaks: list[int] = field(default_factory=list)  # max_memory_reserved per step
    syncs: float = 0.0
    allocator: dict[str, float] = field(default_factory=dict)  # per measured step: memory_stats deltas, callback
    same: str = "-"
    steady: int = 0
    steady_expected: int = 0       # steps after the first two (hybridmem rows): all of them steady, when 0 flags
    hidden_ms: float = 0.0
    exposed_ms: float = 0.0
    evicted: dict[str, int] = field(default_factory=dict)
    swap: dict[str, float] = field(default_factory=dict)      # swap-outs in flight: peak bytes, throttled
    note: str = ""
    error: str = ""

    @property
    def peak(self) -> int:
        return max(self.peaks, default=0)

    @property
    def reserved_peak(self) -> int:
        return max(self.reserved_peaks, default=0)

    @property
    def within(self) -> str:
        """The budget against the reserved peak on CUDA (what the cap holds), the runtime's peak elsewhere."""
        if not self.budget or not self.peaks:
            return "-"
        held = self.reserved_peak if self.reserved_peaks else self.peak
        return "yes" if held <= self.budget else "NO"

    @property
    def not_steady(self) -> bool:
        return self.steady_expected > 0 and self.steady < self.steady_expected


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


def _allocator_counts(device: torch.device) -> dict[str, int]:
    """The caching allocator's counters (:data:`ALLOCATOR`) and hybridmem's callback calls, now."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    out = {k: int(stats.get(k, 0)) for k in ALLOCATOR}
    from hybridmem.native import cpumeter

    native = cpumeter.load()
    out["callback_calls"] = native.cuda_calls if native is not None else 0
    return out


def spread(xs: list[float]) -> tuple[float, float, float]:
    """(min, median, p90) of ``xs`` (nearest rank), 0s when empty."""
    if not xs:
        return 0.0, 0.0, 0.0
    ordered = sorted(xs)
    return ordered[0], statistics.median(ordered), ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def timed_steps(r: Runner, steps: int, res: Result, session: Any = None) -> None:
    """``steps`` steps: each one's allocated and reserved peaks; of those after WARMUP the min / median / p90
    wall time, the median host time, the syncs and the allocator's counter deltas per step."""
    dev = r.device
    walls, hosts, syncs = [], [], []
    deltas: dict[str, int] = {}
    for i in range(steps):
        _sync(dev)
        _reset_peak(dev)
        if session is not None and dev.type != "cuda":
            res.steady += session.stats().steady_steps  # what the reset below zeroes
            session.reset_stats()
        measured = i >= WARMUP
        before = _allocator_counts(dev) if measured else {}
        t0 = time.perf_counter()
        n = _counting_syncs(r.step, dev) if measured else (r.step(), 0)[1]
        t1 = time.perf_counter()
        _sync(dev)
        t2 = time.perf_counter()
        res.peaks.append(_peak(dev, session))
        if dev.type == "cuda":
            res.reserved_peaks.append(torch.cuda.max_memory_reserved(dev))
        if measured:
            walls.append(t2 - t0)
            hosts.append(t1 - t0)
            syncs.append(n)
            for k, v in _allocator_counts(dev).items():
                deltas[k] = deltas.get(k, 0) + v - before[k]
    if session is not None:
        res.steady += session.stats().steady_steps
    res.step_min_ms, res.step_ms, res.step_p90_ms = (x * 1e3 for x in spread(walls))
    res.host_ms = statistics.median(hosts) * 1e3 if hosts else 0.0
    res.syncs = statistics.mean(syncs) if syncs else 0.0
    res.allocator = {k: v / len(walls) for k, v in deltas.items()} if walls else {}


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


def device_work_ms(r: Runner) -> float | None:
    """The device's work in one more step: the sum of its kernels' and copies' own times (copies on side
    streams overlap compute: not busy time, may exceed the wall time)."""
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
            profile_dir: Path | None = None, deterministic: bool = True) -> tuple[Result, Runner | None]:
    res = Result(name, row, deterministic)
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
                res.device_work_ms = device_work_ms(r)
            return res, r
        budget, policies, plan = _hybridmem_setting(row, entry, device, budgets, res)
        r = Runner(entry, device)
        with hybridmem.session(budget=budget, policies=policies, plan=plan, device=str(device)) as s:
            timed_steps(r, steps, res, s)
            if budget is not None or plan is not None:
                res.steady_expected = steps - 2  # every step after the dispatch-mode one and the recorded one
            r.snap()
            res.device_work_ms = device_work_ms(r)
            if profile_dir is not None:
                profile_step(r, profile_dir, f"{name}-{row}")
            st = s.stats()
            swap = s.runtime.policies.get("swap")
            if swap is not None:
                swap.synchronize()
                c = swap.stats
                res.hidden_ms = c.get("hidden_s", 0.0) * 1e3 / max(r.k, 1)
                res.exposed_ms = c.get("exposed_s", 0.0) * 1e3 / max(r.k, 1)
                res.swap = {k: c[k] for k in ("inflight_peak", "throttled") if k in c}
        res.budget = budget or 0
        if res.not_steady:
            res.note = _join(res.note, f"NOT STEADY: {res.steady} of {res.steady_expected} steps after the "
                                       f"first two (measured the dispatch mode)")
        left = [n for n in st.notes if n.startswith(("steady state: not used", "steady state left"))]
        if left:
            res.note = _join(res.note, left[0])
        res.evicted = {n: p.evicted for n, p in st.policies.items() if p.evicted}
        if device.type != "cuda":
            res.note = _join(res.note, "peak: the runtime's (CPU)")
        return res, r
    except Exception as e:  # noqa: BLE001  (the row says what ended it; the next rows still run)
        traceback.print_exception(e, file=sys.stderr)
        res.error = f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"
        named = getattr(e, "min_budget_bytes", None)
        if named:
            res.error += f" (named minimum {named / 2**20:.1f} MiB)"
        return res, None


def _join(note: str, more: str) -> str:
    return f"{note}; {more}" if note else more


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


Snapshot = tuple[list[torch.Tensor], list[torch.Tensor]]


def _same(a: Snapshot, b: Snapshot) -> str:
    """``yes`` where every loss and the parameters after the steps (so every gradient) are bit-identical, else
    the largest relative difference."""
    pairs = list(zip(a[0], b[0])) + list(zip(a[1], b[1]))
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
COLUMNS = ("model", "row", "det", "budget MiB", "alloc MiB", "reserved MiB", "within", "step ms min/med/p90",
           "x", "host ms", "device work ms", "syncs", "allocator syncs/retries/mallocs/frees/ooms, callback",
           "same", "steady", "copy hidden/exposed ms", "evicted", "note")


def _allocator_cell(r: Result) -> str:
    if not r.allocator:
        return "-"
    a = r.allocator
    return "/".join(f"{a.get(k, 0):g}" for k in ALLOCATOR) + f", {a.get('callback_calls', 0):g}"


def table(results: list[Result]) -> list[str]:
    base = {(r.model, r.deterministic): r for r in results if r.row == "unmanaged" and not r.error}
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        b = base.get((r.model, r.deterministic))
        x = f"{r.step_ms / b.step_ms:.2f}" if b is not None and b.step_ms and r.step_ms else "-"
        det = "on" if r.deterministic else "off"
        if r.error:
            cells = [r.model, r.row, det, f"{r.budget / 2**20:.0f}", *["-"] * (len(COLUMNS) - 5), r.error]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        copy_ms = f"{r.hidden_ms:.1f}/{r.exposed_ms:.1f}" if r.hidden_ms or r.exposed_ms else "-"
        reserved = f"{r.reserved_peak / 2**20:.0f}" if r.reserved_peaks else "-"
        cells = [r.model, r.row, det, f"{r.budget / 2**20:.0f}", f"{r.peak / 2**20:.0f}", reserved, r.within,
                 f"{r.step_min_ms:.1f}/{r.step_ms:.1f}/{r.step_p90_ms:.1f}", x, f"{r.host_ms:.1f}",
                 "-" if r.device_work_ms is None else f"{r.device_work_ms:.1f}", f"{r.syncs:g}", _allocator_cell(r),
                 r.same, f"{r.steady}" + (" (!)" if r.not_steady else ""), copy_ms,
                 ", ".join(f"{k} {v}" for k, v in r.evicted.items()) or "-", r.note]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def environment(device: torch.device, link: tuple[float, float] | None) -> list[str]:
    from hybridmem.native import cpumeter

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


def set_deterministic(on: bool) -> None:
    """Ask cuDNN and cuBLAS for deterministic algorithms (``on``), or leave them free to pick kernels."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = on, False
    torch.use_deterministic_algorithms(on, warn_only=True)


@dataclass
class ModelRun:
    """What one model's rows need: where they run, how many steps, in which mode, until when."""

    name: str
    size: str
    device: torch.device
    rows: list[str]
    steps: int
    deterministic: bool
    deadline_at: float
    profile: Path | None
    isolate: bool


def run_model(plan: ModelRun) -> list[Result]:
    """The rows of one model in one mode; each hybridmem row's budget from the rows before it, and each row
    compared with the unmanaged one through CPU snapshots (no row's model or optimizer state stays on the
    device for the next)."""
    results: list[Result] = []
    budgets: dict[str, int] = {}
    base: Snapshot | None = None
    set_deterministic(plan.deterministic)
    entry = None if plan.isolate else build(plan.name, plan.size, device=plan.device)
    for row in plan.rows:
        if time.perf_counter() > plan.deadline_at:
            results.append(Result(plan.name, row, plan.deterministic, error="not run: past the deadline"))
            continue
        prof = plan.profile if plan.profile is not None and row == "online@ckpt" else None
        if plan.isolate:
            res, snap = run_isolated(plan, row, budgets, prof)
        else:
            _free(plan.device)
            res, r = run_row(plan.name, row, entry, plan.device, plan.steps, budgets, prof, plan.deterministic)
            snap = r.snapshot if r is not None else None
            del r  # its model and momentum leave the device before the next row
        if not res.error:
            budgets[row] = res.peak
            if row == "unmanaged":
                base = snap
            elif base is not None and snap is not None:
                res.same = _same(snap, base)
        results.append(res)
        print(f"# {plan.name} {row} (deterministic {'on' if plan.deterministic else 'off'}): {res.step_ms:.1f} ms, "
              f"alloc {res.peak / 2**20:.0f} MiB, reserved {res.reserved_peak / 2**20:.0f} MiB"
              + (f", {res.error}" if res.error else ""), flush=True)
    del entry
    _free(plan.device)
    return results


def run_isolated(plan: ModelRun, row: str, budgets: dict[str, int], prof: Path | None) -> tuple[Result, Snapshot | None]:
    """One row in a fresh Python process (``--child``): its result and its CPU snapshot."""
    with tempfile.TemporaryDirectory(prefix="gpu-bench-row-") as tmp:
        spec = {"name": plan.name, "row": row, "size": plan.size, "device": str(plan.device), "steps": plan.steps,
                "budgets": budgets, "deterministic": plan.deterministic, "out": tmp,
                "profile": None if prof is None else str(prof)}
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec))
        left = max(60.0, plan.deadline_at - time.perf_counter() + 120.0)  # a row started runs to its end
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(path)], timeout=left)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timed out after {left:.0f} s"
        result = Path(tmp) / "result.json"
        if not result.is_file():
            return Result(plan.name, row, plan.deterministic, error=f"row process ended without a result ({rc})"), None
        res = Result(**json.loads(result.read_text()))
        snap_file = Path(tmp) / "snapshot.pt"
        snap = torch.load(snap_file) if snap_file.is_file() else None
        return res, snap


def child(spec_file: Path) -> int:
    """``--child SPEC``: run the one row SPEC names, write its result and snapshot next to SPEC."""
    spec = json.loads(spec_file.read_text())
    device = torch.device(spec["device"])
    set_deterministic(spec["deterministic"])
    entry = build(spec["name"], spec["size"], device=device)
    prof = Path(spec["profile"]) if spec["profile"] else None
    res, r = run_row(spec["name"], spec["row"], entry, device, spec["steps"], spec["budgets"], prof,
                     spec["deterministic"])
    out = Path(spec["out"])
    if r is not None and r.snapshot is not None:
        torch.save(r.snapshot, out / "snapshot.pt")
    (out / "result.json").write_text(json.dumps(asdict(res)))
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--child"]:
        return child(Path(argv[1]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="resnet50,gpt", help="zoo names, comma-separated")
    ap.add_argument("--size", default=None, help="zoo size (default: paper on CUDA, tiny on the CPU)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=STEPS, help=f"steps per row (the first {WARMUP} are not timed)")
    ap.add_argument("--deadline", type=float, default=330.0, help="no row starts after this many seconds")
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                    help="ask cuDNN/cuBLAS for deterministic algorithms (default); --no-deterministic leaves "
                         "them free to pick kernels (production speed)")
    ap.add_argument("--both-modes", action="store_true", help="run every row with and without deterministic "
                    "algorithms (each compared with the unmanaged row of its mode)")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="each row in a subprocess of its own (default on CUDA)")
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
    isolate = device.type == "cuda" if a.isolate is None else a.isolate
    modes = (True, False) if a.both_modes else (a.deterministic,)
    start = time.perf_counter()
    link = pinned_link(device)
    results: list[Result] = []
    for name in [m for m in a.models.split(",") if m]:
        for det in modes:
            results += run_model(ModelRun(name, size, device, rows, a.steps, det, start + a.deadline, a.profile, isolate))
    lines = ["## GPU benchmark (`python bench/gpu_bench.py`)", "", *environment(device, link),
             f"- {a.steps} steps per row, the first {WARMUP} untimed; "
             f"{'each row in its own process' if isolate else 'all rows in one process'}", "", *table(results)]
    text = "\n".join(lines) + "\n"
    print(text)
    a.md.parent.mkdir(parents=True, exist_ok=True)
    a.md.write_text(text)
    a.json.write_text(json.dumps({"environment": environment(device, link), "size": size, "steps": a.steps,
                                  "isolated": isolate,
                                  "results": [asdict(r) | {"peak": r.peak, "reserved_peak": r.reserved_peak,
                                                           "within": r.within, "not_steady": r.not_steady}
                                              for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
