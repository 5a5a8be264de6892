import json

import pytest

from hybridmem.errors import GraphFormatError
from hybridmem.graph.ir import Graph
from tests.helpers import chain_graph


def test_memory_profile_of_chain():
    g = chain_graph(3, nbytes=100, param_bytes=10)
    # forward: a0, a0+a1, a0+a1+a2; backward frees a2 at stage 3 after reading it
    assert g.memory_profile().tolist() == [110, 210, 310, 410, 410, 310]
    assert g.peak_bytes() == 410
    assert g.num_forward == 3
    assert g.saved_bytes() == 300
    assert [t.id for t in g.evictable()] == [1, 2, 3]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_round_trip_keeps_hashes(tmp_path, suffix):
    g = chain_graph(4)
    p = g.save(tmp_path / f"g{suffix}")
    h = Graph.load(p)
    assert h.content_hash() == g.content_hash()
    assert h.structure_hash() == g.structure_hash()
    assert h.tensors[1].shape == g.tensors[1].shape


def test_structure_hash_ignores_costs_but_content_hash_does_not():
    g, h = chain_graph(3), chain_graph(3, cost=5.0)
    assert g.structure_hash() == h.structure_hash()
    assert g.content_hash() != h.content_hash()
    assert chain_graph(3, nbytes=7).structure_hash() != g.structure_hash()


def test_truncated_yaml_is_reported(tmp_path):
    p = chain_graph(3).save(tmp_path / "g.yaml")
    text = p.read_text()
    p.write_text(text[: len(text) // 2] + "\n  - {broken: [")
    with pytest.raises(GraphFormatError, match="not valid YAML|missing key|truncated"):
        Graph.load(p)


def test_missing_keys_and_wrong_types(tmp_path):
    d = chain_graph(3).to_dict()
    del d["tensors"]
    p = tmp_path / "g.json"
    p.write_text(json.dumps(d))
    with pytest.raises(GraphFormatError, match=r"missing key\(s\) \['tensors'\]"):
        Graph.load(p)
    d = chain_graph(3).to_dict(with_hash=False)
    d["tensors"][1]["nbytes"] = "lots"
    with pytest.raises(GraphFormatError, match="nbytes.*must be a number"):
        Graph.from_dict(d)
    d = chain_graph(3).to_dict(with_hash=False)
    d["tensors"][1]["nbytes"] = -5
    with pytest.raises(GraphFormatError, match="negative"):
        Graph.from_dict(d)
    d = chain_graph(3).to_dict(with_hash=False)
    d["stages"][0]["colour"] = "red"
    with pytest.raises(GraphFormatError, match="unknown field.*colour"):
        Graph.from_dict(d)


def test_edited_file_fails_hash_check(tmp_path):
    d = chain_graph(3).to_dict()
    d["stages"][0]["cost_s"] = 123.0
    with pytest.raises(GraphFormatError, match="content hash"):
        Graph.from_dict(d)


def test_inconsistent_edges_are_named():
    g = chain_graph(3)
    g.stages[4].inputs.remove(2)
    with pytest.raises(GraphFormatError, match="tensor 2: consumer stage 4 does not list it"):
        g.validate()


def test_missing_file(tmp_path):
    with pytest.raises(GraphFormatError, match="cannot read"):
        Graph.load(tmp_path / "nope.yaml")


def _with_optimizer_state(g: Graph, nbytes: int) -> Graph:
    """``g`` plus one optimizer-state tensor (as capture(optimizer=) appends it: last, fixed, never freed)."""
    d = g.to_dict(with_hash=False)
    d["tensors"].append({"id": len(d["tensors"]), "nbytes": nbytes, "kind": "optimizer", "producer": -1,
                         "name": "optimizer.w.momentum_buffer"})
    return Graph.from_dict(d)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_optimizer_state_is_resident_at_every_stage(tmp_path, suffix):
    """An optimizer-state tensor is fixed, not evictable, adds its bytes to every stage, to the peak, to the
    simulator's peak and to the lower bound of any plan; it survives a save/load and changes the
    structure hash (a plan made without it is refused on a graph with it)."""
    from hybridmem.graph.simulate import min_feasible_budget, simulate

    g = chain_graph(3, nbytes=100, param_bytes=10)
    h = _with_optimizer_state(g, 10)
    assert h.tensors[-1].kind == "optimizer" and not h.tensors[-1].evictable and h.evictable() == g.evictable()
    assert h.memory_profile().tolist() == [v + 10 for v in g.memory_profile().tolist()]
    assert h.peak_bytes() == g.peak_bytes() + 10 and h.fixed_bytes() == g.fixed_bytes() + 10
    assert simulate(h, None, device="cpu").peak_bytes == simulate(g, None, device="cpu").peak_bytes + 10
    assert min_feasible_budget(h) == min_feasible_budget(g) + 10
    assert h.structure_hash() != g.structure_hash()
    back = Graph.load(h.save(tmp_path / f"g{suffix}"))
    assert back.tensors[-1].kind == "optimizer" and back.structure_hash() == h.structure_hash()


def test_solvers_budget_optimizer_state():
    """The solvers see the state as fixed bytes: a budget one byte under the lower bound with the state is
    refused, and a plan made with it fits its budget in the simulator."""
    from hybridmem.errors import BudgetInfeasibleError
    from hybridmem.graph.simulate import min_feasible_budget, simulate
    from hybridmem.solvers import plan as solve

    h = _with_optimizer_state(chain_graph(6, nbytes=100, param_bytes=10), 50)
    with pytest.raises(BudgetInfeasibleError):
        solve(h, min_feasible_budget(h) - 1, device="cpu", solver="approx")
    budget = min_feasible_budget(h) + 100
    p = solve(h, budget, device="cpu", solver="approx")
    assert p.predicted_peak_bytes <= budget
    assert simulate(h, p, device="cpu", budget=budget).peak_bytes <= budget


def test_unknown_tensor_kind_names_the_accepted_ones():
    d = chain_graph(3).to_dict(with_hash=False)
    d["tensors"][0]["kind"] = "momentum"
    with pytest.raises(GraphFormatError, match="kind 'momentum' is not one of.*'optimizer'"):
        Graph.from_dict(d)
    d = _with_optimizer_state(chain_graph(3), 8).to_dict(with_hash=False)
    d["tensors"][-1]["freed_after"] = 2
    with pytest.raises(GraphFormatError, match="optimizer state exists for the whole step"):
        Graph.from_dict(d)
    d["tensors"][-1]["freed_after"], d["tensors"][1]["kind"] = None, "optimizer"  # a1: produced by stage 0
    with pytest.raises(GraphFormatError, match="tensor 1: optimizer state.*producer must be -1"):
        Graph.from_dict(d)


def _with_write(g: Graph) -> Graph:
    """chain_graph with forward stage 1 also writing its input a0 (tensor 1) in place (``a0.relu_()``-like)."""
    g.stages[1].writes = [1]
    return g.validate()


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_in_place_writes_round_trip_and_replay(tmp_path, suffix):
    g = _with_write(chain_graph(3))
    h = Graph.load(g.save(tmp_path / f"g{suffix}"))
    assert [s.writes for s in h.stages] == [s.writes for s in g.stages] and h.stages[1].writes == [1]
    assert h.content_hash() == g.content_hash() and h.writes_recorded
    # a recompute of a0 replays its producer and then its in-place writer; before the writer, the producer only
    assert h.writers() == {1: [1]}
    assert h.replay_stages(1) == [0, 1] and h.replay_stages(1, before=1) == [0] and h.replay_stages(2) == [1]
    assert h.replay_stages(0) == []  # the parameter exists before the step: nothing to replay
    # writes are not structure (same ops, same edges: plans still match), but they are content
    plain = chain_graph(3)
    assert g.structure_hash() == plain.structure_hash() and g.content_hash() != plain.content_hash()


def test_graph_file_without_writes_loads_and_says_so():
    d = chain_graph(3).to_dict()
    for s in d["stages"]:
        del s["writes"]  # a file written before Stage.writes existed; its content hash is still valid
    g = Graph.from_dict(d)
    assert g.meta["writes_recorded"] is False and not g.writes_recorded
    assert all(s.writes == [] for s in g.stages) and g.replay_stages(1) == [0]
    assert g.structure_hash() == chain_graph(3).structure_hash()
    # a graph made in memory (or saved with the field) claims nothing is missing
    assert chain_graph(3).writes_recorded and "writes_recorded" not in Graph.from_dict(chain_graph(3).to_dict()).meta


def test_bad_writes_are_named():
    g = chain_graph(3)
    g.stages[1].writes = [3]  # stage 1 does not read tensor 3
    with pytest.raises(GraphFormatError, match="stage 1: writes tensor 3 in place, so it must be one of its inputs"):
        g.validate()
    g.stages[1].writes = [99]
    with pytest.raises(GraphFormatError, match="tensor id 99 out of range"):
        g.validate()
    d = chain_graph(3).to_dict(with_hash=False)
    d["stages"][1]["writes"] = "a0"
    with pytest.raises(GraphFormatError, match="'writes' must be a list of integers"):
        Graph.from_dict(d)
