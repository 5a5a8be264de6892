"""The simulator counts what the allocator holds: a captured step's keep-all peak against the CPU allocator's
real peak of the same step (``shared/tools/real_peak.py``), with the gradients of the step before kept and
freed, an SGD-momentum (or AdamW) step in the loop; and capture says what it counted."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem.errors import CaptureError
from hybridmem.graph.capture import capture
from hybridmem.native import cpumeter
from hybridmem.zoo import build
from bench.fidelity import trained
from tests.helpers.peaks import real_peak

pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator device unavailable: {cpumeter.unavailable_reason()}")


@pytest.mark.parametrize("grads", ["kept", "none"])
@pytest.mark.parametrize("name", ["resnet50", "gpt"])
def test_simulated_peak_is_the_allocators(name: str, grads: str, one_thread) -> None:
    e = build(name, "tiny")
    opt = torch.optim.SGD(e.model.parameters(), lr=0.01, momentum=0.9)
    step, before, ins = trained(e.model, e.inputs, e.loss_fn, opt, grads)
    real = real_peak(step, e.model, opt, ins)
    before()
    g = hybridmem.capture(e.model, e.inputs, e.loss_fn, device="cpu")  # the optimizer is found: optimizer="auto"
    sim = hybridmem.simulate(g, device="measured")
    assert 0.98 <= sim.peak_bytes / real <= 1.02, (name, grads, sim.peak_bytes, real)
    grads_held = sim.counted["bytes"].get("gradients before the step", 0)
    params = sum(p.numel() * p.element_size() for p in e.model.parameters())
    assert grads_held == (params if grads == "kept" else 0)
    assert sim.counted["bytes"]["optimizer state"] == params  # one momentum buffer per parameter
    assert "SGD" in sim.counted["optimizer state"] and "found" in sim.counted["optimizer state"]


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)), torch.randn(2, 256)


def test_optimizer_step_counts_its_temporaries_and_leaves_everything_as_it_was(one_thread) -> None:
    """AdamW on a model whose activations are small: its step's temporaries make the peak; recorded, the
    simulated peak is the allocator's; the user's parameters, gradients and optimizer state are untouched."""
    m, x = _mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    step, before, ins = trained(m, x, lambda out: out.sum(), opt, "kept")
    real = real_peak(step, m, opt, ins)
    params = [p.detach().clone() for p in m.parameters()]
    grads = [p.grad.clone() for p in m.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in m.parameters()]
    without = hybridmem.simulate(hybridmem.capture(m, x, device="cpu", optimizer=opt), device="measured")
    g = hybridmem.capture(m, x, device="cpu", optimizer=opt, optimizer_step=True)
    sim = hybridmem.simulate(g, device="measured")
    assert 0.98 <= sim.peak_bytes / real <= 1.02, (sim.peak_bytes, real)
    assert without.peak_bytes < 0.95 * real  # what the step's temporaries add
    assert {s.phase for s in g.stages} == {"forward", "backward", "optimizer"}
    assert "recorded" in g.meta["counted"]["optimizer step"]
    for p, a, b, st in zip(m.parameters(), params, grads, state):
        assert torch.equal(p, a) and torch.equal(p.grad, b)
        assert all(torch.equal(opt.state[p][k], v) for k, v in st.items())


def test_grads_kept_are_made_and_removed_for_the_capture(one_thread) -> None:
    m, x = _mlp()
    g = hybridmem.capture(m, x, device="cpu", grads="kept", optimizer=None)
    assert all(p.grad is None for p in m.parameters())
    held = [t for t in g.tensors if t.kind == "grad" and t.producer < 0]
    assert len(held) == 4 and {t.name for t in held} == {"0.weight.grad", "0.bias.grad", "2.weight.grad", "2.bias.grad"}
    none = hybridmem.capture(m, x, device="cpu", grads="none", optimizer=None)
    assert g.peak_bytes() - none.peak_bytes() > 0
    assert "not counted" in none.meta["counted"]["optimizer state"]
    meta = hybridmem.capture(m, x, device="meta", grads="kept", optimizer=None)
    assert sum(t.nbytes for t in meta.tensors if t.kind == "grad" and t.producer < 0) == sum(t.nbytes for t in held)


def test_bad_step_settings_are_refused() -> None:
    m, x = _mlp()
    with pytest.raises(ValueError, match="grads='sometimes'.*accepted: 'auto', 'kept', 'none'"):
        hybridmem.capture(m, x, grads="sometimes")
    with pytest.raises(ValueError, match="optimizer_step=True records the optimizer's step: pass optimizer="):
        hybridmem.capture(m, x, optimizer=None, optimizer_step=True)
    a, b = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.Adam(m.parameters())
    with pytest.raises(CaptureError, match="2 optimizers step the model's parameters.*pass the step's one"):
        hybridmem.capture(m, x)
    del a, b


def test_a_plan_of_a_step_with_its_optimizer_step_is_followed() -> None:
    """A graph captured with ``optimizer_step=True`` ends with the optimizer's stages, which run between the
    runtime's steps: its plan is followed (the signature is the step's forward and backward), bit-identical."""
    import copy

    from hybridmem.solvers import plan
    from tests.helpers.runtime import Case, train

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    x = torch.randn(2048, 64)
    case = Case("mlp", model, (x,))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = capture(model, (x,), case.loss_fn, device="cpu", optimizer=opt, optimizer_step=True)
    assert any(s.phase == "optimizer" for s in g.stages)
    p = plan(g, int(0.8 * g.peak_bytes()), device="cpu", time_limit=20, exact=False)
    ref = train(case, copy.deepcopy(model), 4)
    with hybridmem.session(plan=p, device="cpu") as s:
        got = train(case, copy.deepcopy(model), 4)
    assert got == ref
    assert s.stats().plan == "following", s.stats().plan_note
