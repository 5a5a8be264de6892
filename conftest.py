"""Shared pytest fixtures; being at the repository root also puts it on sys.path, so ``bench`` imports."""
from __future__ import annotations

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
