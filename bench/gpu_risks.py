"""Device checks of the GPU risks a read of the CUDA paths found, one short command for a device session.

    python bench/gpu_risks.py --out gpu-risks                  # on a CUDA machine: every check
    python bench/gpu_risks.py --only compile-r2 --out DIR      # some of them (names, or a section: compile)
    python bench/gpu_risks.py --dry-run --out DIR              # on the CPU: what runs there, the rest skipped

Each check is one function returning ``{name, section, passed, detail}`` (``passed`` None: skipped, the
detail says why); ``--out DIR`` gets ``gpu_risks.json`` and ``gpu_risks.md``. Exit status 1 where a
check failed.

The compiled path (``compile`` section), hybridmem's own offload and codec ops
(:mod:`hybridmem.compile.offload_ops`, :mod:`hybridmem.compile.codec_ops`):

- ``compile-r1``, ``compile-r1-deterministic``: a reload's block is handed out while a write into it is
  still queued on the compute stream (a 256 MiB block freed with a fill queued behind ``torch.cuda._sleep``;
  under deterministic algorithms, ``empty_strided``'s own NaN fill). The reload must wait for the compute
  stream: its bytes must equal the offloaded ones.
- ``compile-r2``: ``torch.compile`` of ``x = a @ b; offload(x); y = b @ a`` (8192², TF32 off), with and
  without the fence (``offload_wait``) and Inductor's buffer reuse. Without the fence and with reuse, ``y``
  is written into ``x``'s buffer while the copy out reads it; with the fence the reload must equal ``a @ b``.
- ``compile-r5``: ``pack_saved`` on a 64 MiB ReLU output and a bool mask under
  ``torch.cuda.set_sync_debug_mode("error")``: no host read of device values; the round trip bit-exact.
- ``compile-r10``: a reload issued behind a 256 MiB offload completes before that offload's copy does
  (copies in and out on streams of their own).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing bench

from hybridmem.compile import codec_ops, offload_ops  # noqa: E402

MIB = 1 << 20


@dataclass
class Context:
    """Where the checks run: ``device``; ``dry_run``: on the CPU, small sizes."""

    device: torch.device
    dry_run: bool


Check = Callable[[Context], dict[str, Any]]
CHECKS: dict[str, tuple[str, Check]] = {}       # name -> (section, check), in the order they run


def check(section: str, name: str) -> Callable[[Check], Check]:
    """Register ``fn`` as check ``name`` of ``section``; its result gets both."""
    def register(fn: Check) -> Check:
        if name in CHECKS:
            raise ValueError(f"check {name!r} is defined twice")

        def run(ctx: Context) -> dict[str, Any]:
            return {"name": name, "section": section, **fn(ctx)}
        CHECKS[name] = (section, run)
        return fn
    return register


def result(passed: bool | None, detail: str, **extra: Any) -> dict[str, Any]:
    return {"passed": passed, "detail": detail, **extra}


def skipped(why: str) -> dict[str, Any]:
    return result(None, f"skipped: {why}")


@contextlib.contextmanager
def deterministic(on: bool) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(on)`` (uninitialised memory filled with NaN), restored after."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """Exact float32 matrix products (a reload compares bit for bit with the eager product)."""
    was = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = was


def _sleep_cycles(device: torch.device, seconds: float) -> int:
    """GPU clock cycles in ``seconds`` (``torch.cuda._sleep`` counts cycles)."""
    khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 1_500_000
    return int(khz * 1e3 * seconds)


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.reshape(-1).view(bits) != b.reshape(-1).view(bits)).sum())


# ---- compile -------------------------------------------------------------------------------------------

def _r1(ctx: Context, det: bool) -> dict[str, Any]:
    if ctx.device.type != "cuda":
        return skipped("needs CUDA: the race is a copy-in stream against a write queued on the compute stream "
                       "(on the CPU the ops copy at once; tests/test_compile_cuda_ops.py checks the stream order)")
    offload_ops.register()
    dev, n = ctx.device, 256 * MIB // 4
    geometry = ([n], [1], torch.float32, dev)
    with deterministic(det):
        x = torch.randn(n, device=dev)
        ref = x.cpu()
        token = torch.ops.hybridmem.offload(x)
        token = torch.ops.hybridmem.offload_wait(token, x, [])
        del x
        torch.cuda.synchronize(dev)              # the copy out is done: only the compute stream can order the copy in
        torch.cuda.empty_cache()                 # x's block gone: the reload gets the block freed below
        junk = torch.empty(n, device=dev)
        block = junk.data_ptr()
        torch.cuda._sleep(_sleep_cycles(dev, 0.2))
        junk.fill_(7.0)                          # queued behind the sleep
        del junk                                 # its block is free to the allocator, the fill still queued
        ready = torch.ops.hybridmem.reload_start(token, *geometry)
        out = torch.ops.hybridmem.reload_wait(ready, *geometry)
        same = out.data_ptr() == block
        torch.cuda.synchronize(dev)
        bad = _differ(out.cpu(), ref)
    mode = "deterministic" if det else "plain"
    exercised = "" if same else " (the reload got another block: the race was not exercised)"
    return result(bad == 0 and same, f"{mode}: {bad} of {n} elements differ from the offloaded ones{exercised}",
                  differ=bad, same_block=same)


@check("compile", "compile-r1")
def compile_r1(ctx: Context) -> dict[str, Any]:
    """R1, plain mode: a reload into a block a queued fill still writes."""
    return _r1(ctx, False)


@check("compile", "compile-r1-deterministic")
def compile_r1_deterministic(ctx: Context) -> dict[str, Any]:
    """R1 under deterministic algorithms: empty_strided's NaN fill is the queued write."""
    return _r1(ctx, True)


def _offload_then_mm(fence: bool) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``x = a @ b; offload(x); y = b @ a``, with the fence where the graph rewrite puts it (after ``y``)."""
    def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = a @ b
        token = torch.ops.hybridmem.offload(x)
        y = b @ a
        if fence:
            token = torch.ops.hybridmem.offload_wait(token, x, [y])
        return token, y
    return f


def _reused(code: str) -> bool:
    """Whether Inductor's code hands the offloaded buffer to another before a fence reads it."""
    import re
    lines = code[code.find("def call"):].splitlines()
    at = next((i for i, s in enumerate(lines) if "hybridmem.offload.default(" in s), None)
    if at is None:
        return False
    buf = re.search(r"offload\.default\((buf\d+)\)", lines[at]).group(1)
    for s in lines[at + 1:]:
        if "hybridmem.offload_wait.default(" in s and re.search(rf"\b{buf}\b", s):
            return False
        if re.search(rf"= {buf}; del {buf}\s+# reuse", s):
            return True
    return False


def _r2_variant(ctx: Context, a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, fence: bool,
                reuse: bool) -> tuple[int, bool]:
    """Elements of the reload that differ from ``a @ b``, and whether the code reused the buffer early."""
    from torch._inductor import config as iconfig
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(_offload_then_mm(fence), backend="inductor", fullgraph=True)
    with iconfig.patch(allow_buffer_reuse=reuse, fx_graph_cache=False):
        (token, _), codes = run_and_get_code(compiled, a, b)
    n = ref.shape[0]
    geometry = ([n, n], [n, 1], torch.float32, ctx.device)
    out = torch.ops.hybridmem.reload_wait(torch.ops.hybridmem.reload_start(token, *geometry), *geometry)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return _differ(out.cpu(), ref), any(_reused(c) for c in codes)


@check("compile", "compile-r2")
def compile_r2(ctx: Context) -> dict[str, Any]:
    """R2: Inductor's buffer reuse against the copy out, with and without the fence."""
    offload_ops.register()
    n = 512 if ctx.dry_run else 8192
    g = torch.Generator(device=ctx.device).manual_seed(0)
    with no_tf32():
        a = torch.randn(n, n, device=ctx.device, generator=g)
        b = torch.randn(n, n, device=ctx.device, generator=g)
        ref = (a @ b).cpu()
        got = {(fence, reuse): _r2_variant(ctx, a, b, ref, fence, reuse)
               for fence in (True, False) for reuse in (True, False)}
    torch._dynamo.reset()
    fenced = [got[True, r] for r in (True, False)]
    passed = all(bad == 0 and not early for bad, early in fenced)
    parts = [f"{'fence' if f else 'no fence'}, reuse {'on' if r else 'off'}: {bad} of {n * n} differ"
             + (", the offloaded buffer reused before any fence" if early else "")
             for (f, r), (bad, early) in got.items()]
    hazard = got[False, True]
    note = ("" if hazard[1] else "; Inductor reused nothing even without the fence: the hazard did not show")
    return result(passed, f"{n}²: " + "; ".join(parts) + note,
                  variants={f"fence={f},reuse={r}": {"differ": bad, "reused_early": early}
                            for (f, r), (bad, early) in got.items()})


@check("compile", "compile-r5")
def compile_r5(ctx: Context) -> dict[str, Any]:
    """R5: the codec ops read no device value on the host."""
    if ctx.device.type != "cuda":
        return skipped("needs CUDA: set_sync_debug_mode sees device synchronisations only "
                       "(tests/test_compile_cuda_ops.py counts host reads on the CPU)")
    codec_ops.register()
    region = codec_ops.new_region()
    g = torch.Generator(device=ctx.device).manual_seed(0)
    relu = torch.randn(64 * MIB // 4, device=ctx.device, generator=g).relu()
    mask = relu > 0
    tensors = (relu, mask)
    torch.cuda.synchronize(ctx.device)
    error = ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = [torch.ops.hybridmem.pack_saved(x, region, 0) for x in tensors]
        outs = [torch.ops.hybridmem.unpack_saved(t, list(x.shape), list(x.stride()), x.dtype, x.device, region)
                for t, x in zip(tokens, tensors)]
    except RuntimeError as e:
        error, outs = str(e).splitlines()[0], []
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if error:
        return result(False, f"a host synchronisation while packing: {error}")
    bad = sum(_differ(o.cpu(), x.cpu()) for o, x in zip(outs, tensors))
    st = codec_ops.stats_for(region)
    return result(bad == 0, f"no synchronisation; codecs {st.codecs or {}}, {st.raw} held as they were; "
                            f"{bad} elements differ after the round trip", differ=bad)


@check("compile", "compile-r10")
def compile_r10(ctx: Context) -> dict[str, Any]:
    """R10: a reload does not queue behind the offloads issued before it."""
    if ctx.device.type != "cuda":
        return skipped("needs CUDA: on the CPU the ops copy at once (tests/test_compile_cuda_ops.py checks the "
                       "two streams against a recording stand-in)")
    offload_ops.register()
    dev = ctx.device
    small = torch.randn(MIB // 4, device=dev)
    ref = small.cpu()
    first = torch.ops.hybridmem.offload_wait(torch.ops.hybridmem.offload(small), small, [])
    big = torch.randn(256 * MIB // 4, device=dev)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    second = torch.ops.hybridmem.offload(big)                           # a long copy out, queued
    geometry = (list(small.shape), list(small.stride()), small.dtype, dev)
    ready = torch.ops.hybridmem.reload_start(first, *geometry)       # a short copy in, issued behind it
    _, held_big = offload_ops._TABLE.get(second, "compile-r10")
    _, held_small = offload_ops._TABLE.get(ready, "compile-r10")
    while not held_small.landed.query():
        time.sleep(1e-4)
    in_s = time.perf_counter() - t0
    out_pending = not held_big.copied.query()
    out = torch.ops.hybridmem.reload_wait(ready, *geometry)
    torch.cuda.synchronize(dev)
    bad = _differ(out.cpu(), ref)
    d2h, h2d = offload_ops._streams(dev)
    return result(out_pending and bad == 0 and d2h != h2d,
                  f"the 1 MiB reload landed after {in_s * 1e3:.2f} ms, "
                  f"{'before' if out_pending else 'not before'} the 256 MiB offload issued ahead of it; "
                  f"{bad} elements differ", differ=bad)


# ---- eager -------------------------------------------------------------------------------------------
# The eager runtime's device wiring (``eager`` section), each check in a fresh Python process of its own
# (allocator settings, a registered callback and forked workers must not leak into the next check):
#
# - ``eager-r6``: with ``PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:4``, the bytes a 1,100,000-byte
#   tensor takes before enable (1,310,720: rounded to a quarter of the power of two), under a budget and
#   after disable must be the same, and after disable the settings string and memory fraction as before.
# - ``eager-r7``: enable under a budget, then iterate a ``DataLoader(num_workers=2)`` of forked workers: no
#   "Cannot re-initialize CUDA" from a worker, and the batches arrive.
# - ``eager-r8``: an 8 x 4096 MLP under swap at 0.85 x its peak, four warm steps on a side stream, then its
#   forward and backward captured with ``torch.cuda.graph`` and replayed: no error raised through hybridmem.
# - ``eager-r3-default``, ``eager-r3-swap``: ResNet-50 (b64, 224 px) at 70 % of its unmanaged peak: the
#   steady steps' deltas of the allocator's syncs of all streams and retries are zero (no cache flush), the
#   reserved peak of every step is within the budget, and no step raises an OOM (R4).
# - ``eager-r12``: the same model under ``cudnn.benchmark`` at 70 %: a session from step 1 (the autotuner
#   runs under the cap) against one after two unmanaged warm steps, and benchmark off; the cold one must be
#   within 5 % of the warm one (median of steps 5-8), no refusal in either.

_EAGER_PRELUDE = f"""
import json, statistics, sys, time
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
import torch
import hybridmem
spec = json.loads(sys.argv[1])
dev = torch.device(spec["device"])
cuda = dev.type == "cuda"
def sync():
    if cuda:
        torch.cuda.synchronize(dev)
def report(**out):
    print("RESULT " + json.dumps(out), flush=True)
"""

# Steps of a zoo model, unmanaged or under a budget: per step its time, peaks, allocator counter deltas, steady.
_EAGER_STEPS = _EAGER_PRELUDE + """
from hybridmem.native import cpumeter
from hybridmem.zoo import build
torch.backends.cudnn.benchmark = spec.get("benchmark", False)
entry = build(spec["model"], spec["size"], device=dev)
model = entry.model
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
args, kwargs = entry.args_kwargs()
KEYS = ("num_sync_all_streams", "num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")
native = cpumeter.load()
def counts():
    out = {k: torch.cuda.memory_stats(dev).get(k, 0) for k in KEYS} if cuda else {}
    out["callback_calls"] = native.cuda_calls if native is not None else 0
    return out
def step():
    loss = entry.loss_fn(model(*args, **kwargs))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
def steps(n, session=None):
    rows = []
    for i in range(n):
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        before, steady0 = counts(), session.stats().steady_steps if session else 0
        t0 = time.perf_counter()
        step()
        sync()
        ms = (time.perf_counter() - t0) * 1e3
        after = counts()
        st = session.stats() if session else None
        rows.append({"ms": ms, "steady": bool(st and st.steady_steps > steady0),
                     "alloc_peak": torch.cuda.max_memory_allocated(dev) if cuda else (st.peak_bytes if st else 0),
                     "reserved_peak": torch.cuda.max_memory_reserved(dev) if cuda else 0,
                     **{k: after[k] - before[k] for k in after}})
    return rows
warm = steps(spec.get("warm", 0)) if spec.get("warm") else []
if spec.get("budget") is None:
    if cuda:
        rows = steps(spec["steps"])
        peak = max(r["alloc_peak"] for r in rows)
    else:  # the CPU has no allocator statistics: the runtime watching counts them
        with hybridmem.session(budget=None, device="cpu") as s:
            step()
            peak = s.stats().peak_bytes
    report(peak=peak)
    sys.exit(0)
rows, oom, notes, swap = [], "", [], {}
try:
    with hybridmem.session(budget=spec["budget"], policies=spec["policies"], device=str(dev)) as s:
        rows = steps(spec["steps"], s)
        notes = s.stats().notes
        pol = s.runtime.policies.get("swap")
        if pol is not None:
            c = pol.stats
            swap = {k: c.get(k, 0) for k in ("inflight_peak", "throttled", "exposed_s", "h2d_s")}
except torch.OutOfMemoryError as e:
    oom = str(e).splitlines()[0][:300]
report(rows=rows, oom=oom, notes=notes[:8], swap=swap, steps_done=len(rows))
"""


def _eager_run(script: str, spec: dict[str, Any], timeout: float = 300.0,
               env: dict[str, str] | None = None) -> tuple[dict[str, Any] | None, str]:
    """Run ``script`` with ``spec`` in a fresh Python process: its RESULT line (None when it printed none) and
    the tail of what it wrote to stderr."""
    full_env = {**os.environ, **(env or {})}
    try:
        proc = subprocess.run([sys.executable, "-c", script, json.dumps(spec)], capture_output=True, text=True,
                              timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired as e:
        return None, f"timed out after {timeout:.0f} s; {str(e.stderr or '')[-400:]}"
    got = [ln[len("RESULT "):] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    tail = proc.stderr.strip()[-1500:]
    if proc.returncode != 0 and not got:
        return None, f"exit {proc.returncode}: {tail[-600:]}"
    return (json.loads(got[-1]) if got else None), tail


_EAGER_DEFAULT = ("swap", "recompute", "compress")  # hybridmem's default policies


def _eager_model(ctx: Context) -> tuple[str, str]:
    return ("resnet50", "tiny") if ctx.dry_run else ("resnet50", "paper")


def _eager_budget(ctx: Context, share: float) -> tuple[int | None, str]:
    """``share`` of the model's unmanaged allocated peak (two steps, benchmark off), measured in its own process."""
    name, size = _eager_model(ctx)
    got, err = _eager_run(_EAGER_STEPS, {"device": str(ctx.device), "model": name, "size": size, "steps": 2})
    if got is None:
        return None, f"the unmanaged run failed: {err}"
    return int(share * got["peak"]), ""


_EAGER_R6 = _EAGER_PRELUDE + """
get = getattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "(no getter)")
def nbytes():
    sync()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(dev)
    x = torch.empty(1_100_000, dtype=torch.uint8, device=dev)
    n = torch.cuda.memory_allocated(dev) - before
    del x
    return n
out = {"settings_before": get(), "fraction_before": torch.cuda.get_per_process_memory_fraction(dev)}
out["bytes_before"] = nbytes()
hybridmem.enable(budget="50%", policies=("recompute",), device=str(dev))
out["settings_enabled"], out["bytes_enabled"] = get(), nbytes()
hybridmem.disable()
out["settings_after"], out["bytes_after"] = get(), nbytes()
out["fraction_after"] = torch.cuda.get_per_process_memory_fraction(dev)
report(**out)
"""


@check("eager", "eager-r6")
def eager_r6(ctx: Context) -> dict[str, Any]:
    """R6: enable keeps the user's allocator settings; disable restores them and the memory fraction."""
    if ctx.device.type != "cuda":
        return skipped("needs CUDA: the caching allocator's settings (tests/test_cuda_device.py stands in for them)")
    got, err = _eager_run(_EAGER_R6, {"device": str(ctx.device)}, 120,
                          env={"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:4"})
    if got is None:
        return result(False, f"the run failed: {err}")
    kept = got["bytes_before"] == got["bytes_enabled"] == got["bytes_after"]
    after = got["settings_after"]
    restored = "roundup_power2_divisions:4" in after and "expandable_segments:True" not in after
    fraction = got["fraction_after"] == got["fraction_before"]
    return result(kept and restored and fraction,
                  f"1,100,000 bytes take {got['bytes_before']:,} before enable, {got['bytes_enabled']:,} under it, "
                  f"{got['bytes_after']:,} after; settings {got['settings_before']!r} -> {got['settings_enabled']!r} "
                  f"-> {after!r}; fraction {got['fraction_before']} -> {got['fraction_after']}", **got)


_EAGER_R7 = _EAGER_PRELUDE + """
from torch.utils.data import DataLoader, TensorDataset
torch.zeros(1, device=dev)  # the parent's CUDA (or CPU) state is initialised before the workers fork
hybridmem.enable(budget=spec["budget"], device=str(dev))
loader = DataLoader(TensorDataset(torch.arange(64.0).view(-1, 1)), batch_size=8, num_workers=2,
                    multiprocessing_context="fork")
total = sum(float(b[0].sum()) for b in loader)
hybridmem.disable()
report(total=total)
"""


@check("eager", "eager-r7")
def eager_r7(ctx: Context) -> dict[str, Any]:
    """R7: forked DataLoader workers of a managed CUDA process call no CUDA."""
    budget = "50%" if ctx.device.type == "cuda" else "512MiB"
    got, err = _eager_run(_EAGER_R7, {"device": str(ctx.device), "budget": budget}, 180)
    reinit = "Cannot re-initialize CUDA" in err
    ok = got is not None and got.get("total") == float(sum(range(64))) and not reinit
    return result(ok, ("workers forked and released cleanly" if ok else "a worker failed")
                  + ("; a worker called CUDA: 'Cannot re-initialize CUDA in forked subprocess'" if reinit else "")
                  + ("" if got is not None else f"; {err[-300:]}"))


_EAGER_R8 = _EAGER_PRELUDE + """
import traceback
torch.manual_seed(0)
layers = []
for _ in range(8):
    layers += [torch.nn.Linear(4096, 4096), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(512, 4096, device=dev)
def step():
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss
torch.cuda.reset_peak_memory_stats(dev)
step()
opt.zero_grad(set_to_none=True)
sync()
peak = torch.cuda.max_memory_allocated(dev)
error, where = "", ""
try:
    with hybridmem.session(budget=int(0.85 * peak), policies=("swap",), device=str(dev)) as s:
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(4):
                opt.zero_grad(set_to_none=True)
                step()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            static_loss = step()
        for _ in range(3):
            graph.replay()
        sync()
        steady = s.stats().steady_steps
except Exception as e:
    error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    tb = traceback.format_exc()
    where = "hybridmem" if "hybridmem" in tb else "torch"
    steady = -1
report(error=error, where=where, steady=steady, budget=int(0.85 * peak))
"""


@check("eager", "eager-r8")
def eager_r8(ctx: Context) -> dict[str, Any]:
    """R8: a managed MLP step captured in a CUDA graph and replayed."""
    if ctx.device.type != "cuda":
        return skipped("needs CUDA graphs (tests/test_cuda_capture.py stands in for the capture state)")
    got, err = _eager_run(_EAGER_R8, {"device": str(ctx.device)}, 240)
    if got is None:
        return result(False, f"the run failed: {err}")
    if got["error"]:
        return result(False, f"capture raised through {got['where']}: {got['error']}", **got)
    return result(True, f"captured and replayed 3 times under swap at {got['budget'] / MIB:.0f} MiB "
                        f"({got['steady']} steady steps before the capture)", **got)


def _steady_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    steady = [r for r in rows if r["steady"]]
    return {"steady": len(steady),
            "syncs": sum(r.get("num_sync_all_streams", 0) for r in steady),
            "retries": sum(r.get("num_alloc_retries", 0) for r in steady),
            "mallocs": sum(r.get("num_device_alloc", 0) for r in steady),
            "callback_calls": sum(r.get("callback_calls", 0) for r in steady),
            "ms": statistics.median([r["ms"] for r in steady]) if steady else 0.0,
            "reserved_peak": max((r["reserved_peak"] for r in rows), default=0)}


def _eager_r3(ctx: Context, policies: tuple[str, ...] | None) -> dict[str, Any]:
    # the dry run checks the plumbing: a tiny model's fixed bytes leave nothing to evict at 70 %
    budget, why = _eager_budget(ctx, 1.2 if ctx.dry_run else 0.7)
    if budget is None:
        return result(False, why)
    name, size = _eager_model(ctx)
    spec = {"device": str(ctx.device), "model": name, "size": size, "steps": 8, "budget": budget,
            "policies": list(policies or _EAGER_DEFAULT)}
    got, err = _eager_run(_EAGER_STEPS, spec, 400)
    if got is None:
        return result(False, f"the run failed: {err}")
    s = _steady_summary(got["rows"])
    cuda = ctx.device.type == "cuda"
    within = s["reserved_peak"] <= budget if cuda else max((r["alloc_peak"] for r in got["rows"]), default=0) <= budget
    ok = not got["oom"] and s["steady"] > 0 and s["syncs"] == 0 and s["retries"] == 0 and within
    detail = (f"{name} {size} at {budget / MIB:.0f} MiB ({', '.join(spec['policies'])}): "
              + (f"OOM after {got['steps_done']} steps: {got['oom']}" if got["oom"] else
                 f"{s['steady']} of {len(got['rows'])} steps steady, median {s['ms']:.1f} ms; in them "
                 f"{s['syncs']} allocator syncs of all streams, {s['retries']} retries, {s['mallocs']} cudaMallocs, "
                 f"{s['callback_calls']} callback calls; reserved peak {s['reserved_peak'] / MIB:.0f} MiB"
                 + (f"; swap in flight peak {got['swap'].get('inflight_peak', 0) / MIB:.0f} MiB, "
                    f"{got['swap'].get('throttled', 0)} throttled" if got["swap"] else "")))
    return result(ok, detail, budget=budget, **s, oom=got["oom"], swap=got["swap"], notes=got["notes"])


@check("eager", "eager-r3-default")
def eager_r3_default(ctx: Context) -> dict[str, Any]:
    """R3/R4, default policies at 70 %: no allocator flush in steady steps, reserved within the budget."""
    return _eager_r3(ctx, None)


@check("eager", "eager-r3-swap")
def eager_r3_swap(ctx: Context) -> dict[str, Any]:
    """R3/R4, swap only at 70 %: swap-outs in flight bounded, no allocator flush, no OOM."""
    return _eager_r3(ctx, ("swap",))


@check("eager", "eager-r12")
def eager_r12(ctx: Context) -> dict[str, Any]:
    """R12: cudnn.benchmark's autotuner under the cap (cold) against a warmed cache, and benchmark off."""
    if ctx.device.type != "cuda":
        return skipped("needs CUDA: cuDNN's autotuner under the cap")
    budget, why = _eager_budget(ctx, 0.7)
    if budget is None:
        return result(False, why)
    name, size = _eager_model(ctx)
    runs = {}
    for label, bench, warm in (("off", False, 0), ("cold", True, 0), ("warm", True, 2)):
        got, err = _eager_run(_EAGER_STEPS, {"device": str(ctx.device), "model": name, "size": size, "steps": 8,
                                             "budget": budget, "benchmark": bench, "warm": warm,
                                             "policies": list(_EAGER_DEFAULT)}, 400)
        if got is None or got["oom"] or len(got["rows"]) < 8:
            return result(False, f"benchmark {label}: " + (got["oom"] if got else err))
        rows = got["rows"][4:8]
        runs[label] = {"ms": statistics.median(r["ms"] for r in rows),
                       "ooms": sum(r.get("num_ooms", 0) for r in got["rows"])}
    cold, warm = runs["cold"]["ms"], runs["warm"]["ms"]
    ok = cold <= 1.05 * warm and not any(r["ooms"] for r in runs.values())
    refusals = ", ".join(f"{k} {v['ooms']}" for k, v in runs.items())
    return result(ok, f"{name} {size} at {budget / MIB:.0f} MiB, median of steps 5-8: benchmark off "
                      f"{runs['off']['ms']:.1f} ms, on from step 1 {cold:.1f} ms, on after two warm steps "
                      f"{warm:.1f} ms; refusals {refusals}", runs=runs)


# ---- running and reporting ------------------------------------------------------------------------------

def select(only: str | None) -> list[str]:
    """The checks ``only`` names (names or sections, ','-separated; None: all), in their order."""
    if not only:
        return list(CHECKS)
    asked = [x.strip() for x in only.split(",") if x.strip()]
    sections = {s for s, _ in CHECKS.values()}
    unknown = [x for x in asked if x not in CHECKS and x not in sections]
    if unknown:
        raise SystemExit(f"--only: unknown {', '.join(unknown)}; known checks: {', '.join(CHECKS)}; "
                         f"sections: {', '.join(sorted(sections))}")
    return [name for name, (section, _) in CHECKS.items() if name in asked or section in asked]


def run(names: list[str], ctx: Context) -> list[dict[str, Any]]:
    """Run the checks ``names``; one that raises is a failure whose detail says what it raised."""
    out = []
    for name in names:
        section, fn = CHECKS[name]
        t0 = time.perf_counter()
        try:
            got = fn(ctx)
        except Exception as e:      # noqa: BLE001  (the next checks still run; the row says what happened)
            got = {"name": name, "section": section, **result(False, f"raised {type(e).__name__}: {str(e)[:300]}")}
        got["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"{_mark(got['passed']):5s} {name}: {got['detail']}", flush=True)
        out.append(got)
    return out


def _mark(passed: bool | None) -> str:
    return "skip" if passed is None else "pass" if passed else "FAIL"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# GPU risk checks: {report['device']}", "",
             f"{report['date']}, torch {report['torch']}" + (", dry run" if report["dry_run"] else ""), "",
             "| check | section | result | s | detail |", "|---|---|---|---|---|"]
    for r in report["checks"]:
        lines.append(f"| {r['name']} | {r['section']} | {_mark(r['passed'])} | {r['seconds']} | "
                     f"{r['detail'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write gpu_risks.json and gpu_risks.md into this folder")
    ap.add_argument("--only", default=None, help="checks or sections to run, ','-separated (default: all)")
    ap.add_argument("--dry-run", action="store_true",
                    help="run on the CPU at small sizes, skipping what needs CUDA (says why)")
    args = ap.parse_args(argv)
    names = select(args.only)
    if args.dry_run:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        ap.error("no CUDA device here: --dry-run runs the checks the CPU can")
    ctx = Context(device, args.dry_run)
    checks = run(names, ctx)
    report = {"device": device_name(device), "torch": torch.__version__, "dry_run": args.dry_run,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "checks": checks}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_risks.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "gpu_risks.md").write_text(markdown(report))
    return 1 if any(r["passed"] is False for r in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
