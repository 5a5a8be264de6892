"""What PyTorch's partitioner does with a joint graph left untagged: the forward values it saves.

``min_cut_rematerialization_partition`` saves a min-cut of the forward values the backward needs and
recomputes the rest in the backward, where Inductor fuses those recomputes (pointwise ops and views:
reductions and compute-intensive ops are banned from recompute by default) into the backward's kernels,
so they are never stored. A count that keeps every forward value the backward reads holds them from
the forward to the backward: on a GPT's loss, the log-softmax the backward recomputes from the logits
(4 MiB of a 27 MiB step). The backend partitions a copy of the joint graph once, untagged, to learn
which forward values the backward really reads (:func:`saved_by_partition`); its second count of the region
reads those in place of the values recomputed from them (:func:`hybridmem.compile.joint.joint_graph`), and a
plan made on it pins the recomputes with ``MUST_RECOMPUTE`` so that its tags do not change them.
"""
from __future__ import annotations

import copy
from typing import Any

from torch import fx

__all__ = ["saved_by_partition", "saved_bytes"]


def saved_by_partition(gm: fx.GraphModule, joint_inputs: Any, kwargs: dict[str, Any]) -> set[fx.Node] | None:
    """The nodes of ``gm``'s forward whose values PyTorch's partition of a copy of ``gm``, under the
    checkpoint tags ``gm`` carries (none of a plan: PyTorch's own choice; a plan's:
    :func:`hybridmem.compile.partition_peak.realized_peak`), saves for the backward; None if that partition
    fails (the count then keeps every value the backward reads). ``joint_inputs``, ``kwargs``: what
    AOTAutograd passes to the partition function. ``gm`` has been through the partitioner's common
    subexpression elimination already (the backend runs it first, so that its tags land on the nodes the
    partition keeps): the copy's partition skips it (a second pass changes nothing, and took a fifth of the
    partition's time on ResNet-50)."""
    from torch._functorch import config as fconfig
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    try:
        # the user's own checkpoint tags (torch.utils.checkpoint in the compiled code) stay: the real
        # partition honours them too
        with fconfig.patch(cse=False):
            _, bw = min_cut_rematerialization_partition(copy.deepcopy(gm), joint_inputs, **kwargs)
    except Exception:   # a partition that fails here fails again, with its own error, when it is run for real
        return None
    names = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
    return {n for n in gm.graph.nodes if n.name in names}


def saved_bytes(fw: fx.GraphModule, bw: fx.GraphModule, device: Any) -> int:
    """Bytes of the distinct storages a partition's backward graph ``bw`` reads from its forward ``fw`` on
    ``device``, but the forward's inputs' (the region's inputs and parameters, held for the step anyway; a
    weight's transpose is a view of its storage) and the tangents (made by the backward's caller). A value
    swapped to the host or held compressed (a token on the host) is not on ``device``."""
    from .fxnodes import node_nbytes, storage_key, tensor_vals

    inputs = {storage_key(v) for n in fw.graph.find_nodes(op="placeholder") for v in tensor_vals(n.meta.get("val"))}
    seen: dict[Any, int] = {}
    for n in bw.graph.find_nodes(op="placeholder"):
        if str(n.target).startswith(("primals", "tangents")):
            continue
        for v in tensor_vals(n.meta.get("val")):
            k = storage_key(v)
            if v.device.type == getattr(device, "type", device) and k not in inputs:
                seen.setdefault(k, node_nbytes(v))
    return sum(seen.values())
