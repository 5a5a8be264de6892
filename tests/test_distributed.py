"""hybridmem under torch.distributed: DDP and FSDP2 (gloo, CPU, 2 ranks on 127.0.0.1), the parameter
guard, FSDP's resized storages in the meter, and activation under torchrun (env variables and
``hybridmem run``).

Ranks are forked (:func:`hybridmem.runtime.distributed.launch`): children inherit the imported torch, so a
2-rank job starts in well under a second; each test's ranks compare their own runs and return plain
data. Each rank trains fresh copies of the model three times (unmanaged, monitor only, capped) so
nothing has to cross process boundaries but numbers.
"""
from __future__ import annotations

import json
import gc
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
import torch.distributed.fsdp  # noqa: E402,F401  (imported once here: forked ranks inherit it)

import hybridmem  # noqa: E402
import hybridmem.runtime as hm_runtime  # noqa: E402
from hybridmem.runtime.distributed import (FsdpStorageSync, RankError, backend_threads, collective_writes,  # noqa: E402
                                   free_port, is_collective, is_parameter_view, launch, plain_storages,
                                   release_process_groups)
from tests.helpers.runtime import min_budget_of  # noqa: E402

# Two zoo models whose tiny size has room under the budget rule: at "tiny" the transformer, GPT,
# VGG-16 and U-Net peak where activations are already freed (embedding/classifier gradients
# dominate), so "peak minus 40 % of the saved bytes" is below their minimum even without DDP.
MODELS = ("resnet50", "mobilenet")
STEPS = 3
ROOT = Path(__file__).resolve().parents[1]


# ---- helpers that run inside a rank ---------------------------------------------------------------
def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (``torch.equal`` calls -0.0 and 0.0 equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
    return torch.equal(a, b)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP gradients are sharded DTensors


def _entry(name: str, rank: int) -> Any:
    """The zoo model with the same weights on every rank and this rank's own batch."""
    from hybridmem.zoo import build

    e = build(name, "tiny", seed=100 + rank)
    e.model.load_state_dict(build(name, "tiny", seed=0).model.state_dict())
    return e


def _wrap(model: nn.Module, wrap: str) -> nn.Module:
    if wrap == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child)
        return fully_shard(model)
    return model


def _train(name: str, rank: int, wrap: str, *, managed: bool, budget: int | None = None,
           steps: int = STEPS, monitor: str | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], Any, float]:
    gc.collect()  # the previous run's tensors, if held in cycles: the allocator counts them until collected
    e = _entry(name, rank)
    model = _wrap(e.model, wrap)
    args, kwargs = e.args_kwargs()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1234 + rank)  # dropout masks: the same in every run of this rank
    losses = []
    stats = None
    if managed:
        hybridmem.enable(budget=budget, device="cpu", monitor=monitor)  # default: the allocator, the cap's units
    t0 = time.perf_counter()
    try:
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = e.loss_fn(model(*args, **kwargs))
            loss.backward()
            losses.append(loss.detach())
            if i < steps - 1:
                opt.step()
        if managed:
            stats = hybridmem.stats()
    finally:
        if managed:
            hybridmem.disable()
    dt = time.perf_counter() - t0
    grads = [_local(p.grad).detach().clone() for p in model.parameters()]
    return losses, grads, stats, dt


def _saved_activation_bytes(name: str, rank: int) -> int:
    """Saved-activation bytes of one step of the bare model (the same set a rank's wrapped model saves),
    measured by the runtime in monitor-only mode outside any wrapper."""
    e = _entry(name, rank)
    torch.manual_seed(1234 + rank)
    with hybridmem.session(budget=None, device="cpu", monitor="ops") as s:
        e.loss().backward()
    return s.stats().saved_bytes


def _train_feasible(name: str, rank: int, wrap: str, budget: int) -> tuple[Any, ...]:
    """``_train`` under ``budget``, retried at the budget the runtime's OOM names (+1 %), as a user does. The
    monitor-only peak the budget is derived from moves from run to run with gloo's buffers, and may land
    below what a step needs. Every rank trains again when one must (its collectives stay in lockstep); the
    OOM is raised once the run is over, so no collective is left waiting."""
    for _ in range(3):
        named = 0
        try:
            losses, grads, st, t_cap = _train(name, rank, wrap, managed=True, budget=budget)
        except torch.OutOfMemoryError as e:
            named = min_budget_of(e)
            assert named > budget, f"a budget too small must name one that works: {e}"
        again = torch.tensor([int(named > 0)])
        torch.distributed.all_reduce(again)
        if not again.item():
            return losses, grads, st, t_cap, budget
        if named:
            budget = int(named * 1.01)
    raise AssertionError("the named budget did not train")


def _rank_case(rank: int, world: int, name: str, wrap: str) -> dict[str, Any]:
    assert not hm_runtime.enabled(), "a runtime leaked into the forked rank"
    ref_losses, ref_grads, _, t_ref = _train(name, rank, wrap, managed=False)
    _, _, mon, t_mon = _train(name, rank, wrap, managed=True, budget=None)
    _, _, per_op, _ = _train(name, rank, wrap, managed=True, budget=None, monitor="ops")  # saved bytes, per op
    saved = _saved_activation_bytes(name, rank)
    budget = int(mon.peak_bytes - 0.4 * saved)
    losses, grads, st, t_cap, budget = _train_feasible(name, rank, wrap, budget)
    # DDP's gradient buckets are allocated when the model is wrapped, before enable(): the allocator never
    # saw them, the monitor has no per-op hook to find them, the capped run counts them when an op first
    # reads them. They are the only bytes the capped run may count beyond the monitor's peak.
    late = sum(p.numel() * p.element_size() for p in _entry(name, rank).model.parameters()) if wrap == "ddp" else 0
    return {
        "rank": rank, "monitor_peak": mon.peak_bytes, "saved": saved, "budget": budget, "peak": st.peak_bytes,
        "late": late, "evicted": st.evicted_bytes, "steps": st.steps, "monitor_saved": per_op.saved_bytes,
        "losses_identical": all(_bits_equal(a, b) for a, b in zip(ref_losses, losses)),
        "grads_identical": len(grads) == len(ref_grads) and all(_bits_equal(a, b) for a, b in zip(ref_grads, grads)),
        "loss": float(losses[-1]), "n_grads": len(grads), "times": (round(t_ref, 2), round(t_mon, 2), round(t_cap, 2)),
        "steady": st.steady_steps, "notes": st.notes,
    }


_CACHE: dict[tuple[str, str], list[dict[str, Any]]] = {}


def _results(name: str, wrap: str) -> list[dict[str, Any]]:
    """One 2-rank job per (model, wrapper), shared by the tests that read it."""
    key = (name, wrap)
    if key not in _CACHE:
        _CACHE[key] = launch(_rank_case, 2, (name, wrap), timeout=90)
    return _CACHE[key]


# ---- DDP and FSDP: identical training under the cap --------------------------------------------------
@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
@pytest.mark.parametrize("name", MODELS)
def test_identical_under_budget(name: str, wrap: str) -> None:
    """3 steps of SGD at the monitor-only peak minus 40 % of the saved-activation bytes: losses and
    every gradient (FSDP: every local shard) bit-identical to the same run without hybridmem, each
    rank's peak within its budget, and something was evicted (the cap bit)."""
    res = _results(name, wrap)
    for r in res:
        assert r["losses_identical"], r
        assert r["grads_identical"], r
        assert r["peak"] <= r["budget"] + r["late"], r
        # FSDP: the process-wide allocator also holds gloo's buffers for the all-gathers, whose lifetimes
        # move the monitor-only peak (and so the budget) from run to run: the cap may not have to bite
        assert r["evicted"] > 0 or wrap == "fsdp", r
        # step 1 runs under the dispatch mode, step 2 records, step 3 follows: no per-op work, each rank its own
        assert r["steady"] == STEPS - 2, r
    assert res[0]["loss"] != res[1]["loss"]  # the ranks really trained on different batches


def _no_sync_train(rank: int, budget: int | None, managed: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], Any,
                                                                        int]:
    """DDP with gradient accumulation as its docs teach it: each optimizer step's first micro-batch under
    ``no_sync()`` (no all-reduce, gradients accumulate locally), the second synchronised."""
    gc.collect()
    e = _entry("mobilenet", rank)
    model = _wrap(e.model, "ddp")
    args, kwargs = e.args_kwargs()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1234 + rank)
    losses: list[torch.Tensor] = []
    stats, hookless = None, 0
    if managed:
        hybridmem.enable(budget=budget, device="cpu")
    try:
        for _ in range(STEPS):
            with model.no_sync():
                loss = e.loss_fn(model(*args, **kwargs)) / 2
                loss.backward()
            losses.append(loss.detach())
            loss = e.loss_fn(model(*args, **kwargs)) / 2
            loss.backward()
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
        if managed:
            stats = hybridmem.stats()
            rt = hm_runtime.current.rt
            hookless = rt.hookless.steps if rt is not None else 0   # passes run without hooks (runtime.hookless)
    finally:
        if managed:
            hybridmem.disable()
    state = [p.detach().clone() for p in model.parameters()]
    return losses, state, stats, hookless


def _no_sync_case(rank: int, world: int) -> dict[str, Any]:
    ref_losses, ref_state, _, _ = _no_sync_train(rank, None, managed=False)
    _, _, mon, _ = _no_sync_train(rank, None, managed=True)
    budget = int(mon.peak_bytes - 0.4 * _saved_activation_bytes("mobilenet", rank))
    losses, state, st, _ = _no_sync_train(rank, budget, managed=True)
    # far from the budget: the passes after a light one run without hooks, each rank on its own
    far_losses, far_state, far, hookless = _no_sync_train(rank, 10 * mon.peak_bytes, managed=True)
    return {"rank": rank, "budget": budget, "peak": st.peak_bytes, "evicted": st.evicted_bytes,
            "far_identical": all(_bits_equal(a, b) for a, b in zip(ref_losses + ref_state, far_losses + far_state)),
            "far_steps": (far.steps, far.optimizer_steps), "hookless": hookless,
            "steps": st.steps, "optimizer_steps": st.optimizer_steps, "steady": st.steady_steps,
            "late": sum(p.numel() * p.element_size() for p in _entry("mobilenet", rank).model.parameters()),
            "identical": all(_bits_equal(a, b) for a, b in zip(ref_losses + ref_state, losses + state)),
            "notes": st.notes}


def test_ddp_no_sync_accumulation_in_the_steady_state() -> None:
    """Accumulation under ``no_sync()``: each backward pass is a step, each optimizer step counted as one;
    after the first two passes every pass runs in the steady state, synchronised or not, bit-identical. Far
    from the budget the passes after a light one run without the saved-tensor hooks, bit-identical too."""
    for r in launch(_no_sync_case, 2, (), timeout=120):
        assert r["identical"], r
        assert r["steps"] == 2 * STEPS and r["optimizer_steps"] == STEPS, r
        assert r["steady"] == 2 * STEPS - 2, r
        assert r["evicted"] > 0, r
        assert r["peak"] <= r["budget"] + r["late"], r
        assert r["far_identical"] and r["far_steps"] == (2 * STEPS, STEPS) and r["hookless"] >= 2, r


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_one_step_per_training_step(wrap: str) -> None:
    """DDP's reducer and FSDP's root post-backward run ops from autograd final callbacks queued
    after the runtime's own end-of-backward callback, in the same graph task. They must not count as
    a second step (which also made ``saved_bytes`` read 0: it reports the last completed step)."""
    res = _results(MODELS[0], wrap)
    for r in res:
        assert r["steps"] == STEPS, r
        assert r["monitor_saved"] > 0, r


def test_fsdp_parameters_are_not_activations() -> None:
    """FSDP2's unsharded parameters are made by ops during the step; the runtime must not take the
    ``weight.t()`` a linear layer saves for a saved activation (monitor-only saved bytes equal the
    bare model's)."""
    res = _results(MODELS[0], "fsdp")
    for r in res:
        assert r["monitor_saved"] == r["saved"], r


# ---- the guard and the meter sync, in isolation ---------------------------------------------------------
def test_is_parameter_view() -> None:
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    assert is_parameter_view(lin.weight) and is_parameter_view(lin.weight.t())
    assert is_parameter_view(x)                          # a leaf that requires grad: program state
    assert not is_parameter_view(lin(x)) and not is_parameter_view(torch.randn(3))
    frozen = nn.Parameter(torch.randn(3), requires_grad=False)
    assert is_parameter_view(frozen[1:])                 # frozen FSDP/LoRA weights are parameters too


def test_is_collective() -> None:
    assert not is_collective(torch.ops.aten.add.Tensor)
    assert is_collective(torch.ops.c10d.allreduce_.default)


def test_collective_writes() -> None:
    """c10d's in-place collectives write their first argument without saying so in the schema."""
    c10d = torch.ops.c10d
    assert collective_writes(c10d.allreduce_.default) == (0,)
    assert collective_writes(c10d._allgather_base_.default) == (0,)
    assert collective_writes(c10d.broadcast_.default) == (0,)
    assert collective_writes(c10d.send.default) == ()
    assert collective_writes(torch.ops.aten.add_.Tensor) == ()


def test_runtime_knows_collective_writes() -> None:
    """The runtime's op facts must include those writes (else lineage misses them, see below) and
    must not call a collective's aliased outputs new storages (else the cap reserves a bucket's size
    for every all-reduce)."""
    from hybridmem.runtime.lineage import replay_info

    info = replay_info(torch.ops.c10d.allreduce_.default)
    assert 0 in info.written and not any(info.fresh)


def _tp_case(rank: int, world: int) -> dict[str, Any]:
    """Row-parallel style: an activation all-reduced in place, then saved. Recompute-only under a
    budget: replaying its producer without the all-reduce would be silently wrong."""
    torch.manual_seed(0)
    lins = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
    x0 = torch.randn(512, 64, generator=torch.Generator().manual_seed(rank))

    def step() -> torch.Tensor:
        h = x0
        for lin in lins:
            y = lin(h)
            dist.all_reduce(y)
            h = y * y * 0.01  # mul saves y
        loss = h.sum()
        loss.backward()
        return loss.detach()

    def grads() -> list[torch.Tensor]:
        g = [p.grad.clone() for p in lins.parameters()]
        for p in lins.parameters():
            p.grad = None
        return g

    import warnings
    warnings.filterwarnings("ignore", message=".*autograd kernel was not registered.*")
    step()
    g0 = grads()
    with hybridmem.session(budget=None, device="cpu") as s:
        step()
    grads()
    mon = s.stats()
    budget = int(mon.peak_bytes - 0.3 * mon.saved_bytes)
    try:
        with hybridmem.session(budget=budget, policies=("recompute",), device="cpu"):
            step()
    except torch.OutOfMemoryError:
        return {"outcome": "refused"}  # correct: the all-reduced tensors cannot be recomputed
    same = all(_bits_equal(a, b) for a, b in zip(g0, grads()))
    return {"outcome": "identical" if same else "wrong gradients"}


def test_in_place_collective_is_never_replayed() -> None:
    for r in launch(_tp_case, 2, timeout=90):
        assert r["outcome"] in ("identical", "refused"), r


def test_plain_storages_of_a_dtensor() -> None:
    """A DTensor's own storage reports the global size with no data; the meter must count the shard."""
    def case(rank: int, world: int) -> list[int]:
        from torch.distributed.fsdp import fully_shard

        lin = nn.Linear(64, 64)
        fully_shard(lin)
        w = lin.weight
        return [w.untyped_storage().nbytes(), sum(st.nbytes() for st in plain_storages(w))]

    for fake, real in launch(case, 2, timeout=30):
        assert fake == 64 * 64 * 4 and real == 64 * 64 * 4 // 2


def _fsdp_meter_case(rank: int, world: int) -> dict[str, Any]:
    """A 5-block MLP under FSDP2, metered by a plain Meter whose mode calls FsdpStorageSync at
    collectives: returns live bytes after the step with and without the sync, and the truth."""
    from torch.distributed.fsdp import fully_shard

    from hybridmem.runtime.meter import Meter, MeterMode

    class SyncMode(MeterMode):
        sync: FsdpStorageSync | None = None

        def after_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
            super().after_op(func, args, kwargs, out)
            if self.sync is not None and is_collective(func):
                self.sync.after_op(func, args, kwargs)

    out = {}
    for use_sync in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(4)], nn.Linear(64, 4))
        for block in m:
            fully_shard(block)
        fully_shard(m)
        meter = Meter("cpu", mode_cls=SyncMode)
        with meter:
            meter._mode.sync = FsdpStorageSync(meter) if use_sync else None
            for _ in range(2):
                x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
                m(x).square().sum().backward()
            if use_sync:
                meter._mode.sync.refresh()  # the runtime does this at step end
                out["remembered"] = len(meter._mode.sync)
        # Truth: every sharded parameter and gradient; unsharded storages are all resized to 0 now.
        shard = sum(p.to_local().untyped_storage().nbytes() for p in m.parameters())
        grads = sum(p.grad.to_local().untyped_storage().nbytes() for p in m.parameters())
        unsharded = sum(p.numel() * 4 for p in m.parameters())
        out["with" if use_sync else "without"] = meter.current_bytes
        out["shards"], out["unsharded"] = shard + grads, unsharded
    return out


def test_fsdp_resized_storages_are_metered() -> None:
    """``storage.resize_`` is not an op: without the sync the meter counts every unsharded parameter
    as live from its first all-gather on; with it, live bytes after the step are the shards and
    sharded gradients (plus the step's last inputs), not a whole unsharded copy more."""
    for r in launch(_fsdp_meter_case, 2, timeout=60):
        assert r["remembered"] == 10  # weight and bias of 5 linear layers
        assert r["without"] - r["with"] >= r["unsharded"] // 2, r   # about one unsharded model copy
        assert r["with"] < r["shards"] + r["unsharded"] // 4, r


def test_launch_reports_a_failing_rank() -> None:
    def boom(rank: int, world: int) -> int:
        if rank == 1:
            raise ValueError("rank one fails")
        return rank

    with pytest.raises(RankError, match="rank one fails"):
        launch(boom, 2, timeout=30)


# ---- a clean exit: the group's threads joined before the interpreter finalizes -------------------------
def _release_case(rank: int, world: int) -> dict[str, Any]:
    """A DDP step, then the program's own destroy_process_group: the gloo threads must be gone once
    release_process_groups has collected DDP's cycles (the pytest process imported
    torch.distributed.nn before any group existed, so its defaults do not pin this one)."""
    import torch.distributed.nn.functional as dnf

    def step() -> None:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
        ddp(torch.randn(4, 8)).sum().backward()

    step()
    during = backend_threads()
    dist.destroy_process_group()
    return {"during": during, "after": release_process_groups(),
            "pinned": any(isinstance(d, dist.ProcessGroup) for d in dnf.all_reduce.__defaults__ or ())}


def test_release_process_groups_joins_backend_threads() -> None:
    for r in launch(_release_case, 2, timeout=60):
        assert r["during"] and not r["after"] and not r["pinned"], r


EXIT_RANK = textwrap.dedent('''
    """Rank 0's collective completes while rank 0's interpreter finalizes (rank 1 joins late), and its
    callback is Python: the gloo worker needs the GIL then."""
    import os, sys, time
    if sys.argv[1] == "prepared":
        import torch
        from hybridmem.runtime.distributed import prepare_clean_exit
        prepare_clean_exit()
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    import torch.distributed.nn  # what DDP's constructor does: binds group.WORLD as default arguments
    if dist.get_rank() == 0:
        work = dist.all_reduce(torch.ones(1024), async_op=True)
        fut = work.get_future().then(lambda f: f.value())
    else:
        time.sleep(1.5)
        dist.all_reduce(torch.ones(1024))
    dist.destroy_process_group()
''')


def _run_ranks(argv: list[str], tmp_path: Path) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        for k in ("HYBRIDMEM_BUDGET", "HYBRIDMEM_PLAN", "HYBRIDMEM_CONFIG"):
            env.pop(k, None)
        procs.append(subprocess.Popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


# Opt-in (-m slow): two torch start-ups per mode, 12-17 s each on the 2 shared cores. The default run keeps
# test_release_process_groups_joins_backend_threads (forked ranks, about 4 s).
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bare", "prepared"])  # bare: the control
def test_exit_while_a_collective_completes(mode: str, tmp_path: Path) -> None:
    """torch 2.13 keeps the default group alive past destroy_process_group (torch.distributed.nn's
    default arguments, bound by DDP's constructor), so its gloo threads are joined during interpreter
    finalization, and one that takes the GIL then dies in pthread_exit inside a noexcept frame: SIGABRT,
    "terminate called without an active exception" (the likely cause of the torchrun + `hybridmem run`
    test's rare abort: DDP's bucket callbacks can carry the runtime's saved-tensor hooks to the worker).
    Bare torch aborts deterministically here; prepare_clean_exit (called by `hybridmem run`) exits 0."""
    script = tmp_path / "rank.py"
    script.write_text(EXIT_RANK)
    res = _run_ranks([sys.executable, str(script), mode], tmp_path)
    if mode == "bare":
        if res[0].returncode == 0:
            pytest.skip("this torch no longer aborts here (the group is freed before finalization)")
        assert res[0].returncode == -6 and "terminate called without an active exception" in res[0].stderr, \
            res[0].stderr[-2000:]
    else:
        for r in res:
            assert r.returncode == 0, r.stderr[-3000:]


# ---- torchrun: environment variables and `hybridmem run` ---------------------------------------------
SCRIPT = textwrap.dedent('''
    """A DDP training script that knows nothing about hybridmem."""
    import json, os, sys
    import torch, torch.nn as nn, torch.distributed as dist

    def train(rank, wrap=True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
        ddp = nn.parallel.DistributedDataParallel(model) if wrap else model
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        x = torch.randn(512, 32, generator=torch.Generator().manual_seed(rank))
        losses = []
        for i in range(3):
            opt.zero_grad(set_to_none=True)
            loss = ddp(x).square().mean()
            loss.backward()
            losses.append(loss.item())
            if i < 2:
                opt.step()
        return losses, [p.grad.sum().item() for p in model.parameters()]

    if __name__ == "__main__":
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        losses, grads = train(rank)
        import hybridmem.runtime as rt
        out = {"rank": rank, "world": dist.get_world_size(), "losses": losses, "grads": grads,
               "enabled": rt.enabled()}
        if rt.enabled():
            s = rt.stats()
            out.update(peak=s.peak_bytes, budget=s.budget_bytes, evicted=s.evicted_bytes)
        with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()
''')


def _script_ref(rank: int, world: int, path: str) -> dict[str, Any]:
    """The script's train() run unmanaged, and monitor-only for the budget (forked ranks)."""
    import runpy

    train = runpy.run_path(path)["train"]
    ref = train(rank)
    with hybridmem.session(budget=None, device="cpu") as s:
        train(rank)
    with hybridmem.session(budget=None, device="cpu", monitor="ops") as bare:  # saved bytes: see _saved_activation_bytes
        train(rank, wrap=False)
    return {"losses": ref[0], "grads": ref[1], "peak": s.stats().peak_bytes, "saved": bare.stats().saved_bytes}


@pytest.fixture(scope="module")
def ddp_script(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], int]:
    d = tmp_path_factory.mktemp("torchrun")
    script = d / "train_ddp.py"
    script.write_text(SCRIPT)
    ref = launch(_script_ref, 2, (str(script),), timeout=60)
    # One variable for both ranks. This MLP's backward needs its widest activations and their
    # gradients at once, so the zoo tests' 40 % is beyond its minimum: 20 % still forces evictions.
    budget = min(int(r["peak"] - 0.2 * r["saved"]) for r in ref)
    return script, ref, budget


def _torchrun(cmd_tail: list[str], out: Path, env: dict[str, str], timeout: float = 60) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *cmd_tail]
    full_env = {**os.environ, **env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _check_torchrun(res: list[dict[str, Any]], ref: list[dict[str, Any]], budget: int) -> None:
    for r in res:
        assert r["world"] == 2 and r["enabled"], r
        assert r["budget"] == budget and r["peak"] <= budget and r["evicted"] > 0, r
        assert r["losses"] == ref[r["rank"]]["losses"], (r["losses"], ref[r["rank"]]["losses"])
        assert r["grads"] == ref[r["rank"]]["grads"]


def test_torchrun_environment_variables(ddp_script: Any, tmp_path: Path) -> None:
    """``HYBRIDMEM_BUDGET=... torchrun ... train.py``: every rank enables itself at start-up."""
    pytest.importorskip("hybridmem._autoload", reason="the runtime's start-up hook has not landed")
    script, ref, budget = ddp_script
    res = _torchrun([str(script), str(tmp_path)], tmp_path, {"HYBRIDMEM_BUDGET": str(budget),
                                                             "HYBRIDMEM_DEVICE": "cpu"})
    _check_torchrun(res, ref, budget)


# Opt-in (-m slow) for its time (three torch start-ups: 26-85 s on the 2 shared cores). Its rare abort at
# exit ("terminate called without an active exception", 1 of 3 CI runs once; 0 of 22 runs here) is
# torch's, not hybridmem's: after DDP the default group outlives destroy_process_group and its gloo
# threads are joined during interpreter finalization; see test_exit_while_a_collective_completes, which
# reproduces it deterministically, and prepare_clean_exit, which `hybridmem run` calls against it.
@pytest.mark.slow
def test_torchrun_hybridmem_run(ddp_script: Any, tmp_path: Path) -> None:
    """``torchrun ... -m hybridmem.cli run --budget B train.py``: the same, explicitly."""
    pytest.importorskip("hybridmem._autoload", reason="the runtime's start-up hook has not landed")
    script, ref, budget = ddp_script
    res = _torchrun(["-m", "hybridmem.cli", "run", "--budget", str(budget), str(script), str(tmp_path)],
                    tmp_path, {"HYBRIDMEM_DEVICE": "cpu"})
    _check_torchrun(res, ref, budget)
