"""Train a small GPT-2 with the Hugging Face Trainer; hybridmem needs no change to the script.

    python examples/hf_trainer.py                                   # unmanaged
    HYBRIDMEM_BUDGET=10MiB HYBRIDMEM_DEVICE=cpu python examples/hf_trainer.py   # evicts to fit
    HYBRIDMEM_BUDGET=10MiB HYBRIDMEM_DEVICE=cpu python examples/hf_trainer.py --gradient-checkpointing

The model is built from a config (no download) and trained on random tokens made from a seed. The last
line printed is JSON: the loss of every step, a hash of the trained parameters, and (when hybridmem is
enabled) its peak and evicted bytes, so that runs can be compared bit for bit.
"""
from __future__ import annotations

import argparse
import json
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from common import summary  # examples/common.py, beside this script


class RandomTokens(torch.utils.data.Dataset):
    """``n`` sequences of random token ids (the labels are the inputs: causal language modelling)."""

    def __init__(self, n: int, length: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001 (the Trainer's signature)
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--gradient-checkpointing", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    losses = Losses()
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=8,
                                  learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                                  use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True,
                                  gradient_checkpointing=args.gradient_checkpointing)
        trainer = Trainer(model=model, args=targs, train_dataset=RandomTokens(64, 64, config.vocab_size),
                          callbacks=[losses])
        trainer.train()
    print(json.dumps(summary(model, losses.losses)))


if __name__ == "__main__":
    main()
