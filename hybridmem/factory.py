"""Resolve a model spec from the command line: a zoo name or ``MODULE:FACTORY``.

``FACTORY()`` returns ``(model, inputs, loss_fn)``; a zoo name builds that model at ``size``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class ModelSpec:
    name: str
    model: Any
    inputs: Any
    loss_fn: Callable[[Any], Any] | None


def bench_module(name: str) -> Any:
    """A module of the benchmark suite: installed as ``hybridmem.bench``, ``bench`` in a source checkout."""
    try:
        return importlib.import_module(f"hybridmem.bench.{name}")
    except ModuleNotFoundError:
        return importlib.import_module(f"bench.{name}")


def zoo() -> Any:
    """The model zoo module."""
    return bench_module("zoo")


def load_model(spec: str, *, size: str = "small", batch: int | None = None, device: str = "cpu") -> ModelSpec:
    """Build the model named by ``spec`` (zoo name, or ``package.module:factory``)."""
    if ":" not in spec:
        z = zoo()
        if spec not in z.MODELS:
            raise ValueError(f"unknown model {spec!r}: give a zoo name ({', '.join(z.MODELS)}) "
                             "or MODULE:FACTORY where FACTORY() returns (model, inputs, loss_fn)")
        e = z.build(spec, size, batch=batch, device=device)
        return ModelSpec(f"{spec}-{size}" + (f"-b{batch}" if batch else ""), e.model, e.inputs, e.loss_fn)
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} from model spec {spec!r}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{spec!r}: {module_name} has no callable {attr!r}")
    out = factory()
    if not (isinstance(out, tuple) and len(out) in (2, 3)):
        raise ValueError(f"{spec!r}: FACTORY() must return (model, inputs) or (model, inputs, loss_fn), "
                         f"got {type(out).__name__}")
    model, inputs, *rest = out
    return ModelSpec(spec, model, inputs, rest[0] if rest else None)
