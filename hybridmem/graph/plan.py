"""Plan: which tensors to evict, by which policy, and when to regenerate them.

A plan is a list of *actions* on a Graph's tensors, each tied to a stage. Timing rules (the simulator
and the runtime both follow them):

- ``recompute`` and ``decompress`` at stage t run on the compute stream *before* op t, in list order.
  ``recompute`` replays the tensor's producer stage; that stage's inputs must be resident then.
- ``swap_in`` at stage t is issued at the start of stage t on the host-to-device stream; the device
  buffer is allocated at issue; a reader stalls until the copy is done. It needs an earlier ``swap_out``
  of the same tensor (the *host checkpoint*); several swap-ins may follow one swap-out.
- ``swap_out`` at stage t is issued after op t on the device-to-host stream; the tensor must be resident.
- ``compress`` at stage t runs after op t on the compute stream and replaces the device bytes by
  ``nbytes * ratio``.
- ``free`` at stage t drops the device copy after op t (deferred until an in-flight swap-out ends).

A tensor with no actions follows its natural lifetime (Graph memory model). Regeneration after the
tensor's natural end is pointless and rejected by validation.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, MutableMapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import PlanFormatError, StalePlanError
from .ir import _build, load_mapping, save_mapping

if TYPE_CHECKING:
    from .ir import Graph

PLAN_SCHEMA_VERSION = 1
ACTION_KINDS = ("swap_out", "swap_in", "recompute", "compress", "decompress", "free")
# Which policy an action's tensor is charged to in summaries.
POLICY_OF = {"swap_out": "swap", "swap_in": "swap", "recompute": "recompute",
             "compress": "compress", "decompress": "compress"}


@dataclass(frozen=True)
class Action:
    kind: str          # one of ACTION_KINDS
    tensor: int        # Graph tensor id
    stage: int         # Graph stage index (see the timing rules above)
    codec: str = ""    # compress/decompress: codec name
    ratio: float = 1.0  # compress: compressed bytes / original bytes


@dataclass(eq=False)
class PlanInfo(MutableMapping):
    """What a planner says about its plan, typed: ``plan.info.plan_from``, ``plan.info.lower_bound_s``.

    Every field is optional (None: not reported). It also reads and writes like the mapping it replaces
    (``info["gap"]``, ``info.get(...)``, ``dict(info)``) over the fields that were set, in the order they
    were set, which is how a plan file writes them; a name that is not a field is refused with the list
    of names accepted, so a misspelt key fails where it is written, and a plan file with a key this
    version does not know fails to load with that list."""

    # -- the entry point (solvers.plan), on every plan: its simulation, the valid bound, timing
    solve_s: float | None = None                # wall seconds of the whole planning call
    compute_s: float | None = None              # the step's compute time (nothing regenerated, no stall)
    overhead: float | None = None               # predicted step time / compute_s - 1
    stall_s: float | None = None                # predicted seconds the compute stream waits for copies
    copies: str | None = None                   # where swaps copy on the compute stream: how the plan chose
    lower_bound_s: float | None = None          # valid bound on any swap/recompute plan's step time
    lower_bound_kind: str | None = None         # which bound gives it: "compute" or "swap/recompute"
    gap_to_lower_bound: float | None = None     # predicted time / lower_bound_s - 1
    gap: float | None = None                    # predicted time / lp_bound_s - 1 (within the STR model)
    note: str | None = None                     # e.g. why nothing was evicted
    runtime: dict[str, Any] | None = None       # what the runtime needs to follow the plan (runtime.follow)
    # -- the approx portfolio (solvers.approx)
    plan_from: str | None = None                # the start or step the plan came from
    phases_s: str | None = None                 # wall seconds per phase
    notes: str | None = None                    # what the portfolio tried that did not work
    coarse_stages: int | None = None            # super-stages of the planning problem (None: not coarsened)
    candidates: int | None = None               # tensors (or bundles) the planning problem may evict
    planning_budget_bytes: int | None = None    # the smaller budget planned for so that the full graph fits
    exact_status: str | None = None             # the exact MILP step on small graphs: its status
    exact_s: float | None = None
    exact_improved: bool | None = None          # whether it beat the rest of the portfolio
    # -- the STR LP relaxation and its rounding (solvers.relax, solvers.lp)
    lp_status: str | None = None
    lp_vars: int | None = None
    lp_constraints: int | None = None
    lp_s: float | None = None
    lp_bound_s: float | None = None             # the LP value: a bound within the STR model only
    rounding: str | None = None                 # the rounding rule and variant that won
    rounding_s: float | None = None
    rounding_tries: int | None = None
    rounded_overhead_s: float | None = None
    recompute_lp_bound_s: float | None = None   # Checkmate's LP value (a bound on recompute-only plans)
    # -- the MILPs (milp, checkmate, swap-opt)
    status: str | None = None
    milp_vars: int | None = None
    milp_constraints: int | None = None
    milp_s: float | None = None
    compact: bool | None = None                 # the compact (coarse) model was solved
    milp_stages: int | None = None              # stages the MILP was posed on, where not the planning problem's
    milp_refined: str | None = None             # why: no start satisfied the planning problem's rows
    warm_start: str | None = None               # whether the warm start satisfies the model's rows
    objective_s: float | None = None
    bound_s: float | None = None
    mip_gap: float | None = None
    fallback: str | None = None                 # why another plan than the MILP's is returned
    # -- baselines
    baseline_s: float | None = None
    segments: int | None = None                 # chen
    saved_tensors: int | None = None            # chen
    swapped: int | None = None                  # swap-vdnn
    swapped_gaps: int | None = None             # capuchin
    recomputed_gaps: int | None = None          # capuchin
    evictor_budget_bytes: int | None = None     # dtr
    # -- the least budget (budget="min")
    min_budget_bytes: int | None = None
    min_no_plan_bytes: int | None = None        # the largest budget below it found without a plan
    min_probes: int | None = None
    min_failed_above: int | None = None         # probes without a plan at budgets the least plan fits
    min_checked_bytes: int | None = None        # 1 % below the least budget: the MILP's last probe found none
    memory_floor_bytes: int | None = None
    min_remembered: bool | None = None          # the search was this process's earlier one (solvers.LEAST_KEPT)
    # -- a plan book's bucket (hybridmem.buckets)
    shape_key: str | None = None
    dims: dict[str, Any] | None = None

    _set: list[str] = field(default_factory=list, repr=False)   # the fields set, in order

    def __post_init__(self) -> None:
        self._set = [f for f in _INFO_FIELDS if getattr(self, f) is not None]

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _INFO_INDEX and name not in self.__dict__.get("_set", [name]):
            self._set.append(name)

    # -- the mapping view over the fields that were set
    def __getitem__(self, key: str) -> Any:
        if key not in _INFO_INDEX:
            raise KeyError(_unknown(key))
        if key not in self._set:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in _INFO_INDEX:
            raise KeyError(_unknown(key))
        setattr(self, key, value)

    def __delitem__(self, key: str) -> None:
        if key not in _INFO_INDEX or key not in self._set:
            raise KeyError(key)
        self._set.remove(key)
        object.__setattr__(self, key, None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._set))

    def __len__(self) -> int:
        return len(self._set)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PlanInfo, dict)):
            return dict(self) == dict(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"PlanInfo({self.to_dict()!r})"

    def to_dict(self) -> dict[str, Any]:
        """The fields set, in order: what a plan file holds under ``info``."""
        return {k: getattr(self, k) for k in self._set}

    @classmethod
    def from_mapping(cls, d: Any, *, source: str = "plan") -> "PlanInfo":
        """From a mapping (a plan file's ``info``, or a planner's dict); unknown keys are refused."""
        if isinstance(d, PlanInfo):
            return d
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise PlanFormatError(f"{source}: info must be a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_INFO_INDEX))
        if unknown:
            raise PlanFormatError(f"{source}: info: {_unknown(*unknown)}")
        out = cls()
        for k, v in d.items():
            setattr(out, k, v)
        return out


_INFO_FIELDS = tuple(f.name for f in fields(PlanInfo) if f.name != "_set")
_INFO_INDEX = {name: i for i, name in enumerate(_INFO_FIELDS)}


def _unknown(*keys: str) -> str:
    return f"unknown plan info key(s) {list(keys)}; accepted: {sorted(_INFO_FIELDS)}"


@dataclass
class Plan:
    """A per-tensor schedule of evictions and regenerations for one Graph."""

    actions: list[Action] = field(default_factory=list)
    graph_hash: str = ""              # Graph.structure_hash() of the graph it was made for
    device: str = ""                  # cost model the plan was made under
    budget_bytes: int | None = None
    solver: str = "keep-all"
    predicted_time_s: float | None = None
    predicted_peak_bytes: int | None = None
    info: PlanInfo = field(default_factory=PlanInfo)  # solver status, objective, bound, gap, timings

    def __setattr__(self, name: str, value: Any) -> None:
        # a mapping given as info (Plan(info={...}), plan.info = {...}) becomes a PlanInfo: unknown keys fail here
        if name == "info" and not isinstance(value, PlanInfo):
            value = PlanInfo.from_mapping(value)
        object.__setattr__(self, name, value)

    @classmethod
    def keep_all(cls, graph: "Graph | None" = None) -> "Plan":
        return cls(graph_hash=graph.structure_hash() if graph is not None else "")

    def sorted_actions(self) -> list[Action]:
        """Actions in execution order: by stage, regenerations (before the op) first, then evictions."""
        before = {"recompute": 0, "decompress": 0, "swap_in": 1}
        return sorted(self.actions, key=lambda a: (a.stage, 0 if a.kind in before else 1))

    def by_tensor(self) -> dict[int, list[Action]]:
        out: dict[int, list[Action]] = {}
        for a in self.sorted_actions():
            out.setdefault(a.tensor, []).append(a)
        return out

    def policy_of(self, tensor: int) -> str:
        """``keep`` or the policy that evicts this tensor (``hybrid`` if several)."""
        kinds = {POLICY_OF[a.kind] for a in self.actions if a.tensor == tensor and a.kind in POLICY_OF}
        return "keep" if not kinds else kinds.pop() if len(kinds) == 1 else "hybrid"

    def check_graph(self, graph: "Graph") -> None:
        """Refuse a plan made for another graph, saying why."""
        if self.graph_hash and self.graph_hash != graph.structure_hash():
            raise StalePlanError(
                f"plan was made for graph {self.graph_hash} but this step's graph is {graph.structure_hash()} "
                f"({graph.num_stages} stages): the model, its input shapes or the torch version changed; "
                "capture and plan again (hybridmem plan)")
        n, m = graph.num_stages, len(graph.tensors)
        for a in self.actions:
            if not 0 <= a.stage < n or not 0 <= a.tensor < m:
                raise PlanFormatError(f"action {a}: stage must be in 0..{n - 1} and tensor in 0..{m - 1}")
            if not graph.tensors[a.tensor].evictable:
                t = graph.tensors[a.tensor]
                raise PlanFormatError(f"action {a}: tensor {a.tensor} is a {t.kind} and may not be evicted")

    # ---- (de)serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The plan as saved: ``checksum`` (of everything else) and ``entries`` (its counts) come first,
        so that a file cut short keeps them and is recognised."""
        d = asdict(self)
        d["info"] = self.info.to_dict()
        d["actions"] = [_compact(a) for a in self.sorted_actions()]
        body = {"entries": _entries(d), **d}
        return {"schema": PLAN_SCHEMA_VERSION, "checksum": _checksum(body), **body}

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "plan") -> "Plan":
        if not isinstance(d, dict):
            raise PlanFormatError(f"{source}: expected a mapping with keys schema, graph_hash, actions; "
                                  f"got {type(d).__name__}")
        missing = [k for k in ("schema", "actions") if k not in d]
        if missing:
            raise PlanFormatError(f"{source}: missing key(s) {missing} (file truncated or not a hybridmem plan?)")
        _check_integrity(d, source)
        if d["schema"] != PLAN_SCHEMA_VERSION:
            raise PlanFormatError(f"{source}: schema version {d['schema']!r} unsupported; this hybridmem reads "
                                  f"{PLAN_SCHEMA_VERSION}")
        if not isinstance(d["actions"], list):
            raise PlanFormatError(f"{source}: actions must be a list")
        actions = []
        for i, a in enumerate(d["actions"]):
            act = _build(Action, a, f"{source}: actions[{i}]", PlanFormatError)
            if act.kind not in ACTION_KINDS:
                raise PlanFormatError(f"{source}: actions[{i}]: kind {act.kind!r} is not one of {ACTION_KINDS}")
            if act.stage < 0 or act.tensor < 0 or not 0 < act.ratio <= 1:
                raise PlanFormatError(f"{source}: actions[{i}]: stage and tensor must be >= 0 and ratio in (0, 1]")
            actions.append(act)
        rest = {k: v for k, v in d.items() if k not in ("schema", "actions", "checksum", "entries")}
        known = {"graph_hash", "device", "budget_bytes", "solver", "predicted_time_s", "predicted_peak_bytes", "info"}
        unknown = sorted(set(rest) - known)
        if unknown:
            raise PlanFormatError(f"{source}: unknown key(s) {unknown}; accepted: "
                                  f"{sorted(known | {'schema', 'actions', 'checksum', 'entries'})}")
        b = rest.get("budget_bytes")
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
            raise PlanFormatError(f"{source}: budget_bytes must be a non-negative integer or null, got {b!r}")
        if "info" in rest:
            rest["info"] = PlanInfo.from_mapping(rest["info"], source=source)
        return cls(actions=actions, **rest)

    def save(self, path: str | Path) -> Path:
        return save_mapping(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_dict(load_mapping(path, PlanFormatError), source=str(path))

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in self.actions:
            out[a.kind] = out.get(a.kind, 0) + 1
        return out


def _entries(d: dict[str, Any]) -> dict[str, int]:
    """How many actions and annotated tensors (``info.runtime.tensors``) a plan mapping has."""
    ann = d.get("info", {}).get("runtime") if isinstance(d.get("info"), dict) else None
    tensors = ann.get("tensors") if isinstance(ann, dict) else None
    return {"actions": len(d["actions"]) if isinstance(d.get("actions"), list) else 0,
            "tensors": len(tensors) if isinstance(tensors, dict) else 0}


def _checksum(body: dict[str, Any]) -> str:
    """SHA-256 of the compact JSON of a plan mapping: what YAML and JSON both round-trip (key order is kept
    by both; keys are not sorted, since a mapping may mix int and str keys)."""
    text = json.dumps(body, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_integrity(d: dict[str, Any], source: str) -> None:
    """A saved plan's counts and checksum against its content (both optional: hand-made plans have none)."""
    body = {k: v for k, v in d.items() if k not in ("schema", "checksum")}
    said = d.get("entries")
    if said is not None:
        has = _entries(d)
        if said != has:
            raise PlanFormatError(
                f"{source}: the file lists {said.get('actions') if isinstance(said, dict) else said} actions and "
                f"{said.get('tensors') if isinstance(said, dict) else '?'} tensor entries, it has {has['actions']} "
                f"and {has['tensors']}: it was truncated or edited after it was saved. It is not used: make "
                "the plan again (hybridmem plan)")
    want = d.get("checksum")
    if want is not None and want != _checksum(body):
        raise PlanFormatError(
            f"{source}: checksum {want} does not match its content ({_checksum(body)}): the file was truncated "
            "or edited after it was saved. It is not used: make the plan again (hybridmem plan), or, if you "
            "edited it on purpose, delete its 'checksum' line")


def _compact(a: Action) -> dict[str, Any]:
    d = asdict(a)
    if not a.codec:
        d.pop("codec")
    if a.ratio == 1.0:
        d.pop("ratio")
    return d
