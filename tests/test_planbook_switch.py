"""Shape buckets: keys from inputs, the plan book (files, checks, lookups), the root-call watcher,
planning several buckets, and a training loop over three sequence lengths under one budget."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from hybridmem.planbooks import parse_dims, plan_buckets, zoo_factory
from hybridmem.graph.planbook import BookFormatError, PlanBook, ShapeKey, TensorSpec, is_book
from hybridmem.runtime.planbook_switch import RootCallWatcher
from hybridmem.errors import StalePlanError
from hybridmem.graph.plan import Action, Plan

from tests.helpers import chain_graph


# ---- keys ------------------------------------------------------------------------------------------
def test_shape_key_from_call() -> None:
    ids, mask = torch.zeros(2, 16, dtype=torch.long), torch.ones(2, 16, dtype=torch.bool)
    k = ShapeKey.of(input_ids=ids, attention_mask=mask)
    assert str(k) == "2x16:bool,2x16:int64"                       # keywords sorted by name
    assert k == ShapeKey.of(attention_mask=mask, input_ids=ids)   # spelling order does not matter
    assert k == ShapeKey.of_inputs({"input_ids": ids, "attention_mask": mask})
    assert ShapeKey.parse(str(k)) == k and k.batch == 2
    nested = ShapeKey.of((ids, [torch.zeros(3)]), 5, flag=True, extra={"s": torch.tensor(1.0)})
    assert str(nested) == "2x16:int64,3:float32,scalar:float32"   # non-tensors ignored, nesting flattened
    assert ShapeKey.of_inputs(torch.zeros(4, 3, 8, 8)) != ShapeKey.of_inputs(torch.zeros(2, 3, 8, 8))
    assert len(k.digest()) == 12 and k.digest() != nested.digest()
    with pytest.raises(ValueError, match="SHAPE:DTYPE"):
        TensorSpec.parse("2x16")


def test_parse_dims() -> None:
    assert parse_dims("8x128") == {"batch": 8, "seq": 128}
    assert parse_dims("4x64", ("batch", "image")) == {"batch": 4, "image": 64}
    assert parse_dims("batch=8,seq=32") == {"batch": 8, "seq": 32}
    with pytest.raises(ValueError, match="BATCHxLEN"):
        parse_dims("8 by 128")


# ---- the book --------------------------------------------------------------------------------------
def _graph_and_plan(n: int, key: ShapeKey) -> tuple:
    g = chain_graph(n)
    g.meta["shape_key"] = str(key)
    p = Plan(actions=[Action("swap_out", 1, 0), Action("free", 1, 0), Action("swap_in", 1, n)],
             graph_hash=g.structure_hash(), budget_bytes=10_000, solver="test")
    return g, p


K4 = ShapeKey.parse("2x4:int64")
K6 = ShapeKey.parse("2x6:int64")


def test_book_round_trip(tmp_path: Path) -> None:
    book = PlanBook(tmp_path / "book")
    for n, k in ((4, K4), (6, K6)):
        g, p = _graph_and_plan(n, k)
        book.add(k, p, g)
    book.save()
    assert is_book(tmp_path / "book") and not is_book(tmp_path)
    again = PlanBook.load(tmp_path / "book")
    assert again.keys() == [K4, K6]
    p4 = again.lookup(K4)
    assert p4 is not None and p4.graph_hash == chain_graph(4).structure_hash()
    assert again.graph(K4).num_stages == 8
    assert again.lookup("2x4:int64") is p4                       # string keys; the plan is loaded once
    assert again.lookup(ShapeKey.parse("2x5:int64")) is None     # no bucket: the online scorer's step
    assert again.unplanned == {ShapeKey.parse("2x5:int64"): 1}
    assert "no plan for input shapes 2x5:int64" in again.why_not("2x5:int64")
    again.save()
    assert "2x5:int64" in (tmp_path / "book" / "index.yaml").read_text()  # remembered for planning later
    assert PlanBook.load(tmp_path / "book").unplanned == {ShapeKey.parse("2x5:int64"): 1}


def test_book_never_hands_out_a_plan_for_another_graph(tmp_path: Path) -> None:
    book = PlanBook(tmp_path)
    g4, p4 = _graph_and_plan(4, K4)
    g6, p6 = _graph_and_plan(6, K6)
    with pytest.raises(StalePlanError, match="captured for inputs 2x4"):
        book.add(K6, p4, g4)                                      # graph of another shape
    with pytest.raises(StalePlanError, match="was made for graph"):
        book.add(K4, p6, g4)                                      # plan of another graph
    book.add(K4, p4, g4)
    book.add(K6, p6, g6)
    book.save()
    # The step's own graph, when the caller has it, must be the plan's.
    assert book.lookup(K4, graph=g6) is None and "made for graph" in book.refused[K4]
    # A plan file replaced behind the index's back is refused for its bucket only.
    (tmp_path / book.entries[K6].plan_file).write_text((tmp_path / book.entries[K4].plan_file).read_text())
    fresh = PlanBook.load(tmp_path)
    assert fresh.lookup(K6) is None and "was replaced" in fresh.refused[K6]
    assert fresh.lookup(K4) is not None


def test_book_budget_and_bad_files(tmp_path: Path) -> None:
    book = PlanBook(tmp_path)
    g, p = _graph_and_plan(4, K4)
    book.add(K4, p, g)
    book.save()
    assert book.lookup(K4, budget=20_000) is not None
    assert book.lookup(K4, budget=5_000) is None                  # made for a larger budget: would not hold
    assert "above the runtime's 5000" in book.why_not(K4, budget=5_000)
    with pytest.raises(BookFormatError, match="not a plan book"):
        PlanBook.load(tmp_path / "nothing")
    (tmp_path / "index.yaml").write_text("kind: hybridmem-planbook\nschema: 99\n")
    with pytest.raises(BookFormatError, match="schema 99"):
        PlanBook.load(tmp_path)
    (tmp_path / "index.yaml").write_text(
        "kind: hybridmem-planbook\nschema: 1\nbuckets:\n  '2x4:int64': {plan: gone.yaml, graph_hash: x}\n")
    with pytest.raises(BookFormatError, match="gone.yaml is missing"):
        PlanBook.load(tmp_path)


# ---- the runtime's view of the inputs ------------------------------------------------------------------
class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * scale


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner(x, scale=scale if scale is not None else torch.ones(1))


def test_root_call_watcher_sees_the_model_inputs() -> None:
    keys: list[ShapeKey] = []
    w = RootCallWatcher(keys.append).install()
    try:
        m = _Outer()
        m(torch.zeros(3, 4), scale=torch.ones(3, 1))   # keyword input of the outermost call
        m(torch.zeros(5, 4))
        with torch.no_grad():
            m(torch.zeros(7, 4))                         # evaluation: not a training step
    finally:
        w.remove()
    assert [str(k) for k in keys] == ["3x4:float32,3x1:float32", "5x4:float32"]
    assert w.keywords_seen
    m(torch.zeros(2, 4))                                 # removed: nothing more
    assert len(keys) == 2


def test_zoo_factory_builds_each_bucket_with_the_same_weights() -> None:
    make = zoo_factory("transformer", "tiny")
    m8, in8, _ = make({"batch": 2, "seq": 8})
    m12, in12, _ = make({"batch": 3, "seq": 12})
    assert tuple(in8["input_ids"].shape) == (2, 8) and tuple(in12["input_ids"].shape) == (3, 12)
    assert all(torch.equal(a, b) for a, b in zip(m8.parameters(), m12.parameters()))
    with pytest.raises(ValueError, match="cannot set"):
        make({"batch": 2, "width": 3})


# ---- end to end -------------------------------------------------------------------------------------
SEQS = (16, 24, 32)   # 16 and 24 planned, 32 not
BATCH = 8             # the tiny transformer at batch 8: activations dominate, so plans have work to do


def _loop(make, data, *, budget=None, plan=None, managed=True):
    import hybridmem
    import hybridmem.runtime as rt

    model = make({"batch": BATCH, "seq": SEQS[0]})[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(7)  # dropout masks: the same in every run
    losses, stats, usage = [], None, None
    if managed:
        hybridmem.enable(budget=budget, plan=plan, device="cpu")
    try:
        for r in range(3):
            for s in SEQS:
                inputs, loss_fn = data[s]
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(**inputs))
                loss.backward()
                losses.append(loss.detach())
                if (r, s) != (2, SEQS[-1]):
                    opt.step()
        if managed:
            stats = hybridmem.stats()
            usage = getattr(rt.current.rt, "buckets", None)
            usage = None if usage is None else {str(k): dict(v) for k, v in usage.usage.items()}
    finally:
        if managed:
            hybridmem.disable()
    return losses, [p.grad.clone() for p in model.parameters()], stats, usage


def test_three_sequence_lengths_two_planned(tmp_path: Path) -> None:
    """Two buckets planned, one not, in one training loop under one budget: the planned shapes follow
    their plans (after the bucket's first step, which verifies the plan's op signature), the third
    runs on the online scorer; gradients bit-identical to an unmanaged run; the cap held throughout."""
    torch.set_num_threads(1)
    make = zoo_factory("transformer", "tiny")
    data = {s: make({"batch": BATCH, "seq": s})[1:] for s in SEQS}
    t0 = time.perf_counter()
    ref_losses, ref_grads, _, _ = _loop(make, data, managed=False)
    _, _, mon, _ = _loop(make, data, budget=None)
    budget = int(mon.peak_bytes - 0.25 * mon.saved_bytes)
    # Each bucket planned at 80 % of its own keep-all peak (the graph's bytes: below the runtime's
    # budget, which also holds the other buckets' batches and the optimizer's step).
    book = plan_buckets(make, [f"{BATCH}x{SEQS[0]}", f"{BATCH}x{SEQS[1]}"], "80%", out_dir=tmp_path / "book",
                        device="cpu", solver="approx")
    assert len(book) == 2 and all(e.budget_bytes <= budget for e in book.entries.values())
    assert all(book.plan(k).actions for k in book.keys())      # plans with real work in them
    losses, grads, st, usage = _loop(make, data, budget=budget, plan=tmp_path / "book")
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert all(torch.equal(a, b) for a, b in zip(ref_grads, grads))
    assert st.peak_bytes <= budget, (st.peak_bytes, budget)
    key = {s: str(ShapeKey.of_inputs(data[s][0])) for s in SEQS}
    assert usage is not None, "the runtime did not pick up the plan book (see the hook-up in the report)"
    assert usage[key[16]] == {"verify": 1, "plan": 2}, usage
    assert usage[key[24]] == {"verify": 1, "plan": 2}, usage
    assert usage[key[32]] == {"scorer": 3}, usage
    assert any(key[32] in n and "online scorer" in n for n in st.notes)
    assert st.evicted_bytes > 0
    assert time.perf_counter() - t0 < 60


def test_cli_plan_shapes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``hybridmem plan --shapes``: one bucket per shape into a plan book folder."""
    from hybridmem.cli import main

    rc = main(["plan", "--model", "transformer", "--size", "tiny", "--shapes", "8x16", "8x24", "--budget", "80%",
               "--device", "cpu", "--json", "-o", str(tmp_path / "book")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    summary = json.loads(out.out)
    assert [b["shape_key"] for b in summary["buckets"]] == ["8x16:bool,8x16:int64", "8x24:bool,8x24:int64"]
    book = PlanBook.load(tmp_path / "book")
    assert len(book) == 2 and all(book.plan(k).actions for k in book.keys())
    assert all(book.graph(k).meta["shape_key"] == str(k) for k in book.keys())
    rc = main(["plan", "--model", "transformer", "--size", "tiny", "--shapes", "8x16", "--budget", "80%",
               "--device", "cpu"])
    assert rc == 2 and "-o DIR" in capsys.readouterr().err


def mlp_with_momentum(batch: int, seq: int) -> tuple:
    """A ``MODULE:FACTORY`` for the test below: the 4th value is the optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(seq, 64), nn.ReLU(), nn.Linear(64, 1))
    return model, torch.randn(batch, seq), lambda out: out.square().mean(), \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_factory_optimizer_state_is_in_each_bucket(tmp_path: Path) -> None:
    """A 4-tuple factory's optimizer state (momentum buffers: one parameter's worth) is budgeted."""

    book = plan_buckets("tests.test_planbook_switch:mlp_with_momentum", ["4x16"], "100%", out_dir=tmp_path / "book")
    (key,) = book.entries
    graph = book.graph(key)
    assert graph is not None
    params = sum(p.numel() * 4 for p in mlp_with_momentum(4, 16)[0].parameters())
    assert sum(t.nbytes for t in graph.tensors if t.kind == "optimizer") == params
