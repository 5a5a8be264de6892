"""The CUDA caching allocator's settings a budget needs: expandable segments.

Under a cap the caching allocator fragments: a step that frees and allocates activations of many sizes
leaves its fixed-size segments holding free blocks too small for the next request, and a new segment
does not fit under the cap (measured: docs/benchmarks.md, "Measured constants and design choices"). With expandable segments each stream's memory is one virtual
range mapped page by page, so freed blocks coalesce with their neighbours and the cap counts pages
actually mapped. Setting it affects segments made from then on, so the runtime sets it before it empties
the allocator's cache (:func:`hybridmem.runtime.meter.cap_cuda`), and the environment-variable path does
so before the program's first CUDA allocation.

The user's own setting wins: where ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``, or the
allocator's current settings string) names ``expandable_segments`` it is left as it is, and
``plugins: {expandable: false}`` leaves the allocator alone (expandable segments do not support sharing
CUDA tensors between processes through IPC).

torch re-parses the *whole* settings string it is given and first resets the keys the string does not
name (``max_split_size_mb``, ``roundup_power2_divisions``, ``garbage_collection_threshold``), so the
runtime passes the current string with ``expandable_segments:True`` appended, and :class:`SavedAllocator`
puts the old string and the old memory fraction back when the runtime is uninstalled (the settings are
process-wide: later code, CUDA IPC included, sees the allocator as the user configured it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
KEY = "expandable_segments"
SETTING = f"{KEY}:True"
# What an expandable segment may add to a request at the fraction check (its page rounding): a new
# segment, or a grown one, needs this much room under the cap beyond the bytes asked for.
EXPANDABLE_SLACK = 20 << 20


def named(settings: str | None) -> str | None:
    """The value ``settings`` (an allocator settings string) gives expandable segments, else None."""
    for item in (settings or "").split(","):
        key, _, value = item.partition(":")
        if key.strip() == KEY:
            return value.strip()
    return None


def user_choice(environ: Mapping[str, str] | None = None) -> str | None:
    """The user's expandable-segments setting from the environment (``"True"``/``"False"``), else None."""
    env = os.environ if environ is None else environ
    for var in ENV_VARS:
        value = named(env.get(var))
        if value is not None:
            return value
    return None


def _getter() -> Callable[[], str] | None:
    """torch's entry point reading the allocator's current settings string (torch 2.9 on), else None."""
    return getattr(torch._C, "_accelerator_getAllocatorSettings", None)


def current_settings(getter: Callable[[], str] | None = None,
                     environ: Mapping[str, str] | None = None) -> str:
    """The allocator's settings string now: torch's where it can say, else what the environment gave it at
    start-up (a torch without the getter cannot have been reconfigured but through its setter, which
    hybridmem alone calls here)."""
    fn = getter or _getter()
    if fn is not None:
        try:
            return str(fn() or "")
        except RuntimeError:  # an allocator that keeps no string
            pass
    env = os.environ if environ is None else environ
    for var in reversed(ENV_VARS):  # PYTORCH_ALLOC_CONF wins where both are set
        if env.get(var):
            return env[var]
    return ""


def with_setting(settings: str, value: str) -> str:
    """``settings`` with ``expandable_segments:value`` appended (the rest kept: torch resets what the string
    it parses leaves out)."""
    kept = [item for item in settings.split(",") if item.strip() and item.partition(":")[0].strip() != KEY]
    return ",".join([*kept, f"{KEY}:{value}"])


def _setter() -> Callable[[str], None] | None:
    """torch's runtime entry point for allocator settings (its name moved between releases)."""
    for name in ("_accelerator_setAllocatorSettings", "_cuda_cudaCachingAllocator_set_allocator_settings"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            return fn
    return None


def prefer_expandable_segments(environ: Mapping[str, str] | None = None,
                               setter: Callable[[str], None] | None = None,
                               getter: Callable[[], str] | None = None) -> str:
    """Make the caching allocator's new segments expandable unless the user chose, keeping the user's other
    settings; returns what was done, in words, for ``stats().notes``."""
    chosen = user_choice(environ)
    if chosen is not None:
        return f"CUDA allocator: expandable_segments:{chosen} as the environment sets it"
    settings = current_settings(getter, environ)
    chosen = named(settings)
    if chosen is not None:
        return f"CUDA allocator: expandable_segments:{chosen} as its settings ({settings}) say"
    fn = setter or _setter()
    if fn is None:
        return "CUDA allocator: this torch has no runtime setting for expandable segments; its cache may fragment"
    try:
        fn(with_setting(settings, "True"))
    except RuntimeError as e:  # a build whose allocator does not support them (ROCm, old drivers)
        return f"CUDA allocator: expandable segments refused ({e}); its cache may fragment under the cap"
    return "CUDA allocator: expandable segments (freed blocks coalesce under the cap)"


def _fraction(device: torch.device) -> float:
    """The device's per-process memory fraction now (1.0 where this torch cannot say)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return 1.0 if get is None else float(get(device))


@dataclass(frozen=True)
class SavedAllocator:
    """What the runtime changes in a CUDA device's caching allocator, as it was: the settings string and the
    per-process memory fraction. :meth:`restore` puts both back."""

    device: torch.device
    settings: str
    fraction: float

    @classmethod
    def now(cls, device: torch.device, getter: Callable[[], str] | None = None,
            environ: Mapping[str, str] | None = None) -> "SavedAllocator":
        return cls(device, current_settings(getter, environ), _fraction(device))

    def restore(self, setter: Callable[[str], None] | None = None, getter: Callable[[], str] | None = None) -> None:
        """The old fraction, and the old settings where they changed. A string that named no
        ``expandable_segments`` comes back with ``expandable_segments:False``: parsing a string leaves the
        keys it does not name to the allocator's defaults, except this one, which it leaves as it is."""
        torch.cuda.set_per_process_memory_fraction(self.fraction, self.device)
        if (getter or _getter()) is not None and current_settings(getter) == self.settings:
            return  # unchanged (without the getter it cannot be told: set again, which is harmless)
        fn = setter or _setter()
        if fn is not None:
            old = self.settings if named(self.settings) is not None else with_setting(self.settings, "False")
            fn(old)
