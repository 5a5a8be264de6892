"""Steady state: once a training step is known, later steps run with the saved-tensor hooks alone.

A step run under the dispatch mode (the *recording step*) leaves, besides its results, a
:class:`StepProgram`: for each pack of that step in order (its *ordinal*), the saved tensor's shape and
dtype and the lineage :class:`~.lineage.Node` of its storage. The nodes keep their recorded ops, which
now read as a replay program: arguments are other nodes (rebuilt or bound again), module parameters and
buffers (read as they are in the current step), or tensors the step saved (the batch): those are bound
again at the pack that saves them in each later step.

A later step that starts like the recorded one follows the program with the saved-tensor hooks alone: how
each pack and unpack does it, evictions by swap and compress included, is written once in :mod:`.steady`.
Without recompute among the policies there is no lineage: a save is bound through an :class:`Anchor`, a
node with no ops to replay.

Random ops (dropout) replay with the generator state they drew from. The recording step notes, for each,
the module call after which it was the first random op (the *n*-th call of a module forward in the
step); a later step reads the default generators' state when that call comes (the same module, checked),
which is the state the op draws from, and gives it to the op's record. A random op that is not the first
since a module call, or draws from an explicit ``generator=``, is not replayed in the steady state (its
output is kept, or rebuilt from a kept copy); nor is an op reading a tensor of the recording step that
later steps do not save (no way to find its counterpart). A program holds no
tensor of a step once the runtime is disabled (only module state, which the module holds anyway).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from .lineage import FixedRef, GenState, Node, NodeRef
from .rises import Room

Tensor = torch.Tensor
RNG_REASON = "it draws random numbers (replayed with recorded RNG states only in steps run under the dispatch mode)"
RNG_PENDING = "it draws random numbers, and the state it draws from is read when its module is called"


@dataclass(slots=True)
class Save:
    """One pack of the recorded step."""

    shape: torch.Size
    dtype: torch.dtype
    node: "Node | Anchor | None"  # lineage of the saved storage; None: not an activation (kept)
    root_version: int             # version counter of the saved tensor's root at the pack
    rebind: list[tuple[FixedRef, int]]  # fixed references to this save's root: (ref, version - root_version)
    kept: bool = False            # a parameter or buffer (the same storage, counted, in every step)


class Anchor:
    """A saved activation storage of the recorded step that has no lineage (recompute is not a policy, so
    nothing is recorded per op): binds the storage a later step saves at the same ordinal, as a
    :class:`~.lineage.Node` does, with no ops to replay."""

    __slots__ = ("ops", "nbytes", "storage", "entry", "ok_memo")
    stale = True  # nothing to replay: recompute never applies (a Node's flag for a storage it cannot rebuild)

    def __init__(self, nbytes: int):
        self.ops: tuple = ()
        self.nbytes = nbytes
        self.storage: Any = None   # the bound storage's slot (a weak reference), as Node.storage
        self.entry: Any = None
        self.ok_memo: Any = None

    def live(self) -> torch.UntypedStorage | None:
        return self.storage() if self.storage is not None else None


class ProgramRecorder:
    """Collects the packs of a recording step (called after ``SavedStore.pack`` with its handle)."""

    def __init__(self) -> None:
        self.saves: list[Save] = []
        # id(storage) of a saved tensor -> (first ordinal saving it, the storage, weakly: ids are reused)
        self.roots: dict[int, tuple[int, weakref.ref]] = {}
        # id(storage) of a tensor argument of the step's first module call -> (its position, the storage)
        self.inputs: dict[int, tuple[int, weakref.ref]] = {}
        self.input_shapes: list[tuple[torch.Size, torch.dtype]] = []
        # id(record) of a random op -> (the module call it was the first random op after, that module)
        self.random_calls: dict[int, tuple[int, weakref.ref]] = {}
        self.evicted: list[Node] = []    # lineage of the entries the step evicted
        self.uids: list[int] = []        # per save: the uid of its entry (-1: kept, no entry)
        self.storages: list[int] = []    # per save: id of its storage (0: none)
        self.first_policy: dict[int, str] = {}  # entry uid -> the policy that first evicted it
        self.evictions: dict[int, int] = {}     # entry uid -> how often the step evicted it
        self.codecs: dict[int, str] = {}        # entry uid -> the codec compress first evicted it with
        self.read_uids: dict[int, None] = {}    # entry uids in the order backward first read them
        self._anchors: dict[int, Anchor] = {}

    def saved(self, t: Tensor, entry: Any) -> None:
        """A pack of the step; ``entry``: the runtime's entry for it (None: the tensor is kept)."""
        node = None
        if entry is not None:
            node = entry.lineage
            if node is None:
                node = self._anchors.get(entry.uid)
                if node is None:
                    node = self._anchors[entry.uid] = Anchor(entry.nbytes)
        self.uids.append(entry.uid if entry is not None else -1)
        root = t._base if t._base is not None else t
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            st = None
        if st is not None:
            got = self.roots.get(id(st))
            if got is None or got[1]() is not st:
                self.roots[id(st)] = (len(self.saves), weakref.ref(st))
        self.storages.append(id(st) if st is not None else 0)
        self.saves.append(Save(t.shape, t.dtype, node, root._version, []))

    def evicted_entry(self, e: Any, policy: str, handle: Any) -> None:
        """The step evicted ``e`` by ``policy`` (``handle``: what the policy keeps)."""
        if e.lineage is not None:
            self.evicted.append(e.lineage)
        self.evictions[e.uid] = self.evictions.get(e.uid, 0) + 1
        if e.uid not in self.first_policy:
            self.first_policy[e.uid] = policy
            enc = getattr(handle, "enc", None)
            if enc is not None:
                self.codecs[e.uid] = enc.codec

    def read(self, e: Any) -> None:
        """Backward read ``e``'s bytes (an unpack)."""
        if e.uid not in self.read_uids:
            self.read_uids[e.uid] = None

    def step_inputs(self, tensors: list[Tensor]) -> None:
        """The tensor arguments of the step's first module call (the batch), in order."""
        self.input_shapes = [(t.shape, t.dtype) for t in tensors]
        for i, t in enumerate(tensors):
            st = t.untyped_storage()
            self.inputs.setdefault(id(st), (i, weakref.ref(st)))

    def random_at(self, rec: Any, call: int, module: torch.nn.Module | None) -> None:
        """``rec`` draws random numbers and is the first to since module call ``call`` (0: not the first)."""
        if call > 0 and module is not None:
            self.random_calls[id(rec)] = (call, weakref.ref(module))

    def finish(self, persistent: set[int]) -> "StepProgram":
        """The program of the recorded step. ``persistent``: storage ids of module parameters and buffers
        (read as they are in each later step). Nothing recorded changes until the program first runs
        (:meth:`StepProgram.start_step`): a program refused stays without effect."""
        nodes = _closure(s.node for s in self.saves if s.node is not None)
        for s, st in zip(self.saves, self.storages):
            s.kept = s.node is None and st in persistent
        refresh: list[tuple[FixedRef, int]] = []
        random: list[Any] = []
        temporaries: list[FixedRef] = []
        inputs: list[list[tuple[FixedRef, int]]] = [[] for _ in self.input_shapes]
        seen: set[int] = set()
        for n in nodes:
            for rec, _ in n.ops:
                if rec.func is None or id(rec) in seen:
                    continue
                seen.add(id(rec))
                if rec.rng is not None or _explicit_generator(rec):
                    random.append(rec)
                for r in rec.refs():
                    if isinstance(r, FixedRef) and r.alias is not None and id(r) not in seen:
                        seen.add(id(r))
                        self._classify(r, persistent, refresh, temporaries, inputs)
        # The recorded step's own tensors are not kept: saved ones are bound again at their packs, the
        # others (temporaries) have no counterpart in a later step.
        for s in self.saves:
            for r, _ in s.rebind:
                r.alias = None
        for r in temporaries:
            r.alias = None
        for refs in inputs:
            for r, _ in refs:
                r.alias = None
        at: dict[int, tuple[weakref.ref, list[Any]]] = {}
        fixed: list[Any] = []
        for rec in random:
            where = self.random_calls.get(id(rec))
            # a record refused for another reason (a non-deterministic CUDA kernel) stays refused
            if where is None or rec.why_not or _explicit_generator(rec):
                fixed.append(rec)
            else:
                at.setdefault(where[0], (where[1], []))[1].append(rec)
        prog = StepProgram(self.saves, nodes, refresh, fixed, temporaries, at)
        prog.inputs, prog.input_shapes = inputs, self.input_shapes
        first = self.first_ordinals()
        prog.offload = {first[u]: p for u, p in self.first_policy.items() if p != "recompute" and u in first}
        prog.recomputed = {first[u] for u, p in self.first_policy.items() if p == "recompute" and u in first}
        prog.codecs = {first[u]: c for u, c in self.codecs.items() if u in first}
        prog.again = {first[u] for u, n in self.evictions.items() if n > 1 and first.get(u, -1) in prog.offload}
        prog.reads = [first[u] for u in self.read_uids if u in first]
        prog.read_at = {k: i for i, k in enumerate(prog.reads)}
        return prog

    def first_ordinals(self) -> dict[int, int]:
        """Entry uid -> the first ordinal that saved it."""
        first: dict[int, int] = {}
        for k, uid in enumerate(self.uids):
            if uid >= 0 and uid not in first:
                first[uid] = k
        return first

    def _classify(self, r: FixedRef, persistent: set[int], refresh: list[tuple[FixedRef, int]],
                  temporaries: list[FixedRef], inputs: list[list[tuple[FixedRef, int]]]) -> None:
        assert r.alias is not None
        storage = r.alias.untyped_storage()
        st = id(storage)
        got = self.roots.get(st)
        given = self.inputs.get(st)
        if st in persistent:  # module state: read as it is, at the version it has when the step starts
            refresh.append((r, _delta(r, r.alias._version)))
        elif given is not None and given[1]() is storage:  # the batch: bound again at the step's first call
            inputs[given[0]].append((r, _delta(r, r.alias._version)))
        elif got is not None and got[1]() is storage:  # saved by the step: bound again at that pack
            s = self.saves[got[0]]
            s.rebind.append((r, _delta(r, s.root_version)))
        elif _no_elements(r):
            # an empty tensor (an empty key/value cache that torch.cat extends): any empty tensor of its dtype
            # stands for it in every step; the recorded step's own is not held
            r.alias, r.version = torch.empty(0, dtype=r.view.dtype, device=r.alias.device), -1
        else:
            temporaries.append(r)  # a temporary of the recorded step: nothing in a later step stands for it


def _no_elements(r: FixedRef) -> bool:
    """Whether the recorded op read no element through ``r`` (an empty view)."""
    return any(n == 0 for n in r.view.size)


def _explicit_generator(rec: Any) -> bool:
    """Whether a recorded op draws from a ``generator=`` argument (its state is not the default one)."""
    return any(isinstance(a, GenState) for a in (*rec.args, *rec.kwargs.values()))


def _delta(r: FixedRef, base: int) -> int:
    """How far ``r``'s recorded version is past ``base`` (the version of what it will be bound to then);
    -1: the value is not read, no version to check."""
    return -1 if r.version < 0 else r.version - base


def _bind(refs: list[tuple[FixedRef, int]], t: Tensor) -> None:
    """Point ``refs`` at ``t``'s root, at its version now plus each reference's delta."""
    root = t._base if t._base is not None else t
    v = root._version
    for r, delta in refs:
        r.alias = root
        if delta >= 0:
            r.version = v + delta


def _closure(roots: Iterable[Node]) -> list[Node]:
    """The nodes whose ops a replay of ``roots`` may run (the roots and every node they read)."""
    out: list[Node] = []
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        out.append(n)
        for rec, _ in n.ops:
            stack.extend(r.node for r in rec.refs() if isinstance(r, NodeRef))
    return out


class StepProgram:
    """A recorded step's saves and replay program (see the module docstring)."""

    def __init__(self, saves: list[Save], nodes: list[Node], refresh: list[tuple[FixedRef, int]],
                 random: list[Any], temporaries: list[FixedRef],
                 random_at: dict[int, tuple[weakref.ref, list[Any]]] | None = None):
        self.saves = saves
        self.nodes = nodes
        self.keep = {id(n) for n in nodes}  # the recorder must not prune them at step ends
        self.refresh = [(r, delta, weakref.ref(r.alias)) for r, delta in refresh]
        self.random = random            # records of random ops not replayed in the steady state
        self.random_at = random_at or {}  # module call -> (its module, random ops given the state read there)
        self.temporaries = temporaries  # references to tensors no later step has
        self.stages = 0                 # stage ops the recorded step counted (reported for steady-state steps)
        self.pressure = False           # the recorded step came near its budget
        self.headroom = 0               # bytes kept free after each save and read (the most an op needed)
        self.gross_headroom = 0         # the same, with what the dispatch mode evicted in between added back
        self.room: Room | None = None   # the same per save and read, where it was measured (runtime.rises)
        # Its light steps (never near the budget): the most the bytes rose above a step's start at a save, and
        # what such a step counted as saved (bytes, tensors). None: none ran whole yet (runtime.hookless).
        self.light_rise: int | None = None
        self.light_saved = (0, 0)
        self.light_external = False     # the last light step counted a storage from before the native device
        # per tensor argument of the step's first module call: the references bound to it, and its signature
        self.inputs: list[list[tuple[FixedRef, int]]] = []
        self.input_shapes: list[tuple[torch.Size, torch.dtype]] = []
        self.offload: dict[int, str] = {}   # save ordinal -> the policy that evicts it as it is packed
        self.recomputed: set[int] = set()   # save ordinals the recorded step evicted by recompute
        self.codecs: dict[int, str] = {}    # save ordinal -> the codec the recorded step compressed it with
        self.again: set[int] = set()        # offloaded save ordinals the recorded step evicted again after a read
        self.reads: list[int] = []          # save ordinals (first of each storage) in first-read order
        self.read_at: dict[int, int] = {}   # save ordinal -> its position in ``reads``
        self._armed = False
        # no node or save bound since the last unbind: the step after it ran without hooks (runtime.hookless),
        # so the next step's start has only the module state and inputs to forget
        self.unbound = False

    def bind_inputs(self, tensors: list[Tensor]) -> str:
        """The step's first module call: bind the references to its tensor arguments. Returns why not ("" when
        done): the arguments differ from the recorded step's."""
        got = [(t.shape, t.dtype) for t in tensors]
        if got != self.input_shapes:
            return (f"the step's inputs are {[(list(s), str(d)) for s, d in got]} where the recorded step's were "
                    f"{[(list(s), str(d)) for s, d in self.input_shapes]}")
        for t, refs in zip(tensors, self.inputs):
            _bind(refs, t)
        return ""

    def module_called(self, call: int, module: torch.nn.Module, state: Callable[[], Any]) -> str:
        """Module call ``call`` of a steady-state step: give the random ops noted there the generator state
        they will draw from (``state()``). Returns why not ("" when done): another module is called."""
        ref, recs = self.random_at[call]
        expected = ref()
        if expected is not module:
            return (f"module call #{call} is {type(module).__name__} where the recorded step called "
                    f"{type(expected).__name__ if expected is not None else 'a module that is gone'}")
        got = state()
        for rec in recs:
            rec.rng = got if rec.rng is None or rec.rng[1] is not None else (got[0], None)
            rec.why_not = ""
        return ""

    def cannot_rebuild(self, evicted: list[Node]) -> str:
        """Why rebuilding ``evicted`` (what the recorded step evicted) may need an op the steady state does
        not replay, or "": a random op it gives no state, or one reading a temporary."""
        random = {id(r) for r in self.random}
        temporaries = {id(r) for r in self.temporaries}
        for n in _closure(evicted):
            for rec, _ in n.ops:
                if id(rec) in random:
                    return ("what the step evicted is rebuilt through random ops that draw from an explicit "
                            "generator or after another random op in the same module call")
                if temporaries and any(id(r) in temporaries for r in rec.refs()):
                    return ("what the step evicted is rebuilt from a tensor of the step that autograd does not "
                            "save (an input read but not saved, e.g. an attention mask)")
        return ""

    def start_step(self) -> None:
        """Unbind every node (their storages belong to an earlier step) and read module state anew."""
        if not self._armed:
            self._armed = True
            for rec in self.random:
                rec.why_not = rec.why_not or RNG_REASON
        for _, recs in self.random_at.values():
            for rec in recs:
                rec.why_not = RNG_PENDING  # until its module call gives it this step's state
        self.unbind(nodes=not self.unbound)
        self.unbound = False
        for r, delta, ref in self.refresh:
            a = r.alias = ref()  # None once the module is gone: what reads it is not replayed
            if a is not None and delta >= 0:
                r.version = a._version + delta

    def unbind(self, nodes: bool = True) -> None:
        """Forget the tensors of the last step that ran it (bound again at the packs of the next) and the
        module state it read (held weakly meanwhile): a disabled runtime keeps no tensor alive. ``nodes``:
        the nodes and saves too (False where none was bound since they were last forgotten: ``unbound``)."""
        if nodes:
            for n in self.nodes:
                n.storage = None
                n.entry = None
                n.ok_memo = None
            for s in self.saves:
                for r, _ in s.rebind:
                    r.alias = None
        for r, _, _ in self.refresh:
            r.alias = None
        for refs in self.inputs:
            for r, _ in refs:
                r.alias = None
