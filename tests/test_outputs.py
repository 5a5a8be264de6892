"""The one walk over an op's outputs (hybridmem/graph/outputs.py)."""
from __future__ import annotations

import torch

from hybridmem.graph.outputs import flat_outputs, output_tensors, storage_of, walk_outputs


def test_one_tensor_tuples_and_tensor_lists():
    a, b, c = torch.ones(2), torch.zeros(3), torch.ones(4)
    assert list(walk_outputs(a)) == [(0, 0, a)]
    out = (a, [b, c], None)
    assert [(i, p) for i, p, _ in walk_outputs(out)] == [(0, 0), (1, 1), (1, 2), (2, 3)]
    assert flat_outputs(out) == [a, b, c, None]
    assert list(output_tensors(out)) == [a, b, c]
    assert list(output_tensors(3.0)) == [] and list(walk_outputs(None)) == []


def test_views_share_one_storage_object():
    t = torch.arange(6.0)
    assert storage_of(t[2:]) is storage_of(t)
    assert storage_of(torch.ones(2).to_sparse()) is None
