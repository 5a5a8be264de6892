"""What a recorded step allocated between its saves and reads: the room a steady step keeps free at each.

A steady step runs no hook around its ops, only at saves and reads (:mod:`.steady`). After each it keeps
free what the ops up to the next one need, evicting where the allocator alone could not free it. The
recording measures that per position, from the native CPU meter's peak window: from the end of each save
(by its ordinal) or read (by the ordinal of the save it reads) to the end of the next one, the most the
allocator's bytes rose (the next read's rebuild included: near the least budget nothing may be left to
evict for it there). Where one number serves every position, the largest is kept free everywhere, and near
the budget each save then evicts for the step's largest op: backward rebuilds what a recording kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


Rise = tuple[int, int]  # (net, gross) bytes


@dataclass
class Room:
    """Bytes to keep free after each save and read of a recorded step, as ``(net, gross)``. Net: as the
    recorded step rose; gross: with what the dispatch mode evicted in between added back, for a step that
    follows at other sizes (the allocator cannot free for it what the recording evicted)."""

    after_save: list[Rise | None] = field(default_factory=list)  # by save ordinal
    after_read: dict[int, Rise] = field(default_factory=dict)     # by the ordinal of the save read


class RiseRecorder:
    """Measures :class:`Room` during a recording step: :meth:`mark` after each save and read. ``window``: the
    native CPU meter (``window_peak``, ``window_reset``, ``current_bytes``); ``evicted()``: the bytes every
    policy has evicted so far."""

    def __init__(self, window: Any, evicted: Callable[[], int]):
        self.window = window
        self.evicted = evicted
        self.base = -1                 # bytes when the open interval started (-1: none is open)
        self.evicted_base = 0
        self.key = (False, 0)          # (a read, its key) of the open interval
        self.saves: dict[int, Rise] = {}  # save ordinal -> its rise
        self.reads: dict[int, Rise] = {}  # uid of the entry read -> its rise (ordinals at the step's end)
        self.most: Rise = (0, 0)       # the largest of each (the room where no position was measured)

    def mark(self, read: bool, key: int) -> None:
        """Save ``key`` (its ordinal) or the read of entry ``key`` (its uid) is done: the interval the last one
        opened ends, and one starts."""
        self.close()
        self.window.window_reset()
        self.base, self.evicted_base = self.window.current_bytes, self.evicted()
        self.key = (read, key)

    def close(self) -> None:
        """The interval opened by the last save or read ends here."""
        if self.base < 0:
            return
        peak, evicted = self.window.window_peak, self.evicted()
        rise = (max(peak - self.base, 0), max(peak - self.base + evicted - self.evicted_base, 0))
        self.most = (max(self.most[0], rise[0]), max(self.most[1], rise[1]))
        read, key = self.key
        into = self.reads if read else self.saves
        got = into.get(key)
        # a storage read twice: the larger room serves both reads
        into[key] = rise if got is None else (max(got[0], rise[0]), max(got[1], rise[1]))
        self.base = -1

    def room(self, saves: int, first: dict[int, int], extra: int) -> Room:
        """The room of a recorded step of ``saves`` packs. ``first``: entry uid -> the first ordinal that
        saved it; ``extra`` (the residency's reserve) is added to each."""
        self.close()

        def plus(r: Rise) -> Rise:
            return (r[0] + extra, r[1] + extra)
        return Room([plus(self.saves[k]) if k in self.saves else None for k in range(saves)],
                    {first[u]: plus(r) for u, r in self.reads.items() if u in first})
