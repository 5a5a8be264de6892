"""Record one real training step (forward + backward) of an unmodified model into a :class:`Graph`.

    graph = capture(model, x)                         # CPU: measured op times
    graph = capture(model, x, device="meta")          # no memory, no data: sizes, FLOPs, bytes
    graph = capture(model, {"input_ids": ids}, loss_fn=lambda out: out["loss"])

The step runs under a ``TorchDispatchMode`` that sees every aten op, forward then backward:

- **Stages** are the ops for which :func:`is_stage_op` holds (everything but views and metadata ops,
  which allocate nothing). A stage's ``module`` is the innermost module whose forward was running
  (module pre/post hooks keep a stack); a backward op gets the module of the forward op that created
  the autograd node being executed (matched by the node's sequence number; gradient accumulation
  into a parameter gets the parameter's module; ops the engine runs outside any node get ``""``),
  and forward code re-run during backward (``torch.utils.checkpoint``) its own module.
  ``id`` is ``"{phase}/{module}/{op}#{k}"``, ``k`` counting repeats of ``(phase, module, op)``.
- **Tensors** are storages. An op's inputs are the storages of its tensor arguments (lists
  included); its outputs are the storages it returns that did not exist before (a view shares its
  base's storage; an in-place op writes an input, recorded in its ``writes``: ``relu_``, ``add_``,
  ``out=``, BatchNorm running stats). Storages first seen as inputs existed before the
  step: ``producer=-1``, kind ``param``/``buffer``/``input`` (matched by storage, so ``weight.t()``
  is a param) or ``state``. Storages produced in backward are ``grad``, in forward ``activation``.
  ``freed_after`` is the last stage executed before the storage was freed (a weak-reference callback),
  ``None`` if it outlives the step. ``saved`` marks storages autograd packed for backward
  (a ``saved_tensors_hooks`` pair that records them; only the innermost pair runs, so inside
  ``torch.utils.checkpoint`` regions nothing is marked).
- **Flags**: ``rng`` (the op draws random numbers: a ``Generator`` argument, or dropout p > 0 in
  fused attention), ``side_effect`` (writes a storage that existed before the step: BatchNorm running
  stats, ``num_batches_tracked``), ``deterministic=False`` for ops in ``_trace.CUDA_NONDETERMINISTIC``
  when the step targets CUDA (``cuda`` or ``meta`` captures; CPU ops are all deterministic).
- **Costs**: FLOPs from ``torch.utils.flop_counter``'s formulas, ``bytes_accessed`` = bytes of input
  and output tensors (each storage at most once), ``cost_s`` from the cost model
  (``op_times(graph)`` if it has it, else ``op_time(stage)``); without one, the measured wall time
  of each op on a CPU (or CUDA) run, and on meta ``hybridmem.costs``' default device model. A real
  run also stores its measured op times in ``graph.meta["measured_cost_s"]`` (first-call effects
  included: run a step before capture for steady-state times).

Capture has no side effects on the model: gradients, buffers (BatchNorm running statistics) and the
RNG state are restored afterwards; on meta a parameter-free copy of the model is used.
"""
from __future__ import annotations

import copy
import math
import sys
import time
import weakref
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .ops import is_stage_op, op_info, uses_rng, written_tensors
from ..errors import HybridMemError
from .ir import Graph, Stage, TensorInfo, link_consumers

__all__ = ["capture", "merge_stages", "module_groups", "run_step", "is_stage_op", "optimizer_state", "StateTensor",
           "CaptureError", "GRANULARITIES"]

Tensor = torch.Tensor
GRANULARITIES = ("op", "module")
_MAX_OP_CHARS = 96


class CaptureError(HybridMemError, RuntimeError):
    """The model (or its loss) raised while being captured; the message says where."""


# ---- the training step --------------------------------------------------------------------------
def split_inputs(inputs: Any) -> tuple[tuple, dict]:
    """``inputs`` as ``(args, kwargs)``: a tensor is one positional argument, a tuple (or list) the
    positional arguments, a dict the keyword arguments."""
    if isinstance(inputs, Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    if isinstance(inputs, dict):
        return (), dict(inputs)
    raise TypeError(f"inputs must be a tensor, a tuple of positional arguments or a dict of keyword "
                    f"arguments; got {type(inputs).__name__}")


def compute_loss(output: Any, loss_fn: Callable[[Any], Tensor] | None) -> Tensor:
    """``loss_fn(output)`` (default: ``output.sum()``), checked to be a scalar tensor."""
    if loss_fn is None:
        if not isinstance(output, Tensor):
            raise TypeError(f"the model returned a {type(output).__name__}, not a tensor: pass "
                            "loss_fn=callable(output) -> scalar tensor")
        loss = output.sum()
    else:
        loss = loss_fn(output)
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(f"the loss must be a scalar, got a tensor of shape {tuple(loss.shape)}; "
                         "reduce it in loss_fn (e.g. .mean())")
    if not loss.requires_grad:
        raise ValueError("the loss does not require grad: no parameter or input requires grad, or the "
                         "forward ran under torch.no_grad()")
    return loss


def run_step(model: Callable[..., Any], inputs: Any, loss_fn: Callable[[Any], Tensor] | None = None) -> None:
    """One forward + backward exactly as :func:`capture` runs it: the model output is dropped once the
    loss is computed and the loss after backward, so a :class:`~hybridmem.meter.Meter` around
    ``run_step`` measures the step the graph describes."""
    args, kwargs = split_inputs(inputs)
    loss = compute_loss(model(*args, **kwargs), loss_fn)
    loss.backward()


def _guarded_step(model: Callable[..., Any], args: tuple, kwargs: dict, loss_fn: Any, rec: "_Recorder",
                  dev: torch.device) -> None:
    """``run_step`` with errors from the model or loss wrapped in a CaptureError saying where."""
    try:
        out = model(*args, **kwargs)
    except Exception as e:
        raise _context(e, rec, dev) from e
    if loss_fn is None:
        loss = compute_loss(out, None)
    else:
        try:
            raw = loss_fn(out)
        except Exception as e:
            raise _context(e, rec, dev, "in loss_fn") from e
        loss = compute_loss(raw, _identity)  # checks only: scalar, requires grad
        del raw
    del out  # as in run_step: the output lives on only where autograd saved it
    rec.phase = "backward"
    try:
        loss.backward()
    except Exception as e:
        raise _context(e, rec, dev) from e


def _identity(x: Any) -> Any:
    return x


# ---- recording ----------------------------------------------------------------------------------
@dataclass
class _Fixed:
    kind: str
    name: str


class _Recorder:
    """Mutable capture state: tensors by storage, stages, module stack, node -> module map."""

    def __init__(self, fixed: dict[int, _Fixed], measure: bool, sync: Callable[[], None] | None,
                 to_meta: bool, target_cuda: bool, param_module: dict[int, str]):
        self.fixed = fixed                      # id(storage) -> kind/name of pre-existing storages
        self.param_module = param_module        # id(param tensor) -> module path (AccumulateGrad)
        self.tensors: list[TensorInfo] = []
        self.refs: list[weakref.ref | None] = []  # keep weakrefs alive (their callbacks set freed_after)
        self.sid: dict[int, int] = {}           # id(live storage) -> tensor index
        self.stages: list[Stage] = []
        self.measured: list[float] = []
        self.mutations: list[list[int]] = []
        self.counts: dict[tuple[str, str, str], int] = {}
        self.phase = "forward"
        self.stack: list[str] = [""]
        self.seq_module: dict[int, str] = {}
        self.last_seq = torch.autograd._get_sequence_nr()
        self.closed = False
        self.measure, self.sync = measure, sync
        self.to_meta = to_meta
        self.meta_copies: dict[int, Tensor] = {}  # id(non-meta storage) -> its meta stand-in (meta capture)
        self.target_cuda = target_cuda and not torch.are_deterministic_algorithms_enabled()
        self.last_op = ""
        self.native: Any = None     # the native allocator device (CPU capture): per-op scratch
        self.error = 0              # id() of the last exception seen leaving a module
        self.error_module = ""

    # -- tensors ---------------------------------------------------------------------------------
    def tid(self, t: Tensor, producer: int) -> tuple[int, bool]:
        """Tensor index of ``t``'s storage, registering it if new; returns (index, is_new)."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return -1, False
        k = id(st)
        i = self.sid.get(k)
        if i is not None:
            return i, False
        i = len(self.tensors)
        if producer < 0:
            f = self.fixed.get(k)
            kind, name = (f.kind, f.name) if f is not None else ("state", "")
        else:
            kind, name = ("grad" if self.phase == "backward" else "activation"), ""
        self.tensors.append(TensorInfo(id=i, nbytes=st.nbytes(), dtype=str(t.dtype).removeprefix("torch."),
                                       shape=tuple(t.shape), kind=kind, producer=producer, name=name))
        self.sid[k] = i
        self.refs.append(weakref.ref(st, lambda r, k=k, i=i: self._freed(k, i)))
        return i, True

    def _freed(self, k: int, i: int) -> None:
        if self.sid.get(k) == i:
            del self.sid[k]
        if self.closed:
            return  # freed after the step ended: it outlived the step
        t = self.tensors[i]
        t.freed_after = max(len(self.stages) - 1, t.producer, 0)

    def saved(self, t: Tensor) -> Tensor:
        """Pack hook: mark the storage saved; return a detached alias (no reference to the grad_fn, so
        a saved output does not form a cycle with its own node and is freed as without the hook)."""
        i, _ = self.tid(t, -1)
        if i >= 0:
            self.tensors[i].saved = True
        return t.detach()

    # -- modules ---------------------------------------------------------------------------------
    def module_of_backward(self) -> str:
        node = torch._C._current_autograd_node()
        if node is None:
            return ""
        m = self.seq_module.get(node._sequence_nr())
        if m is not None:
            return m
        var = getattr(node, "variable", None)  # AccumulateGrad: the parameter it accumulates into
        if var is not None:
            return self.param_module.get(id(var), "")
        return ""

    def note_nodes(self) -> None:
        """Attribute autograd nodes created since the last op to the module running now."""
        cur = torch.autograd._get_sequence_nr()
        if cur != self.last_seq:
            m = self.stack[-1]
            for s in range(self.last_seq, cur):
                self.seq_module[s] = m
            self.last_seq = cur

    # -- ops -------------------------------------------------------------------------------------
    def meta_args(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Meta capture: replace stray non-meta tensors (loss targets, constants) by meta stand-ins."""
        def conv(a: Any) -> Any:
            if isinstance(a, Tensor) and a.device.type != "meta":
                st = a.untyped_storage()
                m = self.meta_copies.get(id(st))
                if m is None:
                    m = torch.empty_like(a, device="meta")
                    self.meta_copies[id(st)] = m  # keeps the stand-in alive: one tensor per storage
                    f = self.fixed.get(id(st))
                    self.fixed[id(m.untyped_storage())] = f or _Fixed("input", "")
                return m
            if isinstance(a, (list, tuple)) and any(isinstance(b, Tensor) for b in a):
                return type(a)(conv(b) for b in a)
            return a
        return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        info = op_info(func)
        self.last_op = info.name
        if self.phase == "forward":
            self.note_nodes()
        if not info.stage:
            out = func(*args, **kwargs)
            for t in _tensors(args, kwargs):
                self.tid(t, -1)
            for t in _outs(out):  # a view allocates nothing; anything new goes to the last stage
                i, new = self.tid(t, len(self.stages) - 1)
                if new and self.stages:
                    self.stages[-1].outputs.append(i)
            return out

        index = len(self.stages)
        inputs: dict[int, None] = {}
        in_bytes: dict[int, int] = {}
        for t in _tensors(args, kwargs):
            i, _ = self.tid(t, -1)
            if i >= 0:
                inputs[i] = None
                in_bytes[i] = max(in_bytes.get(i, 0), min(self.tensors[i].nbytes, _tensor_bytes(t)))
        native = self.native
        if native is not None:
            held = native.current_bytes
            native.window_reset()
        if self.measure:
            if self.sync:
                self.sync()
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            if self.sync:
                self.sync()
            dt = time.perf_counter() - t0
        else:
            out = func(*args, **kwargs)
            dt = 0.0
        outputs: list[int] = []
        out_bytes = 0
        for t in _outs(out):
            i, new = self.tid(t, index)
            if new:
                outputs.append(i)
                out_bytes += self.tensors[i].nbytes
        # scratch: what the allocator held at its peak inside the op beyond what was live and the outputs
        workspace = max(0, native.window_peak - held - out_bytes) if native is not None else 0
        written = []
        for w in written_tensors(func, args, kwargs):
            st = w.untyped_storage()
            j = self.sid.get(id(st))
            if j is not None:
                written.append(j)
                if info.may_resize and st.nbytes() > self.tensors[j].nbytes:
                    self.tensors[j].nbytes = st.nbytes()  # resized in place: a tensor has one size, its largest
        side_effect = any(self.tensors[j].producer < 0 for j in written)
        for j in written:
            self.mutations.append([index, j])
            out_bytes += in_bytes.get(j, 0)  # an in-place op writes what it reads
        # in backward a module forward runs only when something recomputes it (checkpointing)
        module = self.stack[-1] if self.phase == "forward" or len(self.stack) > 1 else self.module_of_backward()
        key = (self.phase, module, info.name)
        k = self.counts.get(key, 0)
        self.counts[key] = k + 1
        self.stages.append(Stage(
            index=index, id=f"{self.phase}/{module}/{info.name}#{k}", op=info.name, module=module,
            phase=self.phase, flops=_flops(func, args, kwargs, out), bytes_accessed=sum(in_bytes.values()) + out_bytes,
            inputs=list(inputs), outputs=outputs, rng=uses_rng(func, args, kwargs), side_effect=side_effect,
            deterministic=not (info.cuda_nondeterministic and self.target_cuda),
            # storages that existed before the op and that it wrote: a recompute of one replays this op too
            writes=[j for j in dict.fromkeys(written) if j in inputs and j not in outputs], workspace=workspace))
        self.measured.append(dt)
        return out


class _CaptureMode(TorchDispatchMode):
    def __init__(self, rec: _Recorder):
        super().__init__()
        self.rec = rec

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # eager only: skip the per-op torch._disable_dynamo wrapper (see MeterMode)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.rec.to_meta:
            args, kwargs = self.rec.meta_args(args, kwargs)
        return self.rec.run(func, args, kwargs)


def _tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    out: list[Tensor] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(b for b in a if isinstance(b, Tensor))
    return out


def _outs(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        res: list[Tensor] = []
        for o in out:
            if isinstance(o, Tensor):
                res.append(o)
            elif isinstance(o, (list, tuple)):
                res.extend(p for p in o if isinstance(p, Tensor))
        return res
    return []


def _tensor_bytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


# ---- FLOPs ----------------------------------------------------------------------------------------
_EXTRA_FLOPS: dict[Any, Any] | None = None


def _flop_table() -> dict[Any, Any]:
    """torch's FLOP formulas, plus the CPU flash-attention kernels (same maths as the CUDA ones)."""
    global _EXTRA_FLOPS
    if _EXTRA_FLOPS is None:
        from torch.utils import flop_counter as fc

        table = dict(fc.flop_registry)
        aten = torch.ops.aten
        for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", "sdpa_flop"),
                              ("_scaled_dot_product_flash_attention_for_cpu_backward", "sdpa_backward_flop")):
            if hasattr(aten, name) and hasattr(fc, formula):
                table.setdefault(getattr(aten, name), getattr(fc, formula))
        _EXTRA_FLOPS = table
    return _EXTRA_FLOPS


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    f = _flop_table().get(getattr(func, "overloadpacket", None))
    if f is None:
        return 0.0
    try:
        return float(f(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not know this overload's arguments: no FLOP estimate
        return 0.0


# ---- cost models ----------------------------------------------------------------------------------
class _FallbackCost:
    """Used when no cost model is given, op times cannot be measured (meta) and hybridmem.costs is missing."""

    name = "fallback"

    def op_time(self, stage: Stage) -> float:
        return 1e-12 * stage.flops + stage.bytes_accessed / 1e11


def _resolve_cost_model(cost_model: Any) -> Any:
    """A cost model object, ``"measured"``, or None (decided after the run)."""
    if cost_model is None or cost_model == "measured":
        return cost_model
    if isinstance(cost_model, str):
        try:
            from .costs import get_cost_model
        except ImportError as e:
            raise ValueError(f"cost_model={cost_model!r} needs hybridmem.costs, which failed to import: {e}") from e
        return get_cost_model(cost_model)
    if not callable(getattr(cost_model, "op_time", None)):
        raise TypeError(f"cost_model must have an op_time(stage) -> seconds method (or be a name); "
                        f"got {type(cost_model).__name__}")
    return cost_model


def _default_cost_model() -> Any:
    """hybridmem.costs' default device model (analytic roofline), else the local FLOP/byte formula."""
    try:
        from .costs import DEFAULT_DEVICE, get_cost_model
        return get_cost_model(DEFAULT_DEVICE)
    except ImportError:
        return _FallbackCost()


def _assign_costs(graph: Graph, cost_model: Any, measured: list[float] | None) -> str:
    """Set every ``Stage.cost_s``; return the cost model's name for ``graph.meta``."""
    if cost_model == "measured" or (cost_model is None and measured is not None):
        if measured is None:
            raise ValueError("cost_model='measured' needs a real run: op times cannot be measured on meta")
        for s, dt in zip(graph.stages, measured):
            s.cost_s = dt
        return "measured"
    model = cost_model if cost_model is not None else _default_cost_model()
    if callable(getattr(model, "op_times", None)):  # vectorised and dtype-aware (hybridmem.costs models)
        times = [float(t) for t in model.op_times(graph)]
    else:
        times = [float(model.op_time(s)) for s in graph.stages]
    for s, t in zip(graph.stages, times):
        s.cost_s = t
    return str(getattr(model, "name", type(model).__name__))


# ---- optimizer state ---------------------------------------------------------------------------------
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
    params = _unique_params(optimizer)
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


def _unique_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
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
        return _tensor_bytes(t)


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


# ---- capture ----------------------------------------------------------------------------------------
def capture(model: torch.nn.Module, inputs: Any, loss_fn: Callable[[Any], Tensor] | None = None,
            device: str | torch.device | None = None, granularity: str = "op",
            cost_model: Any = None, optimizer: torch.optim.Optimizer | None = None) -> Graph:
    """Run one forward + backward of ``model`` on ``inputs`` and return its :class:`Graph`.

    ``inputs``: a tensor, a tuple of positional arguments or a dict of keyword arguments.
    ``loss_fn(output) -> scalar`` (default ``output.sum()``). ``device``: ``None`` (where the model
    is), ``"meta"`` (a meta copy: shapes only), or the model's device. ``granularity``: ``"op"`` or
    ``"module"`` (consecutive ops of one leaf module and phase merged, see :func:`merge_stages`).
    ``cost_model``: an object with ``op_time(stage) -> seconds``, a name for
    ``hybridmem.costs.get_cost_model``, or ``"measured"``; default: measured op times (CPU/CUDA), the
    default device model of ``hybridmem.costs`` on meta. The model's parameters, gradients, buffers
    and the RNG state are left as they were.

    ``optimizer``: the step's optimizer. Its state (momentum buffers, Adam's moments, step counters on
    the device) persists across steps, so the graph holds it for the whole step: one tensor of kind
    ``"optimizer"`` per state tensor (producer -1, never freed, not evictable), sized by
    :func:`optimizer_state` (the optimizer is not stepped or changed). Without it a plan ignores those
    bytes and a run with a stateful optimizer needs more than the plan's budget. The optimizer's own
    step (its transient buffers) is not part of the graph.
    """
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (or None), got {type(optimizer).__name__}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; accepted: {', '.join(map(repr, GRANULARITIES))}")
    cost_model = _resolve_cost_model(cost_model)
    args, kwargs = split_inputs(inputs)
    dev = _pick_device(model, args, kwargs, device)
    t_start = time.perf_counter()

    if dev.type == "meta":
        run_model = _meta_model(model)
        args, kwargs = _map_tensors((args, kwargs), _meta_like)
    else:
        run_model = model
        args, kwargs = _map_tensors((args, kwargs), lambda t: t if t.device == dev else t.to(dev))

    fixed = _fixed_storages(run_model, args, kwargs)
    param_module = {id(p): n.rpartition(".")[0] for n, p in run_model.named_parameters()}
    measure = dev.type != "meta"
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
    rec = _Recorder(fixed, measure, sync, to_meta=dev.type == "meta", target_cuda=dev.type in ("cuda", "meta"),
                    param_module=param_module)
    scratch = "none (meta: shapes only)" if dev.type == "meta" else "not measured (CUDA)"

    with ExitStack() as stack:
        leaves = [t for t in _flat_tensors((args, kwargs)) if t.requires_grad and t.is_leaf]
        stack.enter_context(_preserve_state(run_model, dev, leaves))
        handles = _module_hooks(run_model, rec)
        stack.callback(lambda: [h.remove() for h in handles])
        if dev.type == "meta":
            stack.enter_context(torch.device("meta"))  # factory calls inside forward land on meta too
        if dev.type == "cpu":
            rec.native, scratch = _scratch_meter(stack)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(rec.saved, lambda x: x))
        stack.enter_context(_CaptureMode(rec))
        try:
            _guarded_step(run_model, args, kwargs, loss_fn, rec, dev)
            # which parameters got a gradient (before _preserve_state restores them): those get state
            got_grad = {id(p): q.grad is not None for p, q in zip(model.parameters(), run_model.parameters())}
        finally:
            rec.closed = True
            rec.refs.clear()  # unregister the free callbacks now rather than when the recorder is collected
    if not rec.stages:
        raise CaptureError("capture recorded no ops: the model ran no aten operations")

    tensors = rec.tensors
    opt_meta = None
    if optimizer is not None:  # appended last: the ids of the step's own tensors do not change
        opt_meta = _add_optimizer_state(tensors, optimizer, model, dev,
                                        lambda p: got_grad.get(id(p), p.requires_grad))
    graph = Graph(rec.stages, tensors, {})
    link_consumers(graph.stages, tensors)
    model_name = type(model).__name__
    meta: dict[str, Any] = {
        "model": model_name, "device": dev.type, "granularity": "op",
        "input_shapes": _shapes(args, kwargs), "torch": str(torch.__version__),
        "num_ops": len(rec.stages), "capture_s": 0.0,
    }
    meta["writes_recorded"] = True  # Stage.writes is filled (graph files written before it was are not)
    meta["workspace"] = scratch  # where Stage.workspace (kernel scratch) comes from
    if measure:
        meta["measured_cost_s"] = list(rec.measured)
    if rec.mutations:
        meta["mutations"] = rec.mutations
    if opt_meta is not None:
        meta["optimizer"] = opt_meta
    meta["cost_model"] = _assign_costs(graph, cost_model, rec.measured if measure else None)
    graph.meta = meta
    graph.validate()
    if granularity == "module":
        graph = merge_stages(graph, module_groups(graph))
        graph.meta["granularity"] = "module"
    graph.meta["capture_s"] = round(time.perf_counter() - t_start, 6)
    return graph


def _add_optimizer_state(tensors: list[TensorInfo], optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                         dev: torch.device, with_grad: Callable[[Tensor], bool]) -> dict[str, Any]:
    """Append the optimizer's device-resident state to ``tensors``; return its summary for ``graph.meta``."""
    states, how = optimizer_state(optimizer, with_grad)
    names = {id(p): n for n, p in model.named_parameters()}
    params = {id(p): i for i, p in enumerate(_unique_params(optimizer))}
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


def _scratch_meter(stack: ExitStack) -> tuple[Any, str]:
    """The native allocator device for a CPU capture (each op's scratch: ``Stage.workspace``), installed
    for the capture and exempt from any budget, and where the workspace figures come from."""
    from ..runtime.cpumeter import load, unavailable_reason

    native = load()
    if native is None:
        return None, f"not measured (the native allocator meter is not available: {unavailable_reason()})"
    if not native.installed:
        native.install()
        stack.callback(native.uninstall)
    native.cap_exempt(True)
    stack.callback(native.cap_exempt, False)
    return native, "measured: the CPU allocator's peak inside each op beyond its live tensors and outputs"


def _context(e: Exception, rec: _Recorder, dev: torch.device, where: str = "") -> CaptureError:
    if not where and rec.phase == "forward":
        module = rec.error_module if rec.error == id(e) else rec.stack[-1]
        where = f"at module {module or '<top level>'!r}"
    hint = ""
    if dev.type == "meta":
        hint = (" (on meta, data-dependent code such as .item(), .tolist(), nonzero() or boolean masks "
                "cannot run: capture on the CPU with a small batch instead)")
    return CaptureError(f"capture failed in the {rec.phase} pass {where} after "
                        f"{len(rec.stages)} ops (last op {rec.last_op or '-'}) on {dev.type}: "
                        f"{type(e).__name__}: {e}{hint}")


def _pick_device(model: torch.nn.Module, args: tuple, kwargs: dict, device: Any) -> torch.device:
    here = next((p.device for p in model.parameters()), None)
    if here is None:
        here = next((t.device for t in _tensors(args, kwargs)), torch.device("cpu"))
    if device is None:
        return here
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type != "meta" and (dev.type != here.type or (dev.index is not None and here.index is not None
                                                        and dev.index != here.index)):
        raise ValueError(f"capture(device={str(device)!r}) but the model is on {here}: capture runs where "
                         "the model is, or on 'meta' (a copy); move the model first")
    return dev


def _meta_like(t: Tensor) -> Tensor:
    if t.device.type == "meta":
        return t
    m = torch.empty_like(t, device="meta")
    return m.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else m


def _meta_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model itself if it already lives on meta, else a copy whose tensors are meta stand-ins
    (deepcopy with a memo, so no parameter data is copied and tied weights stay tied)."""
    if all(t.device.type == "meta" for t in (*model.parameters(), *model.buffers())):
        return model
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    for m in model.modules():  # plain tensor attributes (masks, tables): meta too, without copying
        for v in vars(m).values():
            if isinstance(v, Tensor) and id(v) not in memo:
                memo[id(v)] = torch.empty_like(v, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:
        raise CaptureError(f"capture(device='meta') could not copy {type(model).__name__} "
                           f"({type(e).__name__}: {e}); build the model under `with torch.device('meta'):` "
                           "and pass that instead") from e


def _map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_map_tensors(o, fn) for o in obj]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _fixed_storages(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[int, _Fixed]:
    fixed: dict[int, _Fixed] = {}
    for name, t in (*((f"input[{i}]", a) for i, a in enumerate(args)), *((f"input.{k}", v) for k, v in kwargs.items())):
        for j, x in enumerate(_flat_tensors(t)):
            fixed[id(x.untyped_storage())] = _Fixed("input", name if j == 0 else f"{name}.{j}")
    for name, b in model.named_buffers():
        fixed[id(b.untyped_storage())] = _Fixed("buffer", name)
    for name, p in model.named_parameters():
        fixed[id(p.untyped_storage())] = _Fixed("param", name)
    return fixed


def _flat_tensors(obj: Any) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flat_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _flat_tensors(o)]
    return []


def _shapes(args: tuple, kwargs: dict) -> Any:
    def one(v: Any) -> Any:
        if isinstance(v, Tensor):
            return list(v.shape)
        if isinstance(v, (list, tuple)):
            return [one(x) for x in v]
        if isinstance(v, dict):
            return {str(k): one(x) for k, x in v.items()}
        return repr(v)[:40]
    return {str(k): one(v) for k, v in kwargs.items()} if kwargs else [one(a) for a in args]


def _module_hooks(model: torch.nn.Module, rec: _Recorder) -> list[Any]:
    handles = []
    for name, mod in model.named_modules():
        def pre(_m: Any, _a: Any, name: str = name) -> None:
            rec.note_nodes()  # nodes created before entering belong to the caller
            rec.stack.append(name)

        def post(_m: Any, _a: Any, _o: Any) -> None:
            rec.note_nodes()
            exc = sys.exc_info()[1]  # always_call hooks also run while an exception unwinds the module
            if exc is not None and rec.error != id(exc):
                # remember the innermost module it left, by id: holding the exception would hold its
                # traceback's frames and their tensors (checkpoint stops recomputation by raising)
                rec.error, rec.error_module = id(exc), rec.stack[-1]
            if len(rec.stack) > 1:
                rec.stack.pop()
        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))
    return handles


class _preserve_state:
    """Restore gradients, buffers and the RNG state after capture (no side effects on the model)."""

    def __init__(self, model: torch.nn.Module, dev: torch.device, leaves: list[Tensor]):
        self.model, self.dev, self.leaves = model, dev, leaves

    def __enter__(self) -> None:
        params = list(self.model.parameters()) + self.leaves  # inputs that require grad get .grad too
        self.grads = [(p, p.grad) for p in params]
        for p in params:
            p.grad = None  # a step starts from no gradients (zero_grad(set_to_none=True))
        with torch.no_grad():
            self.buffers = [(b, b.clone()) for b in self.model.buffers() if b.device.type != "meta"]
        devices = [self.dev] if self.dev.type == "cuda" else []
        self.rng = torch.random.fork_rng(devices=devices) if self.dev.type != "meta" else nullcontext()
        self.rng.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.rng.__exit__(*exc)
        for p, g in self.grads:
            p.grad = g
        with torch.no_grad():
            for b, v in self.buffers:
                b.copy_(v)


# ---- merging stages ---------------------------------------------------------------------------------
def module_groups(graph: Graph) -> list[list[int]]:
    """Runs of consecutive stages with the same (phase, module): the ``granularity="module"`` groups."""
    groups: list[list[int]] = []
    prev: tuple[str, str] | None = None
    for s in graph.stages:
        key = (s.phase, s.module)
        if key != prev:
            groups.append([])
            prev = key
        groups[-1].append(s.index)
    return groups


def merge_stages(graph: Graph, groups: Sequence[Sequence[int]]) -> Graph:
    """Merge each group of consecutive stages into one stage; return a new, densely indexed Graph.

    ``groups`` must cover every stage once, in order, each a run of consecutive indices within one
    phase. A merged stage reads the tensors its ops read that were produced outside it and produces
    those its ops produced that are still alive after it; tensors produced and freed inside it
    disappear, their memory kept as ``workspace``: the merged stage's memory (``memory_profile``)
    is the maximum of its ops' memory. (It can be higher when the group holds an input that an early op
    frees together with an output of a late op: an atomic stage needs both.) Costs, FLOPs and bytes
    add up; ``rng`` and ``side_effect`` are OR-ed and ``deterministic`` AND-ed; ``writes`` keeps the in-place
    writes into tensors produced outside the group.
    """
    n = graph.num_stages
    flat = [i for g in groups for i in g]
    if flat != list(range(n)) or any(len(g) == 0 for g in groups):
        raise ValueError(f"groups must cover stages 0..{n - 1} once, in order, as non-empty runs")
    group_of = [0] * n
    for gi, g in enumerate(groups):
        for i in g:
            group_of[i] = gi
        if len({graph.stages[i].phase for i in g}) > 1:
            raise ValueError(f"group {gi} (stages {g[0]}..{g[-1]}) mixes phases")

    # which tensors survive, and their new lifetimes
    new_id: dict[int, int] = {}
    tensors: list[TensorInfo] = []
    for t in graph.tensors:
        if t.producer >= 0:
            pg = group_of[t.producer]
            if t.freed_after is not None and group_of[t.freed_after] == pg:
                continue  # produced and freed inside one group: becomes workspace
        nt = copy.copy(t)
        nt.id = len(tensors)
        nt.producer = group_of[t.producer] if t.producer >= 0 else -1
        nt.freed_after = None if t.freed_after is None else group_of[t.freed_after]
        nt.consumers = []
        new_id[t.id] = nt.id
        tensors.append(nt)

    stages: list[Stage] = []
    counts: dict[tuple[str, str, str], int] = {}
    for gi, g in enumerate(groups):
        members = [graph.stages[i] for i in g]
        inputs: dict[int, None] = {}
        outputs: dict[int, None] = {}
        writes: dict[int, None] = {}
        for s in members:
            for old in s.inputs:
                j = new_id.get(old)
                if j is not None and tensors[j].producer != gi:
                    inputs[j] = None
            for old in s.outputs:
                j = new_id.get(old)
                if j is not None:
                    outputs[j] = None
            for old in s.writes:
                # a write into a tensor made inside the group is part of making it (replaying the group
                # replays it); one into a tensor from outside is a write of the merged stage
                j = new_id.get(old)
                if j is not None and tensors[j].producer != gi:
                    writes[j] = None
        ops = list(dict.fromkeys(s.op for s in members))
        op = "+".join(ops)
        if len(op) > _MAX_OP_CHARS:
            op = op[:_MAX_OP_CHARS].rsplit("+", 1)[0] + f"+...({len(ops)} ops)"
        module = _common_module([s.module for s in members])
        phase = members[0].phase
        key = (phase, module, op)
        k = counts.get(key, 0)
        counts[key] = k + 1
        stages.append(Stage(
            index=gi, id=f"{phase}/{module}/{op}#{k}", op=op, module=module, phase=phase,
            cost_s=math.fsum(s.cost_s for s in members), flops=math.fsum(s.flops for s in members),
            bytes_accessed=sum(s.bytes_accessed for s in members), inputs=list(inputs), outputs=list(outputs),
            writes=list(writes),
            rng=any(s.rng for s in members), side_effect=any(s.side_effect for s in members),
            deterministic=all(s.deterministic for s in members), ops=sum(s.ops for s in members)))

    meta = dict(graph.meta)
    if isinstance(meta.get("measured_cost_s"), list) and len(meta["measured_cost_s"]) == n:
        m = meta["measured_cost_s"]
        meta["measured_cost_s"] = [math.fsum(m[i] for i in g) for g in groups]
    if isinstance(meta.get("mutations"), list):
        meta["mutations"] = [[group_of[s], new_id[t]] for s, t in meta["mutations"] if t in new_id]
    meta["merged_from_stages"] = n
    meta["granularity"] = "merged"
    merged = Graph(stages, tensors, meta)
    link_consumers(merged.stages, tensors)

    # workspace: make each merged stage's memory the maximum of its members' memory
    before = graph.memory_profile()
    base = merged.memory_profile()  # workspaces are still 0 here
    for gi, g in enumerate(groups):
        merged.stages[gi].workspace = max(0, int(before[g[0]:g[-1] + 1].max()) - int(base[gi]))
    return merged.validate()


def _common_module(paths: list[str]) -> str:
    first = paths[0]
    if all(p == first for p in paths):
        return first
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for level in zip(*parts):
        if any(x != level[0] for x in level):
            break
        common.append(level[0])
    return ".".join(common)
