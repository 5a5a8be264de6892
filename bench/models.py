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


class _CausalLMLoss(nn.Module):
    """A Hugging Face causal language model whose forward returns the loss of the next token
    (``model(input_ids=ids, labels=ids).loss``), as a training loop calls it."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


def hf_gpt2(layers: int = 2, width: int = 128, heads: int = 2, vocab: int = 50257, seq: int = 1024,
            batch: int = 1, dropout: float = 0.1) -> dict[str, Any]:
    """Hugging Face's ``GPT2LMHeadModel`` from a ``GPT2Config`` (nothing downloaded), ``use_cache=False``, its loss
    computed by the model from the labels. The defaults keep GPT-2's vocabulary and sequence (the loss region,
    which Dynamo compiles apart after a graph break, holds logits of ``batch x 1024 x 50,257``) with 2 layers
    128 wide, so that it compiles in seconds on a CPU; ``hf_gpt2_small`` is GPT-2 small (12 x 768). ``dropout``:
    GPT-2's (0.1) on the embeddings, attention and residuals; attention's is drawn inside the attention kernel,
    which no lossless plan recomputes."""
    from transformers import GPT2Config, GPT2LMHeadModel   # an optional dependency: only this model needs it

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=vocab, n_positions=seq, use_cache=False,
                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    model = _CausalLMLoss(GPT2LMHeadModel(cfg))
    ids = torch.randint(0, vocab, (batch, seq))
    return dict(model=model, inputs=ids, loss_fn=lambda loss: loss)


def hf_gpt2_small(batch: int = 8) -> dict[str, Any]:
    """GPT-2 small (12 layers, 768 wide, 12 heads), sequence 1024: the GPU benchmark's size."""
    return hf_gpt2(layers=12, width=768, heads=12, batch=batch)
