"""Measured runs on this CPU: real step time and real peak, hybridmem next to what users would pick instead.

Every method trains its own deep copy of one zoo model (same weights, same inputs, same RNG seed per
step) with SGD for a few steps. Steps are interleaved round-robin over the methods, so drift on a
shared machine hits all of them alike, and torch runs on one thread. Overhead is reported as the median
over rounds of ``step time / unmanaged step time in the same round - 1``: a ratio measured side by side,
never an absolute time compared across runs.

Step time is the process's CPU time (user + system, ``time.process_time``) by default: torch runs on one
thread and nothing here waits on I/O or on a device, so on an idle machine it equals the wall time, and
on shared cores it is not inflated by other processes' turns (wall-clock ratios swung by 20-30 % under
load). ``HYBRIDMEM_BENCH_CLOCK=wall`` times with ``time.perf_counter`` instead (needed on CUDA, where
copies and kernels run beside the Python thread).

Methods (``METHODS``):

``unmanaged``          plain PyTorch, the reference for time, peak, losses and gradients
``hybridmem-monitor``  ``hybridmem.session(budget=None)``: measures, never evicts (its overhead is the
                       price of the hooks; on the CPU the native allocator meter, nothing per op)
``hybridmem-monitor-ops`` the same with ``monitor="ops"``: every op metered (not in ``METHODS``; the
                       overhead benchmark shows it beside the default)
``hybridmem-online``   ``hybridmem.session(budget=B)``: the online scorer picks swap/recompute/compress
``hybridmem-plan``     the same budget, following an offline plan made on this CPU's captured graph
``hybridmem-plan-recompute`` a recompute-only plan, recompute the only policy (not in ``METHODS``: the
                       steady-state benchmark makes its plan, ``bench/test_bench_steady.py``)
``ckpt-sqrt``          ``torch.utils.checkpoint.checkpoint_sequential`` with sqrt(n) segments (only
                       for models whose forward is a plain chain of their children)
``ckpt-block``         every block wrapped in ``torch.utils.checkpoint.checkpoint`` (on a deep copy)
``save-on-cpu``        ``torch.autograd.graph.save_on_cpu``: on a CPU-only machine the device *is* the
                       host, so it moves nothing; it is listed because it is what a user would try

Peak memory of every method comes from one source, :func:`peak_probe` (the hybridmem meter when it is
importable, else the CPU allocator's own events from ``torch.profiler``), in a separate untimed step.
"""
from __future__ import annotations

import copy
import functools
import gc
import math
import os
import re
import statistics
import sys
import tempfile
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .methods import LABELS, METHODS  # noqa: E402  (torch-free, for `hybridmem bench --help`)

BUDGET_SAVED_SHARE = 0.4   # the budget: monitor-only peak minus this share of the saved-activation bytes


class Unavailable(Exception):
    """A method cannot run on this model or install; the message says why (shown in the table)."""


# ---- results ---------------------------------------------------------------------------------------
@dataclass
class MethodResult:
    """One method on one model. ``status`` is ``ok``, ``skipped`` (with ``reason``) or ``error``."""

    method: str
    status: str = "ok"
    reason: str = ""
    step_s: float | None = None            # median step time (forward + backward + optimizer step)
    overhead: float | None = None          # median over rounds of step_s / unmanaged step_s - 1
    peak_bytes: int | None = None          # peak from the shared probe (see peak_source)
    alloc_peak_bytes: int | None = None    # CPU allocator's own peak above the pre-step level (profiler)
    budget_ok: bool | None = None          # peak_bytes <= budget (only for methods given the budget)
    losses: list[float] = field(default_factory=list)
    losses_identical: bool | None = None   # every step's loss bit-identical to unmanaged
    grads_identical: bool | None = None    # every gradient bit-identical to unmanaged (first and last step)
    buffers_identical: bool | None = None  # BatchNorm running statistics identical after the run
    evicted_bytes: dict[str, int] = field(default_factory=dict)      # per policy (hybridmem only)
    regenerated_bytes: dict[str, int] = field(default_factory=dict)
    stall_s: float | None = None
    plan_state: str = ""                   # hybridmem: "following", "diverged", ... (runtime stats)
    times_s: list[float] = field(default_factory=list)


@dataclass
class ModelRun:
    """All methods measured side by side on one model."""

    model: str
    size: str
    batch: int | None
    steps: int
    rounds: int
    threads: int
    peak_source: str
    unmanaged_peak_bytes: int | None = None
    monitor_peak_bytes: int | None = None
    saved_bytes: int | None = None          # saved-activation bytes of one step (captured graph)
    budget_bytes: int | None = None
    plan_solver: str = ""
    results: list[MethodResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- building the variants -------------------------------------------------------------------------
@dataclass
class Variant:
    """One method's own copy of the model, its forward and the context each step runs in."""

    method: str
    model: nn.Module
    forward: Callable[[], Any]
    context: Callable[[], AbstractContextManager] = nullcontext
    optimizer: torch.optim.Optimizer | None = None
    inputs: Any = None
    after_step: Callable[[], None] = lambda: None

    def params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())


def _args_kwargs(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages under ``tensors`` (views of one storage count once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def state_bytes(model: nn.Module, inputs: Any) -> int:
    """Distinct storages of parameters, buffers and inputs: the state alive when a step starts (gradients
    are set to None before each measured step, so the allocator's step peak counts them)."""
    ins = inputs.values() if isinstance(inputs, dict) else inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    return storage_bytes([*model.parameters(), *model.buffers(), *(t for t in ins if torch.is_tensor(t))])


def checkpoint_real_peak(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor]) -> tuple[int | None, str]:
    """(real peak of one step under ``torch.utils.checkpoint`` around every block: the state alive at its
    start plus the CPU allocator's peak during it, ""), or (None, why checkpoint does not apply)."""
    first, _ = run_methods(model, inputs, loss_fn, ["ckpt-block"], budget=None, steps=1, warmup=1,
                           allocator_peak=True, measure_peaks=True)
    ck = next(r for r in first if r.method == "ckpt-block")
    if ck.status != "ok" or ck.alloc_peak_bytes is None:
        return None, ck.reason or "no allocator peak"
    return state_bytes(model, inputs) + ck.alloc_peak_bytes, ""


def _plain_forward(model: nn.Module, inputs: Any) -> Callable[[], Any]:
    args, kwargs = _args_kwargs(inputs)
    return lambda: model(*args, **kwargs)


# Selective activation checkpointing keeps what these ops return (the compute-heavy ones) and recomputes the rest
_SAC_SAVE = frozenset(("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
                       "_scaled_dot_product_cudnn_attention"))


def _sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    name = getattr(op, "_opname", "")
    return CheckpointPolicy.MUST_SAVE if name in _SAC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointBlock(nn.Module):
    """Runs ``inner`` under non-reentrant ``torch.utils.checkpoint`` (RNG state preserved, kwargs allowed);
    ``selective``: selective activation checkpointing (the outputs of matrix products, convolutions and
    attention kept, the rest recomputed)."""

    def __init__(self, inner: nn.Module, selective: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.selective = selective

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        if self.selective:
            return checkpoint(self.inner, *args, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, _sac_policy), **kwargs)
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)


def _is_leaf(m: nn.Module) -> bool:
    return next(m.children(), None) is None


def wrap_blocks(model: nn.Module, selective: bool = False) -> int:
    """Wrap every block of ``model`` in :class:`CheckpointBlock`, in place; return how many.

    A block is a composite child of a ``Sequential``/``ModuleList`` (ResNet bottlenecks, MobileNet
    inverted residuals, transformer layers, U-Net levels). A ``Sequential`` of plain layers with pooling
    (VGG's features) is cut into its pooling-delimited runs instead, the VGG paper's "blocks".
    Wrapping keeps the parameter order, so gradients can be compared position by position.
    """
    count = 0

    def visit(m: nn.Module) -> None:
        nonlocal count
        kids = list(m.children())
        if isinstance(m, (nn.Sequential, nn.ModuleList)) and any(not _is_leaf(k) for k in kids):
            for i, k in enumerate(kids):
                if not _is_leaf(k):
                    m[i] = CheckpointBlock(k, selective)
                    count += 1
            return
        if isinstance(m, nn.Sequential) and kids and all(_is_leaf(k) for k in kids) \
                and any(isinstance(k, _POOLS) for k in kids) and len(kids) >= 4:
            runs, run = [], []
            for k in kids:
                run.append(k)
                if isinstance(k, _POOLS):
                    runs.append(run)
                    run = []
            if run:
                runs.append(run)
            for name in list(m._modules):
                del m._modules[name]
            for i, r in enumerate(runs):
                m.add_module(str(i), CheckpointBlock(nn.Sequential(*r), selective))
            count += len(runs)
            return
        for k in kids:
            visit(k)

    visit(model)
    return count


class _FlattenForLinear(nn.Module):
    """``torch.flatten(x, 1)`` where a model's forward flattens between its pooling and its classifier."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(x, 1) if x.dim() > 2 else x


def sequential_view(model: nn.Module, inputs: Any) -> list[nn.Module]:
    """The model as a chain of modules for ``checkpoint_sequential``, or raise :class:`Unavailable`.

    The chain is the model's children in registration order, ``Sequential`` children spliced in and a
    flatten before the first ``Linear``; it is accepted only if it reproduces the model's output exactly
    on the real inputs (checked on throw-away copies, so no running statistics move).
    """
    if not isinstance(inputs, torch.Tensor):
        raise Unavailable("its forward takes several or keyword inputs, not one tensor")
    chain: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, nn.ModuleList):
            raise Unavailable("its forward loops over a ModuleList with extra arguments or skips")
        parts = list(child) if isinstance(child, nn.Sequential) else [child]
        for p in parts:
            if isinstance(p, nn.Linear) and not any(isinstance(c, (nn.Linear, _FlattenForLinear)) for c in chain):
                chain.append(_FlattenForLinear())
            if getattr(p, "inplace", False) and chain:
                # An in-place activation must not open a segment: it would overwrite the previous
                # segment's output, which checkpointing keeps to recompute from. Pair it with its producer
                # (what a user of checkpoint_sequential has to do by hand on VGG).
                chain[-1] = nn.Sequential(chain[-1], p)
                continue
            chain.append(p)
    if len(chain) < 2:
        raise Unavailable("it has fewer than two top-level layers")
    a, b = copy.deepcopy(model), None
    b = copy.deepcopy(nn.Sequential(*chain))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        want = a(inputs)
        torch.manual_seed(0)
        got = b(inputs)
    if not (isinstance(want, torch.Tensor) and want.shape == got.shape and torch.equal(want, got)):
        raise Unavailable("its forward is not a plain chain of its children (skips or branches)")
    return chain


def build_variant(method: str, model: nn.Module, inputs: Any, *, budget: int | None = None,
                  plan: Any = None) -> Variant:
    """A fresh deep copy of ``model`` set up for ``method``; raise :class:`Unavailable` with a reason."""
    m = copy.deepcopy(model)
    if method == "unmanaged":
        return Variant(method, m, _plain_forward(m, inputs))
    if method == "save-on-cpu":
        from torch.autograd.graph import save_on_cpu

        return Variant(method, m, _plain_forward(m, inputs), context=lambda: save_on_cpu(pin_memory=False))
    if method in ("ckpt-block", "ckpt-selective"):
        if wrap_blocks(m, selective=method == "ckpt-selective") == 0:
            raise Unavailable("no blocks found to wrap")
        return Variant(method, m, _plain_forward(m, inputs))
    if method == "ckpt-sqrt":
        from torch.utils.checkpoint import checkpoint_sequential

        chain = sequential_view(m, inputs)
        segments = max(1, round(math.sqrt(len(chain))))
        seq = nn.Sequential(*chain)  # shares m's modules, so m's parameters get the gradients
        return Variant(method, m, lambda: checkpoint_sequential(seq, segments, inputs, use_reentrant=False))
    if method.startswith("hybridmem"):
        monitor_only = method.startswith("hybridmem-monitor")
        kw: dict[str, Any] = {"budget": None if monitor_only else budget, "device": "cpu"}
        if method == "hybridmem-monitor-ops":
            kw["monitor"] = "ops"
        if method in ("hybridmem-recompute", "hybridmem-recompute-mode", "hybridmem-plan-recompute"):
            kw["policies"] = ("recompute",)
        if method.endswith("-mode"):  # every step under the dispatch mode (no steady state): the comparison
            kw["config"] = {"plugins": {"steady": False}}
        if method in ("hybridmem-plan", "hybridmem-plan-recompute"):
            if plan is None or isinstance(plan, str):  # a string says why there is no plan
                raise Unavailable(plan or "no plan (planner or capture missing)")
            kw["plan"] = plan
        return Variant(method, m, _plain_forward(m, inputs), context=persistent_runtime(**kw))
    raise ValueError(f"unknown measured method {method!r}; known: {', '.join(METHODS)}, hybridmem-monitor-ops, "
                     "hybridmem-plan-recompute")


def persistent_runtime(**kw: Any) -> Callable[[], AbstractContextManager]:
    """A context factory that switches one hybridmem runtime on around each step and off after it.

    A user enables hybridmem once and trains; the runtime keeps what it learns from step to step. To
    interleave methods, that one runtime is made once and re-installed around each of its steps,
    rather than a fresh ``session()`` per step (which would start cold every time). Falls back to a
    session per step if the runtime's internals are not as expected.
    """
    try:
        import hybridmem
        from hybridmem import runtime as rtmod
    except ImportError as e:
        raise Unavailable(f"hybridmem runtime not importable: {e}") from None
    if not hasattr(rtmod, "session"):
        raise Unavailable("hybridmem runtime has no session()")
    hybridmem.enable(**kw)
    rt = rtmod.current.rt
    hybridmem.disable()
    if rt is None or not hasattr(rt, "install") or not hasattr(rt, "uninstall"):
        return lambda: hybridmem.session(**kw)

    @contextmanager
    def active() -> Iterator[Any]:
        if rtmod.current.rt is not None:
            raise RuntimeError("another hybridmem runtime is enabled: the benchmark needs the thread to itself")
        rt.install(reset_peak=False)
        rtmod.current.rt = rt
        try:
            yield rt
        finally:
            rtmod.current.rt = None
            rt.uninstall()

    return active


# ---- peak probe ------------------------------------------------------------------------------------
PeakFn = Callable[[Variant, Callable[[], None]], int]


def peak_probe() -> tuple[str, PeakFn]:
    """``(source name, fn)`` where ``fn(variant, step)`` runs ``step`` once and returns the peak bytes.

    One meter measures every method, so peaks compare like for like: ``hybridmem.runtime.meter.Meter`` on the
    simulated CPU device, counting the weights, gradients and inputs too (what a device would hold). For
    hybridmem's managed methods the runtime's meter is read instead (``hybridmem.stats().peak_bytes``, the
    same counting rules), since only it knows which copies the runtime moved to the host. Without the
    meter, the CPU allocator's events (torch.profiler) are the fallback; they count only what the step
    allocates on top of what was live before it.
    """
    try:
        from hybridmem.runtime.meter import Meter
    except ImportError:
        return "torch.profiler allocator events (step increment)", lambda v, step: _profiler_peak(step)

    def meter_peak(v: Variant, step: Callable[[], None]) -> int:
        # monitor-only evicts nothing and may count through the allocator (other rules): the meter's count
        if v.method.startswith("hybridmem") and not v.method.startswith("hybridmem-monitor"):
            import hybridmem

            hybridmem.reset_stats()
            step()
            return int(hybridmem.stats().peak_bytes)
        with Meter("cpu") as m:
            m.track(v.model, v.inputs, v.optimizer)
            step()
        return int(m.peak_bytes)

    return "hybridmem meter (simulated device: weights, grads, optimizer state and activations)", meter_peak


def alloc_peak(step: Callable[[], None]) -> int:
    """The CPU allocator's own peak during ``step`` above what was live before (torch.profiler events)."""
    with without_profiler_lines():
        try:
            from hybridmem.runtime.meter import profiler_peak
        except ImportError:
            return _profiler_peak(step)
        return int(profiler_peak(step))


_PROFILER_LINE = re.compile(r"^USDT:.*\] profiler_(start|stop)\s*$")


@contextmanager
def without_profiler_lines() -> Iterator[None]:
    """Drop the ``USDT: ... profiler_start/stop`` lines the profiler's C++ side writes to file descriptor 2
    at every start and stop (no setting turns them off); everything else written there is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not _PROFILER_LINE.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def _profiler_peak(step: Callable[[], None]) -> int:
    """Peak of live bytes allocated during ``step`` on top of what was live before, from allocator events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return peak


# ---- the run ---------------------------------------------------------------------------------------
@dataclass
class _State:
    variant: Variant
    result: MethodResult
    ratios: list[float] = field(default_factory=list)
    grads_first: list[torch.Tensor] | None = None


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros(0) for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b.detach().clone() for b in model.buffers()]


def step_clock() -> Callable[[], float]:
    """The clock steps are timed with: ``HYBRIDMEM_BENCH_CLOCK`` = ``cpu`` (default) or ``wall``."""
    import os

    name = os.environ.get("HYBRIDMEM_BENCH_CLOCK", "cpu").strip().lower()
    if name not in ("cpu", "wall"):
        raise ValueError(f"HYBRIDMEM_BENCH_CLOCK={name!r}: accepted values are 'cpu' and 'wall'")
    return time.process_time if name == "cpu" else time.perf_counter


def one_step(v: Variant, loss_fn: Callable[[Any], torch.Tensor], seed: int) -> tuple[float, float]:
    """One training step of ``v`` with the RNG seeded: returns ``(loss, seconds)`` (:func:`step_clock`)."""
    clock = step_clock()
    torch.manual_seed(seed)
    v.model.zero_grad(set_to_none=True)
    with v.context():
        t0 = clock()
        loss = loss_fn(v.forward())
        loss.backward()
        if v.optimizer is not None:
            v.optimizer.step()
        dt = clock() - t0
        v.after_step()
    return float(loss.detach()), dt


def run_methods(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor], methods: list[str], *,
                budget: int | None, plan: Any = None, steps: int = 3, warmup: int = 1, lr: float = 0.01,
                progress: Any = None, allocator_peak: bool = False,
                measure_peaks: bool = True) -> tuple[list[MethodResult], str]:
    """Train each method's copy for ``warmup + steps`` steps, interleaved; return results and peak source.

    The first ``warmup`` rounds are not timed (allocator and kernel warm-up) but their losses are
    compared too. Gradients are compared after the first and the last step.
    """
    states: list[_State] = []
    for method in dict.fromkeys(["unmanaged", *methods]):
        try:
            v = build_variant(method, model, inputs, budget=budget, plan=plan)
        except Unavailable as e:
            states.append(_State(None, MethodResult(method, status="skipped", reason=str(e))))  # type: ignore[arg-type]
            continue
        except Exception as e:  # a comparator failing must not sink the others; say what happened
            states.append(_State(None, MethodResult(method, status="error", reason=f"{type(e).__name__}: {e}")))  # type: ignore[arg-type]
            continue
        v.optimizer = torch.optim.SGD(v.model.parameters(), lr=lr)
        v.inputs = inputs
        states.append(_State(v, MethodResult(method)))
    live = [s for s in states if s.variant is not None]
    ref = live[0]
    assert ref.result.method == "unmanaged"
    rounds = warmup + steps
    grads: dict[str, list[torch.Tensor]] = {}
    for r in range(rounds):
        gc.collect()
        times: dict[str, float] = {}
        k = r % len(live)  # rotate who goes first: no method always runs on a cache its neighbour warmed
        for s in live[k:] + live[:k]:
            if s.result.status != "ok":
                continue
            for o in live:
                # the others' gradients go (each set them to None before its own step anyway): a budget caps
                # what the allocator holds, and a hybridmem runtime would count another variant's gradients
                if o is not s and o.variant is not None:
                    o.variant.model.zero_grad(set_to_none=True)
            try:
                loss, dt = one_step(s.variant, loss_fn, seed=1000 + r)
            except Exception as e:
                s.result.status, s.result.reason = "error", f"{type(e).__name__}: {str(e).splitlines()[0]}"
                continue
            s.result.losses.append(loss)
            if r >= warmup:
                s.result.times_s.append(dt)
                times[s.result.method] = dt
            if r == 0 or r == rounds - 1:
                grads[s.result.method] = _grads(s.variant.model)
            if progress is not None:
                progress.update()
        if r == 0 or r == rounds - 1:  # compare once the whole round is done (the reference may run last)
            want = grads.pop("unmanaged", None)
            for s in live:
                g = grads.pop(s.result.method, None)
                if s is ref or g is None or want is None:
                    continue
                same = _same(g, want)
                s.result.grads_identical = same if s.result.grads_identical is None else (s.result.grads_identical and same)
        base = times.get("unmanaged")
        for s in live:
            t = times.get(s.result.method)
            if base and t is not None:
                s.ratios.append(t / base)
    ref_buffers = _buffers(ref.variant.model)
    for s in live:
        res = s.result
        if res.status != "ok":
            continue
        res.step_s = statistics.median(res.times_s) if res.times_s else None
        res.overhead = statistics.median(s.ratios) - 1 if s.ratios else None
        res.losses_identical = len(res.losses) == len(ref.result.losses) and all(
            _bits(a) == _bits(b) for a, b in zip(res.losses, ref.result.losses))
        if s is not ref:
            res.buffers_identical = _same(_buffers(s.variant.model), ref_buffers)
    source, probe = peak_probe()
    for s in live:
        if s.result.status != "ok" or not measure_peaks:
            continue
        v = s.variant
        for o in live:  # as in the rounds: no other variant's gradients held meanwhile
            if o.variant is not None:
                o.variant.model.zero_grad(set_to_none=True)
        try:
            torch.manual_seed(0)
            v.model.zero_grad(set_to_none=True)  # outside the probe: the peak is the step's own
            with v.context():
                s.result.peak_bytes = probe(v, lambda: _probe_step(v, loss_fn))
                _read_hybridmem_stats(s.result)
            if allocator_peak:
                v.model.zero_grad(set_to_none=True)
                with v.context():
                    s.result.alloc_peak_bytes = alloc_peak(lambda: _probe_step(v, loss_fn))
        except Exception as e:
            s.result.reason = f"peak not measured: {type(e).__name__}: {e}"
        if budget is not None and s.result.peak_bytes is not None and s.result.method.startswith(("hybridmem-online", "hybridmem-plan", "hybridmem-recompute")):
            s.result.budget_ok = s.result.peak_bytes <= budget
    return [s.result for s in states], source


def _probe_step(v: Variant, loss_fn: Callable[[Any], torch.Tensor]) -> None:
    loss_fn(v.forward()).backward()


def _read_hybridmem_stats(res: MethodResult) -> None:
    if not res.method.startswith("hybridmem"):
        return
    import hybridmem

    st = hybridmem.stats()
    for pol, ps in (getattr(st, "policies", None) or {}).items():
        res.evicted_bytes[pol] = int(getattr(ps, "evicted_bytes", 0) or 0)
        res.regenerated_bytes[pol] = int(getattr(ps, "regenerated_bytes", 0) or 0)
    res.stall_s = getattr(st, "stall_seconds", None)
    res.plan_state = str(getattr(st, "plan", "") or "")
    if getattr(st, "cap_overruns", 0):
        res.reason = f"{st.cap_overruns} op(s) ran over the budget (runtime's own count)"


def _bits(x: float) -> bytes:
    import struct

    return struct.pack("<d", x)
