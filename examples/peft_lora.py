"""Fine-tune a small Llama-style decoder with a peft LoRA, in a plain loop, under a hybridmem budget.

    python examples/peft_lora.py                       # unmanaged
    python examples/peft_lora.py --budget none         # hybridmem measuring only: its summary names the range
    python examples/peft_lora.py --budget 12MiB        # hybridmem.enable(budget="12MiB"): never holds more

The model is a ``LlamaConfig`` decoder with grouped-query attention, built from the config (no download),
with a LoRA of rank 8 on the attention's q, k, v and o projections (only those train). The loop is the one a
fine-tuning script writes: batches of random token sequences of varied lengths padded per batch by
``DataCollatorWithPadding``, gradient accumulation over 2 micro-batches, bf16 autocast around the forward
where the machine supports it (``--no-bf16`` turns it off), AdamW. Under hybridmem it prints its summary
(what it evicted and what that cost); the last line printed is JSON: the losses, a hash of the parameters
and hybridmem's figures, so that runs can be compared bit for bit.
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import hybridmem
from common import PadWithLabels, VariableTokens, bf16_supported, print_hybridmem, summary  # beside this script

ACCUM = 2  # micro-batches per optimizer step


def model_with_lora(layers: int, positions: int) -> torch.nn.Module:
    """A Llama-style decoder from its config (4 query heads sharing 2 key-value heads) with a LoRA on
    q, k, v, o; seeded."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                         bos_token_id=1, eos_token_id=1, pad_token_id=0, use_cache=False)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")
    return get_peft_model(LlamaForCausalLM(config), lora)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", default=None, help='bytes with a unit ("12MiB"), "none" to measure only; '
                   "left out: hybridmem is not enabled")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lengths", default="24-64", help="shortest-longest sequence, in tokens")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast (default: where the machine supports it)")
    args = p.parse_args()
    lo, hi = (int(x) for x in args.lengths.split("-"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = bf16_supported(device) if args.bf16 is None else args.bf16
    model = model_with_lora(args.layers, hi + 8).to(device)
    model.train()
    g = torch.Generator().manual_seed(0)
    data = VariableTokens(4 * ACCUM * args.steps, lo, hi, vocab=256)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=g, collate_fn=PadWithLabels(256))
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    if args.budget is not None:
        hybridmem.enable(budget=None if args.budget == "none" else args.budget)
    losses: list[float] = []
    for i, batch in enumerate(loader):
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast():
            loss = model(**batch).loss / ACCUM
        loss.backward()
        losses.append(loss.item())
        if (i + 1) % ACCUM == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    print_hybridmem()
    print(json.dumps(summary(model, losses)))


if __name__ == "__main__":
    main()
