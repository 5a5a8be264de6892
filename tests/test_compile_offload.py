"""hybridmem's offload ops in a compiled graph (:mod:`hybridmem.compile.offload_ops`): a partition's saved
tensors rewritten to go to the host after their last forward read and back before their first backward read.
On the CPU the ops copy at once; the gradients are bit for bit those of the same partition without them."""
from __future__ import annotations


import torch
from torch import nn

from hybridmem.compile import offload_ops
from hybridmem.compile.compressed import storage_of
from hybridmem.compile.offload import rewrite_partition
from tests.helpers import bit_equal


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def _train(model: nn.Module, offload: bool, graphs: list) -> list[torch.Tensor]:
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    def partition(gm, joint_inputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        if offload:
            # every saved activation of the forward (not the inputs): what a plan that swaps all would move
            saved = {n.name for n in bw.graph.find_nodes(op="placeholder")}
            picks = [storage_of(n) for n in fw.graph.nodes if n.op == "call_function" and n.name in saved]
            graphs.append(rewrite_partition(fw, bw, picks))
        graphs.append((fw, bw))
        return fw, bw

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(16, 32)
    for _ in range(2):
        model.zero_grad()
        compiled(x).square().sum().backward()
    return [p.grad for p in model.parameters()]


def test_offloaded_saved_tensors_give_the_same_gradients_bit_for_bit() -> None:
    plain, moved = [], []
    ref = _train(_mlp(), False, plain)
    got = _train(_mlp(), True, moved)
    assert all(bit_equal(a, b) for a, b in zip(ref, got))
    rewritten, (fw, bw) = moved[0], moved[1]
    assert len(rewritten) >= 2, rewritten                     # the ReLU's and tanh's outputs at least
    targets = [n.target for g in (fw, bw) for n in g.graph.nodes if n.op == "call_function"]
    for op in ("offload", "reload_start", "reload_wait"):
        assert targets.count(getattr(torch.ops.hybridmem, op).default) == len(rewritten), op
    # the backward reads tokens, not the tensors: nothing the forward made is held on the device between them
    bw_in = [n.name for n in bw.graph.find_nodes(op="placeholder")]
    assert not set(rewritten) & set(bw_in)
    assert offload_ops.held() == 0                            # the host copies went with the backward


def test_a_reload_starts_one_kernel_before_its_first_read() -> None:
    moved: list = []
    _train(_mlp(), True, moved)
    _, (_, bw) = moved[0], moved[1]
    nodes = list(bw.graph.nodes)
    for start in (n for n in nodes if n.target is torch.ops.hybridmem.reload_start.default):
        (wait,) = start.users
        kernels = [n for n in nodes[nodes.index(start) + 1:nodes.index(wait)]
                   if n.op == "call_function" and n.target is not torch.ops.hybridmem.reload_start.default]
        assert len(kernels) <= 2, kernels                       # the kernel it runs beside (and its view)
