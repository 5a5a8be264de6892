"""``enable(compile=True)`` with a new sequence length each step: a region compiled for dynamic shapes is planned
for the sizes it meets.

The second length makes Dynamo compile a language model's regions again for any length. Each is planned at
the largest length compiled for, guarded at most that length, and measured once at it when it compiles; a
longer batch fails the guard and Dynamo compiles the region again, planned at its length. No step runs a plan
made for shorter sequences, so no step holds more than its plan counted, and nothing warns that it might.
"""
from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch

import hybridmem
from hybridmem.compile import sizes as sizes_mod
from hybridmem.native import cpumeter
from tests.helpers import bit_equal
from tests.helpers.peaks import real_peak

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator meter unavailable: {cpumeter.unavailable_reason()}")

LENGTHS = (32, 48, 40, 64)   # 48: compiled for any length; 64: longer than planned, compiled again


def _gpt2() -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)


def _batches() -> list[torch.Tensor]:
    return [torch.randint(0, 128, (4, n), generator=torch.Generator().manual_seed(k)) for k, n in enumerate(LENGTHS)]


def _train(backend: str | None) -> tuple[list[int], list[torch.Tensor], list[list[torch.Tensor]]]:
    """AdamW steps of ``torch.compile(model)`` (``backend`` None: the one ``enable()`` installed) on
    :data:`LENGTHS`; each step's real peak besides the optimizer's state (``enable(compile=True)`` does not
    see the optimizer), the losses, the gradients."""
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch._dynamo.reset()
    gc.collect()   # garbage of earlier tests freed during a measured step would lower its peak
    compiled = torch.compile(model) if backend is None else torch.compile(model, backend=backend)
    peaks, losses, grads = [], [], []
    torch.manual_seed(1234)      # GPT-2's dropout: the same draws in both runs
    for ids in _batches():
        opt.zero_grad(set_to_none=True)
        box: list[torch.Tensor] = []

        def step() -> None:
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            box.append(loss.detach())
        peaks.append(real_peak(step, model, None, [ids]))
        losses.append(box[0])
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return peaks, losses, grads


def test_per_batch_lengths_are_planned_for_the_lengths_they_meet(recwarn: pytest.WarningsRecorder) -> None:
    """AOTAutograd's eager runner (the partition hybridmem plans, no kernel generation: the test stays fast)
    against PyTorch's ``aot_eager``: the same kernels on the same inputs, so losses and gradients are
    bit-identical; every step within the budget, no warning."""
    ref_peaks, ref_losses, ref_grads = _train("aot_eager")
    budget = int(0.9 * max(ref_peaks))
    with hybridmem.session(budget=budget, compile=True) as s:
        s.runtime.backend.compiler = "eager"
        peaks, losses, grads = _train(None)
        st = s.stats()
    ours = [w for w in recwarn if "hybridmem" in str(w.message)]
    assert not ours, [str(w.message) for w in ours]
    assert all(bit_equal(a, b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    for ga, gb in zip(grads, ref_grads):
        assert all(bit_equal(x, y) for x, y in zip(ga, gb))
    assert max(peaks) <= budget, (peaks, budget, str(st))
    assert any(r.recomputed for r in st.regions), str(st)
    dynamic = [r for r in st.regions if r.planned_sizes]
    assert dynamic, str(st)
    for r in dynamic:
        # planned at 64 when 64 came: compiled again for it, measured at it when compiled
        assert sorted(r.planned_sizes.values())[-1] == 64 and r.size_replans == 1, str(st)
        assert r.trial_peak_bytes is not None and r.trial_peak_bytes <= r.budget_bytes, str(st)
    assert "compiled again for larger sizes 1 time(s)" in str(st)


def test_the_run_at_compile_time_gets_the_inputs_at_the_planned_sizes() -> None:
    """A region compiled for any length at 20, after 32: the run at compile time gets plain ints for the
    symbolic sizes (the compiled step reads ints: a SymInt failed Inductor's allocation, "Expected result >=
    0") and the batch at 32, its values repeated from the call's; the region is guarded at most 32."""
    seen: list[tuple[Any, Any, Any]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        tensors = [(str(n.target), n.meta["example_value"]) for n in gm.graph.nodes
                   if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)]
        at = sizes_mod.planned_at(tensors, largest)
        sizes_mod.bound(tensors, at)
        with sizes_mod.planning_at(at):
            planned = sizes_mod.PlannedSizes(example_inputs, [n.meta.get("example_value") for n in gm.graph.nodes
                                                              if n.op == "placeholder"])
            seen.append((planned.planned, planned.compiled_at, planned.inputs(example_inputs)))
        return gm.forward

    largest: dict[tuple[str, int], int] = {}
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x.float() * 2).sum(), backend=backend)
    batches = [torch.arange(2 * n).view(2, n) for n in (32, 20, 24, 40)]
    for x in batches:
        f(x)
    assert len(seen) == 3, "32; 20 for any length, which 24 runs; 40 above the plan's 32, compiled again"
    planned, compiled_at, inputs = seen[1]
    assert list(planned.values()) == [32] and list(compiled_at.values()) == [20]
    (n,) = [v for v in inputs if not isinstance(v, torch.Tensor)]
    assert type(n) is int and n == 32
    (x,) = [v for v in inputs if isinstance(v, torch.Tensor)]
    assert x.shape == (2, 32) and x.is_contiguous()
    assert torch.equal(x[:, :20], batches[1]) and torch.equal(x[:, 20:], batches[1][:, :12])
    assert list(seen[2][0].values()) == [40] and list(seen[2][1].values()) == [40]
