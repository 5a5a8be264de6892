"""Resolve a model spec from the command line: a zoo name or ``MODULE:FACTORY``.

``FACTORY()`` returns ``(model, inputs)``, ``(model, inputs, loss_fn)`` or ``(model, inputs, loss_fn,
optimizer)``; a zoo name builds that model at ``size``. The optimizer (a ``torch.optim.Optimizer`` over
the model's parameters, or None) is what the plan budgets the state of (see ``capture(optimizer=)``).
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
    optimizer: Any = None   # torch.optim.Optimizer | None


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
                             "or MODULE:FACTORY where FACTORY() returns (model, inputs, loss_fn[, optimizer])")
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
    if not (isinstance(out, tuple) and len(out) in (2, 3, 4)):
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise ValueError(f"{spec!r}: FACTORY() must return (model, inputs), (model, inputs, loss_fn) or "
                         f"(model, inputs, loss_fn, optimizer); got {got}")
    model, inputs, *rest = out
    loss_fn = rest[0] if rest else None
    optimizer = rest[1] if len(rest) > 1 else None
    if optimizer is not None:
        import torch
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"{spec!r}: the 4th value FACTORY() returned must be a torch.optim.Optimizer "
                             f"(or None), got {type(optimizer).__name__}")
    return ModelSpec(spec, model, inputs, loss_fn, optimizer)


# ---- --optimizer NAME[:key=value,...] ------------------------------------------------------------------
OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop", "adagrad")


def parse_optimizer(text: str) -> tuple[str, dict[str, Any]] | None:
    """``"none"`` -> None; ``"sgd:lr=0.1,momentum=0.9"`` -> ``("sgd", {"lr": 0.1, "momentum": 0.9})``.
    Values are numbers, ``true``/``false``, or comma-free tuples ``0.9/0.999`` (Adam's betas)."""
    name, _, rest = text.strip().partition(":")
    name = name.strip().lower()
    if name == "none" and not rest:
        return None
    if name not in OPTIMIZERS:
        raise ValueError(f"--optimizer {text!r}: unknown optimizer {name!r}; accepted: none, "
                         f"{', '.join(OPTIMIZERS)} (with :key=value,... e.g. sgd:momentum=0.9)")
    kwargs: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"--optimizer {text!r}: {item!r} is not key=value (e.g. momentum=0.9)")
        kwargs[key.strip()] = _option_value(value.strip(), text)
    return name, kwargs


def _option_value(v: str, text: str) -> Any:
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    if "/" in v:
        return tuple(_option_value(x, text) for x in v.split("/"))
    try:
        return int(v) if v.lstrip("-").isdigit() else float(v)
    except ValueError:
        raise ValueError(f"--optimizer {text!r}: value {v!r} is not a number, true/false or a/b") from None


def make_optimizer(text: str, model: Any) -> Any:
    """The optimizer ``--optimizer text`` names, over ``model``'s parameters (None for ``none``)."""
    import torch

    parsed = parse_optimizer(text)
    if parsed is None:
        return None
    name, kwargs = parsed
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
           "rmsprop": torch.optim.RMSprop, "adagrad": torch.optim.Adagrad}[name]
    kwargs.setdefault("lr", 1e-3)  # SGD needs one; it does not change the state's size
    try:
        return cls(model.parameters(), **kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--optimizer {text!r}: {cls.__name__} refused the options: {e}") from None
