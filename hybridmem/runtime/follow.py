"""Follow an offline plan: run its actions at its stages, and stop where reality departs from it.

A plan names graph tensors and stages. The runtime knows ops as they run, so a plan carries a small
runtime annotation made with it (:mod:`hybridmem.graph.signature`): per action tensor its producer stage
and output index (and size), the number of ops per stage, and the step's *op signature*.

- Step 1 runs under the online scorer and records the stage ops and their outputs' sizes; at its end
  the signature and the sizes of the plan's tensors are compared: a difference (another model, other
  input shapes) refuses the plan (:class:`~hybridmem.errors.StalePlanError`, raised from ``backward()``
  once the step's gradients are complete; caught, training goes on with the online scorer). From step 2 the plan's actions run at their stages (timing rules in
  :mod:`hybridmem.graph.plan`): ``recompute``/``decompress`` before op t regenerate at once, ``swap_in``
  starts a prefetch; after op t ``compress`` evicts by compress, ``swap_out`` marks a swap and
  ``free`` evicts (by swap after a ``swap_out``, else by recompute).
- Each stage op is checked against step 1's; at the first mismatch the plan is left for the rest of
  the run (``Stats.plan == "diverged"`` and ``plan_note`` says where), and the online scorer, which
  always enforces the budget, carries on alone.
"""
from __future__ import annotations

from typing import Any

from ..errors import PlanFormatError, StalePlanError
from ..graph.plan import Plan
from ..graph.signature import annotate, graph_signature, op_signature, step_stages  # noqa: F401  (old path)
from .opfacts import op_name
from .parts import FollowerRuntime

_BEFORE = ("recompute", "decompress", "swap_in")


class PlanFollower:
    """Executes one plan's actions at runtime stages; see the module docstring."""

    def __init__(self, plan: Plan, rt: FollowerRuntime):
        ann = plan.info.runtime
        if plan.actions and not isinstance(ann, dict):
            raise PlanFormatError(
                "this plan has no runtime annotation (plan.info['runtime']): make it with `hybridmem plan` / "
                "hybridmem.plan(), or call hybridmem.runtime.follow.annotate(plan, graph) with the graph it was "
                "made for")
        ann = ann or {"signature": "", "stages": 0, "tensors": {}}
        self.rt = rt
        self.plan = plan
        self.signature: str = ann.get("signature", "")
        self.groups: list[int] | None = ann.get("ops_per_stage")
        self.where: dict[int, tuple[int, int, int]] = {int(k): tuple(v) for k, v in ann.get("tensors", {}).items()}
        # op-level stage -> actions; a merged stage's "before" runs before its first op, "after" after its last
        starts, ends = self._bounds()
        self.regen_at: dict[int, list[Any]] = {}
        self.evict_at: dict[int, list[Any]] = {}
        for a in plan.sorted_actions():
            if a.stage >= len(starts):
                continue
            if a.kind in _BEFORE:
                self.regen_at.setdefault(starts[a.stage], []).append(a)
            else:
                self.evict_at.setdefault(ends[a.stage], []).append(a)
        self.state = "pending"        # pending (step 1: verifying) -> following | diverged | refused
        self.expected: list[str] = []              # op names of step 1's stages
        self.seen: list[str] = []
        self.outputs: list[list[Any]] = []         # per stage of this step: produced slots, in order
        self.sizes: list[list[int]] = []           # step 1 only: their bytes (checked against the plan's)
        self.swapping: set[int] = set()            # tensors with a swap_out this step: their frees swap
        self.entries: dict[int, Any] = {}          # plan tensor -> its saved-tensor entry this step
        self.pending: list[tuple[Any, Any]] = []   # (entry, policy) evictions waiting for sole ownership
        self.unsaved: list[tuple[Any, str, int]] = []  # (slot, policy name, tensor): evictions waiting for the pack
        # lineage nodes of what this step's plan actions evicted by recompute: a steady-state step has the
        # allocator free those first (runtime.steady_control, SteadyControl._finish_program)
        self.recomputed: set[Any] = set()

    def _bounds(self) -> tuple[list[int], list[int]]:
        if self.groups is None:
            n = max([a.stage for a in self.plan.actions] + [-1]) + 1
            return list(range(n)), list(range(n))
        starts, ends, i = [], [], 0
        for n in self.groups:
            starts.append(i)
            ends.append(i + n - 1)
            i += n
        return starts, ends

    # ---- step boundaries -----------------------------------------------------------------------
    def step_started(self) -> None:
        self.seen = []
        self.outputs = []
        self.sizes = []
        self.swapping.clear()
        self.entries.clear()
        self.pending = []
        self.unsaved = []
        self.recomputed = set()

    def step_ended(self, stages: int) -> None:
        if self.state == "pending":
            self._verify()
        elif self.state == "following" and len(self.seen) != len(self.expected):
            self._diverge(f"the step had {len(self.seen)} stage ops, the plan's {len(self.expected)}")

    def _verify(self) -> None:
        sig = op_signature(self.seen, self.groups)
        if self.signature and sig != self.signature:
            self._refuse(f"op signature {sig} != plan's {self.signature}",
                         f"the plan was made for a different step: its op signature is {self.signature}, this "
                         f"run's first step gives {sig} ({len(self.seen)} stage ops). The model, its input "
                         "shapes, the torch version or the code around the model changed")
        wrong = self._wrong_size()
        if wrong is not None:
            tensor, planned, got = wrong
            self._refuse(f"tensor {tensor}: {got} bytes in this run, {planned} in the plan",
                         f"the plan was made for a different step: the same ops, but other input shapes (plan "
                         f"tensor {tensor} has {planned} bytes in the plan, {got} in this run's first step)")
        self.expected = list(self.seen)
        self.state = "following"
        self.sizes = []
        self.rt.stats.plan, self.rt.stats.plan_note = "following", f"verified on step 1 ({len(self.seen)} stage ops)"

    def _wrong_size(self) -> tuple[int, int, int] | None:
        """The first plan tensor whose size in step 1 differs from the plan's: (tensor, plan's, run's)."""
        for tensor, (p, k, nbytes) in sorted(self.where.items()):
            if p < len(self.sizes) and k < len(self.sizes[p]) and self.sizes[p][k] != nbytes:
                return tensor, nbytes, self.sizes[p][k]
        return None

    def _refuse(self, note: str, why: str) -> None:
        self.state = "refused"
        self.sizes = []
        self.rt.stats.plan, self.rt.stats.plan_note = "refused", note
        raise StalePlanError(
            f"{why}. The plan is refused and not used from here. This is raised from backward() at the end of "
            "the first step, which ran under the online scorer: that step's gradients are complete. If you "
            "catch it, training goes on with the online scorer alone keeping the budget. To follow a plan, "
            "capture and plan again for this step (hybridmem capture / plan), or give a plan book folder with "
            "one plan per input shape (hybridmem plan --shapes ...).")

    def _diverge(self, why: str) -> None:
        self.state = "diverged"
        self.rt.stats.plan, self.rt.stats.plan_note = "diverged", why

    # ---- per op ----------------------------------------------------------------------------------
    def before(self, stage: int, func: Any) -> None:
        name = op_name(func)
        self.seen.append(name)
        self.outputs.append([])
        if self.state != "following":
            if self.state == "pending":
                self.sizes.append([])
            return
        if self.unsaved:
            self._saved_late()
        if self.pending:
            self._flush()
        exp = self.expected[stage] if stage < len(self.expected) else "nothing"
        if exp != name:
            self._diverge(f"stage {stage}: the plan expects {exp}, the program ran {name}")
            return
        for a in self.regen_at.get(stage, ()):
            self._regenerate(a)

    def after(self, stage: int, func: Any, fresh: list[tuple[int, Any, Any]]) -> None:
        if self.outputs:
            self.outputs[-1].extend(slot for _, slot, _ in fresh)
        if self.state != "following":
            if self.state == "pending" and self.sizes:
                self.sizes[-1].extend(_nbytes(t) for _, _, t in fresh)
            return
        for a in self.evict_at.get(stage, ()):
            self._evict(a)

    def after_other(self, fresh: list[tuple[int, Any, Any]]) -> None:
        """A non-stage op allocated: its storages belong to the last stage (as in capture)."""
        if self.outputs and fresh and self.rt.steps.phase != 0:
            self.outputs[-1].extend(slot for _, slot, _ in fresh)
            if self.state == "pending" and self.sizes:
                self.sizes[-1].extend(_nbytes(t) for _, _, t in fresh)

    # ---- actions ---------------------------------------------------------------------------------
    def _slot(self, tensor: int) -> Any:
        where = self.where.get(tensor)
        if where is None:
            return None
        p, k, nbytes = where
        if p >= len(self.outputs) or k >= len(self.outputs[p]):
            self._diverge(f"tensor {tensor}: stage {p} has no output {k} in this run")
            return None
        slot = self.outputs[p][k]
        st = slot()
        if st is not None and st.nbytes() != nbytes and not _freed_by_allocator(st, slot):
            self._diverge(f"tensor {tensor}: {st.nbytes()} bytes in this run, {nbytes} in the plan")
            return None
        return slot

    def _entry(self, tensor: int) -> Any:
        """The saved-tensor entry of a plan tensor in this step, resident or not (None: not saved)."""
        slot = self._slot(tensor)
        if slot is None:
            return None
        if slot() is not None:
            e = slot.entry
            if e is not None:
                self.entries[tensor] = e
            return e
        # The produced storage is gone: evicted (its slot forgot the entry when the bytes went) and
        # maybe regenerated since into a new storage; the entry is the one the plan's eviction met.
        return self.entries.get(tensor) or slot.last_entry

    def _evict(self, a: Any) -> None:
        if a.kind == "swap_out":
            self.swapping.add(a.tensor)
            return
        name = "compress" if a.kind == "compress" else "swap" if a.tensor in self.swapping else "recompute"
        slot = self._slot(a.tensor)
        if slot is None:
            return  # not a produced storage in this run
        e = self._entry(a.tensor)
        if e is None and slot() is not None:
            # Not packed yet: autograd saves an op's outputs (relu's, a clone under an in-place op)
            # after the dispatch returns, so after this hook. Evict once the pack has happened.
            self.unsaved.append((slot, name, a.tensor))
            return
        if e is not None:
            self._evict_entry(e, name, a.tensor)  # also a second eviction, after a regeneration

    def _evict_entry(self, e: Any, name: str, tensor: int) -> None:
        self.entries[tensor] = e
        if e.tensor is None:
            return  # already evicted
        policy = self.rt.policies.get(name)
        if policy is None or not policy.applicable(e):
            self.rt.stats.note(f"plan: {name} not applicable to tensor {tensor}; left to the online scorer")
            return
        if name == "recompute" and e.lineage is not None:
            self.recomputed.add(e.lineage)
        self.pending.append((e, policy))
        self._flush()

    def _saved_late(self) -> None:
        """Evictions of tensors that were not packed at their action: those packed since then go
        ahead; those still unpacked wait (a storage that died was never saved: nothing to do)."""
        waiting = []
        for slot, name, tensor in self.unsaved:
            if slot() is None:
                continue
            if slot.entry is None:
                waiting.append((slot, name, tensor))
            else:
                self._evict_entry(slot.entry, name, tensor)
        self.unsaved = waiting

    def _flush(self) -> None:
        """Evict what the plan asked for once only the runtime holds it: right after the op that
        last reads it, the program's own variable usually still does (until its next statement)."""
        keep = []
        store = self.rt.store
        for e, policy in self.pending:
            if e.tensor is None or e.refs == 0:
                continue
            if store.sole_owner(e) and not e.pinned:
                self.rt.residency.evict(e, policy)
            else:
                keep.append((e, policy))
        self.pending = keep

    def _regenerate(self, a: Any) -> None:
        e = self._entry(a.tensor)
        if e is None or e.tensor is not None or e.policy is None:
            return
        if a.kind == "swap_in" and self.rt.device.type == "cuda":
            self.rt.residency.prefetch([e])  # the copy starts now on its stream; the read waits for it
        else:
            self.rt.residency.ensure(e)


def _freed_by_allocator(st: Any, slot: Any) -> bool:
    """Whether a storage reads 0 bytes because the allocator freed its registered entry at an allocation
    (evicted by recompute before the plan's action for it came): not a different step."""
    e = slot.entry
    return st.nbytes() == 0 and e is not None and e.registered


def _nbytes(t: Any) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, AttributeError):
        return -1

