"""Replay: regenerate a lineage node at a version, bit for bit.

:class:`Replayer` rebuilds a node (:mod:`.lineage`) from its live storage when that is still there, from an
entry evicted by another policy (a swapped-out host checkpoint, a compressed copy), or by replaying its ops
under ``no_grad`` with inputs regenerated the same way, iteratively (no Python recursion limit on long
chains). A chain is planned whole before it runs: inputs the allocator already freed are replayed within it
(each once), and inputs it may still free are held for the chain and handed back after. Random ops replay
with the state saved before them (:mod:`.rng`); arguments an op writes besides the regenerated storage
(BatchNorm running statistics) get private clones, so side effects are never applied twice.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from ..graph.outputs import flat_outputs as _flat_outputs
from .lineage import OPAQUE, FixedRef, GenState, Node, NodeRef, OpRecord, replay_info
from .rng import _ForkedRNG

if TYPE_CHECKING:
    from .entry import Entry

Tensor = torch.Tensor


class ReplayError(RuntimeError):
    """A node cannot be regenerated (its lineage was refused or an input changed)."""


class Replayer:
    """Regenerates nodes; see the module docstring.

    ``fetch(entry)`` makes an entry evicted by another policy resident and returns its storage as a
    flat tensor; ``adopt(entry, tensor)`` hands a tensor recomputed for an entry evicted by recompute
    back to that entry (it becomes resident again, DTR-style: it will likely be read soon).
    ``epoch()`` changes at each step so validity checks are redone once per step. ``claim(entry)`` takes
    an entry back from the allocator's registry before its storage is read (see ``SavedStore.claim``).
    """

    def __init__(self, fetch: Callable[["Entry"], Tensor], adopt: Callable[["Entry", Tensor], None],
                 epoch: Callable[[], int], claim: Callable[["Entry"], bool] | None = None,
                 drain: Callable[[], None] | None = None, hold_done: Callable[[list["Entry"]], None] | None = None,
                 retry: Callable[..., Any] | None = None):
        self.fetch, self.adopt, self.epoch = fetch, adopt, epoch
        self.claim: Callable[["Entry"], bool] = claim or (lambda e: e.tensor is not None)
        # drain(): record the entries the allocator freed (before a chain is planned, so that its plan
        # sees them gone); hold_done(entries): the chain has run, the registered sources it claimed may
        # be freed again; retry(func, *args, **kwargs): run an op again after the allocator refused it
        # (replays that run outside the dispatch mode: see ``unmetered``)
        self.drain: Callable[[], None] = drain or (lambda: None)
        self.hold_done: Callable[[list["Entry"]], None] = hold_done or (lambda es: None)
        self.retry = retry

    # -- validity and cost ---------------------------------------------------------------------
    def why_not(self, node: Node, version: int) -> str:
        """"" if ``node`` at ``version`` can be replayed, else why not. The whole chain back to fixed
        inputs must be replayable: an input that is live now may be gone when the replay runs."""
        epoch = self.epoch()
        stack = [(node, version)]
        seen: set[tuple[int, int]] = set()
        walked: list[tuple[Node, int]] = []
        while stack:
            n, v = stack.pop()
            key = (id(n), v)
            if key in seen:
                continue
            seen.add(key)
            memo = n.ok_memo
            if memo is not None and memo[0] == epoch and memo[1] == v:
                reason = memo[2]
                if not reason:
                    continue  # its whole chain was found replayable this step
            else:
                reason = _own_reason(n, v)
            if reason and n is not node and _held_by_entry(n, v):
                continue  # an input not replayable, but its content stays with its entry: the chain starts there
            if reason:
                n.ok_memo = (epoch, v, reason)
                return reason  # the nodes walked to here are not memoised: their chains are not all OK
            walked.append((n, v))
            for rec, _ in n.ops[:v]:
                for r in rec.refs():
                    if isinstance(r, NodeRef) and r.node is not n:
                        stack.append((r.node, r.version))
        for n, v in walked:  # every chain below them is replayable: remember it for this step
            n.ok_memo = (epoch, v, "")
        return ""

    def registration_cost(self, node: Node) -> float | None:
        """``None`` when ``node`` at its current version cannot be replayed (:meth:`why_not`), else the
        seconds its replay costs now (:meth:`cost`): what registering its entry with the allocator asks,
        once per new entry. One pass where the usual case holds (its own ops replayable, every input found
        replayable this step already, every input available), :meth:`why_not` and :meth:`cost` otherwise:
        the same answer and the same memo either way."""
        if node.stale:
            return None
        v = len(node.ops)
        epoch = self.epoch()
        own, inputs = node.deps(v)
        memo = node.ok_memo
        if memo is None or memo[0] != epoch or memo[1] != v:
            if not node.own_ok(v):
                return None if self.why_not(node, v) else self.cost(node, v, {})
            for m, w in inputs:
                mm = m.ok_memo
                if mm is None or mm[0] != epoch or mm[1] != w or mm[2]:
                    return None if self.why_not(node, v) else self.cost(node, v, {})
            node.ok_memo = (epoch, v, "")  # what why_not records when the walk ends at memoised inputs
        elif memo[2]:
            return None
        available = self.available
        for m, w in inputs:
            if not available(m, w):
                return self.cost(node, v, {})
        return own

    def cost(self, node: Node, version: int, memo: dict[tuple[int, int], float]) -> float:
        """Seconds to replay ``node`` at ``version``, plus its inputs that are not available now
        (each counted once per ``memo``: one eviction decision)."""
        if not memo:
            # The usual case at a scoring pass: every input is available, so the cost is the node's
            # own (what the walk below returns then, without its stack and keys).
            own, inputs = node.deps(version)
            if all(self.available(m, w) for m, w in inputs):
                memo[(id(node), version)] = 0.0
                return own
        total = 0.0
        stack = [(node, version)]
        while stack:
            n, v = stack.pop()
            key = (id(n), v)
            if key in memo:
                continue
            memo[key] = 0.0
            cost, inputs = n.deps(v)
            total += cost
            for m, w in inputs:
                if not self.available(m, w):
                    stack.append((m, w))
        return total

    @staticmethod
    def available(n: Node, v: int) -> bool:
        """Whether ``n`` at ``v`` exists without replaying it: live, or held by a non-recompute policy."""
        if v != len(n.ops) or n.stale:
            return False
        st = n.live()
        if st is not None and (st.nbytes() or not n.nbytes):  # 0 bytes: freed by the allocator
            return True
        e = n.entry
        return e is not None and (e.tensor is not None or e.policy not in (None, "recompute"))

    # -- regeneration ----------------------------------------------------------------------------
    def materialize(self, node: Node, version: int) -> Tensor:
        """A flat tensor over a storage holding ``node``'s content at ``version``.

        Plans the chain first (which versions must be replayed, in dependency order), then runs it,
        dropping each intermediate result as soon as its last consumer in the chain has run, so a
        long chain holds only its frontier."""
        self.drain()
        held: list["Entry"] = []
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # once for the chain, not per op
        try:
            if torch._C._is_any_autocast_enabled():
                with _no_autocast():
                    return self._materialize(node, version, held)
            return self._materialize(node, version, held)
        finally:
            torch._C._set_grad_enabled(grad)
            if held:
                self.hold_done(held)

    def _materialize(self, node: Node, version: int, held: list["Entry"]) -> Tensor:
        order, deps = self._plan(node, version, held)
        uses: dict[tuple[int, int], int] = {}
        for k in order:
            for d in deps[k][1]:
                uses[d] = uses.get(d, 0) + 1
        memo: dict[tuple[int, int], Tensor] = {}
        for k in order:
            n, v = deps[k][0]
            for d in deps[k][1]:
                if d not in memo:
                    dn, dv = deps[d][0]
                    got = self._get(dn, dv)
                    if got is None:
                        # available when the chain was planned, evicted since: the replays before it
                        # allocated, and the cap made room by dropping it. Regenerate it the same way.
                        got = self._materialize(dn, dv, held)
                    memo[d] = got
            memo[k] = self._replay(n, v, memo)
            for d in deps[k][1]:
                uses[d] -= 1
                if uses[d] == 0:
                    del memo[d]  # its last consumer in this chain has run
        key = (id(node), version)
        if key in memo:
            return memo[key]
        got = self._get(node, version)
        assert got is not None
        return got

    def _plan(self, node: Node, version: int,
              held: list["Entry"]) -> tuple[list[tuple[int, int]], dict[tuple[int, int], Any]]:
        """Post-order of the (node, version) pairs to replay, and per pair ((node, version), inputs).

        The chain's sources that the allocator may free (registered entries) are claimed here and
        appended to ``held``: freed while the chain allocates, each would be rebuilt by a chain of its
        own (and what it shares with this one replayed twice). One the allocator freed already is
        replayed within this chain."""
        deps: dict[tuple[int, int], Any] = {}
        order: list[tuple[int, int]] = []
        if self.available(node, version):
            return order, deps
        stack: list[tuple[Node, int, bool]] = [(node, version, False)]
        while stack:
            n, v, expanded = stack.pop()
            key = (id(n), v)
            if expanded:
                order.append(key)
                continue
            if key in deps:
                continue
            inputs: list[tuple[int, int]] = []
            todo: list[tuple[Node, int]] = []
            for rec, _ in n.ops[:v]:
                for r in rec.refs():
                    if isinstance(r, NodeRef) and r.node is not n:
                        k = (id(r.node), r.version)
                        if k not in inputs:
                            inputs.append(k)
                            todo.append((r.node, r.version))
            deps[key] = ((n, v), inputs)
            stack.append((n, v, True))
            for m, w in todo:
                k = (id(m), w)
                if k in deps:
                    continue
                if self.available(m, w) and self._hold(m, held):
                    deps[k] = ((m, w), [])  # fetched when first needed, never replayed
                else:
                    stack.append((m, w, False))
        return order, deps

    def _hold(self, n: Node, held: list["Entry"]) -> bool:
        """Take ``n``'s entry back from the allocator's registry for the chain; False when it was freed."""
        e = n.entry
        if e is None or not e.registered:
            return True
        if self.claim(e):
            held.append(e)
            return True
        return False

    def _get(self, n: Node, v: int) -> Tensor | None:
        """The content of ``n`` at ``v`` without replaying it: its live storage, or its entry's copy."""
        if v != len(n.ops) or n.stale:
            return None
        e = n.entry
        if e is not None and e.registered:
            self.claim(e)  # the allocator may free a registered storage at any allocation: take it back first
        st = n.live()
        if st is not None and (st.nbytes() or not n.nbytes):
            return flat(st, n.dtype, n.device)
        if e is None:
            return None
        if e.tensor is not None:
            return e.tensor
        if e.policy not in (None, "recompute"):
            return self.fetch(e)  # a host checkpoint or compressed copy: where the chain starts
        return None

    def _replay(self, n: Node, v: int, memo: dict[tuple[int, int], Tensor]) -> Tensor:
        reason = _own_reason(n, v)
        if reason:
            raise ReplayError(f"cannot recompute a {n.dtype} storage of {n.nbytes} bytes: {reason}")
        rec, pos = n.ops[0]
        out = self._run(rec, memo, None, None)
        base = flat((out if type(out) is Tensor else _flat_outputs(out)[pos]).untyped_storage(), n.dtype, n.device)
        del out  # the producer's other outputs are not needed
        for rec, _ in n.ops[1:v]:
            self._run(rec, memo, n, base)
        e = n.entry
        if e is not None and e.tensor is None and e.policy == "recompute" and v == len(n.ops):
            self.adopt(e, base)
        return base

    def _run(self, rec: OpRecord, memo: dict[tuple[int, int], Tensor], target: Node | None,
             base: Tensor | None) -> Any:
        # runs under no_grad (materialize); only the arguments that are references are resolved per replay
        fixed, refs, fixed_kw, refs_kw = rec.arg_plan()
        args = list(fixed)
        for i, a, written in refs:
            args[i] = self._arg(a, memo, target, base, written)
        kwargs = dict(fixed_kw)
        for k, a, written in refs_kw:
            kwargs[k] = self._arg(a, memo, target, base, written)
        if rec.rng is not None:
            rng = _ForkedRNG(rec.rng, _device_of(args))
            self._call(rng.__enter__, [], {})  # reading the current state allocates (5 KB): refused, retried
            try:
                return self._call(rec.func, args, kwargs, rng)
            finally:
                rng.__exit__(None, None, None)
        return self._call(rec.func, args, kwargs)

    def _call(self, func: Any, args: list[Any], kwargs: dict[str, Any], rng: _ForkedRNG | None = None) -> Any:
        try:
            return func(*args, **kwargs)
        except torch.OutOfMemoryError:
            # Outside the dispatch mode (a steady-state step) the allocator caps each allocation and
            # frees registered entries; when those are not enough, the runtime evicts and the op reruns
            # (a random op from its recorded state again).
            if self.retry is None:
                raise
            if rng is not None:
                return self.retry(_rewound(rng, func), *args, **kwargs)
            return self.retry(func, *args, **kwargs)

    def _arg(self, a: Any, memo: dict[tuple[int, int], Tensor], target: Node | None, base: Tensor | None,
             written: bool) -> Any:
        if type(a) in (list, tuple):
            if any(isinstance(b, (NodeRef, FixedRef)) for b in a):
                return type(a)(self._arg(b, memo, target, base, written) for b in a)
            return a
        if isinstance(a, NodeRef):
            if a.node is target:
                return a.view.on(base)  # the storage being rebuilt, at the version this op saw
            t = a.view.on(memo[(id(a.node), a.version)])
            return t.clone() if written else t  # never write into another node's storage
        if isinstance(a, FixedRef):
            if a.version >= 0 and a.alias._version != a.version:
                raise ReplayError(f"an input of shape {list(a.view.size)} changed in place since it was recorded")
            t = a.view.on(a.alias)
            return t.clone() if written else t  # BatchNorm running stats: update a private copy
        if isinstance(a, GenState):
            return a.make()
        return a


def _rewound(rng: _ForkedRNG, func: Any) -> Callable[..., Any]:
    """``func`` run from ``rng``'s recorded state, each time it is called."""
    def run(*args: Any, **kwargs: Any) -> Any:
        rng.rewind()
        return func(*args, **kwargs)
    run.__name__ = getattr(func, "__name__", "op")
    return run


def _held_by_entry(n: Node, v: int) -> bool:
    """Whether ``n``'s content at ``v`` is kept by its saved-tensor entry for as long as the entry lives: it
    is the current content and the entry is resident or evicted by a policy that keeps a copy (swap,
    compress). Recompute cannot evict it (it is not replayable), so a replay can always fetch it."""
    e = n.entry
    return (e is not None and not n.stale and v == len(n.ops)
            and (e.tensor is not None or e.policy not in (None, "recompute")))


def _own_reason(n: Node, v: int) -> str:
    """Why ``n``'s own ops up to ``v`` cannot be replayed ("" if they can), inputs not included."""
    if not 1 <= v <= len(n.ops):
        return "its lineage was dropped"
    for rec, _ in n.ops[:v]:
        if rec.why_not:
            return rec.why_not
        for r in rec.refs():
            if r is OPAQUE:
                return "an input has no lineage (made outside the recorded forward pass)"
            if isinstance(r, FixedRef) and r.alias is None:
                return "an input of the recorded step is not bound in this step"
            if isinstance(r, FixedRef) and r.version >= 0 and r.alias._version != r.version:
                return f"an input of shape {list(r.view.size)} was modified in place since"
    return ""


def flat(st: torch.UntypedStorage, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The whole storage as a 1-D tensor of ``dtype`` (bytes if the size is not a multiple)."""
    item = dtype.itemsize
    n = st.nbytes()
    if n % item:
        dtype, item = torch.uint8, 1
    with torch._C._DisableTorchDispatch():
        return torch.empty((0,), dtype=dtype, device=device).set_(st, 0, (n // item,), (1,))


def _device_of(args: list[Any]) -> torch.device:
    for a in args:
        if isinstance(a, Tensor):
            return a.device
    return torch.device("cpu")


@contextmanager
def _no_autocast() -> Iterator[None]:
    """Autocast off on every device type for a replay. Recorded ops are the ones autocast already cast
    (the dispatch mode sees them below the autocast key); the state at unpack (a ``backward()`` inside
    ``torch.autocast``) would cast them again: an fp32 op of an ``autocast(enabled=False)`` block would
    replay in bf16, into a storage sized for fp32."""
    on = [d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
    for d in on:
        torch.set_autocast_enabled(d, False)
    try:
        yield
    finally:
        for d in on:
            torch.set_autocast_enabled(d, True)


def _autocast_devices() -> tuple[str, ...]:
    """The device types this torch has an autocast state for."""
    out = []
    for d in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "privateuseone"):
        try:
            torch.is_autocast_enabled(d)
        except (RuntimeError, ValueError, TypeError):
            continue
        out.append(d)
    return tuple(out)


_AUTOCAST_DEVICES = _autocast_devices()
