"""Monitor-only on the CPU through the native allocator meter (hybridmem.runtime.monitor), the default
for ``budget=None`` where it builds: no dispatch mode, results bit-identical, the same saved-activation
count as the op-level monitor, and peaks that agree with it up to what only one of them can see.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem.native.cpumeter import load, unavailable_reason
from hybridmem.runtime.monitor import NOTE
from tests.helpers.runtime import Case, run
from tests.helpers.zoo import FAST, OPTIM, SLOW, zoo_case

pytestmark = pytest.mark.skipif(load() is None, reason=f"native CPU meter unavailable: {unavailable_reason()}")


def _input_bytes(case: Case) -> int:
    """Bytes of the tensors the step reads that exist before enable() and no module owns: the batch
    and the loss's targets."""
    found = (*case.args, *case.kwargs.values(), getattr(case.loss_fn, "target", None))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in found if isinstance(t, torch.Tensor)}
    return sum(storages.values())


@pytest.mark.parametrize("name", [*FAST, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW)])
def test_allocator_monitor_on_every_zoo_model(name: str) -> None:
    case = zoo_case(name)
    ref, _ = run(case, optim=OPTIM)
    got, st = run(case, optim=OPTIM, budget=None, monitor="allocator")
    ops_got, ops = run(case, optim=OPTIM, budget=None, monitor="ops")
    assert got == ref and ops_got == ref  # losses, every gradient, buffers, RNG state: bit for bit
    assert st is not None and ops is not None
    assert st.steps == ops.steps == 3
    assert NOTE in st.notes and st.stages_last_step == 0 and st.min_budget_bytes == 0
    # The same activations: storages allocated inside the step that autograd saved.
    assert (st.saved_bytes, st.saved_tensors) == (ops.saved_bytes, ops.saved_tensors) and st.saved_bytes > 0
    # The op-level meter also counts the batch and targets made before enable() (the allocator never
    # handed them out);
    # the allocator also sees scratch that kernels free inside an op (VGG16's convolutions: ~11 %).
    assert st.peak_bytes >= ops.peak_bytes - _input_bytes(case)
    assert st.peak_bytes <= 1.5 * ops.peak_bytes


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def test_default_on_the_cpu_is_the_allocator_monitor_and_ops_on_request() -> None:
    model, x = _mlp(), torch.randn(32, 64)
    with hybridmem.session(budget=None, device="cpu") as s:
        model(x).sum().backward()
    assert NOTE in s.stats().notes and s.stats().steps == 1
    with hybridmem.session(budget=None, device="cpu", config={"monitor": "ops"}) as s:
        model(x).sum().backward()
    assert NOTE not in s.stats().notes and s.stats().stages_last_step > 0


def test_peak_current_and_reset() -> None:
    model, x = _mlp(), torch.randn(32, 64)
    params = sum(p.nbytes for p in model.parameters())
    with hybridmem.session(budget=None, device="cpu") as s:
        big = torch.empty(1 << 20, dtype=torch.uint8)  # 1 MiB through the allocator
        model(x).sum().backward()  # the module hook counts the weights made before enable()
        st = s.stats()
        assert st.current_bytes >= params + (1 << 20)
        assert st.peak_bytes >= st.current_bytes
        del big
        assert s.stats().current_bytes == st.current_bytes - (1 << 20)
        hybridmem.reset_stats()
        assert s.stats().peak_bytes == s.stats().current_bytes
    after = s.stats()  # frozen at disable()
    assert after.peak_bytes >= after.current_bytes


def test_in_place_change_of_a_saved_tensor_is_an_error() -> None:
    w = torch.randn(8, 8, requires_grad=True)
    with hybridmem.session(budget=None, device="cpu"):
        h = torch.randn(4, 8) @ w
        y = h.sigmoid()   # sigmoid saves its output
        y.mul_(2)         # ... which is then changed in place
        with pytest.raises(RuntimeError, match="modified"):
            y.sum().backward()


def test_a_program_without_modules_counts_steps_and_saved_bytes() -> None:
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(16, 64)
    with hybridmem.session(budget=None, device="cpu") as s:
        for _ in range(2):
            (x @ w).relu().sum().backward()
    st = s.stats()
    assert st.steps == 2
    assert st.saved_bytes == 16 * 64 * 4  # relu's output: x and w come from before the step


def test_nested_session_and_the_outer_peak() -> None:
    model, x = _mlp(), torch.randn(32, 64)
    with hybridmem.session(budget=None, device="cpu") as outer:
        model(x).sum().backward()
        before = outer.stats().peak_bytes
        with hybridmem.session(budget=None, device="cpu", monitor="ops") as inner:
            model(x).sum().backward()
        assert inner.stats().steps == 1
        model(x).sum().backward()
    st = outer.stats()
    assert st.steps == 2 and st.peak_bytes >= before


def test_monitor_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="monitor must be one of auto, allocator, ops"):
        hybridmem.enable(budget=None, device="cpu", monitor="fast")
    with pytest.raises(ValueError, match="without a budget or a plan"):
        hybridmem.enable(budget="1GiB", device="cpu", monitor="allocator")
    assert not hybridmem.enabled()


def test_without_the_native_meter_auto_falls_back_and_allocator_is_an_error() -> None:
    code = textwrap.dedent("""
        import torch, hybridmem
        with hybridmem.session(budget=None, device="cpu") as s:
            torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()
        print(s.stats().stages_last_step > 0, [n for n in s.stats().notes if n.startswith("monitor")])
        try:
            hybridmem.enable(budget=None, device="cpu", monitor="allocator")
        except ValueError as e:
            print("error:", e)
    """)
    env = {**os.environ, "HYBRIDMEM_NATIVE": "0", "HYBRIDMEM_MONITOR": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True ['monitor: per op (the native CPU meter is not available: ")
    assert "error: monitor='allocator' on the CPU needs hybridmem's native meter" in out.stdout
    assert "HYBRIDMEM_NATIVE=0" in out.stdout


def test_environment_variable_and_hybridmem_run_select_the_monitor(tmp_path) -> None:
    code = "import torch, hybridmem\n" \
           "with hybridmem.session(budget=None, device='cpu') as s:\n" \
           "    torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()\n" \
           "print(s.stats().stages_last_step > 0)\n"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "HYBRIDMEM_MONITOR": "ops"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
    script = tmp_path / "train.py"
    script.write_text("import torch, hybridmem\n"
                      "torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()\n"
                      "st = hybridmem.stats()\n"
                      "print(st.steps, st.stages_last_step > 0, st.budget_bytes)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDMEM_")}
    for monitor, stages in (("ops", "True"), ("allocator", "False")):
        out = subprocess.run([sys.executable, "-m", "hybridmem.cli", "run", "--monitor", monitor, str(script)],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["1", stages, "None"], (monitor, out.stdout, out.stderr)


def test_the_last_tensor_made_before_the_step_is_no_activation() -> None:
    """The batch comes before the step's first module call, its last tensor too (the target here, made right
    before the call, saved by the loss): only what the step allocated counts as saved activations."""
    torch.manual_seed(0)
    model = nn.Linear(64, 10)
    with hybridmem.session(budget=None, device="cpu") as s:
        for _ in range(2):
            x = torch.randn(32, 64)
            target = torch.randint(0, 10, (32,))  # the last allocation before the model's call
            nn.functional.cross_entropy(model(x), target).backward()
            st = s.stats()
            # log_softmax's output (32 x 10 float32) and nll_loss's total weight (one float32): not x, not target
            assert (st.saved_bytes, st.saved_tensors) == (32 * 10 * 4 + 4, 2)
