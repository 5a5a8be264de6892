"""The compiled path's custom ops as CUDA runs them, checked on the CPU: the stream protocol of the offload ops
against a recording stand-in for ``torch.cuda`` (:class:`tests.helpers.fakecuda.FakeCuda`), Inductor's code
for a graph that offloads, the codec ops on a device reading no value on the host, and the stats' word on
host tokens (which CUDA graphs skip)."""
from __future__ import annotations

import dataclasses
import gc
import re
import time
from typing import Any

import pytest
import torch
from functorch.compile import min_cut_rematerialization_partition
from torch import fx, nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._inductor.compile_fx import compile_fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn
from torch._inductor.utils import run_and_get_code

from hybridmem.compile import codec_ops, compile_backend, offload_ops, probe
from hybridmem.compile import offload as offload_mod
from hybridmem.compile.compressed import storage_of
from hybridmem.graph.costs import get_cost_model
from hybridmem.plugins import codecs
from tests.helpers import bit_equal
from tests.helpers.fakecuda import FakeCuda, HostPool
from tests.helpers.syncs import SyncCounter

torch.set_num_threads(1)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """The offload ops' CUDA branch on CPU tensors, their stream and event calls recorded in ``fake.log``."""
    fake = FakeCuda()
    offload_ops.register()
    for name, value in (("_cuda", fake), ("_on_cuda", lambda t: True), ("_STREAMS", {}), ("_POOL", HostPool()),
                        ("_record_stream", lambda t, s: fake.log.append(("record_stream", s.name)))):
        monkeypatch.setattr(offload_ops, name, value, raising=False)
    return fake


def _round_trip(fake: FakeCuda, x: torch.Tensor, fence: bool = True) -> tuple[list, list, list, torch.Tensor]:
    """Offload ``x``, fence it (``fence``), reload it: the log of each phase and the tensor reloaded."""
    geometry = (list(x.shape), list(x.stride()), x.dtype, x.device)
    token = torch.ops.hybridmem.offload(x)
    out_log = fake.log[:]
    del fake.log[:]
    if fence:
        token = torch.ops.hybridmem.offload_wait(token, x, [])
    fence_log = fake.log[:]
    del fake.log[:]
    ready = torch.ops.hybridmem.reload_start(token, *geometry)
    got = torch.ops.hybridmem.reload_wait(ready, *geometry)
    return out_log, fence_log, fake.log[:], got


def _entered(log: list, stream: str) -> int:
    return next(i for i, e in enumerate(log) if e == ("enter", stream))


def test_a_reload_copies_only_after_the_compute_stream_reached_it(fake: FakeCuda) -> None:
    """R1: reload_start's block comes from the compute stream, whose queued kernels may still write it (a
    deterministic mode's NaN fill): its copy waits for the compute stream, then lands."""
    x = torch.randn(64, 32)
    _, _, log, got = _round_trip(fake, x, fence=False)
    assert bit_equal(got, x)
    assert ("enter", "h2d") in log, log
    start = _entered(log, "h2d")
    assert ("wait_stream", "h2d", "compute") in log[:start], log
    assert ("record_stream", "h2d") in log[start:], log          # not reused under the copy if dropped early
    landed = next(e[2] for e in log[start:] if e[:2] == ("record", "h2d"))
    assert log[-1] == ("wait_event", "compute", landed)           # the compute stream waits for it, the host not
    assert not [e for e in log if e[0] == "event_sync"]


def test_offloads_and_reloads_copy_on_streams_of_their_own(fake: FakeCuda) -> None:
    """R10: the copy out and the copy in are queued on two streams (a reload does not wait behind the offloads
    queued before it); the reload waits for its own copy out by its event, the fence too."""
    x = torch.randn(16, 16)
    out_log, fence_log, in_log, _ = _round_trip(fake, x)
    d2h, h2d = offload_ops._STREAMS[0]
    assert d2h is not h2d and (d2h.name, h2d.name) == ("d2h", "h2d")
    start = _entered(out_log, "d2h")
    assert ("wait_stream", "d2h", "compute") in out_log[:start], out_log
    assert ("record_stream", "d2h") in out_log
    copied = next(e[2] for e in out_log if e[:2] == ("record", "d2h"))
    assert fence_log == [("wait_event", "compute", copied)]      # Inductor may reuse x's buffer after this
    assert ("wait_event", "h2d", copied) in in_log[:_entered(in_log, "h2d")]
    assert ("enter", "d2h") not in in_log


# ---- Inductor's code --------------------------------------------------------------------------------------

class _Offloading(CustomPartitionerFn):
    """The default partition with its saved matmul outputs offloaded (what a plan that swaps them does); the
    names of those rewritten in ``done``."""

    def __init__(self) -> None:
        self.done: list[str] = []
        self.key = f"test-offloading-{time.time_ns()}"     # never a cached partition made by another version

    def __call__(self, gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        saved = {n.name for n in bw.graph.find_nodes(op="placeholder")}
        picks = [storage_of(n) for n in fw.graph.nodes if n.target is torch.ops.aten.mm.default and n.name in saved]
        self.done.extend(offload_mod.rewrite_partition(fw, bw, picks))
        return fw, bw

    def uuid(self) -> str:
        return self.key

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (str, (self.key,))          # Inductor pickles its config into cache keys


def test_inductor_keeps_an_offloaded_buffer_until_its_fence() -> None:
    """R2: Inductor hands a buffer whose last read was the offload to a later kernel (``buf1 = buf0; del buf0
    # reuse``) while on CUDA the copy out may still read it. The offloaded buffer must be read by a fence
    (offload_wait) placed after a kernel, and reused by nothing before it."""
    offload_ops.register()
    partitioner = _Offloading()

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a @ b).sin() @ b              # a @ b is saved (sin's backward reads it), then another mm

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=lambda gm, ex: compile_fx(
        gm, ex, config_patches={"custom_partitioner_fn": partitioner}))
    torch.manual_seed(0)
    a, b = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)
    _, codes = run_and_get_code(lambda: compiled(a, b).sum().backward())
    assert partitioner.done, "nothing was offloaded"
    fw = next(c for c in codes if "hybridmem.offload.default" in c)
    lines = fw[fw.index("def call"):].splitlines()
    at = next(i for i, s in enumerate(lines) if "hybridmem.offload.default(" in s)
    buf = re.search(r"offload\.default\((buf\d+)\)", lines[at]).group(1)
    fence = next((i for i, s in enumerate(lines) if "hybridmem.offload_wait.default(" in s), None)
    reuse = next((i for i, s in enumerate(lines) if re.search(rf"= {buf}; del {buf}\s+# reuse", s)), None)
    assert fence is not None and re.search(rf"offload_wait\.default\(buf\d+, {buf}\b", lines[fence]), fw
    assert reuse is None or reuse > fence, "\n".join(lines[at:])
    kernels = [s for s in lines[at + 1:fence] if "extern_kernels." in s or re.match(r"\s*cpp_fused", s)]
    assert kernels, "the fence runs right after the offload: nothing runs beside the copy"
    ref_a, ref_b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    f(ref_a, ref_b).sum().backward()
    assert torch.allclose(a.grad, ref_a.grad, rtol=1e-4, atol=1e-4)     # Inductor's sums may round otherwise
    assert torch.allclose(b.grad, ref_b.grad, rtol=1e-4, atol=1e-4)
    gc.collect()
    assert offload_ops.held() == 0


# ---- the codec ops on a device --------------------------------------------------------------------------

def test_compiled_compress_on_a_device_reads_no_value_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """R5: on CUDA, choosing a codec from the data (sparse, binary, narrow) reads statistics on the host: one
    device drain per saved tensor per step. There the ops (and the probe that plans for them) take only the
    codecs that decide without: bool tensors as bitmasks; the others are held as they are."""
    monkeypatch.setattr(codec_ops, "_on_device", lambda x: True, raising=False)       # the CUDA branch
    monkeypatch.setattr(codecs, "_numba", lambda kernel, t, force_torch: None)        # torch's kernels, as there
    codec_ops.register()
    region = codec_ops.new_region()
    g = torch.Generator().manual_seed(0)
    relu = torch.randn(4096, generator=g).relu()
    mask = torch.rand(4096, generator=g) > 0.5
    index = torch.randint(0, 100, (4096,), generator=g)
    with SyncCounter(monkeypatch) as sync:
        tokens = [codec_ops._pack(x, region, 0) for x in (relu, mask, index)]
        chosen = [probe._smallest(x) for x in (relu, mask, index)]
    counts, _ = sync.take()
    assert not counts, counts
    st = codec_ops.stats_for(region)
    assert st.codecs == {"bitmask": 1} and st.raw == 2, st
    assert chosen[0] is None and chosen[1] == ("bitmask", 512) and chosen[2] is None
    for token, x in zip(tokens, (relu, mask, index)):
        got = torch.ops.hybridmem.unpack_saved(token, list(x.shape), list(x.stride()), x.dtype, x.device, region)
        assert bit_equal(got, x)


# ---- host tokens in the stats ---------------------------------------------------------------------------

def _offloaded(model: Any = None) -> tuple[fx.GraphModule, int, list[str]]:
    """An MLP's default partition with every saved activation offloaded (by ``model``'s fence placement): its
    forward, the host tokens it saved before the rewrite, and the values rewritten."""
    got: list[tuple[fx.GraphModule, int, list[str]]] = []

    def partition(gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        before = offload_mod.host_tokens(fw)
        saved = {n.name for n in bw.graph.find_nodes(op="placeholder")}
        picks = [storage_of(n) for n in fw.graph.nodes if n.op == "call_function" and n.name in saved]
        got.append((fw, before, offload_mod.rewrite_partition(fw, bw, picks, model)))
        return fw, bw

    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    compiled = torch.compile(mlp, backend=aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                                       partition_fn=partition))
    compiled(torch.randn(4, 8)).sum().backward()
    (one,) = got
    return one


def _fences(fw: fx.GraphModule) -> list[tuple[int, bool]]:
    """For each fence: the forward's kernels between its offload and it (views and hybridmem's ops are none),
    and whether only fences follow it (the forward's end)."""
    nodes = list(fw.graph.nodes)
    out = []
    for fence in (n for n in nodes if n.target is torch.ops.hybridmem.offload_wait.default):
        between = nodes[nodes.index(fence.args[0]) + 1:nodes.index(fence)]
        kernels = sum(1 for n in between if n.op == "call_function" and "hybridmem" not in str(n.target)
                      and n.target is not torch.ops.aten.t.default)
        after = nodes[nodes.index(fence) + 1:-1]
        out.append((kernels, all(n.target is torch.ops.hybridmem.offload_wait.default for n in after)))
    return out


def test_a_fence_follows_the_nodes_its_copy_out_is_predicted_to_take() -> None:
    """R2's fence: a few nodes after its offload (the copy runs beside them; x is held no longer than the copy
    takes), as many as the cost model predicts the copy to take; at the forward's end where that comes first
    (an offload after the forward's last kernel has nothing to run beside)."""
    fw, _, moved = _offloaded()
    got = _fences(fw)
    assert len(got) == len(moved) >= 2
    assert all(1 <= k <= offload_mod.FENCE_NODES or end for k, end in got) and any(k for k, _ in got), got
    fast = get_cost_model("h100")                       # a few KiB: the next kernel covers the copy
    fw, _, _ = _offloaded(fast)
    assert all(k == 1 or end for k, end in _fences(fw)), _fences(fw)
    slow = dataclasses.replace(fast, d2h_bw=1.0)        # a copy out that outlasts the forward
    fw, _, _ = _offloaded(slow)
    assert all(end for _, end in _fences(fw)), _fences(fw)


def test_a_forward_that_saves_host_tokens_is_counted() -> None:
    """R8: an offloaded value is saved as a host token, which CUDA graphs (cudagraph trees) skip."""
    fw, before, moved = _offloaded()
    assert before == 0 and moved and offload_mod.host_tokens(fw) == len(moved)


def test_the_stats_say_cuda_graphs_skip_a_region_that_holds_host_tokens() -> None:
    """R8: a compressed region's forward saves host tokens: its stats count them and the note says CUDA graphs
    skip its graphs (torch skips them without a word)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(128, 128), nn.ReLU())], nn.Linear(128, 4))
    x = torch.randn(1024, 128)
    torch._dynamo.reset()
    probe_b = compile_backend(1 << 40, compiler="eager", measure=False, verify=False)
    torch.compile(model, backend=probe_b)(x).sum().backward()
    keep_all = probe_b.stats().regions[0].keep_all_peak_bytes
    torch._dynamo.reset()
    b = compile_backend(int(0.97 * keep_all), compiler="eager", policies=("compress",), measure=False, verify=False)
    torch.compile(model, backend=b)(x).sum().backward()
    (region,) = b.stats().regions
    assert region.compressed > 0, str(b.stats())
    assert getattr(region, "host_tokens", 0) == region.compressed, str(b.stats())
    assert "CUDA graphs" in region.note and "skip" in region.note, region.note
    assert probe_b.stats().regions[0].host_tokens == 0
