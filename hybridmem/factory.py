"""Resolve a model spec from the command line: a zoo name or ``MODULE:FACTORY``.

``FACTORY()`` returns ``(model, inputs)``, ``(model, inputs, loss_fn)``, ``(model, inputs, loss_fn,
optimizer)`` or a dict with keys ``model``, ``inputs`` and optionally ``loss_fn``, ``targets``,
``optimizer``. ``loss_fn(output)`` returns the scalar loss; with ``targets`` it is called as
``loss_fn(output, targets)`` (so ``nn.CrossEntropyLoss()`` works). A zoo name builds that model at
``size``. The optimizer (a ``torch.optim.Optimizer`` over the model's parameters, or None) is what the
plan budgets the state of (see ``capture(optimizer=)``).
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch


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


@contextmanager
def cwd_importable() -> Iterator[None]:
    """Modules in the working directory importable, as under ``python -m``: the console script's
    ``sys.path[0]`` is its own bin folder, so ``--model mymodels:factory`` would not find ``mymodels.py``."""
    cwd = os.getcwd()
    if "" in sys.path or cwd in sys.path:
        yield
        return
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if cwd in sys.path:
            sys.path.remove(cwd)


def zoo() -> Any:
    """The model zoo module."""
    return importlib.import_module("hybridmem.zoo")


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
        raise ValueError(f"cannot import {module_name!r} from model spec {spec!r}: {e} (the module must be in the "
                         "working directory or on PYTHONPATH)") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{spec!r}: {module_name} has no callable {attr!r}")
    model, inputs, loss_fn, targets, optimizer = unpack_factory(spec, factory())
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"{spec!r}: the optimizer FACTORY() returned (4th value) must be a "
                             f"torch.optim.Optimizer (or None), got {type(optimizer).__name__}")
    return ModelSpec(spec, model, inputs, bind_loss(spec, loss_fn, targets), optimizer)


FACTORY_CONTRACT = ("FACTORY() must return (model, inputs), (model, inputs, loss_fn), (model, inputs, loss_fn, "
                    "optimizer), or a dict with keys model, inputs and optionally loss_fn, targets, optimizer; "
                    "loss_fn(output) -> scalar tensor, or loss_fn(output, targets) when targets are given")
_KEYS = ("model", "inputs", "loss_fn", "targets", "optimizer")


def unpack_factory(spec: str, out: Any) -> tuple[Any, Any, Any, Any, Any]:
    """``(model, inputs, loss_fn, targets, optimizer)`` from what ``FACTORY()`` returned."""
    if isinstance(out, dict):
        unknown = sorted(set(out) - set(_KEYS))
        missing = [k for k in ("model", "inputs") if k not in out]
        if unknown or missing:
            what = f"unknown key(s) {unknown}" if unknown else f"missing key(s) {missing}"
            raise ValueError(f"{spec!r}: {what}; {FACTORY_CONTRACT}")
        return tuple(out.get(k) for k in _KEYS)  # type: ignore[return-value]
    if not (isinstance(out, tuple) and len(out) in (2, 3, 4)):
        got = f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
        raise ValueError(f"{spec!r}: {FACTORY_CONTRACT}; got {got}")
    model, inputs, *rest = out
    return model, inputs, rest[0] if rest else None, None, rest[1] if len(rest) > 1 else None


def bind_loss(spec: str, loss_fn: Any, targets: Any) -> Callable[[Any], Any] | None:
    """``loss_fn`` as the one-argument ``loss(output)`` capture calls: with ``targets``, bound as the second
    argument. Refuses a loss that cannot be called that way, showing the signature expected."""
    if loss_fn is None:
        if targets is not None:
            raise ValueError(f"{spec!r}: FACTORY() gave targets but no loss_fn to use them; {FACTORY_CONTRACT}")
        return None
    if not callable(loss_fn):
        raise ValueError(f"{spec!r}: loss_fn is a {type(loss_fn).__name__}, not callable; {FACTORY_CONTRACT}")
    takes = _positional_range(loss_fn)
    wanted = 1 if targets is None else 2
    if takes is not None and not takes[0] <= wanted <= takes[1]:
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        shown = f"{name}{_signature_text(loss_fn)}"
        if targets is None:
            raise ValueError(f"{spec!r}: loss_fn {shown} is called as loss_fn(output), with the model's output only; "
                             "return a one-argument loss (e.g. lambda out: F.cross_entropy(out, y)), or return the "
                             "targets too: dict(model=..., inputs=..., loss_fn=..., targets=y), which calls "
                             "loss_fn(output, targets)")
        raise ValueError(f"{spec!r}: loss_fn {shown} is called as loss_fn(output, targets) since FACTORY() gave "
                         "targets; give a two-argument loss (e.g. nn.CrossEntropyLoss()) or drop the targets")
    if targets is None:
        return loss_fn
    return lambda output: loss_fn(output, targets)


def _callable_target(fn: Any) -> Any:
    """What to inspect: an ``nn.Module``'s ``forward`` (its ``__call__`` takes ``*args``)."""
    forward = getattr(fn, "forward", None)
    return forward if callable(forward) and hasattr(fn, "_call_impl") else fn


def _positional_range(fn: Any) -> tuple[int, float] | None:
    """(required, most) positional arguments ``fn`` takes, or None where Python cannot tell (builtins)."""
    try:
        sig = inspect.signature(_callable_target(fn))
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [q for q in sig.parameters.values() if q.kind in kinds]
    required = sum(q.default is inspect.Parameter.empty for q in params)
    var = any(q.kind is inspect.Parameter.VAR_POSITIONAL for q in sig.parameters.values())
    return required, float("inf") if var else float(len(params))


def _signature_text(fn: Any) -> str:
    try:
        return str(inspect.signature(_callable_target(fn)))
    except (TypeError, ValueError):
        return "(...)"


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
