"""Recompute: drop a saved activation and rebuild it by replaying the ops that produced it.

The runtime records each activation storage's lineage during the forward pass (its producing op,
then the in-place ops that wrote it; see :mod:`hybridmem.runtime.lineage`). Regeneration replays that
lineage under ``no_grad``: inputs come from live storages, from host checkpoints or compressed copies
of other policies, or are recomputed themselves (chains, iteratively). Results are bit-identical:
same kernels on the same inputs, RNG ops replayed from the RNG state saved before them (dropout
masks match), and arguments an op writes besides the target (BatchNorm running statistics) replaced
by private copies, so no side effect is applied twice.

Not applicable (another policy is used instead) when the lineage was not recorded, when an op on the
chain is non-deterministic (``_trace.CUDA_NONDETERMINISTIC`` on CUDA without
``torch.use_deterministic_algorithms``) or not an aten op, or when an input was modified in place
since it was recorded.
"""
from __future__ import annotations

from typing import Any

import torch

from hybridmem.plugins.base import EntryView, PolicyHints


class RecomputePolicy:
    """The ``recompute`` policy; bound to a runtime, whose recorded lineage it replays."""

    name = "recompute"
    lossless = True
    # metered: its regeneration runs ordinary ops, which the dispatch mode meters and caps one by one (in a
    # steady-state step the native allocator device caps them: runtime.dispatch_mode.metered). dynamic_cost: the
    # chain a recomputation triggers changes as other entries are evicted.
    hints = PolicyHints(metered=True, dynamic_cost=True)

    def __init__(self, **options: Any):
        if options:
            raise ValueError(f"recompute takes no options, got {sorted(options)}")
        self.replayer: Any = None

    def bind(self, runtime: Any) -> None:
        """Called by the runtime after creating the policy: where lineage lives."""
        self.replayer = runtime.replayer

    def why_not(self, entry: EntryView) -> str:
        """"" if applicable, else the reason (for diagnostics)."""
        node = entry.lineage
        if self.replayer is None:
            return "no runtime recording lineage"
        if node is None:
            return "no lineage recorded for this tensor"
        if node.stale:
            return "written by an unrecorded op"
        return self.replayer.why_not(node, len(node.ops))

    def applicable(self, entry: EntryView) -> bool:
        node = entry.lineage
        return (self.replayer is not None and node is not None and not node.stale
                and not self.replayer.why_not(node, len(node.ops)))

    def cost(self, entry: EntryView) -> float:
        node = entry.lineage
        return self.replayer.cost(node, len(node.ops), {})

    def registration_cost(self, entry: EntryView) -> float | None:
        """``cost(entry)`` where ``applicable(entry)``, else None: one pass over the lineage (the runtime asks
        for every new entry near the budget, to order the allocator's registry)."""
        node = entry.lineage
        if self.replayer is None or node is None:
            return None
        return self.replayer.registration_cost(node)

    def savings(self, entry: EntryView) -> int:
        return entry.nbytes

    def evict(self, entry: EntryView) -> int:
        return len(entry.lineage.ops)  # the version to rebuild; the runtime drops the bytes

    def prefetch(self, entry: EntryView) -> None:
        return None  # recomputation runs on the compute stream: nothing to start ahead

    def regenerate(self, entry: EntryView) -> torch.Tensor:
        return self.replayer.materialize(entry.lineage, entry.handle)
