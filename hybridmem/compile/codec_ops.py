"""The custom ops that keep a compiled graph's saved tensor compressed from the forward to the backward.

    token = torch.ops.hybridmem.pack_saved(x, region, planned)          # forward, after x's last read there
    x = torch.ops.hybridmem.unpack_saved(token, size, stride, dtype, device, region)   # backward, before its first

``pack_saved`` encodes ``x`` with the lossless codec that shrinks it most (:mod:`hybridmem.plugins.codecs`:
``bitmask``, ``binary``, ``sparse``, ``narrow``; chosen per call, on the data) and returns a one-element
int64 token on the host that names the encoding. The forward saves the token in ``x``'s place, so ``x``
is freed after its last forward read and only the encoding stays on the device. The encoding lives as
long as the token: autograd frees the token with the backward's other saved tensors (after the backward,
or when the graph is dropped), and the encoding goes with it. ``unpack_saved`` decodes into a new tensor
of ``x``'s size, strides and dtype, bit for bit; a backward run twice (``retain_graph=True``) decodes
twice. Where no codec shrinks ``x`` at run time, the token holds ``x`` itself (nothing saved) and the
region's stats count it.

Each call runs in Python (a codec pass over the tensor, Numba kernels on the CPU): what it costs is the
codec's, once per saved tensor per step, not per op. On a device (CUDA) the host must not read the tensor's
values to choose (one device drain per saved tensor per step): there only the codecs that decide without
reading the bytes apply (:func:`codecs_for`: ``bitmask`` for bool tensors), and every other tensor is held
as it is. The token is a host tensor: CUDA graphs (cudagraph trees) skip a graph that holds one.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..plugins.codecs import LOSSLESS, Codec, CodecPasses, Encoded
from .oplib import TokenTable, define_once, tensor_fake, token_fake

__all__ = ["CodecStats", "codecs_for", "dense", "live_payloads", "new_region", "register", "reset_stats",
           "stats_for"]

CODECS = tuple(LOSSLESS.values())
# the codecs that choose without reading the bytes on the host: the ones a device tensor may use
DEVICE_CODECS = tuple(c for c in CODECS if not c.reads_bytes)


@dataclass
class CodecStats:
    """What the compress ops of one compiled region did, over every step since it compiled."""

    packed: int = 0                   # saved tensors encoded
    raw: int = 0                      # ... of which no codec shrank (held as they were)
    bytes_in: int = 0                 # their bytes
    bytes_out: int = 0                # the bytes their encodings held
    planned_bytes: int = 0            # what the plan counted for those encodings
    encode_s: float = 0.0
    decode_s: float = 0.0
    codecs: dict[str, int] = field(default_factory=dict)

    @property
    def over_plan_bytes(self) -> int:
        """Bytes the encodings held beyond what the plan counted (data that compressed worse than the
        tensors measured when the region compiled), summed over the steps."""
        return max(0, self.bytes_out - self.planned_bytes)


@dataclass(eq=False)
class _Payload:
    enc: Encoded | None               # None: held raw
    raw: torch.Tensor | None


_LOCK = threading.Lock()               # the regions' stats
_PAYLOADS: TokenTable[_Payload] = TokenTable("encoding")
_REGIONS: dict[int, CodecStats] = {}
_REGION_IDS = itertools.count(1)


def new_region() -> int:
    """A fresh region id for the ops' stats (one per compiled region that compresses)."""
    rid = next(_REGION_IDS)
    _REGIONS[rid] = CodecStats()
    return rid


def stats_for(region: int) -> CodecStats:
    return _REGIONS.setdefault(region, CodecStats())


def reset_stats(region: int) -> None:
    """Forget what the ops of ``region`` did so far (a run at compile time is not a step)."""
    with _LOCK:
        _REGIONS[region] = CodecStats()


def live_payloads() -> int:
    """Encodings held now (tokens alive): 0 once every step's backward has freed its saved tensors."""
    return len(_PAYLOADS)


def _on_device(x: torch.Tensor) -> bool:
    """Whether reading ``x``'s values on the host waits for a device."""
    return x.device.type != "cpu"


def codecs_for(x: torch.Tensor) -> tuple[Codec, ...]:
    """The codecs ``hybridmem::pack_saved`` chooses among for ``x``: every lossless one on the CPU; on a
    device only those that decide without a host read of its values (:data:`DEVICE_CODECS`)."""
    return DEVICE_CODECS if _on_device(x) else CODECS


def dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements fill one block of its storage, each once (any order of dimensions)."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false
    return bool(is_non_overlapping_and_dense_or_false(x))   # symbolic strides: False


def _dense_flat(x: torch.Tensor) -> torch.Tensor:
    """``x``'s elements in memory order as a 1-D tensor (``x`` is non-overlapping and dense: its elements
    fill one block of its storage)."""
    return x.as_strided((x.numel(),), (1,), x.storage_offset())


def _pack(x: torch.Tensor, region: int, planned: int) -> torch.Tensor:
    t0 = time.perf_counter()
    st = stats_for(region)
    if not dense(x):   # the graph rewrite compresses dense tensors only
        raise RuntimeError(f"hybridmem::pack_saved: a tensor of size {tuple(x.shape)} and strides {x.stride()} "
                           "is not dense")
    flat = _dense_flat(x)
    nbytes = x.numel() * x.element_size()
    passes = CodecPasses(x.dtype, nbytes, lambda vdt: flat.view(vdt))
    best = passes.smallest(codecs_for(x), nbytes - 1)
    if best is None:
        payload = _Payload(None, x)
        st.raw += 1
        out_bytes = nbytes
    else:
        size, codec, info = best
        vdt = codec.view_dtype(x.dtype)
        payload = _Payload(codec.encode(passes.flat(vdt), info), None)
        out_bytes = payload.enc.nbytes  # type: ignore[union-attr]
        st.codecs[codec.name] = st.codecs.get(codec.name, 0) + 1
    # the encoding is freed with the token: after the backward, or when autograd drops the graph
    token = _PAYLOADS.put(payload)
    st.packed += 1
    st.bytes_in += nbytes
    st.bytes_out += out_bytes
    st.planned_bytes += planned
    st.encode_s += time.perf_counter() - t0
    return token


def _unpack(token: torch.Tensor, size: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
            device: torch.device, region: int) -> torch.Tensor:
    t0 = time.perf_counter()
    _, payload = _PAYLOADS.get(token, "unpack_saved")
    out = torch.empty_strided(tuple(size), tuple(stride), dtype=dtype, device=device)
    if payload.enc is None:
        out.copy_(payload.raw)  # a copy: the backward may write into what it reads; the held tensor stays
    else:
        enc = payload.enc
        target = _dense_flat(out).view(enc.dtype)
        LOSSLESS[enc.codec].decode(enc, target)
    stats_for(region).decode_s += time.perf_counter() - t0
    return out


def register() -> None:
    """Define ``hybridmem::pack_saved`` and ``hybridmem::unpack_saved`` (once per process)."""
    define_once("codec", _define)


def _define(lib: torch.library.Library) -> None:
    lib.define("pack_saved(Tensor x, int region, int planned) -> Tensor")
    lib.define("unpack_saved(Tensor token, SymInt[] size, SymInt[] stride, ScalarType dtype, Device device, "
               "int region) -> Tensor")
    lib.impl("pack_saved", _pack, "CompositeExplicitAutograd")
    lib.impl("unpack_saved", _unpack, "CompositeExplicitAutograd")
    torch.library.register_fake("hybridmem::pack_saved", token_fake, lib=lib)
    torch.library.register_fake("hybridmem::unpack_saved", tensor_fake, lib=lib)
