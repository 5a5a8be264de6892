"""The runtime's record of one saved storage it manages (what policies see of it:
:class:`hybridmem.plugins.base.EntryView`). Below the runtime, so that a policy can build one too (compress
estimates a bare tensor through it)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Entry"]

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
    # runtime bookkeeping (hybridmem.runtime.saved): not for policies
    refs: int = 0                   # live saved-tensor handles; the entry is released at 0
    vshift: int = 0                 # tensor._version + vshift = the version counter the packs saw
    root: Any = None                # weak reference to the tensor whose version counter `tensor` shares
    origin: str = ""                # op around which it was first saved (for error messages)
    view: Any = None                # geometry of `tensor` (a runtime View), to recognise saves of it
    registered: bool = False        # in the allocator's registry: it may free the bytes at any allocation
    priority: float = 0.0           # its order in that registry (lower: freed first)
    written: int = -1               # evicted as it was saved, then written in place: the version seen (else -1)

    @property
    def resident(self) -> bool:
        return self.tensor is not None


_new = object.__new__


def new_entry(tensor: torch.Tensor | None, nbytes: int, dtype: torch.dtype, device: torch.device, lineage: Any,
              version: int, stage: int) -> Entry:
    """``Entry(tensor=..., nbytes=..., ...)`` without the generated ``__init__``'s call overhead (an entry is
    made per saved storage): the fields given here and a fresh ``uid`` are set, the others read their
    defaults from the class until assigned (every default is immutable)."""
    e = _new(Entry)
    e.tensor, e.nbytes, e.dtype, e.device, e.lineage, e.version, e.stage = (tensor, nbytes, dtype, device, lineage,
                                                                           version, stage)
    e.uid = next(_uids)
    return e
