"""Models the benchmarks use beside the zoo, as ``MODULE:FACTORY`` factories (:mod:`hybridmem.factory`)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def relu_mlp() -> dict[str, Any]:
    """Six 256-wide ReLU layers on a batch of 2048: its saved activations, ReLU outputs about half zeros,
    are most of its step's memory, and recomputing one replays a matrix product."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.ReLU())], nn.Linear(256, 10))
    return dict(model=model, inputs=torch.randn(2048, 256), targets=torch.randint(0, 10, (2048,)),
                loss_fn=nn.CrossEntropyLoss())
