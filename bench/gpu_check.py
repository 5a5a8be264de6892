"""CUDA check: the CPU test suite's correctness and hard-cap checks, run on a GPU, as one short table.

    python bench/gpu_check.py                 # on a machine with CUDA (the default device)
    python bench/gpu_check.py --device cpu    # the same checks on the CPU's simulated device (dry run)

First the ``--compiled`` models (default ResNet-50) under ``torch.compile``: Inductor unmanaged, and
hybridmem's compile backend at 70 % of the unmanaged steady-state peak with swap and recompute (PyTorch's
activation offloading for the swaps), then PyTorch's own recompute knapsack (``activation_memory_budget``
at the ``--amb`` ratios) beside hybridmem's backend at the peak that knapsack reached, timed interleaved;
they run first, before the eager rows leave the allocator's cache and library workspaces behind. Then
for each model: 4 SGD steps unmanaged (twice: on CUDA, under
``torch.use_deterministic_algorithms``, to show the device repeats itself), then 4 steps under hybridmem
per policy set at a budget of the monitor-only peak minus 30 % of the saved-activation bytes (where the
runtime says that cannot work, the smallest budget it names + 1 %, up to 8 tries). A row passes when the
losses, every gradient and every BatchNorm buffer are bit-identical to the unmanaged run (lossless
policies; within rounding where two unmanaged runs differ) and the peak of *every* step, the first
included, stays within the budget: on CUDA the peak is ``torch.cuda.max_memory_allocated`` (reset at each
step), the allocator's own number. The ``(monitor only)`` row is the runtime watching without a budget.

cuDNN runs a convolution with the plan it cached for that shape; where the cap refuses the plan's
workspace it runs the next plan and caches that one for the rest of the process, so a model's rows from
the first refusal on may round differently from its unmanaged run: ``cuDNN+``, counted apart from the
failures (``refused`` counts the allocations refused; the largest one's size is printed under the row,
the room a workspace needed). The ``--exact`` models then run again with cuDNN off
(``-cuDNN`` rows), where no kernel depends on free memory and every row must be bit-identical.

The first lines say whether the CUDA caching-allocator hook (hybridmem's free-memory callback) was built
and registered; each row shows how often the caching allocator called it and what it freed, the swap
rows the copy time hidden behind compute vs exposed (stall), and ``steady`` the steps that ran without the
dispatch mode. A row whose run raised says where
(the whole traceback goes to stderr) and the next rows still run; ``--verify`` checks every regenerated
saved tensor against the bytes it was evicted with. No model starts after ``--deadline`` seconds (default
420; those left are listed), so that the check ends within a device session. Exit status 1 if a row fails.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# cuBLAS reads this when it creates its handle: deterministic matrix products (with
# torch.use_deterministic_algorithms below), so that unmanaged runs repeat bit for bit on CUDA too
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing bench

import hybridmem  # noqa: E402
from hybridmem.zoo import build  # noqa: E402

POLICY_SETS = (("swap",), ("recompute",), ("compress",), ("swap", "recompute", "compress"))
ROUNDS = 10  # interleaved timing rounds of the compiled variants beside PyTorch's activation budget
STEPS = 4  # steps 1-2 under the dispatch mode (2 records the program), 3-4 in the steady state where it applies
CUT = 0.3  # of the saved-activation bytes (compress alone: of what its codecs save)
TRIES = 8  # budgets tried per row: the first, then the minimum each OOM names + 1 %


@dataclass
class Row:
    model: str
    policies: str
    budget: int
    peaks: list[int]
    identical: bool
    step_ms: float
    base_ms: float
    stall_ms: float
    regen_ms: float
    hook_calls: int = 0
    hook_freed: int = 0
    hidden_ms: float = 0.0
    steady: int = 0  # steps run without the dispatch mode (hybridmem.runtime.program)
    error: str = ""  # the exception that ended the row's run, if any (the other rows still run)
    repeatable: bool = True  # two unmanaged runs were bit-identical (else: compared within rounding)
    worst: float = 0.0  # the largest difference from the unmanaged run, of the tensor's largest magnitude
    first_diff: int = 0  # the first step whose loss differs from the unmanaged run's (0: none)
    refused: int = 0  # CUDA: allocations the caching allocator refused during the run (num_ooms), caught by the
    #                  runtime or by a library that then does without (cuDNN: another convolution algorithm)
    cudnn: bool = False  # differs, and cuDNN was refused workspace in this model's rows so far (check_model)
    refused_max: int = 0  # CUDA: the largest allocation refused during the run (bytes)

    @property
    def peak(self) -> int:
        return max(self.peaks)

    @property
    def ok(self) -> bool:
        return not self.error and (self.identical or self.cudnn) and all(p <= self.budget for p in self.peaks)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(entry, device: torch.device, steps: int = STEPS,
           peaks: list[int] | None = None) -> tuple[list[torch.Tensor], dict, float]:
    """Run ``steps`` SGD steps on a copy of the model; return losses, final state and ms per step. On
    CUDA, ``peaks`` receives each step's ``max_memory_allocated``."""
    model = copy.deepcopy(entry.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # stateless: the activation peak stays the peak
    losses = []
    torch.manual_seed(1234)  # dropout masks: same RNG stream in every run
    if device.type == "cuda":
        torch.cuda.manual_seed_all(1234)
    _sync(device)
    t0 = time.perf_counter()
    for step in range(steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        args, kwargs = entry.args_kwargs()
        loss = entry.loss_fn(model(*args, **kwargs))
        loss.backward()
        losses.append(loss.detach())
        if peaks is not None and device.type == "cuda":
            _sync(device)
            peaks.append(torch.cuda.max_memory_allocated(device))
        if step == steps - 1:  # keep the last gradients without copying (zero_grad drops, not zeroes)
            grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
    _sync(device)
    ms = (time.perf_counter() - t0) * 1e3 / steps
    # no copies here: this may run under the budget; the final buffers and parameters are read as they are
    state = {"grads": grads, **{f"buf:{n}": b.detach() for n, b in model.named_buffers()},
             **{f"param:{n}": p.detach() for n, p in model.named_parameters()}}
    return losses, state, ms


def _worst(a: tuple[list, dict], b: tuple[list, dict]) -> float:
    """The largest difference between two runs' losses and gradients, relative to each tensor's largest value."""
    pairs = list(zip(a[0], b[0])) + [(a[1]["grads"][k], b[1]["grads"][k]) for k in a[1]["grads"] if k in b[1]["grads"]]
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item() for x, y in pairs)


def _first_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    """The first step (from 1) whose loss differs bit for bit between two runs; 0 where none does."""
    return next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)), 0)


def _ooms(device: torch.device) -> int:
    return torch.cuda.memory_stats(device).get("num_ooms", 0) if device.type == "cuda" else 0


_REFUSED_SIZES: list[int] = []  # CUDA: the size of each allocation the caching allocator refused


def _watch_refusals(device: torch.device) -> None:
    """Record the size of every allocation the caching allocator refuses (its OOM observer): the largest a
    row saw is the room a library's workspace needed beside the budget's count (cuDNN's, mostly)."""
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if device.type == "cuda" and attach is not None:
        attach(lambda dev, alloc, allocated, free: _REFUSED_SIZES.append(int(alloc)))


def _identical(a: tuple[list, dict], b: tuple[list, dict], exact: bool = True) -> bool:
    """Losses, gradients, buffers and parameters bit-identical (``exact``) or equal within rounding."""
    same = torch.equal if exact else (lambda x, y: torch.allclose(x.double(), y.double(), rtol=1e-3, atol=1e-5))
    la, sa = a
    lb, sb = b
    if len(la) != len(lb) or not all(same(x, y) for x, y in zip(la, lb)):
        return False
    flat = lambda s: {**{f"grad:{k}": v for k, v in s["grads"].items()}, **{k: v for k, v in s.items() if k != "grads"}}
    fa, fb = flat(sa), flat(sb)
    return fa.keys() == fb.keys() and all(same(fa[k], fb[k]) for k in fa)


def compressible_bytes(entry) -> int:
    """Bytes the lossless codecs would save on one step's saved activations (the compress-only target)."""
    from hybridmem.plugins.compress import compressible_share

    args, kwargs = entry.args_kwargs()
    inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    _, per_codec = compressible_share(entry.model, lambda m: entry.loss_fn(m(*args, **kwargs)), exclude=inputs)
    return sum(per_codec.values())


def _managed(entry, device: torch.device, budget: int, policies: tuple[str, ...], plugins: dict | None = None):
    """Train under ``budget`` (raised to the minimum an OOM names + 1 %, at most TRIES times): the session,
    the budget it ran at, each step's peak, losses, state and ms per step; else the last OOM's message.
    ``plugins``: the session's ``plugins`` config (``--verify``, ``--workspace``)."""
    config = {"plugins": plugins} if plugins else None
    for _ in range(TRIES):
        gc.collect()  # what earlier runs left in reference cycles is memory the allocator holds
        peaks: list[int] = []
        try:
            with hybridmem.session(budget=budget, policies=policies, device=str(device), config=config) as s:
                losses, state, ms = _train(entry, device, peaks=peaks)
            return s, budget, peaks, losses, state, ms
        except torch.OutOfMemoryError as e:  # infeasible: the named minimum + 1 %, as a user would
            named = getattr(e, "min_budget_bytes", None)
            if named is None or named <= budget:
                raise
            budget = int(named * 1.01)
            last = str(e).splitlines()[0][:300]
            del e
    return last


def check_model(name: str, size: str, device: torch.device, plugins: dict | None = None) -> list[Row]:
    entry = build(name, size, device=device)
    base_losses, base_state, base_ms = _train(entry, device)
    # a device whose kernels do not repeat bit for bit (atomics in some backward kernels on CUDA, even with
    # deterministic algorithms asked for) cannot show bit-identity: such rows compare within rounding
    again = _train(entry, device)
    repeatable = _identical((base_losses, base_state), again[:2])
    again = None
    with hybridmem.session(budget=None, device=str(device)) as s:
        m_losses, m_state, m_ms = _train(entry, device)  # the same steps as below: optimizer state counts too
    monitor = s.stats()
    # the runtime watching, evicting nothing: where this differs, interposing alone changes the kernels run
    same = _identical((base_losses, base_state), (m_losses, m_state), exact=repeatable)
    rows = [Row(name, "(monitor only)", monitor.peak_bytes, [monitor.peak_bytes], same, m_ms, base_ms, 0.0, 0.0,
                repeatable=repeatable, worst=0.0 if same else _worst((m_losses, m_state), (base_losses, base_state)),
                first_diff=_first_diff(m_losses, base_losses))]
    m_losses = m_state = None
    # cuDNN runs a convolution with the plan it cached for its shape; where the cap refuses that plan's
    # workspace it tries the next plan and caches the one that ran, for the rest of the process: from the
    # first refusal on, this model's convolutions may round differently from the unmanaged run's
    convs = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in entry.model.modules())
    plans_changed = False
    for policies in POLICY_SETS:
        # compress alone can only reach the share its lossless codecs save: its cut is of those bytes
        cut = compressible_bytes(entry) if policies == ("compress",) else monitor.saved_bytes
        budget = int(monitor.peak_bytes - CUT * cut)
        native = _native()
        calls0, freed0 = (native.cuda_calls, native.cuda_freed_bytes) if native is not None else (0, 0)
        ooms0, sizes0 = _ooms(device), len(_REFUSED_SIZES)
        try:
            run = _managed(entry, device, budget, policies, plugins)
        except Exception as e:  # noqa: BLE001  (the row says what ended it; the next rows still run)
            rows.append(Row(name, "+".join(policies), budget, [0], False, 0.0, base_ms, 0.0, 0.0, error=_err(e)))
            gc.collect()
            continue
        if isinstance(run, str):
            rows.append(Row(name, "+".join(policies) + " (no budget found)", budget, [budget + 1], False,
                            0.0, base_ms, 0.0, 0.0, error=f"the last of {TRIES} tries: {run}"))
            continue
        s, budget, peaks, losses, state, ms = run
        st = s.stats()
        if device.type != "cuda":
            peaks = [st.peak_bytes]
        swap = s.runtime.policies.get("swap")
        copy_s = swap.stats if swap is not None else {}  # (a property: the copies' times)
        hidden = copy_s.get("hidden_s", 0.0)  # swap-in time behind compute (the rest was a stall)
        same = _identical((base_losses, base_state), (losses, state), exact=repeatable)
        worst = 0.0 if same else _worst((losses, state), (base_losses, base_state))
        first = _first_diff(losses, base_losses)
        refused = _ooms(device) - ooms0
        plans_changed |= convs and refused > 0 and device.type == "cuda" and torch.backends.cudnn.enabled
        losses = state = run = None  # the run's model copy must not be alive during the next run: the budget counts it
        rows.append(Row(name, "+".join(policies), budget, peaks, same,
                        ms, base_ms, st.stall_seconds * 1e3, st.regen_seconds * 1e3,
                        (native.cuda_calls - calls0) if native is not None else 0,
                        (native.cuda_freed_bytes - freed0) if native is not None else 0, hidden * 1e3,
                        st.steady_steps, repeatable=repeatable, worst=worst,
                        first_diff=first, refused=refused, cudnn=not same and plans_changed,
                        refused_max=max(_REFUSED_SIZES[sizes0:], default=0)))
    return rows


def _err(e: BaseException) -> str:
    """An exception as one line, with where it was raised (its last frame); the whole traceback goes to
    stderr, chained exceptions included."""
    import traceback
    traceback.print_exception(e, file=sys.stderr)
    frames = traceback.extract_tb(e.__traceback__)
    at = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{at}"


def _leftover(device: torch.device, what: str) -> None:
    """Free what earlier rows left cached; say what is still allocated (every row's peak includes it)."""
    gc.collect()
    if device.type == "cuda":
        torch._C._cuda_clearCublasWorkspaces()  # cuBLAS keeps a workspace per stream in the caching allocator
        torch.cuda.empty_cache()
        # plain tensors only: torch.compile leaves FakeTensors behind, which have no data pointer
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in gc.get_objects()
                if type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cuda"}
        print(f"# before {what}: {torch.cuda.memory_allocated(device) / 2**20:.1f} MiB allocated "
              f"({sum(seen.values()) / 2**20:.1f} MiB in {len(seen)} tensors Python holds), "
              f"{torch.cuda.memory_reserved(device) / 2**20:.1f} MiB reserved")


def _native():
    from hybridmem.native import cpumeter
    return cpumeter.load()


def hook_lines(device: torch.device) -> list[str]:
    """What enforces the budget on this device: the native library, the CUDA hook, or why not."""
    from hybridmem.native import cpumeter

    native = cpumeter.load()
    if native is None:
        return [f"# native library: not available ({cpumeter.unavailable_reason()})"]
    if device.type != "cuda":
        return ["# native allocator device: the CPU allocator, capped at allocation time"]
    if not native.cuda_hook:
        return [f"# CUDA caching-allocator hook: not built ({cpumeter.cuda_note()}); op-boundary cap + memory fraction"]
    return [f"# CUDA caching-allocator hook: built, registered={native.cuda_registered} ({native.path.name})"]


@dataclass
class _Compiled:
    """One compiled variant of a model and what its steps measured."""

    model: torch.nn.Module
    compiled: Any
    opt: torch.optim.Optimizer
    peaks: list[int]                  # each step's peak (CUDA; 0 on the CPU)
    grads: list[torch.Tensor]         # the last step's gradients
    ms: float                         # the fastest step after those that may compile, seconds
    compile_s: float = 0.0            # the first step's wall seconds (it compiles)


def _one_step(entry, c: _Compiled, device: torch.device, seed: int, args: tuple, kwargs: dict) -> float:
    torch.manual_seed(seed)           # the same dropout masks in every variant
    c.opt.zero_grad(set_to_none=True)
    _sync(device)
    t0 = time.perf_counter()
    entry.loss_fn(c.compiled(*args, **kwargs)).backward()
    _sync(device)
    return time.perf_counter() - t0


def _compiled_steps(model: torch.nn.Module, entry, backend, device: torch.device, label: str) -> _Compiled:
    """4 SGD steps of ``torch.compile(model, backend=backend)``: the peak of each, the last gradients,
    the fastest of the steps after the first two (the first compiles, the second may compile again).
    ``label`` names the variant: each gets code of its own, so that Dynamo neither reuses another variant's
    compiled step for it nor drops that one's (the variants are timed side by side afterwards)."""
    from bench.compiled import distinct

    c = _Compiled(model, torch.compile(distinct(model, label), backend=backend),
                  torch.optim.SGD(model.parameters(), lr=0.01), [], [], 0.0)
    args, kwargs = entry.args_kwargs()
    times = []
    for step in range(STEPS):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times.append(_one_step(entry, c, device, step, args, kwargs))
        c.peaks.append(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0)
        c.grads = [p.grad.detach().clone() for p in model.parameters()]
        c.opt.step()
    c.ms = min(times[2:] or times)
    c.compile_s = times[0]
    return c


def _interleaved_ms(entry, runs: list[_Compiled], device: torch.device, rounds: int = ROUNDS) -> list[float]:
    """Each variant's median step time over ``rounds`` rounds of one step of each in turn (compiled already:
    no compile in the rounds), so that a busy device slows them alike."""
    args, kwargs = entry.args_kwargs()
    times: list[list[float]] = [[] for _ in runs]
    for r in range(rounds):
        for i, c in enumerate(runs):
            times[i].append(_one_step(entry, c, device, STEPS + r, args, kwargs))
    return [statistics.median(t) for t in times]


def _infeasible(e: BaseException):
    """The hybridmem budget error behind ``e`` (torch.compile chains the backend's), or None."""
    from hybridmem.errors import BudgetInfeasibleError
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, BudgetInfeasibleError):
            return e
        e = getattr(e, "inner_exception", None) or e.__cause__ or e.__context__
    return None


def _mibs(peaks: list[int]) -> str:
    """Per-step peaks in MiB, '/'-separated."""
    return "/".join(f"{p / 2**20:.1f}" for p in peaks)


def _ratio(x: float, y: float) -> str:
    return f"{x / y:.3f}" if y else "-"


def _compiled_entry(name: str, size: str, device: torch.device, batch: int | None = None) -> Any:
    """A zoo model, or ``MODULE:FACTORY``'s (``bench.models:hf_gpt2_small``: Hugging Face's GPT-2 small), on
    ``device``, as the zoo's entries are: ``model``, ``loss_fn``, ``args_kwargs()``."""
    if ":" not in name:
        return build(name, size, batch=batch, device=device)
    import types

    from hybridmem.factory import load_model

    spec = load_model(name, size=size)
    inputs = spec.inputs if isinstance(spec.inputs, tuple) else (spec.inputs,)
    inputs = tuple(x.to(device) if torch.is_tensor(x) else x for x in inputs)
    return types.SimpleNamespace(model=spec.model.to(device), loss_fn=spec.loss_fn or (lambda out: out),
                                 args_kwargs=lambda: (inputs, {}))


def _predicted(st: Any) -> str:
    """The regions' predicted step time over keep-all, as the plan counted it."""
    return "/".join(f"{100 * r.predicted_overhead:+.1f} %" for r in st.regions)


def check_compiled(name: str, size: str, device: torch.device, fraction: float = 0.7,
                   ambs: tuple[float, ...] = (0.5,), policy_sets: tuple[tuple[str, ...] | None, ...] = (None,),
                   batch: int | None = None) -> list[str]:
    """torch.compile (Inductor) unmanaged, then (``fraction`` > 0) under hybridmem's compile backend at
    ``fraction`` of its peak with swap and recompute: peaks per step, step time, gradients within rounding.
    Then for each ratio of ``ambs``, PyTorch's own recompute knapsack (``activation_memory_budget``) beside
    hybridmem's backend (once per policy set of ``policy_sets``; None: its default) at the peak that knapsack
    reached: peaks per step against the budget, interleaved median step times as ratios to the unmanaged
    step's, hybridmem's predicted step time beside its measured one, and its planning time beside Inductor's
    compile time (the knapsack's first step; docs/benchmarks.md's compiled table, on this device)."""
    from torch._dynamo.utils import counters
    from torch._functorch import config as fconfig

    from bench.compiled import own_inductor
    from hybridmem.compile import compile_backend

    entry = _compiled_entry(name, size, device, batch)
    base = copy.deepcopy(entry.model)
    torch._dynamo.reset()          # nothing compiled before (another model's variants) is kept
    torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)   # a variant per backend
    c0 = _compiled_steps(copy.deepcopy(base), entry, own_inductor(), device, f"{name}_unmanaged")
    peaks0, grads0 = c0.peaks, c0.grads
    cuda = device.type == "cuda"
    lines: list[str] = []

    def managed(budget: int, label: str, policies: tuple[str, ...] | None = None) -> tuple[_Compiled | None, Any, int]:
        """hybridmem's backend at ``budget``; where it says the budget cannot work, the budget it names + 1 %,
        as a user would (3 tries)."""
        for _ in range(3):
            # the loop drops the outputs before the backward (entry.loss_fn reads them inside the step)
            backend = compile_backend(budget, device=device, hold_outputs=False,
                                      **({} if policies is None else {"policies": policies}))
            try:
                return (_compiled_steps(copy.deepcopy(base), entry, backend, device, f"{label}_hybridmem_{budget}"),
                        backend, budget)
            except Exception as e:  # noqa: BLE001  (torch.compile wraps the backend's error: BackendCompilerFailed)
                cause = _infeasible(e)
                if cause is None or not cause.minimum_bytes or cause.minimum_bytes <= budget:
                    lines.append(f"compiled {label:12s} budget {budget / 2**20:.1f} MiB: {_err(e)}  FAIL")
                    return None, None, budget
                lines.append(f"# compiled {label}: {str(cause).splitlines()[0][:400]}")
                budget = int(cause.minimum_bytes * 1.01)
        lines.append(f"compiled {label:12s}: no budget found in 3 tries  FAIL")
        return None, None, budget

    def close(c: _Compiled) -> tuple[bool, float]:
        ok = all(torch.allclose(a, b, rtol=1e-3, atol=1e-5) for a, b in zip(c.grads, grads0))
        worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() for a, b in zip(c.grads, grads0))
        return ok, worst

    if fraction > 0:
        budget = int(fraction * max(peaks0[1:])) if cuda else 1 << 40  # steps after the compiling one
        c, backend, budget = managed(budget, name)
        if c is None:
            return lines
        same, worst = close(c)
        ok = same and (not cuda or max(c.peaks) <= budget)
        lines += [f"compiled {name:12s} budget {budget / 2**20:8.1f} MiB  peaks {_mibs(c.peaks)} "
                  f"(unmanaged {_mibs(peaks0)})  step {c.ms * 1e3:.1f} ms (unmanaged {c0.ms * 1e3:.1f})  "
                  f"grads {'close' if same else 'DIFFER'} (worst {worst:.1e} of a tensor's largest)  {'ok' if ok else 'FAIL'}"]
        lines += [f"  {line}" for line in str(backend.stats()).splitlines()]
        del c, backend
    top0 = max(peaks0[1:])
    for r in ambs:
        with fconfig.patch(activation_memory_budget=r):     # the partition runs at the first call
            ca = _compiled_steps(copy.deepcopy(base), entry, own_inductor(), device, f"{name}_amb_{r}")
        b = max(ca.peaks[1:]) if cuda else 1 << 40
        for policies in policy_sets:
            label = f"{name} amb={r}" + ("" if policies is None else f" [{','.join(policies)}]")
            ch, backend, b_used = managed(b, label, policies)
            if ch is None:
                continue
            frames = counters["frames"]["ok"]
            t0, ta, th = _interleaved_ms(entry, [c0, ca, ch], device)
            recompiled = counters["frames"]["ok"] - frames     # a variant compiled again would time another step
            same, worst = close(ch)
            st = backend.stats()
            plan_s = st.plan_seconds
            ok = same and not recompiled and (not cuda or max(ch.peaks) <= b_used)
            lines += [f"compiled {label:16s} knapsack: peak {max(ca.peaks[1:]) / 2**20:.1f} MiB "
                      f"({_ratio(max(ca.peaks[1:]), top0)} of unmanaged), step x{_ratio(ta, t0)}, compiled in "
                      f"{ca.compile_s:.1f} s  |  hybridmem at {b_used / 2**20:.1f} MiB: peaks {_mibs(ch.peaks)} "
                      f"({_ratio(max(ch.peaks[1:]), top0)}; {'within' if max(ch.peaks) <= b_used else 'OVER'} the "
                      f"budget), step x{_ratio(th, t0)} (predicted {_predicted(st)}), compiled in "
                      f"{ch.compile_s:.1f} s, planning {plan_s:.1f} s = {100 * plan_s / max(ca.compile_s, 1e-9):.0f} % of "
                      f"Inductor's compile  (unmanaged {t0 * 1e3:.1f} ms, median of {ROUNDS} interleaved"
                      f"{f', {recompiled} frame(s) compiled again' if recompiled else ''})  "
                      f"grads {'close' if same else 'DIFFER'} (worst {worst:.1e})  {'ok' if ok else 'FAIL'}"]
            lines += [f"  {line}" for line in str(st).splitlines()]
            del ch, backend
        del ca
    return lines


def _policy_sets(text: str) -> tuple[tuple[str, ...] | None, ...]:
    """``--compiled-policies``: policy sets, 'default' (or nothing) for the backend's own."""
    from hybridmem.compile.backend import _policies
    parts = [p.strip() for p in text.split(";") if p.strip()]
    return tuple(None if p == "default" else _policies(p) for p in parts) or (None,)


def _ratios(text: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ratios between 0 and 1, ','-separated (e.g. 0.5,0.2)") from None
    if any(not 0.0 < x <= 1.0 for x in out):
        raise argparse.ArgumentTypeError(f"{text!r}: each ratio must be in (0, 1]")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    ap.add_argument("--models", default="resnet50,transformer,gpt,unet,mobilenet", help="zoo models")
    ap.add_argument("--size", default="small", help="zoo size (default: small)")
    ap.add_argument("--compiled", default="resnet50",
                    help="zoo models to check under torch.compile with hybridmem's backend ('' to skip)")
    ap.add_argument("--amb", default="0.5", type=_ratios,
                    help="--compiled models: PyTorch's activation_memory_budget at these ','-separated ratios beside "
                         "hybridmem's backend at the peak each reached ('' to skip; default 0.5)")
    ap.add_argument("--compiled-policies", default="",
                    help="--compiled models: hybridmem's policy sets beside the knapsack, ';'-separated, 'default' for "
                         "the backend's own (e.g. 'default;recompute'; default: the backend's own only)")
    ap.add_argument("--fraction", type=float, default=0.7,
                    help="--compiled models: hybridmem's backend first at this share of the unmanaged peak (0 skips it)")
    ap.add_argument("--batch", type=int, default=None, help="--compiled zoo models: this batch instead of the size's")
    ap.add_argument("--expandable", action="store_true",
                    help="CUDA: the caching allocator's expandable segments (a segment grows by 2 MiB pages "
                         "instead of a new 20 MiB one: less of a capped budget lost to its cache)")
    ap.add_argument("--verify", action="store_true",
                    help="plugins: {verify: true}: every regenerated saved tensor is checked against the bytes it "
                         "was evicted with (a mismatch ends the row naming the tensor and the policy)")
    ap.add_argument("--no-cudnn", action="store_true",
                    help="torch.backends.cudnn.enabled = False in every run (PyTorch's own convolution and "
                         "BatchNorm kernels, whose scratch is plain tensors: no algorithm chosen by free memory)")
    ap.add_argument("--exact", default="resnet50",
                    help="CUDA: models run again with cuDNN off after the table ('-cuDNN' rows), where no "
                         "convolution plan depends on free memory: bit-identical or failed ('' to skip)")
    ap.add_argument("--deadline", type=float, default=420.0,
                    help="seconds after which no further model starts (those left are listed), so that the "
                         "check ends within a device session's time (default 420)")
    ap.add_argument("--workspace", default=None,
                    help="plugins: {workspace: ...} in every managed run (e.g. 64MiB): room kept free beside the "
                         "count at each op, so that the cap leaves cuDNN the workspace of the plan it cached")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    if args.no_cudnn:
        torch.backends.cudnn.enabled = False
    if args.expandable and device.type == "cuda":
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; run with --device cpu for a dry run", file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)  # kernels with no deterministic version warn
        torch.backends.cudnn.benchmark = False
        _watch_refusals(device)
        warnings.filterwarnings("ignore", message=".*does not have a deterministic implementation.*")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (simulated device)"
    print(f"# hybridmem gpu_check  {time.strftime('%Y-%m-%d %H:%M')}  {name}  torch {torch.__version__}"
          + ("  expandable segments" if args.expandable else "") + ("  cuDNN off" if args.no_cudnn else "")
          + (f"  workspace room {args.workspace}" if args.workspace else ""))
    for line in hook_lines(device):
        print(line)
    failed = 0
    # the compiled models first: the eager rows' runs leave the allocator's cache and workspaces behind
    for model in filter(None, args.compiled.split(",")):
        _leftover(device, f"compiled {model}")
        try:
            for line in check_compiled(model, args.size, device, fraction=args.fraction, ambs=args.amb,
                                       policy_sets=_policy_sets(args.compiled_policies), batch=args.batch):
                failed += line.endswith("FAIL")
                print(line)
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"compiled {model}  error: {_err(e)}  FAIL")
    print(f"{'model':12s} {'policies':26s} {'budget MiB':>10s} {'peak MiB (per step)':>22s} {'bit-equal':>9s} "
          f"{'step ms':>8s} {'base ms':>8s} {'regen ms':>9s} {'stall ms':>9s} {'hidden ms':>9s} "
          f"{'hook calls':>10s} {'hook MiB':>8s} {'refused':>7s} {'steady':>6s}  ok")
    plugins = {**({"verify": True} if args.verify else {}),
               **({"workspace": args.workspace} if args.workspace else {})}
    runs = [(m, False) for m in filter(None, args.models.split(","))]
    if device.type == "cuda" and torch.backends.cudnn.enabled:
        runs += [(m, True) for m in filter(None, args.exact.split(","))]
    skipped = []
    for model, no_cudnn in runs:
        if time.perf_counter() - started > args.deadline:
            skipped.append(f"{model} -cuDNN" if no_cudnn else model)
            continue
        _leftover(device, model)
        torch.backends.cudnn.enabled = not (no_cudnn or args.no_cudnn)
        try:
            rows = check_model(model, args.size, device, plugins)
        except Exception as e:  # noqa: BLE001  (one table for all models: a model's error is its row)
            rows = [Row(model, "(unmanaged/monitor)", 0, [0], False, 0.0, 0.0, 0.0, 0.0, error=_err(e))]
        for r in rows:
            failed += not r.ok
            peaks = _mibs(r.peaks)
            label = f"{r.model} -cuDNN" if no_cudnn else r.model
            print(f"{label:12s} {r.policies:26s} {r.budget / 2**20:10.1f} {peaks:>22s} "
                  f"{('yes' if r.repeatable else 'close*') if r.identical else ('cuDNN+' if r.cudnn else 'NO'):>9s} "
                  f"{r.step_ms:8.1f} {r.base_ms:8.1f} {r.regen_ms:9.1f} {r.stall_ms:9.1f} {r.hidden_ms:9.1f} "
                  f"{r.hook_calls:10d} {r.hook_freed / 2**20:8.1f} {r.refused:7d} {r.steady:6d}  "
                  f"{'ok' if r.ok else 'FAIL'}")
            if r.error:
                print(f"    error: {r.error}")
            if r.refused_max:
                print(f"    largest allocation refused: {r.refused_max / 2**20:.2f} MiB")
            if not r.identical and r.worst:
                where = f"from step {r.first_diff}'s loss" if r.first_diff else "in the last step's gradients only"
                print(f"    differs from the unmanaged run {where}; by up to {r.worst:.1e} of a tensor's largest value "
                      f"after {STEPS} steps (unmanaged runs {'repeat' if r.repeatable else 'differ'} bit for bit)")
    print("close*: two unmanaged runs of the model differ on this device; compared within rtol 1e-3")
    print("refused: allocations the caching allocator refused at the cap during the run (the runtime makes room "
          "and retries; cuDNN instead runs the convolution with another plan that needs less workspace)")
    print("cuDNN+: differs after cuDNN was refused workspace in this model's rows: it ran and cached another "
          "convolution plan, which rounds differently (the unmanaged run, short of memory, does the same); "
          "not counted as failed. '-cuDNN' rows (--exact) run with cuDNN off, where every row must be bit-identical")
    if skipped:
        print(f"# not run, past the --deadline of {args.deadline:.0f} s: {', '.join(skipped)}")
    print(f"{failed} row(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
