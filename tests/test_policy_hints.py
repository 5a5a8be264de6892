"""The policy interface made explicit: :class:`~hybridmem.plugins.base.PolicyHints`, read once per runtime.

A built-in policy declares its hints and the runtime reads exactly those; a policy written before hints
existed (old attributes, no ``hints``) gets the same hints from its attributes and trains bit for bit as the
built-in it wraps; a policy declaring nothing gets the defaults."""
from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem.plugins import base
from hybridmem.plugins.base import PolicyHints, hints_of
from hybridmem.plugins.compress import CompressPolicy
from hybridmem.plugins.recompute import RecomputePolicy
from hybridmem.plugins.swap import SwapPolicy
from tests.helpers.runtime import Case, budget_for, run, run_feasible

POLICIES = ("swap", "recompute", "compress")
METHODS = ("bind", "step_ended", "release", "in_flight", "device_tensors", "registration_cost")
# what each built-in declares; the other facts keep their defaults
DECLARED = {"swap": {"moves_to_host": True}, "recompute": {"metered": True, "dynamic_cost": True},
            "compress": {"allocates_to_evict": True}}


class OldStyle:
    """A policy as a user wrote it before hints existed: the old attributes, no ``hints``. It hands every
    call to the built-in it wraps (a stand-in for a user's own code)."""

    def __init__(self, inner: Any, **old: bool):
        self._inner = inner
        self.__dict__.update(old)

    def __getattr__(self, name: str) -> Any:
        if name == "hints":
            raise AttributeError(name)  # written before hints: only the old attributes say anything
        return getattr(self._inner, name)


def _old_style(cls: type, **old: bool) -> Any:
    return lambda **options: OldStyle(cls(**options), **old)


def _facts(h: PolicyHints) -> dict[str, Any]:
    return {f.name: getattr(h, f.name) for f in fields(h) if f.name not in METHODS}


def _case() -> Case:
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (nn.Linear(256, 256), nn.ReLU())]
    return Case("mlp", nn.Sequential(*layers, nn.Linear(256, 1)), (torch.randn(256, 256),))


def test_a_policy_declaring_nothing_gets_the_defaults() -> None:
    class Bare:
        name, lossless = "bare", True

    assert hints_of(Bare()) == PolicyHints()
    assert hints_of(type("Swap", (Bare,), {"name": "swap"})()).moves_to_host  # the old default, by name


def test_old_attributes_and_methods_are_read_without_hints() -> None:
    old = OldStyle(CompressPolicy(lossy=("bf16",)), allocates_to_evict=True)
    h = hints_of(old)
    assert _facts(h) == _facts(PolicyHints(allocates_to_evict=True, verifiable=False))
    assert h.release == old._inner.release and h.device_tensors == old._inner.device_tensors
    assert h.bind is None and h.in_flight is None


@pytest.mark.parametrize("name", POLICIES)
def test_old_attributes_give_the_built_ins_hints(name: str) -> None:
    cls = {"swap": SwapPolicy, "recompute": RecomputePolicy, "compress": CompressPolicy}[name]
    old, new = OldStyle(cls(), **DECLARED[name]), cls()
    assert _facts(hints_of(old)) == _facts(hints_of(new)) == _facts(PolicyHints(**DECLARED[name]))
    assert [getattr(hints_of(old), m) is None for m in METHODS] == [getattr(hints_of(new), m) is None for m in METHODS]


def test_a_subclass_of_a_built_in_keeps_the_old_attribute_it_overrides() -> None:
    class HostCompress(CompressPolicy):
        allocates_to_evict = False  # written before hints: it still wins over the built-in's hints

    assert not hints_of(HostCompress()).allocates_to_evict
    assert hints_of(CompressPolicy()).allocates_to_evict


def test_hints_of_another_type_are_refused() -> None:
    class Wrong:
        name, hints = "wrong", {"metered": True}

    with pytest.raises(TypeError, match="hints must be a hybridmem.plugins.base.PolicyHints, got dict"):
        hints_of(Wrong())


@pytest.mark.parametrize("lossy", [(), ("bf16",)], ids=["lossless", "lossy"])
def test_built_ins_hints_are_what_the_runtime_reads(lossy: tuple[str, ...]) -> None:
    with hybridmem.session(budget="1GiB", device="cpu", policies=POLICIES,
                           config={"lossy": list(lossy)} if lossy else None) as s:
        rt = s.runtime
        for name in POLICIES:
            policy, h = rt.policies[name], rt.residency.hints[name]
            want = PolicyHints(**DECLARED[name], verifiable=not (name == "compress" and lossy))
            assert _facts(h) == _facts(want), name
            for m in METHODS:
                assert getattr(h, m) == getattr(policy, m, None), (name, m)
        assert rt.residency.reserve == rt.budget // 32  # compress allocates to evict
        assert rt._policy_step_ends == [rt.policies["swap"].step_ended]


@pytest.mark.parametrize("policies", [("swap",), ("recompute",), ("compress",), POLICIES], ids="+".join)
def test_old_style_policies_train_as_the_built_ins(policies: tuple[str, ...], monkeypatch: pytest.MonkeyPatch,
                                                   one_thread: None) -> None:
    """Policies without hints, registered under the built-ins' names, train bit for bit as the built-ins and
    evict and regenerate the same bytes: their old attributes give the runtime the same hints."""
    case = _case()
    _, mon = run(case, steps=2, budget=None, policies=policies)
    builtin, st, budget = run_feasible(case, budget_for(mon, 0.4), steps=3, policies=policies)
    assert sum(p.evicted for p in st.policies.values()) > 0
    monkeypatch.setitem(base._REGISTRY, "swap", _old_style(SwapPolicy, moves_to_host=True))
    monkeypatch.setitem(base._REGISTRY, "recompute", _old_style(RecomputePolicy, metered=True, dynamic_cost=True))
    monkeypatch.setitem(base._REGISTRY, "compress", _old_style(CompressPolicy, allocates_to_evict=True))
    old, old_st = run(case, steps=3, budget=budget, policies=policies)
    assert old_st is not None
    assert old == builtin
    assert ({n: (p.evicted_bytes, p.regenerated_bytes) for n, p in old_st.policies.items()}
            == {n: (p.evicted_bytes, p.regenerated_bytes) for n, p in st.policies.items()})
    assert old_st.peak_bytes == st.peak_bytes
