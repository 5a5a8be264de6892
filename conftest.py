"""Shared pytest fixtures; being at the repository root also puts it on sys.path, so ``bench`` imports."""
from __future__ import annotations

import gc
import os
import sys
from typing import Iterator

import pytest
import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One CPU thread: sizes and timings are stated for it, and results stay steady on shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_compiled_measurement_left() -> Iterator[None]:
    """A test that compiled with hybridmem's backend leaves the process-wide CPU meter held by the backend's
    measurement (compile.measured) for as long as something keeps the backend (Dynamo's cache, torch.compile's
    wrapper), counting every later allocation against later tests' budgets: its measurements stop with it."""
    yield
    measured = sys.modules.get("hybridmem.compile.measured")
    if measured is None or not measured._Shared.users:
        return
    torch._dynamo.reset()
    gc.collect()
    if measured._Shared.users:
        for obj in gc.get_objects():
            if isinstance(obj, measured.StepPeak):
                obj.stop()


@pytest.fixture(autouse=True)
def _least_budgets_searched_afresh() -> None:
    """Each test searches its least budgets itself: a search another test left in the process's memory
    (solvers.LEAST_KEPT) would skip the probes a test counts or patches."""
    solvers = sys.modules.get("hybridmem.solvers")
    if solvers is not None:
        solvers._least.clear()


# The longest tests (each 30 s to 2 min on 2 cores, pytest --durations), started first: with workers
# (``-n auto``, and ``--dist worksteal`` from pyproject), an idle worker takes queued tests from a busy one,
# so the run ends on short tests instead of one worker finishing a long one alone.
LONGEST_FIRST = (
    "tests/test_readme.py::test_readme_commands_run_in_order",
    "tests/test_compile_lengths.py::test_per_batch_lengths_are_planned_for_the_lengths_they_meet",
    "tests/test_compile.py::test_inductor_trains_a_gpt2_near_the_knapsacks_peak",
    "tests/test_compile.py::test_a_budget_inside_the_margin",
    "tests/test_compile.py::test_a_budget_below_the_floor",
    "tests/test_compile.py::test_a_loop_that_drops_the_outputs",
    "tests/test_examples.py::",
    "tests/test_bench_cli.py::test_quick_writes_json_markdown_and_prints_tables",
    "tests/test_compile.py::test_a_compiled_step_that_holds_more_than_its_share",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: the order the files give (workers collect the same order, as xdist requires)

    def rank(item: pytest.Item) -> int:
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
                    len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order
