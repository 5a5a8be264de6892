"""Plans per input-shape bucket: a step whose inputs have other shapes is another graph.

A plan is made for one :class:`~hybridmem.graph.ir.Graph`, and the graph of a training step changes
with the shapes of its inputs (batch, sequence length, image size, the last partial batch). A
:class:`PlanBook` keeps one plan per :class:`ShapeKey` (the shapes and dtypes of the step's input
tensors) in a folder::

    book/
      index.yaml                  # key -> plan file, graph file, graph hash, budget, predictions
      <digest>.plan.yaml          # one plan per bucket
      <digest>.graph.json         # the graph it was made for (lets the runtime check each stage)

At each step the runtime (:class:`~hybridmem.runtime.planbook_switch.BucketSwitch`, enabled by ``enable(plan=DIR)`` or
``HYBRIDMEM_PLAN=DIR``) computes the key of the model's inputs (its ``RootCallWatcher``) before the
step's first op and asks ``book.lookup(key)``: the bucket's plan, or ``None`` (no plan for that
shape, or one that cannot be trusted): then the step runs on the online scorer, the shape is named in
``Stats.notes`` and remembered in ``book.unplanned``, to be captured and planned later
(:func:`~hybridmem.planbooks.plan_buckets`). A plan is never applied to a graph it was not made for: the book refuses an
entry whose plan, graph file and key disagree (structure hashes), and each bucket's plan follower
checks the plan's op signature against the bucket's first step before following it (a mismatch
refuses that bucket only).

Planning several buckets at once (``hybridmem plan --model transformer --size tiny --shapes 8x16
8x24 --budget 80% --device cpu -o book``)::

    book = hybridmem.planbooks.plan_buckets("transformer", ["8x16", "8x24"], "80%", device="cpu", out_dir="book")
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import HybridMemError, PlanFormatError, StalePlanError
from .ir import Graph, load_mapping, save_mapping

from .plan import Plan

__all__ = ["ShapeKey", "TensorSpec", "PlanBook", "BookEntry", "BookFormatError", "is_book", "graph_key", "INDEX_NAME"]

BOOK_SCHEMA = 1
INDEX_NAME = "index.yaml"
MAX_UNPLANNED = 256   # shapes remembered without a plan; beyond that only counts of known ones grow


class BookFormatError(PlanFormatError):
    """A plan book folder or its index is malformed or inconsistent."""


# ---- keys --------------------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class TensorSpec:
    """Shape and dtype of one input tensor."""

    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{'x'.join(map(str, self.shape)) or 'scalar'}:{self.dtype}"

    @classmethod
    def parse(cls, text: str) -> "TensorSpec":
        dims, sep, dtype = text.strip().partition(":")
        if not sep or not dtype:
            raise ValueError(f"tensor spec {text!r}: expected SHAPE:DTYPE like 8x128:int64 or scalar:float32")
        try:
            shape = () if dims == "scalar" else tuple(int(d) for d in dims.split("x"))
        except ValueError:
            raise ValueError(f"tensor spec {text!r}: dimensions must be integers joined by 'x'") from None
        return cls(shape, dtype)


@dataclass(frozen=True, order=True)
class ShapeKey:
    """Shapes and dtypes of a step's input tensors, flattened: the identity of a shape bucket.

    Positional arguments come first in order, then keyword arguments sorted by name (the order a
    caller spells keywords in does not change the graph); lists, tuples and dicts inside them are
    flattened the same way. Non-tensor arguments are ignored. ``str(key)`` is the form used in
    index files and on the command line: ``2x16:int64,2x16:bool``.
    """

    tensors: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, *args: Any, **kwargs: Any) -> "ShapeKey":
        """The key of a call ``model(*args, **kwargs)``."""
        out: list[TensorSpec] = []
        _flatten(args, out)
        _flatten({k: kwargs[k] for k in sorted(kwargs)}, out)
        return cls(tuple(out))

    @classmethod
    def of_inputs(cls, inputs: Any) -> "ShapeKey":
        """The key of zoo/factory-style inputs: a tensor, a tuple of positional arguments or a dict
        of keyword arguments (the convention of :func:`hybridmem.graph.capture.capture`)."""
        if isinstance(inputs, dict):
            return cls.of(**inputs)
        if isinstance(inputs, (tuple, list)):
            return cls.of(*inputs)
        return cls.of(inputs)

    @classmethod
    def parse(cls, text: str) -> "ShapeKey":
        text = text.strip()
        if not text:
            return cls(())
        return cls(tuple(TensorSpec.parse(p) for p in text.split(",")))

    @property
    def batch(self) -> int | None:
        """First dimension of the first non-scalar input (the batch, by convention)."""
        return next((t.shape[0] for t in self.tensors if t.shape), None)

    def __str__(self) -> str:
        return ",".join(map(str, self.tensors))

    def digest(self) -> str:
        """Short stable name for file names (keys may be long and contain ':' and ',')."""
        return hashlib.sha256(str(self).encode()).hexdigest()[:12]


def _flatten(v: Any, out: list[TensorSpec]) -> None:
    if isinstance(v, torch.Tensor):
        out.append(TensorSpec(tuple(int(d) for d in v.shape), str(v.dtype).removeprefix("torch.")))
    elif isinstance(v, (list, tuple)):
        for x in v:
            _flatten(x, out)
    elif isinstance(v, Mapping):
        for x in v.values():
            _flatten(x, out)


def _as_key(key: "ShapeKey | str | Any") -> "ShapeKey":
    if isinstance(key, ShapeKey):
        return key
    if isinstance(key, str):
        return ShapeKey.parse(key)
    return ShapeKey.of_inputs(key)


# ---- the book ----------------------------------------------------------------------------------------
@dataclass
class BookEntry:
    """One bucket: its plan (and graph) files and what the index says about them."""

    key: ShapeKey
    plan_file: str                     # relative to the book folder
    graph_file: str | None
    graph_hash: str
    budget_bytes: int | None = None
    solver: str = ""
    device: str = ""
    predicted_peak_bytes: int | None = None
    predicted_time_s: float | None = None
    _plan: "Plan | None" = field(default=None, repr=False, compare=False)
    _graph: "Graph | None" = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan_file, "graph": self.graph_file, "graph_hash": self.graph_hash,
                "budget_bytes": self.budget_bytes, "solver": self.solver, "device": self.device,
                "predicted_peak_bytes": self.predicted_peak_bytes, "predicted_time_s": self.predicted_time_s}


class PlanBook:
    """Plans per input-shape bucket, in a folder with an ``index.yaml`` (see the module docstring).

    ``lookup(key)`` is the runtime's question at each step: one dict access once the bucket's plan
    was loaded (plans are loaded lazily and checked against their graph files when first used).
    """

    def __init__(self, root: str | Path, entries: Mapping[ShapeKey, BookEntry] | None = None,
                 unplanned: Mapping[ShapeKey, int] | None = None, meta: Mapping[str, Any] | None = None):
        self.root = Path(root)
        self.entries: dict[ShapeKey, BookEntry] = dict(entries or {})
        self.unplanned: dict[ShapeKey, int] = dict(unplanned or {})
        self.meta: dict[str, Any] = dict(meta or {})
        self.refused: dict[ShapeKey, str] = {}   # buckets whose files disagree: key -> reason
        self.hits = 0
        self.misses = 0

    # ---- the runtime's side -------------------------------------------------------------------
    def lookup(self, key: "ShapeKey | str | Any", *, graph: "Graph | None" = None,
               budget: int | None = None) -> "Plan | None":
        """The plan for this shape, or ``None`` (the step then runs on the online scorer).

        ``key``: a :class:`ShapeKey`, its string form, or model inputs. ``graph``: the step's own
        graph if the caller has it; a plan made for another graph is then refused. ``budget``: the
        runtime's budget; a plan made for a larger budget would not hold the cap and is refused.
        A refused or missing bucket is remembered (:attr:`unplanned`, :attr:`refused`).
        """
        k = _as_key(key)
        entry = self.entries.get(k)
        if entry is None or k in self.refused:
            self.misses += 1
            self._note_unplanned(k)
            return None
        try:
            plan = self.plan(k)
            if graph is not None:
                plan.check_graph(graph)
        except (HybridMemError, OSError) as e:
            self.refused[k] = str(e)
            self.misses += 1
            return None
        if budget is not None and plan.budget_bytes is not None and plan.budget_bytes > budget:
            self.misses += 1
            self._note_unplanned(k)
            return None
        self.hits += 1
        return plan

    def why_not(self, key: "ShapeKey | str | Any", budget: int | None = None) -> str:
        """Why :meth:`lookup` gives no plan for this key ("" if it gives one)."""
        k = _as_key(key)
        if k in self.refused:
            return f"bucket {k} refused: {self.refused[k]}"
        entry = self.entries.get(k)
        if entry is None:
            near = ", ".join(str(x) for x in sorted(self.entries)[:4])
            return f"no plan for input shapes {k} (planned: {near or 'none'})"
        if budget is not None and entry.budget_bytes is not None and entry.budget_bytes > budget:
            return (f"the plan for {k} was made for a budget of {entry.budget_bytes} bytes, above the "
                    f"runtime's {budget}: it would not hold the cap")
        return ""

    def _note_unplanned(self, k: ShapeKey) -> None:
        if k in self.unplanned or len(self.unplanned) < MAX_UNPLANNED:
            self.unplanned[k] = self.unplanned.get(k, 0) + 1

    # ---- entries ------------------------------------------------------------------------------
    def plan(self, key: "ShapeKey | str | Any") -> "Plan":
        """The bucket's plan, loaded and checked once: its graph hash must match the index and, when
        the graph file is there, the graph's structure hash and input shapes."""
        k = _as_key(key)
        e = self.entries[k]
        if e._plan is None:
            plan = Plan.load(self.root / e.plan_file)
            if plan.graph_hash != e.graph_hash:
                raise StalePlanError(f"{self.root / e.plan_file}: made for graph {plan.graph_hash or '(none)'} "
                                     f"but the book's index says bucket {k} has graph {e.graph_hash}: the file "
                                     "was replaced; plan the bucket again")
            g = self.graph(k)
            if g is not None:
                plan.check_graph(g)
            e._plan = plan
        return e._plan

    def graph(self, key: "ShapeKey | str | Any") -> "Graph | None":
        """The graph a bucket's plan was made for, or None if the book does not keep it."""
        k = _as_key(key)
        e = self.entries[k]
        if e.graph_file is None:
            return None
        if e._graph is None:
            g = Graph.load(self.root / e.graph_file)
            if g.structure_hash() != e.graph_hash:
                raise StalePlanError(f"{self.root / e.graph_file}: graph {g.structure_hash()} is not the graph "
                                     f"{e.graph_hash} the index names for bucket {k}")
            gk = graph_key(g)
            if gk is not None and gk != k:
                raise StalePlanError(f"{self.root / e.graph_file}: captured for inputs {gk}, filed under {k}")
            e._graph = g
        return e._graph

    def add(self, key: "ShapeKey | str | Any", plan: "Plan", graph: "Graph | None" = None,
            *, keep_graph: bool = True) -> BookEntry:
        """File ``plan`` under ``key`` (replacing the bucket's previous plan) and write its files;
        call :meth:`save` to write the index. The plan must name ``graph`` (hash) when one is given."""
        k = _as_key(key)
        if graph is not None:
            if plan.graph_hash and plan.graph_hash != graph.structure_hash():
                raise StalePlanError(f"plan for bucket {k} was made for graph {plan.graph_hash}, not for the "
                                     f"given graph {graph.structure_hash()}")
            gk = graph_key(graph)
            if gk is not None and gk != k:
                raise StalePlanError(f"the graph was captured for inputs {gk}, not {k}")
            if not plan.graph_hash:
                plan = replace(plan, graph_hash=graph.structure_hash())
        if not plan.graph_hash:
            raise PlanFormatError(f"plan for bucket {k} has no graph hash: the book could never check it "
                                  "against a step; give the graph it was made for")
        self.root.mkdir(parents=True, exist_ok=True)
        name = k.digest()
        plan.save(self.root / f"{name}.plan.yaml")
        graph_file = None
        if graph is not None and keep_graph:
            graph_file = f"{name}.graph.json"
            graph.save(self.root / graph_file)
        e = BookEntry(k, f"{name}.plan.yaml", graph_file, plan.graph_hash, plan.budget_bytes, plan.solver,
                      plan.device, plan.predicted_peak_bytes, plan.predicted_time_s, plan,
                      graph if keep_graph else None)
        self.entries[k] = e
        self.unplanned.pop(k, None)
        self.refused.pop(k, None)
        return e

    def keys(self) -> list[ShapeKey]:
        return sorted(self.entries)

    def __contains__(self, key: Any) -> bool:
        return _as_key(key) in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    # ---- files --------------------------------------------------------------------------------
    def save(self) -> Path:
        """Write ``index.yaml`` (bucket files are written by :meth:`add`)."""
        d = {"schema": BOOK_SCHEMA, "kind": "hybridmem-planbook", "meta": self.meta,
             "buckets": {str(k): e.to_dict() for k, e in sorted(self.entries.items())},
             "unplanned": {str(k): n for k, n in sorted(self.unplanned.items())}}
        return save_mapping(d, self.root / INDEX_NAME)

    @classmethod
    def load(cls, root: str | Path) -> "PlanBook":
        """Read a book's index; bucket files are read (and checked) when first used."""
        root = Path(root)
        index = root / INDEX_NAME
        if not index.is_file():
            raise BookFormatError(f"{root}: not a plan book (no {INDEX_NAME}); write one with "
                                  "`hybridmem plan --shapes ... -o DIR`")
        d = load_mapping(index, BookFormatError)
        src = str(index)
        if not isinstance(d, dict) or d.get("kind") != "hybridmem-planbook":
            raise BookFormatError(f"{src}: not a hybridmem plan book index (kind must be hybridmem-planbook)")
        if d.get("schema") != BOOK_SCHEMA:
            raise BookFormatError(f"{src}: schema {d.get('schema')!r} unsupported; this hybridmem reads {BOOK_SCHEMA}")
        buckets = d.get("buckets") or {}
        if not isinstance(buckets, dict):
            raise BookFormatError(f"{src}: buckets must be a mapping of shape key -> files")
        entries: dict[ShapeKey, BookEntry] = {}
        for ks, v in buckets.items():
            try:
                k = ShapeKey.parse(str(ks))
            except ValueError as e:
                raise BookFormatError(f"{src}: bucket {ks!r}: {e}") from None
            if not (isinstance(v, dict) and isinstance(v.get("plan"), str) and isinstance(v.get("graph_hash"), str)):
                raise BookFormatError(f"{src}: bucket {ks!r} needs 'plan' (file) and 'graph_hash'")
            if not (root / v["plan"]).is_file():
                raise BookFormatError(f"{src}: bucket {ks!r}: plan file {v['plan']} is missing")
            entries[k] = BookEntry(k, v["plan"], v.get("graph"), v["graph_hash"], v.get("budget_bytes"),
                                   v.get("solver", ""), v.get("device", ""), v.get("predicted_peak_bytes"),
                                   v.get("predicted_time_s"))
        unplanned = {}
        for ks, n in (d.get("unplanned") or {}).items():
            try:
                unplanned[ShapeKey.parse(str(ks))] = int(n)
            except ValueError as e:
                raise BookFormatError(f"{src}: unplanned {ks!r}: {e}") from None
        return cls(root, entries, unplanned, d.get("meta") or {})

    @classmethod
    def open(cls, root: str | Path) -> "PlanBook":
        """Load the book in ``root``, or start an empty one there."""
        root = Path(root)
        return cls.load(root) if (root / INDEX_NAME).is_file() else cls(root)

    def __repr__(self) -> str:
        return f"PlanBook({str(self.root)!r}, {len(self.entries)} bucket(s), {len(self.unplanned)} unplanned)"


def is_book(path: str | Path | None) -> bool:
    """Whether ``path`` is a plan-book folder (how the runtime tells it from a single plan file)."""
    return path is not None and Path(path).is_dir() and (Path(path) / INDEX_NAME).is_file()


def graph_key(graph: "Graph") -> ShapeKey | None:
    """The bucket key a captured graph was made for (``meta['shape_key']``, set by :func:`plan_buckets`)."""
    s = graph.meta.get("shape_key")
    return ShapeKey.parse(s) if isinstance(s, str) else None
