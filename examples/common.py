"""What the examples share: variable-length token data padded per batch, and what they print last (hybridmem's
summary, then one JSON line to compare runs by: losses, parameters, hybridmem's figures)."""
from __future__ import annotations

import hashlib
from typing import Any

import torch


def summary(model: torch.nn.Module, losses: list[float]) -> dict:
    """Losses, a hash of the parameters' bytes, and hybridmem's figures when it is enabled."""
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    out: dict = {"losses": losses, "params": h.hexdigest()[:16]}
    import hybridmem  # enabled by HYBRIDMEM_BUDGET at `import torch`, by the script, or not at all

    if hybridmem.enabled():
        st = hybridmem.stats()
        out["hybridmem"] = {"budget": st.budget_bytes, "peak": st.peak_bytes, "saved": st.saved_bytes,
                            "evicted": st.evicted_bytes, "steps": st.steps, "steady": st.steady_steps,
                            "within": st.budget_bytes is None or st.peak_bytes <= st.budget_bytes}
    return out


def print_hybridmem() -> None:
    """What hybridmem saved and what it cost: the summary ``hybridmem run`` prints at exit."""
    import hybridmem

    if hybridmem.enabled():
        from hybridmem.cli import run_summary  # the CLI module: only when there is something to print

        print(run_summary(hybridmem.stats()))


def tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over ``vocab`` ids built in memory (nothing downloaded); id 0 pads. The
    collators need one to pad with."""
    from tokenizers import Tokenizer, models  # Hugging Face's; only the examples that pad need it
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0")


class VariableTokens(torch.utils.data.Dataset):
    """``n`` sequences of random token ids (1 to ``vocab - 1``), each ``lo`` to ``hi`` tokens long, from a seed."""

    def __init__(self, n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
        self.ids = [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.ids[i]}


class PadWithLabels:
    """``DataCollatorWithPadding`` (each batch padded to its longest sequence, rounded up to 8, with an
    attention mask), and labels for causal language modelling: the inputs, -100 where padded."""

    def __init__(self, vocab: int) -> None:
        from transformers import DataCollatorWithPadding  # the Hugging Face examples only

        self.pad = DataCollatorWithPadding(tokenizer(vocab), pad_to_multiple_of=8, return_tensors="pt")

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.pad(features)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch


def bf16_supported(device: str) -> bool:
    """Whether bf16 autocast is worth turning on here: a CUDA device that has bf16, or any CPU (torch's CPU
    autocast runs bf16 everywhere, fast where the CPU has bf16 instructions)."""
    if device.startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    return True
