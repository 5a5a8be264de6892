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
  stats, ``num_batches_tracked``), ``deterministic=False`` for ops in ``ops.CUDA_NONDETERMINISTIC``
  when the step targets CUDA (``cuda`` or ``meta`` captures; CPU ops are all deterministic).
- **Costs**: FLOPs from ``torch.utils.flop_counter``'s formulas, ``bytes_accessed`` = bytes of input
  and output tensors (each storage at most once), ``cost_s`` from the cost model
  (``op_times(graph)`` if it has it, else ``op_time(stage)``); without one, the measured wall time
  of each op on a CPU (or CUDA) run, and on meta ``hybridmem.graph.costs``' default device model. A real
  run also stores its measured op times in ``graph.meta["measured_cost_s"]`` (first-call effects
  included: run a step before capture for steady-state times).

Capture has no side effects on the model: gradients, buffers (BatchNorm running statistics) and the
RNG state are restored afterwards; on meta a parameter-free copy of the model is used.

The parts: :mod:`.recorder` (the dispatch mode and its bookkeeping), :mod:`.flops` (FLOPs per op),
:mod:`.costs` (``cost_s``), :mod:`.optstate` (the optimizer's state), :mod:`.metacopy` (meta copies),
:mod:`.merge` (``granularity="module"``).
"""
from __future__ import annotations

import sys
import time
import types
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Callable

import torch

from ..errors import CaptureError
from ..native.cpumeter import load as load_native_meter, unavailable_reason
from .costs import resolve_cost_model, set_stage_costs
from .ir import Graph, link_consumers
from .merge import merge_stages, module_groups
from .metacopy import map_tensors, meta_like, meta_model
from .optstate import add_optimizer_state
from .recorder import Fixed, Recorder, CaptureMode, arg_tensors
from .stepparts import GradsBefore, OptimizerStep, check_grads, counted, optimizers_of

__all__ = ["capture", "run_step", "split_inputs", "compute_loss", "CaptureError", "GRANULARITIES"]

Tensor = torch.Tensor
GRANULARITIES = ("op", "module")



# ---- torch._dynamo, not imported for a capture ----------------------------------------------------
@contextmanager
def dynamo_deferred() -> Any:
    """While the step runs, ``import torch._dynamo`` finds a stand-in whose ``disable(fn)`` is ``fn``.

    On ``meta`` the step runs PyTorch's Python decompositions (batch norm, the elementwise references),
    wrapped by ``torch._disable_dynamo``, which imports ``torch._dynamo`` (about a second) on its first
    call, only to keep a compiler that is not running out of them. Outside a compile that wrapper is the
    function itself, so the capture does not need the import. Any other use of ``torch._dynamo`` while the
    stand-in is there imports the real module and goes to it. Afterwards the stand-in is gone and the
    functions it was asked about forget it: a later ``torch.compile`` imports and uses the real one. Does
    nothing where ``torch._dynamo`` is already imported."""
    if "torch._dynamo" in sys.modules:
        yield
        return
    asked: list[Any] = []
    stub = types.ModuleType("torch._dynamo")

    def disable(fn: Any = None, recursive: bool = True, *, reason: Any = None, wrapping: bool = True) -> Any:
        if fn is None:
            return lambda f: disable(f, recursive, reason=reason, wrapping=wrapping)
        asked.append(fn)
        return fn

    def _real(name: str) -> Any:
        _drop_stub(stub)
        import torch._dynamo as real
        return getattr(real, name)

    stub.disable = disable  # type: ignore[attr-defined]
    stub.__getattr__ = _real  # type: ignore[attr-defined]
    sys.modules["torch._dynamo"] = stub
    torch._dynamo = stub  # type: ignore[attr-defined]  # ``import torch._dynamo`` then reads the attribute
    try:
        yield
    finally:
        _drop_stub(stub)
        for fn in asked:
            if getattr(fn, "__dynamo_disable", None) is fn:
                try:
                    del fn.__dynamo_disable
                except AttributeError:
                    pass


def _drop_stub(stub: types.ModuleType) -> None:
    if sys.modules.get("torch._dynamo") is stub:
        del sys.modules["torch._dynamo"]
    if torch.__dict__.get("_dynamo") is stub:
        del torch._dynamo  # type: ignore[attr-defined]


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
    loss is computed and the loss after backward, so a :class:`~hybridmem.runtime.meter.Meter` around
    ``run_step`` measures the step the graph describes."""
    args, kwargs = split_inputs(inputs)
    loss = compute_loss(model(*args, **kwargs), loss_fn)
    loss.backward()


def _guarded_step(model: Callable[..., Any], args: tuple, kwargs: dict, loss_fn: Any, rec: Recorder,
                  dev: torch.device, hold_outputs: bool = False) -> None:
    """``run_step`` with errors from the model or loss wrapped in a CaptureError saying where
    (``hold_outputs``: the output is held until backward ends, as by a loop that keeps it)."""
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
    held = out if hold_outputs else None
    del out  # as in run_step: the output lives on only where autograd saved it (or the loop holds it)
    rec.phase = "backward"
    try:
        loss.backward()
    except Exception as e:
        raise _context(e, rec, dev) from e
    del held


def _identity(x: Any) -> Any:
    return x


# ---- capture ----------------------------------------------------------------------------------------
def capture(model: torch.nn.Module, inputs: Any, loss_fn: Callable[[Any], Tensor] | None = None,
            device: str | torch.device | None = None, granularity: str = "op",
            cost_model: Any = None, optimizer: torch.optim.Optimizer | str | None = "auto", *,
            grads: str = "auto", optimizer_step: bool = False, hold_outputs: bool = False, warmup: int = 0) -> Graph:
    """Run one forward + backward of ``model`` on ``inputs`` and return its :class:`Graph`.

    ``inputs``: a tensor, a tuple of positional arguments or a dict of keyword arguments.
    ``loss_fn(output) -> scalar`` (default ``output.sum()``). ``device``: ``None`` (where the model
    is), ``"meta"`` (a meta copy: shapes only), or the model's device. ``granularity``: ``"op"`` or
    ``"module"`` (consecutive ops of one leaf module and phase merged, see :func:`~hybridmem.graph.merge.merge_stages`).
    ``cost_model``: an object with ``op_time(stage) -> seconds``, a name for
    ``hybridmem.graph.costs.get_cost_model``, or ``"measured"``; default: measured op times (CPU/CUDA), the
    default device model of ``hybridmem.graph.costs`` on meta. The model's parameters, gradients, buffers
    and the RNG state are left as they were.

    ``optimizer``: the step's optimizer; ``"auto"`` (default): the optimizer alive in the process that steps
    the model's parameters, if there is one (:func:`~hybridmem.graph.stepparts.optimizers_of`); ``None``: none.
    Its state (momentum buffers, Adam's moments, step counters on
    the device) persists across steps, so the graph holds it for the whole step: one tensor of kind
    ``"optimizer"`` per state tensor (producer -1, never freed, not evictable), sized by
    :func:`~hybridmem.graph.optstate.optimizer_state` (the optimizer is not stepped or changed). Without it a plan ignores those
    bytes and a run with a stateful optimizer needs more than the plan's budget.

    ``grads``: the gradients the step starts with (:mod:`~hybridmem.graph.stepparts`): ``"auto"`` (default)
    those the parameters have now (a loop that keeps them between steps: held for the whole step, backward
    adds into them), ``"kept"`` one per parameter that requires grad, ``"none"`` none (as after
    ``zero_grad(set_to_none=True)``). ``optimizer_step=True`` (needs ``optimizer``) records one step of the
    optimizer after backward (phase ``"optimizer"``: its state before it, its temporaries in it), taken by
    a same-class optimizer over the captured parameters; the runtime does not follow a plan made for such a
    graph (its steps end with backward). ``hold_outputs=True``: the model's output is held until backward
    ends, as by a loop that keeps it (``out = model(x); loss = f(out)``). ``graph.meta["counted"]`` says
    what the graph counts beside forward and backward.

    ``warmup`` (a real device only): plain forward + backward steps run first, unrecorded (their gradients
    dropped, the buffers and RNG restored with the rest), so the op times measured are a steady step's, not a
    first call's; the last one's wall time is ``graph.meta["step_s"]``, from which a measured cost model
    counts what a step spends outside its ops (``outside_s``: the autograd engine, Python, freeing memory).
    """
    found = False
    if isinstance(optimizer, str) and optimizer == "auto":
        live = optimizers_of(model)
        if len(live) > 1:
            raise CaptureError(f"{len(live)} optimizers step the model's parameters "
                               f"({', '.join(type(o).__name__ for o in live)}): pass the step's one as optimizer=")
        optimizer, found = (live[0], True) if live else (None, False)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, 'auto' or None, got {optimizer!r}")
    check_grads(grads)
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup={warmup!r}: expected a number of steps, 0 or more")
    if optimizer_step and optimizer is None:
        raise ValueError("optimizer_step=True records the optimizer's step: pass optimizer= too")
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; accepted: {', '.join(map(repr, GRANULARITIES))}")
    cost_model = resolve_cost_model(cost_model)
    args, kwargs = split_inputs(inputs)
    dev = _pick_device(model, args, kwargs, device)
    t_start = time.perf_counter()

    if warmup and dev.type == "meta":
        raise ValueError("warmup runs real steps to time them: it needs a real device (cpu or cuda), not meta")
    if dev.type == "meta":
        run_model = meta_model(model)
        args, kwargs = map_tensors((args, kwargs), meta_like)
    else:
        run_model = model
        args, kwargs = map_tensors((args, kwargs), lambda t: t if t.device == dev else t.to(dev))

    fixed = _fixed_storages(run_model, args, kwargs)
    param_module = {id(p): n.rpartition(".")[0] for n, p in run_model.named_parameters()}
    measure = dev.type != "meta"
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
    rec = Recorder(fixed, measure, sync, to_meta=dev.type == "meta", target_cuda=dev.type in ("cuda", "meta"),
                    param_module=param_module)
    scratch = "none (meta: shapes only)" if dev.type == "meta" else "not measured (CUDA)"

    opt_step = None
    with ExitStack() as stack:
        leaves = [t for t in _flat_tensors((args, kwargs)) if t.requires_grad and t.is_leaf]
        stack.enter_context(PreservedState(run_model, dev))
        step_s = _warm_steps(run_model, args, kwargs, loss_fn, leaves, dev, warmup) if warmup else None
        names = [n for n, _ in run_model.named_parameters()]
        run_params = list(run_model.parameters())
        user_params = list(model.parameters())
        rec.fixed.update(stack.enter_context(GradsBefore(
            run_params + leaves, user_params + leaves, grads, names + [f"input{i}" for i in range(len(leaves))])))
        if optimizer_step:
            assert optimizer is not None
            opt_step = OptimizerStep(optimizer, user_params, run_params, {id(p): n for n, p in zip(names, run_params)})
            stack.callback(opt_step.finish)  # parameters restored outside the recording
        handles = _module_hooks(run_model, rec)
        stack.callback(lambda: [h.remove() for h in handles])
        if dev.type == "meta":
            stack.enter_context(torch.device("meta"))  # factory calls inside forward land on meta too
            stack.enter_context(dynamo_deferred())     # decompositions run there: no compiler import
        if dev.type == "cpu":
            rec.native, scratch = scratch_meter(stack)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(rec.saved, lambda x: x))
        stack.enter_context(CaptureMode(rec))
        try:
            _guarded_step(run_model, args, kwargs, loss_fn, rec, dev, hold_outputs)
            # which parameters got a gradient (before _preserve_state restores them): those get state
            got_grad = {id(p): q.grad is not None for p, q in zip(model.parameters(), run_model.parameters())}
            if opt_step is not None:
                rec.paused = True  # its first step (state made) is not the step's
                try:
                    rec.fixed.update(opt_step.prepare())
                finally:
                    rec.paused = False
                rec.phase = "optimizer"
                n_before = len(rec.stages)
                opt_step.run()
                opt_ops = len(rec.stages) - n_before
        finally:
            rec.closed = True
            rec.refs.clear()  # unregister the free callbacks now rather than when the recorder is collected
    if not rec.stages:
        raise CaptureError("capture recorded no ops: the model ran no aten operations")

    tensors = rec.tensors
    opt_meta = None
    if opt_step is not None:
        opt_step.unseen_state(tensors, lambda v: id(v.untyped_storage()) in rec.sid)
        state = [t for t in tensors if t.kind == "optimizer"]
        opt_meta = {"class": type(optimizer).__name__, "source": "a same-class optimizer stepped (recorded step)",
                    "state_bytes": sum(t.nbytes for t in state), "other_bytes": 0, "tensors": len(state)}
    elif optimizer is not None:  # appended last: the ids of the step's own tensors do not change
        opt_meta = add_optimizer_state(tensors, optimizer, model, dev,
                                        lambda p: got_grad.get(id(p), p.requires_grad))
    graph = Graph(rec.stages, tensors, {})
    link_consumers(graph.stages, tensors)
    model_name = type(model).__name__
    meta: dict[str, Any] = {
        "model": model_name, "device": dev.type, "granularity": "op",
        "input_shapes": _shapes(args, kwargs), "torch": str(torch.__version__),
        "num_ops": len(rec.stages), "saves": rec.saves, "capture_s": 0.0,
    }
    meta["writes_recorded"] = True  # Stage.writes is filled (graph files written before it was are not)
    meta["workspace"] = scratch  # where Stage.workspace (kernel scratch) comes from
    if measure:
        meta["measured_cost_s"] = list(rec.measured)
    if step_s is not None:
        meta["step_s"] = step_s
    if rec.mutations:
        meta["mutations"] = rec.mutations
    if opt_meta is not None:
        meta["optimizer"] = opt_meta
    meta["counted"] = counted(tensors, scratch, grads, opt_meta, opt_step is not None,
                              opt_ops if opt_step is not None else 0, hold_outputs, found)
    meta["cost_model"] = set_stage_costs(graph, cost_model, rec.measured if measure else None)
    graph.meta = meta
    graph.validate()
    if granularity == "module":
        graph = merge_stages(graph, module_groups(graph))
        graph.meta["granularity"] = "module"
    graph.meta["capture_s"] = round(time.perf_counter() - t_start, 6)
    return graph


def scratch_meter(stack: ExitStack) -> tuple[Any, str]:
    """The native allocator device for measuring each op's scratch on the CPU (``Stage.workspace``),
    installed until ``stack`` closes and exempt from any budget, and where the workspace figures come
    from (capture, and :mod:`hybridmem.compile.scratch`)."""
    native = load_native_meter()
    if native is None:
        return None, f"not measured (the native allocator meter is not available: {unavailable_reason()})"
    native.acquire()
    stack.callback(native.release)
    native.cap_exempt(True)
    stack.callback(native.cap_exempt, False)
    return native, "measured: the CPU allocator's peak inside each op beyond its live tensors and outputs"


def _context(e: Exception, rec: Recorder, dev: torch.device, where: str = "") -> CaptureError:
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
        here = next((t.device for t in arg_tensors(args, kwargs)), torch.device("cpu"))
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


def _fixed_storages(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[int, Fixed]:
    fixed: dict[int, Fixed] = {}
    for name, t in (*((f"input[{i}]", a) for i, a in enumerate(args)), *((f"input.{k}", v) for k, v in kwargs.items())):
        for j, x in enumerate(_flat_tensors(t)):
            fixed[id(x.untyped_storage())] = Fixed("input", name if j == 0 else f"{name}.{j}")
    for name, b in model.named_buffers():
        fixed[id(b.untyped_storage())] = Fixed("buffer", name)
    for name, p in model.named_parameters():
        fixed[id(p.untyped_storage())] = Fixed("param", name)
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


def _module_hooks(model: torch.nn.Module, rec: Recorder) -> list[Any]:
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


def _warm_steps(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Any, leaves: list[Tensor],
                dev: torch.device, n: int) -> float:
    """``n`` plain forward + backward steps, unrecorded, each tensor's gradient as it was before them; the last
    one's wall seconds (on CUDA, synchronised before and after)."""
    owners = [*model.parameters(), *leaves]
    grads = [t.grad for t in owners]
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    seconds = 0.0
    try:
        for _ in range(n):
            sync()
            t0 = time.perf_counter()
            compute_loss(model(*args, **kwargs), loss_fn).backward()
            sync()
            seconds = time.perf_counter() - t0
            for t in owners:
                t.grad = None
    finally:
        for t, g in zip(owners, grads):
            t.grad = g
    return seconds


class PreservedState:
    """Restore buffers and the RNG state after capture (no side effects on the model; gradients:
    :class:`~hybridmem.graph.stepparts.GradsBefore`)."""

    def __init__(self, model: torch.nn.Module, dev: torch.device):
        self.model, self.dev = model, dev

    def __enter__(self) -> None:
        with torch.no_grad():
            self.buffers = [(b, b.clone()) for b in self.model.buffers() if b.device.type != "meta"]
        devices = [self.dev] if self.dev.type == "cuda" else []
        self.rng = torch.random.fork_rng(devices=devices) if self.dev.type != "meta" else nullcontext()
        self.rng.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.rng.__exit__(*exc)
        with torch.no_grad():
            for b, v in self.buffers:
                b.copy_(v)
