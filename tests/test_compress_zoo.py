"""Compress alone on every zoo model, with a real saving (issue 3's protocol for compress alone).

The budget is the monitor-only peak minus 40 % of *the share its lossless codecs can save*: after the
first step's loss, when all of its saved activations are alive, the compress policy a session makes is
asked what it would save on each of them (``CompressPolicy.estimate``: decided afresh, nothing cached
or counted, the tensor only read); the storages asked about add up to the runtime's own count of the
step's saved activation bytes (checked). The same 40 % as the other policies' budgets, because all
of the share can never be saved at once: backward decodes what each op reads while that op's
gradients are live. Measured at batch 8 (3 SGD steps): 40 % of the share fits every model, 60 % and
75 % all but VGG-16 (at 60 % its max-pool backward runs out), 100 % none (the last test checks the
refusal on the two transformers).

What is compressible (fraction of the step's saved bytes, and where it comes from):

===========  =====  =============================================================================
vgg16        0.56   ReLU outputs (``sparse``), max-pool indices (``narrow``: int64 -> int16), dropout
resnet50     0.14   ReLU outputs after in-place ReLU (the BatchNorm inputs are dense), max-pool indices
resnet101    0.12   the same (slow test)
resnet152    0.11   the same (slow test)
mobilenet    0.15   ReLU6 outputs; depthwise/pointwise conv outputs and BatchNorm inputs are dense
unet         0.21   ReLU outputs, max-pool indices
transformer  0.18   dropout masks (``binary``), 112 bytes of position ids; GELU, softmax, LayerNorm: dense
gpt          0.16   dropout masks; causal attention's softmax and its dropout (half zeros, ``sparse``)
===========  =====  =============================================================================

The saving is real: the CPU allocator's own peak (``torch.profiler`` memory events, over the 3 steps)
drops with it, except on VGG-16, whose allocator peak is scratch memory inside the backward of its
second convolution (full resolution), when the only compressible tensor still alive is that op's own
input (it is then equal, never higher).
ResNet-101/-152 are ``slow``, as in tests/test_runtime_zoo.py.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import pytest
import torch

import hybridmem
from hybridmem.runtime.meter import profiler_peak
from hybridmem.plugins.compress import compressible_share as compressible_share_of
from tests.helpers.runtime import Case, run, train
from tests.helpers.zoo import FAST, OPTIM, SLOW, zoo_case

torch.set_num_threads(1)

CUT = 0.4
# fraction of the step's saved bytes the lossless codecs save, and the codecs that save it
SHARE: dict[str, tuple[float, set[str]]] = {
    "vgg16": (0.558, {"sparse", "narrow", "binary"}),
    "resnet50": (0.137, {"sparse", "narrow", "binary"}),
    "resnet101": (0.117, {"sparse", "narrow", "binary"}),
    "resnet152": (0.105, {"sparse", "narrow", "binary"}),
    "mobilenet": (0.150, {"sparse", "binary"}),
    "unet": (0.207, {"sparse", "narrow", "binary"}),
    "transformer": (0.183, {"binary", "narrow"}),
    "gpt": (0.162, {"binary", "sparse", "narrow"}),
}
# models whose allocator peak is kernel scratch at an op that reads the only compressible tensor left
ALLOCATOR_PEAK_OUT_OF_REACH = {"vgg16"}


@dataclass(frozen=True)
class Baseline:
    ref: list            # unmanaged: per step loss, gradients, buffers; then the RNG state
    ref_alloc: int       # the CPU allocator's peak over the unmanaged run
    peak: int            # monitor-only peak (meter)
    saved: int           # the step's saved activation bytes
    share: dict          # codec -> bytes it would save on the last step's saved activations


def _tensors(obj: Any, depth: int = 3) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0:
        return []
    if isinstance(obj, dict):
        obj = list(obj.values())
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        obj = list(vars(obj).values())
    return [t for v in obj for t in _tensors(v, depth - 1)] if isinstance(obj, (list, tuple)) else []


def compressible_share(case: Case, seed: int = 0) -> tuple[int, dict[str, int]]:
    """The share for ``case``: its inputs excluded, the first training step's seed (same dropout masks)."""
    return compressible_share_of(case.model, case.loss, exclude=_tensors((case.args, case.kwargs, case.loss_fn)),
                                 seed=seed)


def _profiled(case: Case, **session: Any) -> tuple[list, Any, int]:
    """3 training steps (unmanaged without ``session`` arguments) and the allocator's peak over them."""
    model = copy.deepcopy(case.model)  # outside the session and the profile: the same in both runs
    got: dict[str, Any] = {}

    def go() -> None:
        if not session:
            got["result"], got["stats"] = train(case, model, optim=OPTIM), None
            return
        with hybridmem.session(device="cpu", **session) as s:
            got["result"] = train(case, model, optim=OPTIM)
        got["stats"] = s.stats()

    alloc = profiler_peak(go)
    return got["result"], got["stats"], alloc


@lru_cache(maxsize=None)
def _baseline(name: str) -> Baseline:
    case = zoo_case(name)
    ref, _, ref_alloc = _profiled(case)
    mon, st = run(case, optim=OPTIM, budget=None, policies=("compress",))
    assert mon == ref, f"{name}: the monitor-only run differs from the unmanaged run"
    assert st is not None and st.saved_bytes > 0
    seen, share = compressible_share(case)
    assert seen == st.saved_bytes, f"{name}: asked about {seen} saved bytes, the runtime counted {st.saved_bytes}"
    return Baseline(ref, ref_alloc, st.peak_bytes, st.saved_bytes, share)


@pytest.mark.parametrize("name", [*FAST, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW)])
def test_compress_alone_on_zoo_model(name: str) -> None:
    b = _baseline(name)
    share = sum(b.share.values())
    fraction, codecs = SHARE[name]
    assert set(b.share) == codecs, b.share
    assert share / b.saved == pytest.approx(fraction, abs=0.02), (share, b.saved, b.share)
    budget = b.peak - int(CUT * share)

    got, st, alloc = _profiled(zoo_case(name), budget=budget, policies=("compress",))
    assert st is not None and set(st.policies) == {"compress"}
    assert st.peak_bytes <= budget, f"{name}: peak {st.peak_bytes} > budget {budget}"
    assert st.cap_overruns == 0
    c = st.policies["compress"]
    assert c.evicted > 0 and c.regenerated == c.evicted
    for i, (x, y) in enumerate(zip(got, b.ref)):
        assert x == y, f"{name}: step {i} (loss, gradients, BatchNorm buffers or RNG) differs under compress alone"

    if name in ALLOCATOR_PEAK_OUT_OF_REACH:
        assert alloc <= b.ref_alloc, (alloc, b.ref_alloc)
    else:
        # a quarter of the demanded saving at least (measured: 29 % on MobileNet, whose allocator peak
        # is inside a convolution's backward; 63 % on ResNet-50; all of it on U-Net, Transformer, GPT)
        assert b.ref_alloc - alloc >= 0.25 * (b.peak - budget), (name, b.ref_alloc, alloc, b.peak - budget)


@pytest.mark.parametrize("name", ["transformer", "gpt"])
def test_compress_alone_refuses_a_budget_below_what_it_can_save(name: str) -> None:
    """Dropout masks are all a transformer has to compress (GELU/softmax/LayerNorm outputs are dense):
    a budget of the monitor peak minus the whole share is out of reach, and the error names a minimum
    that is above that budget and below the monitor peak."""
    b = _baseline(name)
    budget = b.peak - sum(b.share.values())
    case = zoo_case(name)
    model = copy.deepcopy(case.model)
    with pytest.raises(torch.OutOfMemoryError, match="holds every op of it") as err:
        with hybridmem.session(budget=budget, policies=("compress",), device="cpu"):
            train(case, model, optim=OPTIM)
    # the step went on uncapped and names the budget it needed (runtime.survey): compress cannot get below
    # the peak by much more than its codecs save
    m = re.search(r"a budget of [^(]*\((\d+) bytes\) holds every op of it", str(err.value))
    assert m is not None, str(err.value)
    assert budget < int(m.group(1)) == err.value.min_budget_bytes <= 1.02 * b.peak
    del err


def test_compressible_share_leaves_nothing_alive() -> None:
    """Its model copy and the step's activations are freed when it returns (a saved tensor handed back as
    itself would hold its own node: a cycle through C++ that the collector cannot free)."""
    import gc

    case = zoo_case("resnet50")
    gc.collect()
    before = sum(1 for o in gc.get_objects() if type(o) is torch.Tensor)
    seen, _ = compressible_share(case)
    gc.collect()
    after = sum(1 for o in gc.get_objects() if type(o) is torch.Tensor)
    assert seen > 0 and after <= before, f"{after - before} tensors left alive by compressible_share"
