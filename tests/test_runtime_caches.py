"""Caches and fast paths on the runtime's hot path give the answers of the code they shortcut."""
from __future__ import annotations

import pytest
import torch

from hybridmem.plugins.codecs import bits_dtype
from hybridmem.plugins.compress import CompressPolicy
from hybridmem.runtime.entry import Entry
from hybridmem.runtime.lineage import OPAQUE, FixedRef, Node, NodeRef, OpRecord, View
from hybridmem.runtime.replay import Replayer


def test_bits_dtype_cached_per_dtype_matches_element_width():
    want = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.float64: torch.int64, torch.int8: torch.int8, torch.uint8: torch.int8, torch.bool: torch.int8,
            torch.int64: torch.int64, torch.complex64: torch.int64, torch.complex128: torch.int64}
    for _ in range(2):  # the second round answers from the cache
        for dt, bits in want.items():
            assert bits_dtype(dt) is bits, dt


def _fixed(t: torch.Tensor) -> FixedRef:
    return FixedRef(t, t._version, View.of(t))


def test_view_of_equals_the_dataclass_constructor():
    t = torch.arange(24.0).view(2, 3, 4)[:, 1:, ::2]
    v = View.of(t)
    assert v == View(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)
    assert hash(v) == hash(View(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype))
    assert torch.equal(v.on(t._base.view(-1)), t)


def test_record_refs_in_argument_order_and_stable():
    a, b, c = torch.zeros(2), torch.ones(3), torch.full((4,), 2.0)
    fa, fb, fc = _fixed(a), _fixed(b), _fixed(c)
    rec = OpRecord(None, (fa, [fb, 3, OPAQUE], 1.5), {"weight": fc, "dims": (0, 1)}, None, "")
    first = list(rec.refs())
    assert first == [fa, fb, OPAQUE, fc]
    assert list(rec.refs()) == first  # cached: the same objects again
    assert list(OpRecord(None, (), {}, None, "barrier").refs()) == []


class _Live:
    """Stands in for a weak reference to a storage: returns one (64 bytes) while 'alive'."""

    def __init__(self, alive: bool):
        self.alive = alive

    def __call__(self):
        return torch.UntypedStorage(64) if self.alive else None


def _node(record: OpRecord, cost: float, alive: bool) -> Node:
    record.cost_s = cost
    return Node(record, 0, 64, torch.float32, torch.device("cpu"), _Live(alive))  # type: ignore[arg-type]


def test_recompute_cost_fast_path_matches_the_walk():
    x = torch.zeros(4)
    src = _node(OpRecord(torch.ops.aten.relu.default, (_fixed(x),), {}, None, ""), 0.25, alive=True)
    view = View.of(x)
    mid = _node(OpRecord(torch.ops.aten.neg.default, (NodeRef(src, 1, view),), {}, None, ""), 0.5, alive=True)
    top = _node(OpRecord(torch.ops.aten.add.Tensor, (NodeRef(mid, 1, view), NodeRef(src, 1, view)), {}, None, ""),
                1.0, alive=False)
    r = Replayer(lambda e: None, lambda e, t: None, lambda: 0)  # type: ignore[arg-type,return-value]

    def walk(node: Node) -> float:  # the general walk: a memo that is not empty skips the fast path
        return r.cost(node, 1, {("sentinel", 0): 0.0})  # type: ignore[dict-item]

    memo: dict = {}
    assert r.cost(top, 1, memo) == walk(top) == 1.0  # inputs live: the node's own cost
    assert memo == {(id(top), 1): 0.0}
    mid.storage = _Live(False)  # an input gone: its replay counts too, and its own live input does not
    assert r.cost(top, 1, {}) == walk(top) == 1.5
    src.storage = _Live(False)
    assert r.cost(top, 1, {}) == walk(top) == 1.75  # src counted once, though two ops read it
    e = Entry(tensor=None, nbytes=64, dtype=torch.float32, device=torch.device("cpu"), policy="swap")
    mid.entry = e  # held by another policy (a host copy): available without replaying
    assert r.cost(top, 1, {}) == walk(top) == 1.25


def test_compress_decision_follows_new_bytes_of_the_same_storage():
    """The decision is cached per entry by its storage and version: bytes written in place since
    (a new version) are analysed again, never answered from the old decision."""
    pol = CompressPolicy()
    t = torch.relu(torch.randn(4096))
    e = Entry(tensor=t, nbytes=t.untyped_storage().nbytes(), dtype=t.dtype, device=t.device)
    assert pol.choose(e).codec.name == "sparse"
    assert pol.choose(e) is pol.choose(e)  # cached while the bytes are the same
    t.copy_(torch.randn(4096).abs() + 1)  # in place: dense now, a new version
    assert pol.choose(e) is None
    assert pol.stats["analyses"] == 2
    m = torch.zeros(4096, dtype=torch.bool)
    m[::3] = True
    b = Entry(tensor=m, nbytes=m.untyped_storage().nbytes(), dtype=m.dtype, device=m.device)
    assert pol.choose(b).codec.name == "bitmask"
    i = torch.randint(0, 200, (1000,))
    n = Entry(tensor=i, nbytes=i.untyped_storage().nbytes(), dtype=i.dtype, device=i.device)
    c = pol.choose(n)
    assert c.codec.name == "narrow" and c.size == 1000


def test_a_replayed_op_the_allocator_refuses_runs_again_from_its_recorded_random_state():
    """Outside the dispatch mode (a steady-state step) a replay reruns an op the allocator refused once the
    runtime has made room; a random op draws from its recorded state again, not from where it stopped."""
    from hybridmem.runtime.rng import _ForkedRNG, rng_state

    torch.manual_seed(3)
    state = rng_state(torch.device("cpu"))
    expected = torch.rand(4)
    after = torch.get_rng_state()
    refused: list[int] = []

    def op(n: int) -> torch.Tensor:
        x = torch.rand(n)  # draws, then the allocator refuses
        if not refused:
            refused.append(n)
            raise torch.OutOfMemoryError("refused")
        return x

    made_room: list[str] = []

    def retry(func, *args, **kwargs):  # what Meter.retry_oom does after the runtime evicted
        made_room.append(func.__name__)
        return func(*args, **kwargs)

    r = Replayer(lambda e: None, lambda e, t: None, lambda: 0, retry=retry)  # type: ignore[arg-type,return-value]
    with _ForkedRNG(state, torch.device("cpu")) as rng:
        got = r._call(op, [4], {}, rng)
    assert refused == [4] and made_room == ["op"]
    assert torch.equal(got, expected)
    assert torch.equal(torch.get_rng_state(), after)  # the training run's stream is put back
    with pytest.raises(torch.OutOfMemoryError):  # no retry given (the dispatch mode retries itself)
        refused.clear()
        Replayer(lambda e: None, lambda e, t: None, lambda: 0)._call(op, [4], {})  # type: ignore[arg-type,return-value]
