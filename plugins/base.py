"""The one small protocol every regeneration policy implements, and the registry that finds them by name.

A policy sees an :class:`Entry` (one saved storage the runtime manages) and offers to evict it and
regenerate it later. The scorer and the solvers only see its ``cost`` and ``savings``. A new policy is
one file: a class with these methods, registered with :func:`register` or through the
``hybridmem.plugins`` entry-point group.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from hybridmem.errors import UnknownNameError

_uids = itertools.count()


@dataclass(eq=False)
class Entry:
    """One device storage saved for backward and managed by the runtime.

    ``tensor`` is a tensor that covers the whole storage (so views can be rebuilt from it) while the
    bytes are on the device, and ``None`` while evicted. ``handle`` is what the evicting policy keeps.
    """

    tensor: torch.Tensor | None
    nbytes: int
    dtype: torch.dtype
    device: torch.device
    stage: int = -1                 # runtime op counter when it was produced/saved
    version: int = 0                # storage version counter at save time (in-place detection)
    policy: str | None = None       # name of the policy holding it while evicted
    handle: Any = None
    lineage: Any = None             # recompute information, owned by the recompute policy/runtime
    deterministic: bool = True      # produced by a deterministic op (safe to recompute)
    last_access: float = 0.0        # runtime clock of the last pack/unpack (staleness for the scorer)
    pinned: int = 0                 # >0 while in use by a running op: never evicted
    uid: int = field(default_factory=lambda: next(_uids))

    @property
    def resident(self) -> bool:
        return self.tensor is not None


@runtime_checkable
class Policy(Protocol):
    """Evict a saved tensor and regenerate it on demand."""

    name: str
    lossless: bool

    def applicable(self, entry: Entry) -> bool:
        """Whether this policy can evict ``entry`` (dtype, device, determinism, ...)."""

    def cost(self, entry: Entry) -> float:
        """Estimated seconds the compute stream loses to regenerate ``entry`` (hidden copy time excluded)."""

    def savings(self, entry: Entry) -> int:
        """Device bytes freed by evicting ``entry``."""

    def evict(self, entry: Entry) -> Any:
        """Release the device bytes of ``entry``; return the handle needed to regenerate it."""

    def prefetch(self, entry: Entry) -> None:
        """Start regenerating ``entry`` ahead of use (asynchronous where the device allows); may do nothing."""

    def regenerate(self, entry: Entry) -> torch.Tensor:
        """Return a tensor covering the whole storage of ``entry``, bit-identical for lossless policies."""


_REGISTRY: dict[str, Callable[..., Policy]] = {}


def register(name: str, factory: Callable[..., Policy]) -> None:
    """Register a policy factory under ``name`` (in-process registry; overrides entry points)."""
    _REGISTRY[name] = factory


def known_policies() -> dict[str, Callable[..., Policy]]:
    """All policies: the built-in ones, entry points of group ``hybridmem.plugins``, then registered ones."""
    from importlib.metadata import entry_points

    found: dict[str, Callable[..., Policy]] = {}
    for ep in entry_points(group="hybridmem.plugins"):
        found.setdefault(ep.name, ep.load)  # load lazily: a broken third-party plugin only fails when used
    found.update({k: (lambda f=f: f) for k, f in _builtin().items()})
    found.update({k: (lambda f=f: f) for k, f in _REGISTRY.items()})
    return {k: v() for k, v in found.items()}


def get_policy(name: str, **kwargs: Any) -> Policy:
    """Instantiate the policy called ``name``; an unknown name lists the known ones."""
    policies = known_policies()
    if name not in policies:
        raise UnknownNameError("policy", name, list(policies))
    return policies[name](**kwargs)


def _builtin() -> dict[str, Callable[..., Policy]]:
    out: dict[str, Callable[..., Policy]] = {}
    for mod, cls, key in (("swap", "SwapPolicy", "swap"), ("recompute", "RecomputePolicy", "recompute"),
                          ("compress", "CompressPolicy", "compress")):
        try:
            module = __import__(f"hybridmem.plugins.{mod}", fromlist=[cls])
        except ImportError:
            continue  # not written yet / optional dependency missing: the entry point reports it when used
        out[key] = getattr(module, cls)
    return out
