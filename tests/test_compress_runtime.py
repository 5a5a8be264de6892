"""Compress policy under the runtime: bit-identical training with BatchNorm + in-place ReLU (sparse
codec) and with max-pool indices (narrow codec), and bench/gpu_check's compress-only protocol (which
once trained the model it then compared against)."""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridmem

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Block(nn.Module):
    """ResNet bottleneck in miniature: conv-bn-ReLU(inplace), then ``out += identity; relu_``."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         Block(8), Block(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 3):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, {n: b.clone() for n, b in model.named_buffers()}


def _reference(model: nn.Module, batch: int = 8, image: int = 16) -> tuple[torch.Tensor, torch.Tensor, Any, int]:
    """Seeded inputs, the unmanaged run on them, and the monitor-only peak of the same steps."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 3, image, image, generator=g), torch.randint(0, 10, (batch,), generator=g)
    base = _train(model, x, y)
    with hybridmem.session(budget=None, device="cpu") as s:  # the allocator: the units the cap enforces
        _train(model, x, y)
    return x, y, base, s.stats().peak_bytes


def _same(a, b) -> bool:
    (la, ga, ba), (lb, gb, bb) = a, b
    return (all(torch.equal(x, y) for x, y in zip(la, lb))
            and all(torch.equal(x[k], y[k]) for x, y in zip(ga, gb) for k in x)
            and ba.keys() == bb.keys() and all(torch.equal(ba[k], bb[k]) for k in ba))


def test_compress_alone_bn_inplace_relu_is_bit_identical() -> None:
    model = _net()
    # large enough that saved activations, not the convolutions' scratch, make the peak
    x, y, base, peak = _reference(model, batch=16, image=32)
    evicted = 0
    for cut in (1 << 14, 1 << 15):      # a little and some more below the monitor peak
        with hybridmem.session(budget=peak - cut, policies=("compress",), device="cpu") as s:
            got = _train(model, x, y)
        st = s.stats().policies["compress"]
        evicted += st.evicted
        assert st.regenerated == st.evicted
        assert _same(base, got), f"compress at budget peak - {cut} changed the training run"
    assert evicted > 0


def test_compress_alone_max_pool_indices_are_narrowed_and_bit_identical() -> None:
    """Max-pool saves int64 indices (values < H*W): the narrow codec keeps 2 of their 8 bytes, and
    max_pool2d_with_indices_backward reads them back exactly."""
    torch.manual_seed(0)
    # the wide second stage makes the peak an op of its backward, while the first pool's indices
    # wait unused: the only tensor the narrow codec can shrink then
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(64 * 4 * 4, 10))
    x, y, base, peak = _reference(model, batch=32)
    budget = peak - (1 << 13)
    only_narrow = {"extra": {"compress": {"lossless_codecs": ["narrow"]}}}   # the indices, nothing else
    with hybridmem.session(budget=budget, policies=("compress",), device="cpu", config=only_narrow) as s:
        got = _train(model, x, y)
    policy = s.runtime.policies["compress"]
    assert set(policy.codec_counts) == {"narrow"}, policy.codec_counts
    assert s.stats().peak_bytes <= budget
    assert _same(base, got)


def test_gpu_check_compressible_bytes_leaves_the_model_untouched() -> None:
    """compressible_bytes() ran a training-mode step on entry.model: BatchNorm running stats and
    num_batches_tracked moved, so every later policy row (compress alone, all policies) started from
    another model than the unmanaged run and could not be bit-identical."""
    from bench.gpu_check import compressible_bytes
    from hybridmem.zoo import build

    entry = build("resnet50", "tiny")
    before = {k: v.clone() for k, v in entry.model.state_dict().items()}
    assert compressible_bytes(entry) > 0
    after = entry.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in entry.model.parameters())
