"""Train a small model with PyTorch Lightning; hybridmem needs no change to the script.

    python examples/lightning_train.py                                   # unmanaged
    HYBRIDMEM_BUDGET=4MiB HYBRIDMEM_DEVICE=cpu python examples/lightning_train.py   # evicts to fit

The model is an MLP with dropout trained on random data made from a seed. The last line printed is
JSON: the loss of every step, a hash of the trained parameters, and (when hybridmem is enabled) its
peak and evicted bytes, so that runs can be compared bit for bit.
"""
from __future__ import annotations

import argparse
import json

import lightning as L
import torch
from torch import nn

from common import summary  # examples/common.py, beside this script


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 256), nn.Tanh(),
                                 nn.Linear(256, 1))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 64, generator=g)
    data = torch.utils.data.TensorDataset(x, x[:, :1].sin())
    loader = torch.utils.data.DataLoader(data, batch_size=512, shuffle=True, generator=g)
    model = Regressor()
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        deterministic=True)
    trainer.fit(model, loader)
    print(json.dumps(summary(model, model.losses)))


if __name__ == "__main__":
    main()
