import pytest

from hybridmem.errors import PlanFormatError, StalePlanError
from hybridmem.graph.plan import Action, Plan
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


def _annotated(g):
    p = _plan(g)
    p.info["runtime"] = {"signature": "0123456789abcdef", "stages": 5,
                         "tensors": {"1": [0, 0, 100], "2": [1, 0, 100], "3": [2, 0, 100]}}
    return p


@pytest.mark.parametrize("suffix", ["yaml", "json"])
def test_plan_file_truncated_at_a_line_boundary_is_refused(tmp_path, suffix):
    path = _annotated(chain_graph(3)).save(tmp_path / f"p.{suffix}")
    lines = path.read_text().splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if '"2"' in line or "'2'" in line)
    path.write_text("".join(lines[:cut] + lines[cut + 2:]) if suffix == "yaml" else
                    "".join(lines[:cut]).rstrip().rstrip(",") + "\n}}}}\n")  # two tensor entries lost
    with pytest.raises(PlanFormatError, match=r"3 tensor entries, it has 4 and 1.*truncated or edited.*plan again"):
        Plan.load(path)
    path.write_text(_annotated(chain_graph(3)).save(path).read_text().replace("100", "101"))  # edited
    with pytest.raises(PlanFormatError, match=r"checksum .* does not match.*truncated or edited.*plan again"):
        Plan.load(path)


def test_plan_file_carries_its_entry_count_and_checksum(tmp_path):
    p = _annotated(chain_graph(3))
    d = p.to_dict()
    assert d["entries"] == {"actions": 4, "tensors": 3} and len(d["checksum"]) == 16
    assert list(d)[:3] == ["schema", "checksum", "entries"]  # first: a truncated file keeps them
    assert Plan.load(p.save(tmp_path / "p.yaml")).info == p.info
    del d["checksum"]  # a hand-made or edited plan: the entry count still guards it
    d["actions"] = d["actions"][:3]
    with pytest.raises(PlanFormatError, match="4 actions and 3 tensor entries, it has 3 and 3"):
        Plan.from_dict(d)


def test_plan_info_is_typed_and_saves_as_the_mapping_it_was(tmp_path):
    """PlanInfo: fields by name, the mapping view over what was set (in order), the file unchanged."""
    import yaml

    from hybridmem.graph.plan import PlanInfo

    p = _plan(chain_graph(3))
    assert isinstance(p.info, PlanInfo) and p.info.gap == 0.0 and p.info.plan_from is None
    p.info.plan_from = "str"
    p.info["coarse_stages"] = None          # set to None: written, as before
    assert list(p.info) == ["gap", "plan_from", "coarse_stages"] and "fallback" not in p.info
    path = p.save(tmp_path / "p.yaml")
    assert yaml.safe_load(path.read_text())["info"] == {"gap": 0.0, "plan_from": "str", "coarse_stages": None}
    q = Plan.load(path)
    assert q.info == p.info and q.info.plan_from == "str"
    with pytest.raises(KeyError, match=r"unknown plan info key\(s\) \['gpa'\]; accepted: .*'gap'"):
        p.info["gpa"] = 1.0
    with pytest.raises(PlanFormatError, match=r"info: unknown plan info key\(s\) \['gpa'\]"):
        Plan(info={"gpa": 1.0})


def test_a_plan_file_with_an_unknown_info_key_is_refused_with_the_accepted_ones(tmp_path):
    p = _plan(chain_graph(3))
    d = p.to_dict()
    d["info"]["made_by"] = "someone"
    d.pop("checksum")                       # a hand-edited file: no checksum to check
    with pytest.raises(PlanFormatError, match=r"unknown plan info key\(s\) \['made_by'\]; accepted: \["):
        Plan.from_dict(d)
