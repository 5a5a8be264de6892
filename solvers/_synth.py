"""Synthetic training-step graphs for tests and benchmarks (no torch needed).

``chain_graph`` builds what a capture of a small network looks like to the solvers: forward stages that
each read the previous activation (and sometimes a skip connection) and one parameter, a loss stage, then
backward stages in reverse order that read the saved activations and produce gradients. Sizes and costs
are drawn from a seeded ``numpy`` generator so a test can sweep many graphs reproducibly.
"""
from __future__ import annotations

import numpy as np

from hybridmem.graph.costs import get_cost_model
from hybridmem.graph.ir import Graph, Stage, TensorInfo, link_consumers


def chain_graph(n_forward: int, *, seed: int = 0, skip_prob: float = 0.3, saved_prob: float = 0.85,
                mb: tuple[float, float] = (1.0, 8.0), ms: tuple[float, float] = (0.05, 0.3),
                workspace_prob: float = 0.0, device: str = "h100-80gb") -> Graph:
    """A forward chain of ``n_forward`` ops (the last one is the loss) and its mirrored backward pass.

    ``mb`` is the range of activation sizes in MiB, ``ms`` the range of stage costs in milliseconds on
    ``device`` (stage FLOPs are set so that the device's cost model gives these times; ``cost_s`` too).
    Backward stage of forward op k reads k's input activation and its output (when saved), the gradient
    of its output and its parameter; it produces the gradient of its input. Gradients are freed after
    their single consumer; activations after their last backward reader.
    """
    rng = np.random.default_rng(seed)
    stages: list[Stage] = []
    tensors: list[TensorInfo] = []

    def tensor(nbytes: int, kind: str, producer: int, name: str, saved: bool = False) -> int:
        tensors.append(TensorInfo(id=len(tensors), nbytes=int(nbytes), kind=kind, producer=producer,
                                  name=name, saved=saved, shape=(int(nbytes) // 4,)))
        return len(tensors) - 1

    def mib() -> int:
        return int(rng.uniform(*mb) * 2**20) // 4 * 4

    def cost() -> float:
        return float(rng.uniform(*ms) * 1e-3)

    x = tensor(mib(), "input", -1, "input")
    params = [tensor(int(rng.integers(1, 64)) * 1024, "param", -1, f"w{k}") for k in range(n_forward)]
    acts = [x]                      # acts[k] is the input of forward op k
    op_inputs: list[list[int]] = []
    saved_out: list[bool] = []
    for k in range(n_forward):
        s = len(stages)
        ins = [acts[-1], params[k]]
        if k >= 2 and rng.random() < skip_prob:
            ins.append(acts[-2])
        last = k == n_forward - 1
        out = tensor(4 if last else mib(), "activation", s, "loss" if last else f"a{k}")
        stages.append(Stage(index=s, id=f"forward/l{k}/op#0", op="loss" if last else "op", module=f"l{k}",
                            phase="forward", cost_s=cost(), inputs=ins, outputs=[out],
                            workspace=mib() // 4 if rng.random() < workspace_prob else 0))
        op_inputs.append(ins)
        saved_out.append(not last and bool(rng.random() < saved_prob))
        acts.append(out)
    grad = None
    for k in reversed(range(n_forward)):
        s = len(stages)
        ins = [a for a in op_inputs[k] if tensors[a].kind != "param"]
        if saved_out[k]:
            ins.append(acts[k + 1])
        if grad is not None:
            ins.append(grad)
        ins.append(params[k])
        g = tensor(tensors[acts[k]].nbytes, "grad", s, f"g{k}")
        stages.append(Stage(index=s, id=f"backward/l{k}/op#0", op="op_backward", module=f"l{k}",
                            phase="backward", cost_s=2 * stages[k].cost_s, inputs=list(dict.fromkeys(ins)),
                            outputs=[g]))
        grad = g
    link_consumers(stages, tensors)
    for t in tensors:
        if t.producer >= 0:
            t.freed_after = max(t.consumers) if t.consumers else t.producer
            t.saved = t.kind == "activation" and any(stages[c].phase == "backward" for c in t.consumers)
        if t.id == grad:
            t.freed_after = None
    model = get_cost_model(device)
    rate = model.peak("float32") * model.efficiency
    for st in stages:
        st.flops = max(st.cost_s - model.launch_s, 0.0) * rate
        st.cost_s = float(model.op_time(st))
    return Graph(stages, tensors, {"model": f"chain{n_forward}-s{seed}", "synthetic": True,
                                   "cost_model": model.name}).validate()


def random_graph(n_stages: int, *, seed: int = 0, n_forward: int | None = None,
                 mb: tuple[float, float] = (1.0, 16.0), grad_mb: tuple[float, float] = (0.1, 2.0),
                 ms: tuple[float, float] = (0.02, 0.4), readers: tuple[int, int] = (1, 2),
                 saved_prob: float = 0.9, nondeterministic_prob: float = 0.0, device: str = "h100-80gb") -> Graph:
    """A random small training step: a forward chain (last op = loss) and backward stages that each read
    the previous gradient and a random set of saved forward activations (each read by ``readers`` stages).

    Saved activations dominate memory, as in real networks, so budgets between the minimum and the
    keep-all peak give the planners real choices even on 6-8 stages.
    """
    rng = np.random.default_rng(seed)
    nf = n_forward if n_forward is not None else max(2, n_stages // 2)
    nb = n_stages - nf
    stages: list[Stage] = []
    tensors: list[TensorInfo] = []

    def tensor(nbytes: float, kind: str, producer: int, name: str) -> int:
        n = int(nbytes) // 4 * 4
        tensors.append(TensorInfo(id=len(tensors), nbytes=n, kind=kind, producer=producer, name=name, shape=(n // 4,)))
        return len(tensors) - 1

    x = tensor(0.25 * 2**20, "input", -1, "input")
    w = tensor(64 * 1024, "param", -1, "w")
    acts = [x]
    for k in range(nf):
        last = k == nf - 1
        ins = [acts[-1], w] + ([acts[-2]] if k >= 2 and rng.random() < 0.3 else [])
        out = tensor(4 if last else rng.uniform(*mb) * 2**20, "activation", k, "loss" if last else f"a{k}")
        stages.append(Stage(index=k, id=f"forward/l{k}/op#0", op="loss" if last else "op", module=f"l{k}",
                            cost_s=float(rng.uniform(*ms) * 1e-3), inputs=list(dict.fromkeys(ins)), outputs=[out],
                            deterministic=bool(rng.random() >= nondeterministic_prob)))
        acts.append(out)
    reads: dict[int, list[int]] = {j: [] for j in range(nb)}
    for a in acts[1:-1]:
        if rng.random() < saved_prob and nb > 0:
            r = int(rng.integers(readers[0], readers[1] + 1))
            for j in rng.choice(nb, size=min(r, nb), replace=False):
                reads[int(j)].append(a)
    grad = acts[-1]
    for j in range(nb):
        s = nf + j
        out = tensor(rng.uniform(*grad_mb) * 2**20, "grad", s, f"g{j}")
        stages.append(Stage(index=s, id=f"backward/l{j}/op#0", op="op_backward", module=f"b{j}", phase="backward",
                            cost_s=float(rng.uniform(*ms) * 2e-3), inputs=list(dict.fromkeys([grad, *reads[j], w])),
                            outputs=[out]))
        grad = out
    link_consumers(stages, tensors)
    for t in tensors:
        if t.producer >= 0:
            t.freed_after = max(t.consumers) if t.consumers else t.producer
            t.saved = t.kind == "activation" and any(stages[c].phase == "backward" for c in t.consumers)
    tensors[grad].freed_after = None
    model = get_cost_model(device)
    rate = model.peak("float32") * model.efficiency
    for st in stages:
        st.flops = max(st.cost_s - model.launch_s, 0.0) * rate
        st.cost_s = float(model.op_time(st))
    return Graph(stages, tensors, {"model": f"random{n_stages}-s{seed}", "synthetic": True,
                                   "cost_model": model.name}).validate()
