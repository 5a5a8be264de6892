"""A step that runs out of its budget goes on, uncapped, to measure the budget it needs; then it fails.

The first op a budget cannot hold says little about the rest of the step: the op that fails next needs more,
and a user who retries at each failure's bound creeps up one op at a time. So under a budget, when nothing
more can be evicted for an op (or a regeneration), the runtime does not raise there. It lifts the cap (the
native allocator's budget; on CUDA also the caching allocator's memory fraction), goes on evicting as the
budget asks, and at every op notes what a budget must hold there: the bytes at the op's peak (the native
device's window on the CPU, the caching allocator's peak on CUDA where the op raised it, else its bytes
after the op) less what was evictable then, the op's own inputs excepted. When the next step starts (after
the optimizer's step: its temporaries are measured too), or when the runtime is disabled, it puts the cap
back and raises the first refusal's ``torch.OutOfMemoryError``, naming as ``min_budget_bytes`` the largest
of those, where the ops of the step count what the device holds more when the next one starts than when
theirs did (the state an optimizer's first step creates is there in every later step): the least budget under which every op had
room with everything evictable evicted. The step's results are those of an uncapped step, so the error
stops the training loop there.

``plugins: {survey: false}`` raises at the first refusal instead (the cap is never lifted, even by a step
that fails), naming only a lower bound.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..graph.units import fmt_bytes


@dataclass
class Survey:
    """What an over-budget step has shown so far."""

    first: torch.OutOfMemoryError   # the refusal that started it
    budget: int
    need: int = 0                   # the most a budget must hold at one point seen so far
    where: str = ""                 # there
    step_need: int = 0              # the most at one point inside a step (forward and backward)
    step_where: str = ""
    held_at_start: int = 0          # the device's bytes when the (last) step measured started
    steps_ended: int = 0            # steps that ended since it started
    ops: int = 0                    # ops measured

    def note(self, need: int, where: str, in_step: bool) -> None:
        if need > self.need:
            self.need, self.where = need, where
        if in_step and need > self.step_need:
            self.step_need, self.step_where = need, where

    def error(self, held_now: int) -> torch.OutOfMemoryError:
        """The OOM to raise at its end (``held_now``: the device's bytes then): the first refusal's, naming what
        the step needed, its ops counting what the device holds more now than when the step started."""
        grown = self.step_need + max(0, held_now - self.held_at_start) if self.steps_ended else 0
        if grown > self.need:
            self.need, self.where = grown, f"{self.step_where}, with what the optimizer's step added"
        need = max(self.need, self.budget + 1)
        text = str(self.first)
        first = text.split(". Smallest budget", 1)[0]
        resident = text[text.index("Resident: "):].split(" A budget that works", 1)[0] if "Resident: " in text else ""
        err = torch.OutOfMemoryError(
            f"{first}. The step went on without the cap to measure what it needs: a budget of "
            f"{fmt_bytes(need)} ({need} bytes) holds every op of it (the tightest: {self.where}, with everything "
            f"evictable evicted; {self.ops} ops measured, the optimizer's step included). Retry at that budget "
            f"(`min_budget_bytes`); plugins: {{survey: false}} fails at the first op instead, without exceeding "
            f"the cap. At the first refusal: {resident}")
        err.min_budget_bytes = need
        return err
