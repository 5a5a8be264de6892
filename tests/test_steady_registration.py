"""Registering new entries with the allocator: the one-pass check gives what the full checks give.

Near the budget every new entry asks whether recompute can rebuild it and what that costs (the order in
which the allocator frees). :meth:`Replayer.registration_cost` answers in one pass from what can change
between two checks (:meth:`Node.own_ok`: the records' reasons, the fixed references' binding and version),
and falls back to :meth:`Replayer.why_not` and :meth:`Replayer.cost` otherwise. These tests compare the two
answers where what they read changes: in place, between steps, at a module call.
"""
from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch import nn

from hybridmem.native import cpumeter
from hybridmem.runtime.lineage import OPAQUE, FixedRef, Node, NodeRef, OpRecord, View
from hybridmem.runtime.replay import Replayer, _own_reason
from tests.helpers.steady import budget_run as _budget_run, train_steps as _train

torch.set_num_threads(1)


def _node(*args: Any, why_not: str = "") -> Node:
    out = torch.zeros(4)
    rec = OpRecord(torch.ops.aten.add.Tensor, args, {}, None, why_not)
    return Node(rec, 0, 16, torch.float32, out.device, weakref.ref(out.untyped_storage()))


def _agree(n: Node) -> bool:
    got = n.own_ok(len(n.ops))
    assert got == (_own_reason(n, len(n.ops)) == ""), (got, _own_reason(n, len(n.ops)))
    return got


def test_own_check_reads_what_changes_each_time() -> None:
    w = torch.ones(4)
    ref = FixedRef(w, w._version, View.of(w))
    n = _node(ref, ref)
    assert _agree(n)
    w.add_(1)  # written in place since it was recorded
    assert not _agree(n)
    ref.version = w._version  # bound again at its current version (the next step's start)
    assert _agree(n)
    ref.alias = None  # not bound in this step
    assert not _agree(n)
    ref.alias = w
    assert _agree(n)
    n.ops[0][0].why_not = "it draws random numbers, and the state it draws from is read when its module is called"
    assert not _agree(n)
    n.ops[0][0].why_not = ""  # given its state at the module call
    assert _agree(n)


def test_own_check_follows_the_op_list() -> None:
    w = torch.ones(4)
    ref = FixedRef(w, w._version, View.of(w))
    n = _node(ref)
    assert _agree(n)
    v = torch.ones(4)
    late = FixedRef(v, v._version, View.of(v))
    n.ops.append((OpRecord(torch.ops.aten.mul_.Tensor, (NodeRef(n, 1, View.of(w)), late), {}, None, ""), -1))
    assert _agree(n)
    v.add_(1)  # read by the op appended: the longer list is checked, not the one seen first
    assert not _agree(n)
    assert n.own_ok(1)  # the first version alone does not read it
    n.ops = [(OpRecord(torch.ops.aten.add.Tensor, (OPAQUE,), {}, None, ""), 0)]  # pruned: another list
    assert not _agree(n)
    n.ops = [(OpRecord(None, (), {}, None, "its lineage was dropped"), -1)]
    assert not _agree(n)


def _both(r: Replayer, n: Node, nodes: list[Node]) -> Any:
    """The one-pass answer, checked against the full checks' (same answer, same memos left behind): the
    recompute policy's ``applicable`` (not stale, ``why_not``), then ``cost``."""
    memos = [n.ok_memo for n in nodes]
    want = None if n.stale or r.why_not(n, len(n.ops)) else r.cost(n, len(n.ops), {})
    after = [n.ok_memo for n in nodes]
    for m, old in zip(nodes, memos):
        m.ok_memo = old
    got = r.registration_cost(n)
    assert got == want and [n.ok_memo for n in nodes] == after, (got, want)
    return got


def test_registration_cost_one_pass_and_its_fallbacks() -> None:
    """An input not checked yet this step, one found not replayable, a stale node, a record refused, a new
    step: each answered as the full checks answer."""
    epoch = [1]
    r = Replayer(lambda e: e.tensor, lambda e, t: None, lambda: epoch[0])
    w = torch.ones(4)
    a = _node(FixedRef(w, w._version, View.of(w)))
    a.ops[0][0].cost_s = 2.0
    keep = torch.zeros(4)
    a.storage = weakref.ref(keep.untyped_storage())  # live: available to a replay of what reads it
    b = _node(NodeRef(a, 1, View.of(w)), FixedRef(w, w._version, View.of(w)))
    b.ops[0][0].cost_s = 3.0
    nodes = [a, b]
    assert _both(r, b, nodes) == 3.0  # a not checked yet: the full walk, which checks it
    assert a.ok_memo == (1, 1, "") and b.ok_memo == (1, 1, "")
    b.ok_memo = None
    assert _both(r, b, nodes) == 3.0  # one pass: a found replayable this step
    a.storage = None  # a freed: rebuilding b rebuilds a too
    b.ok_memo = None
    assert _both(r, b, nodes) == 5.0
    epoch[0] = 2  # a new step: every memo is from the last one
    a.ops[0][0].why_not = "it draws random numbers, and the state it draws from is read when its module is called"
    assert _both(r, b, nodes) is None
    assert _both(r, b, nodes) is None  # memoised as not replayable
    epoch[0] = 3
    a.ops[0][0].why_not = ""
    assert _both(r, b, nodes) == 5.0
    b.stale = True
    assert _both(r, b, nodes) is None
    b.stale = False
    epoch[0] = 4
    w.add_(1)  # both read w: neither is replayable now
    assert _both(r, b, nodes) is None


class _Scaled(nn.Module):
    """A block that reads a buffer (a fixed reference of the program, bound again at each step's start)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.register_buffer("scale", torch.full((64,), 0.5))
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(nn.functional.gelu(self.lin(x)) * self.scale)


@pytest.mark.skipif(cpumeter.load() is None, reason=f"native allocator device unavailable: {cpumeter.unavailable_reason()}")
def test_registration_cost_matches_the_full_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """For every entry registered: the one-pass answer is the full checks' answer, with the same memos
    left behind. Between steps the user writes the buffers in place (their versions move), and the
    dropouts draw from a state given at their module call."""
    from hybridmem import runtime as rtmod
    from hybridmem.plugins.recompute import RecomputePolicy

    fused = RecomputePolicy.registration_cost
    seen = {"steady": 0, "none": 0, "cost": 0}

    def checked(self: Any, entry: Any) -> Any:
        rt = rtmod.current.rt
        nodes = list(rt.recorder._step_nodes) if rt is not None and rt.recorder is not None else []
        if rt is not None and rt.program is not None:
            nodes += rt.program.nodes
        memos = [(n, n.ok_memo) for n in nodes]
        want = self.cost(entry) if self.applicable(entry) else None
        after = [(n, n.ok_memo) for n in nodes]
        for n, m in memos:
            n.ok_memo = m  # as if the full checks had not run
        got = fused(self, entry)
        assert got == want, (got, want)
        assert [(n, n.ok_memo) for n in nodes] == after, "the one pass left other memos than the full checks"
        seen["steady"] += rt is not None and rt._steady is not None
        seen["none" if got is None else "cost"] += 1
        return got

    monkeypatch.setattr(RecomputePolicy, "registration_cost", checked)
    torch.manual_seed(0)
    model = nn.Sequential(*[_Scaled() for _ in range(6)], nn.Linear(64, 1))
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(256, 64, generator=g),) for _ in range(6)]

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        for b in m.modules():
            if isinstance(b, _Scaled):
                b.scale.mul_(1.0)  # same values, a new version: what the program read is bound again
        return m(x).square().mean()

    ref, _ = _train(model, batches, loss_fn)
    got, st, budget, _ = _budget_run(model, batches, loss_fn, cut=0.4)
    assert got == ref
    assert st.peak_bytes <= budget
    assert st.steady_steps == len(batches) - 2 and seen["steady"] and seen["cost"], (seen, st.notes)


@pytest.mark.parametrize("make", [
    lambda: torch.empty(2, 3, 4), lambda: torch.empty(2, 3, 4).transpose(0, 1), lambda: torch.empty(1, 3, 1, 4),
    lambda: torch.empty(0, 3), lambda: torch.empty(2, 1, 3)[:, :, :2], lambda: torch.empty(()),
    lambda: torch.empty(4, 1).expand(4, 3), lambda: torch.empty(3, 1, 5).as_strided((3, 1, 5), (5, 99, 1)),
    lambda: torch.empty(6)[:4]])
def test_the_steady_packs_covering_test_is_pytorchs(make: Any) -> None:
    """``pack_bound`` tests from one read of a tensor's geometry whether it covers its storage contiguously
    (its entry is then the tensor itself): what ``is_contiguous()``, ``numel()`` and the offset say."""
    from hybridmem.runtime.saved import _contiguous
    t = make()
    n = t.untyped_storage().nbytes() // t.element_size()
    want = t.is_contiguous() and t.numel() == n and t.storage_offset() == 0
    assert (t.storage_offset() == 0 and _contiguous(tuple(t.shape), t.stride(), n)) == want
