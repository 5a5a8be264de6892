"""Process and thread hygiene: forked children start unmanaged, a runtime whose thread died is released,
and training on a thread other than the enabling one warns once with the fix."""
from __future__ import annotations

import copy
import gc
import multiprocessing
import threading
import warnings

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem.native import cpumeter
from tests.helpers.runtime import Case, run, train

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _disabled():
    yield
    hybridmem.disable()


def _mlp() -> Case:
    torch.manual_seed(0)
    return Case("mlp", nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 4)), (torch.randn(64, 32),))


# ---- forked children ---------------------------------------------------------------------------------
class _Decoding(torch.utils.data.Dataset):
    """A worker that decodes into a 2 MB buffer: more than the parent's budget, none of its business."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> tuple[bool, float]:
        buf = torch.zeros(512 * 1024)  # 2 MB
        return hybridmem.enabled(), float(buf.add_(i).sum())


def test_forked_dataloader_workers_start_unmanaged() -> None:
    gc.collect()  # the budget counts every live allocation of the process: earlier tests' cycles too
    keep = torch.zeros(100_000)  # the parent's live bytes (390.62 KiB), under its 1 MiB budget
    hybridmem.enable(budget="1MiB", device="cpu")
    keep = keep + 1
    loader = torch.utils.data.DataLoader(_Decoding(), batch_size=None, num_workers=1,
                                         multiprocessing_context="fork")
    got = list(loader)
    assert got == [[False, 0.0], [False, 1024.0 * 512]]  # (enabled in the worker, the decoded sum)
    assert hybridmem.enabled() and hybridmem.stats().budget_bytes == 2**20
    del keep


def _child(queue: "multiprocessing.Queue[tuple[bool, bool]]") -> None:
    before = hybridmem.enabled()
    hybridmem.enable(budget="64MiB", device="cpu")  # the child may enable its own runtime
    m = nn.Linear(8, 8)
    m(torch.randn(4, 8)).sum().backward()
    queue.put((before, hybridmem.stats().steps == 1))


@pytest.mark.parametrize("budget", ["1GiB", None])  # None: the allocator monitor (process-wide native meter)
def test_forked_process_starts_unmanaged_and_may_enable_its_own(budget: str | None) -> None:
    hybridmem.enable(budget=budget, device="cpu")
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0 and got == (False, True)


# ---- threads ---------------------------------------------------------------------------------------
def _in_thread(fn) -> None:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as e:  # re-raised on the calling thread below
            errors.append(e)

    t = threading.Thread(target=body, name="trainer")
    t.start()
    t.join()
    if errors:
        raise errors[0]


def test_runtime_of_a_thread_that_exited_is_released() -> None:
    case = _mlp()

    def train_one_step() -> None:
        hybridmem.enable(budget="1GiB", device="cpu")
        case.loss(copy.deepcopy(case.model)).backward()

    _in_thread(train_one_step)
    assert not hybridmem.enabled()
    assert hybridmem.stats().steps == 1  # what the thread measured stays readable until disable()
    hybridmem.disable()
    ref, _ = run(case)
    got, st = run(case, budget="1GiB", policies=("recompute",))
    assert got == ref and st is not None and st.steps == 3
    with hybridmem.session(budget=None, device="cpu") as s:
        case.loss(copy.deepcopy(case.model)).backward()
    assert s.stats().steps == 1


def test_out_of_memory_in_a_training_thread_leaves_hybridmem_usable() -> None:
    case = _mlp()

    def train_too_small() -> None:
        hybridmem.enable(budget=4096, device="cpu", policies=("recompute",))
        case.loss(copy.deepcopy(case.model)).backward()

    with pytest.raises(torch.OutOfMemoryError):
        _in_thread(train_too_small)
    assert not hybridmem.enabled()
    hybridmem.enable(budget="1GiB", device="cpu")
    assert hybridmem.enabled()
    hybridmem.disable()
    assert not hybridmem.enabled()


def test_training_on_another_thread_warns_once_with_the_fix() -> None:
    case = _mlp()
    hybridmem.enable(budget="1GiB", device="cpu")
    model = copy.deepcopy(case.model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _in_thread(lambda: train(case, model, steps=2))
    msgs = [str(w.message) for w in caught if "hybridmem" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert "'trainer'" in msgs[0] and "hybridmem.enable()" in msgs[0] and "not enforced" in msgs[0]


def test_enabling_on_the_training_thread_manages_it() -> None:
    case = _mlp()
    ref, _ = run(case)
    model = copy.deepcopy(case.model)
    out: list = []

    def body() -> None:
        with hybridmem.session(budget="1GiB", device="cpu", policies=("recompute",)) as s:
            out.append(train(case, model, steps=3))
        out.append(s.stats())

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _in_thread(body)
    assert out[0] == ref and out[1].steps == 3


@pytest.mark.parametrize("budget", [None, "1GiB"])  # None: the allocator monitor (no dispatch mode)
def test_disable_from_another_thread_leaves_the_enabling_thread_unmanaged(budget: str | None) -> None:
    case = _mlp()
    ref, _ = run(case)
    hybridmem.enable(budget=budget, device="cpu")
    _in_thread(hybridmem.disable)
    meter = cpumeter.load()
    counted = meter.current_bytes if meter is not None else 0
    got = train(case, copy.deepcopy(case.model))  # this thread's leftover hooks pass everything through
    assert got == ref
    assert meter is None or meter.current_bytes == counted  # and count nothing (the meter is process-wide)

    # torch.compile on this thread compiles beside them: Dynamo skips every frame under a dispatch mode on the
    # stack unless the mode lets it compile beside it
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(copy.deepcopy(case.model), backend=backend)(*case.args).sum().backward()
    assert len(graphs) == 1

    # this thread's next call into hybridmem takes them off its stacks (they cost a Python call per op)
    assert not hybridmem.enabled()
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    got2, st = run(case, budget="1GiB", policies=("swap",))
    assert got2 == ref and st is not None and st.steps == 3
