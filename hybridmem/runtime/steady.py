"""A steady-state step, from pack to unpack: the recorded program followed with no op hook.

The runtime runs a step here when it starts like the recorded one (:mod:`.program`). No dispatch mode is
active: nothing runs per op in Python. What runs is per saved tensor:

**pack** (:meth:`SteadyStep.__call__`, autograd's pack hook)
  1. the save's ordinal ``k`` and the recorded save's signature (shape, dtype); the first mismatch leaves
     the steady state for the rest of the step (it keeps what it saves) and the next step records again;
  2. fixed references the recorded ops read from this save are bound to the new tensor;
  3. *light* packs: while the recorded step never came near its budget and the device is still far from
     it, an activation is kept like a parameter (no entry), which costs a few attribute reads;
  4. else the storage is bound to the recorded node and gets an entry (``pack_bound``); near the budget
     entries recompute can rebuild are registered with the allocator, which frees them at allocation time;
  5. a save the recorded step evicted by swap or compress is evicted now, by the same policy (``offload``):
     a swap queues its device-to-host copy on a side stream after the producer's kernels, and the device
     bytes go when the step's own references to the tensor do. The recorded step evicted it when memory
     ran short; evicting it as it is saved frees the same bytes no later. A compression allocates its
     encoding first, so it waits until only the runtime holds the tensor (checked at the next packs):
     encoding while the step still holds the original would hold both. While the step holds a tensor
     evicted this way, each later pack checks its version counter: a write in place after the save is
     refused at unpack, as PyTorch refuses it (saved-tensor hooks switch PyTorch's own check off).

**unpack** (:meth:`SteadyStep.unpacked`, before the store rebuilds the tensor)
  6. the first read of a save moves the step along the recorded read order, and the evicted saves that the
     recorded backward read next are prefetched (their swap-in copies queued on a side stream) while the
     budget has room for them: the read that needs one then finds it on its way or arrived. An entry the
     allocator freed is rebuilt by replaying its node's recorded ops (:mod:`.replay`);
  7. a save the recorded step evicted again after backward read it is evicted again once the read is done
     (at the next read of another save): a swap's host copy is still there, so no copy is made.

Budget: the CUDA caching allocator is capped at the budget and its free-memory callback (the native
library) frees registered entries on a cache miss; the CPU allocator wrapper does the same. What the
recorded step made room for by eviction is evicted here at pack time, so a steady step holds no more than
its recorded step did. An op's allocation that still finds no room is let through on the CPU (the step
has no hook around its ops to retry in) and handled at the next save or read (``steady_control._recover``). A save
whose policy cannot evict it here (compress could not decide without
reading the bytes) stays resident: :meth:`StepProgram` refuses such a program on CUDA (``steady_control``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .program import StepProgram, _bind
from ..errors import StepDivergedError
from .saved import Saved

Tensor = torch.Tensor
# Prefetch looks this many first reads ahead of the current one: copies start a few backward ops early,
# and the room they take is bounded (each is also checked against the budget).
PREFETCH_WINDOW = 8


@dataclass
class SteadyParts:
    """What a steady-state step uses of the runtime (built once by the runtime, handed to each step)."""

    store_pack: Callable[[Tensor], Any]              # SavedStore.pack: the general pack
    pack_bound: Callable[[Tensor, Any, Any, bool], Any]  # pack of a storage just bound to its node
    bind: Callable[[Any, torch.UntypedStorage], Any]  # bind(node, storage) -> the storage's slot
    after: Callable[[], None]                        # register pending entries near the budget
    diverged: Callable[[str], None]                  # the step left the program: say why
    keep: Callable[[Tensor], Any]                    # a light pack: the tensor itself
    far: Callable[[], bool]                          # the device is far from its budget
    counted: Callable[[int], None]                   # a light pack's bytes count as saved
    offload: Callable[[Any, str], bool]              # evict an entry now by the named policy
    sole_owner: Callable[[Any], bool]                # only the runtime references the entry's storage
    prefetch: Callable[[Any], bool] | None           # start regenerating an evicted entry (False: no room)
    claim: Callable[[Any], bool]                     # SavedStore.claim: take an entry back from the allocator
    pack_plain: Callable[[Tensor, Any], Any]         # an entry without lineage (evictable by swap or compress)


class SteadyStep:
    """The pack hook of one steady-state step, and what its unpacks do (see the module docstring)."""

    def __init__(self, program: StepProgram, parts: SteadyParts, sig: Any = None, swap: bool = False,
                 grow: float = 1.0):
        self.program = program
        self.sig = sig                    # a scaled step's own input signature (None: the program's)
        self.scaled = sig is not None     # followed at other sizes than recorded (another sequence length, batch)
        self.swap = swap                  # swap may stand in for what the recorded step recomputed
        # kept free after each save and read: what the recorded step rose until its next one (runtime.rises).
        # A scaled step adds back what the recording's dispatch mode evicted in between (its entries are bound
        # to no program node, so the allocator cannot free them for its ops), grown with the sizes if larger.
        self.grow = max(grow, 1.0)
        self.headroom = int(program.gross_headroom * grow) if grow > 1 else program.headroom
        self.room = program.room
        self.room_now = self.headroom
        self.saves = program.saves
        self.parts = parts
        self.register = True  # new entries are registered with the allocator at once (freed only when needed)
        self.light = not program.pressure
        self.seen: set[int] = set()       # storages light packs counted as saved this step
        self.k = 0                        # ordinal of the next pack
        self.off = False                  # the step left the program: packs keep their tensors
        self.offload = program.offload
        self.entries: dict[int, Any] = {}  # save ordinal -> its entry, for the saves evicted at pack
        self.ordinal_of: dict[int, int] = {}  # entry uid -> its save ordinal
        self.bound: list[Any] = []        # entries this step bound to program nodes, in pack order
        self.deferred: list[tuple[int, Any]] = []  # compressions waiting for the step to drop the tensor
        self.again: Any = None            # the entry read last, to evict again at the next read
        self.held: list[Any] = []         # entries evicted at pack whose tensor the step may still write
        self.read_pos = -1                # position in program.reads of the latest first read
        self.next_prefetch = 0            # position in program.reads from which to prefetch

    # ---- pack ------------------------------------------------------------------------------------
    def __call__(self, t: Tensor) -> Any:
        k = self.k
        self.k = k + 1
        parts = self.parts
        if self.off:
            return parts.store_pack(t)
        saves = self.saves
        if k >= len(saves):
            return self._leave(f"save #{k} of shape {list(t.shape)} is beyond the {len(saves)} the recorded step made", t)
        s = saves[k]
        if t.dtype != s.dtype or (t.shape != s.shape and (not self.scaled or t.dim() != len(s.shape))):
            return self._leave(f"save #{k} is {list(t.shape)} {t.dtype} where the recorded step saved "
                               f"{list(s.shape)} {s.dtype}", t)
        if self.scaled:
            return self._pack_scaled(k, s, t)
        if s.rebind:
            _bind(s.rebind, t)
        node = s.node
        if node is None:
            # kept by the recorded step (module state, an input): far from the budget a light pack keeps it
            # as it is (a storage from before the runtime was installed was counted when first saved)
            return parts.keep(t) if self.light and s.kept and parts.far() else parts.store_pack(t)
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return self._leave(f"save #{k} has no storage", t)
        if self.light:
            if parts.far():
                if id(st) not in self.seen:
                    self.seen.add(id(st))
                    parts.counted(st.nbytes())
                return parts.keep(t)
            self.light = False
        cur = node.live()
        if cur is None:
            if st.nbytes() != node.nbytes:
                return self._leave(f"save #{k} is over a storage of {st.nbytes()} bytes where the recorded "
                                   f"step's had {node.nbytes}", t)
            policy = self.offload.get(k)
            h = parts.pack_bound(t, st, parts.bind(node, st), self.register and policy is None)
            if type(h) is Saved:
                e = h.entry
                self.ordinal_of[e.uid] = k
                self.bound.append(e)
                self._evict_at_pack(k, e, policy)
        elif cur is not st:
            return self._leave(f"save #{k} is over another storage than the recorded step's", t)
        else:
            h = parts.store_pack(t)
        return self._after_pack(h)

    def _evict_at_pack(self, k: int, e: Any, policy: str | None) -> None:
        """Save ``k``'s new entry, evicted now by ``policy`` (a compression once only the runtime holds it)."""
        if policy == "compress":
            self.deferred.append((k, e))
        elif policy is not None and e.tensor is not None and self.parts.offload(e, policy):
            self.entries[k] = e
            self.held.append(e)

    def _after_pack(self, h: Any) -> Any:
        room = self.room
        if room is not None:
            k = self.k - 1
            self._room(room.after_save[k] if k < len(room.after_save) else None)
        if self.deferred:
            self._compress_deferred()
        if self.held:
            self._check_writes()
        self.parts.after()
        return h

    def _pack_scaled(self, k: int, s: Any, t: Tensor) -> Any:
        """A save of a step that follows a program recorded at other sizes. The recorded ops cannot rebuild it
        (their size arguments are the recorded step's), so nothing is bound to them: a save the recorded step
        swapped or compressed is evicted by the same policy as it is made, one it recomputed is swapped where
        swap is a policy; the others get entries swap and compress may evict for room."""
        parts = self.parts
        if s.node is None:
            return parts.store_pack(t)
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return self._leave(f"save #{k} has no storage", t)
        policy = self.offload.get(k) or ("swap" if self.swap and k in self.program.recomputed else None)
        h = parts.pack_plain(t, st)
        if type(h) is Saved:
            e = h.entry
            if e.uid not in self.ordinal_of:
                self.ordinal_of[e.uid] = k
                self._evict_at_pack(k, e, policy)
        return self._after_pack(h)

    def _room(self, rise: tuple[int, int] | None) -> None:
        """What to keep free until the next save or read: ``rise`` (None: not measured there, the most)."""
        if rise is None:
            self.room_now = self.headroom
        else:
            self.room_now = int(rise[1] * self.grow) if self.scaled else rise[0]

    def _check_writes(self) -> None:
        """Note the entries evicted at pack whose tensor was written in place since (unpack refuses them);
        forget those whose tensor the step dropped (nothing can write it any more)."""
        held = []
        for e in self.held:
            r = e.root() if e.root is not None and e.tensor is None else None
            if r is None:
                continue
            now = r._version + e.vshift
            if now != e.version:
                e.written = now
            else:
                held.append(e)
        self.held = held

    def _compress_deferred(self) -> None:
        """Compress the deferred saves that only the runtime holds now; the others wait for the next pack."""
        waiting = []
        for k, e in self.deferred:
            if e.tensor is None or e.refs == 0:
                continue  # the allocator freed it, or its handles are gone
            if not self.parts.sole_owner(e):
                waiting.append((k, e))
            elif self.parts.offload(e, "compress"):
                self.entries[k] = e
                self.held.append(e)
        self.deferred = waiting

    def _leave(self, why: str, t: Tensor) -> Any:
        self.leave(why)
        return self.parts.store_pack(t)

    def leave(self, why: str) -> None:
        """The step left the program: the rest of it keeps what it saves. What it bound to program nodes
        so far was matched by its saves' signatures alone, and a step whose ops differ may have bound a
        tensor to a node that did not produce it: none of them is rebuilt from the program (see
        :meth:`_unbind`)."""
        self.off = True
        lost = self._unbind()
        self.parts.diverged(why)
        if lost:
            raise StepDivergedError(
                f"hybridmem: a steady-state step left its recorded program ({why}) after the allocator had "
                f"freed {lost} tensor(s) matched to the program by their saves; rebuilt from the recorded ops "
                "they could differ, so this step stops instead of computing gradients from them. The next "
                "step records the ops anew; a model whose ops change within a step with the same inputs "
                "(a branch on the data) trains exactly with plugins: {steady: false}.")

    def _unbind(self) -> int:
        """Take the entries this step bound to program nodes back from the allocator and off their nodes:
        they stay as they are (no recompute). Returns how many the allocator had freed already."""
        lost = 0
        for e in self.bound:
            if e.refs == 0:
                continue  # released: nothing reads it any more
            if e.tensor is None:
                lost += e.policy in (None, "recompute")  # a swapped or compressed copy is still exact
                continue
            if not self.parts.claim(e):
                lost += 1
                continue
            node = e.lineage
            if node is not None and node.entry is e:
                node.entry = node.storage = None
            e.lineage = None
        self.bound.clear()
        return lost

    @property
    def complete(self) -> bool:
        return not self.off and self.k == len(self.saves)

    # ---- unpack ----------------------------------------------------------------------------------
    def unpacked(self, h: Any) -> None:
        """Backward reads ``h`` (before the store rebuilds it): evict the save read last again where the
        recorded step did; where this is the first read of a save, prefetch the next evicted ones."""
        if type(h) is not Saved:
            return
        e = h.entry
        if self.deferred:
            self._compress_deferred()
        if self.held:
            self._check_writes()
        last = self.again
        if last is not None and last is not e:
            self.again = None
            if last.tensor is not None and last.refs > 0:
                self.parts.offload(last, self.offload[self.ordinal_of[last.uid]])
        k = self.ordinal_of.get(e.uid)
        if self.room is not None and k is not None:
            self._room(self.room.after_read.get(k))
        if k is not None and k in self.program.again:
            self.again = e
        prefetch = self.parts.prefetch
        if prefetch is None:
            return
        pos = self.program.read_at.get(k, -1) if k is not None else -1
        if pos <= self.read_pos:
            return
        self.read_pos = pos
        reads, entries = self.program.reads, self.entries
        i = max(self.next_prefetch, pos + 1)
        end = min(len(reads), pos + 1 + PREFETCH_WINDOW)
        while i < end:
            e = entries.get(reads[i])
            if e is not None and e.tensor is None and e.refs > 0 and not prefetch(e):
                break  # no room now: the next first read tries again from here
            i += 1
        self.next_prefetch = i
