"""The optimizer's state in a captured graph: which tensors a step's optimizer keeps on the device
(momentum buffers, Adam's moments, step counters), sized without stepping the user's optimizer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import CaptureError
from .ir import TensorInfo
from .recorder import tensor_bytes

Tensor = torch.Tensor


@dataclass
class StateTensor:
    """One tensor of an optimizer's per-parameter state, as the graph records it."""

    param: Tensor            # the user's parameter it belongs to
    key: str                 # its name in ``optimizer.state[param]`` ("exp_avg", "momentum_buffer", ...)
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    on_device: bool          # lives on its parameter's device (host-side step counters do not)


def optimizer_state(optimizer: torch.optim.Optimizer,
                    with_grad: Callable[[Tensor], bool] | None = None) -> tuple[list[StateTensor], str]:
    """The tensors of ``optimizer``'s state after a step, and how they were found.

    - ``"existing"``: the optimizer has stepped already: its state is read as it is.
    - ``"meta"``: a fresh optimizer of the same class, with the same ``param_groups`` hyperparameters,
      over meta copies of the parameters (no memory), with a meta gradient for each parameter that
      ``with_grad`` accepts (default: those that require grad), steps once; its state is read. Where
      that step cannot run on meta because a group asks for ``fused`` or ``capturable`` kernels, it
      runs without them (``"meta-unfused"``): the state has the same shapes, and the scalar step
      counters, which those kernels keep on the parameter's device instead of the host, are moved there.
    - ``"cpu-copy"``: the meta step failed (e.g. it calls ``.item()``) and every parameter is on the
      CPU: the same step on zero-filled CPU copies (costs host memory of the parameters, their
      gradients and the state, once).
    Anything else raises :class:`CaptureError` saying what to do (step the optimizer once before
    capture). The user's optimizer and parameters are not touched.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (or None), got {type(optimizer).__name__}")
    params = unique_params(optimizer)
    if any(_state_tensors(optimizer.state.get(p, {})) for p in params):
        return _dedup([StateTensor(p, k, _storage_bytes(v), v.dtype, tuple(v.shape), v.device == p.device)
                       for p in params for k, v in _state_tensors(optimizer.state.get(p, {}))],
                      [v for p in params for _, v in _state_tensors(optimizer.state.get(p, {}))]), "existing"
    wants = with_grad or (lambda p: p.requires_grad)
    errors: list[str] = []
    for how in ("meta", "meta-unfused", "cpu-copy"):
        if how == "meta-unfused" and not any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups):
            continue
        if how == "cpu-copy" and not all(p.device.type == "cpu" for p in params):
            continue
        try:
            probe, copies = _probe_step(optimizer, params, wants, how)
        except Exception as e:  # the probe is best effort: the next way is tried, and all errors reported
            errors.append(f"{how}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        group = _group_flags(optimizer)
        out, found = [], []
        for p, c in zip(params, copies):
            for k, v in _state_tensors(probe.state.get(c, {})):
                # on the copy's device: on the parameter's device. Elsewhere (host-side step counters): on it
                # only if that is the parameter's device (a CPU model), or if the group's fused/capturable
                # kernels, turned off for the probe, would have kept them there
                on_device = v.device in (c.device, p.device) or (how == "meta-unfused" and v.dim() == 0 and group[id(p)])
                out.append(StateTensor(p, k, _storage_bytes(v), v.dtype, tuple(v.shape), on_device))
                found.append(v)
        return _dedup(out, found), how
    raise CaptureError(f"cannot work out the state of {type(optimizer).__name__} without stepping it "
                       f"({'; '.join(errors) or 'its parameters are not on the CPU'}): step the optimizer "
                       "once before capture (its existing state is then read as it is), or capture without "
                       "optimizer=")


def _dedup(states: list[StateTensor], tensors: list[Tensor]) -> list[StateTensor]:
    """One entry per storage (state tensors that view one buffer are one allocation)."""
    seen: set[int] = set()
    out = []
    for s, v in zip(states, tensors):
        try:
            k = id(v.untyped_storage())
        except (RuntimeError, NotImplementedError):
            k = id(v)
        if k not in seen:
            seen.add(k)
            out.append(s)
    return out


def unique_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _group_flags(optimizer: torch.optim.Optimizer) -> dict[int, bool]:
    """id(param) -> whether its group asks for fused or capturable kernels."""
    return {id(p): bool(g.get("fused") or g.get("capturable")) for g in optimizer.param_groups for p in g["params"]}


def _state_tensors(state: Any) -> list[tuple[str, Tensor]]:
    """(key, tensor) of one parameter's state; lists of tensors (LBFGS' history) as ``key[i]``."""
    if not isinstance(state, dict):
        return []
    out = []
    for k, v in state.items():
        if isinstance(v, Tensor):
            out.append((str(k), v))
        elif isinstance(v, (list, tuple)):
            out.extend((f"{k}[{i}]", x) for i, x in enumerate(v) if isinstance(x, Tensor))
    return out


def _storage_bytes(t: Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return tensor_bytes(t)


def _probe_step(optimizer: torch.optim.Optimizer, params: list[Tensor], wants: Callable[[Tensor], bool],
                how: str) -> tuple[torch.optim.Optimizer, list[Tensor]]:
    """A same-class optimizer over copies of ``params`` (meta, or zeros on the CPU), stepped once."""
    dev = "cpu" if how == "cpu-copy" else "meta"
    copies = []
    for p in params:
        c = torch.zeros_like(p, device=dev).requires_grad_(p.requires_grad)
        if wants(p):
            c.grad = torch.zeros_like(c)
        copies.append(c)
    by_id = {id(p): c for p, c in zip(params, copies)}
    groups = []
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        if how == "meta-unfused":
            hyper.update({k: False for k in ("fused", "capturable") if hyper.get(k)})
        groups.append({**hyper, "params": [by_id[id(p)] for p in g["params"]]})
    cls = type(optimizer)
    try:
        probe = cls(groups, **optimizer.defaults)
    except TypeError:  # a constructor that does not take every default by name: the groups carry them
        probe = cls(groups)
    step = type(probe).step
    # call the step itself, not torch's wrapper around it: global optimizer hooks must not see the probe
    step = step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step
    step(probe)
    return probe, copies


def add_optimizer_state(tensors: list[TensorInfo], optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                         dev: torch.device, with_grad: Callable[[Tensor], bool]) -> dict[str, Any]:
    """Append the optimizer's device-resident state to ``tensors``; return its summary for ``graph.meta``."""
    states, how = optimizer_state(optimizer, with_grad)
    names = {id(p): n for n, p in model.named_parameters()}
    params = {id(p): i for i, p in enumerate(unique_params(optimizer))}
    kept = host = 0
    for s in states:
        # a real capture describes its own device; a meta capture the model's device, whatever it is
        if not s.on_device or (dev.type != "meta" and s.param.device != dev):
            host += s.nbytes
            continue
        pname = names.get(id(s.param), f"param{params[id(s.param)]}")
        tensors.append(TensorInfo(id=len(tensors), nbytes=s.nbytes, dtype=str(s.dtype).removeprefix("torch."),
                                  shape=s.shape, kind="optimizer", producer=-1, name=f"optimizer.{pname}.{s.key}"))
        kept += s.nbytes
    return {"class": type(optimizer).__name__, "source": how, "state_bytes": kept, "other_bytes": host,
            "tensors": sum(1 for t in tensors if t.kind == "optimizer")}
