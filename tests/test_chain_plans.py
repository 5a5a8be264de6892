"""Plans whose recomputes rebuild forward temporaries first (``plan(..., trace_sources=True)``).

In a transformer block most saved tensors are made from values nothing saves (a layer norm's output
that only the next matrix product reads, an attention's scores before the softmax): a recompute that
may only replay the producer has no source left in the backward, and recompute-only planners found no
plan far below the peak. With ``trace_sources`` a recompute replays the chain back to what the plan
keeps (``Graph.replay_stages``), the simulator charges it, and the runtime's lineage replays it.

The model is a small pre-LayerNorm GPT-style decoder built here from a config (not a zoo model). Its
plans are followed for 5 steps and compared with an unmanaged run bit for bit (losses, gradients,
buffers, the RNG state at the end).
"""
from __future__ import annotations

import copy
import gc
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import hybridmem
from hybridmem.errors import BudgetInfeasibleError
from hybridmem.native import cpumeter
from tests.helpers.runtime import Case, train

pytestmark = pytest.mark.skipif(cpumeter.load() is None,
                                reason=f"native allocator device unavailable: {cpumeter.unavailable_reason()}")

STEPS = 5


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 256
    width: int = 64
    heads: int = 4
    layers: int = 3
    seq: int = 32
    batch: int = 4


class Block(nn.Module):
    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln1, self.ln2 = nn.LayerNorm(c.width), nn.LayerNorm(c.width)
        self.qkv, self.proj = nn.Linear(c.width, 3 * c.width), nn.Linear(c.width, c.width)
        self.mlp = nn.Sequential(nn.Linear(c.width, 4 * c.width), nn.GELU(), nn.Linear(4 * c.width, c.width))
        self.register_buffer("mask", torch.tril(torch.ones(c.seq, c.seq, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=-1)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(w // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, w)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(c.vocab, c.width), nn.Embedding(c.seq, c.width)
        self.blocks = nn.Sequential(*[Block(c) for _ in range(c.layers)])
        self.ln, self.head = nn.LayerNorm(c.width), nn.Linear(c.width, c.vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.head(self.ln(self.blocks(x)))


@pytest.fixture(scope="module")
def captured() -> tuple[Case, Any, list]:
    from hybridmem.graph.capture import capture
    from hybridmem.graph.costs import apply_costs, get_cost_model

    c = DecoderConfig()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Decoder(c)
        ids = torch.randint(0, c.vocab, (c.batch, c.seq))
        targets = torch.randint(0, c.vocab, (c.batch, c.seq))
    case = Case("decoder", model, (ids,), {},
                lambda out: nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten()))
    g = apply_costs(capture(copy.deepcopy(model), (ids,), case.loss_fn, device="cpu"), get_cost_model("cpu"))
    reference = train(case, copy.deepcopy(model), STEPS, "sgd-plain")
    return case, g, reference


def _checkmate(g: Any, budget: int, **options: Any) -> Any:
    from hybridmem.solvers import plan

    return plan(g, budget, device="cpu", solver="checkmate", time_limit=30, **options)


def test_recompute_only_plans_far_below_the_peak_exist_only_with_chains(captured: tuple) -> None:
    _, g, _ = captured
    budget = int(0.62 * g.peak_bytes())
    with pytest.raises(BudgetInfeasibleError):
        _checkmate(g, budget)
    p = _checkmate(g, budget, trace_sources=True)
    assert p.predicted_peak_bytes <= budget and all(a.kind in ("free", "recompute") for a in p.actions)
    # some of its recomputes replay a chain: stages before the producer that rebuild a gone temporary
    chains = [a for a in p.actions if a.kind == "recompute"
              and g.replay_stages(a.tensor, a.stage)[0] < g.tensors[a.tensor].producer]
    assert chains, "no recompute of the plan replays a chain"
    # the plan is a plan of the graph as captured: the simulator (which always traces) accepts it
    from hybridmem.graph.simulate import simulate
    assert simulate(g, p, "cpu", budget=budget).peak_bytes <= budget


def test_a_plan_with_chains_is_followed_bit_identical_within_its_budget(captured: tuple) -> None:
    case, g, reference = captured
    p = _checkmate(g, int(0.62 * g.peak_bytes()), trace_sources=True)
    model = copy.deepcopy(case.model)
    gc.collect()  # the budget counts every live allocation of the process: earlier tests' cycles too
    with hybridmem.session(plan=p, device="cpu", policies=("recompute",)) as s:
        got = train(case, model, STEPS, "sgd-plain")
    stats = s.stats()
    for i, (a, b) in enumerate(zip(got, reference)):
        assert a == b, f"step {i} (loss, gradients, buffers or the RNG state) differs from unmanaged"
    assert stats.plan == "following", stats.plan_note
    assert stats.peak_bytes <= p.budget_bytes, (stats.peak_bytes, p.budget_bytes)
    assert stats.policies["recompute"].regenerated > 0
    assert stats.steady_steps == STEPS - 2, stats.notes
