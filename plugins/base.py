"""The one small protocol every regeneration policy implements, the hints it gives the runtime, and the
registry that finds policies by name.

A policy sees an :class:`EntryView` (one saved storage the runtime manages) and offers to evict it and
regenerate it later. The scorer and the solvers only see its ``cost`` and ``savings``. A new policy is
one file: a class with the :class:`Policy` methods, registered with :func:`register` or through the
``hybridmem.plugins`` entry-point group.

Everything else the runtime reads of a policy is one :class:`PolicyHints`: facts the policy declares as a
class attribute (``hints = PolicyHints(moves_to_host=True)``), and its optional methods (``bind``,
``step_ended``, ``release``, ``in_flight``, ``device_tensors``, ``registration_cost``), which stay
ordinary methods under those names. The runtime calls :func:`hints_of` once per policy when it builds
them: it binds the optional methods it finds (a missing one is None: the runtime skips that call, so
there is no base class to inherit and no no-op to pay for per op). A policy written before hints existed,
with the old attributes (``moves_to_host``, ``allocates_to_evict``, ``dynamic_cost``, ``metered``,
``lossy_codecs``) and no ``hints``, gets the same behaviour from them.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, replace
from importlib.metadata import entry_points
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

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


@dataclass(frozen=True)
class PolicyHints:
    """What the runtime reads of a policy besides the :class:`Policy` methods, read once per runtime.

    The defaults are what the runtime assumes of a policy that declares nothing. The first five fields
    are facts a policy declares (class attribute ``hints``); the rest are its optional methods, which
    :func:`hints_of` binds from the policy's methods of the same name (one given here, e.g. in an
    instance's ``hints``, is used instead).
    """

    # The handle keeps its bytes in host memory: on the simulated CPU device no tensor in it is counted as
    # device memory (host copies are CPU tensors there too). False: every device tensor in the handle counts
    # (a compressed copy), unless ``device_tensors`` names them.
    moves_to_host: bool = False
    # Its eviction allocates on the device before it frees (an encoding buffer): the runtime keeps 1/32 of the
    # budget free when making room, so that the eviction can run at the cap.
    allocates_to_evict: bool = False
    # Its cost for an entry changes with other entries' state (recompute's chain): asked at each scoring pass,
    # never cached with the entry's offer.
    dynamic_cost: bool = False
    # Its regeneration runs ordinary ops that the dispatch mode meters and caps one by one; False: it runs
    # unmetered and the tensor it returns is counted as a whole.
    metered: bool = False
    # ``plugins: {verify: true}`` hashes what it evicts and checks the regenerated bytes; False where they may
    # differ by design (lossy codecs).
    verifiable: bool = True

    # bind(runtime): called once, after the runtime built its parts (the budget, recompute's replayer)
    bind: Callable[[Any], None] | None = None
    # step_ended(): called at each training step's end (swap: fold the copies' timings in)
    step_ended: Callable[[], None] | None = None
    # release(entry): an entry it evicted once has died: free what it keeps for it (a host copy)
    release: Callable[[EntryView], None] | None = None
    # in_flight(entry): its regeneration already holds its device bytes (a prefetched swap-in): no room made
    in_flight: Callable[[EntryView], bool] | None = None
    # device_tensors(handle): the device tensors a handle keeps, counted on the simulated device
    device_tensors: Callable[[Any], Iterable[torch.Tensor]] | None = None
    # registration_cost(entry): cost(entry) where applicable(entry), else None, in one pass (recompute: asked
    # for each new entry near the budget, to order the allocator's registry)
    registration_cost: Callable[[EntryView], float | None] | None = None


# The optional methods among PolicyHints' fields: hints_of binds them from the policy.
_METHODS = ("bind", "step_ended", "release", "in_flight", "device_tensors", "registration_cost")


def hints_of(policy: Any) -> PolicyHints:
    """``policy``'s hints, its optional methods bound: its declared ``hints`` (or, for a policy that declares
    none, the old attributes), with the old attributes a subclass sets below the class declaring them."""
    declared = getattr(policy, "hints", None)
    if declared is None:
        declared = PolicyHints(**_old_facts(policy, lambda name, default: getattr(policy, name, default)))
    elif not isinstance(declared, PolicyHints):
        raise TypeError(f"policy {getattr(policy, 'name', policy)!r}: hints must be a "
                        f"hybridmem.plugins.base.PolicyHints, got {type(declared).__name__}")
    else:
        declared = replace(declared, **_old_facts_below_hints(policy))
    methods = {n: getattr(declared, n) or getattr(policy, n, None) for n in _METHODS}
    return replace(declared, **methods)


def _old_facts(policy: Any, read: Callable[[str, Any], Any]) -> dict[str, bool]:
    """The facts of a policy without ``hints``, from the attributes the runtime read before hints existed,
    with the defaults it read them with (swap moved its bytes to the host by name)."""
    return {"moves_to_host": bool(read("moves_to_host", getattr(policy, "name", None) == "swap")),
            "allocates_to_evict": bool(read("allocates_to_evict", False)),
            "dynamic_cost": bool(read("dynamic_cost", False)),
            "metered": bool(read("metered", False)),
            "verifiable": not read("lossy_codecs", None)}


# The old attributes, by the field each one sets (lossy_codecs: verifiable when empty)
_OLD_NAMES = {"moves_to_host": "moves_to_host", "allocates_to_evict": "allocates_to_evict",
              "dynamic_cost": "dynamic_cost", "metered": "metered", "lossy_codecs": "verifiable"}


def _old_facts_below_hints(policy: Any) -> dict[str, bool]:
    """The facts old attributes set in subclasses below the class that declares ``hints`` (a user's subclass
    of a built-in policy, written before hints existed, that overrides one): they win, as they did."""
    below: dict[str, Any] = {}
    for klass in type(policy).__mro__:
        if "hints" in vars(klass):
            break
        for name in _OLD_NAMES:
            if name in vars(klass) and name not in below:
                below[name] = vars(klass)[name]
    if not below:
        return {}
    facts = _old_facts(policy, below.get)
    return {_OLD_NAMES[name]: facts[_OLD_NAMES[name]] for name in below}


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
