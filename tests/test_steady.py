"""Steady state: steps after the recorded one run without the dispatch mode (hybridmem.runtime.program).

Each test trains a model unmanaged and under a recompute budget, same seeds, same random draws, and
compares losses, gradients, parameters and buffers bit for bit. Steady-state steps must really evict
and rebuild (the allocator frees registered entries; unpack replays the recorded program), stay under
the budget in real allocator bytes, and leave the steady state, saying why, when a step differs.
"""
from __future__ import annotations

import dataclasses
import gc
from typing import Any, Callable

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem.native import cpumeter
from hybridmem.runtime import current
from hybridmem.runtime.programs import PassCosts
from tests.helpers.runtime import in_fresh_process
from tests.helpers.steady import (budget_run as _budget_run, monitor_peak as _monitor_peak,
                                  recompute_stats as _rc, steady_real_bytes as _steady_real_bytes,
                                  train_steps as _train, zoo_batches as _zoo)

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator device unavailable: {cpumeter.unavailable_reason()}")


@pytest.mark.parametrize("name,cut", [("resnet50", 0.3), ("mobilenet", 0.3), ("unet", 0.3), ("resnet101", 0.3), ("transformer", 0.3), ("gpt", 0.3)])
def test_zoo_steady_state_evicts_and_is_bit_identical(name: str, cut: float) -> None:
    model, batches, loss_fn = _zoo(name)
    ref, _ = _train(model, batches, loss_fn)
    got, st, budget, per = _budget_run(model, batches, loss_fn, cut=cut)
    assert got == ref
    # step 1 runs under the dispatch mode (the optimizer's state appears after it), step 2 records
    assert st.steady_steps == len(batches) - 2, st.notes
    rc = [_rc(s) for s in per]
    # steady-state steps evict (the allocator frees registered entries) and rebuild what they evicted
    assert rc[-1].evicted > rc[1].evicted and rc[-1].regenerated > rc[1].regenerated
    assert st.peak_bytes <= budget


@pytest.mark.parametrize("cut", [0.2, 0.4])
def test_near_the_floor_a_steady_step_rebuilds_about_what_its_recording_did(cut: float) -> None:
    """Near the least budget (ResNet-50 at batch 2, 32 px: 5 % and 10 % under the watched peak) a steady step
    rebuilds about what its recorded step did: it keeps free after each save and read what the recorded step
    rose until the next one, not the most it rose anywhere (which evicted, at every save, what backward
    then rebuilt: 1,430 and 2,433 tensors a step where the recording rebuilt 8 and 20)."""
    model, batches, loss_fn = _zoo("resnet50", steps=6, size="tiny")
    ref, _ = _train(model, batches, loss_fn)
    peak, saved = _monitor_peak(model, batches, loss_fn)
    budget = int(peak - cut * saved)
    per: list[Any] = []
    got, st = _train(model, batches, loss_fn, per_step=lambda i, s: per.append(s),
                     session={"budget": budget, "policies": ("recompute",)})
    assert got == ref
    assert st.peak_bytes <= budget and st.cap_overruns == 0, st
    assert st.steady_steps == len(batches) - 2, st.notes
    rebuilt = [_rc(b).regenerated - _rc(a).regenerated for a, b in zip(per, per[1:])]  # steps 2..6
    assert rebuilt[0] > 0, "the budget must bite in the recorded step"
    assert max(rebuilt[1:]) <= 4 * rebuilt[0], rebuilt


def test_steady_state_real_peak_within_budget() -> None:
    """Measured independently of hybridmem (torch.profiler's memory events) in a steady-state step."""
    real, budget, st = _steady_real_bytes("resnet50", 0.25, "recompute")
    assert st.steady_steps == 2, st.notes
    assert st.policies["recompute"].evicted > 0
    assert real <= budget, (real, budget)


class _Block(nn.Module):
    """A torchvision-style bottleneck block (BN, in-place ReLU, residual) the zoo does not build."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.b = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(x + self.bn2(self.b(self.relu(self.bn1(self.a(x))))))


class _Encoder(nn.Module):
    """An HF-style encoder layer stack (LayerNorm, GELU MLP, attention by SDPA), no dropout."""

    def __init__(self, d: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, d)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True,
                                                                activation="gelu", norm_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(d, 100)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=padding)
        return self.head(x)


def _cnn() -> tuple[nn.Module, Callable[[int], tuple], Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), *[_Block(16) for _ in range(4)],
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    g = torch.Generator().manual_seed(1)

    def batch(n: int = 8, hw: int = 32) -> tuple:
        return torch.randn(n, 3, hw, hw, generator=g), torch.randint(0, 10, (n,), generator=g)
    return model, batch, lambda m, x, y: nn.functional.cross_entropy(m(x), y)


def test_unseen_models_new_batch_each_step() -> None:
    """New data every step: the program binds each step's input where the recorded one read its own."""
    model, batch, loss_fn = _cnn()
    batches = [batch() for _ in range(4)]
    ref, _ = _train(model, batches, loss_fn)
    got, st, _, per = _budget_run(model, batches, loss_fn, cut=0.4)
    assert got == ref
    assert st.steady_steps == 2, st.notes
    assert _rc(per[-1]).regenerated > _rc(per[1]).regenerated

    # the padding mask is a keyword argument the layers read but autograd does not save: the program
    # binds it at the step's first module call
    torch.manual_seed(0)
    enc = _Encoder()
    g = torch.Generator().manual_seed(2)
    pad = torch.zeros(4, 32, dtype=torch.bool)
    pad[:, 28:] = True
    ids = [(torch.randint(0, 100, (4, 32), generator=g), pad.clone()) for _ in range(4)]
    ce = lambda m, i, p: nn.functional.cross_entropy(m(i, padding=p).flatten(0, 1), i.flatten())  # noqa: E731
    ref, _ = _train(enc, ids, ce)
    got, st, _, per = _budget_run(enc, ids, ce, cut=0.4)
    assert got == ref
    assert st.steady_steps == 2, st.notes
    assert _rc(per[-1]).regenerated > _rc(per[1]).regenerated


def test_a_step_with_other_inputs_records_its_own_program_and_the_first_is_followed_again() -> None:
    model, batch, loss_fn = _cnn()
    batches = [batch(), batch(), batch(n=4), batch(n=4), batch(n=4), batch(), batch(n=4)]
    ref, _ = _train(model, batches, loss_fn)
    got, st, _, per = _budget_run(model, batches, loss_fn, cut=0.3)
    assert got == ref
    # step 1 runs under the dispatch mode, 2 records; 3 has other inputs: it switches to the dispatch mode at
    # its first module call (before any op) and records their program; 4 and 5 follow it, 6 follows the
    # first program again, 7 the second
    assert [p.steady_steps for p in per] == [0, 0, 0, 1, 2, 3, 4], st.notes
    assert not any("steady state left" in n for n in st.notes), st.notes
    assert any("one program per input shape" in n for n in st.notes), st.notes


@pytest.mark.parametrize("follows", [2, 1 << 20])
def test_smaller_inputs_follow_the_program_of_larger_ones_scaled(monkeypatch: pytest.MonkeyPatch,
                                                                 follows: int) -> None:
    """A smaller batch follows the program recorded for a larger one (what it recomputed is swapped, nothing is
    rebuilt from ops recorded at the other size) as many times as the pass costs say following is cheaper
    than recording (fixed here: two, or always); a larger batch than any recorded runs under the dispatch
    mode and is recorded. Bit for bit, within the budget."""
    monkeypatch.setattr(PassCosts, "follows_before_recording", lambda self: follows)
    model, batch, loss_fn = _cnn()
    batches = [batch(), batch(), batch(n=4), batch(), batch(n=4), batch(n=4), batch(), batch(n=12), batch(n=4)]
    ref, _ = _train(model, batches, loss_fn)
    got, st, budget, per = _budget_run(model, batches, loss_fn, cut=0.3,
                                       policies=("swap", "recompute", "compress"))
    assert got == ref
    assert st.peak_bytes <= budget
    if follows == 2:
        # 1 dispatch, 2 records 8; 3 (4) scaled, 4 (8) exact, 5 (4) scaled, 6 (4) records 4, 7 (8) exact,
        # 8 (12: larger than any) records, 9 (4) exact
        assert [p.steady_steps for p in per] == [0, 0, 1, 2, 3, 3, 4, 4, 5], st.notes
        assert st.programs == 3, st.notes
    else:  # 6 and 9 (4) follow the program of 8, then of 12, scaled
        assert [p.steady_steps for p in per] == [0, 0, 1, 2, 3, 4, 5, 5, 6], st.notes
        assert st.programs == 2, st.notes
    assert not any("steady state left" in n for n in st.notes), st.notes


def test_slightly_larger_inputs_follow_a_smaller_program_evicting_more(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch a little larger than any recorded (here 9 after 8: at most GROWTH_FOLLOWED) follows the largest
    smaller program scaled, keeping free what rose between its saves and reads grown with the sizes, and
    evicting by swap what the budget needs beyond the recorded step; one much larger (12) is recorded.
    Bit for bit, within the budget, no allocation let past it."""
    monkeypatch.setattr(PassCosts, "follows_before_recording", lambda self: 1 << 20)
    model, batch, loss_fn = _cnn()
    batches = [batch(), batch(), batch(n=9), batch(n=9), batch(n=12), batch(n=9), batch()]
    ref, _ = _train(model, batches, loss_fn)
    got, st, budget, per = _budget_run(model, batches, loss_fn, cut=0.3, policies=("swap", "recompute"))
    assert got == ref
    assert st.peak_bytes <= budget and st.cap_overruns == 0, st
    # 1 dispatch, 2 records 8; 3, 4 (9) scaled up; 5 (12) records; 6 (9) scaled down from 12; 7 (8) exact
    assert [p.steady_steps for p in per] == [0, 0, 1, 2, 2, 3, 4], st.notes
    assert st.programs == 2, st.notes
    assert st.policies["swap"].evicted > 0


def test_each_regime_s_passes_are_timed_for_the_choice_to_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host time of each pass, per input element, goes to the regime it ran in: the recording steps,
    steps following their own program, steps following a larger one's scaled (runtime.programs). (What
    the choice makes of the times is fixed here: step 5 follows scaled whatever they are.)"""
    monkeypatch.setattr(PassCosts, "follows_before_recording", lambda self: 1 << 20)
    model, batch, loss_fn = _cnn()
    batches = [batch(), batch(), batch(n=4), batch(), batch(n=4)]
    _, watched = _train(model, batches, loss_fn, session={"budget": None})
    costs: list[Any] = []

    def keep_costs(i: int, st: Any) -> None:
        rt = current.rt
        costs.append(dataclasses.replace(rt.programs.costs))

    _train(model, batches, loss_fn, per_step=keep_costs,
           session={"budget": int(watched.peak_bytes * 0.9), "policies": ("swap", "recompute")})
    blank = PassCosts()
    assert costs[0] == blank                                   # step 1: the dispatch mode, not recording
    assert costs[1].record and costs[1].own is None and costs[1].scaled is None  # step 2 records
    assert costs[2].scaled and costs[2].own is None            # step 3 (smaller) follows step 2's scaled
    assert costs[3].own and costs[3].record == costs[1].record  # step 4 follows its own
    assert costs[4].scaled != costs[2].scaled                  # step 5 scaled again


def test_far_from_the_budget_module_state_is_kept_as_it_is_and_a_new_target_still_counted() -> None:
    """Far from the budget a steady step keeps a parameter's save with no check (the recorded step saw the
    same storage, counted); a tensor the recorded step kept that is new each step (the loss's target, made
    before the runtime was installed) still goes through the store, which counts its bytes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    batches = [(torch.randn(16, 32), torch.randn(16, 8)) for _ in range(5)]

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(m(x), y)
    ref, watched = _train(model, batches, loss_fn, session={"budget": None})
    progs: list[Any] = []
    got, st = _train(model, batches, loss_fn, session={"budget": 10 * watched.peak_bytes, "policies": ("recompute",)},
                     per_step=lambda i, s: progs.append(current.rt.programs.last))
    assert got == ref and st.steady_steps == 3, st.notes
    saves = progs[-1].saves
    assert {tuple(s.shape) for s in saves if s.kept} == {(64, 8)}  # the second weight, transposed (x needs no grad)
    assert [s.kept for s in saves if s.node is None and tuple(s.shape) == (16, 8)] == [False]  # the target
    assert st.peak_bytes >= watched.peak_bytes, (st.peak_bytes, watched.peak_bytes)


class _Branchy(nn.Module):
    """A branch taken on the data: the deeper path saves more, from the same inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 256)
        self.rest = nn.ModuleList(nn.Linear(256, 256) for _ in range(6))
        self.c = nn.Linear(256, 1)

    def forward(self, x: torch.Tensor, deep: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if bool(deep):
            h = torch.tanh(self.b(h)) * 0.5
        for m in self.rest:
            h = torch.tanh(m(h))
        return self.c(h).square().mean()


def _part_way_case() -> tuple[bool, bool, list[int], list[str]]:
    """Trained unmanaged and under a budget: (bit-identical, within the budget, steady steps after each step,
    notes). The budget comes from a run that took the deeper branch too (its step holds more than the recorded
    one), with swap beside recompute: what the step matched before it left is no longer rebuilt from the
    program, and the dispatch mode that takes the rest over may swap it."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _Branchy()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(512, 64, generator=g), torch.tensor(i == 3)) for i in range(7)]
    ref, _ = _train(model, batches, lambda m, x, d: m(x, d))
    _, watched = _train(model, batches, lambda m, x, d: m(x, d), session={"budget": None})
    budget = int(watched.peak_bytes - 0.15 * watched.saved_bytes)
    per: list = []
    got, st = _train(model, batches, lambda m, x, d: m(x, d), per_step=lambda i, s: per.append(s),
                     session={"budget": budget, "policies": ("swap", "recompute")})
    return got == ref, st.peak_bytes <= budget, [p.steady_steps for p in per], list(st.notes)


def test_a_part_way_leave_is_taken_over_above_a_mode_entered_before_enable() -> None:
    """A dispatch mode entered before hybridmem (the user's, or one a finished runtime left quieted on this
    thread) stays under the runtime's: the step that leaves part-way is still taken over by hybridmem's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Below(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    with Below():
        same, within, steady, notes = _part_way_case()
    assert same and within, notes
    assert steady == [0, 0, 1, 2, 2, 3, 4], notes


def test_a_step_that_leaves_its_program_part_way_says_why_and_records_again() -> None:
    """Same inputs, other saves (a branch taken on the data): the step leaves its program at the first save
    that differs and keeps what it saves from there; the next step records anew and later ones follow. In a
    process of its own: the dispatch mode taking the step over must be the only mode entered."""
    same, within, steady, notes = in_fresh_process(_part_way_case)
    assert same and within, notes
    assert any("steady state left at step 4" in n for n in notes), notes
    # 1 dispatch, 2 records, 3 follows, 4 leaves part-way (counted: it started steady), 5 records, 6-7 follow
    assert steady == [0, 0, 1, 2, 2, 3, 4], notes


@pytest.mark.parametrize("write_at, message", [
    (3, "modified by an in-place operation"),   # the first steady step: light packs, hybridmem's check
    (5, "modified by an inplace operation"),    # a step run without the hooks (runtime.hookless): autograd's own
])
def test_in_place_write_to_a_saved_tensor_is_caught_in_the_steady_state(write_at: int, message: str) -> None:
    class Sneaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)
            self.step = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            y = h.sigmoid()  # saves its output
            self.step += 1
            if self.step == write_at:
                y.mul_(2)  # modifies the saved output: autograd's own check is off under hooks
            return y.sum()

    m = Sneaky()
    x = torch.randn(64, 32)
    with hybridmem.session(budget="1GiB", policies=("recompute",)) as s:
        for _ in range(write_at - 1):
            m(x).backward()
        assert s.stats().steady_steps == write_at - 3 and current.rt.hookless.steps == max(write_at - 4, 0)
        with pytest.raises(RuntimeError, match=message):
            m(x).backward()


def test_dropout_near_the_budget_replays_with_each_steps_random_state() -> None:
    """A dropout module's draw gets the generator state read when the module is called in that step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.2)) for _ in range(6)],
                          nn.Linear(64, 1))
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(256, 64, generator=g),) for _ in range(5)]
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    ref, _ = _train(model, batches, loss_fn)
    got, st, _, per = _budget_run(model, batches, loss_fn, cut=0.4)
    assert got == ref
    assert st.steady_steps == 3, st.notes
    assert _rc(per[-1]).regenerated > _rc(per[1]).regenerated


class _TwoDraws(nn.Module):
    """Two dropouts in one module call, no submodule between them: the second one's state is not the
    state at a module call."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(64, 64) / 8)
        self.w2 = nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(nn.functional.gelu(x @ self.w1), 0.2)
        return nn.functional.dropout(nn.functional.gelu(h @ self.w2), 0.2)


def test_random_ops_the_program_cannot_replay_keep_the_dispatch_mode() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[_TwoDraws() for _ in range(4)], nn.Linear(64, 1))
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(256, 64, generator=g),) for _ in range(4)]
    loss_fn = lambda m, x: m(x).square().mean()  # noqa: E731
    ref, _ = _train(model, batches, loss_fn)
    got, st, _, _ = _budget_run(model, batches, loss_fn, cut=0.5)
    assert got == ref
    assert st.steady_steps == 0
    assert any("after another random op in the same module call" in n for n in st.notes), st.notes
    got, st = _train(model, batches, loss_fn, session={"budget": "4GiB", "policies": ("recompute",)})
    assert got == ref
    assert st.steady_steps == 2, st.notes  # far from the budget nothing is evicted: the steady state runs


def test_steady_state_can_be_switched_off_and_checks_its_setting() -> None:
    model, batch, loss_fn = _cnn()
    batches = [batch() for _ in range(3)]
    ref, _ = _train(model, batches, loss_fn)
    got, st, _, _ = _budget_run(model, batches, loss_fn, cut=0.3, config={"plugins": {"steady": False}})
    assert got == ref
    assert st.steady_steps == 0
    with pytest.raises(ValueError, match="steady: expected true or false"):
        hybridmem.enable(budget="1GiB", config={"plugins": {"steady": "yes"}})


def test_steady_state_rebuilds_each_tensor_once_per_chain_without_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuild in a steady-state step plans its whole chain at once (sources the allocator already freed
    are replayed within it, those it has not are held for it), so no tensor is rebuilt twice by one chain,
    and its ops run without the dispatch mode (the allocator caps each allocation)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from hybridmem import runtime as rtmod
    from hybridmem.runtime import replay

    model, batches, loss_fn = _zoo("gpt")
    ref, _ = _train(model, batches, loss_fn)
    replays: list[tuple[int, int, int]] = []  # (runtime, step, node) per node replayed in a steady-state step
    modes: list[bool] = []                    # per op replayed in one: whether the runtime's mode was active
    run, call = replay.Replayer._replay, replay.Replayer._call

    def steady() -> Any:
        rt = rtmod.current.rt
        return rt if rt is not None and rt._steady is not None else None

    def counted(self: Any, n: Any, v: int, memo: dict) -> Any:
        rt = steady()
        if rt is not None:
            replays.append((id(rt), rt.steps.steps, id(n)))
        return run(self, n, v, memo)

    def seen(self: Any, func: Any, args: Any, kwargs: Any, rng: Any = None) -> Any:
        rt = steady()
        if rt is not None:
            modes.append(_get_current_dispatch_mode() is rt.mode)
        return call(self, func, args, kwargs, rng)

    monkeypatch.setattr(replay.Replayer, "_replay", counted)
    monkeypatch.setattr(replay.Replayer, "_call", seen)
    got, st, budget, _ = _budget_run(model, batches, loss_fn, cut=0.5)
    assert got == ref
    assert st.steady_steps == len(batches) - 2, st.notes
    assert st.peak_bytes <= budget
    assert replays, "the steady-state steps rebuilt nothing"
    assert len(replays) == len(set(replays)), "a node was replayed twice in one steady-state step"
    assert modes and not any(modes), "a steady-state rebuild ran under the runtime's dispatch mode"


def test_leaving_after_the_allocator_freed_a_matched_tensor_raises_instead_of_rebuilding_it() -> None:
    """A step that leaves its program part-way takes what it matched to program nodes off them (kept as they
    are); one the allocator had already freed cannot be rebuilt from ops that may not be its own: the step
    stops with StepDivergedError rather than train on it."""
    from types import SimpleNamespace

    from hybridmem.errors import StepDivergedError
    from hybridmem.runtime.program import StepProgram
    from hybridmem.runtime.steady import SteadyParts, SteadyStep

    said: list[str] = []
    claims = {1: True, 2: False}
    parts = SteadyParts(*([None] * 4), said.append, *([None] * 6), claim=lambda e: claims[e.uid],
                        pack_plain=None)
    step = SteadyStep(StepProgram([], [], [], [], []), parts)
    node = SimpleNamespace(entry=None, storage=object())
    kept = SimpleNamespace(uid=1, tensor=torch.zeros(1), policy=None, lineage=node, refs=1)
    node.entry = kept
    swapped = SimpleNamespace(uid=3, tensor=None, policy="swap", lineage=object(), refs=1)
    step.bound = [kept, swapped]
    step.leave("save #1 differs")
    assert said == ["save #1 differs"] and step.off
    assert kept.lineage is None and node.entry is None and node.storage is None  # never rebuilt from the node

    freed = SimpleNamespace(uid=2, tensor=torch.zeros(1), policy=None, lineage=object(), refs=1)  # claim: freed
    dropped = SimpleNamespace(uid=4, tensor=None, policy="recompute", lineage=object(), refs=1)
    released = SimpleNamespace(uid=5, tensor=None, policy=None, lineage=object(), refs=0)  # nothing reads it
    step2 = SteadyStep(StepProgram([], [], [], [], []), parts)
    step2.bound = [freed, dropped, released]
    with pytest.raises(StepDivergedError, match="freed 2 tensor"):
        step2.leave("save #3 differs")


class _Spiky(nn.Module):
    """An MLP whose step ``spike_at`` allocates ``spike`` bytes of scratch in forward (a kernel's workspace,
    a data-dependent buffer): more than the recorded step ever needed, in a step that runs without the
    dispatch mode."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(6))
        self.spike_at, self.spike = -1, 0

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = x
        for i, layer in enumerate(self.layers):
            h = torch.relu(layer(h))
            if i == 2 and step == self.spike_at:
                torch.empty(self.spike, dtype=torch.uint8).fill_(1)
        return h.square().mean()


def _spiky_loss(model: nn.Module, i: int) -> torch.Tensor:
    # each step's batch is made in the step and dropped after it, as a data loader's would be
    return model(torch.randn(512, 256, generator=torch.Generator().manual_seed(i)), i)


def _spiky_case(spike: float) -> tuple[nn.Module, list[tuple], int]:
    torch.manual_seed(0)
    model = _Spiky()
    batches = [(i,) for i in range(8)]
    peak, saved = _budget_monitor(model, batches)
    budget = int(peak - 0.5 * saved)
    model.spike_at, model.spike = 4, int(spike * budget)
    return model, batches, budget


def _budget_monitor(model: nn.Module, batches: list[tuple]) -> tuple[int, int]:
    _, st = _train(model, batches[:2], _spiky_loss, session={"budget": None})
    return st.peak_bytes, st.saved_bytes


def test_a_steady_step_the_budget_cannot_hold_names_one_that_does() -> None:
    """A refusal in a steady step (no op hook to retry in) is not a bare OOM: the step goes on, the next one
    measures under the dispatch mode, and the error names a budget; at it, the run trains exactly."""
    model, batches, budget = _spiky_case(0.5)
    ref, _ = _train(model, batches, _spiky_loss)
    message, named = "", 0
    try:
        _train(model, batches, _spiky_loss, session={"budget": budget})
    except torch.OutOfMemoryError as e:  # (its traceback holds the failed run's model: dropped here)
        message, named = str(e), getattr(e, "min_budget_bytes", 0)
    gc.collect()
    assert named > budget, message or "no OutOfMemoryError"
    assert "steady-state step" in message
    got, st = _train(model, batches, _spiky_loss, session={"budget": named})
    assert got == ref
    assert st.peak_bytes <= named
    assert st.steady_steps >= 4, st.notes


def test_a_steady_step_over_its_budget_evicts_and_its_shape_is_recorded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where what the step holds could be evicted (the allocator alone could not: entries it was not given),
    the step evicts at its next save and goes on; its program is retired and the next step records anew."""
    from hybridmem.runtime.residency import Residency

    monkeypatch.setattr(Residency, "need", lambda self, extra, held: 0)  # everything it held was evictable
    model, batches, budget = _spiky_case(0.5)
    ref, _ = _train(model, batches, _spiky_loss)
    got, st = _train(model, batches, _spiky_loss, session={"budget": budget})
    assert got == ref
    assert st.cap_overruns >= 1
    assert any("recorded again under the dispatch mode" in n for n in st.notes), st.notes
    # steps 2-4 and 6-7 in the steady state; step 5 records the retired program's shape again
    assert st.steady_steps == 5, st.notes
    assert st.programs == 2
