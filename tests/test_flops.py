"""The one FLOP counter (hybridmem/graph/flops.py): its closed forms give torch.utils.flop_counter's numbers."""
from __future__ import annotations

import pytest
import torch
from torch.utils import flop_counter as fc

from hybridmem.graph import flops

aten = torch.ops.aten


def _torch(func, args, kwargs, out):
    return float(fc.flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))


def _cases():
    a, b = torch.randn(6, 5), torch.randn(5, 7)
    ba, bb = torch.randn(3, 6, 5), torch.randn(3, 5, 7)
    x = torch.randn(2, 4, 9, 9)
    q, k, v = torch.randn(2, 3, 8, 16), torch.randn(2, 3, 10, 16), torch.randn(2, 3, 10, 12)
    yield aten.mm.default, (a, b), {}
    yield aten.bmm.default, (ba, bb), {}
    yield aten.addmm.default, (torch.randn(7), a, b), {}
    yield aten.baddbmm.default, (torch.randn(3, 6, 7), ba, bb), {}
    yield aten.convolution.default, (x, torch.randn(6, 4, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}
    yield aten.convolution.default, (x, torch.randn(8, 2, 3, 3), None, [2, 2], [0, 0], [1, 1], False, [0, 0], 2), {}
    yield aten.convolution.default, (x, torch.randn(4, 3, 3, 3), None, [2, 2], [1, 1], [1, 1], True, [1, 1], 1), {}
    yield aten._scaled_dot_product_efficient_attention.default, tuple(t.to("meta") for t in (q, k, v)) + (None, False), {}


@pytest.mark.parametrize("func,args,kwargs", list(_cases()), ids=lambda v: str(v) if hasattr(v, "overloadpacket") else "")
def test_closed_forms_match_torchs_formulas(func, args, kwargs):
    out = func(*args, **kwargs)
    assert func.overloadpacket in flops._FAST
    assert flops.op_flops(func, args, kwargs, out) == _torch(func, args, kwargs, out) > 0


def test_other_ops_use_torchs_formula_or_count_zero():
    x, w = torch.randn(2, 4, 9, 9), torch.randn(6, 4, 3, 3)
    out = aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    args = (out, x, w, [6], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])
    grads = aten.convolution_backward.default(*args)
    assert flops.op_flops(aten.convolution_backward.default, args, {}, grads) == _torch(
        aten.convolution_backward.default, args, {}, grads) > 0
    assert flops.op_flops(aten.relu.default, (x,), {}, x.relu()) == 0.0
