"""The CUDA caching allocator's settings a budget needs: expandable segments.

Under a cap the caching allocator fragments: a step that frees and allocates activations of many sizes
leaves its fixed-size segments holding free blocks too small for the next request, and a new segment
does not fit under the cap (GPT-2 small at ``torch.utils.checkpoint``'s peak was refused with 3.37 GiB of
its cap unallocated, H100, 2026-12-05). With expandable segments each stream's memory is one virtual
range mapped page by page, so freed blocks coalesce with their neighbours and the cap counts pages
actually mapped. Setting it affects segments made from then on, so the runtime sets it before it empties
the allocator's cache (:func:`~.meter.cap_cuda`), and the environment-variable path does so before the
program's first CUDA allocation.

The user's own setting wins: where ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) names
``expandable_segments`` it is left as it is, and ``plugins: {expandable: false}`` leaves the allocator
alone (expandable segments do not support sharing CUDA tensors between processes through IPC).
"""
from __future__ import annotations

import os
from typing import Callable, Mapping

import torch

ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
SETTING = "expandable_segments:True"


def user_choice(environ: Mapping[str, str] | None = None) -> str | None:
    """The user's expandable-segments setting from the environment (``"True"``/``"False"``), else None."""
    env = os.environ if environ is None else environ
    for var in ENV_VARS:
        for item in (env.get(var) or "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip()
    return None


def _setter() -> Callable[[str], None] | None:
    """torch's runtime entry point for allocator settings (its name moved between releases)."""
    for name in ("_accelerator_setAllocatorSettings", "_cuda_cudaCachingAllocator_set_allocator_settings"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            return fn
    return None


def prefer_expandable_segments(environ: Mapping[str, str] | None = None,
                               setter: Callable[[str], None] | None = None) -> str:
    """Make the caching allocator's new segments expandable unless the user chose; returns what was done, in
    words, for ``stats().notes``."""
    chosen = user_choice(environ)
    if chosen is not None:
        return f"CUDA allocator: expandable_segments:{chosen} as the environment sets it"
    fn = setter or _setter()
    if fn is None:
        return "CUDA allocator: this torch has no runtime setting for expandable segments; its cache may fragment"
    try:
        fn(SETTING)
    except RuntimeError as e:  # a build whose allocator does not support them (ROCm, old drivers)
        return f"CUDA allocator: expandable segments refused ({e}); its cache may fragment under the cap"
    return "CUDA allocator: expandable segments (freed blocks coalesce under the cap)"
