import pytest

from hybridmem.errors import PlanFormatError, StalePlanError
from hybridmem.plan import Action, Plan
from tests.helpers import chain_graph


def _plan(g):
    return Plan(actions=[Action("swap_out", 1, 0), Action("free", 1, 0), Action("swap_in", 1, 4),
                         Action("compress", 2, 1, codec="bitmask", ratio=0.25)],
                graph_hash=g.structure_hash(), device="h100-80gb", budget_bytes=1000, solver="test",
                info={"gap": 0.0})


def test_round_trip(tmp_path):
    g = chain_graph(3)
    p = _plan(g)
    q = Plan.load(p.save(tmp_path / "p.yaml"))
    assert q == Plan(**{**p.__dict__, "actions": p.sorted_actions()})
    assert q.policy_of(1) == "swap" and q.policy_of(2) == "compress" and q.policy_of(3) == "keep"
    q.check_graph(g)


def test_stale_plan_is_refused_with_reason():
    p = _plan(chain_graph(3))
    with pytest.raises(StalePlanError, match="plan was made for graph .* capture and plan again"):
        p.check_graph(chain_graph(4))


def test_actions_on_params_are_refused():
    g = chain_graph(3)
    with pytest.raises(PlanFormatError, match="is a param and may not be evicted"):
        Plan(actions=[Action("free", 0, 1)], graph_hash=g.structure_hash()).check_graph(g)


@pytest.mark.parametrize("bad,match", [
    ({"schema": 1}, r"missing key\(s\) \['actions'\]"),
    ({"schema": 9, "actions": []}, "schema version 9 unsupported"),
    ({"schema": 1, "actions": [{"kind": "teleport", "tensor": 1, "stage": 0}]}, "kind 'teleport' is not one of"),
    ({"schema": 1, "actions": [{"kind": "free", "tensor": "x", "stage": 0}]}, "must be a number"),
    ({"schema": 1, "actions": [], "budget_bytes": -1}, "budget_bytes must be a non-negative"),
    ({"schema": 1, "actions": [], "colour": 1}, r"unknown key\(s\) \['colour'\]"),
    ([1, 2], "expected a mapping"),
])
def test_malformed_plans(bad, match):
    with pytest.raises(PlanFormatError, match=match):
        Plan.from_dict(bad)
