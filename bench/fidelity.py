"""How well hybridmem's numbers meet the allocator's: for each model, one training step (forward, backward,
an SGD-momentum step) measured three ways on this CPU, with the gradients of the step before kept and freed.

- **real**: the CPU allocator's peak in the step (torch.profiler's memory events) plus the training state
  alive when it starts (parameters, gradients, buffers, optimizer state, inputs): ``shared/tools/real_peak.py``
  beside the checkout, else the same measurement here;
- **simulated**: ``simulate(capture(model, inputs, loss_fn, device="cpu", optimizer=opt,
  optimizer_step=True)).peak_bytes``, captured with the gradients as the loop leaves them;
- **watched**: ``stats().peak_bytes`` of a step under ``hybridmem.session(budget=None)``.

    python -m bench.fidelity                      # the zoo at small size and the three models below
    python -m bench.fidelity --models resnet50 tv-resnet18 --size bench --json fidelity.json

Models outside the zoo (:mod:`bench.fidelity_models`): ``tv-resnet18``, ``tv-mobilenet_v2`` (torchvision's,
written out) and ``hf-gpt2-tiny`` (Hugging Face's GPT-2 from a config; needs ``transformers``).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import hybridmem
from hybridmem.graph.capture import split_inputs
from hybridmem.graph.units import fmt_bytes
from hybridmem.runtime.meter import profiler_peak
from hybridmem.zoo import MODELS, build

from .fidelity_models import BUILDERS

_TOOLS = Path(__file__).resolve().parents[2] / "shared" / "tools"
GRADS = ("kept", "none")


@dataclass
class Row:
    model: str
    grads: str               # "kept": the step starts with the step before's gradients; "none": zero_grad(set_to_none=True)
    real_bytes: int
    simulated_bytes: int
    watched_bytes: int | None

    @property
    def simulated_ratio(self) -> float:
        return self.simulated_bytes / self.real_bytes

    @property
    def watched_ratio(self) -> float | None:
        return None if self.watched_bytes is None else self.watched_bytes / self.real_bytes


def real_peak_fn() -> Callable[..., int]:
    """``real_peak(step, model, optimizer, inputs)``: the acceptance tool where it is, else the same here."""
    if (_TOOLS / "real_peak.py").is_file():
        sys.path.insert(0, str(_TOOLS))
        from real_peak import real_peak  # the acceptance tool, beside the checkout
        return real_peak

    def real_peak(step: Callable[[], Any], model: nn.Module, optimizer: Any = None, inputs: Any = ()) -> int:
        ts = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
        if optimizer is not None:
            ts += [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        ts += [t for t in inputs if torch.is_tensor(t)]
        state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}
        return sum(state.values()) + profiler_peak(step)
    return real_peak


def model_of(name: str, size: str) -> tuple[nn.Module, Any, Callable[[Any], torch.Tensor]]:
    if name in BUILDERS:
        return BUILDERS[name]()
    if name in MODELS:
        e = build(name, size)
        return e.model, e.inputs, e.loss_fn
    raise ValueError(f"unknown model {name!r}; accepted: {', '.join((*MODELS, *BUILDERS))}")


def trained(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor], opt: torch.optim.Optimizer,
            grads: str) -> tuple[Callable[[], None], Callable[[], None], tuple[Any, ...]]:
    """The model after two steps (gradients and optimizer state exist): its step (forward, backward, the
    optimizer's step), the loop's zero_grad before it (``grads="none"``: set to None; ``"kept"``: none), and
    the step's input tensors. The zero_grad has run once."""
    args, kwargs = split_inputs(inputs)

    def step() -> None:
        loss_fn(model(*args, **kwargs)).backward()
        opt.step()

    def before() -> None:  # the loop's zero_grad, outside the measured step
        if grads == "none":
            opt.zero_grad(set_to_none=True)

    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        step()
    before()
    return step, before, (*args, *kwargs.values())


def measure(name: str, size: str = "small", grads: str = "kept", watch: bool = True) -> Row:
    """One row: the model after two SGD-momentum steps (gradients and momentum exist), then the step measured
    three ways, each from the same state."""
    if grads not in GRADS:
        raise ValueError(f"grads={grads!r}; accepted: {', '.join(GRADS)}")
    model, inputs, loss_fn = model_of(name, size)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step, before, tensors = trained(model, inputs, loss_fn, opt, grads)
    real = real_peak_fn()(step, model, opt, tensors)
    before()
    graph = hybridmem.capture(model, inputs, loss_fn, device="cpu", optimizer=opt, optimizer_step=True)
    simulated = hybridmem.simulate(graph, device="measured").peak_bytes
    watched = None
    if watch:
        with hybridmem.session(budget=None) as s:
            before()
            step()
            before()
            hybridmem.reset_stats()
            step()
            watched = s.stats().peak_bytes
    return Row(name, grads, real, simulated, watched)


def table(rows: list[Row]) -> str:
    lines = ["| model | gradients before the step | real | simulated | ratio | watched | ratio |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        w = "-" if r.watched_bytes is None else fmt_bytes(r.watched_bytes)
        wr = "-" if r.watched_ratio is None else f"{r.watched_ratio:.3f}"
        lines.append(f"| {r.model} | {r.grads} | {fmt_bytes(r.real_bytes)} | {fmt_bytes(r.simulated_bytes)} | "
                     f"{r.simulated_ratio:.3f} | {w} | {wr} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=[*MODELS, *BUILDERS], help="zoo names and/or "
                    f"{', '.join(BUILDERS)} (default: all)")
    ap.add_argument("--size", default="small", help="zoo size (default: small)")
    ap.add_argument("--no-watch", action="store_true", help="leave out the watching runtime's peak")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # single-threaded steps give stable allocator figures
    rows = []
    for name in args.models:
        for grads in GRADS:
            rows.append(measure(name, args.size, grads, watch=not args.no_watch))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "simulated_ratio": r.simulated_ratio,
                                          "watched_ratio": r.watched_ratio} for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
