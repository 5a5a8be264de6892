"""Steady steps far from the budget run without the saved-tensor hooks (runtime.hookless): bit for bit as without
hybridmem, within the budget in real bytes, the step boundaries and counts as with the hooks, and the hook stack
left as it was found."""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem.native import cpumeter
from hybridmem.runtime import current
from tests.helpers.models import BasicBlock
from tests.helpers.peaks import real_peak
from tests.helpers.runtime import raw

pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator meter unavailable: {cpumeter.unavailable_reason()}")

_top = torch._C._autograd._top_saved_tensors_default_hooks


def _resnet_like() -> nn.Module:
    """A small torchvision-style ResNet (two basic blocks) from a config of widths."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         BasicBlock(8, 8, 1), BasicBlock(8, 16, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10))


def _train(model: nn.Module, steps: int, session: dict | None, between: Callable[[int], None] | None = None,
           accum: int = 1) -> tuple[list[bytes], list[bytes], Any, list[int], list[int]]:
    """SGD over ``steps`` batches made inside the loop (a DataLoader's); (losses, parameters, stats, each
    pass's count of steps run without hooks, each steady pass's real peak)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses, hookless, peaks = [], [], []
    ctx = hybridmem.session(**session) if session is not None else None
    s = ctx.__enter__() if ctx is not None else None
    try:
        for i in range(steps):
            x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
            box: list[torch.Tensor] = []

            def step() -> None:
                loss = nn.functional.cross_entropy(model(x), y) / accum
                loss.backward()
                box.append(loss.detach())
            if s is not None and s.stats().steady_steps:
                peaks.append(real_peak(step, model, opt, [x, y]))
            else:
                step()
            losses.append(raw(box[0]))
            if s is not None:
                hookless.append(current.rt.hookless.steps)
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad()
            if between is not None:
                between(i)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return losses, [raw(p) for p in model.parameters()], (s.stats() if s is not None else None), hookless, peaks


@pytest.mark.parametrize("accum", [1, 2])
def test_far_from_the_budget_steps_run_without_hooks_bit_identical_within_the_budget(accum: int) -> None:
    model = _resnet_like()
    ref_losses, ref_params, _, _, _ = _train(model, 8, None, accum=accum)
    _, _, watched, _, _ = _train(model, 8, {"budget": None}, accum=accum)
    budget = 10 * watched.peak_bytes
    losses, params, st, hookless, peaks = _train(model, 8, {"budget": budget}, accum=accum)
    assert (losses, params) == (ref_losses, ref_params)
    # passes: dispatch, recording, a light steady step (it measures how far steps rise), then without hooks
    assert hookless == [0, 0, 0, 1, 2, 3, 4, 5], st.notes
    assert st.steady_steps == 6 and st.steps == 8 and st.optimizer_steps == 8 // accum, st
    assert any("without saved-tensor hooks" in n for n in st.notes), st.notes
    assert st.peak_bytes <= budget and max(peaks) <= budget, (peaks, budget)
    assert st.saved_bytes > 0      # counted as its light steps counted
    assert _top(False) is None     # the stack as before enable()


def test_a_step_that_would_come_near_the_budget_keeps_its_hooks() -> None:
    """A step that starts with more held than the light steps did (the loop keeps a tensor between steps) runs
    with its hooks where its program's rise would take it past half the budget; bit for bit and within it."""
    model = _resnet_like()
    ref_losses, ref_params, _, _, _ = _train(model, 8, None)
    _, _, watched, _, _ = _train(model, 8, {"budget": None})
    budget = 4 * watched.peak_bytes
    kept: list[torch.Tensor] = []

    def hold(i: int) -> None:
        if i == 4:   # from the sixth step on, a quarter of the budget more is held
            kept.append(torch.empty(budget // 4, dtype=torch.uint8))
    losses, params, st, hookless, peaks = _train(model, 8, {"budget": budget}, between=hold)
    assert (losses, params) == (ref_losses, ref_params)
    assert hookless[4] >= 1 and hookless[-1] == hookless[4], (hookless, st.notes)
    assert st.steady_steps == 6 and st.peak_bytes <= budget and max(peaks) <= budget, (st, peaks)


def test_the_hook_stack_is_left_as_found() -> None:
    """enable() inside the user's own saved_tensors_hooks context: steps without hooks take only the runtime's
    off the stack and put them back; after disable() the user's context is on top again. A step run inside a
    context the user opened after enable() keeps the runtime's hooks where they are (under it)."""
    model = _resnet_like()
    seen: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(1)
        return t

    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outer = _top(False)
        with hybridmem.session(budget="1GiB") as s:
            for _ in range(6):
                nn.functional.cross_entropy(model(x), y).backward()
            assert current.rt.hookless.steps >= 2, s.stats().notes
            done = current.rt.hookless.steps
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                before = len(seen)
                nn.functional.cross_entropy(model(x), y).backward()
                assert len(seen) > before                  # the user's inner context saw the saves
            assert current.rt.hookless.steps == done       # not taken off from under another context
            nn.functional.cross_entropy(model(x), y).backward()
        assert _top(False) == outer
    assert _top(False) is None


def test_disable_right_after_a_step_without_hooks_and_a_new_session_after_it() -> None:
    model = _resnet_like()
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    for _ in range(2):
        with hybridmem.session(budget="1GiB"):
            for _ in range(5):
                nn.functional.cross_entropy(model(x), y).backward()
            assert current.rt.hookless.steps >= 1
        assert _top(False) is None


def test_hf_gpt2_far_from_the_budget_with_per_batch_padding_and_accumulation() -> None:
    """A Hugging Face causal LM (its loss in the ``ModelOutput`` backward starts from) with dropout, three padded
    lengths in turn, two micro-batches per optimizer step: the steps of a length with a program of its own run
    without hooks once one of them has run light (when a length gets its own program depends on measured host
    time: runtime.programs); bit for bit as without hybridmem (the same dropout masks), within the budget."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=128)
    model = transformers.GPT2LMHeadModel(cfg).train()
    g = torch.Generator().manual_seed(1)
    batches = []
    for i in range(18):
        length = (32, 48, 64)[i % 3]
        ids = torch.randint(0, 500, (4, length), generator=g)
        batches.append((ids, (torch.arange(length)[None] < torch.randint(length // 2, length + 1, (4, 1),
                                                                            generator=g)).long()))

    def train(session: dict | None) -> tuple[list[bytes], list[bytes], Any, int]:
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        torch.manual_seed(7)  # dropout (GPT-2's default 0.1) draws the same masks in every run
        losses = []
        ctx = hybridmem.session(**session) if session is not None else None
        s = ctx.__enter__() if ctx is not None else None
        try:
            for i, (ids, mask) in enumerate(batches):
                loss = m(input_ids=ids, attention_mask=mask, labels=ids).loss / 2
                loss.backward()
                losses.append(raw(loss.detach()))
                if i % 2 == 1:
                    opt.step()
                    opt.zero_grad()
            hookless = current.rt.hookless.steps if s is not None else 0
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        return losses, [raw(p) for p in m.parameters()], (s.stats() if s is not None else None), hookless

    ref_losses, ref_params, _, _ = train(None)
    _, _, watched, _ = train({"budget": None})
    budget = 10 * watched.peak_bytes
    losses, params, st, hookless = train({"budget": budget})
    assert (losses, params) == (ref_losses, ref_params)
    assert hookless >= 3 and st.steps == 18 and st.optimizer_steps == 9, (hookless, st)
    assert st.peak_bytes <= budget
    assert _top(False) is None


def test_a_step_without_hooks_that_raises_in_its_forward_and_the_loop_goes_on() -> None:
    """An exception in the forward of a step run without hooks (the module pre-hook is off for such a step):
    the next call of the model starts a step seen as usual; training goes on bit for bit as without hybridmem,
    and the hook stack ends as it was found."""

    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _resnet_like()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            h = self.body[0](x)
            if self.calls == 6:
                raise ValueError("a bad batch")
            return self.body[1:](h)

    def train(session: dict | None) -> tuple[list[bytes], list[bytes], int]:
        torch.manual_seed(0)
        m = Flaky()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        losses = []
        with (hybridmem.session(**session) if session is not None else contextlib.nullcontext()):
            for _ in range(10):
                x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
                try:
                    loss = nn.functional.cross_entropy(m(x), y)
                except ValueError:
                    # it raised in a step run without hooks, the module pre-hook off
                    assert session is None or (current.rt.hookless.active and current.rt.fixed.calls.paused)
                    continue
                loss.backward()
                losses.append(raw(loss.detach()))
                opt.step()
                opt.zero_grad()
            hookless = current.rt.hookless.steps if session is not None else 0
        return losses, [raw(p) for p in m.parameters()], hookless

    ref_losses, ref_params, _ = train(None)
    losses, params, hookless = train({"budget": "1GiB"})
    assert (losses, params) == (ref_losses, ref_params)
    assert hookless >= 4
    assert _top(False) is None


@pytest.mark.parametrize("budget", [None, "1GiB"], ids=["watching", "budget"])
def test_no_hook_stays_on_the_model_after_disable_and_a_later_model_gets_its_own(budget: str | None) -> None:
    """The root module's hooks (its inputs read, its outputs given to runtime.hookless) come off at ``disable()``
    and go back when the same runtime is installed again, before the model's next call; a model made after the
    first one is gone gets them too, and its steps run without the saved-tensor hooks as the first one's did."""
    from bench import measure

    def hooks(m: nn.Module) -> int:
        return len(m._forward_pre_hooks) + len(m._forward_hooks) + sum(
            len(p._post_accumulate_grad_hooks or ()) for p in m.parameters())

    def steps_without(m: nn.Module, run: Callable[[], Any], n: int) -> int:
        x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
        for _ in range(n):
            with run() as rt:
                nn.functional.cross_entropy(m(x), y).backward()
                mon = rt.allocator if budget is None else rt
                got = mon.hookless.steps
            m.zero_grad(set_to_none=True)
            assert hooks(m) == 0  # off between installs
        return got

    run = measure.persistent_runtime(budget=budget, device="cpu")
    first = _resnet_like()
    assert steps_without(first, run, 6) >= 2  # each install puts the hooks back before the call that needs them
    del first
    second = _resnet_like()
    before = steps_without(second, run, 1)
    assert steps_without(second, run, 6) - before >= 2
    assert _top(False) is None


@pytest.mark.parametrize("budget", [None, "1GiB"], ids=["watching", "budget"])
def test_a_loss_built_from_a_captured_tensor_ends_its_step(budget: str | None) -> None:
    """A step run without hooks ends when its backward pass reaches the root's outputs, or where the root's first
    trainable parameter accumulates its gradient: a loss built from a tensor a forward hook captured (not from
    what the model returns) still ends each step, counted as with the hooks, bit for bit."""

    def train(session: dict | None) -> tuple[list[bytes], list[bytes], Any, int]:
        model = _resnet_like()
        captured: list[torch.Tensor] = []
        model[5].register_forward_hook(lambda m, a, out: captured.append(out))  # the pooled features
        head = nn.Linear(16, 10)
        opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
        g = torch.Generator().manual_seed(1)
        losses = []
        with (hybridmem.session(**session) if session is not None else contextlib.nullcontext()) as s:
            for _ in range(8):
                x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
                captured.clear()
                model(x)  # its logits go unused
                loss = nn.functional.cross_entropy(head(captured[0].flatten(1)), y)
                loss.backward()
                losses.append(raw(loss.detach()))
                opt.step()
                opt.zero_grad()
            rt = current.rt if s is not None else None
            hookless = (rt.allocator if budget is None else rt).hookless.steps if rt is not None else 0
        return losses, [raw(p) for p in model.parameters()], (s.stats() if s is not None else None), hookless

    ref_losses, ref_params, _, _ = train(None)
    losses, params, st, hookless = train({"budget": budget, "device": "cpu"})
    assert (losses, params) == (ref_losses, ref_params)
    assert st.steps == 8 and st.optimizer_steps == 8 and hookless >= 2
    assert _top(False) is None
