"""Small hand-made graphs shared by tests."""
from __future__ import annotations

import torch

from hybridmem.graph.ir import Graph, Stage, TensorInfo, link_consumers
from hybridmem.runtime.entry import Entry
from hybridmem.plugins.codecs import bits_dtype


def chain_graph(n_forward: int = 4, nbytes: int = 100, cost: float = 1e-3, param_bytes: int = 10) -> Graph:
    """A linear chain: forward stages f_i produce a_i from a_{i-1}; backward stages read a_i in reverse.

    Tensor 0 is a parameter; a_0..a_{n-1} are activations saved for the backward pass; each backward
    stage produces a gradient that lives until the next backward stage.
    """
    tensors = [TensorInfo(id=0, nbytes=param_bytes, kind="param", producer=-1, name="w")]
    stages: list[Stage] = []
    prev = 0
    for i in range(n_forward):
        tid = len(tensors)
        tensors.append(TensorInfo(id=tid, nbytes=nbytes, producer=i, saved=True, name=f"a{i}"))
        stages.append(Stage(index=i, id=f"forward/l{i}/aten.mm#0", op="aten.mm", module=f"l{i}",
                            cost_s=cost, inputs=[prev, 0] if prev else [0], outputs=[tid]))
        prev = tid
    grad = None
    for k in range(n_forward):
        i = n_forward - 1 - k
        idx = n_forward + k
        tid = len(tensors)
        tensors.append(TensorInfo(id=tid, nbytes=nbytes, kind="grad", producer=idx, name=f"g{i}"))
        ins = [1 + i] + ([grad] if grad is not None else [])
        stages.append(Stage(index=idx, id=f"backward/l{i}/aten.mm#0", op="aten.mm", module=f"l{i}",
                            phase="backward", cost_s=2 * cost, inputs=ins, outputs=[tid]))
        tensors[1 + i].freed_after = idx
        if grad is not None:
            tensors[grad].freed_after = idx
        grad = tid
    link_consumers(stages, tensors)
    return Graph(stages, tensors, {"model": "chain"}).validate()


def entry_of(t: torch.Tensor) -> Entry:
    return Entry(tensor=t, nbytes=t.untyped_storage().nbytes(), dtype=t.dtype, device=t.device)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and bit patterns (torch.equal alone says -0.0 == 0.0 and NaN != NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    bd = bits_dtype(a.dtype)
    return torch.equal(a.contiguous().view(bd), b.contiguous().view(bd))
