"""Planning a compiled region runs with the heap from before it frozen (hybridmem.compile.gc_freeze)."""
import gc
import weakref

import pytest

from hybridmem.compile.gc_freeze import frozen_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_heap_is_frozen_inside_and_thawed_after_and_new_garbage_is_still_collected():
    assert gc.get_freeze_count() == 0
    before = _Cycle()
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        c = _Cycle()
        ref = weakref.ref(c)
        del c
        gc.collect()
        assert ref() is None          # a cycle made while frozen is collected
    assert gc.get_freeze_count() == 0
    ref_before = weakref.ref(before)
    del before
    gc.collect()
    assert ref_before() is None       # and the objects from before are collectable again


def test_a_callers_freeze_is_left_as_it_was():
    gc.freeze()
    try:
        n = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert gc.get_freeze_count() == n
    finally:
        gc.unfreeze()


def test_the_partitioner_plans_with_the_heap_frozen_and_thaws_it_when_planning_fails():
    from hybridmem.compile.backend import _Partitioner

    seen = []

    class Planner:
        def prepare(self, gm, joint_inputs, kwargs, key, dev, examples):
            seen.append(gc.get_freeze_count())
            raise RuntimeError("planning failed")

    class Backend:
        planner = Planner()
        _current, _dev, _examples = (), None, None

    with pytest.raises(RuntimeError, match="planning failed"):
        _Partitioner(Backend())(None, None, num_fwd_outputs=1)
    assert seen and seen[0] > 0
    assert gc.get_freeze_count() == 0
