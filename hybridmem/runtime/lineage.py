"""Lineage: which ops produced each activation storage, so that it can be recomputed bit for bit.

The runtime's dispatch mode records, for every storage an op allocates during the forward pass, a
:class:`Node`: the producing op and then every in-place op that later wrote into it (``conv`` then
``relu_`` for ``ReLU(inplace=True)``). A node's *version* ``k`` is its content after its first ``k``
ops. Tensor arguments of a recorded op are kept as references, never as tensors:

- :class:`NodeRef`: another activation storage at a given version, plus the view (size, stride,
  offset, dtype) the op saw;
- :class:`FixedRef`: a storage that existed before (parameter, buffer, input), as a detached alias
  (no autograd graph, same version counter) and the version it had, checked again before a replay;
- :data:`OPAQUE`: a storage without lineage (made while nothing was recorded): not replayable.

:class:`~.replay.Replayer` regenerates a node from what is recorded here; :mod:`.rng` keeps the random
states random ops drew from.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from ..graph.flops import op_flops
from ..graph.ops import op_info
from .distributed import collective_writes
from .rng import host_state, state_tensor

if TYPE_CHECKING:
    from .entry import Entry

Tensor = torch.Tensor
MAX_OPS_PER_NODE = 64   # a storage written in place more often than this (an accumulator) is not replayed


_new, _set = object.__new__, object.__setattr__


@dataclass(frozen=True, slots=True)
class View:
    """Where a tensor sits in its storage: enough to rebuild it on any tensor over that storage."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @classmethod
    def of(cls, t: Tensor) -> "View":
        # The frozen dataclass's __init__ made field by field (what it does itself), without its call
        # overhead: a View is made per saved tensor and per recorded tensor argument.
        v = _new(cls)
        _set(v, "size", tuple(t.shape))
        _set(v, "stride", t.stride())
        _set(v, "offset", t.storage_offset())
        _set(v, "dtype", t.dtype)
        return v

    def on(self, base: Tensor) -> Tensor:
        """This view of ``base``'s storage (a view of ``base``, so it shares its version counter)."""
        with torch._C._DisableTorchDispatch():  # metadata only: not worth a trip through the mode
            if base.dtype == self.dtype:
                return base.as_strided(self.size, self.stride, self.offset)
            return torch.empty((0,), dtype=self.dtype, device=base.device).set_(
                base.untyped_storage(), self.offset, self.size, self.stride)


class NodeRef:
    """An argument that is (a view of) an activation storage at one version."""

    __slots__ = ("node", "version", "view")

    def __init__(self, node: "Node", version: int, view: View):
        self.node, self.version, self.view = node, version, view


class FixedRef:
    """An argument that is (a view of) a storage which existed before: parameter, buffer, input.
    ``alias`` is the tensor (its autograd base), whose version counter every view shares."""

    __slots__ = ("alias", "version", "view")

    def __init__(self, alias: Tensor | None, version: int, view: View):
        # version -1: value not used; alias None: not bound in this step (a step program's, runtime.program)
        self.alias, self.version, self.view = alias, version, view


class GenState:
    """An explicit ``generator=`` argument, as the state it had when the op ran."""

    __slots__ = ("device", "state")

    def __init__(self, device: torch.device, state: bytes):
        self.device, self.state = device, state

    def make(self) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.set_state(state_tensor(self.state))
        return g


class _Opaque:
    """An argument without lineage: an op reading it cannot be replayed."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "OPAQUE"


OPAQUE = _Opaque()
# Argument types that are never tensors, lists of them or generators: recorded as they are.
_PLAIN = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format))
_REFS = (NodeRef, FixedRef, _Opaque)


class OpRecord:
    """One recorded op call, with tensor arguments replaced by references. ``func is None`` marks a
    barrier: the storage was written by something unrecorded, or its lineage was dropped."""

    __slots__ = ("func", "args", "kwargs", "rng", "cost_s", "why_not", "_refs", "_plan")

    def __init__(self, func: Any, args: tuple, kwargs: dict, rng: Any, why_not: str):
        self.func, self.args, self.kwargs, self.rng = func, args, kwargs, rng
        self.cost_s = 0.0
        self.why_not = why_not  # "" when replayable, else the reason (non-deterministic op, ...)
        self._refs: tuple[Any, ...] | None = None
        self._plan: tuple[tuple, tuple, dict, tuple] | None = None

    def arg_plan(self) -> tuple[tuple, tuple, dict, tuple]:
        """How a replay builds the call's arguments, resolved once: (positional arguments as recorded,
        (position, argument, written) of those a replay resolves, keyword arguments as recorded, (name,
        argument, written) of those it resolves). Resolved: references (and lists of them) and
        generator states; ``written``: the op writes the argument (a replay gives it a private copy)."""
        got = self._plan
        if got is None:
            info = replay_info(self.func)
            refs = tuple((i, a, i in info.written) for i, a in enumerate(self.args) if _resolved(a))
            refs_kw = tuple((k, a, k in info.written_kw) for k, a in self.kwargs.items() if _resolved(a))
            got = self._plan = (self.args, refs, self.kwargs, refs_kw)
        return got

    def refs(self) -> Iterator[Any]:
        """The reference arguments, in argument order. Collected once: a record's arguments never
        change after it is made, and validity checks, cost estimates and pruning ask again and again."""
        got = self._refs
        if got is None:
            out: list[Any] = []
            for group in (self.args, self.kwargs.values()):
                for a in group:
                    if isinstance(a, _REFS):
                        out.append(a)
                    elif type(a) in (list, tuple):
                        out.extend(b for b in a if isinstance(b, _REFS))
            got = self._refs = tuple(out)
        return iter(got)


def _resolved(a: Any) -> bool:
    """Whether a replay resolves recorded argument ``a`` (see ``OpRecord.arg_plan``)."""
    if isinstance(a, (NodeRef, FixedRef, GenState)):
        return True
    return type(a) in (list, tuple) and any(isinstance(b, (NodeRef, FixedRef)) for b in a)


def _barrier(reason: str) -> tuple[OpRecord, int]:
    return OpRecord(None, (), {}, None, reason), -1


_DROPPED = "its lineage was dropped at the end of its step"
_INPUT = "it is an input of the step (a tensor argument of its first module call)"


class Node:
    """The lineage of one activation storage: its producer op, then the in-place ops that wrote it.

    ``ops[i] = (record, output position)``; position is the index of this storage among the
    producer's flattened outputs, or -1 for a write. ``storage`` is a weak reference to the storage
    while it lives; ``entry`` the saved-tensor entry managing it, if any. ``stale``: the live
    storage was written by something unrecorded, so its content is no known version.
    """

    __slots__ = ("ops", "nbytes", "dtype", "device", "storage", "entry", "stale", "ok_memo", "_deps", "_checks",
                 "__weakref__")

    def __init__(self, record: OpRecord, position: int, nbytes: int, dtype: torch.dtype, device: torch.device,
                 storage: weakref.ref):
        self.ops: list[tuple[OpRecord, int]] = [(record, position)]
        self.nbytes, self.dtype, self.device = nbytes, dtype, device
        self.storage = storage
        self.entry: "Entry | None" = None
        self.stale = False
        self.ok_memo: tuple[int, int, str] | None = None  # (epoch, version, reason) of the last check
        self._deps: tuple[int, float, tuple[tuple["Node", int], ...]] | None = None
        # own_ok's records and fixed references of the ops up to a version (what it reads again each time)
        self._checks: tuple[int, tuple[OpRecord, ...], tuple[FixedRef, ...]] | None = None

    @property
    def dropped(self) -> bool:
        """Its ops forgotten, its content not written since: made in an earlier step, or between steps and
        given to this one as an input (a data loader's batch)."""
        return (len(self.ops) == 1 and not self.stale and self.ops[0][0].func is None
                and self.ops[0][0].why_not in (_DROPPED, _INPUT))

    def own_ok(self, v: int) -> bool:
        """Whether the node's own ops up to ``v`` can be replayed now (``replay._own_reason`` is "", inputs
        not included), from what can change between two checks: the records' ``why_not`` (a random op
        given its state at its module call) and the fixed references' binding and version. What cannot
        change while the ops stay (the version range, inputs without lineage) is read once per version;
        the op list only grows, or is replaced when the recorder drops the lineage (which forgets this)."""
        c = self._checks
        if c is None or c[0] != v or c[1][0] is not self.ops[0][0]:
            if not 1 <= v <= len(self.ops):
                return False
            recs = tuple(rec for rec, _ in self.ops[:v])
            refs = [r for rec in recs for r in rec.refs()]
            if any(r is OPAQUE for r in refs):
                return False
            c = self._checks = (v, recs, tuple(r for r in refs if isinstance(r, FixedRef)))
        for rec in c[1]:
            if rec.why_not:
                return False
        for r in c[2]:
            a = r.alias
            if a is None or (r.version >= 0 and a._version != r.version):
                return False
        return True

    def deps(self, v: int) -> tuple[float, tuple[tuple["Node", int], ...]]:
        """(seconds the ops up to ``v`` took, the other nodes they read): cached per version."""
        d = self._deps
        if d is None or d[0] != v:
            cost = 0.0
            inputs: dict[tuple[int, int], tuple[Node, int]] = {}
            for rec, _ in self.ops[:v]:
                cost += rec.cost_s
                for r in rec.refs():
                    if isinstance(r, NodeRef) and r.node is not self:
                        inputs.setdefault((id(r.node), r.version), (r.node, r.version))
            d = self._deps = (v, cost, tuple(inputs.values()))
        return d[1], d[2]

    @property
    def version(self) -> int:
        return len(self.ops)

    def live(self) -> torch.UntypedStorage | None:
        return self.storage() if self.storage is not None else None

    def break_here(self, reason: str) -> None:
        """Unrecorded write: the live content is unknown from now on, and so is every later version."""
        if not self.stale:
            self.ops.append(_barrier(reason))
            self.stale = True


# ---- recording -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _ReplayInfo:
    """Per-op facts for recording and replay, read once from the schema."""

    written: frozenset[int]           # positional arguments the op writes
    written_kw: frozenset[str]
    stats: tuple[int, ...]            # BatchNorm running_mean/var positions (values unused in training)
    training: int                     # position of BatchNorm's ``training`` argument, or -1
    fresh: tuple[bool, ...]           # per return: a new storage (no alias annotation)
    why_not: str                      # "" or why this op is never replayed


_INFO: dict[Any, _ReplayInfo] = {}


def replay_info(func: Any) -> _ReplayInfo:
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = _make_replay_info(func)
    return info


def _make_replay_info(func: Any) -> _ReplayInfo:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return _ReplayInfo(frozenset(), frozenset(), (), -1, (), f"{func} is not an aten op")
    names = [a.name for a in schema.arguments]
    base = op_info(func)
    stats = tuple(i for i, n in enumerate(names) if n in ("running_mean", "running_var"))
    training = names.index("training") if "training" in names and stats else -1
    written = set(base.written)
    if base.bn_training >= 0:  # legacy BatchNorm kernels write running stats without saying so
        written |= set(stats)
    fresh = tuple(r.alias_info is None for r in schema.returns)
    hidden = collective_writes(func)  # c10d schemas do not annotate the arguments they write
    if hidden:
        written |= set(hidden)
        fresh = tuple(False for _ in fresh)  # what they return are those arguments
    ns = getattr(func, "namespace", "aten")
    why = "" if ns in ("aten", "prims") else f"{base.name} is not an aten op (side effects unknown)"
    return _ReplayInfo(frozenset(written), frozenset(base.written_kw), stats, training, fresh, why)


class Recorder:
    """Builds :class:`OpRecord` and :class:`Node` objects from the ops the runtime's mode sees.

    ``lookup(storage)`` returns the storage's produced-table slot (with ``.node``) or None for a
    storage that existed before. Nodes created in a step lose their ops at the step's end unless a
    live entry depends on them, so lineage never keeps a finished step's inputs alive.
    """

    def __init__(self, lookup: Callable[[torch.UntypedStorage], Any], cuda_deterministic: Callable[[], bool],
                 cost: "OpCost | None" = None,
                 unreplayable: Callable[[torch.UntypedStorage], bool] | None = None,
                 on_random: "Callable[[OpRecord, bool], None] | None" = None):
        self.lookup = lookup
        self.unreplayable = unreplayable  # fixed storages a replay must not read (FSDP's unsharded params)
        self.cuda_deterministic = cuda_deterministic
        self.cost = cost
        self._step_nodes: list[Node] = []
        self.keep: set[int] = set()  # ids of nodes a step program replays (runtime.program): never pruned
        # the ``keep`` under which the last prune kept every node of the step for being in it: the next prunes
        # have nothing to do until a node is recorded or ``keep`` changes (steady steps record none)
        self._settled: set[int] | None = None
        self._gens: dict[int, bytes] = {}  # generator states before the op being recorded
        # called with each recorded op that draws random numbers, and whether it has explicit generators
        self.on_random = on_random

    # -- references ----------------------------------------------------------------------------
    def ref(self, t: Tensor, value_unused: bool = False) -> Any:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return OPAQUE
        slot = self.lookup(st)
        if slot is not None:
            node = slot.node
            if node is None:
                return OPAQUE
            if not node.dropped:
                return NodeRef(node, len(node.ops), View.of(t))
            # Made in an earlier step and kept past it (a dataset made after enable(), the batch a data loader
            # stacks from it between steps): to this step it is an input like a parameter, held by the
            # reference and its version checked at replay. As a node its dropped lineage would refuse every
            # chain through it (the whole step's recomputes, left to the online scorer).
        # The tensor itself (its autograd base), not a detached alias: this runs below autograd,
        # where a new alias would get a version counter of its own and in-place writes would go
        # unnoticed. Pre-existing tensors cannot hold the runtime's handles, so no cycle forms.
        if self.unreplayable is not None and self.unreplayable(st):
            return OPAQUE  # FSDP frees this parameter between forward and backward: no replay from it
        root = t._base if t._base is not None else t
        return FixedRef(root, -1 if value_unused else t._version, View.of(t))

    def _refs(self, v: Any) -> Any:
        if type(v) in _PLAIN:  # most non-tensor arguments; isinstance(v, Generator) runs Python code
            return v
        if isinstance(v, Tensor):
            return self.ref(v)
        if type(v) in (list, tuple) and any(isinstance(b, Tensor) for b in v):
            return type(v)(self.ref(b) if isinstance(b, Tensor) else b for b in v)
        if isinstance(v, torch.Generator):
            # replay draws from a copy in the state the op found; the user's generator stays put
            return GenState(v.device, self._gens.get(id(v)) or host_state(v.get_state()))
        return v

    # -- ops -----------------------------------------------------------------------------------
    def record(self, func: Any, args: tuple, kwargs: dict, rng: Any, fresh: list[tuple[int, Any, Tensor]],
               out: Any = None, out_bytes: int = 0) -> OpRecord:
        """Record one op call. ``fresh``: (output position, produced slot, tensor) of new storages;
        each gets a Node. In-place writes into activation storages are appended to their nodes."""
        info = replay_info(func)
        self._gens = rng.generators if rng is not None else {}
        why = info.why_not
        if not why and op_info(func).cuda_nondeterministic and not self.cuda_deterministic():
            if any(isinstance(a, Tensor) and a.is_cuda for a in args):
                why = f"{op_info(func).name} is non-deterministic on CUDA"
        unused = _unused_stats(info, args)
        rargs = tuple([self.ref(a, i in unused) if isinstance(a, Tensor) else self._refs(a)
                       for i, a in enumerate(args)])
        rkw = {k: self._refs(v) for k, v in kwargs.items()} if kwargs else {}
        rec = OpRecord(func, rargs, rkw, rng.default if rng is not None else None,
                       why or _fixed_write_reason(info, rargs, unused))
        if rng is not None and self.on_random is not None:
            self.on_random(rec, bool(rng.generators))
        if self.cost is not None:
            rec.cost_s = self.cost(func, args, kwargs, out, out_bytes)
        for i in info.written:
            if i < len(rargs):
                _append_write(rargs[i], rec)
        for k in info.written_kw:
            if k in rkw:
                _append_write(rkw[k], rec)
        for pos, slot, t in fresh:
            st = slot()
            if st is not None:
                node = slot.node = Node(rec, pos, st.nbytes(), t.dtype, t.device, slot)
                self._step_nodes.append(node)
                self._settled = None
        return rec

    def unrecorded_write(self, func: Any, args: tuple, kwargs: dict) -> None:
        """An op that is not recorded wrote into storages: their later versions have unknown lineage."""
        info = replay_info(func)
        for i in info.written:
            if i < len(args):
                self._break(args[i], func)
        for k in info.written_kw:
            if k in kwargs:
                self._break(kwargs[k], func)

    def _break(self, v: Any, func: Any) -> None:
        for t in (v if type(v) in (list, tuple) else (v,)):
            if isinstance(t, Tensor):
                slot = self.lookup(t.untyped_storage())
                if slot is not None and slot.node is not None:
                    slot.node.break_here(f"written by {op_info(func).name} outside the recorded forward pass")

    def end_step(self) -> None:
        """Forget the ops of this step's nodes that no live entry depends on."""
        self._prune()

    def as_inputs(self, tensors: list[Tensor]) -> None:
        """The tensor arguments of the step's first module call: where one was made since ``enable()`` (a
        batch a data loader stacked between steps) its ops are forgotten, so that this step's ops read it as
        they read an input made before: a fixed reference (held, its version checked at replay), where a
        recompute's chain starts. Followed back through the loader's ops it would reach the dataset, and a
        steady-state program cannot replay ops outside the step."""
        for t in tensors:
            try:
                slot = self.lookup(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                continue
            node = slot.node if slot is not None else None
            if node is not None and not node.stale and node.entry is None:
                node.ops = [_barrier(_INPUT)]
                node._deps = node._checks = node.ok_memo = None

    def _prune(self) -> None:
        if self._settled is self.keep:
            return
        nodes, self._step_nodes = self._step_nodes, []
        program = self.keep
        keep: set[int] = set(program)
        stack = [n for n in nodes if n.entry is not None]
        while stack:  # everything an entry's lineage may replay stays
            n = stack.pop()
            if id(n) in keep:
                continue
            keep.add(id(n))
            for rec, _ in n.ops:
                stack.extend(r.node for r in rec.refs() if isinstance(r, NodeRef))
        settled = True
        for n in nodes:
            if id(n) in keep:
                self._step_nodes.append(n)
                settled = settled and id(n) in program
            elif not (len(n.ops) == 1 and n.ops[0][0].func is None):
                # the live content (if any) stays usable as version 1; nothing before it is replayable
                n.ops = [_barrier(_DROPPED)]
                n.stale = False
                n._checks = None  # own_ok keeps nothing of the dropped lineage reachable
        self._settled = program if settled else None


def _unused_stats(info: _ReplayInfo, args: tuple) -> frozenset[int]:
    """Running statistics whose values a training-mode BatchNorm does not read."""
    if not info.stats or info.training < 0 or info.training >= len(args) or not args[info.training]:
        return frozenset()
    return frozenset(info.stats)


def _fixed_write_reason(info: _ReplayInfo, rargs: tuple, unused: frozenset[int]) -> str:
    # An op that reads and writes a pre-existing tensor would see a different value when replayed.
    for i in info.written:
        if i < len(rargs) and i not in unused and isinstance(rargs[i], FixedRef):
            return "it writes a parameter, buffer or input in place"
    return ""


def _append_write(ref: Any, rec: OpRecord) -> None:
    for r in (ref if type(ref) in (list, tuple) else (ref,)):
        if isinstance(r, NodeRef):
            node = r.node
            if node.stale:
                continue
            if len(node.ops) >= MAX_OPS_PER_NODE:
                node.break_here(f"written in place more than {MAX_OPS_PER_NODE} times")
            else:
                node.ops.append((rec, -1))


class OpCost:
    """Seconds an op takes under the runtime's cost model (roofline: FLOPs of its matrix products and
    convolutions, bytes read and written). Not the measured time: a model makes eviction decisions (and the statistics they
    produce) identical from run to run, and is the one the planner and the simulator use."""

    def __init__(self, model: Any):
        self.model = model

    def __call__(self, func: Any, args: tuple, kwargs: dict, out: Any, out_bytes: int) -> float:
        nbytes = out_bytes
        for group in (args, kwargs.values()) if kwargs else (args,):
            for a in group:
                if isinstance(a, Tensor):
                    nbytes += a.numel() * a.element_size()
                elif type(a) in (list, tuple):
                    for t in a:
                        if isinstance(t, Tensor):
                            nbytes += t.numel() * t.element_size()
        return float(self.model.op_time(_Work(op_flops(func, args, kwargs, out), nbytes)))


class _Work:
    """What a cost model's ``op_time`` reads from a stage."""

    __slots__ = ("flops", "bytes_accessed", "ops")

    def __init__(self, flops: float, nbytes: int):
        self.flops, self.bytes_accessed, self.ops = flops, nbytes, 1
