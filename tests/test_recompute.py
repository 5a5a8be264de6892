"""Recompute (and all policies) on the hard cases real models bring: bit-identical gradients, side
effects applied once, RNG replayed, in-place chains, views, concatenation, attention, tied weights."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridmem
from hybridmem.runtime.lineage import FixedRef, Recorder
from tests.helpers.runtime import Case, check_managed, run, run_feasible

torch.set_num_threads(1)


class ConvBlock(nn.Module):
    """ReLU(inplace=True) after BatchNorm, dropout, concatenation, views and reshapes, LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.25)
        self.conv2 = nn.Conv2d(16, 8, 3, padding=1, bias=False)
        self.ln = nn.LayerNorm(16)
        self.head = nn.Linear(8 * 16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = self.relu(self.bn(self.conv1(x)))
        x = torch.cat([x, self.drop(x).flip(1)], dim=1)   # concatenation of an in-place-modified tensor
        x = torch.tanh(self.conv2(x))
        x = x.permute(0, 2, 3, 1).reshape(n, 16, -1)       # a view chain, then a copy
        x = self.ln(x.transpose(1, 2)).transpose(1, 2).sigmoid() * x
        return self.head(x.reshape(n, 16, 16, 8).mean(dim=2).flatten(1))


class Attention(nn.Module):
    """Self-attention through scaled_dot_product_attention (causal, with attention dropout)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.ff(x)


class TiedLM(nn.Module):
    """Embedding whose weight is tied to the output projection, keyword inputs, dict output."""

    def __init__(self, vocab: int = 50, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(16, dim))
        self.block = Attention(dim)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, *, input_ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.emb(input_ids) + self.pos[: input_ids.shape[1]]
        h = self.block(h) * mask.unsqueeze(-1)
        return {"logits": self.out(self.norm(h)), "hidden": h}


def _lm_loss(out: dict[str, torch.Tensor]) -> torch.Tensor:
    return out["logits"].logsumexp(-1).mean() + 1e-3 * out["hidden"].square().mean()


def _cases() -> dict[str, Case]:
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (16, 16))
    mask = torch.ones(16, 16)
    mask[:, 12:] = 0
    return {
        "conv": Case("conv", ConvBlock(), (torch.randn(16, 3, 16, 16),)),
        "attention": Case("attention", Attention(), (torch.randn(16, 16, 32),)),
        "tied-lm": Case("tied-lm", TiedLM(), kwargs={"input_ids": ids, "mask": mask}, loss_fn=_lm_loss),
    }


CASES = _cases()


@pytest.mark.parametrize("optim", ["sgd", "adam"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_recompute_alone_is_bit_identical_within_budget(name: str, optim: str) -> None:
    st = check_managed(CASES[name], ("recompute",), optim=optim)
    assert st.policies["recompute"].regenerated > 0


@pytest.mark.parametrize("name", sorted(CASES))
def test_all_policies_are_bit_identical_within_budget(name: str) -> None:
    check_managed(CASES[name], ("swap", "recompute", "compress"))


def test_batchnorm_statistics_updated_once() -> None:
    case = CASES["conv"]
    ref_model, man_model = copy.deepcopy(case.model), copy.deepcopy(case.model)
    _, mon = run(case, budget=None, policies=("recompute",))
    assert mon is not None
    _, _, budget = run_feasible(case, mon.peak_bytes - int(0.4 * mon.saved_bytes), policies=("recompute",))
    for model, managed in ((ref_model, False), (man_model, True)):
        torch.manual_seed(0)
        ctx = hybridmem.session(budget=budget, policies=("recompute",), device="cpu") if managed else None
        if ctx is not None:
            s = ctx.__enter__()
        for _ in range(3):
            case.loss(model).backward()
        if ctx is not None:
            ctx.__exit__(None, None, None)
            assert s.stats().policies["recompute"].regenerated > 0
    assert man_model.bn.num_batches_tracked.item() == ref_model.bn.num_batches_tracked.item() == 3
    assert torch.equal(man_model.bn.running_mean, ref_model.bn.running_mean)
    assert torch.equal(man_model.bn.running_var, ref_model.bn.running_var)


class DeepMLP(nn.Module):
    def __init__(self, depth: int = 24) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_long_recompute_chains() -> None:
    """A tight budget on a deep chain makes recomputations start from other recomputed tensors."""
    case = Case("mlp", DeepMLP(), (torch.randn(1024, 64),))
    st = check_managed(case, ("recompute",), cut=0.75)
    assert st.policies["recompute"].regenerated >= 10


def test_explicit_generator_is_replayed_from_its_state() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64)
            self.gen = torch.Generator().manual_seed(7)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            keep = torch.bernoulli(torch.full_like(x, 0.7), generator=self.gen)
            return torch.tanh(self.lin(x * keep)) * keep

    case = Case("noisy", Noisy(), (torch.randn(512, 64),))
    check_managed(case, ("recompute",), cut=0.6)


def test_lineage_of_inplace_chain_and_refusal_after_input_change() -> None:
    """conv then relu_ is one node with two ops; a fixed input modified in place refuses recompute."""
    conv = nn.Conv2d(3, 4, 3)
    x = torch.randn(2, 3, 8, 8)
    with hybridmem.session(budget=10**9, policies=("recompute",), device="cpu"):
        rt = hybridmem.runtime.current.rt
        y = torch.relu_(conv(x))
        z = y.exp()
        slot = rt.produced.get(y.untyped_storage())
        node = slot.node
        assert [op_name(r.func) for r, _ in node.ops] == ["convolution", "relu_"]
        entry = slot.entry
        policy = rt.policies["recompute"]
        assert policy.applicable(entry)
        assert torch.equal(rt.replayer.materialize(node, 2).view_as(y), y)
        assert torch.equal(rt.replayer.materialize(node, 1).view_as(y), conv(x))  # before the relu_
        with torch.no_grad():
            conv.weight.mul_(1.0)  # a pre-existing input changes: its version counter moves
        rt.steps.steps += 1        # validity is re-checked once per step
        assert not policy.applicable(entry)
        assert "modified in place" in policy.why_not(entry)
        with pytest.raises(RuntimeError, match="modified by an in-place operation"):
            z.sum().backward()  # the convolution saved the weight too: the version check catches it


def op_name(func: object) -> str:
    return getattr(func, "_opname", str(func))


def test_fixed_refs_share_the_version_counter() -> None:
    """Recorded inside the dispatch mode: a reference to a parameter must see later in-place writes."""
    w = nn.Parameter(torch.randn(4))
    rec = Recorder(lambda st: None, lambda: True)
    ref = rec.ref(w.t() if w.dim() > 1 else w[:])
    assert isinstance(ref, FixedRef)
    before = ref.alias._version
    with torch.no_grad():
        w.add_(1)
    assert ref.alias._version == before + 1
