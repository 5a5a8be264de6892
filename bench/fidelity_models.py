"""Models outside the zoo for the fidelity table, built from their published configurations in code (no
download): torchvision's ResNet-18 and MobileNetV2 written out (torchvision need not be installed) and a
small Hugging Face GPT-2 from a ``GPT2Config``. Each returns ``(model, inputs, loss_fn)``."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

Built = tuple[nn.Module, Any, Callable[[Any], torch.Tensor]]


class BasicBlock(nn.Module):
    """torchvision's ResNet-18/34 block."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + identity)


def resnet18(batch: int = 8, pixels: int = 96, classes: int = 1000, width: int = 64) -> Built:
    """torchvision's ``resnet18()`` (11.7 M parameters at width 64, 1000 classes)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = width
    for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
        layers += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)]
        cin = cout
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))
    x, y = torch.randn(batch, 3, pixels, pixels), torch.randint(0, classes, (batch,))
    return model, x, lambda out: F.cross_entropy(out, y)


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: bool = True) -> list[nn.Module]:
    mods: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
                             nn.BatchNorm2d(cout)]
    return mods + [nn.ReLU6(inplace=True)] if act else mods


class InvertedResidual(nn.Module):
    """torchvision's MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 linear projection."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        mods = _conv_bn(cin, hidden, 1) if expand != 1 else []
        mods += _conv_bn(hidden, hidden, 3, stride, hidden) + _conv_bn(hidden, cout, 1, act=False)
        self.conv = nn.Sequential(*mods)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


def mobilenet_v2(batch: int = 8, pixels: int = 96, classes: int = 1000) -> Built:
    """torchvision's ``mobilenet_v2()`` (width 1.0: 3.5 M parameters at 1000 classes)."""
    torch.manual_seed(0)
    table = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))
    layers: list[nn.Module] = [nn.Sequential(*_conv_bn(3, 32, 3, 2))]
    cin = 32
    for t, c, n, s in table:
        for i in range(n):
            layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
            cin = c
    layers.append(nn.Sequential(*_conv_bn(cin, 1280, 1)))
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(1280, classes))
    x, y = torch.randn(batch, 3, pixels, pixels), torch.randint(0, classes, (batch,))
    return model, x, lambda out: F.cross_entropy(out, y)


def gpt2_tiny(batch: int = 4, seq: int = 128, layers: int = 2, width: int = 128, heads: int = 4,
              vocab: int = 50257) -> Built:
    """Hugging Face's ``GPT2LMHeadModel`` from a ``GPT2Config`` (GPT-2's vocabulary, 2 layers 128 wide), its loss
    computed by the model from the labels; dropout off so repeated steps allocate alike."""
    from transformers import GPT2Config, GPT2LMHeadModel  # optional and slow to import: only this model needs it

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=seq,
                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, vocab, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss


BUILDERS: dict[str, Callable[[], Built]] = {"tv-resnet18": resnet18, "tv-mobilenet_v2": mobilenet_v2,
                                            "hf-gpt2-tiny": gpt2_tiny}
