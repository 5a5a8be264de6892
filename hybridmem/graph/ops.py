"""Low-level helpers shared by the meter, capture and the runtime: which aten ops are stages, op names,
and per-op facts (RNG use, mutated arguments) read once from the op's schema and cached.

Everything here is keyed by ``OpOverload`` and cached in plain dicts, so a lookup on the hot path is one
dict access. The capture and the runtime must agree on :func:`is_stage_op`, or their op counters (stage
indices) drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

aten = torch.ops.aten

# Ops that allocate nothing and only change metadata, but whose schema does not say so: `_unsafe_view`
# has no alias annotation (it is only ever applied to fresh tensors), and the in-place metadata ops
# (`t_`, `transpose_`, ...) are annotated as writes although they touch no data.
_METADATA_ONLY = frozenset({
    "_unsafe_view", "t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "swapdims_",
    "swapaxes_", "detach_", "_reshape_alias", "lift_fresh", "alias", "detach",
})

# Ops that consume the RNG but take no Generator argument (dropout inside fused attention kernels).
# Keyed by packet name -> name of the dropout-probability argument; RNG is used only when it is > 0.
_DROPOUT_ARG = {
    "_scaled_dot_product_flash_attention": "dropout_p",
    "_scaled_dot_product_flash_attention_for_cpu": "dropout_p",
    "_scaled_dot_product_efficient_attention": "dropout_p",
    "_scaled_dot_product_cudnn_attention": "dropout_p",
    "_flash_attention_forward": "dropout_p",
    "_efficient_attention_forward": "dropout_p",
    "native_dropout": "p",
    "_fused_dropout": "p",
}
# RNG ops whose schema has no Generator argument and no dropout probability.
_RNG_ALWAYS = frozenset({"rrelu_with_noise", "rrelu_with_noise_", "randperm"})

# BatchNorm kernels whose running statistics are not annotated as mutable in the schema (legacy);
# they update them when ``training`` is true and running stats are given.
_BN_LEGACY = frozenset({"native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"})

# Ops known to be non-deterministic on CUDA (atomics in the kernel or its backward), from the list in
# ``torch.use_deterministic_algorithms``. On the CPU every op is deterministic (RNG ops are replayable
# from the saved RNG state). Recomputing one of these would not reproduce its output bit for bit, so
# the plan must swap instead.
CUDA_NONDETERMINISTIC = frozenset({
    "index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
    "index_put", "index_put_", "_index_put_impl_", "put_", "put",
    "embedding_dense_backward", "_embedding_bag_backward", "_embedding_bag_dense_backward",
    "_embedding_bag_per_sample_weights_backward",
    "avg_pool3d_backward", "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward",
    "adaptive_max_pool2d_backward", "adaptive_max_pool3d_backward", "max_pool3d_with_indices_backward",
    "fractional_max_pool2d_backward", "fractional_max_pool3d_backward", "max_unpool2d", "max_unpool3d",
    "upsample_linear1d_backward", "upsample_bilinear2d_backward", "upsample_bicubic2d_backward",
    "upsample_trilinear3d_backward", "_upsample_bilinear2d_aa_backward", "_upsample_bicubic2d_aa_backward",
    "reflection_pad1d_backward", "reflection_pad2d_backward", "reflection_pad3d_backward",
    "replication_pad1d_backward", "replication_pad2d_backward", "replication_pad3d_backward",
    "grid_sampler_2d_backward", "grid_sampler_3d_backward", "nll_loss2d_forward", "_ctc_loss_backward",
    "histc", "bincount", "kthvalue", "median",
})


@dataclass(frozen=True)
class OpInfo:
    """What the schema of one ``OpOverload`` tells us, computed once."""

    name: str                    # "addmm", "add.Tensor", "myns::op.overload"
    stage: bool                  # is_stage_op(func)
    rng: bool                    # always consumes the RNG (has a Generator argument, or listed)
    dropout_arg: int             # index of the dropout probability argument (RNG iff > 0), or -1
    dropout_kw: str              # its name, for keyword calls
    written: tuple[int, ...]     # positional indices of arguments the op writes (alias ``!``)
    written_kw: tuple[str, ...]  # the same arguments by name (``out=`` and friends)
    bn_training: int             # legacy BatchNorm: index of ``training`` argument, else -1
    cuda_nondeterministic: bool
    may_resize: bool = False     # may change the size of a written storage (resize_, out= variants)


_INFO: dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    """Cached :class:`OpInfo` of an ``OpOverload``."""
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = _make_info(func)
    return info


def is_stage_op(func: Any) -> bool:
    """Whether an aten op is a *stage*: anything except pure view/metadata ops.

    Not stages: ops whose schema returns an alias of an input without writing it (``view``, ``t``,
    ``transpose``, ``expand``, ``as_strided``, ``split``, ``detach``, ``alias``, ``lift_fresh``, ...),
    the unannotated or in-place metadata ops in ``_METADATA_ONLY`` (``_unsafe_view``, ``t_``, ...),
    and ops that return no tensor and write nothing (``sym_size``, ``_local_scalar_dense``,
    ``equal``). None of them allocates device memory. Everything else, in-place and ``out=`` ops
    included, is a stage. Capture and runtime both count stages with this predicate.
    """
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = _make_info(func)
    return info.stage


def _make_info(func: Any) -> OpInfo:
    schema = getattr(func, "_schema", None)
    packet = getattr(func, "_opname", None) or getattr(func, "__name__", str(func)).split(".")[0]
    ns = getattr(func, "namespace", "aten")
    overload = getattr(func, "_overloadname", "default")
    name = packet if overload in ("default", "") else f"{packet}.{overload}"
    if ns != "aten":
        name = f"{ns}::{name}"
    if schema is None:  # not an OpOverload (a higher-order op): count it, know nothing else
        return OpInfo(name, True, False, -1, "", (), (), -1, False)

    args = list(schema.arguments)
    written = tuple(i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write
                    and not a.kwarg_only)
    written_kw = tuple(a.name for a in args if a.alias_info is not None and a.alias_info.is_write)
    returns_tensor = any("Tensor" in str(r.type) for r in schema.returns)
    is_view = bool(getattr(func, "is_view", False))
    if ns == "aten" and packet in _METADATA_ONLY:
        stage = False
    elif is_view and not written:
        stage = False
    elif not returns_tensor and not written:
        stage = False
    else:
        stage = True

    # The seeded-nondeterminism tag covers the overloads without a Generator argument (``rand.default``:
    # what ``torch.rand(n)`` dispatches to), which still draw from the default generator.
    seeded = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
    rng = packet in _RNG_ALWAYS or seeded or any("Generator" in str(a.type) for a in args)
    dropout_arg, dropout_kw = -1, ""
    if packet in _DROPOUT_ARG:
        dropout_kw = _DROPOUT_ARG[packet]
        dropout_arg = next((i for i, a in enumerate(args) if a.name == dropout_kw), -1)
        rng = False  # decided per call from the probability
    bn_training = -1
    if packet in _BN_LEGACY:
        bn_training = next((i for i, a in enumerate(args) if a.name == "training"), -1)
    may_resize = packet in ("resize_", "resize_as_") or any(
        a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in args)  # out= variants
    return OpInfo(name, stage, rng, dropout_arg, dropout_kw, written, written_kw, bn_training,
                  packet in CUDA_NONDETERMINISTIC, may_resize)


def uses_rng(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call of ``func`` consumes the RNG (dropout probability checked per call)."""
    info = op_info(func)
    if info.rng:
        return True
    if info.dropout_arg >= 0:
        p = args[info.dropout_arg] if info.dropout_arg < len(args) else kwargs.get(info.dropout_kw, 0.0)
        return bool(p) and float(p) > 0.0
    return False


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors this call writes in place (``relu_``'s self, ``out=``, running stats of BatchNorm)."""
    info = op_info(func)
    out: list[torch.Tensor] = []
    for i in info.written:
        if i < len(args):
            _collect(args[i], out)
    for k in info.written_kw:
        if k in kwargs:
            _collect(kwargs[k], out)
    if info.bn_training >= 0:
        training = args[info.bn_training] if info.bn_training < len(args) else kwargs.get("training", False)
        if training:
            # running_mean and running_var are arguments 3 and 4 of every legacy BatchNorm kernel
            for v in (args[3:5] if len(args) >= 5 else (kwargs.get("running_mean"), kwargs.get("running_var"))):
                if isinstance(v, torch.Tensor):
                    out.append(v)
    return out


def _collect(v: Any, out: list[torch.Tensor]) -> None:
    if isinstance(v, torch.Tensor):
        out.append(v)
    elif isinstance(v, (list, tuple)):
        out.extend(x for x in v if isinstance(x, torch.Tensor))
