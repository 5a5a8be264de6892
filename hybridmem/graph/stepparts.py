"""The parts of a training step beside forward and backward that the allocator holds, for
:func:`~hybridmem.graph.capture.capture`: gradients that exist before the step, the optimizer's own step
(its state and temporaries), and the summary of what a graph counts (``graph.meta["counted"]``).

- **Gradients before the step.** A loop that keeps its gradients (no ``zero_grad``, or
  ``zero_grad(set_to_none=False)``, gradient accumulation) starts each step with one gradient per
  parameter; backward adds into them in place, so they are held for the whole step and each new
  gradient is a temporary. ``grads="auto"`` counts the gradients the parameters have when capture is
  called, ``"kept"`` one for every parameter that requires grad, ``"none"`` none (as after
  ``zero_grad(set_to_none=True)``, PyTorch's default).
- **The optimizer's step.** ``optimizer_step=True`` records one ``optimizer.step()`` after backward (phase
  ``"optimizer"``), taken by an optimizer of the same class and hyperparameters over the captured
  parameters, stepped once beforehand so that its state exists before the recorded step, as it does
  in every step but the first. The user's optimizer is not stepped; parameters are restored.
"""
from __future__ import annotations

from typing import Any, Callable

import gc

import torch

from ..errors import CaptureError
from .ir import TensorInfo
from .optstate import unique_params
from .recorder import Fixed
from .units import fmt_bytes

Tensor = torch.Tensor
GRADS = ("auto", "kept", "none")


def check_grads(grads: str) -> str:
    if grads not in GRADS:
        raise ValueError(f"grads={grads!r} is not accepted; accepted: {', '.join(map(repr, GRADS))} ('auto': the "
                         "gradients the parameters have now, 'kept': one per parameter that requires grad, as in a "
                         "loop without zero_grad, 'none': as after zero_grad(set_to_none=True))")
    return grads


class GradsBefore:
    """Sets the gradients a captured step starts with and restores the user's afterwards (values too: backward
    adds into a kept gradient in place)."""

    def __init__(self, params: list[Tensor], originals: list[Tensor], grads: str, names: list[str]):
        self.params, self.originals, self.grads, self.names = params, originals, grads, names
        self.saved: list[tuple[Tensor, Tensor | None]] = []
        self.values: list[tuple[Tensor, Tensor]] = []

    def __enter__(self) -> dict[int, Fixed]:
        """Returns the storages of the gradients the step starts with, as pre-existing tensors."""
        fixed: dict[int, Fixed] = {}
        for p, orig, name in zip(self.params, self.originals, self.names):
            self.saved.append((p, p.grad))
            if self.grads == "none" or not p.requires_grad:
                p.grad = None
                continue
            if p is not orig and orig.grad is not None and p.grad is None:  # a meta copy of the model
                p.grad = torch.empty_like(p)
            elif self.grads == "kept" and p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad is None:
                continue
            if p.grad.device.type != "meta":
                self.values.append((p.grad, p.grad.detach().clone()))
            fixed[id(p.grad.untyped_storage())] = Fixed("grad", f"{name}.grad")
        return fixed

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for g, v in self.values:
                g.copy_(v)
        for p, g in self.saved:
            p.grad = g


class OptimizerStep:
    """One ``step()`` of an optimizer like the user's, over the captured parameters, for the recorder."""

    def __init__(self, optimizer: torch.optim.Optimizer, user_params: list[Tensor], run_params: list[Tensor],
                 names: dict[int, str]):
        by_id = {id(u): r for u, r in zip(user_params, run_params)}
        missing = [p for p in unique_params(optimizer) if id(p) not in by_id]
        if missing:
            raise CaptureError(f"optimizer_step=True: the optimizer steps {len(missing)} tensor(s) that are not "
                               "parameters of the captured model; capture with optimizer_step=False")
        self.optimizer, self.by_id, self.names = optimizer, by_id, names
        self.probe: torch.optim.Optimizer | None = None
        self.restore: list[tuple[Tensor, Tensor]] = []

    def prepare(self) -> dict[int, Fixed]:
        """Build the probe and step it once, unrecorded, so that its state exists; returns its state storages."""
        opt = self.optimizer
        params = [p for p in self.by_id.values()]
        self.restore = [(p, p.detach().clone()) for p in params if p.device.type != "meta"]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [self.by_id[id(p)] for p in g["params"]]}
                  for g in opt.param_groups]
        try:
            try:
                probe = type(opt)(groups, **opt.defaults)
            except TypeError:  # a constructor that does not take every default by name: the groups carry them
                probe = type(opt)(groups)
            _step(probe)
        except Exception as e:
            raise CaptureError(f"optimizer_step=True: could not step a {type(opt).__name__} like the given one "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); capture with "
                               "optimizer_step=False (its state is then counted, its step's temporaries are not)") from e
        self.probe = probe
        fixed: dict[int, Fixed] = {}
        for i, p in enumerate(params):
            for k, v in probe.state.get(p, {}).items():
                if isinstance(v, Tensor):
                    fixed[id(v.untyped_storage())] = Fixed("optimizer", f"optimizer.{self.names.get(id(p), f'param{i}')}.{k}")
        return fixed

    def run(self) -> None:
        """The recorded step."""
        assert self.probe is not None
        _step(self.probe)

    def finish(self) -> None:
        with torch.no_grad():
            for p, v in self.restore:
                p.copy_(v)
        self.restore = []

    def unseen_state(self, tensors: list[TensorInfo], seen: Callable[[Tensor], bool]) -> None:
        """Append state tensors no recorded op touched (they are held all the same)."""
        assert self.probe is not None
        for p, st in self.probe.state.items():
            for k, v in st.items():
                if isinstance(v, Tensor) and not seen(v):
                    tensors.append(TensorInfo(id=len(tensors), nbytes=v.untyped_storage().nbytes(),
                                              dtype=str(v.dtype).removeprefix("torch."), shape=tuple(v.shape),
                                              kind="optimizer", producer=-1,
                                              name=f"optimizer.{self.names.get(id(p), 'param')}.{k}"))


def optimizers_of(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers alive in the process that step any of ``model``'s parameters (``optimizer="auto"``):
    their state is held while the model trains, whether or not capture is told. One pass over the objects
    the garbage collector tracks (tens of milliseconds; about 0.1 s with 300,000 objects)."""
    params = {id(p) for p in model.parameters()}
    if not params:
        return []
    # type(o), not isinstance(o, ...): some module proxies warn when their __class__ is read
    found = [o for o in gc.get_objects() if issubclass(type(o), torch.optim.Optimizer)]
    return [o for o in found if any(id(p) in params for g in getattr(o, "param_groups", ()) for p in g["params"])]


def _step(opt: torch.optim.Optimizer) -> None:
    step = type(opt).step
    # the step itself, not torch's wrapper around it: global optimizer hooks must not see the probe
    step = step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step
    with torch.no_grad():
        step(opt)


def counted(tensors: list[TensorInfo], workspace: str, grads: str, optimizer: dict[str, Any] | None,
            optimizer_step: bool, step_ops: int, hold_outputs: bool, found: bool = False) -> dict[str, str]:
    """What a captured graph counts beside forward and backward, one line each (``graph.meta["counted"]``)."""
    def total(kind: str) -> tuple[int, int]:
        ts = [t for t in tensors if t.kind == kind and t.producer < 0]
        return len(ts), sum(t.nbytes for t in ts)

    n_grad, b_grad = total("grad")
    n_opt, b_opt = total("optimizer")
    grads_line = (f"{n_grad} held for the whole step ({fmt_bytes(b_grad)}; backward adds into them)" if n_grad else
                  "none exist before the step (as after zero_grad(set_to_none=True))")
    if grads == "auto":
        grads_line += ": as the parameters had them at capture (grads='auto')"
    if optimizer is None:
        state = "not counted: no optimizer steps the model's parameters (capture(optimizer=...), --optimizer)"
    else:
        state = f"{n_opt} tensors, {fmt_bytes(b_opt)} ({optimizer.get('class')}, {optimizer.get('source')})"
        if found:
            state += ": found stepping the model's parameters (optimizer='auto'; optimizer=None leaves it out)"
    step = (f"recorded: {step_ops} ops after backward, temporaries included" if optimizer_step else
            "not part of the step (optimizer_step=True records it)")
    return {
        "workspace": workspace,
        "gradients before the step": grads_line,
        "optimizer state": state,
        "optimizer step": step,
        "loss and outputs": ("the model's output held until backward ends (hold_outputs=True); the loss to the "
                             "step's end" if hold_outputs else "the model's output until the loss is computed "
                             "(and where autograd saved it); the loss to the step's end"),
    }
