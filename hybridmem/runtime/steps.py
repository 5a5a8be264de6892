"""Where the program is in its training step: forward, backward, or between steps.

A step starts when a module is called with grad enabled, outside backward, after the previous
backward finished (or after enabling): the model's forward, exactly where ``capture`` starts
recording. Programs that call no module at all start a step at the first stage op on a tensor that
requires grad. A step ends when the autograd engine finishes a backward pass (a callback queued on
the engine at its first op). Ops between steps (optimizer, logging, data preparation) belong to no
step. Stage indices count the ops for which ``is_stage_op`` holds from the step's start, forward then
backward: the predicate capture uses, so a stage index here names the same op as in a Graph.
"""
from __future__ import annotations

from typing import Callable

import torch

IDLE, FORWARD, BACKWARD = 0, 1, 2
_task_id = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled


class Clock:
    """Logical time: ops seen so far. Staleness for the scorer is counted in ops, not seconds, so that
    eviction decisions (and the stats they produce) are the same on every run."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0


class StepTracker:
    """Phase and stage counter of the current step; calls ``on_start``/``on_end`` at step boundaries."""

    def __init__(self, on_start: Callable[[], None], on_end: Callable[[int], None]):
        self.on_start, self.on_end = on_start, on_end
        self.phase = IDLE
        self.stage = -1              # index of the last stage op of the current step
        self.in_backward = False
        self.steps = 0
        self.modules = False         # a module was ever called: steps start at module calls only
        self._ended_task = -1        # graph task of the backward pass that ended the last step

    def epoch(self) -> int:
        """The steps ended so far: it changes once a step (replay validity is checked once per step)."""
        return self.steps

    def in_step(self) -> bool:
        """Whether a training step is running."""
        return self.phase != IDLE

    def observe(self, is_stage: bool, args: tuple) -> int:
        """Note one op (``is_stage``: ``is_stage_op`` holds for it); returns its stage index, or -1
        (not a stage op, or outside a step)."""
        task = _task_id()
        if task != -1:
            if self.phase == IDLE and task == self._ended_task:
                # DDP's reducer and FSDP's root post-backward run ops from final callbacks queued
                # after ours, in the same backward pass: they end this step, they start none.
                return -1
            self.in_backward = True
            if self.phase != BACKWARD:
                self._enter_backward()
        else:
            self.in_backward = False
            if self.phase != FORWARD:
                if self.modules or not (is_stage and _grad_enabled() and _requires_grad(args)):
                    return -1
                self._start()
        if is_stage:
            self.stage += 1
            return self.stage
        return -1

    def module_called(self) -> None:
        """A module's forward is about to run (global forward pre-hook)."""
        self.modules = True
        if self.phase != FORWARD and _grad_enabled() and _task_id() == -1:
            self.in_backward = False
            self._start()

    def saved_seen(self) -> None:
        """Autograd saved a tensor outside backward (the allocator monitor's pack hook, which sees no op):
        a program that calls no module starts its step here."""
        if self.phase == IDLE and _grad_enabled() and _task_id() == -1:
            self._start()

    def backward_seen(self) -> None:
        """A backward pass read a saved tensor (the allocator monitor's unpack hook)."""
        self.in_backward = True
        if self.phase != BACKWARD:
            self._enter_backward()

    @property
    def recording(self) -> bool:
        """Whether ops now belong to a forward computation whose lineage is worth recording."""
        return not self.in_backward and (self.phase == FORWARD or _grad_enabled())

    def _start(self) -> None:
        self.phase = FORWARD
        self.stage = -1
        self.on_start()

    def _enter_backward(self) -> None:
        if self.phase == IDLE:  # a backward pass we saw no forward for: count it from here
            self.stage = -1
            self.on_start()
        self.phase = BACKWARD
        # The engine runs queued callbacks when this backward pass is done (any thread).
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._ended_task = _task_id()
        self.phase = IDLE
        self.in_backward = False
        self.steps += 1
        self.on_end(self.stage + 1)


def _requires_grad(args: tuple) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return True
        elif type(a) in (list, tuple):
            for b in a:
                if isinstance(b, torch.Tensor) and b.requires_grad:
                    return True
    return False
