"""Plans per input-shape bucket: a step whose inputs have other shapes is another graph.

A plan is made for one :class:`~hybridmem.graph.Graph`, and the graph of a training step changes
with the shapes of its inputs (batch, sequence length, image size, the last partial batch). A
:class:`PlanBook` keeps one plan per :class:`ShapeKey` (the shapes and dtypes of the step's input
tensors) in a folder::

    book/
      index.yaml                  # key -> plan file, graph file, graph hash, budget, predictions
      <digest>.plan.yaml          # one plan per bucket
      <digest>.graph.json         # the graph it was made for (lets the runtime check each stage)

At each step the runtime (:class:`BucketSwitch`, enabled by ``enable(plan=DIR)`` or
``HYBRIDMEM_PLAN=DIR``) computes the key of the model's inputs (:class:`RootCallWatcher`) before the
step's first op and asks ``book.lookup(key)``: the bucket's plan, or ``None`` (no plan for that
shape, or one that cannot be trusted): then the step runs on the online scorer, the shape is named in
``Stats.notes`` and remembered in ``book.unplanned``, to be captured and planned later
(:func:`plan_buckets`). A plan is never applied to a graph it was not made for: the book refuses an
entry whose plan, graph file and key disagree (structure hashes), and each bucket's plan follower
checks the plan's op signature against the bucket's first step before following it (a mismatch
refuses that bucket only).

Planning several buckets at once (``hybridmem plan --model transformer --size tiny --shapes 8x16
8x24 --budget 80% --device cpu -o book``)::

    book = plan_buckets("transformer", ["8x16", "8x24"], "80%", device="cpu", out_dir="book")
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch

from ..errors import HybridMemError, PlanFormatError, StalePlanError
from .ir import load_mapping, save_mapping

if TYPE_CHECKING:
    from .ir import Graph
    from .plan import Plan

__all__ = ["ShapeKey", "TensorSpec", "PlanBook", "BookEntry", "BookFormatError", "RootCallWatcher", "BucketSwitch",
           "plan_buckets", "parse_dims", "zoo_factory", "is_book", "INDEX_NAME"]

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
        of keyword arguments (the convention of :func:`hybridmem.capture.capture`)."""
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
        from .plan import Plan

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
        from .ir import Graph

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


# ---- the runtime's view of the inputs -----------------------------------------------------------------
class RootCallWatcher:
    """Calls ``on_step(key)`` with the :class:`ShapeKey` of each outermost module call made with grad
    enabled: the model's inputs (under ``DistributedDataParallel`` too: its wrapper is the outermost
    module and receives the same inputs). The runtime takes the first such call after its step
    boundary as the step's shapes.

    Global module hooks see every module without knowing the model; depth is counted so a nested
    call costs one integer update. Install only while a plan book is in use.

    Global forward *pre*-hooks get no keyword arguments in torch 2.x (``with_kwargs`` exists only for
    module-local hooks), and models like the zoo's transformer take keyword inputs. The outermost
    call's keywords are read from the calling frame of ``Module._call_impl``, used only if that
    frame's ``args`` is the very tuple the hook received (so a torch that calls hooks differently falls
    back to positional inputs, never to someone else's keywords).
    """

    def __init__(self, on_step: Callable[[ShapeKey], None]):
        self.on_step = on_step
        self.depth = 0
        self.keywords_seen = True   # False once a root call's keywords could not be read
        self._handles: list[Any] = []

    def install(self) -> "RootCallWatcher":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        if not self._handles:
            self._handles = [register_module_forward_pre_hook(self._pre),
                             register_module_forward_hook(self._post, always_call=True)]
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.depth = 0

    def _pre(self, module: Any, args: tuple) -> None:
        self.depth += 1
        if self.depth == 1 and torch.is_grad_enabled():
            self.on_step(ShapeKey.of(*args, **self._caller_kwargs(args)))

    def _post(self, module: Any, args: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)

    def _caller_kwargs(self, args: tuple) -> dict[str, Any]:
        f = sys._getframe(2)  # 0: _caller_kwargs, 1: _pre, 2: the loop in Module._call_impl
        loc = f.f_locals
        kw = loc.get("kwargs")
        if loc.get("args") is args and isinstance(kw, dict):
            return kw
        self.keywords_seen = False
        return {}


class BucketSwitch:
    """The runtime's plan choice per step: a :class:`PlanBook`, looked up by each step's input shapes.

    A :class:`RootCallWatcher` sees the model's outermost call before the step's first op; the
    bucket's follower (one per bucket, each verifying its plan's op signature on the bucket's first
    step, as a single plan does on step 1) becomes the runtime's follower for that step, or none: the
    online scorer alone, which always enforces the budget. A plan whose signature does not match is
    refused for its bucket only (noted in ``Stats.notes`` and ``book.refused``); training goes on.

    ``usage[key]`` counts steps per bucket by how they ran: ``plan`` (the follower was following at the
    step's end), ``verify`` (the bucket's first step, on the scorer while checking the signature),
    ``scorer`` (no plan), ``refused`` / ``diverged``.
    """

    def __init__(self, book: PlanBook, rt: Any):
        self.book = book
        self.rt = rt
        self.followers: dict[ShapeKey, Any] = {}
        self.usage: dict[ShapeKey, dict[str, int]] = {}
        self.key: ShapeKey | None = None
        self._mode_at_start = "scorer"
        self.watcher = RootCallWatcher(self.step_shapes)

    def install(self) -> None:
        self.watcher.install()

    def uninstall(self) -> None:
        self.watcher.remove()

    def step_shapes(self, key: ShapeKey) -> None:
        """Root-call callback: pick the follower for the step about to start."""
        if getattr(self.rt.steps, "phase", 0) != 0:
            return  # a second model call inside one step: the step's first call decided
        f = self.followers.get(key, _MISSING)
        if f is _MISSING:
            plan = self.book.lookup(key, budget=self.rt.budget)
            f = self.followers[key] = None if plan is None else self._follower(key, plan)
            why = self.book.why_not(key, self.rt.budget) if plan is None else ""
            self.rt.stats.note(f"plan book: input shapes {key}: " + (why + "; online scorer" if why else
                                                                      "plan found, verified on its first step"))
        self.key = key
        self.rt.follower = f
        if getattr(self.rt, "mode", None) is not None:
            self.rt.mode.follower = f
        self._mode_at_start = "scorer" if f is None else "verify" if f.state == "pending" else f.state

    def step_ended(self) -> None:
        """Call at the runtime's step end, after the follower's own ``step_ended``."""
        if self.key is None:
            return
        f = self.followers.get(self.key)
        how = "scorer" if f is None else self._mode_at_start if self._mode_at_start == "verify" else \
            "plan" if f.state == "following" else f.state
        counts = self.usage.setdefault(self.key, {})
        counts[how] = counts.get(how, 0) + 1

    def _follower(self, key: ShapeKey, plan: "Plan") -> Any:
        from ..runtime.follow import PlanFollower

        book, rt = self.book, self.rt

        class BucketFollower(PlanFollower):
            def _verify(self) -> None:
                try:
                    super()._verify()
                except StalePlanError as e:  # refuse this bucket, keep training on the scorer
                    book.refused[key] = str(e)
                    rt.stats.note(f"plan book: input shapes {key}: plan refused: {e}")

        return BucketFollower(plan, rt)


_MISSING = object()


# ---- planning several buckets ----------------------------------------------------------------------------
Factory = Callable[[dict[str, int]], tuple[Any, Any, Any]]


def parse_dims(text: str | Mapping[str, int], names: Sequence[str] = ("batch", "seq")) -> dict[str, int]:
    """A bucket's dimensions from the command line: ``8x128`` (positional, named by ``names``) or
    ``batch=8,seq=128``; a mapping passes through."""
    if isinstance(text, Mapping):
        return {str(k): int(v) for k, v in text.items()}
    text = text.strip()
    try:
        if "=" in text:
            out = {}
            for part in text.split(","):
                k, _, v = part.partition("=")
                out[k.strip()] = int(v)
            return out
        vals = [int(v) for v in text.split("x")]
    except ValueError:
        raise ValueError(f"shape {text!r}: expected BATCHxLEN (e.g. 8x128) or name=value,... "
                         "(e.g. batch=8,seq=128)") from None
    if len(vals) > len(names):
        raise ValueError(f"shape {text!r}: at most {len(names)} dimensions ({'x'.join(names)})")
    return dict(zip(names, vals))


def zoo_factory(name: str, size: str = "tiny", *, device: str = "cpu", seed: int = 0) -> Factory:
    """``dims -> (model, inputs, loss_fn)`` for a zoo model: ``batch``, and ``seq`` (transformer, gpt)
    or ``image`` (CNNs, U-Net) override the size's configuration. The weights do not depend on the
    dims (same seed), so every bucket plans the same model."""
    from ..factory import zoo

    z = zoo()

    def make(dims: dict[str, int]) -> tuple[Any, Any, Any]:
        cfg = z.config(name, size, batch=dims.get("batch"))
        extra = {k: v for k, v in dims.items() if k != "batch"}
        if not extra:
            e = z.build(name, size, batch=dims.get("batch"), device=device, seed=seed)
            return e.model, e.inputs, e.loss_fn
        unknown = sorted(k for k in extra if not hasattr(cfg, k))
        if unknown:
            raise ValueError(f"{name}: cannot set {unknown}; its configuration has "
                             f"{', '.join(f for f in vars(cfg) if isinstance(getattr(cfg, f), int))}")
        cfg = replace(cfg, **extra)
        # The zoo's public build() takes only a batch override; build the variant the way it does.
        builder, maker = getattr(z, "_BUILDERS", {}).get(name), getattr(z, "_InputMaker", None)
        if builder is None or maker is None:
            raise ValueError(f"this zoo cannot build {name} with {extra}: give a MODULE:FACTORY spec instead")
        dev = torch.device(device)
        if dev.type == "meta":
            with torch.device("meta"):
                model, inputs, loss_fn, _ = builder(cfg, maker(seed, dev, torch.float32))
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model, inputs, loss_fn, _ = builder(cfg, maker(seed, dev, torch.float32))
        return model.to(dev).train(), inputs, loss_fn

    return make


def spec_factory(spec: str, size: str = "tiny", *, device: str = "cpu") -> Factory:
    """A factory from a command-line model spec: a zoo name, or ``MODULE:FACTORY`` whose ``FACTORY``
    takes the dims as keyword arguments (``FACTORY(batch=8, seq=128) -> (model, inputs, loss_fn[, optimizer])``)."""
    if ":" not in spec:
        return zoo_factory(spec, size, device=device)
    import importlib

    from ..factory import bind_loss, unpack_factory

    module_name, _, attr = spec.partition(":")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"{spec!r}: {module_name} has no callable {attr!r}")

    def make(dims: dict[str, int]) -> tuple[Any, ...]:
        # the same contract as without --shapes (tuples, or a dict with targets for a two-argument loss)
        model, inputs, loss_fn, targets, optimizer = unpack_factory(f"{spec}(**{dims})", fn(**dims))
        loss = bind_loss(spec, loss_fn, targets)
        return (model, inputs, loss) if optimizer is None else (model, inputs, loss, optimizer)

    return make


def plan_buckets(source: "str | Factory", shapes: Iterable[str | Mapping[str, int]], budget: int | str, *,
                 out_dir: str | Path, device: str = "cpu", solver: str = "approx", size: str = "tiny",
                 capture_device: str = "cpu", time_limit: float | None = None, verbose: bool = False,
                 dim_names: Sequence[str] | None = None) -> PlanBook:
    """Capture and plan one bucket per entry of ``shapes``; file them in the book at ``out_dir``.

    ``source``: a zoo name or ``MODULE:FACTORY`` (see :func:`spec_factory`), or a callable
    ``dims -> (model, inputs, loss_fn)``. ``shapes``: ``"8x128"``, ``"batch=8,seq=128"`` or dicts.
    ``budget``: bytes, ``"6GiB"``, or a percentage of each bucket's own keep-all peak (``"70%"``).
    ``device``: the cost model the plans are made under (``cpu`` for plans the CPU runtime follows).
    Buckets already in the book are replaced; the others are kept.
    """
    from .capture import capture
    from .costs import apply_costs, get_cost_model
    from ..solvers import plan as solve

    if isinstance(source, str):
        names = dim_names or _dim_names(source)
        make = spec_factory(source, size, device=capture_device)
        model_name = source
    else:
        names = dim_names or ("batch", "seq")
        make = source
        model_name = getattr(source, "__name__", "factory")
    book = PlanBook.open(out_dir)
    book.meta.update({"model": model_name, "size": size, "device": device, "solver": solver})
    for s in shapes:
        dims = parse_dims(s, names)
        model, inputs, loss_fn, *rest = make(dims)
        key = ShapeKey.of_inputs(inputs)
        # a 4th value is the optimizer: its state is resident all step long, so the plan budgets for it
        g = capture(model, inputs, loss_fn, device=capture_device, optimizer=rest[0] if rest else None)
        g.meta["shape_key"] = str(key)
        g.meta["dims"] = dims
        if device != "measured":
            g = apply_costs(g, get_cost_model(device))
        try:
            p = solve(g, budget, device=device, solver=solver, time_limit=time_limit, verbose=verbose)
        except HybridMemError as e:  # say which bucket; the buckets planned so far are kept
            if e.args and isinstance(e.args[0], str):
                e.args = (f"bucket {s} (inputs {key}): {e.args[0]}", *e.args[1:])
            raise
        p.info = {**p.info, "shape_key": str(key), "dims": dims}
        if "runtime" not in p.info:  # what the runtime's follower needs (op signature, tensor positions)
            from ..runtime.follow import annotate
            annotate(p, g)
        book.add(key, p, g)
        book.save()
    book.save()
    return book


def _dim_names(spec: str) -> tuple[str, ...]:
    if ":" in spec:
        return ("batch", "seq")
    return ("batch", "seq") if spec in ("transformer", "gpt") else ("batch", "image")


def cli_plan(args: Any) -> int:
    """``hybridmem plan --model M --shapes 2x8 2x16 ... --budget B -o DIR``: one plan per shape bucket
    into the plan book ``DIR`` (created or extended), then a table of the buckets. ``--graph`` is not
    accepted with ``--shapes``: each bucket is captured from the model at its shape."""
    import json

    from .units import fmt_bytes

    if getattr(args, "graph", None):
        raise ValueError("--shapes captures each bucket from --model; it does not take --graph")
    if not args.output:
        raise ValueError("--shapes writes a plan book folder: give it with -o DIR")
    device = args.capture_device or "cpu"
    book = plan_buckets(args.model, args.shapes, args.budget, out_dir=args.output, device=args.device,
                        solver=args.solver, size=args.size, capture_device=device,
                        time_limit=args.time_limit, verbose=args.verbose)
    rows = [{"shape_key": str(k), "plan": e.plan_file, "solver": e.solver, "budget_bytes": e.budget_bytes,
             "predicted_peak_bytes": e.predicted_peak_bytes, "predicted_time_s": e.predicted_time_s}
            for k, e in sorted(book.entries.items())]
    if getattr(args, "json", False):
        print(json.dumps({"book": str(book.root), "buckets": rows}))
        return 0
    print(f"plan book {book.root}: {len(rows)} bucket(s)")
    for r in rows:
        peak = fmt_bytes(r["predicted_peak_bytes"]) if r["predicted_peak_bytes"] is not None else "?"
        t = f"{r['predicted_time_s'] * 1e3:.3f} ms" if r["predicted_time_s"] is not None else "?"
        print(f"  {r['shape_key']:<40}  peak {peak:>12}  time {t:>12}  {r['plan']}")
    return 0
