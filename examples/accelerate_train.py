"""Fine-tune a small Llama-style decoder with Hugging Face Accelerate; hybridmem needs no change to the script.

    python examples/accelerate_train.py                                             # unmanaged
    HYBRIDMEM_BUDGET=24MiB HYBRIDMEM_DEVICE=cpu python examples/accelerate_train.py     # under a budget

The ``Accelerator`` loop: ``accelerator.prepare`` on the model, optimizer and data loader,
``accelerator.accumulate`` over 2 micro-batches, ``accelerator.backward``, and bf16 mixed precision where the
machine supports it (``--no-bf16`` turns it off; on the CPU Accelerate runs torch's bf16 autocast). The
model is a ``LlamaConfig`` decoder (grouped-query attention) built from the config, trained on random token
sequences of varied lengths padded per batch by ``DataCollatorWithPadding``. Under a budget it prints
hybridmem's summary; the last line printed is JSON (losses, a hash of the parameters, hybridmem's figures) to
compare runs bit for bit.
"""
from __future__ import annotations

import argparse
import json

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

from common import PadWithLabels, VariableTokens, bf16_supported, print_hybridmem, summary  # beside this script

ACCUM = 2  # micro-batches per optimizer step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="optimizer steps")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lengths", default="24-64", help="shortest-longest sequence, in tokens")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 mixed precision (default: where the machine supports it)")
    args = p.parse_args()
    lo, hi = (int(x) for x in args.lengths.split("-"))
    cpu = not torch.cuda.is_available()
    bf16 = bf16_supported("cpu" if cpu else "cuda") if args.bf16 is None else args.bf16
    accelerator = Accelerator(cpu=cpu, mixed_precision="bf16" if bf16 else "no", gradient_accumulation_steps=ACCUM)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=hi + 8,
                         bos_token_id=1, eos_token_id=1, pad_token_id=0, use_cache=False)
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    data = VariableTokens(4 * ACCUM * args.steps, lo, hi, vocab=config.vocab_size)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=g,
                                         collate_fn=PadWithLabels(config.vocab_size))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    model.train()
    losses: list[float] = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            opt.step()       # Accelerate steps (and zeroes) only at the last micro-batch of each step
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    print_hybridmem()
    print(json.dumps(summary(accelerator.unwrap_model(model), losses)))


if __name__ == "__main__":
    main()
