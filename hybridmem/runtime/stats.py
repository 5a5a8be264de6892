"""What the runtime measured: memory, evictions and regenerations per policy, plan following, and one record
per evicted tensor.

:class:`Stats` is an immutable snapshot (``hybridmem.stats()``); :class:`StatsRecorder` is the mutable
ledger the runtime writes into on the hot path (plain attribute increments, no locking: the runtime
runs on the training thread and the autograd engine thread, never both at once); :class:`TensorLog` its
per-tensor records.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..graph.units import fmt_bytes
from ..report import build_report


@dataclass
class PolicyStats:
    """Counts and bytes one policy evicted and regenerated, and the time it cost."""

    evicted: int = 0
    evicted_bytes: int = 0
    regenerated: int = 0
    regenerated_bytes: int = 0
    regen_seconds: float = 0.0   # wall time inside the policy's regenerate()
    stall_seconds: float = 0.0   # wall time the training thread waited for a regenerated tensor


@dataclass(frozen=True)
class Stats:
    """A snapshot of the runtime's measurements since ``enable()`` or the last ``reset_stats()``.

    Bytes are device bytes: the CUDA allocator's on CUDA, the meter's simulated device on the CPU.
    ``min_budget_bytes`` is a lower bound on any budget that can work for the steps seen: the largest
    amount that had to be resident at one op (non-evictable bytes plus the op's new outputs).
    """

    device: str
    budget_bytes: int | None
    peak_bytes: int
    current_bytes: int
    policies: dict[str, PolicyStats]
    steps: int = 0                      # forward+backward passes completed
    stages_last_step: int = 0           # stage ops counted in the last completed step
    saved_bytes: int = 0                # unique activation bytes saved for backward by the last step
    saved_tensors: int = 0              # ... and how many storages
    min_budget_bytes: int = 0           # lower bound (see class docstring)
    cap_overruns: int = 0               # ops after which live bytes exceeded the budget (bad estimate)
    plan: str = "none"                  # "none", "following", "diverged", "refused"
    plan_note: str = ""                 # why the plan was left (stage, expected vs seen op)
    notes: tuple[str, ...] = ()         # other one-line facts worth knowing (e.g. lineage refused)
    steady_steps: int = 0               # steps run without the dispatch mode (hybridmem.runtime.program)
    optimizer_steps: int = 0            # training steps as the user counts them: optimizer steps after a backward
    programs: int = 0                   # step programs recorded (one per input shape: runtime.programs)
    step_seconds: float | None = None   # mean wall time of the completed steps (forward + backward)
    tensors: tuple[dict[str, Any], ...] = ()  # evictions, one record each (TensorLog)

    @property
    def evicted_bytes(self) -> int:
        return sum(p.evicted_bytes for p in self.policies.values())

    @property
    def regenerated_bytes(self) -> int:
        return sum(p.regenerated_bytes for p in self.policies.values())

    @property
    def stall_seconds(self) -> float:
        return sum(p.stall_seconds for p in self.policies.values())

    @property
    def regen_seconds(self) -> float:
        return sum(p.regen_seconds for p in self.policies.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d

    def report(self, plan: Any = None, graph: Any = None, device: Any = None, **kwargs: Any) -> Any:
        """The decision report (:func:`hybridmem.report.build_report`); give the plan and its graph for
        the per-tensor table and the simulator's predictions."""
        return build_report(self, plan, graph, device, **kwargs)

    def __str__(self) -> str:
        budget = "monitor only" if self.budget_bytes is None else fmt_bytes(self.budget_bytes)
        lines = [f"hybridmem on {self.device}: peak {fmt_bytes(self.peak_bytes)}, budget {budget}, "
                 f"now {fmt_bytes(self.current_bytes)}, {self.steps_text()}, "
                 f"saved activations {fmt_bytes(self.saved_bytes)}"]
        for name, p in self.policies.items():
            lines.append(f"  {name:10s} evicted {p.evicted} ({fmt_bytes(p.evicted_bytes)}), regenerated "
                         f"{p.regenerated} ({fmt_bytes(p.regenerated_bytes)}) in {p.regen_seconds * 1e3:.1f} ms, "
                         f"stall {p.stall_seconds * 1e3:.1f} ms")
        if self.plan != "none":
            lines.append(f"  plan: {self.plan}" + (f" ({self.plan_note})" if self.plan_note else ""))
        if self.budget_bytes is not None:
            lines.append(f"  {self.steady_summary()}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def steps_text(self) -> str:
        """``N step(s)``, and where optimizers stepped otherwise than once a backward pass (accumulation), that
        they are backward passes and how many training steps they made."""
        per = (f" (backward passes; {self.optimizer_steps} optimizer step(s))"
               if self.optimizer_steps and self.optimizer_steps != self.steps else "")
        return f"{self.steps} step(s){per}"

    def steady_summary(self) -> str:
        """One line: the steady state's reach, over backward passes and the training steps they made."""
        programs = (f"; {self.programs} program(s) recorded (one per input shape, each in one pass under the "
                    "dispatch mode)" if self.programs > 1 else "")
        return (f"steady state: {self.steady_steps} of {self.steps_text()} without per-op work"
                f"{programs} (docs/reference.md, \"Steady state\")")


@dataclass
class StatsRecorder:
    """The runtime's mutable ledger; :meth:`snapshot` freezes it into :class:`Stats`."""

    policies: dict[str, PolicyStats] = field(default_factory=dict)
    steps: int = 0
    stages_last_step: int = 0
    saved_bytes_step: int = 0           # accumulating during the current step
    saved_tensors_step: int = 0
    saved_bytes: int = 0                # of the last completed step
    saved_tensors: int = 0
    min_budget_bytes: int = 0
    cap_overruns: int = 0
    steady_steps: int = 0
    optimizer_steps: int = 0
    programs: int = 0
    _opt_at: int = 0                    # backward passes counted when an optimizer last stepped
    plan: str = "none"
    plan_note: str = ""
    notes: list[str] = field(default_factory=list)
    tensor_log: "TensorLog | None" = None  # per evicted tensor (bounded), or none kept
    step_time: float = 0.0              # wall seconds of the completed steps
    step_t0: float | None = None

    def policy(self, name: str) -> PolicyStats:
        p = self.policies.get(name)
        if p is None:
            p = self.policies[name] = PolicyStats()
        return p

    def evicted(self, name: str, entry: Any) -> None:
        """Policy ``name`` evicted ``entry`` (a saved tensor's ``Entry``)."""
        p = self.policy(name)
        p.evicted += 1
        p.evicted_bytes += entry.nbytes
        if self.tensor_log is not None:
            self.tensor_log.evicted(entry, name)

    def regenerated(self, name: str, entry: Any, regen_s: float, stall_s: float, logged: bool = True) -> None:
        """``entry`` came back by ``name`` in ``regen_s`` seconds, the step waiting ``stall_s``; ``logged``: its
        record takes the times (False for a tensor rebuilt on the way of another's regeneration)."""
        p = self.policy(name)
        p.regenerated += 1
        p.regenerated_bytes += entry.nbytes
        p.regen_seconds += regen_s
        p.stall_seconds += stall_s
        if logged and self.tensor_log is not None:
            self.tensor_log.regenerated(entry, regen_s, stall_s)

    def saved(self, nbytes: int) -> None:
        self.saved_bytes_step += nbytes
        self.saved_tensors_step += 1

    def optimizer_stepped(self) -> None:
        """An optimizer stepped: one training step where backward passes ran since the last one (several
        optimizers, or several steps of one, after the same backward count once)."""
        if self.steps > self._opt_at:
            self.optimizer_steps += 1
            self._opt_at = self.steps

    def step_started(self) -> None:
        self.step_t0 = time.perf_counter()

    def step_done(self, stages: int) -> None:
        if self.step_t0 is not None:
            self.step_time += time.perf_counter() - self.step_t0
            self.step_t0 = None
        self.steps += 1
        self.stages_last_step = stages
        self.saved_bytes, self.saved_tensors = self.saved_bytes_step, self.saved_tensors_step
        self.saved_bytes_step = self.saved_tensors_step = 0

    def note(self, text: str) -> None:
        if text not in self.notes and len(self.notes) < 32:
            self.notes.append(text)

    def reset(self) -> None:
        """Forget counts (``reset_stats``); the plan state and the minimum-budget bound are kept."""
        self.policies = {k: PolicyStats() for k in self.policies}
        self.steps = 0
        self.cap_overruns = 0
        self.steady_steps = 0
        self.optimizer_steps = self._opt_at = 0
        self.step_time = 0.0
        if self.tensor_log is not None:
            self.tensor_log.clear()

    def snapshot(self, *, device: str, budget: int | None, peak: int, current: int) -> Stats:
        return Stats(device=device, budget_bytes=budget, peak_bytes=peak, current_bytes=current,
                     policies={k: replace(v) for k, v in self.policies.items()}, steps=self.steps,
                     stages_last_step=self.stages_last_step, saved_bytes=self.saved_bytes,
                     saved_tensors=self.saved_tensors, min_budget_bytes=self.min_budget_bytes,
                     cap_overruns=self.cap_overruns, steady_steps=self.steady_steps,
                     optimizer_steps=self.optimizer_steps, programs=self.programs, plan=self.plan, plan_note=self.plan_note,
                     notes=tuple(self.notes),
                     step_seconds=self.step_time / self.steps if self.steps else None,
                     tensors=self.tensor_log.records() if self.tensor_log is not None else ())


class TensorLog:
    """The runtime's decision ledger, bounded: one record per eviction of a saved storage (what, when, by which
    policy, what bringing it back cost). :meth:`StatsRecorder.evicted` and :meth:`StatsRecorder.regenerated`
    write it; the snapshot carries :meth:`records` as ``Stats.tensors`` (:func:`hybridmem.report.build_report`
    reads them). Entries are matched by ``entry.uid``; only the last ``limit`` evictions are kept, so a long run
    costs bounded memory."""

    def __init__(self, limit: int = 4096):
        self._open: dict[int, dict[str, Any]] = {}
        self._done: Any = deque(maxlen=limit)

    def evicted(self, entry: Any, policy: str, stage: int = -1) -> None:
        rec = {"uid": entry.uid, "stage": int(getattr(entry, "stage", -1)), "evicted_at": stage,
               "op": getattr(entry, "origin", ""), "nbytes": int(entry.nbytes), "decision": policy,
               "regen_s": None, "stall_s": None}
        if len(self._done) == self._done.maxlen:  # the oldest record drops out: stop updating it
            old = self._done[0]
            if self._open.get(old["uid"]) is old:
                del self._open[old["uid"]]
        self._open[entry.uid] = rec
        self._done.append(rec)

    def regenerated(self, entry: Any, regen_s: float, stall_s: float) -> None:
        rec = self._open.pop(entry.uid, None)
        if rec is not None:
            rec["regen_s"] = (rec["regen_s"] or 0.0) + regen_s
            rec["stall_s"] = (rec["stall_s"] or 0.0) + stall_s

    def records(self) -> tuple[dict[str, Any], ...]:
        return tuple({k: v for k, v in r.items() if k != "uid"} for r in self._done)

    def clear(self) -> None:
        self._open.clear()
        self._done.clear()
