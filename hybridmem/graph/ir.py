"""Graph IR: one training step as stages (ops in execution order) and the tensors they read and write.

A *stage* is one op (or a merged group of ops) of the step, forward then backward. A *tensor* here is a
unit of device memory: one storage, shared by all its views. Tensors that exist before the step
(parameters, buffers, inputs, optimizer state) have ``producer == -1`` and are never evictable.

Memory model (shared by the simulator, the solvers and the meter): a tensor occupies ``nbytes`` on the
device from its producer stage through ``freed_after`` inclusive (``None``: it outlives the step), so the
keep-everything memory during stage ``t`` is the sum over tensors live at ``t`` plus ``stages[t].workspace``.
This is what the meter measures at op boundaries: an op's outputs are counted while its inputs are
still alive, and a tensor freed right after an op still counts during that op.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import yaml

from ..errors import GraphFormatError
from .units import fmt_bytes

SCHEMA_VERSION = 1
# "optimizer": an optimizer's state (momentum, moments), resident for the whole step (producer -1, never freed)
TENSOR_KINDS = ("activation", "param", "buffer", "input", "grad", "state", "optimizer", "other")
PHASES = ("forward", "backward", "optimizer")
FIXED_KINDS = frozenset({"param", "buffer", "input", "state", "optimizer"})


@dataclass
class TensorInfo:
    """One storage-level tensor of the step."""

    id: int
    nbytes: int
    dtype: str = "float32"
    shape: tuple[int, ...] = ()
    kind: str = "activation"
    producer: int = -1                       # stage index; -1 = exists before the step
    consumers: list[int] = field(default_factory=list)  # stages that read it, ascending
    freed_after: int | None = None           # last stage it is alive in; None = outlives the step
    saved: bool = False                      # saved by autograd for the backward pass
    name: str = ""

    @property
    def evictable(self) -> bool:
        """Only activations produced inside the step may be evicted; never params, buffers, inputs."""
        return self.kind == "activation" and self.producer >= 0

    def last_stage(self, num_stages: int) -> int:
        return num_stages - 1 if self.freed_after is None else self.freed_after

    def first_stage(self) -> int:
        return max(self.producer, 0)


@dataclass
class Stage:
    """One op (or a merged group of ops) of the training step."""

    index: int
    id: str                      # stable identity: "<phase>/<module path>/<op>#<k>"
    op: str                      # aten op name, or "a+b+..." for merged stages
    module: str = ""             # module path ("" = top level / unknown)
    phase: str = "forward"
    cost_s: float = 0.0          # compute seconds under the graph's cost model
    flops: float = 0.0
    bytes_accessed: int = 0      # bytes read + written by the op (for HBM-bound cost models)
    inputs: list[int] = field(default_factory=list)   # tensor ids read
    outputs: list[int] = field(default_factory=list)  # tensor ids produced (new storages)
    writes: list[int] = field(default_factory=list)   # tensor ids written in place (``relu_``'s self, ``out=``,
    #                                                   BatchNorm running stats); each is also an input
    workspace: int = 0           # transient bytes during the stage beyond its live tensors
    rng: bool = False            # consumes the RNG (dropout): replay must restore RNG state
    side_effect: bool = False    # mutates state outside its outputs (BatchNorm running stats)
    deterministic: bool = True   # False: must not be recomputed (swap instead)
    ops: int = 1                 # number of original ops merged into this stage


@dataclass
class Graph:
    """A captured training step. ``meta`` holds free-form provenance (model, device, cost model, shapes)."""

    stages: list[Stage]
    tensors: list[TensorInfo]
    meta: dict[str, Any] = field(default_factory=dict)

    # ---- derived views -------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_forward(self) -> int:
        """Index of the first non-forward stage (== number of forward stages)."""
        for s in self.stages:
            if s.phase != "forward":
                return s.index
        return len(self.stages)

    def evictable(self) -> list[TensorInfo]:
        """Activations that live past their producer stage: the candidates for eviction."""
        return [t for t in self.tensors if t.evictable and t.last_stage(self.num_stages) > t.producer]

    def writers(self) -> dict[int, list[int]]:
        """Tensor id -> the forward stages that write it in place, ascending (only tensors with writers)."""
        out: dict[int, list[int]] = {}
        for s in self.stages:
            if s.phase == "forward":
                for tid in s.writes:
                    out.setdefault(tid, []).append(s.index)
        return out

    def replay_stages(self, tensor_id: int, before: int | None = None, *,
                      writers: dict[int, list[int]] | None = None, trace: bool | None = None) -> list[int]:
        """The stages a recompute of ``tensor_id`` replays, in order: its producer, then the forward stages
        that wrote it in place after it (``conv -> bn -> relu_``: regenerating bn's output storage as the
        backward reads it replays bn and ``relu_``). This is what the runtime's lineage replays, and
        what the simulator and the planners charge a recompute.

        An input of those stages that a forward stage wrote in place after the stage read it (and before the
        replay runs) holds later content: it is rebuilt first as that stage read it (its producer and its
        writers before the read: ``bn -> clone -> relu_`` regenerating the clone replays bn), as the runtime's
        lineage rebuilds it, with or without ``trace``. A source of those stages that nothing holds any more is
        rebuilt first too, as the runtime's lineage rebuilds it: a forward temporary the backward does not read
        (not ``saved``: no plan keeps it, and planners free it after its last read) whose last read is before
        ``before`` (or, with ``before=None``, before the backward: a layer norm's output that only the next
        matrix product read), its own stages traced the same way; so a recompute of a saved tensor reaches
        back to tensors a plan can keep, however many such temporaries lie between.

        ``trace=False`` (default: ``graph.meta["trace_sources"]``, else True) leaves the tracing out: a
        compiled region's joint graph turns it off (its partitioner recomputes what a recompute needs on
        its own, inside fused kernels), and the planners leave it out of their candidates unless asked
        (``plan(..., trace_sources=True)``).

        ``before``: a recompute issued before stage ``before`` regenerates the content of that moment, so
        only writers earlier than it replay (``None``: all forward writers, as for a backward recompute).
        ``writers``: ``self.writers()``, passed by callers that ask for many tensors. Empty for a tensor
        that exists before the step (nothing to replay).
        """
        ws_all = self.writers() if writers is None else writers
        n = len(self.stages)
        if trace is None:
            trace = bool(self.meta.get("trace_sources", True))
        # when the replay runs: before stage ``before``, or in the backward (a graph without one: never gone)
        when = before if before is not None else (self.num_forward if self.num_forward < n else -1)
        out: set[int] = set()

        def add(tid: int, upto: int | None) -> None:
            t = self.tensors[tid]
            if t.producer < 0:
                return
            own = [t.producer, *(w for w in ws_all.get(tid, ()) if w > t.producer and (upto is None or w < upto))]
            for r in own:
                if r in out:
                    continue
                out.add(r)
                for j in self.stages[r].inputs:
                    s = self.tensors[j]
                    if j == tid or s.producer < 0:
                        continue
                    if any(r < w < when for w in ws_all.get(j, ())):
                        # written in place after stage r read it, before the replay runs: the storage holds
                        # later content, so it is rebuilt as r read it (a clone before an in-place relu)
                        add(j, r)
                    elif (trace and s.kind == "activation" and not s.saved
                            and self.stages[s.producer].phase == "forward"
                            and max([s.producer, *s.consumers]) < when):
                        add(j, before)
        add(tensor_id, before)
        return sorted(out)

    @property
    def writes_recorded(self) -> bool:
        """False for a graph loaded from a file written before in-place writes were recorded
        (``meta["writes_recorded"] is False``): its recomputes are charged their producer only."""
        return self.meta.get("writes_recorded") is not False

    def compute_time(self) -> float:
        return float(sum(s.cost_s for s in self.stages))

    def fixed_bytes(self) -> int:
        """Bytes resident for the whole step that no policy may evict (params, buffers, inputs, state,
        optimizer state)."""
        return sum(t.nbytes for t in self.tensors if t.producer < 0)

    def memory_profile(self) -> np.ndarray:
        """Keep-everything bytes during each stage (live tensors + stage workspace)."""
        n = self.num_stages
        delta = np.zeros(n + 1, dtype=np.int64)
        for t in self.tensors:
            delta[t.first_stage()] += t.nbytes
            delta[t.last_stage(n) + 1] -= t.nbytes
        mem = np.cumsum(delta[:-1])
        mem += np.array([s.workspace for s in self.stages], dtype=np.int64)
        return mem

    def peak_bytes(self) -> int:
        return int(self.memory_profile().max()) if self.stages else self.fixed_bytes()

    def saved_bytes(self) -> int:
        """Bytes of activations autograd saves for the backward pass."""
        return sum(t.nbytes for t in self.tensors if t.saved and t.evictable)

    # ---- identity ------------------------------------------------------------------------------
    def structure_hash(self) -> str:
        """Hash of what a plan depends on: stage identities, ops, edges and tensor sizes, not costs.

        Plans record it; a plan is refused on a graph whose structure hash differs. In-place writes
        (``Stage.writes``) are left out: they follow from the same ops on the same inputs (a re-capture of the
        same step records the same ones), and a plan's actions name stages and tensors only, so a plan made
        on a graph file that predates recorded writes still names the right things; the simulator checks
        it again against the writes (a recompute must find its writers' inputs too).
        """
        h = hashlib.sha256()
        for s in self.stages:
            h.update(f"S|{s.id}|{s.op}|{s.phase}|{s.inputs}|{s.outputs}\n".encode())
        for t in self.tensors:
            h.update(f"T|{t.id}|{t.nbytes}|{t.kind}|{t.producer}|{t.freed_after}\n".encode())
        return h.hexdigest()[:16]

    def content_hash(self) -> str:
        """Hash of the whole graph, costs and meta included (stable across save/load)."""
        d = self.to_dict(with_hash=False)
        for st in d["stages"]:
            if not st["writes"]:
                del st["writes"]  # hashes of graphs without in-place writes are what they were before the field
        blob = json.dumps(d, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # ---- validation ----------------------------------------------------------------------------
    def validate(self) -> "Graph":
        """Check internal consistency; raise ``GraphFormatError`` naming the first problem."""
        n = len(self.stages)
        for i, s in enumerate(self.stages):
            if s.index != i:
                raise GraphFormatError(f"stage {i}: index field is {s.index}, expected {i} (stages must be in order)")
            if s.phase not in PHASES:
                raise GraphFormatError(f"stage {i}: phase {s.phase!r} is not one of {PHASES}")
            if not (s.cost_s >= 0) or s.workspace < 0 or s.flops < 0:
                raise GraphFormatError(f"stage {i}: cost_s, flops and workspace must be non-negative numbers")
            for tid in (*s.inputs, *s.outputs, *s.writes):
                if not 0 <= tid < len(self.tensors):
                    raise GraphFormatError(f"stage {i}: tensor id {tid} out of range 0..{len(self.tensors) - 1}")
            if s.writes:
                ins = set(s.inputs)
                for tid in s.writes:
                    # an in-place op reads what it writes; a new storage is an output, not a write
                    if tid not in ins or tid in s.outputs:
                        raise GraphFormatError(f"stage {i}: writes tensor {tid} in place, so it must be one of "
                                               f"its inputs and not one of its outputs (inputs {s.inputs}, "
                                               f"outputs {s.outputs})")
        for j, t in enumerate(self.tensors):
            if t.id != j:
                raise GraphFormatError(f"tensor {j}: id field is {t.id}, expected {j}")
            if t.nbytes < 0:
                raise GraphFormatError(f"tensor {j}: nbytes {t.nbytes} is negative")
            if t.kind not in TENSOR_KINDS:
                raise GraphFormatError(f"tensor {j}: kind {t.kind!r} is not one of {TENSOR_KINDS}")
            if not -1 <= t.producer < n:
                raise GraphFormatError(f"tensor {j}: producer {t.producer} out of range -1..{n - 1}")
            if t.kind == "optimizer" and (t.producer != -1 or t.freed_after is not None):
                raise GraphFormatError(f"tensor {j}: optimizer state exists for the whole step: producer must be -1 "
                                       f"and freed_after null, got {t.producer} and {t.freed_after}")
            if t.freed_after is not None and not t.first_stage() <= t.freed_after < n:
                raise GraphFormatError(f"tensor {j}: freed_after {t.freed_after} is not within "
                                       f"{t.first_stage()}..{n - 1}")
            if t.producer >= 0 and j not in self.stages[t.producer].outputs:
                raise GraphFormatError(f"tensor {j}: producer stage {t.producer} does not list it as an output")
            for c in t.consumers:
                if not 0 <= c < n or j not in self.stages[c].inputs:
                    raise GraphFormatError(f"tensor {j}: consumer stage {c} does not list it as an input")
                if c < t.producer:
                    raise GraphFormatError(f"tensor {j}: consumer stage {c} runs before its producer {t.producer}")
                if c > t.last_stage(n):
                    raise GraphFormatError(f"tensor {j}: read at stage {c} after it was freed at {t.freed_after}")
        return self

    # ---- (de)serialisation ---------------------------------------------------------------------
    def to_dict(self, *, with_hash: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "meta": self.meta,
            "stages": [asdict(s) for s in self.stages],
            "tensors": [{**asdict(t), "shape": list(t.shape)} for t in self.tensors],
        }
        if with_hash:
            d["content_hash"] = self.content_hash()
        return d

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "graph") -> "Graph":
        if not isinstance(d, dict):
            raise GraphFormatError(f"{source}: expected a mapping with keys schema, stages, tensors; "
                                   f"got {type(d).__name__}")
        missing = [k for k in ("schema", "stages", "tensors") if k not in d]
        if missing:
            raise GraphFormatError(f"{source}: missing key(s) {missing} (file truncated or not a hybridmem graph?)")
        if d["schema"] != SCHEMA_VERSION:
            raise GraphFormatError(f"{source}: schema version {d['schema']!r} unsupported; this hybridmem reads {SCHEMA_VERSION}")
        stages = [_build(Stage, s, f"{source}: stages[{i}]") for i, s in enumerate(_as_list(d["stages"], source, "stages"))]
        tensors = [_build(TensorInfo, t, f"{source}: tensors[{i}]") for i, t in enumerate(_as_list(d["tensors"], source, "tensors"))]
        for t in tensors:
            t.shape = tuple(t.shape)
        meta = dict(d.get("meta") or {})
        g = cls(stages, tensors, meta)
        try:
            g.validate()
        except GraphFormatError as e:
            raise GraphFormatError(f"{source}: {e}") from None
        want = d.get("content_hash")
        if want is not None and want != g.content_hash():
            raise GraphFormatError(f"{source}: content hash {want} does not match the content ({g.content_hash()}); "
                                   "the file was edited or corrupted")
        if "writes_recorded" not in meta and stages and not any(
                isinstance(s, dict) and "writes" in s for s in d["stages"]):
            # written before in-place writes were recorded: say so rather than infer "no writes"
            meta["writes_recorded"] = False
        return g

    def save(self, path: str | Path) -> Path:
        """Write as YAML (``.yaml``/``.yml``) or JSON (anything else)."""
        return save_mapping(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> "Graph":
        return cls.from_dict(load_mapping(path, GraphFormatError), source=str(path))

    def summary(self) -> str:
        return (f"{self.num_stages} stages ({self.num_forward} forward), {len(self.tensors)} tensors, "
                f"keep-all peak {fmt_bytes(self.peak_bytes())}, saved activations {fmt_bytes(self.saved_bytes())}, "
                f"fixed {fmt_bytes(self.fixed_bytes())}, compute {self.compute_time() * 1e3:.2f} ms")


def link_consumers(stages: Iterable[Stage], tensors: list[TensorInfo]) -> None:
    """Fill ``TensorInfo.consumers`` from the stages' input lists."""
    for t in tensors:
        t.consumers = []
    for s in stages:
        for tid in dict.fromkeys(s.inputs):
            tensors[tid].consumers.append(s.index)


# ---- shared YAML/JSON helpers (graphs and plans) ---------------------------------------------------
def save_mapping(d: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() in (".yaml", ".yml"):
        text = yaml.safe_dump(d, sort_keys=False, default_flow_style=None, width=120)
    else:
        text = json.dumps(d, indent=1)
    path.write_text(text)
    return path


def load_mapping(path: str | Path, error: type[Exception]) -> Any:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            return yaml.safe_load(text)
        return json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise error(f"{path}: not valid {'YAML' if path.suffix.lower() in ('.yaml', '.yml') else 'JSON'} "
                    f"(truncated or corrupted?): {str(e).splitlines()[0]}") from None


def _as_list(v: Any, source: str, key: str) -> list:
    if not isinstance(v, list):
        raise GraphFormatError(f"{source}: {key} must be a list, got {type(v).__name__}")
    return v


_NUMERIC = (int, float)


def _build(cls: type, d: Any, where: str, error: type[Exception] = GraphFormatError) -> Any:
    """Build a dataclass from a dict, checking field names and basic types."""
    if not isinstance(d, dict):
        raise error(f"{where}: expected a mapping, got {type(d).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise error(f"{where}: unknown field(s) {unknown}; accepted: {sorted(known)}")
    try:
        obj = cls(**d)
    except TypeError as e:
        raise error(f"{where}: {e}") from None
    for name, f in known.items():
        v = getattr(obj, name)
        ann = str(f.type)
        if ann.startswith(("int", "float")) and not ann.endswith("None"):
            if isinstance(v, bool) or not isinstance(v, _NUMERIC):
                raise error(f"{where}: field {name!r} must be a number, got {v!r}")
            if ann == "int" and not isinstance(v, int):
                raise error(f"{where}: field {name!r} must be an integer, got {v!r}")
        elif ann.startswith("list[int]") and (not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
            raise error(f"{where}: field {name!r} must be a list of integers, got {v!r}")
        elif ann == "str" and not isinstance(v, str):
            raise error(f"{where}: field {name!r} must be a string, got {v!r}")
    return obj
