"""Which values the compile backend's graph counts as stored under Inductor (``fusion.fusion_groups``),
on small aten graphs traced with ``make_fx``: nothing here compiles."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hybridmem.compile.fusion import MAX_INLINED_USERS, fusion_groups, kernels, materialized


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


def _forward_groups(fn, *args, read_by_backward: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The forward's groups of ``fn`` traced as if every node were a forward node; the ops named in
    ``read_by_backward`` (aten names) get a stand-in backward reader."""
    gm = make_fx(fn)(*args)
    g = gm.graph
    nodes = list(g.nodes)
    out = next(n for n in nodes if n.op == "output")
    fw = {n for n in nodes if n.op == "call_function"}
    for n in list(fw):
        if n.target.overloadpacket.__name__ in read_by_backward:
            with g.inserting_before(out):
                g.call_function(torch.ops.aten.neg.default, (n,))
    nodes = list(g.nodes)
    groups = fusion_groups(nodes, fw, set(out.all_input_nodes), backward=True)
    return {k.name: [m.name for m in v] for k, v in groups.items()}


def test_the_forward_folds_a_value_only_one_kernel_reads() -> None:
    """An attention's scores and softmax are read by its masked probabilities only: they fold into that
    stage (its recompute replays them from q and k), the matrix product with them."""
    q, k = torch.randn(2, 4, 8), torch.randn(2, 8, 4)

    def attn(q, k):
        s = torch.bmm(q, k)
        return torch.softmax(s, -1).masked_fill(s == 0, 0.0)

    groups = _forward_groups(attn, q, k)
    (root, members), = groups.items()
    ops = [m.rstrip("_0123456789") for m in members]
    assert {"bmm", "_softmax", "eq"} <= set(ops), groups


def test_the_forward_keeps_values_two_stages_or_the_backward_read() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def two_readers(x, w):
        y = x @ w
        return y.sum(), torch.mm(y, w)

    def chain(x, w):
        return torch.mm(torch.mm(x, w), w)

    n = _names(two_readers, x, w)
    assert not any(n["mm"] in ms for ms in _forward_groups(two_readers, x, w).values())
    assert _forward_groups(chain, x, w) != {}                               # the inner product folds ...
    assert _forward_groups(chain, x, w, read_by_backward=("mm",)) == {}     # ... unless the backward reads it


def test_a_folded_matrix_product_is_materialized_inside_its_stage() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)

    def f(x, w):
        return torch.relu(torch.mm(x, w))

    gm = make_fx(f)(x, w)
    nodes = list(gm.graph.nodes)
    out = next(n for n in nodes if n.op == "output")
    fw = {n for n in nodes if n.op == "call_function"}
    (root, members), = fusion_groups(nodes, fw, set(out.all_input_nodes)).items()
    stored = materialized([*members, root])
    assert len(stored) == 1 and tuple(stored[0].shape) == (4, 8)


def _members(fn, *args) -> list[list[torch.fx.Node]]:
    gm = make_fx(fn)(*args)
    nodes = list(gm.graph.nodes)
    out = next(n for n in nodes if n.op == "output")
    groups = fusion_groups(nodes, set(), set(out.all_input_nodes), backward=True)
    return [[*ms, k] for k, ms in groups.items()]


def test_a_fused_chain_is_charged_one_launch_and_a_library_op_one_more() -> None:
    # a BatchNorm's normalize-and-ReLU: nine aten nodes (views among them), one Inductor kernel
    x, m, r = torch.randn(2, 4, 3, 3), torch.randn(1, 4, 1, 1), torch.randn(1, 4, 1, 1)
    g, b = torch.randn(4), torch.randn(4)

    def bn_relu(x, m, r, g, b):
        return torch.relu((x - m) * r * g.unsqueeze(-1).unsqueeze(-1) + b.unsqueeze(-1).unsqueeze(-1)).sum()

    chains = _members(bn_relu, x, m, r, g, b)
    longest = max(chains, key=len)
    assert len(longest) >= 5 and kernels(longest) == 1

    def folded(x, w):
        return torch.softmax(torch.mm(x, w), -1)

    nodes = [n for n in make_fx(folded)(torch.randn(4, 3), torch.randn(3, 6)).graph.nodes if n.op == "call_function"]
    assert kernels(nodes) == 2      # the matrix product's, and one for the softmax's loops
