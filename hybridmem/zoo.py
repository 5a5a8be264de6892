"""Benchmark model zoo: the STR paper's models in plain PyTorch, at four sizes.
One concern, hence one module: the models every benchmark and test of the zoo builds, side by side.

``build(name, size)`` returns a :class:`ZooEntry`: a model in training mode, deterministic inputs
and a loss function, ready for one training step::

    entry = build("resnet50", "small")
    loss = entry.loss()            # entry.loss_fn(entry.model(*args, **kwargs))
    loss.backward()

    entry = build("resnet50", "paper", device="meta")   # full size, no memory: for capture/planning

Sizes: ``tiny`` for unit tests (forward+backward well under 0.2 s on one CPU thread), ``small``
(under 1 s), ``bench`` (a few seconds, CPU benchmarks), ``paper`` (the STR paper's sizes, meant for
``device="meta"``). Names that fix a depth (VGG-16, ResNet-50/101/152, MobileNetV2, a 4-level
U-Net) keep the real depth at every size, so their graphs have the paper's structure and stage count;
only width, resolution and batch shrink. The transformer and GPT shrink in depth too.

Parameters and input per size (batch x shape; ``tokens`` are int64 ids):

============  ================  ================  ================  ================
model         tiny              small             bench             paper
============  ================  ================  ================  ================
vgg16         60.27 K           1.144 M           4.519 M           138.4 M
              2x3x32x32         8x3x64x64         32x3x64x64        256x3x224x224
resnet50      96.78 K           1.532 M           5.995 M           25.56 M
              2x3x32x32         8x3x64x64         16x3x112x112      64x3x224x224
resnet101     174 K             2.729 M           10.76 M           44.55 M
              2x3x32x32         8x3x64x64         16x3x112x112      96x3x224x224
resnet152     237.8 K           3.715 M           14.68 M           60.19 M
              2x3x32x32         8x3x64x64         16x3x112x112      64x3x224x224
mobilenet     162.6 K           648.1 K           2.352 M           3.505 M
              2x3x32x32         16x3x64x64        32x3x128x128      512x3x224x224
unet          122.1 K           1.943 M           7.763 M           31.04 M
              2x3x32x32         8x3x64x64         4x3x128x128       32x3x256x256
transformer   27.49 K           1.08 M            6.935 M           109.5 M
              2x16 tokens       8x64 tokens       16x128 tokens     256x128 tokens
gpt           34.18 K           1.064 M           6.869 M           124.4 M
              2x16 tokens       8x64 tokens       8x128 tokens      8x1024 tokens
============  ================  ================  ================  ================

Call conventions (each kind appears so the library is exercised on all three):

- CNNs and U-Net: ``model(images) -> logits``; labels (class per image, or per pixel for U-Net)
  are held by ``loss_fn`` (cross-entropy).
- ``transformer`` (BERT-like, post-LayerNorm): keyword inputs ``input_ids``, ``attention_mask``
  (bool, padded tails); returns a dict ``{"logits", "last_hidden_state"}``; loss: cross-entropy of
  a classifier on the first ([CLS]) token.
- ``gpt`` (GPT-2-like, pre-LayerNorm, tied embeddings): a tuple ``(input_ids, targets)``; the
  model computes its own next-token loss and returns ``(logits, loss)``; ``loss_fn`` picks ``loss``.

Weights come from ``seed`` (global RNG forked, so the caller's RNG state is untouched) and are the
same on every device; inputs come from a ``torch.Generator`` seeded with ``seed``. Dropout draws
from the global RNG at forward time, as it does in any training loop: seed it for repeatable runs.
VGG-16 and MobileNetV2 keep torchvision's classifier dropout (0.5 and 0.2); ResNets and U-Net have
none; the transformer and GPT use 0.1 (embeddings, attention, residual branches).

``python -m hybridmem.zoo`` prints this table from the code; ``--time`` adds one forward+backward per
size on one CPU thread (measured on the project's shared 2-core machine: tiny 5-80 ms, small 0.07-0.32 s,
bench 0.8-2.8 s). On meta, a paper-size forward+backward takes 0.1-1.2 s (ResNet-152 the longest),
plus about 2 s once per process while torch loads its meta kernels.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "PAPER_MODELS", "SIZES", "ZooEntry", "build", "config", "count_parameters", "size_table"]

MODELS: tuple[str, ...] = (
    "vgg16",
    "resnet50",
    "resnet101",
    "resnet152",
    "mobilenet",
    "unet",
    "transformer",
    "gpt",
)
PAPER_MODELS: tuple[str, ...] = (
    "vgg16",
    "unet",
    "mobilenet",
    "resnet50",
    "resnet101",
    "resnet152",
    "transformer",
)
SIZES: tuple[str, ...] = ("tiny", "small", "bench", "paper")


# --------------------------------------------------------------------------------------------
# The entry
# --------------------------------------------------------------------------------------------


@dataclass
class ZooEntry:
    """A model in training mode, one batch of inputs and the loss of one training step.

    ``inputs`` is a tensor (one positional argument), a tuple (positional arguments) or a dict
    (keyword arguments); :meth:`forward` applies the right convention.
    """

    name: str
    model: nn.Module
    inputs: torch.Tensor | tuple | dict
    loss_fn: Callable[[Any], torch.Tensor]
    description: str
    size: str = ""
    config: Any = None

    def args_kwargs(self) -> tuple[tuple, dict]:
        """The inputs as ``(args, kwargs)`` for ``model(*args, **kwargs)``."""
        if isinstance(self.inputs, dict):
            return (), dict(self.inputs)
        if isinstance(self.inputs, tuple):
            return self.inputs, {}
        return (self.inputs,), {}

    def forward(self) -> Any:
        """Runs the model on the inputs and returns its raw output."""
        args, kwargs = self.args_kwargs()
        return self.model(*args, **kwargs)

    def loss(self) -> torch.Tensor:
        """Forward pass and loss: the scalar to call ``backward()`` on."""
        return self.loss_fn(self.forward())


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements; tied weights count once (``parameters()`` deduplicates)."""
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# Losses: small callables rather than lambdas, so entries pickle and print without tensor dumps
# --------------------------------------------------------------------------------------------


@dataclass
class CrossEntropy:
    """Cross-entropy of the logits in the output (``out[key]`` when ``key`` is set) against ``target``.

    Works per sample (``(B, C)`` vs ``(B,)``) and per pixel (``(B, C, H, W)`` vs ``(B, H, W)``).
    """

    target: torch.Tensor = field(repr=False)
    key: str | int | None = None

    def __call__(self, out: Any) -> torch.Tensor:
        logits = out if self.key is None else out[self.key]
        return F.cross_entropy(logits, self.target)


@dataclass
class Select:
    """Picks a loss the model computed itself: ``out[key]``."""

    key: str | int

    def __call__(self, out: Any) -> torch.Tensor:
        return out[self.key]


# --------------------------------------------------------------------------------------------
# VGG-16
# --------------------------------------------------------------------------------------------

# Width multiples of the first block's channels per conv; "M" is a 2x2 max-pool.
_VGG16_LAYOUT: tuple[int | str, ...] = (1, 1, "M", 2, 2, "M", 4, 4, 4, "M", 8, 8, 8, "M", 8, 8, 8, "M")


@dataclass(frozen=True)
class VGGConfig:
    batch: int
    image: int = 224
    width: int = 64  # channels of the first block; the last blocks have 8x
    hidden: int = 4096
    num_classes: int = 1000
    dropout: float = 0.5
    in_channels: int = 3


class VGG16(nn.Module):
    """VGG-16 (configuration D): 13 3x3 convs with ReLU, 5 max-pools, 3 fully connected layers.

    The classifier reads the last feature map directly (no adaptive pool: at 224 it is already
    7x7, and at small sizes upsampling a 1x1 map to 7x7 would only waste memory).
    """

    def __init__(self, cfg: VGGConfig) -> None:
        super().__init__()
        if cfg.image % 32:
            raise ValueError(f"vgg16: image size must be a multiple of 32, got {cfg.image}")
        layers: list[nn.Module] = []
        channels = cfg.in_channels
        for item in _VGG16_LAYOUT:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                out = cfg.width * int(item)
                layers += [nn.Conv2d(channels, out, 3, padding=1), nn.ReLU(inplace=True)]
                channels = out
        self.features = nn.Sequential(*layers)
        side = cfg.image // 32
        self.classifier = nn.Sequential(
            nn.Linear(channels * side * side, cfg.hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(cfg.dropout),
            nn.Linear(cfg.hidden, cfg.hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(cfg.dropout),
            nn.Linear(cfg.hidden, cfg.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


# --------------------------------------------------------------------------------------------
# ResNet-50/101/152 (bottleneck blocks, torchvision's "v1.5": stride on the 3x3 conv)
# --------------------------------------------------------------------------------------------

_RESNET_BLOCKS: dict[str, tuple[int, int, int, int]] = {
    "resnet50": (3, 4, 6, 3),
    "resnet101": (3, 4, 23, 3),
    "resnet152": (3, 8, 36, 3),
}


@dataclass(frozen=True)
class ResNetConfig:
    batch: int
    blocks: tuple[int, int, int, int]
    image: int = 224
    width: int = 64  # stem channels and bottleneck width of the first stage
    num_classes: int = 1000
    in_channels: int = 3


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, each with BatchNorm; ReLU after the residual add."""

    expansion = 4

    def __init__(self, in_channels: int, planes: int, stride: int) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(in_channels, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        # One ReLU module reused three times, as torchvision does: in-place ops on shared modules
        # are part of what the library must handle.
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity  # in place, as in torchvision
        return self.relu(out)


class ResNet(nn.Module):
    """Bottleneck ResNet: 7x7 stem, max-pool, four stages, global average pool, linear classifier."""

    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        w = cfg.width
        self.conv1 = nn.Conv2d(cfg.in_channels, w, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        channels = w
        stages = []
        for i, n in enumerate(cfg.blocks):
            planes, stride = w * 2**i, 1 if i == 0 else 2
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(channels, planes, stride if j == 0 else 1))
                channels = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# --------------------------------------------------------------------------------------------
# MobileNetV2
# --------------------------------------------------------------------------------------------

# (expansion t, output channels c, repeats n, first stride s) from the MobileNetV2 paper.
_MOBILENET_V2_LAYOUT: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


@dataclass(frozen=True)
class MobileNetConfig:
    batch: int
    image: int = 224
    width_mult: float = 1.0  # scales every layer's channels, including the last 1x1 conv
    num_classes: int = 1000
    dropout: float = 0.2
    in_channels: int = 3


def _divisible(value: float, divisor: int = 8) -> int:
    """Rounds channels to a multiple of ``divisor`` without dropping more than 10 % (MobileNet rule)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def _conv_bn_relu6(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    """1x1 expand (ReLU6), 3x3 depthwise (ReLU6), 1x1 linear projection; residual when shapes match."""

    def __init__(self, cin: int, cout: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = cin * expansion
        self.use_residual = stride == 1 and cin == cout
        layers: list[nn.Module] = []
        if expansion != 1:
            layers.append(_conv_bn_relu6(cin, hidden, 1))
        layers += [
            _conv_bn_relu6(hidden, hidden, 3, stride=stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_residual else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2: strided 3x3 stem, 17 inverted residual blocks, 1x1 conv, pool, dropout, linear."""

    def __init__(self, cfg: MobileNetConfig) -> None:
        super().__init__()
        channels = _divisible(32 * cfg.width_mult)
        last = _divisible(1280 * cfg.width_mult)
        layers: list[nn.Module] = [_conv_bn_relu6(cfg.in_channels, channels, 3, stride=2)]
        for t, c, n, s in _MOBILENET_V2_LAYOUT:
            out = _divisible(c * cfg.width_mult)
            for j in range(n):
                layers.append(InvertedResidual(channels, out, s if j == 0 else 1, t))
                channels = out
        layers.append(_conv_bn_relu6(channels, last, 1))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(cfg.dropout), nn.Linear(last, cfg.num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# --------------------------------------------------------------------------------------------
# U-Net
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UNetConfig:
    batch: int
    image: int = 256
    width: int = 64  # channels of the first level; each level down doubles them
    depth: int = 4  # number of 2x down-samplings (the original U-Net has 4)
    num_classes: int = 2  # per-pixel classes (foreground / background)
    in_channels: int = 3


class DoubleConv(nn.Sequential):
    """(3x3 conv, BatchNorm, ReLU) twice; padded, so the skip connections need no cropping."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )


class Up(nn.Module):
    """2x transposed conv halving the channels, concatenation with the skip, double conv."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.conv = DoubleConv(2 * cout, cout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    """Classic U-Net: double convs, max-pool down, transposed conv up, concatenated skips, 1x1 head."""

    def __init__(self, cfg: UNetConfig) -> None:
        super().__init__()
        if cfg.image % 2**cfg.depth:
            raise ValueError(f"unet: image size must be a multiple of {2**cfg.depth}, got {cfg.image}")
        widths = [cfg.width * 2**i for i in range(cfg.depth + 1)]
        self.inc = DoubleConv(cfg.in_channels, widths[0])
        self.pool = nn.MaxPool2d(2)
        self.down = nn.ModuleList(DoubleConv(widths[i], widths[i + 1]) for i in range(cfg.depth))
        self.up = nn.ModuleList(Up(widths[i + 1], widths[i]) for i in reversed(range(cfg.depth)))
        self.head = nn.Conv2d(widths[0], cfg.num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inc(x)
        skips = []
        for down in self.down:
            skips.append(x)
            x = down(self.pool(x))
        for up in self.up:
            x = up(x, skips.pop())
        return self.head(x)


# --------------------------------------------------------------------------------------------
# Transformer encoder (BERT-like) and GPT decoder
# --------------------------------------------------------------------------------------------


class SelfAttention(nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention`` (fused QKV projection)."""

    def __init__(self, hidden: int, heads: int, dropout: float, causal: bool) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
        self.heads, self.dropout, self.causal = heads, dropout, causal
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal,
        )
        return self.proj(a.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Sequential):
    """Linear, GELU, linear: the feed-forward half of a transformer layer."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


@dataclass(frozen=True)
class EncoderConfig:
    batch: int
    seq: int = 128
    vocab: int = 30522
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    ffn: int = 3072
    max_positions: int = 512
    num_classes: int = 2
    dropout: float = 0.1


class EncoderLayer(nn.Module):
    """Post-LayerNorm encoder layer (BERT): x = LN(x + drop(attn(x))); x = LN(x + drop(mlp(x)))."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(cfg.hidden, cfg.heads, cfg.dropout, causal=False)
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, cfg.ffn)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.ln1(x + self.drop(self.attn(x, mask)))
        return self.ln2(x + self.drop(self.mlp(x)))


class TransformerEncoder(nn.Module):
    """BERT-like encoder with a sequence classifier on the first token.

    ``forward(input_ids, attention_mask=None)`` takes keyword tensors and returns a dict
    ``{"logits": (B, num_classes), "last_hidden_state": (B, S, hidden)}``.
    ``attention_mask`` is bool ``(B, S)``, True for real tokens; padded keys are not attended to.
    """

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.ln = nn.LayerNorm(cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers))
        self.pooler = nn.Sequential(nn.Linear(cfg.hidden, cfg.hidden), nn.Tanh())
        self.classifier = nn.Sequential(nn.Dropout(cfg.dropout), nn.Linear(cfg.hidden, cfg.num_classes))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.ln(self.tok(input_ids) + self.pos(positions)))
        # (B, S) -> (B, 1, 1, S): broadcast over heads and queries.
        mask = None if attention_mask is None else attention_mask[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        logits = self.classifier(self.pooler(x[:, 0]))
        return {"logits": logits, "last_hidden_state": x}


@dataclass(frozen=True)
class GPTConfig:
    batch: int
    seq: int = 1024
    vocab: int = 50257
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    max_positions: int = 1024
    dropout: float = 0.1


class GPTBlock(nn.Module):
    """Pre-LayerNorm decoder block (GPT-2): x += drop(attn(LN(x))); x += drop(mlp(LN(x)))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = SelfAttention(cfg.hidden, cfg.heads, cfg.dropout, causal=True)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, 4 * cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """GPT-2-like causal language model; the output projection shares the token embedding's weight.

    ``forward(input_ids, targets=None)`` returns ``(logits, loss)``; ``loss`` is the next-token
    cross-entropy against ``targets`` (None without targets).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.lm_head.weight = self.tok.weight  # tied: one parameter, gradients from both uses

    def forward(
        self, input_ids: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.tok(input_ids) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def _resnet_sizes(name: str, paper_batch: int) -> dict[str, ResNetConfig]:
    blocks = _RESNET_BLOCKS[name]
    return {
        "tiny": ResNetConfig(batch=2, blocks=blocks, image=32, width=4, num_classes=10),
        "small": ResNetConfig(batch=8, blocks=blocks, image=64, width=16, num_classes=100),
        "bench": ResNetConfig(batch=16, blocks=blocks, image=112, width=32, num_classes=100),
        "paper": ResNetConfig(batch=paper_batch, blocks=blocks),
    }


# Paper batches: Checkmate's common settings for VGG-16 (256), MobileNet (512) and U-Net (32);
# ResNet-50 at 64 (a single-GPU setting; Checkmate used 256); ResNet-101/152 and the transformer
# near the middle of STR's sweeps (70-140, 40-90, 210-290). GPT-2 small: 8 x 1024 tokens.
_CONFIGS: dict[str, dict[str, Any]] = {
    "vgg16": {
        "tiny": VGGConfig(batch=2, image=32, width=4, hidden=32, num_classes=10),
        "small": VGGConfig(batch=8, image=64, width=16, hidden=256, num_classes=100),
        "bench": VGGConfig(batch=32, image=64, width=32, hidden=512, num_classes=100),
        "paper": VGGConfig(batch=256),
    },
    "resnet50": _resnet_sizes("resnet50", 64),
    "resnet101": _resnet_sizes("resnet101", 96),
    "resnet152": _resnet_sizes("resnet152", 64),
    "mobilenet": {
        "tiny": MobileNetConfig(batch=2, image=32, width_mult=0.25, num_classes=10),
        "small": MobileNetConfig(batch=16, image=64, width_mult=0.5, num_classes=100),
        "bench": MobileNetConfig(batch=32, image=128, width_mult=1.0, num_classes=100),
        "paper": MobileNetConfig(batch=512),
    },
    "unet": {
        "tiny": UNetConfig(batch=2, image=32, width=4),
        "small": UNetConfig(batch=8, image=64, width=16),
        "bench": UNetConfig(batch=4, image=128, width=32),
        "paper": UNetConfig(batch=32),
    },
    "transformer": {
        "tiny": EncoderConfig(batch=2, seq=16, vocab=256, hidden=32, layers=2, heads=2, ffn=64,
                              max_positions=32),
        "small": EncoderConfig(batch=8, seq=64, vocab=2048, hidden=128, layers=4, heads=4, ffn=512,
                               max_positions=64),
        "bench": EncoderConfig(batch=16, seq=128, vocab=8192, hidden=256, layers=6, heads=4, ffn=1024,
                               max_positions=128),
        "paper": EncoderConfig(batch=256),
    },
    "gpt": {
        "tiny": GPTConfig(batch=2, seq=16, vocab=256, hidden=32, layers=2, heads=2, max_positions=16),
        "small": GPTConfig(batch=8, seq=64, vocab=2048, hidden=128, layers=4, heads=4, max_positions=64),
        "bench": GPTConfig(batch=8, seq=128, vocab=8192, hidden=256, layers=6, heads=4, max_positions=128),
        "paper": GPTConfig(batch=8),
    },
}


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


class _InputMaker:
    """Makes deterministic inputs: drawn on the CPU from a seeded generator, then moved.

    Drawing on the CPU keeps the values identical on every device; on meta only shapes exist.
    """

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.meta = device.type == "meta"
        self.gen = torch.Generator().manual_seed(seed)

    def floats(self, *shape: int) -> torch.Tensor:
        if self.meta:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        return torch.randn(shape, generator=self.gen).to(self.device, self.dtype)

    def ints(self, high: int, *shape: int) -> torch.Tensor:
        if self.meta:
            return torch.empty(shape, dtype=torch.long, device=self.device)
        return torch.randint(high, shape, generator=self.gen).to(self.device)

    def padding_mask(self, batch: int, seq: int) -> torch.Tensor:
        """Bool (B, S), True for real tokens: each row keeps a random length in [seq/2, seq]."""
        if self.meta:
            return torch.empty((batch, seq), dtype=torch.bool, device=self.device)
        lengths = torch.randint(max(1, seq // 2), seq + 1, (batch, 1), generator=self.gen)
        return (torch.arange(seq)[None, :] < lengths).to(self.device)


# --------------------------------------------------------------------------------------------
# Builders: config -> (model, inputs, loss_fn, description)
# --------------------------------------------------------------------------------------------


# What each builder returns: model, inputs, loss_fn, description.
_Built = tuple[nn.Module, Any, Callable[[Any], torch.Tensor], str]


def _image_classifier(
    model: nn.Module, cfg: Any, make: _InputMaker
) -> tuple[nn.Module, Any, Callable[[Any], torch.Tensor]]:
    images = make.floats(cfg.batch, cfg.in_channels, cfg.image, cfg.image)
    labels = make.ints(cfg.num_classes, cfg.batch)
    return model, images, CrossEntropy(labels)


def _build_vgg16(cfg: VGGConfig, make: _InputMaker) -> _Built:
    desc = f"VGG-16, width {cfg.width}, fc {cfg.hidden}, dropout {cfg.dropout}"
    return (*_image_classifier(VGG16(cfg), cfg, make), desc)


def _build_resnet(cfg: ResNetConfig, make: _InputMaker) -> _Built:
    depth = 2 + 3 * sum(cfg.blocks)
    desc = f"ResNet-{depth} (bottleneck, blocks {list(cfg.blocks)}), width {cfg.width}"
    return (*_image_classifier(ResNet(cfg), cfg, make), desc)


def _build_mobilenet(cfg: MobileNetConfig, make: _InputMaker) -> _Built:
    desc = f"MobileNetV2, width x{cfg.width_mult}, dropout {cfg.dropout}"
    return (*_image_classifier(MobileNetV2(cfg), cfg, make), desc)


def _build_unet(cfg: UNetConfig, make: _InputMaker) -> _Built:
    images = make.floats(cfg.batch, cfg.in_channels, cfg.image, cfg.image)
    masks = make.ints(cfg.num_classes, cfg.batch, cfg.image, cfg.image)
    desc = f"U-Net, {cfg.depth} levels, width {cfg.width}, per-pixel {cfg.num_classes}-class cross-entropy"
    return UNet(cfg), images, CrossEntropy(masks), desc


def _build_transformer(cfg: EncoderConfig, make: _InputMaker) -> _Built:
    if cfg.seq > cfg.max_positions:
        raise ValueError(f"transformer: seq {cfg.seq} exceeds max_positions {cfg.max_positions}")
    inputs = {
        "input_ids": make.ints(cfg.vocab, cfg.batch, cfg.seq),
        "attention_mask": make.padding_mask(cfg.batch, cfg.seq),
    }
    labels = make.ints(cfg.num_classes, cfg.batch)
    desc = (
        f"Transformer encoder (BERT-like), {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, "
        f"vocab {cfg.vocab}, dropout {cfg.dropout}; keyword inputs, dict output, [CLS] classification"
    )
    return TransformerEncoder(cfg), inputs, CrossEntropy(labels, key="logits"), desc


def _build_gpt(cfg: GPTConfig, make: _InputMaker) -> _Built:
    if cfg.seq > cfg.max_positions:
        raise ValueError(f"gpt: seq {cfg.seq} exceeds max_positions {cfg.max_positions}")
    if make.meta:
        ids, targets = make.ints(cfg.vocab, cfg.batch, cfg.seq), make.ints(cfg.vocab, cfg.batch, cfg.seq)
    else:
        # Targets are the inputs shifted by one, as in real language-model training.
        tokens = make.ints(cfg.vocab, cfg.batch, cfg.seq + 1)
        ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    desc = (
        f"GPT (GPT-2-like decoder), {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, "
        f"vocab {cfg.vocab}, tied embeddings, dropout {cfg.dropout}; tuple inputs, loss inside the model"
    )
    return GPT(cfg), (ids, targets), Select(1), desc


_BUILDERS: dict[str, Callable[[Any, _InputMaker], _Built]] = {
    "vgg16": _build_vgg16,
    "resnet50": _build_resnet,
    "resnet101": _build_resnet,
    "resnet152": _build_resnet,
    "mobilenet": _build_mobilenet,
    "unet": _build_unet,
    "transformer": _build_transformer,
    "gpt": _build_gpt,
}


def _input_shape(cfg: Any) -> str:
    """Human-readable input shape of one configuration (for descriptions and the size table)."""
    if hasattr(cfg, "image"):
        return f"{cfg.batch}x{cfg.in_channels}x{cfg.image}x{cfg.image}"
    return f"{cfg.batch}x{cfg.seq} tokens"


def config(name: str, size: str = "small", *, batch: int | None = None) -> Any:
    """The configuration ``build`` would use (a frozen dataclass), without building anything."""
    if name not in _CONFIGS:
        raise ValueError(f"unknown model {name!r}; accepted: {', '.join(MODELS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; accepted: {', '.join(SIZES)}")
    cfg = _CONFIGS[name][size]
    if batch is not None:
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        cfg = replace(cfg, batch=batch)
    return cfg


def build(
    name: str,
    size: str = "small",
    *,
    batch: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> ZooEntry:
    """Builds model ``name`` at ``size`` ("tiny", "small", "bench", "paper") in training mode.

    ``batch`` overrides the size's batch. On ``device="meta"`` nothing is allocated or initialised
    (fast even for ResNet-152 at paper size) and the inputs are meta tensors. Elsewhere the weights
    are initialised on the CPU from ``seed``, without touching the caller's RNG state, then moved,
    so every device gets the same weights. Raises ``ValueError`` for an unknown name or size.
    """
    cfg = config(name, size, batch=batch)
    device = torch.device(device)
    make = _InputMaker(seed, device, dtype)
    if device.type == "meta":
        # Parameters are created directly on meta: init functions are no-ops there.
        with torch.device("meta"):
            model, inputs, loss_fn, desc = _BUILDERS[name](cfg, make)
    else:
        # fork_rng(devices=[]) forks only the CPU generator: init draws from it and the caller's
        # state is restored afterwards.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, inputs, loss_fn, desc = _BUILDERS[name](cfg, make)
    model = model.to(device=device, dtype=dtype).train()
    description = f"{desc}; input {_input_shape(cfg)}; {size} size"
    return ZooEntry(name, model, inputs, loss_fn, description, size=size, config=cfg)


# --------------------------------------------------------------------------------------------
# `python -m hybridmem.zoo`: the size table (and CPU timings of one training step)
# --------------------------------------------------------------------------------------------


def _format_count(n: int) -> str:
    return f"{n / 1e6:.4g} M" if n >= 10**6 else f"{n / 1e3:.4g} K"


def size_table(timed: bool = False) -> str:
    """The module docstring's table: parameters and input per model and size.

    With ``timed``, a third line per model gives one forward+backward on the CPU (after a warm-up)
    for every size but "paper"; set ``torch.set_num_threads(1)`` first to match the size targets.
    """

    rule = "  ".join(["=" * 12] + ["=" * 16] * len(SIZES))
    lines = [rule, "  ".join([f"{'model':12s}"] + [f"{s:16s}" for s in SIZES]).rstrip(), rule]
    for name in MODELS:
        params, shapes, times = [], [], []
        for size in SIZES:
            entry = build(name, size, device="meta")
            params.append(_format_count(count_parameters(entry.model)))
            shapes.append(_input_shape(entry.config))
            if timed and size != "paper":
                entry = build(name, size)
                entry.loss().backward()  # warm-up: first calls pay one-off costs
                start = time.perf_counter()
                entry.loss().backward()
                times.append(f"{time.perf_counter() - start:.3f} s")
        rows = [params, shapes] + ([times] if timed else [])
        for label, row in zip([name, "", ""], rows):
            lines.append("  ".join([f"{label:12s}"] + [f"{c:16s}" for c in row]).rstrip())
    lines.append(rule)
    return "\n".join(lines)


def _main() -> None:
    parser = argparse.ArgumentParser(description="Print the zoo's size table.")
    parser.add_argument("--time", action="store_true", help="time forward+backward on one CPU thread")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(size_table(timed=args.time))


if __name__ == "__main__":
    _main()
