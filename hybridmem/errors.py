"""Exceptions raised by hybridmem. Each message says what was wrong and what is accepted."""
from __future__ import annotations


class HybridMemError(Exception):
    """Base class of every hybridmem error."""


class GraphFormatError(HybridMemError, ValueError):
    """A graph file or dict is malformed, truncated or inconsistent."""


class PlanFormatError(HybridMemError, ValueError):
    """A plan file or dict is malformed, truncated or inconsistent."""


class StalePlanError(HybridMemError, ValueError):
    """A plan was made for a different graph (its graph hash does not match)."""


class InfeasiblePlanError(HybridMemError, ValueError):
    """A plan breaks a rule of the simulator (a missing input, memory over budget, ...).

    ``stage``, ``tensor`` and ``reason`` name the first violation found.
    """

    def __init__(self, stage: int, tensor: int | None, reason: str):
        self.stage, self.tensor, self.reason = stage, tensor, reason
        where = f"stage {stage}" + (f", tensor {tensor}" if tensor is not None else "")
        super().__init__(f"infeasible plan at {where}: {reason}")


class BudgetInfeasibleError(HybridMemError, ValueError):
    """No plan of the requested kind fits the budget; ``minimum_bytes`` is the least that does (or a lower bound)."""

    def __init__(self, message: str, minimum_bytes: int | None = None):
        self.minimum_bytes = minimum_bytes
        super().__init__(message)


class UnknownNameError(HybridMemError, ValueError):
    """An unknown device model, solver, policy or codec name."""

    def __init__(self, what: str, name: str, known: list[str] | tuple[str, ...]):
        self.what, self.name, self.known = what, name, tuple(known)
        super().__init__(f"unknown {what} {name!r}; known: {', '.join(sorted(self.known))}")


class CaptureError(HybridMemError, RuntimeError):
    """The model (or its loss) raised while being captured; the message says where."""


class StepDivergedError(HybridMemError, RuntimeError):
    """A steady-state step left its recorded program part-way after the allocator had already freed tensors
    it had matched to the program by their saves alone: rebuilding them by the recorded ops could give wrong
    values, so the step stops rather than train on them. The next step records anew."""

