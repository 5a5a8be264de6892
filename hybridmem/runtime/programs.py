"""The step programs a runtime follows, one per input signature.

A transformer fine-tuned with per-batch padding runs the same ops at a new sequence length each batch,
and the last batch of an epoch is shorter: each signature (the shapes and dtypes of the tensor arguments
of the step's first module call) gets its own recorded program. A step whose inputs have a signature
with a program follows it from its first op; one with other sizes may follow the program of the
smallest larger ones (:meth:`ProgramSet.covering`) or, a little larger than all, of the largest smaller ones
(:meth:`ProgramSet.below`), until following them that way has cost more than recording their own would
(:class:`PassCosts`); one larger still runs under the dispatch mode and records one. A step that leaves
its program part-way (its saves differ from the recorded ones) costs that program and one recording; only
a run of such steps backs recording off, never for good.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

import torch

from .program import StepProgram

Signature = tuple[tuple[torch.Size, torch.dtype], ...]

PROGRAMS_KEPT = 32     # signatures kept, least recently followed dropped first (each holds no tensor)
STREAK_BACKOFF = 3     # steps in a row that left their program before recording backs off
MAX_BACKOFF = 64       # the most steps a backed-off runtime goes without recording
# Scaled steps of one signature before it is recorded while the pass costs are not all measured yet
FOLLOWS_UNMEASURED = 8
FOLLOWS_MOST = 1 << 20  # (a scaled step as cheap as its own program's: never recorded)
COST_WEIGHT = 0.25      # weight of the newest pass in a regime's running cost
GROWTH_FOLLOWED = 1.25  # the most a larger step's inputs may have grown past a program it follows
SIGNATURES_COUNTED = 4096  # signatures whose scaled steps are counted (forgotten all at once past it)


def signature_of(shapes: Iterable[tuple[torch.Size, torch.dtype]]) -> Signature:
    return tuple((torch.Size(s), d) for s, d in shapes)


def _numel(shape: torch.Size) -> int:
    return math.prod(shape)


@dataclass
class PassCosts:
    """Host seconds per input element of recent passes, by regime: recording (the dispatch mode), following a
    program recorded for the pass's own inputs, following one of larger inputs (scaled). One clock read per
    pass; on a GPU the host's time is what the dispatch mode costs, and a step's copies wait for the device
    where its results are read."""

    record: float | None = None
    own: float | None = None
    scaled: float | None = None

    def add(self, regime: str, seconds: float, size: int) -> None:
        if size <= 0 or seconds <= 0:
            return
        now = seconds / size
        was = getattr(self, regime)
        setattr(self, regime, now if was is None else was + COST_WEIGHT * (now - was))

    def follows_before_recording(self) -> int:
        """How many scaled steps of one signature before it is recorded: as a rent-or-buy choice, until what
        they cost beyond steps with a program of their own reaches what one recording costs beyond a scaled
        step (each compared per input element)."""
        rec, own, scaled = self.record, self.own, self.scaled
        if rec is None or own is None or scaled is None:
            return FOLLOWS_UNMEASURED
        if rec <= scaled:
            return 0
        if scaled <= own:
            return FOLLOWS_MOST
        return min(math.ceil((rec - scaled) / (scaled - own)), FOLLOWS_MOST)


class ProgramSet:
    """Recorded programs by signature, and when to record another."""

    def __init__(self, limit: int = PROGRAMS_KEPT):
        self.limit = limit
        self.by_signature: OrderedDict[Signature, StepProgram] = OrderedDict()
        self.last: StepProgram | None = None   # the program a step starts with, before its inputs are seen
        self.streak = 0                        # steps in a row that left their program part-way
        self.resume_at = 0                     # after such a streak: the step from which recording resumes
        self.recorded = 0                      # programs recorded since enable()
        self.costs = PassCosts()
        self.scaled_steps: dict[Signature, int] = {}  # signature -> its steps that followed a larger program

    def __len__(self) -> int:
        return len(self.by_signature)

    def get(self, sig: Signature) -> StepProgram | None:
        prog = self.by_signature.get(sig)
        if prog is not None:
            self.by_signature.move_to_end(sig)
            self.last = prog
        return prog

    def covering(self, sig: Signature) -> StepProgram | None:
        """The program recorded for inputs of the same kinds (count, dtypes, dimensions) that are each at least
        as large as ``sig``'s, the smallest such; None if there is none. A step of ``sig`` holds no more than
        that program's step did where it evicts the same saves (runtime.steady, ``_pack_scaled``)."""
        return self._nearest(sig, above=True)

    def below(self, sig: Signature) -> StepProgram | None:
        """The largest program recorded for inputs of the same kinds each at most as large as ``sig``'s."""
        return self._nearest(sig, above=False)

    def _nearest(self, sig: Signature, above: bool) -> StepProgram | None:
        best: tuple[int, StepProgram] | None = None
        for other, prog in self.by_signature.items():
            if len(other) != len(sig) or any(d != od or len(s) != len(os)
                                             or any((a > b) if above else (a < b) for a, b in zip(s, os))
                                             for (s, d), (os, od) in zip(sig, other)):
                continue
            size = sum(_numel(os) for os, _ in other)
            if best is None or (size < best[0] if above else size > best[0]):
                best = (size, prog)
        return None if best is None else best[1]

    def scaled(self, sig: Signature, swap: bool, grow: bool) -> StepProgram | None:
        """The program a step of ``sig`` (which has none of its own) follows scaled, or None: it is recorded.
        Without ``swap`` a program that recomputed is not followed (what it recomputed could not be evicted
        at other sizes: its recorded ops carry the recorded ones), and no smaller one (swap evicts what a
        larger step needs beyond it); without ``grow`` no smaller one either."""
        seen = self.scaled_steps.get(sig, 0)
        if seen >= self.costs.follows_before_recording():
            return None
        near = self.covering(sig)
        if near is None and swap and grow and (below := self.below(sig)) is not None \
                and growth(sig, below) <= GROWTH_FOLLOWED:
            near = below
        if near is not None and near.recomputed and not swap:
            return None
        if near is not None:
            if len(self.scaled_steps) >= SIGNATURES_COUNTED:
                self.scaled_steps.clear()
            self.scaled_steps[sig] = seen + 1
        return near

    def record_next(self, sig: Signature) -> None:
        """The next step of ``sig`` is recorded (a step of it that followed another program went past the budget)."""
        self.scaled_steps[sig] = FOLLOWS_MOST

    def add(self, prog: StepProgram) -> list[StepProgram]:
        """Keep ``prog`` for its signature; returns the programs it displaced (to unbind)."""
        sig = signature_of(prog.input_shapes)
        dropped = [old] if (old := self.by_signature.pop(sig, None)) is not None else []
        self.by_signature[sig] = prog
        while len(self.by_signature) > self.limit:
            dropped.append(self.by_signature.popitem(last=False)[1])
        self.last = prog
        self.recorded += 1
        return dropped

    def left(self, prog: StepProgram | None, step: int) -> int:
        """A step left ``prog`` part-way: forget it. Returns the step recording resumes at (0: the next)."""
        self.drop(prog)
        self.streak += 1
        if self.streak < STREAK_BACKOFF:
            return 0
        self.resume_at = step + min(2 ** (self.streak - STREAK_BACKOFF + 1), MAX_BACKOFF)
        return self.resume_at

    def drop(self, prog: StepProgram | None) -> None:
        """Forget ``prog``: the next step of its signature is recorded again."""
        if prog is not None:
            sig = signature_of(prog.input_shapes)
            if self.by_signature.get(sig) is prog:
                del self.by_signature[sig]
        if self.last is prog:
            self.last = next(reversed(self.by_signature.values()), None)

    def followed(self) -> None:
        """A step followed its program to the end."""
        self.streak = 0

    def may_record(self, step: int) -> bool:
        return self.streak < STREAK_BACKOFF or step >= self.resume_at

    def keep(self) -> set[int]:
        """Ids of the nodes every kept program may replay (the recorder keeps their ops at step ends)."""
        out: set[int] = set()
        for prog in self.by_signature.values():
            out |= prog.keep
        return out

    def unbind(self) -> None:
        for prog in self.by_signature.values():
            prog.unbind()

    def clear(self) -> list[StepProgram]:
        out = list(self.by_signature.values())
        self.by_signature.clear()
        self.last = None
        return out


def growth(sig: Signature, prog: StepProgram) -> float:
    """How many times larger ``sig``'s largest input is than the same input of ``prog`` (1 at most as large)."""
    return max([_numel(s) / max(_numel(os), 1) for (s, _), (os, _) in zip(sig, prog.input_shapes)] + [1.0])
