"""Planning several input shapes at once: one capture and one plan per shape bucket, saved as a
:class:`~hybridmem.graph.planbook.PlanBook` (``hybridmem plan --shapes``)::

    book = plan_buckets("transformer", ["8x16", "8x24"], "80%", device="cpu", out_dir="book")
"""
from __future__ import annotations

import importlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from . import zoo
from .errors import HybridMemError
from .factory import bind_loss, unpack_factory
from .graph.capture import capture
from .graph.costs import apply_costs, get_cost_model
from .graph.planbook import PlanBook, ShapeKey
from .graph.signature import annotate
from .graph.units import fmt_bytes
from .solvers import plan as solve

__all__ = ["plan_buckets", "parse_dims", "zoo_factory", "spec_factory", "cli_plan"]


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
    z = zoo

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
    if isinstance(source, str):
        names = dim_names or dim_names_of(source)
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
            annotate(p, g)
        book.add(key, p, g)
        book.save()
    book.save()
    return book


def dim_names_of(spec: str) -> tuple[str, ...]:
    if ":" in spec:
        return ("batch", "seq")
    return ("batch", "seq") if spec in ("transformer", "gpt") else ("batch", "image")


def cli_plan(args: Any) -> int:
    """``hybridmem plan --model M --shapes 2x8 2x16 ... --budget B -o DIR``: one plan per shape bucket
    into the plan book ``DIR`` (created or extended), then a table of the buckets. ``--graph`` is not
    accepted with ``--shapes``: each bucket is captured from the model at its shape."""

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
