"""pytest-benchmark's storage for the suites in ``bench/``: the saved baseline lives in the repository.

Unless ``--benchmark-storage`` is given, runs are saved to and compared against ``bench/baseline/``
(whatever the working directory), so the baseline is versioned with the code it measures::

    pytest bench/ --benchmark-autosave                                     # save: bench/baseline/<machine>/NNNN_*.json
    pytest bench/ --benchmark-compare=0002 --benchmark-compare-fail=mean:25%   # compare with run 0002, fail on +25 %

pytest-benchmark files the runs per machine (``Linux-CPython-3.11-64bit``): a comparison finds the
baseline saved by the same platform and Python.
"""
from __future__ import annotations

from pathlib import Path

import pytest

BASELINE_DIR = Path(__file__).resolve().parent / "baseline"
PLUGIN_DEFAULT_STORAGE = "file://./.benchmarks"  # pytest-benchmark's own default (relative to the cwd)


def storage_uri(given: str | None) -> str | None:
    """The storage to use: ``bench/baseline`` when the option was left at pytest-benchmark's default."""
    if given in (None, PLUGIN_DEFAULT_STORAGE):
        return "file://" + str(BASELINE_DIR)
    return given


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark's own pytest_configure reads the option
def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "benchmark_storage"):
        config.option.benchmark_storage = storage_uri(config.option.benchmark_storage)
