"""How small the lossless codecs make a compiled region's saved tensors, measured on the real inputs.

A compiled region is planned before it has run, on fake tensors, but what a lossless codec saves depends
on the values (the zeros of a ReLU's output, the range of an index tensor). :func:`measure` runs the
joint graph's forward nodes once, eagerly, on the example inputs ``torch.compile`` gave the backend (the
first call's parameters, buffers and batch), encodes the value of each candidate node with the codec that
shrinks it most (:class:`hybridmem.plugins.codecs.CodecPasses`, as ``hybridmem::pack_saved`` will at run
time) and frees every value after its last forward read. It runs under ``no_grad`` and ``fork_rng``
(the caller's random stream is left as it was: random ops draw from a copy of it), and an op that would
write into a parameter or buffer (BatchNorm's running statistics) writes into a copy: nothing the user
holds changes. It holds what an inference pass of the region holds, and takes about its time.
"""
from __future__ import annotations

import operator
from typing import Any, Iterable, Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..plugins.codecs import CodecPasses
from .sizes import size_hint

__all__ = ["measure"]


def _lookup(env: dict[fx.Node, Any], a: Any) -> Any:
    return fx.node.map_arg(a, lambda n: env[n])


def measure(gm: fx.GraphModule, forward: Sequence[fx.Node], primals: Sequence[torch.Tensor],
            wanted: Iterable[fx.Node]) -> dict[str, tuple[str, int]]:
    """Run ``forward`` (the joint graph's forward nodes, in graph order) on ``primals`` (real tensors, one
    per ``primals_*`` placeholder) and return, for each node of ``wanted`` whose value a lossless codec
    shrinks, ``name -> (codec, encoded bytes)``. Raises what an op raises (the caller plans without
    compression then)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and str(n.target).startswith("primals")]
    if len(placeholders) != len(primals):
        raise ValueError(f"the joint graph has {len(placeholders)} primals, the region was given {len(primals)} inputs")
    wanted = set(wanted)
    order = {n: i for i, n in enumerate(forward)}
    # an output of a multi-output op that only the backward reads (max-pool's indices) is not a forward
    # node, but the forward makes it: it is measured right after its op
    picks: dict[fx.Node, list[fx.Node]] = {}
    for w in wanted:
        if w not in order and w.target is operator.getitem and w.args[0] in order:
            picks.setdefault(w.args[0], []).append(w)
    last: dict[fx.Node, int] = {}
    for n in forward:
        for a in n.all_input_nodes:
            last[a] = order[n]
    env: dict[fx.Node, Any] = {}
    owned: set[int] = set()          # ids of placeholder values already copied for an in-place write
    out: dict[str, tuple[str, int]] = {}
    devices = sorted({v.device.index or 0 for v in primals if isinstance(v, torch.Tensor) and v.device.type == "cuda"})
    # the partitioner runs under the compile's fake-tensor mode: the probe computes real values
    with unset_fake_temporarily(), torch.random.fork_rng(devices=devices), torch.no_grad():
        for ph, v in zip(placeholders, primals):
            meta = ph.meta.get("val")
            # symbolic sizes (dynamic shapes) compare by their hints: comparing them would add a guard
            shape = tuple(size_hint(s, planned=False) for s in meta.shape) if isinstance(meta, torch.Tensor) else ()
            if isinstance(meta, torch.Tensor) and (not isinstance(v, torch.Tensor)
                                                   or tuple(v.shape) != shape or v.dtype != meta.dtype):
                raise ValueError(f"input {ph.name}: the region was given {type(v).__name__} "
                                 f"{tuple(getattr(v, 'shape', ()))}, its graph reads {shape} {meta.dtype}")
            env[ph] = v.detach() if isinstance(v, torch.Tensor) else size_hint(v, planned=False) if isinstance(v, torch.SymInt) else v
        for i, n in enumerate(forward):
            if n.op != "call_function":
                continue
            args, kwargs = _lookup(env, n.args), _lookup(env, n.kwargs)
            args, kwargs = _own_mutated(n, args, kwargs, placeholders, env, owned)
            env[n] = n.target(*args, **kwargs)
            for w in (n, *picks.get(n, ())):
                v = env[n] if w is n else env[n][w.args[1]]
                if w in wanted and isinstance(v, torch.Tensor):
                    got = _smallest(v)
                    if got is not None:
                        out[w.name] = got
            for a in n.all_input_nodes:
                if last.get(a) == i and a.op != "placeholder":
                    env.pop(a, None)
            if n not in last:
                env.pop(n, None)
    return out


def _smallest(v: torch.Tensor) -> tuple[str, int] | None:
    from .codec_ops import codecs_for, dense
    if not dense(v) or v.numel() == 0:
        return None
    flat = v.as_strided((v.numel(),), (1,), v.storage_offset())
    nbytes = v.numel() * v.element_size()
    # on the CPU, Numba's kernels where Numba works (the backend loads them while Dynamo traces): torch's,
    # the fallback, allocate temporaries at compile time, which the first step's real peak then holds. The
    # codecs pack_saved will choose among on this device: on CUDA those that read no values on the host
    best = CodecPasses(v.dtype, nbytes, lambda vdt: flat.view(vdt)).smallest(codecs_for(v), nbytes - 1)
    return None if best is None else (best[1].name, int(best[0]))


def _own_mutated(n: fx.Node, args: Any, kwargs: Any, placeholders: list[fx.Node], env: dict[fx.Node, Any],
                 owned: set[int]) -> tuple[Any, Any]:
    """``args``/``kwargs`` of ``n`` with each input it writes in place, where that input is one the user holds
    (a placeholder's value: a parameter, a buffer, the batch), replaced by a copy kept for later readers."""
    schema = getattr(n.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return args, kwargs
    phs = set(placeholders)
    args, kwargs = list(args), dict(kwargs)
    for k, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        src = n.args[k] if k < len(n.args) else n.kwargs.get(arg.name)
        if isinstance(src, fx.Node) and src in phs and id(env[src]) not in owned:
            env[src] = env[src].clone()
            owned.add(id(env[src]))
        if k < len(args):
            args[k] = env[src] if isinstance(src, fx.Node) else args[k]
        elif arg.name in kwargs and isinstance(src, fx.Node):
            kwargs[arg.name] = env[src]
    return tuple(args), kwargs
