"""A step that runs out of its budget goes on, uncapped, to measure the budget it needs; then it fails.

The first op a budget cannot hold says little about the rest of the step: the op that fails next needs more,
and a user who retries at each failure's bound creeps up one op at a time. So under a budget, when nothing
more can be evicted for an op (or a regeneration), the runtime does not raise there. It lifts the cap (the
native allocator's budget; on CUDA also the caching allocator's memory fraction), goes on evicting as the
budget asks, and at every op notes what a budget must hold there: the bytes at the op's peak (the native
device's window on the CPU, the caching allocator's peak on CUDA where the op raised it, else its bytes
after the op) less what was evictable then, the op's own inputs excepted; from then on it evicts for the most
it has needed so far, as a run at the budget it will name would. When the step ends (the first step that
ends after the refusal: a refusal between steps, in the optimizer's step or while the model is built,
measures the next step whole), it puts the cap back and raises the first refusal's
``torch.OutOfMemoryError`` from ``backward()``, naming as ``min_budget_bytes`` the largest of those, and 1 %
to spare (a run at that budget evicts a little differently): the least budget under which every op had room
with everything evictable evicted. Where the optimizers that step
the model have no state yet (their first step makes it, sized without stepping them:
:func:`hybridmem.graph.optstate.optimizer_state`), the step's need plus that state counts, and the next step,
which holds it, is measured too before the error. The steps' results are those of uncapped steps, so the
error stops the training loop there; a runtime disabled first raises it at ``disable()``.

``plugins: {survey: false}`` raises at the first refusal instead (the cap is never lifted, even by a step
that fails), naming only a lower bound.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..graph.units import fmt_bytes

SPARE = 0.01  # beyond the need measured, in the budget named


@dataclass
class Survey:
    """What an over-budget step has shown so far."""

    first: torch.OutOfMemoryError   # the refusal that started it
    budget: int
    need: int = 0                   # the most a budget must hold at one point seen so far
    where: str = ""                 # there
    step_need: int = 0              # the most at one point inside a step (forward and backward)
    step_where: str = ""
    steps_ended: int = 0            # steps that ended since it started
    ops: int = 0                    # ops measured
    inputs: list[str] = field(default_factory=list)  # the shapes of each measured step's inputs, where known

    def note(self, need: int, where: str, in_step: bool) -> None:
        if need > self.need:
            self.need, self.where = need, where
        if in_step and need > self.step_need:
            self.step_need, self.step_where = need, where

    def carry(self, state_to_come: int) -> None:
        """The measured step ended before the optimizers' first step: what it needed plus the state to come is
        a need of the next step, which is measured too."""
        self.note(self.step_need + state_to_come,
                  f"{self.step_where}, with the {fmt_bytes(state_to_come)} of optimizer state to come", False)
        self.step_need, self.step_where = 0, ""

    def error(self, state_to_come: int) -> torch.OutOfMemoryError:
        """The OOM to raise at its end: the first refusal's, naming what the step needed, its ops counting the
        optimizer state to come (``state_to_come`` bytes, which every later step will hold)."""
        if state_to_come and self.step_need + state_to_come > self.need:
            self.need = self.step_need + state_to_come
            self.where = f"{self.step_where}, with the {fmt_bytes(state_to_come)} of optimizer state to come"
        # 1 % to spare: a run at the budget named evicts a little differently (what a rebuild holds, and when)
        need = max(math.ceil(self.need * (1 + SPARE)), self.budget + 1)
        text = str(self.first)
        first = text.split(". Smallest budget", 1)[0]
        resident = text[text.index("Resident: "):].split(" A budget that works", 1)[0] if "Resident: " in text else ""
        err = torch.OutOfMemoryError(
            f"{first}. The step went on without the cap to measure what it needs: a budget of "
            f"{fmt_bytes(need)} ({need} bytes) holds every op of it (the tightest: {self.where}, with everything "
            f"evictable evicted, and {SPARE:.0%} to spare; {self.ops} ops measured). Retry at that budget "
            f"(`min_budget_bytes`); plugins: {{survey: false}} fails at the first op instead, without exceeding "
            f"the cap.{self._inputs_said()} At the first refusal: {resident}")
        err.min_budget_bytes = need
        return err

    def _inputs_said(self) -> str:
        """The measured steps' inputs: a step with larger ones (a batch padded to its own length) may need more
        than the budget named."""
        if not self.inputs:
            return ""
        said = "; then ".join(dict.fromkeys(self.inputs))
        steps = "a step" if len(self.inputs) == 1 else "steps"
        return (f" It was measured on {steps} whose inputs were {said}: a step with larger ones (a longer padded "
                "batch) may need more, and then fails naming its own budget; a first step on the largest batch, "
                "or padding to one length (pad_to_multiple_of, max_length), gives one budget for every step.")
