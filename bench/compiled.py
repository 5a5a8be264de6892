"""Compiled training steps side by side: unmanaged ``torch.compile``, PyTorch's activation memory budget
and hybridmem's compile backend, at equal real peak.

    python -m bench.compiled --models resnet50,gpt --size small --ratios 0.5,0.2 --rounds 10 --json out.json
    python -m bench.compiled --from-json out.json --plot docs/img/compiled.png     # table and plot again
    python -m bench.compiled --models bench.models:relu_mlp --policies "recompute;compress;recompute,compress"
    python -m bench.compiled --models resnet50 --margins 0.11,0.08 --rounds 16    # the margin for Inductor's buffers

For each model: the step compiled by Inductor unmanaged, then with
``torch._functorch.config.activation_memory_budget`` at each ratio (PyTorch's recompute knapsack), then
with ``hybridmem.compile_backend`` whose budget is the real peak that ratio reached (once per policy set of
``--policies``, ``;``-separated; default: the backend's own). A model is a zoo name or ``MODULE:FACTORY``
(:func:`hybridmem.factory.load_model`). Every variant is
compiled once (its first step, timed, Inductor's caches off so each compile is a cold one), checked
against the unmanaged losses and gradients, and its real peak measured as acceptance does (the training
state alive at the step's start + the CPU allocator's peak during the step, torch.profiler events).
Step times are CPU seconds of the training thread, variants interleaved in every round, reported as the
median of per-round ratios to the unmanaged step.
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import time
import types
from dataclasses import asdict, dataclass, field
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from bench.measure import alloc_peak, step_clock, storage_bytes

__all__ = ["CompiledResult", "compare", "main"]


@dataclass
class CompiledResult:
    """One variant of one model."""

    model: str
    variant: str                      # "inductor", "amb=0.5", "hybridmem@amb=0.5"
    budget_bytes: int | None = None   # hybridmem's budget
    real_peak_bytes: int = 0
    compile_s: float = 0.0            # wall seconds of the first step (compile included)
    plan_s: float = 0.0               # of which hybridmem's planning
    trial_s: float = 0.0              # ... and its run of the compiled step at compile time (verify)
    replans: int = 0                  # plans made again because that run held more than the share
    step_ratio: float = 1.0           # median per-round step time / unmanaged
    max_grad_diff: float = 0.0        # largest gradient difference to the unmanaged compiled step
    bit_identical: bool = True
    recomputed: int = 0
    compressed: int = 0
    note: str = ""                    # why a variant has no measurements (its compile failed)
    warning: str = ""                 # something wrong with a measured variant


@dataclass
class _Variant:
    name: str
    model: nn.Module
    compiled: Callable[..., Any]
    optimizer: torch.optim.Optimizer
    result: CompiledResult
    ratios: list[float] = field(default_factory=list)


def _state_bytes(model: nn.Module, optimizer: Any, inputs: list[Any]) -> int:
    ts = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
    ts += [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    ts += [t for t in inputs if torch.is_tensor(t)]
    return storage_bytes(ts)


def _step(v: _Variant, args: tuple, kwargs: dict, loss_fn: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    loss = loss_fn(v.compiled(*args, **kwargs))
    loss.backward()
    return loss.detach()


class _Own(nn.Module):
    """A model behind a forward of its own: Dynamo caches compiled code per code object, so two
    variants of one model would otherwise share the first one's compiled step."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def _own_forward(self: _Own, *args: Any, **kwargs: Any) -> Any:
    return self.inner(*args, **kwargs)


def distinct(model: nn.Module, label: str) -> nn.Module:
    """``model`` behind a forward whose code object is its own (named after ``label``): torch.compile of it
    compiles anew, and a later compile of another variant leaves its compiled code in place."""
    code = _own_forward.__code__.replace(co_name="forward_" + re.sub(r"\W", "_", label))
    fn = types.FunctionType(code, _own_forward.__globals__, code.co_name)
    cls = type(f"Own_{code.co_name}", (_Own,), {"forward": fn})
    return cls(model)


def own_inductor() -> Callable[..., Any]:
    """Inductor as a backend object of its own. Dynamo keeps compiled code per code object, guarded by the
    backend's identity: a frame inside a module all variants share (Hugging Face's ``GPT2LMHeadModel.forward``
    resumed after a graph break) would otherwise run the first variant's code for every later variant that
    names ``"inductor"`` (its parameters are graph inputs, not guarded by identity), and PyTorch's activation
    memory budget would never be applied there."""
    from torch._inductor.compile_fx import compile_fx

    def inductor(gm: Any, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs)
    return inductor


def _prepare(name: str, entry: Any, label: str, backend: Any, amb: float | None, args: tuple, kwargs: dict) -> _Variant:
    from torch._functorch import config as fconfig

    if backend == "inductor":
        backend = own_inductor()
    model = copy.deepcopy(entry.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # the model's name too: Dynamo keys what it learned of a frame (sizes that changed between calls make
    # it compile for any size) by the code object, which two models' variants of one label would share
    compiled = torch.compile(distinct(model, f"{name}_{label}"), backend=backend)
    res = CompiledResult(model=name, variant=label)
    v = _Variant(label, model, compiled, opt, res)
    patch = fconfig.patch(activation_memory_budget=amb) if amb is not None else fconfig.patch({})
    t0 = time.perf_counter()
    with patch:                                   # the partition runs at the first call
        torch.manual_seed(0)
        _step(v, args, kwargs, entry.loss_fn)
        # graph breaks: a region planned again for the regions after it is compiled again at its next call
        for _ in range(3):
            if not getattr(backend, "pending", lambda: 0)():
                break
            _step(v, args, kwargs, entry.loss_fn)
    res.compile_s = time.perf_counter() - t0
    return v


def _measure_peak(v: _Variant, args: tuple, kwargs: dict, loss_fn: Any) -> int:
    v.model.zero_grad(set_to_none=True)
    state = _state_bytes(v.model, v.optimizer, [*args, *kwargs.values()])
    torch.manual_seed(0)
    return state + alloc_peak(lambda: _step(v, args, kwargs, loss_fn))


def _entry(name: str, size: str) -> Any:
    """A zoo model, or ``MODULE:FACTORY``'s, as the zoo's entries are: ``model``, ``loss_fn``, ``args_kwargs()``."""
    if ":" not in name:
        from hybridmem.zoo import build
        return build(name, size)
    from hybridmem.factory import load_model

    spec = load_model(name, size=size)
    inputs = spec.inputs if isinstance(spec.inputs, tuple) else (spec.inputs,)
    return types.SimpleNamespace(model=spec.model, loss_fn=spec.loss_fn, args_kwargs=lambda: (inputs, {}))


def _label(policies: tuple[str, ...] | None, ratio: float, margin: float | None = None) -> str:
    return (f"hybridmem{'' if policies is None else '[' + ','.join(policies) + ']'}@amb={ratio}"
            + ("" if margin is None else f" margin={margin}"))


@contextmanager
def _margin(share: float | None) -> Iterator[None]:
    """The compile backend's margin for Inductor's buffers (``INDUCTOR_MARGIN``, a share of the keep-all
    count) set to ``share`` while a variant compiles; None: the backend's own."""
    from hybridmem.compile import tuning

    saved = tuning.INDUCTOR_MARGIN
    if share is not None:
        if not 0.0 <= share < 1.0:
            raise ValueError(f"margin {share}: a share of the keep-all count in [0, 1), e.g. 0.08")
        tuning.INDUCTOR_MARGIN = share
    try:
        yield
    finally:
        tuning.INDUCTOR_MARGIN = saved


def compare(name: str, size: str = "small", ratios: tuple[float, ...] = (0.5,), rounds: int = 10,
            log: Callable[[str], None] = print,
            policies: tuple[tuple[str, ...] | None, ...] = (None,),
            margins: tuple[float | None, ...] = (None,)) -> list[CompiledResult]:
    """The variants of one model (see the module docstring); ``policies``: one hybridmem variant per policy
    set at each ratio (None: the backend's default), and of each per margin of ``margins`` (the share of
    the keep-all count left free for Inductor's buffers on convolutional models; None: the backend's)."""
    import torch._inductor.config as iconfig
    from torch._functorch import config as fconfig

    from hybridmem.compile import compile_backend

    entry = _entry(name, size)
    args, kwargs = entry.args_kwargs()
    variants: list[_Variant] = []
    # every variant compiles the frames of a shared module again (own_inductor): room for them all in Dynamo's cache
    recompiles = 4 * (1 + len(ratios) * (1 + len(policies) * len(margins)))
    with iconfig.patch(fx_graph_cache=False), fconfig.patch(enable_autograd_cache=False), \
            torch._dynamo.config.patch(recompile_limit=max(recompiles, torch._dynamo.config.recompile_limit)):
        base = _prepare(name, entry, "inductor", "inductor", None, args, kwargs)
        variants.append(base)
        base.result.real_peak_bytes = _measure_peak(base, args, kwargs, entry.loss_fn)
        log(f"{name}: inductor compiled in {base.result.compile_s:.1f} s, real peak {base.result.real_peak_bytes}")
        for r in ratios:
            amb = _prepare(name, entry, f"amb={r}", "inductor", r, args, kwargs)
            amb.result.real_peak_bytes = _measure_peak(amb, args, kwargs, entry.loss_fn)
            variants.append(amb)
            log(f"{name}: amb={r} compiled in {amb.result.compile_s:.1f} s, real peak {amb.result.real_peak_bytes}")
            budget = amb.result.real_peak_bytes
            for pol, share in ((pol, share) for pol in policies for share in margins):
                label = _label(pol, r, share)
                extra = {} if pol is None else {"policies": pol}
                # _step drops the outputs. measure=False: the backend's own meter would count every variant
                # this process holds beside it (214 % of the budget, read in the log); the real peak column is
                # measured per variant as acceptance measures it
                backend = compile_backend(budget, hold_outputs=False, measure=False, **extra)
                try:
                    with _margin(share):
                        hm = _prepare(name, entry, label, backend, None, args, kwargs)
                except Exception as e:     # a budget below what a plan can reach: reported, not hidden
                    # Dynamo wraps the backend's error: its first line names the backend, the cause follows
                    why = next((ln for ln in str(e).splitlines() if "Error:" in ln), str(e).splitlines()[0])[:400]
                    log(f"{name}: {label} at {budget} B: {why}")
                    variants.append(_Variant(label, None, None, None,  # type: ignore[arg-type]
                                             CompiledResult(name, label, budget_bytes=budget, note=why)))
                    continue
                st = backend.stats()
                hm.result.budget_bytes = budget
                hm.result.plan_s = st.plan_seconds
                hm.result.trial_s = sum(x.trial_s for x in st.regions)
                hm.result.replans = sum(x.replans for x in st.regions)
                hm.result.recomputed = sum(x.recomputed for x in st.regions)
                hm.result.compressed = sum(x.compressed for x in st.regions)
                hm.result.real_peak_bytes = _measure_peak(hm, args, kwargs, entry.loss_fn)
                variants.append(hm)
                log(f"{name}: {label} at {budget} B compiled in {hm.result.compile_s:.1f} s (planning "
                    f"{hm.result.plan_s:.1f} s), real peak {hm.result.real_peak_bytes}\n{st}")
    live = [v for v in variants if v.compiled is not None]
    # the same step's gradients: each variant against the unmanaged compiled step
    ref = None
    for v in live:
        v.model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        _step(v, args, kwargs, entry.loss_fn)
        grads = [p.grad.detach().clone() for p in v.model.parameters()]
        if ref is None:
            ref = grads
        else:
            v.result.bit_identical = all(torch.equal(a, b) for a, b in zip(grads, ref))
            v.result.max_grad_diff = max(float((a - b).abs().max()) for a, b in zip(grads, ref))
    if ref is not None:
        # the reference itself, against eager PyTorch: a parameter whose compiled gradient is all zeros where
        # eager's is not (torch 2.13.0+cpu: every convolution of VGG-16 small under Inductor's layout
        # optimization) makes every comparison above one with a wrong step
        m = copy.deepcopy(entry.model)
        torch.manual_seed(1)
        entry.loss_fn(m(*args, **kwargs)).backward()
        dead = [n for (n, p), g in zip(m.named_parameters(), ref)
                if p.grad is not None and not bool(g.any()) and bool(p.grad.any())]
        if dead:
            live[0].result.warning = (f"{len(dead)} parameter(s) get all-zero gradients from the unmanaged compiled "
                                   f"step and non-zero ones from eager PyTorch ({', '.join(dead[:3])}"
                                   + (", ..." if len(dead) > 3 else "") + ")")
            log(f"{name}: {live[0].result.warning}")
    clock = step_clock()
    for k in range(rounds):
        times: dict[str, float] = {}
        order = live[k % len(live):] + live[:k % len(live)]      # the first mover rotates
        for v in order:
            v.model.zero_grad(set_to_none=True)
            torch.manual_seed(2 + k)
            t0 = clock()
            _step(v, args, kwargs, entry.loss_fn)
            times[v.name] = clock() - t0
        for v in live:
            v.ratios.append(times[v.name] / times["inductor"])
    for v in live:
        v.result.step_ratio = statistics.median(v.ratios)
    return [v.result for v in variants]


def table(results: list[CompiledResult]) -> str:
    """A markdown table of the results, peaks as a share of the unmanaged compiled step's."""
    lines = ["| model | variant | real peak (÷ compiled unmanaged) | step time (÷ compiled unmanaged) | compile s (planning s) | grads |",
             "|---|---|---:|---:|---:|---|"]
    base = {r.model: r.real_peak_bytes for r in results if r.variant == "inductor"}
    for r in results:
        if r.note:
            lines.append(f"| {r.model} | {r.variant} | budget {r.budget_bytes / base[r.model]:.3f}: {r.note} | | | |")
            continue
        grads = "bit-identical" if r.bit_identical else f"max diff {r.max_grad_diff:.1e}"
        over = (f" (over its budget by {100 * (r.real_peak_bytes / r.budget_bytes - 1):.1f} %)"
                if r.budget_bytes and r.real_peak_bytes > r.budget_bytes else "")
        lines.append(f"| {r.model} | {r.variant} | {r.real_peak_bytes / base[r.model]:.3f}{over} | ×{r.step_ratio:.3f} | "
                     f"{r.compile_s:.1f}" + (f" ({r.plan_s:.1f})" if r.plan_s else "")
                     + f" | {grads}{'; ' + r.warning if r.warning else ''} |")
    return "\n".join(lines)


def plot(results: list[CompiledResult], path: str) -> None:
    """Step time against real peak (both ÷ the unmanaged compiled step's), one panel per model: PyTorch's
    activation memory budget and hybridmem's backend at the same peaks."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in results))
    fig, axes = plt.subplots(1, len(models), figsize=(4 * len(models), 3.4), squeeze=False)
    for ax, name in zip(axes[0], models):
        rs = [r for r in results if r.model == name and not r.note]
        base = next(r for r in rs if r.variant == "inductor").real_peak_bytes
        for label, pick, marker in (("torch.compile (Inductor)", lambda v: v == "inductor", "s"),
                                    ("activation_memory_budget", lambda v: v.startswith("amb="), "o"),
                                    ("hybridmem compile backend", lambda v: v.startswith("hybridmem@"), "^"),
                                    ("hybridmem, other policies", lambda v: v.startswith("hybridmem["), "v")):
            pts = sorted((r.real_peak_bytes / base, r.step_ratio, r.variant) for r in rs if pick(r.variant))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=label)
                for x, y, v in pts:
                    ax.annotate(v.split("@")[-1].replace("amb=", ""), (x, y), fontsize=7,
                                textcoords="offset points", xytext=(3, 3))
        ax.set_title(name)
        ax.set_xlabel("real peak ÷ unmanaged compiled")
        ax.set_ylabel("step time ÷ unmanaged compiled")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _policy_sets(text: str | None) -> tuple[tuple[str, ...] | None, ...]:
    """``--policies`` as policy sets; a bad name is the backend's own error (its accepted names)."""
    if not text:
        return (None,)
    from hybridmem.compile.backend import _policies
    return tuple(_policies(part) for part in text.split(";") if part.strip())


def _margins(text: str | None) -> tuple[float | None, ...]:
    if not text:
        return (None,)
    try:
        shares = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        shares = ()
    if not shares or not all(0.0 <= x < 1.0 for x in shares):
        raise SystemExit(f"--margins {text!r}: shares of the keep-all count in [0, 1), ','-separated, e.g. 0.11,0.08")
    return shares


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet50,mobilenet,transformer,gpt")
    p.add_argument("--size", default="small")
    p.add_argument("--ratios", default="0.5")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="draw step time against real peak here (PNG)")
    p.add_argument("--from-json", default=None, help="tables and plot from a results file, without running")
    p.add_argument("--policies", default=None,
                   help="hybridmem variants' policy sets, ';'-separated "
                        "(e.g. 'recompute;compress;recompute,compress'); default: the backend's own")
    p.add_argument("--margins", default=None,
                   help="hybridmem variants' margins for Inductor's buffers, ','-separated shares of the "
                        "keep-all count (e.g. '0.11,0.08'); default: the backend's own")
    a = p.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            results = [CompiledResult(**d) for d in json.load(f)]
        print(table(results))
        if a.plot:
            plot(results, a.plot)
        return 0
    torch.set_num_threads(1)
    results: list[CompiledResult] = []
    for name in a.models.split(","):
        results += compare(name.strip(), a.size, tuple(float(x) for x in a.ratios.split(",")), a.rounds,
                           policies=_policy_sets(a.policies), margins=_margins(a.margins))
        print(table(results), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump([asdict(r) for r in results], f, indent=1)
    if a.plot:
        plot(results, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
