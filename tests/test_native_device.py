"""The native allocator device: the budget caps what PyTorch's CPU allocator holds, at allocation time.

An allocation that would cross the budget frees registered storages that only their registrant
references, and succeeds; one that cannot be made to fit raises ``torch.OutOfMemoryError`` naming the
bytes; two threads allocating at once neither deadlock nor lose bytes; a forked child starts uncapped.
"""
from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

from hybridmem.native import cpumeter

MIB = 1 << 20
_use_count = torch._C._storage_Use_Count

native = cpumeter.load()
pytestmark = pytest.mark.skipif(native is None, reason=f"native meter unavailable: {cpumeter.unavailable_reason()}")


@pytest.fixture
def device():
    """The native device installed, with no budget and an empty registry when the test ends."""
    gc.collect()  # earlier tests' tensors freed mid-test would move the exact counts
    was = native.installed
    native.install()
    yield native
    native.set_budget(None)
    for key in native.drain():
        native.claim(key)
    if not was:
        native.uninstall()


def _own(t: torch.Tensor) -> int:
    """The use-count limit under which ``t``'s storage has no reference but ``t`` (and the registry's)."""
    return _use_count(t.untyped_storage()._cdata) + 1


def test_allocation_past_the_budget_frees_a_registered_storage_and_succeeds(device) -> None:
    victim = torch.full((MIB,), 7, dtype=torch.uint8)  # the "runtime's" only reference
    assert device.register(101, victim.untyped_storage(), _own(victim), 1.0)
    device.set_budget(device.current_bytes + MIB // 2)
    before_reclaimed = device.reclaimed_bytes
    fresh = torch.ones(MIB, dtype=torch.uint8)  # does not fit beside the victim: the victim goes
    assert fresh[0].item() == 1 and fresh[-1].item() == 1
    assert victim.untyped_storage().nbytes() == 0  # its data was taken out, the tensor object lives
    assert device.reclaimed_bytes - before_reclaimed == MIB
    assert device.current_bytes <= device.budget
    assert device.drain() == [101]
    assert device.claim(101) == 0  # "dropped": the caller must regenerate it


def test_a_storage_the_program_still_references_is_never_freed(device) -> None:
    victim = torch.full((MIB,), 7, dtype=torch.uint8)
    assert device.register(102, victim.untyped_storage(), _own(victim), 1.0)
    view = victim[10:20]  # the program holds a view: freeing the storage would corrupt it
    device.set_budget(device.current_bytes + MIB // 2)
    refused = device.refused
    with pytest.raises(torch.OutOfMemoryError) as info:
        torch.empty(MIB, dtype=torch.uint8)
    assert device.refused == refused + 1
    assert victim.untyped_storage().nbytes() == MIB and int(view.sum()) == 70
    text = str(info.value)
    assert f"({MIB} bytes)" in text and f"({device.budget} bytes)" in text and "held" in text
    device.set_budget(None)
    assert device.claim(102) == 1  # still there


def test_claim_before_reading_keeps_the_storage(device) -> None:
    victim = torch.full((MIB,), 3, dtype=torch.uint8)
    assert device.register(103, victim.untyped_storage(), _own(victim), 1.0)
    assert device.claim(103) == 1  # taken back: the allocator can no longer free it
    device.set_budget(device.current_bytes + MIB // 2)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(MIB, dtype=torch.uint8)
    assert int(victim[0]) == 3


def test_lower_priority_goes_first_and_only_what_is_needed(device) -> None:
    a = torch.ones(MIB, dtype=torch.uint8)
    b = torch.ones(MIB, dtype=torch.uint8)
    assert device.register(104, a.untyped_storage(), _own(a), 5.0)
    assert device.register(105, b.untyped_storage(), _own(b), 1.0)
    device.set_budget(device.current_bytes + MIB // 2)
    c = torch.empty(MIB // 2 + MIB // 4, dtype=torch.uint8)  # needs one of the two freed: the cheaper
    assert b.untyped_storage().nbytes() == 0 and a.untyped_storage().nbytes() == MIB
    assert device.drain() == [105]
    assert device.claim(104) == 1 and device.claim(105) == 0
    del c


def test_external_bytes_count_against_the_budget(device) -> None:
    start = device.current_bytes
    device.add_external(3 * MIB)
    try:
        assert device.current_bytes == start + 3 * MIB and device.peak_bytes >= start + 3 * MIB
        device.set_budget(start + 3 * MIB + MIB // 2)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(MIB, dtype=torch.uint8)
        device.set_budget(None)
    finally:
        device.add_external(-3 * MIB)
    assert device.current_bytes == start


def test_two_threads_allocating_at_once_neither_deadlock_nor_lose_bytes(device) -> None:
    torch.set_num_threads(1)
    keep = [torch.ones(256 * 1024, dtype=torch.uint8) for _ in range(16)]  # registered: freeable
    for i, t in enumerate(keep):
        assert device.register(200 + i, t.untyped_storage(), _own(t), float(i))
    start = device.current_bytes
    device.set_budget(start + 2 * MIB)
    errors: list[BaseException] = []
    oom = [0, 0]

    def work(k: int) -> None:
        try:
            for i in range(300):
                try:
                    x = torch.empty((64 + 37 * ((i + k) % 7)) * 1024, dtype=torch.uint8)
                    x.fill_(1)
                    del x
                except torch.OutOfMemoryError:
                    oom[k] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "allocating threads deadlocked"
    assert not errors
    device.set_budget(None)
    dropped = set(device.drain())
    for i in range(len(keep)):
        device.claim(200 + i)
    freed = sum(MIB // 4 for i in range(len(keep)) if 200 + i in dropped)
    assert device.current_bytes == start - freed  # every byte allocated was freed, counted once
    assert all((keep[i].untyped_storage().nbytes() == 0) == (200 + i in dropped) for i in range(len(keep)))


def test_cap_exempt_allocations_are_counted_not_refused(device) -> None:
    device.set_budget(device.current_bytes)
    device.cap_exempt(True)
    try:
        x = torch.empty(MIB, dtype=torch.uint8)
    finally:
        device.cap_exempt(False)
    assert device.current_bytes > device.budget
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(1, dtype=torch.uint8)
    device.set_budget(None)
    del x


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_without_the_parents_cap(device) -> None:
    held = torch.ones(2 * MIB, dtype=torch.uint8)  # the parent's bytes: not the child's device
    device.set_budget(device.current_bytes + 1024)
    pid = os.fork()
    if pid == 0:  # the child: a DataLoader worker decoding a batch
        try:
            fresh = native.current_bytes == 0 and native.budget is None
            x = torch.empty(4 * MIB, dtype=torch.uint8).fill_(0)
            counted = native.current_bytes == 4 * MIB
            del x
            os._exit(0 if fresh and counted and native.current_bytes == 0 else 3)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    device.set_budget(None)
    assert os.waitstatus_to_exitcode(status) == 0
    del held


def test_cuda_hook_builds_where_torch_has_cuda() -> None:
    """Where torch is a CUDA build with headers (the GPU machines), the library carries the caching
    allocator's free-memory callback and c10's registry holds it, GPU or not; elsewhere it says why not."""
    if torch.version.cuda is None:
        assert not native.cuda_hook and "no CUDA" in (cpumeter.cuda_note() or "")
        pytest.skip("this torch build has no CUDA: the hook is built where it has")
    if not native.cuda_hook:
        pytest.skip(f"CUDA hook not built: {cpumeter.cuda_note()}")
    assert native.cuda_registered
