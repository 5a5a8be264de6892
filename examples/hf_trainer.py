"""Fine-tune a small GPT-2 with the Hugging Face Trainer; hybridmem needs no change to the script.

    python examples/hf_trainer.py                                           # unmanaged
    HYBRIDMEM_BUDGET=24MiB HYBRIDMEM_DEVICE=cpu python examples/hf_trainer.py   # under a budget
    HYBRIDMEM_BUDGET=24MiB HYBRIDMEM_DEVICE=cpu python examples/hf_trainer.py --gradient-checkpointing

The loop a fine-tuning script runs: the model built from a config (no download), random token sequences of
varied lengths padded per batch by ``DataCollatorWithPadding`` (so every batch has a length of its own),
gradient accumulation over 2 micro-batches, and bf16 autocast where the machine supports it (``--no-bf16``
turns it off). Under a budget it prints hybridmem's summary (what it evicted and what that cost). The last
line printed is JSON: the loss of every step, a hash of the trained parameters, and (when hybridmem is
enabled) its peak and evicted bytes, so that runs can be compared bit for bit.
"""
from __future__ import annotations

import argparse
import json
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from common import PadWithLabels, VariableTokens, bf16_supported, print_hybridmem, summary  # beside this script


# the option's name: transformers 5 renamed gradient checkpointing to activation checkpointing
CHECKPOINTING = ("activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
                 else "gradient_checkpointing")


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001 (the Trainer's signature)
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="optimizer steps")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lengths", default="24-64", help="shortest-longest sequence, in tokens")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast (default: where the machine supports it)")
    args = p.parse_args()
    lo, hi = (int(x) for x in args.lengths.split("-"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = bf16_supported(device) if args.bf16 is None else args.bf16
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=hi + 8, n_embd=64, n_layer=args.layers, n_head=2,
                        bos_token_id=1, eos_token_id=1, use_cache=False)
    model = GPT2LMHeadModel(config)
    losses = Losses()
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=4,
                                  gradient_accumulation_steps=2, bf16=bf16, use_cpu=device == "cpu",
                                  learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                                  dataloader_num_workers=0, disable_tqdm=True,
                                  **{CHECKPOINTING: args.gradient_checkpointing})
        trainer = Trainer(model=model, args=targs, data_collator=PadWithLabels(config.vocab_size),
                          train_dataset=VariableTokens(8 * args.steps, lo, hi, config.vocab_size), callbacks=[losses])
        trainer.train()
    print_hybridmem()
    print(json.dumps(summary(model, losses.losses)))


if __name__ == "__main__":
    main()
