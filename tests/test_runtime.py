"""The runtime's API and its safety nets: enable/disable/session/stats, budget parsing, in-place
checks, out-of-memory messages, nesting with other saved-tensor hooks, plan following."""
from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem.errors import PlanFormatError, StalePlanError, UnknownNameError
from hybridmem.graph.plan import Action, Plan
from tests.helpers.runtime import Case, budget_for, run, snapshot

torch.set_num_threads(1)


def _mlp_case(batch: int = 256) -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.BatchNorm1d(128), nn.ReLU(inplace=True), nn.Dropout(0.2),
                          nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4))
    return Case("mlp", model, (torch.randn(batch, 32),))


@pytest.fixture(autouse=True)
def _disabled():
    yield
    hybridmem.disable()


def test_monitor_only_measures_and_changes_nothing() -> None:
    case = _mlp_case()
    ref, _ = run(case)
    got, st = run(case, budget=None, monitor="ops")  # per op: stages are counted
    assert got == ref
    assert st is not None and st.budget_bytes is None and st.device == "cpu"
    assert st.steps == 3 and st.stages_last_step > 0
    assert st.saved_bytes > 0 and st.saved_tensors > 0
    assert st.peak_bytes >= st.current_bytes > 0
    assert st.evicted_bytes == 0 and st.cap_overruns == 0
    assert "monitor only" in str(st)


def test_enable_disable_stats_and_reset() -> None:
    case = _mlp_case()
    model = copy.deepcopy(case.model)
    hybridmem.enable(budget="1GiB", policies="recompute", device="cpu")
    case.loss(model).backward()
    st = hybridmem.stats()
    assert st.budget_bytes == 2**30 and set(st.policies) <= {"recompute"}
    hybridmem.reset_stats()
    assert hybridmem.stats().peak_bytes == hybridmem.stats().current_bytes < st.peak_bytes
    hybridmem.disable()
    with pytest.raises(RuntimeError, match="not enabled"):
        hybridmem.stats()


def test_session_restores_the_runtime_enabled_before() -> None:
    hybridmem.enable(budget=None, device="cpu")
    outer = hybridmem.runtime.current.rt
    with hybridmem.session(budget="512MiB", policies=("swap",), device="cpu") as s:
        assert hybridmem.stats().budget_bytes == 512 * 2**20
    assert s.stats().budget_bytes == 512 * 2**20
    assert hybridmem.runtime.current.rt is outer


@pytest.mark.parametrize("bad", ["12XB", "-5", -5, True, "60%", [1]])
def test_bad_budgets_list_accepted_forms(bad: object) -> None:
    with pytest.raises(ValueError) as e:
        hybridmem.enable(budget=bad, device="cpu")
    assert "512MiB" in str(e.value) or "percentage" in str(e.value)
    assert not hybridmem.runtime.enabled()


def test_budget_forms() -> None:
    for value, expected in ((1000, 1000), ("8GB", 8 * 10**9), ("1.5GiB", int(1.5 * 2**30)), ("512MiB", 2**29)):
        hybridmem.enable(budget=value, device="cpu")
        assert hybridmem.stats().budget_bytes == expected


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(UnknownNameError, match="known: .*compress.*recompute.*swap"):
        hybridmem.enable(budget="1GiB", policies=("recompute", "teleport"), device="cpu")


def test_environment_and_arguments_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDMEM_POLICIES", "recompute")
    monkeypatch.setenv("HYBRIDMEM_BUDGET", "2GiB")
    hybridmem.enable(device="cpu")  # policies left at the default: the environment decides
    rt = hybridmem.runtime.current.rt
    assert list(rt.policies) == ["recompute"] and rt.budget == 2 * 2**30
    hybridmem.enable(budget="1GiB", policies=("swap",), device="cpu")
    rt = hybridmem.runtime.current.rt
    assert list(rt.policies) == ["swap"] and rt.budget == 2**30


def test_inplace_write_to_saved_activation_is_detected() -> None:
    x = torch.randn(8, requires_grad=True)
    with hybridmem.session(budget=None, device="cpu"):
        y = x.exp()        # saves its result
        y.add_(1)          # ... which is then modified in place
        with pytest.raises(RuntimeError, match=r"modified by an in-place operation.*version 1; expected version 0"):
            y.sum().backward()


def test_inplace_write_to_saved_parameter_is_detected() -> None:
    lin = nn.Linear(4, 4)
    with hybridmem.session(budget=None, device="cpu"):
        out = torch.tanh(lin(torch.randn(2, 4, requires_grad=True))).sum()  # saves weight.t()
        with torch.no_grad():
            lin.weight.mul_(2)  # e.g. an optimizer step between forward and backward
        with pytest.raises(RuntimeError, match="shape \\[4, 4\\].*modified by an in-place operation"):
            out.backward()


def test_budget_below_the_minimum_names_it() -> None:
    case = _mlp_case(batch=512)
    _, mon = run(case, steps=1, budget=None)
    assert mon is not None
    budget = mon.peak_bytes // 3
    with pytest.raises(torch.OutOfMemoryError) as e:
        run(case, steps=1, budget=budget, policies=("recompute",))
    msg = str(e.value)
    # the step went on uncapped and names what it needed (runtime.survey)
    m = re.search(r"a budget of .*?\((\d+) bytes\) holds every op of it", msg)
    assert m, msg
    assert budget < int(m.group(1)) == e.value.min_budget_bytes <= mon.peak_bytes
    assert "Resident:" in msg
    with pytest.raises(torch.OutOfMemoryError) as e:  # without lifting the cap: a lower bound, at the first op
        run(case, steps=1, budget=budget, policies=("recompute",), config={"plugins": {"survey": False}})
    msg = str(e.value)
    m = re.search(r"Smallest budget that could work: at least .*?\((\d+) bytes\)", msg)
    assert m, msg
    assert budget < int(m.group(1)) <= mon.peak_bytes
    assert "Resident:" in msg and "lower bound" in msg


def test_entries_die_with_the_graph() -> None:
    case = _mlp_case()
    model = copy.deepcopy(case.model)
    with hybridmem.session(budget=10**9, policies=("recompute",), device="cpu"):
        rt = hybridmem.runtime.current.rt
        loss = case.loss(model)
        assert rt.store.resident
        loss.backward()
        assert not rt.store.resident
        del loss
        assert all(s.entry is None for s in rt.produced.slots.values())


def test_model_built_after_enable_keeps_parameters_fixed() -> None:
    case = _mlp_case()
    _, before = run(case, steps=1, budget=None)
    with hybridmem.session(budget=None, device="cpu") as s:
        model = _mlp_case().model   # parameters produced by ops while the runtime runs
        case.loss(model).backward()
    assert before is not None and s.stats().saved_bytes == before.saved_bytes


class _Blocks(nn.Module):
    """Residual blocks with dropout, each run through ``torch.utils.checkpoint`` (``reentrant``: its
    ``use_reentrant``) or plainly (None)."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Dropout(0.1),
                                                  nn.Linear(256, 128), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(128, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for b in self.blocks:
            x = x + (b(x) if self.reentrant is None else checkpoint(b, x, use_reentrant=self.reentrant))
        return self.head(x)


def test_checkpoint_regions_are_left_to_checkpoint_without_a_budget() -> None:
    x = torch.randn(256, 128, requires_grad=True)
    ckpt, plain = Case("ckpt", _Blocks(False), (x,)), Case("plain", _Blocks(None), (x,))
    ref, _ = run(ckpt)
    mon, st = run(ckpt, budget=None, policies=("recompute",))
    _, st_plain = run(plain, steps=1, budget=None)
    assert mon == ref and st is not None and st_plain is not None
    assert st.saved_tensors < st_plain.saved_tensors  # the regions' activations are checkpoint's


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_model_goes_as_low_as_without_checkpointing(reentrant: bool) -> None:
    # A budget the plain model trains under: with the model's own checkpointing the runtime must too,
    # bit-identically (the regions' dropout included), rather than run out at checkpoint's recompute.
    x = torch.randn(256, 128, requires_grad=True)
    plain = Case("plain", _Blocks(None), (x,))
    _, mon = run(plain, budget=None, policies=("recompute",))
    assert mon is not None
    budget = mon.peak_bytes - int(0.6 * mon.saved_bytes)
    _, st_plain = run(plain, budget=budget, policies=("recompute",))
    ckpt = Case("ckpt", _Blocks(reentrant), (x,))
    ref, _ = run(ckpt)
    got, st = run(ckpt, budget=budget, policies=("recompute",))
    assert got == ref and st is not None and st_plain is not None
    assert st.peak_bytes <= budget and st.policies["recompute"].evicted > 0


def test_disable_inside_later_hooks_is_refused() -> None:
    hybridmem.enable(budget=None, device="cpu")
    with torch.autograd.graph.save_on_cpu():
        with pytest.raises(RuntimeError, match="inside another saved_tensors_hooks"):
            hybridmem.disable()
    hybridmem.disable()
    assert not hybridmem.runtime.enabled()


# ---- plans -------------------------------------------------------------------------------------------
def _recompute_plan(case: Case) -> Plan:
    """Free every saved activation after its last forward use; recompute it before its first backward use."""
    from hybridmem.graph.capture import capture
    from hybridmem.runtime.follow import annotate

    graph = capture(copy.deepcopy(case.model), case.args, case.loss_fn)
    acts = []
    for t in graph.tensors:
        back = [c for c in t.consumers if c >= graph.num_forward]
        if t.saved and t.evictable and back and t.nbytes >= 4096:
            acts.append(Action("free", t.id, max([c for c in t.consumers if c < graph.num_forward] + [t.producer])))
            acts.append(Action("recompute", t.id, back[0]))
    return annotate(Plan(actions=acts, graph_hash=graph.structure_hash()), graph)


def test_plan_is_followed_bit_identically() -> None:
    case = _mlp_case(batch=512)
    plan = _recompute_plan(case)
    ref, _ = run(case)
    got, st = run(case, plan=plan, policies=("recompute",))
    assert got == ref
    assert st is not None and st.plan == "following", st.plan_note
    assert st.policies["recompute"].evicted > 0


def test_stale_plan_is_refused_after_the_first_step() -> None:
    case = _mlp_case(batch=512)
    plan = _recompute_plan(case)
    plan.info["runtime"]["signature"] = "0123456789abcdef"
    with pytest.raises(StalePlanError, match="different step"):
        run(case, plan=plan, policies=("recompute",))


def _steps_through_a_stale_plan(case: Case, steps: int = 3) -> tuple[list, list[str]]:
    """Train ``steps`` steps; a StalePlanError out of backward() is caught (its text kept) and training
    goes on, as its text says it may."""
    model = copy.deepcopy(case.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(0)
    out, errors = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = case.loss(model)
        try:
            loss.backward()
        except StalePlanError as e:
            errors.append(str(e))
        out.append(snapshot(model, loss))
        opt.step()
    return out, errors


def test_plan_for_another_batch_size_is_refused_and_the_step_is_complete() -> None:
    plan = _recompute_plan(_mlp_case(batch=512))
    case = _mlp_case(batch=256)
    ref, _ = _steps_through_a_stale_plan(case)
    with hybridmem.session(plan=plan, budget="64MiB", policies=("recompute",), device="cpu") as s:
        got, errors = _steps_through_a_stale_plan(case)
    assert got == ref  # the step that raised has all its gradients, and the later steps are unchanged
    assert len(errors) == 1 and "input shapes" in errors[0] and "raised from backward()" in errors[0]
    assert "gradients are complete" in errors[0] and "online scorer" in errors[0]
    assert s.stats().plan == "refused" and "bytes" in s.stats().plan_note and s.stats().steps == 3


def test_plan_left_where_the_program_diverges() -> None:
    case = _mlp_case(batch=512)
    plan = _recompute_plan(case)
    model = copy.deepcopy(case.model)
    with hybridmem.session(plan=plan, policies=("recompute",), device="cpu") as s:
        for step in range(3):
            out = model(*case.args)
            loss = (out * 2).square().mean() if step == 2 else case.loss_fn(out)  # step 3: another loss
            loss.backward()
    assert s.stats().plan == "diverged" and "stage" in s.stats().plan_note


def test_plan_without_runtime_annotation_is_rejected() -> None:
    with pytest.raises(PlanFormatError, match="annotate"):
        hybridmem.enable(plan=Plan(actions=[Action("free", 3, 1)]), device="cpu")


def test_budget_helper_matches_issue_definition() -> None:
    _, st = run(_mlp_case(), steps=1, budget=None)
    assert st is not None and budget_for(st) == st.peak_bytes - int(0.4 * st.saved_bytes)


def test_swap_plan_is_followed() -> None:
    """swap_out + free after the last forward use, swap_in before the first backward use."""
    case = _mlp_case(batch=512)
    plan = _recompute_plan(case)
    acts = []
    for a in plan.actions:
        if a.kind == "free":
            acts += [Action("swap_out", a.tensor, a.stage), a]
        else:
            acts.append(Action("swap_in", a.tensor, a.stage))
    plan.actions = acts
    ref, _ = run(case)
    got, st = run(case, plan=plan, policies=("swap",))
    assert got == ref
    assert st is not None and st.plan == "following" and st.policies["swap"].evicted > 0


def test_prefetcher_follows_the_previous_steps_read_order() -> None:
    from hybridmem.runtime.entry import Entry
    from hybridmem.runtime.prefetch import Prefetcher

    class Steps:
        stage = -1

    steps, calls = Steps(), []
    pf = Prefetcher(steps, lookahead=2)  # type: ignore[arg-type]
    for step in range(2):
        entries = []
        for s in range(3):  # forward: stages 0..2 save one tensor each
            steps.stage = s
            e = Entry(tensor=None, nbytes=8, dtype=torch.float32, device=torch.device("cpu"), policy="swap", refs=1)
            pf.saved(e)
            entries.append(e)
        reads = dict(zip((10, 12, 14), reversed(entries)))  # backward reads them in reverse
        for s in range(3, 15):
            steps.stage = s
            if ahead := pf.at(s):
                calls.append([e.stage for e in ahead])
            if s in reads:
                pf.read(reads[s])
        pf.step_ended()
    assert calls == [[2], [1], [0]]  # second step: each two stages before its read
