"""Watching (``budget=None``) steps whose inputs were watched before run without the counting hooks
(runtime.monitor): losses and gradients bit for bit, each step's saved bytes and the peak as when every step is
watched, the hook stack and torch's module hook table left as they were found."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem.native import cpumeter
from hybridmem.runtime import current
from hybridmem.runtime.hookless import Hookless
from hybridmem.runtime.monitor import signature
from tests.helpers.runtime import raw

pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator meter unavailable: {cpumeter.unavailable_reason()}")

_top = torch._C._autograd._top_saved_tensors_default_hooks
LENGTHS = (8, 16, 8, 24, 16, 8, 24, 16)  # per-batch padding: a length per batch, each seen again


class Tagger(nn.Module):
    """A token tagger from a config: embedding, two encoder layers with dropout, a head; keyword inputs as a
    Hugging Face model takes them (``input_ids``, ``attention_mask``)."""

    def __init__(self, vocab: int = 50, d: int = 32, heads: int = 2, layers: int = 2, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.1, batch_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(d, classes)

        self.fail = False  # the next call raises (a batch a user's code refuses)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, scale: float = 1.0,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.fail:
            self.fail = False
            raise ValueError("a batch the model refuses")
        h = self.embed(input_ids)
        pad = None if attention_mask is None else attention_mask == 0
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=pad)
        out = self.head(h) * scale
        if labels is None:
            return out
        return nn.functional.cross_entropy(out.flatten(0, 1), labels.flatten())  # the loss, as HF models give it


def _batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 50, (4, n), generator=g)
    mask = torch.ones(4, n, dtype=torch.long)
    mask[1, n // 2:] = 0
    return ids, mask, torch.randint(0, 5, (4, n), generator=g)


def _train(session: dict | None, accum: int = 2, between: Callable[[int], None] | None = None,
           fail_at: int = -1, premade: bool = False, labels: bool = False,
           device: str = "cpu") -> tuple[list[bytes], list[bytes], list[tuple[int, int]], Any, int]:
    """AdamW over batches of the lengths in ``LENGTHS``, made inside the loop (a data loader's), or before
    ``enable()`` with ``premade``; the loss computed by the model from ``labels`` (as HF models do), else from
    its output; (losses, parameters, each pass's (saved bytes, storages), stats, passes run without hooks)."""
    torch.manual_seed(0)
    model = Tagger().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = [_batch(n, g) for n in LENGTHS] if premade else None
    torch.manual_seed(2)  # dropout draws the same masks in every run, on either device
    losses, saved = [], []
    ctx = hybridmem.session(**session) if session is not None else None
    s = ctx.__enter__() if ctx is not None else None
    try:
        for i, n in enumerate(LENGTHS):
            ids, mask, target = (t.to(device) for t in (batches[i] if batches is not None else _batch(n, g)))
            if i == fail_at:
                model.fail = True
                with pytest.raises(ValueError, match="refuses"):
                    model(input_ids=ids, attention_mask=mask)
            if labels:
                loss = model(input_ids=ids, attention_mask=mask, labels=target) / accum
            else:
                out = model(input_ids=ids, attention_mask=mask)
                loss = nn.functional.cross_entropy(out.flatten(0, 1), target.flatten()) / accum
            loss.backward()
            losses.append(raw(loss.detach()))
            if s is not None:
                st = s.stats()
                saved.append((st.saved_bytes, st.saved_tensors))
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad()
            if between is not None:
                between(i)
        mon = current.rt.allocator if s is not None else None
        hookless = mon.hookless.steps if mon is not None else 0
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return losses, [raw(p) for p in model.parameters()], saved, (s.stats() if s is not None else None), hookless


def test_known_inputs_run_without_hooks_bit_identical_with_the_same_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    ref_losses, ref_params, _, _, _ = _train(None)
    losses, params, saved, st, hookless = _train({"budget": None, "device": "cpu"})
    assert (losses, params) == (ref_losses, ref_params)
    # the first pass counts the weights made before enable() (no model step to repeat); the lengths watched
    # whole at the second to fourth passes come back at the fifth to eighth
    assert hookless == 4
    with monkeypatch.context() as m:
        m.setattr(Hookless, "start", lambda self: False)
        _, _, watched_saved, watched, none = _train({"budget": None, "device": "cpu"})
    assert none == 0 and len(set(watched_saved)) == 3  # three lengths, three counts
    # each pass counts what it counts watched whole, the steps and optimizer steps as then
    assert saved == watched_saved and (st.steps, st.optimizer_steps) == (watched.steps, watched.optimizer_steps) \
        == (len(LENGTHS), len(LENGTHS) // 2)
    assert st.peak_bytes == watched.peak_bytes  # the allocator's own peak: the hooks held no allocator bytes
    from hybridmem.cli import run_summary
    assert "8 step(s) (backward passes; 4 optimizer step(s))" in run_summary(st).splitlines()[0]


@pytest.mark.parametrize("labels", [True, False], ids=["loss-in-the-model", "loss-outside"])
def test_batches_made_before_enable(labels: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch made before ``enable()`` (a list of them, as tests and benchmarks keep) is state the allocator never
    saw. Given to the model, it is counted at the model's call, with or without the hooks, so its steps run
    without them too. A target the loss reads outside the model is counted where the loss saves it: each such
    step counts state no earlier step showed, and keeps its hooks."""
    ref_losses, ref_params, _, _, _ = _train(None, premade=True, labels=labels)
    losses, params, saved, st, hookless = _train({"budget": None, "device": "cpu"}, premade=True, labels=labels)
    assert (losses, params) == (ref_losses, ref_params)
    assert hookless == (4 if labels else 0)
    with monkeypatch.context() as m:
        m.setattr(Hookless, "start", lambda self: False)
        _, _, watched_saved, watched, _ = _train({"budget": None, "device": "cpu"}, premade=True, labels=labels)
    assert saved == watched_saved and st.peak_bytes == watched.peak_bytes


def test_the_hook_stack_and_torchs_module_hooks_are_left_as_found() -> None:
    global_pre = dict(torch.nn.modules.module._global_forward_pre_hooks)
    tops: list[str] = []

    def between(i: int) -> None:
        t = _top(False)
        tops.append("outer" if t == outer else "ours" if t[0] == current.rt.allocator.pack else "other")

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        outer = _top(False)
        _, _, _, _, hookless = _train({"budget": None, "device": "cpu"}, between=between)
        assert _top(False) == outer
    assert _top(False) is None
    assert dict(torch.nn.modules.module._global_forward_pre_hooks) == global_pre
    assert hookless == 4
    # between steps the runtime's hooks are on the stack above the user's context, or off it after a step run
    # without them
    assert tops == ["ours"] * 4 + ["outer"] * 4


def test_a_context_opened_around_a_step_keeps_its_hooks_and_sits_above_them() -> None:
    ref_losses, ref_params, _, _, _ = _train(None)
    inside: list[Any] = []

    class Around:
        """``save_on_cpu`` around the passes 5 and 6, opened after a step that ran without hooks."""

        def __init__(self) -> None:
            self.ctx: Any = None

        def __call__(self, i: int) -> None:
            if i == 3:
                self.ctx = torch.autograd.graph.save_on_cpu()
                self.ctx.__enter__()
                inside.append(_top(False))
            elif i == 5:
                inside.append(_top(False))
                self.ctx.__exit__(None, None, None)

    losses, params, _, st, hookless = _train({"budget": None, "device": "cpu"}, between=Around())
    assert (losses, params) == (ref_losses, ref_params) and st.steps == len(LENGTHS)
    assert inside[0] == inside[1]  # the context stayed on top through the steps under it
    # the passes under it keep the hooks (the context takes their saves: no step to repeat); the 7th and 8th
    # repeat the 4th and 2nd
    assert hookless == 2


def test_a_forward_that_raises_in_a_step_without_hooks_and_the_loop_goes_on() -> None:
    ref_losses, ref_params, _, _, _ = _train(None, fail_at=5)
    _, _, whole, _, _ = _train({"budget": None, "device": "cpu"})
    losses, params, saved, st, hookless = _train({"budget": None, "device": "cpu"}, fail_at=5)
    assert (losses, params) == (ref_losses, ref_params)
    assert saved == whole and st.steps == len(LENGTHS)
    assert hookless == 4
    assert _top(False) is None


def test_the_signature_tells_apart_what_changes_what_a_step_saves() -> None:
    model = Tagger()
    ids = torch.zeros(2, 8, dtype=torch.long)
    base = signature(model, (), {"input_ids": ids})
    assert signature(model, (), {"input_ids": torch.ones(2, 8, dtype=torch.long)}) == base  # values: same step
    assert signature(model, (), {"input_ids": ids[:, :4]}) != base                          # a new length
    assert signature(model, (), {"input_ids": ids, "scale": 2.0}) != base                    # another argument
    assert signature(model, (), {"input_ids": ids, "scale": 2.0}) != signature(model, (), {"input_ids": ids,
                                                                                          "scale": 3.0})
    assert signature(model, (ids,), {}) != base                                              # positional
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert signature(model, (), {"input_ids": ids}) != base
    model.eval()
    assert signature(model, (), {"input_ids": ids}) != base


def test_the_cuda_view_counts_what_the_allocator_serials_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch (no allocation serials: a saved tensor is an activation unless it is module state or the
    batch), driven on the CPU through a view with the caching allocator's interface:
    each pass counts what the native meter's serials count, with and without the hooks, and the monitor installs
    and uninstalls through the view as through the meter."""
    from hybridmem.runtime.monitor import AllocatorMonitor, CudaAllocatorView
    from hybridmem.runtime.stats import StatsRecorder

    class Counters:
        def peak(self) -> int:
            return 0

        def allocated(self) -> int:
            return 0

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    _, _, watched, _, _ = _train({"budget": None, "device": "cpu"}, labels=True)
    stats = StatsRecorder()
    mon = AllocatorMonitor(CudaAllocatorView(torch.device("cpu"), Counters()), stats)
    assert mon.cuda == torch.device("cpu")
    mon.install()
    try:
        torch.manual_seed(0)
        model = Tagger()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        saved = []
        for i, n in enumerate(LENGTHS):
            ids, mask, target = _batch(n, g)
            (model(input_ids=ids, attention_mask=mask, labels=target) / 2).backward()
            saved.append((stats.saved_bytes, stats.saved_tensors))
            if i % 2:
                opt.step()
                opt.zero_grad()
    finally:
        mon.uninstall()
    # the first pass also counts the batch given by keyword, which autograd saves (the embedding's indices and the
    # loss's target, int64): the root's own pre-hook, which reads keyword arguments, runs from its second call on
    assert saved[0] == (watched[0][0] + 2 * 4 * LENGTHS[0] * 8, watched[0][1] + 2) and saved[1:] == watched[1:]
    assert mon.hookless.steps == 4 and stats.optimizer_steps == 4
    assert _top(False) is None and not model._forward_pre_hooks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_watching_on_cuda_runs_known_inputs_without_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (the caching allocator's counters, no serials): bit for bit, the steps of known lengths without
    hooks, each pass's saved bytes as with the hooks, the same peak."""
    ref_losses, ref_params, _, _, _ = _train(None, labels=True, device="cuda")
    losses, params, saved, st, hookless = _train({"budget": None, "device": "cuda"}, labels=True, device="cuda")
    assert (losses, params) == (ref_losses, ref_params)
    assert hookless == 4 and st.steps == len(LENGTHS) and st.optimizer_steps == len(LENGTHS) // 2
    with monkeypatch.context() as m:
        m.setattr(Hookless, "start", lambda self: False)
        _, _, watched_saved, watched, _ = _train({"budget": None, "device": "cuda"}, labels=True, device="cuda")
    assert saved == watched_saved and st.peak_bytes == watched.peak_bytes
