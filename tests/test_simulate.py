"""Simulator tests on hand-made graphs with answers worked out by hand.

The device model below has a 1000 B/s host link in each direction, so a 1000-byte tensor takes exactly 1 s
to copy, and stage costs are whole seconds (``use_graph_costs=True``): every expected time is exact.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from hybridmem.graph.costs import DeviceModel, apply_costs, get_cost_model
from hybridmem.errors import InfeasiblePlanError, StalePlanError, UnknownNameError
from hybridmem.graph.ir import Graph
from hybridmem.graph.plan import Action, Plan
from hybridmem.graph.simulate import min_feasible_budget, simulate
from tests.helpers import A, big_graph, make_graph

SLOW_LINK = DeviceModel("toy", {"float32": 1e12}, hbm_bw=1e12, h2d_bw=1000.0, d2h_bw=1000.0,
                        memory_bytes=10**9, launch_s=0.0)


def sim(g: Graph, actions: list[Action] | None = None, **kw):
    plan = None if actions is None else Plan(actions=actions, solver="hand")
    kw.setdefault("device", SLOW_LINK)
    kw.setdefault("use_graph_costs", True)
    return simulate(g, plan, **kw)


def gap_graph(gap: int = 3) -> Graph:
    """x (input, 100 B) -> t1 = op0(x) (1000 B) ... read again by the last stage; filler stages in between.

    Stage 0 makes t1, stages 1..gap make small tensors (10 B each, chained), stage gap+1 reads t1.
    """
    stages = [(1.0, [0], [1])]
    tensors = [(100, -1, None), (1000, 0, gap + 1)]
    prev = 0
    for i in range(1, gap + 1):
        tensors.append((10, i, i + 1))
        stages.append((1.0, [prev], [len(tensors) - 1]))
        prev = len(tensors) - 1
    stages.append((1.0, [1, prev], []))
    return make_graph(stages, tensors)


# ---- keep-all -----------------------------------------------------------------------------------------
def test_keep_all_matches_graph_profile_and_cost_sum():
    g = gap_graph(4)
    r = sim(g)
    assert r.time_s == pytest.approx(g.compute_time()) == pytest.approx(6.0)
    assert r.compute_s == pytest.approx(6.0) and r.stall_s == 0 and r.recompute_s == 0
    assert r.peak_bytes == g.peak_bytes()
    assert np.array_equal(r.memory, g.memory_profile())
    assert r.overhead == 0 and r.feasible and r.solver == "keep-all"
    assert r.stage_end[-1] == pytest.approx(6.0) and r.stage_start[1] == pytest.approx(1.0)


def test_keep_all_with_device_model_and_workspace():
    g = make_graph([(0, [0], [1]), (0, [1], [2]), (0, [1, 2], [])],
                   [(64, -1, None), (1000, 0, 2), (500, 1, 2)], workspace={1: 300})
    g.stages[1].flops = 2e12
    g.stages[2].bytes_accessed = 10**9
    h100 = get_cost_model("h100-80gb")
    r = simulate(g, device="h100-80gb")
    assert r.time_s == pytest.approx(sum(h100.op_time(s) for s in g.stages))
    assert r.peak_bytes == g.peak_bytes() == 64 + 1000 + 500 + 300
    assert r.device == "h100-80gb" and r.op_costs == "model"


def test_device_graph_uses_stage_costs_and_meta_device():
    g = apply_costs(gap_graph(2), "a100-80gb")
    r = simulate(g, device=None)
    assert r.op_costs == "graph" and r.device == "a100-80gb"
    assert r.time_s == pytest.approx(g.compute_time())


# ---- swaps --------------------------------------------------------------------------------------------
def test_swap_hidden_by_overlap_costs_no_stall():
    g = gap_graph(3)  # t1 (1000 B) made at stage 0, read at stage 4; stages cost 1 s; copies take 1 s
    r = sim(g, [A("swap_out", 1, 0), A("free", 1, 0), A("swap_in", 1, 3)])
    assert r.stall_s == 0 and r.time_s == pytest.approx(5.0)
    assert r.bytes_d2h == r.bytes_h2d == 1000
    # d2h runs 1..2 s, i.e. during stage 1, so t1 is still held then; released before stage 2 starts.
    keep = g.memory_profile()
    assert r.memory[1] == keep[1]
    assert r.memory[2] == keep[2] - 1000
    assert r.memory[3] == keep[3]           # swap-in buffer allocated at issue (start of stage 3)
    assert r.host_peak_bytes == 1000 and r.host_memory[0] == 1000 and r.host_memory[4] == 0


def test_late_swap_in_stalls_exactly():
    g = gap_graph(3)
    r = sim(g, [A("swap_out", 1, 0), A("free", 1, 0), A("swap_in", 1, 4)])
    # issued at the start of stage 4 (t=4), lands at 5: the op waits 1 s
    assert r.stall_s == pytest.approx(1.0) and r.time_s == pytest.approx(6.0)
    assert r.overhead == pytest.approx(0.2)


def two_tensor_graph() -> Graph:
    """Stage 0 makes t1 and t2 (1000 B each); stages 1..3 are filler; stage 4 reads both."""
    return make_graph(
        [(1.0, [0], [1, 2]), (1.0, [0], [3]), (1.0, [3], [4]), (1.0, [4], [5]), (1.0, [1, 2, 5], [])],
        [(100, -1, None), (1000, 0, 4), (1000, 0, 4), (10, 1, 2), (10, 2, 3), (10, 3, 4)])


def test_two_transfers_in_one_direction_serialize():
    g = two_tensor_graph()
    acts = [A("swap_out", 1, 0), A("swap_out", 2, 0), A("free", 1, 0), A("free", 2, 0),
            A("swap_in", 1, 3), A("swap_in", 2, 3)]
    r = sim(g, acts)
    # d2h: t1 1..2, t2 2..3. h2d issued at t=3: t1 3..4, t2 4..5. Stage 4 starts at 4, waits for t2: 1 s.
    assert r.stall_s == pytest.approx(1.0)
    assert r.time_s == pytest.approx(6.0)
    # t2's device bytes are released when its copy ends (t=3), so both are still held during stage 2
    keep = g.memory_profile()
    assert r.memory[1] == keep[1] and r.memory[2] == keep[2] - 1000


def test_swap_in_waits_for_its_own_swap_out():
    g = two_tensor_graph()
    acts = [A("swap_out", 1, 0), A("swap_out", 2, 0), A("free", 1, 0), A("free", 2, 0),
            A("swap_in", 2, 1)]
    r = sim(g, acts, strict=False)
    # t2's host copy is complete at t=3 (after t1's), so its swap-in runs 3..4: no stall at stage 4 (t=4)
    assert r.stall_s == 0
    assert [v.tensor for v in r.violations] == [1]  # t1 read at stage 4 without a swap-in


def test_opposite_directions_overlap():
    g = make_graph(
        [(1.0, [0], [1]), (1.0, [0], [2]), (1.0, [0], [3]), (1.0, [1, 3], []), (1.0, [2], [])],
        [(100, -1, None), (1000, 0, 3), (1000, 1, 4), (10, 2, 3)])
    acts = [A("swap_out", 1, 0), A("free", 1, 0),      # d2h 1..2
            A("swap_out", 2, 1),                        # d2h 2..3
            A("swap_in", 1, 2)]                         # h2d 2..3, concurrent with the d2h above
    r = sim(g, acts)
    assert r.stall_s == 0 and r.time_s == pytest.approx(5.0)


# ---- validation ---------------------------------------------------------------------------------------
def test_budget_violation_names_stage_and_tensor():
    g = gap_graph(3)
    keep = g.memory_profile()
    assert keep.tolist() == [1100, 1110, 1120, 1120, 1110]
    with pytest.raises(InfeasiblePlanError) as e:
        sim(g, budget=int(keep[1]))
    assert e.value.stage == 2 and e.value.tensor == 1
    assert "exceeds the budget" in e.value.reason and "t1" in e.value.reason
    r = sim(g, budget=int(keep[1]), strict=False)
    assert [v.stage for v in r.violations] == [2, 3]
    # the same budget holds if t1 is swapped out (released at t=2) and back in only at stage 4: 1 s stall
    r = sim(g, [A("swap_out", 1, 0), A("free", 1, 0), A("swap_in", 1, 4)], budget=int(keep[1]))
    assert r.feasible and r.peak_bytes == keep[1] and r.stall_s == pytest.approx(1.0)


def test_budget_from_plan_and_percentage():
    g = gap_graph(3)
    with pytest.raises(InfeasiblePlanError):
        simulate(g, Plan(budget_bytes=1000), device=SLOW_LINK, use_graph_costs=True)
    assert simulate(g, None, device=SLOW_LINK, budget="100%").feasible
    with pytest.raises(InfeasiblePlanError):
        simulate(g, None, device=SLOW_LINK, budget="50%")


def test_swap_in_without_swap_out_rejected():
    g = gap_graph(3)
    with pytest.raises(InfeasiblePlanError) as e:
        sim(g, [A("free", 1, 0), A("swap_in", 1, 3)])
    assert (e.value.stage, e.value.tensor) == (3, 1) and "no earlier swap_out" in e.value.reason


def test_reading_an_evicted_tensor_rejected():
    g = gap_graph(3)
    with pytest.raises(InfeasiblePlanError) as e:
        sim(g, [A("swap_out", 1, 0), A("free", 1, 0)])
    assert (e.value.stage, e.value.tensor) == (4, 1)
    assert "freed after stage 0" in e.value.reason and "nothing regenerated" in e.value.reason


def chain_graph() -> Graph:
    """x -> a = op0(x) -> b = op1(a) -> filler 2, 3 -> op4 reads b -> op5 reads a."""
    return make_graph(
        [(1.0, [0], [1]), (2.0, [1], [2]), (1.0, [0], [3]), (1.0, [3], [4]), (1.0, [2, 4], []), (1.0, [1], [])],
        [(100, -1, None), (1000, 0, 5), (1000, 1, 4), (10, 2, 3), (10, 3, 4)])


def test_recompute_chain_accepted_with_exact_time():
    g = chain_graph()
    acts = [A("free", 1, 1), A("free", 2, 1), A("recompute", 1, 4), A("recompute", 2, 4)]
    r = sim(g, acts)
    assert r.feasible and r.stall_s == 0
    assert r.recompute_s == pytest.approx(1.0 + 2.0)
    assert r.time_s == pytest.approx(g.compute_time() + 3.0)
    keep = g.memory_profile()
    assert r.memory[2] == keep[2] - 2000 and r.memory[4] == keep[4]
    assert r.memory[5] == keep[5]  # a stays resident after its recompute, until its natural end


def test_recompute_with_missing_input_rejected():
    g = chain_graph()
    with pytest.raises(InfeasiblePlanError) as e:   # b's producer needs a, which was freed and not regenerated
        sim(g, [A("free", 1, 1), A("free", 2, 1), A("recompute", 2, 4), A("recompute", 1, 5)])
    assert (e.value.stage, e.value.tensor) == (4, 2)
    assert "input tensor 1 (t1) is not resident" in e.value.reason and "freed after stage 1" in e.value.reason


def writer_graph(**kw) -> Graph:
    """x -> r = op0(x); a = op1(x); op2 writes a in place from r (``a += r``, 2 s); filler 3; op4 reads a;
    op5 reads r. A recompute of a after op2 replays op1 and op2, and needs r."""
    return make_graph(
        [(1.0, [0], [1]), (1.0, [0], [2]), (2.0, [2, 1], []), (1.0, [0], [3]), (1.0, [2, 3], []), (1.0, [1], [])],
        [(100, -1, None), (1000, 0, 5), (1000, 1, 4), (10, 3, 4)], writes={2: [2]}, **kw)


def test_recompute_replays_in_place_writers():
    g = writer_graph()
    assert g.replay_stages(2) == [1, 2]
    r = sim(g, [A("free", 2, 2), A("recompute", 2, 4)])
    assert r.feasible and r.recompute_s == pytest.approx(1.0 + 2.0)   # producer + writer
    assert r.time_s == pytest.approx(g.compute_time() + 3.0)
    assert r.memory[3] == g.memory_profile()[3] - 1000
    # recomputed before its writer runs, a is what its producer made: the writer is not replayed
    r = sim(g, [A("free", 2, 1), A("recompute", 2, 2)])
    assert r.feasible and r.recompute_s == pytest.approx(1.0)
    # a non-deterministic writer makes the tensor non-recomputable, like a non-deterministic producer
    with pytest.raises(InfeasiblePlanError, match=r"replays stage 2 \(aten.op\), which is not deterministic"):
        sim(writer_graph(nondeterministic=(2,)), [A("free", 2, 2), A("recompute", 2, 4)])


def test_recompute_rejected_when_a_writer_input_is_missing():
    g = writer_graph()
    # r is evicted after op2 and only regenerated for op5: the replay of op2 at stage 4 has no r
    acts = [A("free", 1, 2), A("free", 2, 2), A("recompute", 2, 4), A("recompute", 1, 5)]
    with pytest.raises(InfeasiblePlanError) as e:
        sim(g, acts)
    assert (e.value.stage, e.value.tensor) == (4, 2)
    assert ("replays stages 1 (aten.op), 2 (aten.op), whose input tensor 1 (t1) (read by stage 2, aten.op) "
            "is not resident" in e.value.reason) and "freed after stage 2" in e.value.reason
    # regenerating r first (same stage, list order) makes it valid, and r stays for op5
    r = sim(g, [A("free", 1, 2), A("free", 2, 2), A("recompute", 1, 4), A("recompute", 2, 4)])
    assert r.feasible and r.recompute_s == pytest.approx(1.0 + 1.0 + 2.0)


def test_shared_producer_replays_the_union_of_writers_once():
    # op0 makes a and b; op1 writes a, op2 writes b (1 s and 3 s); op4 reads both
    g = make_graph([(2.0, [0], [1, 2]), (1.0, [1], []), (3.0, [2], []), (1.0, [0], [3]), (1.0, [1, 2, 3], [])],
                   [(100, -1, None), (1000, 0, 4), (1000, 0, 4), (10, 3, 4)], writes={1: [1], 2: [2]})
    acts = [A("free", 1, 2), A("free", 2, 2), A("recompute", 1, 4), A("recompute", 2, 4)]
    r = sim(g, acts)
    assert r.feasible and r.recompute_s == pytest.approx(2.0 + 1.0 + 3.0)
    # one of them alone: the producer and its own writer (the other output is a transient of the replay)
    r = sim(g, [A("free", 1, 2), A("recompute", 1, 4)])
    assert r.feasible and r.recompute_s == pytest.approx(2.0 + 1.0)


def _dead_source_graph(**kw) -> Graph:
    """x -> a = op0(x), read by op1 only (dead after stage 1); b = op1(a), read again by op3."""
    return make_graph([(1.0, [0], [1]), (1.0, [1], [2]), (1.0, [0], [3]), (1.0, [2, 3], [])],
                      [(100, -1, None), (1000, 0, 1), (1000, 1, 3), (10, 2, 3)], **kw)


def test_recompute_rebuilds_a_source_past_its_natural_end_first():
    """A recompute whose source nothing holds any more (a temporary past its last read) replays the
    source's producer first, as the runtime's lineage does: the source is a transient of the replay."""
    g = _dead_source_graph()
    assert g.replay_stages(2, before=3) == [0, 1]
    assert g.replay_stages(2, before=1) == [1]          # a still alive there: op1 alone
    r = sim(g, [A("free", 2, 1), A("recompute", 2, 3)])
    assert r.feasible and r.recompute_s == pytest.approx(2.0)
    assert r.memory[3] == g.memory_profile()[3] + 1000   # a, made again, held while op1 replays
    # a non-deterministic op on the chain makes it non-recomputable: swap it instead
    r = sim(_dead_source_graph(nondeterministic=(0,)), [A("free", 2, 1), A("recompute", 2, 3)], strict=False)
    assert [(v.stage, v.tensor) for v in r.violations][:1] == [(3, 2)]
    assert "which is not deterministic" in r.violations[0].reason


def test_recompute_from_swapped_in_host_checkpoint():
    g = chain_graph()
    acts = [A("swap_out", 1, 0), A("free", 1, 1), A("free", 2, 1),
            A("swap_in", 1, 4), A("recompute", 2, 4)]
    r = sim(g, acts)
    # a's copy lands 1 s after stage 4 starts; the replay of op1 waits for it
    assert r.stall_s == pytest.approx(1.0) and r.recompute_s == pytest.approx(2.0)
    assert r.time_s == pytest.approx(g.compute_time() + 3.0)


def test_recompute_counts_sibling_outputs_and_workspace_as_transient():
    g = make_graph([(1.0, [0], [1, 2]), (1.0, [0], [3]), (1.0, [1, 3], [])],
                   [(100, -1, None), (1000, 0, 2), (400, 0, 0), (10, 1, 2)], workspace={0: 50})
    r = sim(g, [A("free", 1, 0), A("recompute", 1, 2)])
    # before op 2: x 100 + t3 10 + recomputed t1 1000 + transient sibling t2 400 + workspace 50
    assert r.memory[2] == 100 + 10 + 1000 + 400 + 50
    assert r.recompute_s == pytest.approx(1.0)


def test_one_replay_serves_sibling_recomputes():
    g = make_graph([(1.0, [0], [1, 2]), (1.0, [0], [3]), (1.0, [1, 2, 3], [])],
                   [(100, -1, None), (1000, 0, 2), (400, 0, 2), (10, 1, 2)])
    r = sim(g, [A("free", 1, 0), A("free", 2, 0), A("recompute", 1, 2), A("recompute", 2, 2)])
    assert r.recompute_s == pytest.approx(1.0) and r.feasible


def test_nondeterministic_producer_cannot_be_recomputed():
    g = make_graph([(1.0, [0], [1]), (1.0, [0], [2]), (1.0, [1, 2], [])],
                   [(100, -1, None), (1000, 0, 2), (10, 1, 2)], nondeterministic=(0,))
    with pytest.raises(InfeasiblePlanError, match="not deterministic"):
        sim(g, [A("free", 1, 0), A("recompute", 1, 2)])


def test_host_checkpoint_one_swap_out_two_swap_ins():
    g = make_graph(
        [(1.0, [0], [1])] + [(1.0, [0], [i]) for i in range(2, 4)] + [(1.0, [1], [])]
        + [(1.0, [0], [i]) for i in range(4, 6)] + [(1.0, [1], [])],
        [(100, -1, None), (1000, 0, 6)] + [(10, i, i) for i in (1, 2, 4, 5)])
    acts = [A("swap_out", 1, 0), A("free", 1, 0), A("swap_in", 1, 2), A("free", 1, 3), A("swap_in", 1, 5)]
    r = sim(g, acts)
    assert r.feasible and r.stall_s == 0 and r.time_s == pytest.approx(7.0)
    assert r.bytes_d2h == 1000 and r.bytes_h2d == 2000
    assert r.host_memory.tolist() == [1000] * 6 + [0]   # kept until its last swap-in (stage 5)
    keep = g.memory_profile()
    assert r.memory[1] == keep[1] and (r.memory[4] == keep[4] - 1000)


def test_compress_halves_the_bytes():
    g = gap_graph(3)
    r = sim(g, [A("compress", 1, 0, codec="fp16", ratio=0.5), A("decompress", 1, 4, codec="fp16")])
    keep = g.memory_profile()
    assert r.memory[1] == keep[1] - 500 and r.memory[3] == keep[3] - 500
    assert r.memory[0] == keep[0] + 500        # both forms exist while compressing
    assert r.memory[4] == keep[4] + 500        # ... and while decompressing
    m = SLOW_LINK
    assert r.compress_s == pytest.approx(m.compress_time(1000, "fp16", 0.5) + m.decompress_time(1000, "fp16", 0.5))
    assert r.time_s == pytest.approx(5.0 + r.compress_s)


def test_compressed_tensor_must_be_decompressed_before_use():
    g = gap_graph(3)
    with pytest.raises(InfeasiblePlanError, match="compressed after stage 0"):
        sim(g, [A("compress", 1, 0, codec="bf16", ratio=0.5)])


def test_eviction_of_non_resident_and_non_evictable_rejected():
    g = gap_graph(3)
    r = sim(g, [A("free", 1, 0), A("free", 1, 1), A("swap_out", 1, 2), A("free", 0, 0)], strict=False)
    kinds = [(v.stage, v.tensor) for v in r.violations]
    assert kinds[:3] == [(0, 0), (1, 1), (2, 1)]
    assert "input" in r.violations[0].reason and "not resident" in r.violations[1].reason


def test_regeneration_after_natural_end_rejected():
    g = chain_graph()  # t2 (b) ends at stage 4
    with pytest.raises(InfeasiblePlanError, match="after its natural end"):
        sim(g, [A("swap_out", 2, 1), A("free", 2, 4), A("swap_in", 2, 5)])


def test_redundant_and_premature_actions_rejected():
    g = gap_graph(3)
    with pytest.raises(InfeasiblePlanError, match="redundant"):
        sim(g, [A("recompute", 1, 2)])
    with pytest.raises(InfeasiblePlanError, match="not produced yet"):
        sim(make_graph([(1.0, [0], [1]), (1.0, [0], [2]), (1.0, [1, 2], [])],
                       [(100, -1, None), (10, 0, 2), (1000, 1, 2)]), [A("free", 2, 0)])


def test_free_waits_for_in_flight_swap_out_before_releasing():
    g = gap_graph(3)
    slow = DeviceModel("slow", {"float32": 1e12}, hbm_bw=1e12, h2d_bw=1000.0, d2h_bw=400.0,
                       memory_bytes=10**9, launch_s=0.0)
    r = sim(g, [A("swap_out", 1, 0), A("free", 1, 0), A("swap_in", 1, 3)], device=slow)
    keep = g.memory_profile()
    # d2h of 1000 B at 400 B/s runs 1..3.5: held in stages 1, 2 and 3 (3 starts at 3.0), where the
    # swap-in's new buffer is allocated beside it
    assert r.memory[2] == keep[2] and r.memory[3] == keep[3] + 1000
    # the swap-in cannot start before its host copy is complete (3.5): lands at 4.5, stage 4 starts at 4
    assert r.stall_s == pytest.approx(0.5)


def test_stale_plan_refused_and_unknown_device():
    g = gap_graph(2)
    with pytest.raises(StalePlanError):
        simulate(g, Plan(graph_hash="0123456789abcdef"))
    assert simulate(g, Plan.keep_all(g)).feasible
    with pytest.raises(UnknownNameError, match="h100-80gb"):
        simulate(g, device="tpu-v9")


def test_result_to_dict_is_json():
    g = gap_graph(3)
    r = sim(g, [A("free", 1, 0)], strict=False, budget=10**6)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["memory"] == r.memory.tolist() and d["feasible"] is False
    assert d["violations"][0]["stage"] == 4 and d["solver"] == "hand"


def test_min_feasible_budget_is_a_lower_bound():
    g = chain_graph()
    lb = min_feasible_budget(g)
    # stage 1 reads a and writes b: x 100 + a 1000 + b 1000
    assert lb == 2100 <= g.peak_bytes()
    acts = [A("free", 1, 1), A("free", 2, 1), A("recompute", 1, 4), A("recompute", 2, 4), A("free", 2, 4)]
    r = sim(g, acts)
    assert r.feasible and r.peak_bytes >= lb


# ---- speed --------------------------------------------------------------------------------------------
def test_big_plan_is_feasible_and_saves_memory():
    # its speed is measured in bench/test_bench_foundation.py
    g, plan = big_graph()
    r = simulate(g, plan, get_cost_model("h100-80gb"), use_graph_costs=True)
    assert len(plan.actions) > 1000 and g.num_stages == 1000 and r.feasible
    assert r.peak_bytes < g.peak_bytes()
