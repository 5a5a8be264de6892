"""The one small protocol every regeneration policy implements, and the registry that finds them by name.

A policy sees an :class:`EntryView` (one saved storage the runtime manages) and offers to evict it and
regenerate it later. The scorer and the solvers only see its ``cost`` and ``savings``. A new policy is
one file: a class with these methods, registered with :func:`register` or through the
``hybridmem.plugins`` entry-point group.
"""
from __future__ import annotations

import importlib
import inspect
from importlib.metadata import entry_points
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from hybridmem.errors import UnknownNameError


class EvictionDeclined(Exception):
    """Raised by ``Policy.evict`` where the policy's decision for the entry's bytes, made now, differs from
    the offer it scored with (compress: a codec that paid for the same recorded tensor a step earlier does
    not pay for these bytes). The entry stays resident; the runtime picks another victim."""


class EntryView(Protocol):
    """What a policy sees of one saved storage the runtime manages (the runtime's record is
    :class:`hybridmem.entry.Entry`, which has more fields that are the runtime's own).

    ``tensor`` covers the whole storage while the bytes are on the device and is ``None`` while evicted;
    ``handle`` is what the evicting policy keeps. A policy that regenerates a tensor with a fresh version
    counter sets ``vshift`` so the runtime's in-place check still matches (``tensor._version + vshift``).
    """

    tensor: torch.Tensor | None
    nbytes: int
    dtype: torch.dtype
    device: torch.device
    stage: int                      # runtime op counter when it was produced/saved
    version: int                    # storage version counter at save time (in-place detection)
    policy: str | None              # name of the policy holding it while evicted
    handle: Any
    lineage: Any                    # recompute information, owned by the recompute policy/runtime
    deterministic: bool             # produced by a deterministic op (safe to recompute)
    last_access: float              # runtime clock of the last pack/unpack (staleness for the scorer)
    pinned: int                     # >0 while in use by a running op: never evicted
    uid: int
    vshift: int

    @property
    def resident(self) -> bool: ...


@runtime_checkable
class Policy(Protocol):
    """Evict a saved tensor and regenerate it on demand."""

    name: str
    lossless: bool

    def applicable(self, entry: EntryView) -> bool:
        """Whether this policy can evict ``entry`` (dtype, device, determinism, ...)."""

    def cost(self, entry: EntryView) -> float:
        """Estimated seconds the compute stream loses to regenerate ``entry`` (hidden copy time excluded)."""

    def savings(self, entry: EntryView) -> int:
        """Device bytes freed by evicting ``entry``."""

    def evict(self, entry: EntryView) -> Any:
        """Release the device bytes of ``entry``; return the handle needed to regenerate it."""

    def prefetch(self, entry: EntryView) -> None:
        """Start regenerating ``entry`` ahead of use (asynchronous where the device allows); may do nothing."""

    def regenerate(self, entry: EntryView) -> torch.Tensor:
        """Return a tensor covering the whole storage of ``entry``, bit-identical for lossless policies."""


_REGISTRY: dict[str, Callable[..., Policy]] = {}
# Built-in policies: name -> (module, class). Imported only when asked for, so a policy whose optional
# dependency is missing fails when it is used, naming itself, and never breaks the others.
_BUILTIN = {"swap": ("hybridmem.plugins.swap", "SwapPolicy"),
            "recompute": ("hybridmem.plugins.recompute", "RecomputePolicy"),
            "compress": ("hybridmem.plugins.compress", "CompressPolicy")}


def register(name: str, factory: Callable[..., Policy]) -> None:
    """Register a policy factory under ``name`` (in-process registry; overrides built-ins and entry points)."""
    _REGISTRY[name] = factory


def known_policy_names() -> list[str]:
    """Names of all policies: built-in, entry points of group ``hybridmem.plugins``, and registered ones."""
    return sorted({*_BUILTIN, *(ep.name for ep in _entry_points()), *_REGISTRY})


def get_policy(name: str, **kwargs: Any) -> Policy:
    """Instantiate the policy called ``name``; an unknown name lists the known ones, an unknown option
    (a ValueError) the accepted ones."""
    factory = _REGISTRY.get(name)
    if factory is None and name in _BUILTIN:
        module, cls = _BUILTIN[name]
        factory = getattr(importlib.import_module(module), cls)
    if factory is None:
        eps = [ep for ep in _entry_points() if ep.name == name]
        if not eps:
            raise UnknownNameError("policy", name, known_policy_names())
        factory = eps[0].load()
    _check_options(name, factory, kwargs)
    try:
        return factory(**kwargs)
    except TypeError as e:  # a value of the wrong type, found by the policy itself
        raise ValueError(f"policy {name!r}: bad options {kwargs}: {e}") from None


def _check_options(name: str, factory: Callable[..., Policy], options: dict[str, Any]) -> None:
    """Refuse keyword options ``factory`` does not take, listing those it does (where its signature says)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return  # it checks its own options
    accepted = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"policy {name!r}: unknown option(s) {unknown}; accepted: {accepted or 'none'}")


def _entry_points() -> list[Any]:
    return [ep for ep in entry_points(group="hybridmem.plugins") if ep.name not in _BUILTIN]
