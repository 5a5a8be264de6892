"""The runtime's decision ledger: one record per eviction of a saved tensor (what, when, by which policy,
what bringing it back cost), kept bounded. :func:`hybridmem.report.build_report` reads it from
``Stats.tensors``."""
from __future__ import annotations

from collections import deque
from typing import Any

__all__ = ["TensorLog"]


class TensorLog:
    """Per-tensor record the runtime may keep (bounded): one dict per eviction of a saved storage.

    Hook-up (a few lines in the runtime): ``Residency.evict`` calls ``log.evicted(entry, policy_name,
    stage)`` and ``Residency.ensure`` calls ``log.regenerated(entry, regen_s, stall_s)``; the snapshot
    carries ``log.records()`` as ``Stats.tensors``. Entries are matched by ``entry.uid``; only the last
    ``limit`` evictions are kept, so a long run costs bounded memory.
    """

    def __init__(self, limit: int = 4096):
        self._open: dict[int, dict[str, Any]] = {}
        self._done: Any = deque(maxlen=limit)

    def evicted(self, entry: Any, policy: str, stage: int = -1) -> None:
        rec = {"uid": entry.uid, "stage": int(getattr(entry, "stage", -1)), "evicted_at": stage,
               "op": getattr(entry, "origin", ""), "nbytes": int(entry.nbytes), "decision": policy,
               "regen_s": None, "stall_s": None}
        if len(self._done) == self._done.maxlen:  # the oldest record drops out: stop updating it
            old = self._done[0]
            if self._open.get(old["uid"]) is old:
                del self._open[old["uid"]]
        self._open[entry.uid] = rec
        self._done.append(rec)

    def regenerated(self, entry: Any, regen_s: float, stall_s: float) -> None:
        rec = self._open.pop(entry.uid, None)
        if rec is not None:
            rec["regen_s"] = (rec["regen_s"] or 0.0) + regen_s
            rec["stall_s"] = (rec["stall_s"] or 0.0) + stall_s

    def records(self) -> tuple[dict[str, Any], ...]:
        return tuple({k: v for k, v in r.items() if k != "uid"} for r in self._done)

    def clear(self) -> None:
        self._open.clear()
        self._done.clear()
