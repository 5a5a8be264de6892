"""Helpers shared by tests: small hand-made graphs, entries and bit-exact comparison. Import them as
``from tests.helpers import ...`` (``tests.helpers.runtime``: running models under the runtime;
``tests.helpers.plans``: exhaustive search; ``tests.helpers.zoo``: the zoo cases)."""
from __future__ import annotations

import torch

from hybridmem.graph.ir import Graph, Stage, TensorInfo, link_consumers
from hybridmem.graph.plan import Action, Plan
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


def make_graph(stages: list[tuple[float, list[int], list[int]]],
               tensors: list[tuple[int, int, int | None]], *, kinds: dict[int, str] | None = None,
               workspace: dict[int, int] | None = None, nondeterministic: tuple[int, ...] = (),
               writes: dict[int, list[int]] | None = None) -> Graph:
    """stages: (cost_s, inputs, outputs); tensors: (nbytes, producer, freed_after); writes: stage -> tensors
    it writes in place."""
    kinds, workspace, writes = kinds or {}, workspace or {}, writes or {}
    ts = [TensorInfo(i, nb, producer=p, freed_after=f, kind=kinds.get(i, "activation" if p >= 0 else "input"),
                     name=f"t{i}") for i, (nb, p, f) in enumerate(tensors)]
    ss = [Stage(i, f"forward/m/op#{i}", "aten.op", cost_s=c, inputs=list(ins), outputs=list(outs),
                workspace=workspace.get(i, 0), deterministic=i not in nondeterministic, writes=writes.get(i, []))
          for i, (c, ins, outs) in enumerate(stages)]
    link_consumers(ss, ts)
    return Graph(ss, ts).validate()


def A(kind: str, tensor: int, stage: int, **kw) -> Action:
    return Action(kind, tensor, stage, **kw)


def big_graph(n: int = 1000) -> tuple[Graph, Plan]:
    """A 1000-stage graph: forward half makes activations, backward half reads them in reverse."""
    half = n // 2
    tensors = [(1 << 20, -1, None)]
    stages: list[tuple[float, list[int], list[int]]] = []
    for i in range(half):
        tensors.append((1 << 20, i, n - 1 - i))
        stages.append((1e-3, [i], [i + 1]))
    grad = 0
    for j in range(half):
        i = half + j
        act = half - j  # tensor made at stage half-1-j, read at stage i
        tensors.append((1 << 16, i, i + 1 if i + 1 < n else None))
        stages.append((1e-3, [act] + ([grad] if grad else []), [len(tensors) - 1]))
        grad = len(tensors) - 1
    g = make_graph(stages, tensors)
    actions = []
    for k in range(1, half - 1):   # activation k: made at stage k-1, read at k and at n-k; swap or recompute
        reader = n - k
        if k % 2:
            actions += [A("swap_out", k, k - 1), A("free", k, k), A("swap_in", k, reader - 1)]
        else:   # the replay's input k-1 is swapped in at the start of the same stage
            actions += [A("free", k, k), A("recompute", k, reader)]
    return g, Plan(actions=actions)
