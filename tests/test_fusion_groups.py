"""Which values the compile backend's graph counts as stored under Inductor (``joint.fusion_groups``),
on small aten graphs traced with ``make_fx``: nothing here compiles."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hybridmem.compile.joint import MAX_INLINED_USERS, fusion_groups


def _groups(fn, *args) -> tuple[dict[str, list[str]], set[str]]:
    gm = make_fx(fn)(*args)
    nodes = list(gm.graph.nodes)
    out = next(n for n in nodes if n.op == "output")
    groups = fusion_groups(nodes, set(), set(out.all_input_nodes), backward=True)
    inlined = {m.name for ms in groups.values() for m in ms}
    return {k.name: [m.name for m in v] for k, v in groups.items()}, inlined


def _names(fn, *args) -> dict[str, str]:
    """aten op name (e.g. ``mul``) -> its first node's name, for the asserts below."""
    gm = make_fx(fn)(*args)
    out: dict[str, str] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            out.setdefault(n.target.overloadpacket.__name__, n.name)
    return out


def test_a_pointwise_value_read_by_a_reduction_is_computed_inside_it() -> None:
    x = torch.randn(4, 8)

    def f(x):
        return (x * 2.0).sum(-1)

    groups, inlined = _groups(f, x)
    n = _names(f, x)
    assert n["mul"] in inlined and groups[n["sum"]] == [n["mul"]]


def test_a_value_a_matrix_product_reads_is_stored() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 3)

    def f(x, w):
        return torch.mm(x * 2.0, w)

    _, inlined = _groups(f, x, w)
    assert _names(f, x, w)["mul"] not in inlined


def test_a_value_with_a_few_pointwise_users_is_computed_in_each() -> None:
    x = torch.randn(4, 8)

    def f(x):
        y = x * 2.0
        return (y + 1.0).sum(), (y - 1.0).amax()

    groups, inlined = _groups(f, x)
    mul = _names(f, x)["mul"]
    assert mul in inlined and sum(mul in ms for ms in groups.values()) == 2


def test_a_value_with_many_users_or_returned_is_stored() -> None:
    x = torch.randn(4, 8)

    def many(x):
        y = x * 2.0
        return tuple((y + float(i)).sum() for i in range(MAX_INLINED_USERS + 1))

    def returned(x):
        y = x * 2.0
        return y, (y + 1.0).sum()

    assert _names(many, x)["mul"] not in _groups(many, x)[1]
    assert _names(returned, x)["mul"] not in _groups(returned, x)[1]


def test_the_forward_keeps_one_user_chains_only() -> None:
    x = torch.randn(4, 8)

    def f(x):
        return (x * 2.0).sum(-1)

    gm = make_fx(f)(x)
    nodes = list(gm.graph.nodes)
    fw = {n for n in nodes if n.op == "call_function"}
    out = next(n for n in nodes if n.op == "output")
    # a reduction is no pointwise user: in the forward the product stays a tensor the partitioner may save
    assert fusion_groups(nodes, fw, set(out.all_input_nodes), backward=True) == {}
