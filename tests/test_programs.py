"""The runtime's programs by input signature (runtime.programs): which program a step's inputs select, which
one smaller inputs may follow, what is kept, and when recording backs off after steps leave their programs."""
from __future__ import annotations

import torch

from hybridmem.runtime.program import StepProgram
from hybridmem.runtime.programs import (FOLLOWS_MOST, FOLLOWS_UNMEASURED, MAX_BACKOFF, STREAK_BACKOFF, PassCosts,
                                        ProgramSet, signature_of)


def _prog(*shapes: tuple[int, ...], dtype: torch.dtype = torch.int64) -> StepProgram:
    p = StepProgram([], [], [], [], [])
    p.input_shapes = [(torch.Size(s), dtype) for s in shapes]
    return p


def _sig(*shapes: tuple[int, ...], dtype: torch.dtype = torch.int64) -> tuple:
    return signature_of((torch.Size(s), dtype) for s in shapes)


def test_a_signature_selects_its_own_program_and_the_last_used_is_the_next_start() -> None:
    ps = ProgramSet()
    a, b = _prog((4, 64), (4, 64)), _prog((4, 128), (4, 128))
    assert ps.add(a) == [] and ps.add(b) == []
    assert ps.get(_sig((4, 64), (4, 64))) is a and ps.last is a
    assert ps.get(_sig((4, 72), (4, 72))) is None and ps.last is a
    again = _prog((4, 64), (4, 64))
    assert ps.add(again) == [a] and len(ps) == 2  # recorded anew: the old one is displaced (to unbind)


def test_smaller_inputs_are_covered_by_the_smallest_larger_program_of_the_same_kinds() -> None:
    ps = ProgramSet()
    long, longer = _prog((4, 128), (4, 128)), _prog((4, 192), (4, 192))
    ps.add(longer)
    ps.add(long)
    assert ps.covering(_sig((4, 72), (4, 72))) is long
    assert ps.covering(_sig((4, 136), (4, 136))) is longer
    assert ps.covering(_sig((4, 200), (4, 200))) is None            # longer than any: recorded
    assert ps.covering(_sig((8, 64), (8, 64))) is None              # a larger batch is not covered
    assert ps.covering(_sig((4, 64), (4, 64), (4, 64))) is None     # another number of inputs
    assert ps.covering(_sig((4, 64), (4, 64), dtype=torch.int32)) is None
    assert ps.covering(_sig((4, 64, 1), (4, 64, 1))) is None        # other dimensions


def test_the_least_recently_used_programs_go_first_past_the_limit() -> None:
    ps = ProgramSet(limit=2)
    a, b, c = _prog((1, 8)), _prog((1, 16)), _prog((1, 24))
    ps.add(a)
    ps.add(b)
    ps.get(_sig((1, 8)))  # a used again: b is now the oldest
    assert ps.add(c) == [b]
    assert ps.get(_sig((1, 16))) is None and ps.get(_sig((1, 8))) is a


def test_steps_that_keep_leaving_back_recording_off_never_for_good() -> None:
    ps = ProgramSet()
    p = _prog((2, 8))
    ps.add(p)
    for i in range(STREAK_BACKOFF - 1):
        assert ps.left(p if i == 0 else None, step=10 + i) == 0 and ps.may_record(10 + i)
    assert ps.get(_sig((2, 8))) is None and ps.last is None  # the program left is forgotten
    resume = ps.left(None, step=20)
    assert resume > 20 and not ps.may_record(20) and ps.may_record(resume)
    for step in range(21, 40):
        ps.left(None, step)
    assert ps.resume_at - 39 <= MAX_BACKOFF
    ps.followed()  # a step followed its program to the end: recording as usual again
    assert ps.may_record(40)


def test_a_smaller_signature_is_recorded_once_following_has_cost_what_a_recording_costs() -> None:
    """Rent or buy, per input element: a recording costs 5.0 where a scaled step costs 1.5, and a scaled step
    costs 0.25 more than one with its own program: recorded after 3.5 / 0.25 = 14 scaled steps."""
    costs = PassCosts()
    assert costs.follows_before_recording() == FOLLOWS_UNMEASURED        # nothing measured yet
    costs.add("record", 5.0 * 512, 512)
    costs.add("scaled", 1.5 * 256, 256)
    assert costs.follows_before_recording() == FOLLOWS_UNMEASURED        # no step with its own program yet
    costs.add("own", 1.25 * 512, 512)
    assert costs.follows_before_recording() == 14
    cheap = PassCosts(record=1.0, own=0.5, scaled=1.0)
    assert cheap.follows_before_recording() == 0                         # recording is no dearer: at once
    free = PassCosts(record=3.0, own=1.0, scaled=0.9)
    assert free.follows_before_recording() == FOLLOWS_MOST               # following costs nothing more
    costs.add("own", 3.25 * 512, 512)                                    # a running cost, newest weighted
    assert costs.own == 1.75
    costs.add("own", 5.0, 0)                                             # a pass without inputs: not counted
    assert costs.own == 1.75


def test_scaled_steps_are_counted_per_signature_until_it_is_recorded() -> None:
    ps = ProgramSet()
    ps.costs = PassCosts(record=3.0, own=1.0, scaled=1.5)  # record after ceil(1.5 / 0.5) = 3 scaled steps
    long = _prog((4, 128), (4, 128))
    ps.add(long)
    short = _sig((4, 64), (4, 64))
    assert [ps.scaled(short, swap=True, grow=True) for _ in range(4)] == [long, long, long, None]
    assert ps.scaled(_sig((4, 256), (4, 256)), swap=True, grow=True) is None  # far longer than any: recorded
    assert ps.scaled(_sig((4, 144), (4, 144)), swap=True, grow=True) is long   # 1.125x longer: followed
    assert ps.scaled(_sig((4, 152), (4, 152)), swap=True, grow=False) is None  # ... where larger steps may not
    assert ps.scaled(_sig((4, 152), (4, 152)), swap=False, grow=True) is None  # ... nor without swap
    assert ps.scaled_steps == {short: 3, _sig((4, 144), (4, 144)): 1}
    long.recomputed = {0}
    assert ps.scaled(_sig((4, 72), (4, 72)), swap=False, grow=True) is None  # recomputes, and no swap to stand in
    assert ps.scaled(_sig((4, 72), (4, 72)), swap=True, grow=True) is long
