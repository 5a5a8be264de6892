"""Replay a Plan on a Graph: step time, stalls and device memory per stage, and whether the plan is valid.
One concern, hence one module: the simulator every plan is judged by.

Three streams: one compute stream, and one copy stream per direction of the host link (h2d, d2h). A copy
occupies its direction exclusively; copies in one direction run FIFO in issue order, each for
``copy_time(nbytes)``. Opposite directions overlap each other and the compute stream. Where the cost model's
copies do not overlap (``copies_overlap`` False: the CPU, where a swap is a copy on the calling thread), each
copy runs on the compute stream where it is issued and the step pays all of it (``SimResult.copy_s``). A plan
that evicts anything is also charged the runtime's saved-tensor hooks where the model says the step waits for
them (``host_save_s``, :func:`host_time`: ``SimResult.host_s``), and every step what a measured model says a
step spends outside its ops (``SimResult.outside_s``).

Per stage ``t``, in this order (plan.py's timing rules, made exact):

1. ``swap_in`` actions are issued at the start of stage t: the device buffer is allocated at issue; the
   copy starts when the h2d stream is free *and* the tensor's swap-out has finished (its host copy exists).
2. ``recompute`` / ``decompress`` run on the compute stream, in list order. A recompute replays
   ``Graph.replay_stages``: the producer stage p, then the forward stages that wrote the tensor in place
   before t (``bn`` then ``relu_``), and first the stages that make the sources no plan holds by then (a
   forward temporary past its last read, traced back to what a plan can keep). It waits for those stages'
   inputs (stalling on in-flight swap-ins)
   and costs their op times. All ``recompute`` actions at stage t whose tensors share a producer are
   served by *one* replay of the union of their stages. While it runs, the largest workspace of those
   stages and all their other outputs count as transient bytes. A decompress holds both forms while it
   runs.
3. Op t waits for its inputs (stall = compute idle waiting on h2d copies), allocates its outputs, runs.
4. ``swap_out`` / ``compress`` / ``free`` after op t, in list order. A free (or a compress, which drops
   the full form) of a tensor whose swap-out is still in flight releases its bytes when the copy ends.
   A compress holds both forms while it runs, then ``ceil(nbytes * ratio)``.
5. Tensors whose natural lifetime ends at t (``freed_after == t``) release whatever they still hold.

Memory during stage t is the peak over these steps; deferred releases are applied as soon as the
compute-stream clock passes their time. With no actions this is exactly ``Graph.memory_profile()``.

Validation: each rule broken gives an :class:`~hybridmem.errors.InfeasiblePlanError` (stage, tensor,
reason). ``strict=True`` raises the first in execution order; ``strict=False`` records them all in
``SimResult.violations``; an invalid action is then skipped (its effects do not happen), and memory over
budget is recorded once per stage.

The step ends when all three streams are idle: ``time_s`` includes swap-outs still in flight after the
last op (a plan should not leave any).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .costs import (DEFAULT_DEVICE, DEVICES, CostModel, MeasuredCostModel, _canonical, copies_overlap,
                    get_cost_model)
from ..errors import InfeasiblePlanError, PlanFormatError, StalePlanError
from .plan import ACTION_KINDS
from .units import fmt_bytes, plan_budget_bytes

if TYPE_CHECKING:
    from .ir import Graph
    from .plan import Action, Plan

# residency states of a managed tensor
_ABSENT, _RESIDENT, _COMPRESSED, _EVICTED, _DEAD = range(5)
_REGEN = ("swap_in", "recompute", "decompress")


@dataclass
class SimResult:
    """What a replay predicts. Times in seconds, sizes in bytes; per-stage arrays have one entry per stage."""

    time_s: float                 # step time: all streams idle
    compute_s: float              # sum of the stages' op times
    recompute_s: float            # replays of producer stages and their in-place writers
    compress_s: float             # compress + decompress on the compute stream
    stall_s: float                # compute stream idle, waiting on swap-ins
    peak_bytes: int
    host_peak_bytes: int          # host memory held by swap-outs (host checkpoints)
    bytes_h2d: int
    bytes_d2h: int
    memory: np.ndarray            # int64: peak device bytes during each stage
    host_memory: np.ndarray       # int64: host checkpoint bytes during each stage
    stage_start: np.ndarray       # float64: compute-stream time when the stage starts (before regenerations)
    stage_end: np.ndarray         # float64: ... when its post-op actions are done
    violations: list[InfeasiblePlanError] = field(default_factory=list)
    device: str = DEFAULT_DEVICE  # cost model of copies and codecs (and of ops unless op_costs == "graph")
    op_costs: str = "model"       # "model": ops timed by the device model; "graph": Stage.cost_s
    solver: str = "keep-all"
    budget_bytes: int | None = None
    # what the peak counts: the graph's own account (``graph.meta["counted"]``, from capture) and the bytes of
    # each kind of tensor that exists before the step, which every stage holds (see :func:`counted_bytes`)
    counted: dict[str, Any] = field(default_factory=dict)
    copy_s: float = 0.0           # swaps copying on the compute stream (a cost model whose copies do not overlap)
    host_s: float = 0.0           # the runtime's saved-tensor hooks the step waits for (cost model's host_save_s)
    outside_s: float = 0.0        # what every step spends outside its ops (a measured cost model's outside_s)

    @property
    def overhead(self) -> float:
        """Slow-down against running the ops alone: ``(time_s - outside_s) / compute_s - 1`` (what a step spends
        outside its ops it spends whatever the plan)."""
        busy = self.time_s - self.outside_s
        if self.compute_s <= 0:
            return 0.0 if busy <= 0 else math.inf
        return busy / self.compute_s - 1.0

    @property
    def feasible(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly: arrays as lists, violations as {stage, tensor, reason}."""
        return {
            "time_s": self.time_s, "compute_s": self.compute_s, "recompute_s": self.recompute_s,
            "compress_s": self.compress_s, "stall_s": self.stall_s, "copy_s": self.copy_s, "host_s": self.host_s,
            "outside_s": self.outside_s, "overhead": self.overhead,
            "peak_bytes": self.peak_bytes, "host_peak_bytes": self.host_peak_bytes,
            "bytes_h2d": self.bytes_h2d, "bytes_d2h": self.bytes_d2h, "budget_bytes": self.budget_bytes,
            "device": self.device, "op_costs": self.op_costs, "solver": self.solver,
            "feasible": self.feasible,
            "memory": self.memory.tolist(), "host_memory": self.host_memory.tolist(),
            "stage_start": self.stage_start.tolist(), "stage_end": self.stage_end.tolist(),
            "violations": [{"stage": v.stage, "tensor": v.tensor, "reason": v.reason} for v in self.violations],
            "counted": self.counted,
        }


def simulate(graph: "Graph", plan: "Plan | None" = None, device: "str | CostModel | None" = DEFAULT_DEVICE,
             budget: int | str | None = None, *, use_graph_costs: bool = False, strict: bool = True,
             check_hash: bool = True) -> SimResult:
    """Replay ``plan`` (``None``: keep everything) on ``graph`` under ``device``'s cost model.

    ``device``: a name from ``hybridmem.graph.costs.DEVICES``, a cost model, ``"measured"`` (per-stage seconds in
    ``graph.meta["measured_cost_s"]``), or ``None``/``"graph"``: op times from ``Stage.cost_s`` and copies
    from the model named in ``graph.meta["cost_model"]`` (else ``h100-80gb``). ``use_graph_costs=True``
    also takes op times from ``Stage.cost_s``. ``budget``: bytes, ``"8GiB"`` or ``"60%"`` of the keep-all
    peak; ``None`` uses ``plan.budget_bytes`` (no check if that is unset too). ``check_hash``: refuse a plan
    whose ``graph_hash`` names another graph (costs a few ms on big graphs; the hash is skipped if the
    plan has none). The graph is assumed valid (``Graph.validate()``).
    """
    model, op_costs = _resolve_model(graph, device, use_graph_costs)
    if op_costs == "graph":
        op_s = [float(s.cost_s) for s in graph.stages]
    else:
        op_s = model.op_times(graph).tolist()
    if budget is None and plan is not None:
        budget = plan.budget_bytes
    budget_b = None if budget is None else plan_budget_bytes(budget, graph.peak_bytes())
    if plan is not None and check_hash and plan.graph_hash and plan.graph_hash != graph.structure_hash():
        raise StalePlanError(f"plan was made for graph {plan.graph_hash} but this graph is "
                             f"{graph.structure_hash()}: capture and plan again")
    actions = list(plan.actions) if plan is not None else []
    sim = _Replay(graph, actions, model, op_s, budget_b, strict)
    res = sim.run()
    if actions:
        res.host_s = host_time(graph, model)
    res.outside_s = float(getattr(model, "outside_s", 0.0) or 0.0)
    res.time_s += res.host_s + res.outside_s
    res.device, res.op_costs = model.name, op_costs
    res.solver = plan.solver if plan is not None else "keep-all"
    res.budget_bytes = budget_b
    res.counted = counted_bytes(graph, res.peak_bytes)
    return res


def host_time(graph: "Graph", model: Any) -> float:
    """Seconds the runtime's saved-tensor hooks add to a step that follows a plan on ``model``'s device: one
    pack and one unpack per save the capture counted (``meta["saves"]``; a graph from before it counted them:
    one per saved tensor), at ``model.host_save_s`` each. A plan that evicts nothing runs light packs: none."""
    per = float(getattr(model, "host_save_s", 0.0) or 0.0)
    if not per:
        return 0.0
    saves = graph.meta.get("saves")
    if not isinstance(saves, int):
        saves = sum(1 for t in graph.tensors if t.saved)
    return saves * per


# what each kind of tensor that exists before the step is called in ``counted``
_BEFORE_STEP = {"param": "parameters", "buffer": "buffers", "input": "inputs", "grad": "gradients before the step",
                "optimizer": "optimizer state", "state": "other tensors from before the step", "other": "other"}


def counted_bytes(graph: "Graph", peak: int) -> dict[str, Any]:
    """What a peak of ``graph`` counts: ``graph.meta["counted"]`` (capture's account: kernel scratch, gradients
    before the step, optimizer state and step, loss and outputs), plus ``bytes``: the bytes of each kind of
    tensor that exists before the step (held at every stage, whatever the plan) and ``made in the step``: the
    rest of the peak (activations, gradients made by backward, optimizer temporaries, kernel scratch)."""
    by_kind: dict[str, int] = {}
    for t in graph.tensors:
        if t.producer < 0:
            name = _BEFORE_STEP.get(t.kind, t.kind)
            by_kind[name] = by_kind.get(name, 0) + t.nbytes
    by_kind["made in the step"] = max(peak - sum(by_kind.values()), 0)
    out: dict[str, Any] = dict(graph.meta.get("counted") or {})
    if not out:
        out["note"] = "a graph captured before capture said what it counts (capture again for the account)"
    out["bytes"] = by_kind
    return out


def min_feasible_budget(graph: "Graph") -> int:
    """A lower bound on the budget of any feasible plan (not necessarily achievable).

    For each stage: every non-evictable tensor alive then (parameters, buffers, inputs, gradients, ...),
    plus the evictable inputs and outputs of the stage, plus its workspace: what must be on the device
    during the op even if everything else were evicted. The maximum over stages is returned. Real plans
    need more: recompute transients, swap-in buffers allocated ahead of use, copies still in flight.
    """
    n = graph.num_stages
    if n == 0:
        return graph.fixed_bytes()
    delta = np.zeros(n + 1, dtype=np.int64)
    for t in graph.tensors:
        if not t.evictable:
            delta[t.first_stage()] += t.nbytes
            delta[t.last_stage(n) + 1] -= t.nbytes
    need = np.cumsum(delta[:-1])
    tensors = graph.tensors
    for s in graph.stages:
        extra = sum(tensors[i].nbytes for i in set(s.inputs) | set(s.outputs) if tensors[i].evictable)
        need[s.index] += extra + s.workspace
    return int(need.max())


# ---- internals -------------------------------------------------------------------------------------
def _resolve_model(graph: "Graph", device: "str | CostModel | None", use_graph_costs: bool) -> tuple[Any, str]:
    if device is None or device == "graph":
        src = graph.meta.get("cost_model") or graph.meta.get("device")
        name = src if isinstance(src, str) and _canonical(src) in DEVICES else DEFAULT_DEVICE
        return get_cost_model(name), "graph"
    if device == "measured":
        model: Any = MeasuredCostModel.from_graph(graph)
    else:
        model = get_cost_model(device)
    return model, "graph" if use_graph_costs else "model"


class _TState:
    """Where one managed tensor (one with plan actions) is, and what it holds on the device."""

    __slots__ = ("n", "state", "held", "live", "arrival", "d2h_end", "host", "how", "codec", "ratio", "swapped_at")

    def __init__(self, nbytes: int) -> None:
        self.n = nbytes          # full size
        self.state = _ABSENT
        self.held = 0            # device bytes charged to it, including releases still pending
        self.live = 0            # bytes of its current device copy (full or compressed); 0 when evicted
        self.arrival = 0.0       # time its current copy is readable (swap-in end)
        self.d2h_end = -1.0      # end of its latest swap-out (host copy complete); < 0: none
        self.host = False        # a host copy exists
        self.how = ""            # how it left the device, for messages
        self.codec = ""
        self.ratio = 1.0
        self.swapped_at = -1     # stage of its latest swap-out


class _Replay:
    """One replay. The unmanaged tensors (no actions) are folded into per-stage numpy baselines; only the
    managed ones are followed event by event, so the cost is O(stages + actions + managed tensors)."""

    def __init__(self, graph: "Graph", actions: list["Action"], model: Any, op_s: list[float],
                 budget: int | None, strict: bool):
        self.g, self.model, self.op_s, self.budget, self.strict = graph, model, op_s, budget, strict
        n, m = graph.num_stages, len(graph.tensors)
        self.n = n
        tensors = graph.tensors
        # Python lists for element access in the loop (numpy scalar indexing is slow), arrays for bulk work.
        self.prod_l = [t.producer for t in tensors]
        self.last_l = [n - 1 if t.freed_after is None else t.freed_after for t in tensors]
        self.nb_l = [t.nbytes for t in tensors]
        self.prod = np.array(self.prod_l, dtype=np.int64)
        self.last = np.array(self.last_l, dtype=np.int64)
        self.nb = np.array(self.nb_l, dtype=np.int64)
        self.ws = [s.workspace for s in graph.stages]
        self.writers = graph.writers()  # tensor -> forward stages writing it in place (part of its replay)

        # Per-stage action lists, list order kept within each group (plan.py: "in list order").
        self.swap_ins: dict[int, list["Action"]] = {}
        self.pre: dict[int, list["Action"]] = {}
        self.post: dict[int, list["Action"]] = {}
        managed: set[int] = set()
        for a in actions:
            if a.kind not in ACTION_KINDS:
                raise PlanFormatError(f"action {a}: kind {a.kind!r} is not one of {ACTION_KINDS}")
            if not 0 <= a.stage < n or not 0 <= a.tensor < m:
                raise PlanFormatError(f"action {a}: stage must be in 0..{n - 1} and tensor in 0..{m - 1}")
            group = self.swap_ins if a.kind == "swap_in" else self.pre if a.kind in _REGEN else self.post
            group.setdefault(a.stage, []).append(a)
            if tensors[a.tensor].evictable:
                managed.add(a.tensor)
        self.managed = managed
        self.ts = {x: _TState(self.nb_l[x]) for x in managed}

        # Baselines of the unmanaged tensors: pre[t] = alive before op t (producer < t <= last),
        # new[t] = produced by op t. Managed tensors are added event by event on top.
        mask = np.ones(m, dtype=bool)
        if managed:
            mask[list(managed)] = False
        prod, last, nb = self.prod[mask], self.last[mask], self.nb[mask]
        delta = np.zeros(n + 2, dtype=np.int64)
        np.add.at(delta, prod + 1, nb)
        np.add.at(delta, last + 1, -nb)
        self.base_pre = np.cumsum(delta[:n]).tolist()
        new = np.zeros(n + 1, dtype=np.int64)
        np.add.at(new, prod + 1, nb)       # producer -1 lands in slot 0, which is not a stage: dropped below
        self.base_new = new[1:].tolist()
        self.unmanaged = mask

        # Managed events per stage: produced, read by the op, natural end, host-copy drop. Reads come from
        # the stages' input lists (the ground truth; TensorInfo.consumers is derived from them).
        self.m_out: dict[int, list[int]] = {}
        self.m_in: dict[int, list[int]] = {}
        self.m_end: dict[int, list[int]] = {}
        self.host_drop: dict[int, list[int]] = {}
        first_out: dict[int, int] = {}
        last_in: dict[int, int] = {}
        for a in actions:
            if a.kind == "swap_out":
                first_out[a.tensor] = min(first_out.get(a.tensor, a.stage), a.stage)
            elif a.kind == "swap_in":
                last_in[a.tensor] = max(last_in.get(a.tensor, a.stage), a.stage)
        if managed:
            for st in graph.stages:
                for x in dict.fromkeys(st.inputs):
                    if x in managed:
                        self.m_in.setdefault(st.index, []).append(x)
        for x in managed:
            t = tensors[x]
            end = self.last_l[x]
            self.m_out.setdefault(t.producer, []).append(x)
            self.m_end.setdefault(end, []).append(x)
            if x in first_out:
                # The host checkpoint is kept until its last swap-in (or the tensor's natural end).
                li = last_in.get(x, -1)
                drop = min(li if li >= first_out[x] else end, end)
                self.host_drop.setdefault(drop, []).append(x)

        # Running state.
        self.clock = 0.0
        self.h2d_free = 0.0
        self.d2h_free = 0.0
        self.mbytes = 0              # device bytes held by managed tensors (pending releases included)
        self.host_bytes = 0
        self.pending: list[tuple[float, int, int, int]] = []  # (time, seq, tensor, bytes) deferred releases
        self.seq = 0
        self.compute_s = self.recompute_s = self.compress_s = self.stall_s = self.copy_s = 0.0
        self.bytes_h2d = self.bytes_d2h = 0
        self.serial = not copies_overlap(model)
        self.violations: list[InfeasiblePlanError] = []
        self.t = 0
        self.stage_peak = 0
        self.host_peak = 0
        self.over_reported = False

    # ---- bookkeeping -------------------------------------------------------------------------------
    def fail(self, tensor: int | None, reason: str) -> None:
        err = InfeasiblePlanError(self.t, tensor, reason)
        if self.strict:
            raise err
        self.violations.append(err)

    def wait(self, ready: float) -> None:
        """The compute stream waits for a copy to land."""
        if ready > self.clock:
            self.stall_s += ready - self.clock
            self.clock = ready

    def release_due(self) -> None:
        pending = self.pending
        while pending and pending[0][0] <= self.clock:
            _, _, x, b = heapq.heappop(pending)
            self.mbytes -= b
            self.ts[x].held -= b

    def release(self, x: int, nbytes: int, not_before: float) -> None:
        """Drop ``nbytes`` of tensor x now, or when its copies in flight are done."""
        if not_before <= self.clock:
            self.mbytes -= nbytes
            self.ts[x].held -= nbytes
        else:
            self.seq += 1
            heapq.heappush(self.pending, (not_before, self.seq, x, nbytes))

    def alloc(self, x: int, nbytes: int) -> None:
        self.mbytes += nbytes
        self.ts[x].held += nbytes

    def check_mem(self, total: int, phase: str, what: str, transient: dict[int, int] | None = None) -> None:
        if total > self.stage_peak:
            self.stage_peak = total
        if self.budget is not None and total > self.budget and not self.over_reported:
            self.over_reported = True  # one report per stage is enough
            top = self.largest(phase, transient)
            listing = ", ".join(f"{self.label(x)} {fmt_bytes(b)}" for x, b in top)
            self.fail(top[0][0] if top else None,
                      f"device memory {fmt_bytes(total)} ({total} B) exceeds the budget {fmt_bytes(self.budget)} "
                      f"({self.budget} B) {what}; largest resident tensors: {listing}")

    def largest(self, phase: str, transient: dict[int, int] | None, k: int = 3) -> list[tuple[int, int]]:
        """The k largest tensors on the device now (only computed for a report)."""
        t = self.t
        alive = self.unmanaged & (self.last >= t) & ((self.prod < t) if phase == "pre" else (self.prod <= t))
        cand = {int(i): int(self.nb[i]) for i in np.flatnonzero(alive)}
        for x, s in self.ts.items():
            if s.held > 0:
                cand[x] = cand.get(x, 0) + s.held
        for x, b in (transient or {}).items():
            cand[x] = cand.get(x, 0) + b
        return sorted(cand.items(), key=lambda kv: -kv[1])[:k]

    def describe(self, x: int) -> str:
        """How tensor x came to be off the device (or unusable), for messages."""
        s = self.ts.get(x)
        t = self.g.tensors[x]
        if s is None:  # unmanaged
            if t.producer >= self.t:
                return f"not produced yet (producer stage {t.producer})"
            return f"freed at its natural end after stage {self.last_l[x]}"
        if s.state == _ABSENT:
            return f"not produced yet (producer stage {t.producer})"
        return s.how

    def label(self, x: int) -> str:
        name = self.g.tensors[x].name
        return f"tensor {x}" + (f" ({name})" if name else "")

    # ---- the replay ----------------------------------------------------------------------------------
    def run(self) -> SimResult:
        n = self.n
        memory: list[int] = []
        host_memory: list[int] = []
        start: list[float] = []
        end: list[float] = []
        op_s, ws, base_pre, base_new = self.op_s, self.ws, self.base_pre, self.base_new
        for t in range(n):
            self.t = t
            self.stage_peak = 0
            self.host_peak = self.host_bytes
            self.over_reported = False
            start.append(self.clock)
            self.release_due()
            # 1. swap-ins issued at the start of the stage
            for a in self.swap_ins.get(t, ()):
                self.swap_in(a)
            self.check_mem(base_pre[t] + self.mbytes, "pre", "at the start of the stage")
            # 2. recompute / decompress, in list order
            acts = self.pre.get(t)
            if acts:
                done: set[int] = set()
                for a in acts:
                    if a.kind == "recompute":
                        self.recompute(a, acts, done)
                    else:
                        self.decompress(a)
            # 3. the op
            for x in self.m_in.get(t, ()):
                s = self.ts[x]
                if s.state == _RESIDENT:
                    self.wait(s.arrival)
                else:
                    self.fail(x, f"stage {t} ({self.g.stages[t].id}) reads {self.label(x)}, which is not "
                                 f"resident: it was {self.describe(x)} and nothing regenerated it before stage {t}")
            self.release_due()
            for x in self.m_out.get(t, ()):
                s = self.ts[x]
                s.state, s.live, s.arrival = _RESIDENT, s.n, 0.0
                self.alloc(x, s.n)
            self.check_mem(base_pre[t] + base_new[t] + ws[t] + self.mbytes, "op", "during the op")
            self.clock += op_s[t]
            self.compute_s += op_s[t]
            # 4. evictions after the op, in list order
            self.release_due()
            for a in self.post.get(t, ()):
                getattr(self, a.kind)(a)
            # 5. natural ends
            for x in self.m_end.get(t, ()):
                self.natural_end(x)
            for x in self.host_drop.get(t, ()):
                s = self.ts[x]
                if s.host:
                    s.host = False
                    self.host_bytes -= s.n
            memory.append(self.stage_peak)
            host_memory.append(self.host_peak)
            end.append(self.clock)
        total = max(self.clock, self.h2d_free, self.d2h_free)
        mem, host = np.array(memory, dtype=np.int64), np.array(host_memory, dtype=np.int64)
        return SimResult(
            time_s=total, compute_s=self.compute_s, recompute_s=self.recompute_s, compress_s=self.compress_s,
            stall_s=self.stall_s, copy_s=self.copy_s, peak_bytes=int(mem.max()) if n else self.g.fixed_bytes(),
            host_peak_bytes=int(host.max()) if n else 0, bytes_h2d=self.bytes_h2d,
            bytes_d2h=self.bytes_d2h, memory=mem, host_memory=host,
            stage_start=np.array(start, dtype=np.float64), stage_end=np.array(end, dtype=np.float64),
            violations=self.violations)

    # ---- actions -------------------------------------------------------------------------------------
    def usable(self, a: "Action", regen: bool) -> bool:
        """Checks shared by all actions: evictable tensor, and no regeneration after its natural end."""
        t = self.g.tensors[a.tensor]
        if not t.evictable:
            self.fail(a.tensor, f"{a.kind} of {self.label(a.tensor)}, a {t.kind}"
                                f"{' that exists before the step' if t.producer < 0 else ''}: only "
                                "activations produced in the step may be evicted or regenerated")
            return False
        if regen and a.stage > self.last_l[a.tensor]:
            self.fail(a.tensor, f"{a.kind} of {self.label(a.tensor)} at stage {a.stage} is after its natural "
                                f"end (last used at stage {self.last_l[a.tensor]}): regeneration is pointless")
            return False
        return True

    def swap_in(self, a: "Action") -> None:
        if not self.usable(a, True):
            return
        x, s = a.tensor, self.ts[a.tensor]
        if not s.host:
            self.fail(x, f"swap_in of {self.label(x)} has no earlier swap_out: there is no host copy to read")
            return
        if s.state in (_RESIDENT, _COMPRESSED):
            self.fail(x, f"swap_in of {self.label(x)}, which is already on the device: redundant regeneration")
            return
        nbytes = s.n
        self.alloc(x, nbytes)                           # allocated at issue
        if self.serial:
            s.arrival = self.serial_copy(nbytes, "h2d", s.d2h_end)
        else:
            begin = max(self.clock, self.h2d_free, s.d2h_end)  # FIFO stream; the host copy must be complete
            s.arrival = self.h2d_free = begin + self.model.copy_time(nbytes, "h2d")
        s.state, s.live = _RESIDENT, nbytes
        self.bytes_h2d += nbytes

    def recompute(self, a: "Action", acts: list["Action"], done: set[int]) -> None:
        g = self.g
        p = g.tensors[a.tensor].producer
        if p in done:
            return  # served by the replay of p already run at this stage
        done.add(p)
        # Every recompute at this stage of an output of p is served by this one replay.
        group: list[int] = []
        for b in acts:
            if b.kind != "recompute" or g.tensors[b.tensor].producer != p or b.tensor in group:
                continue
            if not self.usable(b, True):
                continue
            x, s = b.tensor, self.ts[b.tensor]
            if s.state == _ABSENT:
                self.fail(x, f"recompute of {self.label(x)} at stage {self.t} before it is produced "
                             f"(producer stage {p})")
            elif s.state in (_RESIDENT, _COMPRESSED):
                self.fail(x, f"recompute of {self.label(x)}, which is already on the device: redundant "
                             "regeneration" + (" (decompress it instead)" if s.state == _COMPRESSED else ""))
            else:
                group.append(x)
        if not group:
            return
        # One replay serves the group: the producer, then every writer of a member before this stage.
        order = sorted({r for x in group for r in g.replay_stages(x, self.t, writers=self.writers)})
        what = ", ".join(f"{r} ({g.stages[r].op})" for r in order)
        for r in order:
            if not g.stages[r].deterministic:
                self.fail(group[0], f"recompute of {self.label(group[0])} replays stage {r} ({g.stages[r].op}), "
                                    "which is not deterministic: swap it instead")
                return
        # The replayed stages' inputs must be on the device now, except what the replay itself makes.
        made = set(group)
        for r in order:
            made.update(g.stages[r].outputs)
        ready = self.clock
        for r in order:
            for u in dict.fromkeys(g.stages[r].inputs):
                if u in made:
                    continue
                s = self.ts.get(u)
                if s is None:
                    if self.prod_l[u] < self.t <= self.last_l[u]:
                        continue
                elif s.state == _RESIDENT:
                    ready = max(ready, s.arrival)
                    continue
                by = f" (read by stage {r}, {g.stages[r].op})" if len(order) > 1 else ""
                self.fail(group[0], f"recompute of {self.label(group[0])} replays stage"
                                    f"{'s' if len(order) > 1 else ''} {what}, whose input {self.label(u)}{by} "
                                    f"is not resident: it was {self.describe(u)} and nothing regenerated it "
                                    f"before stage {self.t}")
                return
        self.wait(ready)
        self.release_due()
        # Transients during the replay: the largest workspace and the outputs that are not being regenerated.
        transient = {y: self.nb_l[y] for r in order for y in g.stages[r].outputs if y not in group}
        for x in group:
            s = self.ts[x]
            s.state, s.live, s.arrival = _RESIDENT, s.n, 0.0
            self.alloc(x, s.n)
        self.check_mem(self.base_pre[self.t] + self.mbytes + sum(transient.values())
                       + max(self.ws[r] for r in order), "pre",
                       f"while recomputing {self.label(group[0])} (replay of stage{'s' if len(order) > 1 else ''} "
                       f"{', '.join(map(str, order))})", transient)
        dt = math.fsum(self.op_s[r] for r in order)
        self.clock += dt
        self.recompute_s += dt

    def decompress(self, a: "Action") -> None:
        if not self.usable(a, True):
            return
        x, s = a.tensor, self.ts[a.tensor]
        if s.state != _COMPRESSED:
            what = ("already resident: redundant" if s.state == _RESIDENT
                    else f"not compressed: it was {self.describe(x)}")
            self.fail(x, f"decompress of {self.label(x)}, which is {what}")
            return
        nbytes = s.n
        self.release_due()
        self.alloc(x, nbytes)
        self.check_mem(self.base_pre[self.t] + self.mbytes, "pre", f"while decompressing {self.label(x)}")
        dt = self.model.decompress_time(nbytes, s.codec, s.ratio)
        self.clock += dt
        self.compress_s += dt
        self.release(x, s.live, self.clock)
        s.state, s.live, s.arrival = _RESIDENT, nbytes, self.clock

    def _resident_or_fail(self, a: "Action", allow_compressed: bool) -> bool:
        if not self.usable(a, False):
            return False
        x, s = a.tensor, self.ts[a.tensor]
        if s.state == _RESIDENT or (allow_compressed and s.state == _COMPRESSED):
            return True
        self.fail(x, f"{a.kind} of {self.label(x)} at stage {self.t}, which is not resident: it was "
                     f"{self.describe(x)}")
        return False

    def swap_out(self, a: "Action") -> None:
        if not self._resident_or_fail(a, False):
            return
        s = self.ts[a.tensor]
        nbytes = s.n
        if self.serial:
            s.d2h_end = self.serial_copy(nbytes, "d2h", s.arrival)
        else:
            begin = max(self.clock, self.d2h_free, s.arrival)  # FIFO stream; the data must have landed
            s.d2h_end = self.d2h_free = begin + self.model.copy_time(nbytes, "d2h")
        s.swapped_at = self.t
        self.bytes_d2h += nbytes
        if not s.host:
            s.host = True
            self.host_bytes += nbytes
            self.host_peak = max(self.host_peak, self.host_bytes)

    def serial_copy(self, nbytes: int, direction: str, ready: float) -> float:
        """A copy on the compute stream (``copies_overlap`` False): it starts once ``ready`` and the stream
        are, and the stream runs it; return when it ends."""
        self.wait(ready)
        dt = self.model.copy_time(nbytes, direction)
        self.clock += dt
        self.copy_s += dt
        return self.clock

    def compress(self, a: "Action") -> None:
        if not self._resident_or_fail(a, False):
            return
        x, s = a.tensor, self.ts[a.tensor]
        self.wait(s.arrival)
        self.release_due()
        nbytes = s.n
        small = math.ceil(nbytes * a.ratio)
        self.alloc(x, small)  # both forms exist while the codec runs
        self.check_mem(self.base_pre[self.t] + self.base_new[self.t] + self.mbytes, "op",
                       f"while compressing {self.label(x)} after the op")
        dt = self.model.compress_time(nbytes, a.codec, a.ratio)
        self.clock += dt
        self.compress_s += dt
        self.release(x, s.live, max(self.clock, s.d2h_end))
        s.state, s.live, s.codec, s.ratio = _COMPRESSED, small, a.codec, a.ratio
        s.how = f"compressed after stage {self.t} ({a.codec or 'unnamed codec'}, ratio {a.ratio:g})"

    def free(self, a: "Action") -> None:
        if not self._resident_or_fail(a, True):
            return
        x, s = a.tensor, self.ts[a.tensor]
        self.release(x, s.live, max(self.clock, s.d2h_end, s.arrival))
        s.state, s.live = _EVICTED, 0
        s.how = f"freed after stage {self.t}" + (f" (swapped out at stage {s.swapped_at})" if s.host else "")

    def natural_end(self, x: int) -> None:
        s = self.ts[x]
        if s.state in (_RESIDENT, _COMPRESSED):
            self.release(x, s.live, max(self.clock, s.d2h_end, s.arrival))
        s.state, s.live = _DEAD, 0
        s.how = f"freed at its natural end after stage {self.t}"
