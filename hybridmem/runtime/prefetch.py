"""Online prefetch: start regenerating evicted tensors a few stages before backward reads them.

Without a plan the runtime does not know when backward will read a saved tensor, but training steps
repeat: the previous step's backward read the tensor saved at forward stage ``p`` at backward stage
``s``, so this step starts that tensor's regeneration (``policy.prefetch``: an asynchronous swap-in on
CUDA, a decode ahead of use) at stage ``s - lookahead``. Entries are matched across steps by the stage
that first saved them. Policies whose regeneration is on the compute stream anyway (recompute) have
no ``prefetch`` worth calling and are skipped.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .entry import Entry

if TYPE_CHECKING:
    from .steps import StepTracker

LOOKAHEAD = 4  # stages: enough for a copy to hide behind a few kernels, little extra residency


class Prefetcher:
    """Learns the backward read order of one step (the store tells it each save and read); says what to
    prefetch along it in the next (:meth:`at`, whose entries the caller hands to ``Residency.prefetch``)."""

    def __init__(self, steps: "StepTracker", lookahead: int = LOOKAHEAD):
        self.steps = steps
        self.lookahead = lookahead
        self.plan: dict[int, list[int]] = {}     # stage -> save stages of entries to prefetch then
        self._reads: dict[int, int] = {}         # save stage -> first backward stage that read it
        self.by_save: dict[int, Entry] = {}      # save stage -> entry, this step

    def saved(self, e: Entry) -> None:
        stage = e.stage = self.steps.stage
        if stage >= 0:
            self.by_save.setdefault(stage, e)

    def read(self, e: Entry) -> None:
        stage = self.steps.stage
        if e.stage >= 0 and stage >= 0:
            self._reads.setdefault(e.stage, stage)

    def at(self, stage: int) -> list[Entry]:
        """Backward is at ``stage``: the evicted entries the last step read ``lookahead`` stages later."""
        wanted = self.plan.get(stage)
        if not wanted:
            return []
        entries = []
        for s in wanted:
            e = self.by_save.get(s)
            if e is not None and e.tensor is None and e.policy not in (None, "recompute") and e.refs > 0:
                entries.append(e)
        return entries

    def step_ended(self) -> None:
        plan: dict[int, list[int]] = {}
        for save, read in self._reads.items():
            plan.setdefault(max(read - self.lookahead, 0), []).append(save)
        self.plan, self._reads, self.by_save = plan, {}, {}
