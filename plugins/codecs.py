"""Codecs for the compress policy: lossless ones chosen per tensor when they pay, lossy ones by name.

One concern, hence one module: the codecs, their kernels and the per-tensor choice among them.

A codec works on a tensor's whole storage, seen as a flat 1-D tensor (``flat_view``). Lossless codecs
look at element *bits* (the storage viewed as int8/16/32/64), so they round-trip bit-exactly whatever
the values are: -0.0, NaN payloads and denormals are just non-zero bit patterns.

Lossless (always available; measured on 16 MiB inputs, one core of the 2-core Zen 3 dev machine):
  ``bitmask``  bool tensors (CUDA dropout masks, masked_fill masks): 8 per byte.  size n/8        ~5 / 8 GB/s
  ``binary``   every element 0 or one constant c (CPU dropout saves a float mask of
               0 and 1/(1-p)): bitmask + c.                                   size n/8        ~9 / 7 GB/s
  ``sparse``   many zero elements (ReLU outputs): bitmask of non-zeros + the
               non-zeros (+1 spare slot).                                 size n/8 + (nnz+1)w  ~2 / 1.6 GB/s
  ``narrow``   integer tensors whose values span fewer than 2^8, 2^16 or 2^32
               (max-pool indices, positions, token ids): the low 1, 2 or 4
               bytes of each element; decoding restores the high bytes
               from the minimum.                                          size n*1, n*2 or n*4   ~1 / 1 GB/s

Lossy (only when configured by name; float32 sources):
  ``bf16``  |x' - x| <= 2^-8 |x| + 2^-134   (round to nearest even; 2^-134: bf16 denormal half-step)
  ``fp16``  |x' - x| <= 2^-11 |x| + 2^-25   (applicable only when every finite |x| <= 65504)
  ``fp8``   |x' - x| <= 2^-4 |x| + absmax * 2^-10/448 + absmax * 2^-22   (e4m3, per-tensor scaling)
  ``int8``  |x' - x| <= absmax/254 + absmax * 2^-22   (per-tensor absmax scaling; finite tensors only)

Kernels: on CPU tensors Numba loops (one pass each, branch-free; torch's boolean indexing does ~0.2 GB/s
here), on CUDA and without Numba (``HYBRIDMEM_NUMBA=0``) vectorized torch ops, in chunks so their
temporaries stay bounded. Both produce the same encoding (element i is bit i % 8 of byte i // 8), so
either decodes the other's. Encode/decode GB/s above are of original bytes (bench/test_bench_scorer.py).

No kernel here makes the host wait for a device: the torch paths never read a device value on the host
(no ``.item()``, boolean indexing or ``nonzero``), and the one-pass statistics a codec decides from
(:class:`Analysis`, :class:`Span`, :class:`AbsMax`) can be computed by queued kernels whose results are
copied to pinned host memory and read once they have arrived (:class:`DeviceStats`, ``CodecPasses(wait=
False)``): the compress policy decides on CUDA when the copy is there, never by waiting for it. Codecs
marked ``reads_bytes = False`` (bitmask, bf16) need no statistics at all.
"""
from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import torch

from hybridmem.errors import UnknownNameError
from hybridmem._jit import lazy_njit

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24          # torch path: elements per chunk (bounds its temporary masks and values)
_SPARSE_CHUNK = 1 << 22   # the sparse torch path keeps an int64 position per element of a chunk


# --------------------------------------------------------------------------------------------------
# Storage views
# --------------------------------------------------------------------------------------------------

def flat_view(storage: torch.UntypedStorage, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The whole ``storage`` as a contiguous 1-D tensor of ``dtype`` (no copy)."""
    return torch.empty(0, dtype=dtype, device=device).set_(storage)


def bits_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The integer dtype whose elements are this dtype's bit patterns (None: unsupported width)."""
    got = _BITS_OF.get(dtype, _UNKNOWN)
    if got is _UNKNOWN:  # cached per dtype: asked for every codec of every saved tensor at each decision
        width = torch.empty(0, dtype=dtype).element_size()
        got = _BITS_OF[dtype] = (_INT_OF_WIDTH[width] if width in _INT_OF_WIDTH
                                 else torch.int64 if width % 8 == 0 else None)  # complex128: 64-bit pairs
    return got


_BITS_OF: dict[torch.dtype, torch.dtype | None] = {}
_UNKNOWN = object()


@dataclass(frozen=True)
class Geometry:
    """How a tensor sits on its storage: enough to rebuild it on a new storage with the same bytes."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    nbytes: int                      # storage bytes

    @classmethod
    def of(cls, t: torch.Tensor) -> "Geometry":
        return cls(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device,
                   t.untyped_storage().nbytes())

    def rebuild(self, storage: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
            storage, self.offset, self.size, self.stride)


def entry_version(entry: Any) -> int:
    """The version counter the entry's packs saw: ``tensor._version + vshift`` (see base.EntryView).

    The runtime re-wraps a regenerated storage in its own tensor (a new version counter) and sets
    ``vshift`` so that this stays continuous; a policy that hands a tensor over does the same.
    """
    return entry.tensor._version + getattr(entry, "vshift", 0)


@dataclass(frozen=True, eq=False)
class Stamp:
    """Identity of an entry's current bytes: the storage object (weakly) and the version counter.

    Stays valid while the same storage is resident and unwritten, whichever tensor wraps it; a freed
    storage never matches (unlike a data pointer, which the allocator reuses).
    """

    storage: "weakref.ref[torch.UntypedStorage]"
    version: int

    @classmethod
    def of(cls, entry: Any) -> "Stamp":
        return cls(weakref.ref(entry.tensor.untyped_storage()), entry_version(entry))

    def matches(self, entry: Any) -> bool:
        t = entry.tensor
        return (t is not None and self.storage() is t.untyped_storage()
                and self.version == entry_version(entry))


def supported(t: torch.Tensor | None) -> bool:
    """Plain dense tensors on a real device (no meta/sparse/quantized/nested/conj-bit tensors)."""
    return (t is not None and t.layout == torch.strided and t.device.type != "meta"
            and not t.is_quantized and not t.is_nested and not t.is_conj() and not t.is_neg())


# --------------------------------------------------------------------------------------------------
# Numba kernels (CPU). Branch-free inner loops: the data-dependent branches of a naive loop cost 4x.
# --------------------------------------------------------------------------------------------------

def _nb_analyze(bits):
    """(non-zero count, first non-zero value, count of non-zeros different from it)."""
    n = bits.shape[0]
    first = -1
    for i in range(n):
        if bits[i] != 0:
            first = i
            break
    if first < 0:
        return 0, 0, 0
    c = bits[first]
    nnz = 0
    other = 0
    for i in range(first, n):
        v = bits[i]
        nz = v != 0
        nnz += nz
        other += nz & (v != c)
    return nnz, np.int64(c), other


def _nb_pack(bits, packed):
    """packed[j] bit i = bits[8j+i] != 0."""
    n = bits.shape[0]
    full = n // 8
    for j in range(full):
        b = 0
        for i in range(8):
            b |= np.int64(bits[8 * j + i] != 0) << i
        packed[j] = b
    if n > 8 * full:
        b = 0
        for i in range(n - 8 * full):
            b |= np.int64(bits[8 * full + i] != 0) << i
        packed[full] = b


def _nb_unpack_const(packed, c, out):
    """out[i] = c where bit i is set, else 0."""
    n = out.shape[0]
    full = n // 8
    for j in range(full):
        b = np.int64(packed[j])
        for i in range(8):
            out[8 * j + i] = c & -((b >> i) & 1)
    if n > 8 * full:
        b = np.int64(packed[full])
        for i in range(n - 8 * full):
            out[8 * full + i] = c & -((b >> i) & 1)


def _nb_unpack_bytes(packed, lut, out64):
    """Width-1 outputs, 8 elements per store: out64[j] = lut[packed[j]] (lut: 256 int64 words)."""
    for j in range(out64.shape[0]):
        out64[j] = lut[packed[j]]


def _nb_sparse_encode(bits, packed, vals):
    """Bitmask of non-zeros into ``packed``, the non-zeros in order into ``vals`` (len nnz + 1).
    Returns the non-zero count; writes never go past ``vals`` even if the data changed since the
    count was taken (the caller then refuses the encoding)."""
    n = bits.shape[0]
    last = vals.shape[0] - 1
    k = 0
    full = n // 8
    for j in range(full):
        b = 0
        for i in range(8):
            v = bits[8 * j + i]
            nz = np.int64(v != 0)
            vals[min(k, last)] = v     # written always, kept only if non-zero: one spare slot
            k += nz
            b |= nz << i
        packed[j] = b
    if n > 8 * full:
        b = 0
        for i in range(n - 8 * full):
            v = bits[8 * full + i]
            nz = np.int64(v != 0)
            vals[min(k, last)] = v
            k += nz
            b |= nz << i
        packed[full] = b
    vals[min(k, last)] = 0
    return k


def _nb_sparse_decode(packed, vals, out):
    n = out.shape[0]
    k = 0
    full = n // 8
    for j in range(full):
        b = np.int64(packed[j])
        for i in range(8):                    # fixed trip count: unrolled, no data-dependent branch
            bit = (b >> i) & 1
            out[8 * j + i] = vals[k] & -bit    # vals[nnz] is the spare 0: reading it is in bounds
            k += bit
    if n > 8 * full:
        b = np.int64(packed[full])
        for i in range(n - 8 * full):
            bit = (b >> i) & 1
            out[8 * full + i] = vals[k] & -bit
            k += bit
    return k


def _nb_narrow_encode(bits, kept):
    """kept[i] = the low bytes of bits[i] (an integer narrowing truncates: LLVM ``trunc``)."""
    for i in range(bits.shape[0]):
        kept[i] = bits[i]


def _nb_narrow_decode(kept, low_lo, mask, lo, out):
    """out[i] = lo + ((kept[i] - low_lo) & mask): one pass (see NarrowCodec)."""
    for i in range(out.shape[0]):
        out[i] = lo + ((np.int64(kept[i]) - low_lo) & mask)


def _i32(n: int = 16) -> np.ndarray:
    return np.zeros(n, np.int32)


_OPTS = {"error_model": "numpy"}
_K_ANALYZE = lazy_njit(_nb_analyze, lambda: (_i32(),), **_OPTS)
_K_PACK = lazy_njit(_nb_pack, lambda: (_i32(), np.zeros(2, np.uint8)), **_OPTS)
_K_UNPACK = lazy_njit(_nb_unpack_const, lambda: (np.zeros(2, np.uint8), np.int32(1), _i32()), **_OPTS)
_K_UNPACK_BYTES = lazy_njit(_nb_unpack_bytes, lambda: (np.zeros(2, np.uint8), np.zeros(256, np.int64),
                                                       np.zeros(2, np.int64)), **_OPTS)
_K_SP_ENC = lazy_njit(_nb_sparse_encode, lambda: (_i32(), np.zeros(2, np.uint8), _i32(17)), **_OPTS)
_K_NARROW_ENC = lazy_njit(_nb_narrow_encode, lambda: (np.zeros(2, np.int64), np.zeros(2, np.int16)), **_OPTS)
_K_NARROW_DEC = lazy_njit(_nb_narrow_decode, lambda: (np.zeros(2, np.int16), np.int64(0), np.int64(0xFFFF),
                                                      np.int64(0), np.zeros(2, np.int64)), **_OPTS)
_K_SP_DEC = lazy_njit(_nb_sparse_decode, lambda: (np.zeros(2, np.uint8), _i32(17), _i32()), **_OPTS)


def load_analysis_kernel() -> bool:
    """Load the compiled CPU analysis kernel now (Numba: 0.3-0.5 s a process, from its on-disk cache), e.g. from
    a background thread while other work goes on; True where it works. Runs no torch op."""
    return _K_ANALYZE.compiled() is not None


def _numba(kernel: lazy_njit, t: torch.Tensor, force_torch: bool) -> Any:
    """The compiled kernel when ``t`` is a CPU tensor and Numba works, else None (use torch)."""
    if force_torch or t.device.type != "cpu":
        return None
    return kernel.compiled()


# --------------------------------------------------------------------------------------------------
# Torch kernels (CUDA, or CPU without Numba)
# --------------------------------------------------------------------------------------------------

_PACK_MUL = 0x0102040810204080   # byte i (0/1) of a little-endian int64 -> bit 56+i of the product


def _torch_pack(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor LSB-first, 8 per byte. The int64 multiply gathers 8 bytes in one op
    (all partial products land on distinct bits, so no carries); it wraps, which is intended."""
    n = mask.numel()
    full = n // 8
    out = torch.empty((n + 7) // 8, dtype=torch.uint8, device=mask.device)
    if full:
        words = mask[: 8 * full].contiguous().view(torch.uint8).view(torch.int64)
        out[:full] = ((words * _PACK_MUL) >> 56).bitwise_and_(0xFF).to(torch.uint8)
    if n > 8 * full:
        tail = mask[8 * full:].to(torch.uint8)
        shifts = torch.arange(tail.numel(), dtype=torch.uint8, device=mask.device)
        out[full] = (tail << shifts).sum()
    return out


def _torch_unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`_torch_pack`: the first ``n`` bits as a bool tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:n].bool()


def _chunks(n: int, size: int = _CHUNK):
    for start in range(0, n, size):
        yield start, min(n, start + size)


# --------------------------------------------------------------------------------------------------
# Encoded data and codecs
# --------------------------------------------------------------------------------------------------

@dataclass(eq=False)
class Encoded:
    """A compressed storage: ``parts`` stay on the device; ``nbytes`` is what they occupy."""

    codec: str
    numel: int                       # elements of the working view (bits or float values)
    dtype: torch.dtype               # dtype of the working view
    parts: tuple[torch.Tensor, ...]
    const: int = 0                   # binary: the non-zero bit pattern; narrow: the minimum
    nnz: int = 0                     # sparse: non-zero count
    scale: float = 1.0               # int8: dequantization step

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts)


class DeviceStats:
    """Statistics computed by queued kernels: their values are copied to pinned host memory behind the kernels,
    and :meth:`result` reads them once the copy's event has completed, ``None`` until then. Nothing waits
    for the device. ``finish(values)`` turns the host values (a list) into the statistics object."""

    __slots__ = ("host", "event", "finish")

    def __init__(self, values: torch.Tensor, finish: Callable[[list], Any], event: Any = None):
        self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=values.is_cuda)
        self.host.copy_(values, non_blocking=values.is_cuda)
        self.event = event if event is not None else (torch.cuda.Event() if values.is_cuda else _DONE)
        if values.is_cuda:
            self.event.record()
        self.finish = finish

    def result(self) -> Any:
        """The statistics, or None while the copy has not arrived."""
        if not self.event.query():
            return None
        return self.finish(self.host.tolist())


class _Done:
    """The event of work done on the host (a CPU tensor's statistics): always complete."""

    @staticmethod
    def query() -> bool:
        return True


_DONE = _Done()


@dataclass(frozen=True)
class Analysis:
    """Bit statistics of a storage, one pass: drives the lossless codecs' sizes."""

    numel: int
    nnz: int
    const: int                       # the one non-zero value where ``binary`` (else 0)
    binary: bool                     # every element is 0 or ``const``

    @classmethod
    def of(cls, bits: torch.Tensor, force_torch: bool = False) -> "Analysis":
        n = bits.numel()
        kernel = _numba(_K_ANALYZE, bits, force_torch)
        if kernel is not None:
            nnz, c, other = kernel(bits.numpy())
            return cls(n, int(nnz), int(c) if other == 0 else 0, other == 0)
        return cls.finish(n, cls.values(bits).tolist())

    @staticmethod
    def values(bits: torch.Tensor) -> torch.Tensor:
        """[non-zero count, smallest non-zero, largest non-zero] as one int64 device tensor, by queued
        kernels in chunks (no host read): every element is 0 or one constant where the two agree."""
        info = torch.iinfo(bits.dtype)
        nnz = torch.zeros((), dtype=torch.int64, device=bits.device)
        lo = torch.full((), info.max, dtype=bits.dtype, device=bits.device)
        hi = torch.full((), info.min, dtype=bits.dtype, device=bits.device)
        for s, e in _chunks(bits.numel(), _SPARSE_CHUNK):
            chunk = bits[s:e]
            nz = chunk != 0
            nnz += nz.sum(dtype=torch.int64)
            lo = torch.minimum(lo, torch.where(nz, chunk, info.max).amin())
            hi = torch.maximum(hi, torch.where(nz, chunk, info.min).amax())
        return torch.stack([nnz, lo.to(torch.int64), hi.to(torch.int64)])

    @classmethod
    def finish(cls, n: int, v: list) -> "Analysis":
        nnz, lo, hi = v
        if nnz == 0:
            return cls(n, 0, 0, True)
        return cls(n, nnz, lo if lo == hi else 0, lo == hi)

    @classmethod
    def later(cls, bits: torch.Tensor) -> DeviceStats:
        n = bits.numel()
        return DeviceStats(cls.values(bits), lambda v: cls.finish(n, v))


@dataclass(frozen=True)
class Span:
    """Smallest and largest element of an integer storage (one pass): drives the narrow codec."""

    numel: int
    lo: int
    hi: int

    @classmethod
    def of(cls, flat: torch.Tensor, force_torch: bool = False) -> "Span":
        if flat.device.type == "cpu" and not force_torch:
            a = flat.numpy()          # runs no torch op: nothing for a dispatch mode to see or meter
            return cls(a.shape[0], int(a.min()), int(a.max()))
        lo, hi = cls.values(flat).tolist()
        return cls(flat.numel(), lo, hi)

    @staticmethod
    def values(flat: torch.Tensor) -> torch.Tensor:
        lo, hi = torch.aminmax(flat)
        return torch.stack([lo.to(torch.int64), hi.to(torch.int64)])

    @classmethod
    def later(cls, flat: torch.Tensor) -> DeviceStats:
        n = flat.numel()
        return DeviceStats(cls.values(flat), lambda v: cls(n, v[0], v[1]))


@dataclass(frozen=True)
class AbsMax:
    """The largest finite magnitude of a float32 storage and whether every element is finite (one pass):
    drives the lossy codecs that overflow or scale (fp16, int8, fp8)."""

    numel: int
    finite_max: float
    all_finite: bool

    @classmethod
    def of(cls, flat: torch.Tensor, force_torch: bool = False) -> "AbsMax":
        return cls.finish(flat.numel(), cls.values(flat).tolist())

    @staticmethod
    def values(flat: torch.Tensor) -> torch.Tensor:
        if not flat.numel():
            return torch.tensor([0.0, 1.0], dtype=torch.float64, device=flat.device)
        finite = torch.isfinite(flat)
        biggest = torch.where(finite, flat.abs(), 0.0).amax()
        return torch.stack([biggest.to(torch.float64), finite.all().to(torch.float64)])

    @classmethod
    def finish(cls, n: int, v: list) -> "AbsMax":
        return cls(n, float(v[0]), bool(v[1]))

    @classmethod
    def later(cls, flat: torch.Tensor) -> DeviceStats:
        n = flat.numel()
        return DeviceStats(cls.values(flat), lambda v: cls.finish(n, v))


_STATS = {"bits": Analysis, "span": Span, "absmax": AbsMax}


class Codec:
    """One way to shrink a storage. ``size`` is None when the codec does not apply.

    ``needs`` names the one-pass statistics ``size``/``encode`` take as ``info``: ``"bits"`` an
    :class:`Analysis`, ``"span"`` a :class:`Span`, ``"absmax"`` an :class:`AbsMax`, ``""`` none (``info``
    is None). ``reads_bytes``: whether deciding needs them (a codec that does not can be chosen for a
    device tensor without waiting for the device)."""

    name: str = ""
    lossless: bool = True
    doc_bound: str = "exact"
    needs: str = ""

    @property
    def reads_bytes(self) -> bool:
        return bool(self.needs)

    def view_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        return bits_dtype(dtype)

    def size(self, flat: torch.Tensor, info: Analysis | None) -> int | None:
        raise NotImplementedError

    def encode(self, flat: torch.Tensor, info: Analysis | None, force_torch: bool = False) -> Encoded:
        raise NotImplementedError

    def decode(self, enc: Encoded, out: torch.Tensor, force_torch: bool = False) -> None:
        """Fill ``out`` (flat, ``enc.numel`` elements of ``enc.dtype``)."""
        raise NotImplementedError


class BitmaskCodec(Codec):
    """bool -> 1 bit per element. Assumes canonical bools (bytes 0/1, as every torch op makes)."""

    name = "bitmask"

    def view_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        return torch.int8 if dtype == torch.bool else None

    def size(self, flat, info):
        return (flat.numel() + 7) // 8

    def encode(self, flat, info, force_torch=False):
        packed = _pack(flat, force_torch)
        return Encoded(self.name, flat.numel(), flat.dtype, (packed,), const=1)

    def decode(self, enc, out, force_torch=False):
        _unpack_const(enc.parts[0], 1, out, force_torch)


class BinaryCodec(Codec):
    """Every element 0 or one constant bit pattern c (float dropout masks, all-zero tensors)."""

    name = "binary"
    needs = "bits"

    def view_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        return None if dtype == torch.bool else bits_dtype(dtype)     # bools: bitmask, no analysis

    def size(self, flat, info):
        return (flat.numel() + 7) // 8 if info is not None and info.binary else None

    def encode(self, flat, info, force_torch=False):
        packed = _pack(flat, force_torch)
        return Encoded(self.name, flat.numel(), flat.dtype, (packed,), const=info.const)

    def decode(self, enc, out, force_torch=False):
        _unpack_const(enc.parts[0], enc.const, out, force_torch)


class SparseCodec(Codec):
    """Bitmask of non-zero elements + the non-zero elements (bit patterns, so -0.0 is kept)."""

    name = "sparse"
    needs = "bits"

    def view_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        return None if dtype == torch.bool else bits_dtype(dtype)

    def size(self, flat, info):
        if info is None:
            return None
        return (flat.numel() + 7) // 8 + (info.nnz + 1) * flat.element_size()

    def encode(self, flat, info, force_torch=False):
        n = flat.numel()
        packed = torch.empty((n + 7) // 8, dtype=torch.uint8, device=flat.device)
        vals = torch.empty(info.nnz + 1, dtype=flat.dtype, device=flat.device)
        kernel = _numba(_K_SP_ENC, flat, force_torch)
        if kernel is not None:
            k = kernel(flat.numpy(), packed.numpy(), vals.numpy())
            if k != info.nnz:
                raise RuntimeError(f"sparse codec: {k} non-zeros, expected {info.nnz}: the tensor "
                                   "changed after analysis without a version-counter bump")
        else:
            # Each non-zero goes to its rank among the non-zeros (a running count kept on the device), each
            # zero to the spare slot: no host read of the data (boolean indexing would wait for the device).
            spare = info.nnz
            off = torch.zeros((), dtype=torch.int64, device=flat.device)
            for s, e in _chunks(n, _SPARSE_CHUNK):
                chunk = flat[s:e]
                mask = chunk != 0
                packed[s // 8: (e + 7) // 8] = _torch_pack(mask)
                pos = torch.cumsum(mask, 0) + (off - 1)
                off = pos[-1] + 1
                vals.index_put_((torch.where(mask, pos, spare).clamp_(0, spare),), chunk)
            vals[spare] = 0
        return Encoded(self.name, n, flat.dtype, (packed, vals), nnz=info.nnz)

    def decode(self, enc, out, force_torch=False):
        packed, vals = enc.parts
        kernel = _numba(_K_SP_DEC, out, force_torch)
        if kernel is not None:
            kernel(packed.numpy(), vals.numpy(), out.numpy())
            return
        # Element i of a chunk takes the value at its non-zero rank where its bit is set: a gather, no host read.
        off = torch.zeros((), dtype=torch.int64, device=out.device)
        for s, e in _chunks(enc.numel, _SPARSE_CHUNK):
            mask = _torch_unpack(packed[s // 8: (e + 7) // 8], e - s)
            pos = torch.cumsum(mask, 0) + (off - 1)
            off = pos[-1] + 1
            got = vals.index_select(0, pos.clamp_(0, enc.nnz))
            out[s:e] = torch.where(mask, got, torch.zeros((), dtype=got.dtype, device=got.device))


_NARROW_SOURCES = (torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64)


class NarrowCodec(Codec):
    """Integer elements that span less than 2^(8k) (k = 1, 2, 4 bytes, narrower than the source):
    keeps each element's low k bytes. Decoding sign-extends them and adds back the high bytes:
    x = lo + ((low - lo) mod 2^(8k)), exact because 0 <= x - lo < 2^(8k). Works on bit patterns (an
    unsigned source is seen through its signed view), never on floats (their bit patterns almost never
    span a narrow range, and a range pass on every activation would be wasted)."""

    name = "narrow"
    needs = "span"

    def view_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        return bits_dtype(dtype) if dtype in _NARROW_SOURCES else None

    @staticmethod
    def width(flat: torch.Tensor, span: Span) -> int | None:
        """Bytes kept per element, or None when no narrower width holds the span."""
        for k in (1, 2, 4):
            if k < flat.element_size() and span.hi - span.lo < 1 << (8 * k):
                return k
        return None

    def size(self, flat, info):
        k = None if info is None else self.width(flat, info)
        return None if k is None else flat.numel() * k

    def encode(self, flat, info, force_torch=False):
        k = self.width(flat, info)
        assert k is not None
        w = flat.element_size()
        kept = torch.empty(flat.numel(), dtype=_INT_OF_WIDTH[k], device=flat.device)
        kernel = _numba(_K_NARROW_ENC, flat, force_torch)
        if kernel is not None:
            kernel(flat.numpy(), kept.numpy())
        else:
            # The low k bytes of each element as a strided view of the same bytes: a same-dtype copy
            # moves bits and depends on no integer-conversion rule (torch does not promise wrap-around).
            low = flat.view(_INT_OF_WIDTH[k]).view(-1, w // k)[:, 0 if sys.byteorder == "little" else w // k - 1]
            kept.copy_(low)
        return Encoded(self.name, flat.numel(), flat.dtype, (kept,), const=info.lo)

    def decode(self, enc, out, force_torch=False):
        kept = enc.parts[0]
        mask = (1 << (8 * kept.element_size())) - 1
        lo = enc.const
        # kept = x mod 2^8k (sign-extended); (kept - (lo mod 2^8k)) mod 2^8k = x - lo, and that
        # difference stays within +-2^(8k) (no int overflow); adding lo back gives x.
        kernel = _numba(_K_NARROW_DEC, out, force_torch)
        if kernel is not None:
            kernel(kept.numpy(), np.int64(lo & mask), np.int64(mask), np.int64(lo), out.numpy())
            return
        out.copy_(kept)                 # in place on ``out``, no temporaries
        out.sub_(lo & mask).bitwise_and_(mask).add_(lo)


class _FloatCast(Codec):
    """float32 -> a 16-bit float (round to nearest even)."""

    lossless = False
    target: torch.dtype = torch.bfloat16
    limit: float = math.inf          # largest finite |x| that does not overflow

    def view_dtype(self, dtype):
        return torch.float32 if dtype == torch.float32 else None

    def size(self, flat, info):
        if info is not None and info.finite_max > self.limit:
            return None
        return flat.numel() * 2

    def encode(self, flat, info, force_torch=False):
        return Encoded(self.name, flat.numel(), flat.dtype, (flat.to(self.target),))

    def decode(self, enc, out, force_torch=False):
        out.copy_(enc.parts[0])


class BF16Codec(_FloatCast):
    """float32 -> bfloat16: |x' - x| <= 2^-8 |x| + 2^-134 (the second term covers bf16 denormals);
    +-inf and NaN stay inf and NaN; finite values above ~3.39e38 round to inf."""

    name = "bf16"
    doc_bound = "|err| <= 2^-8 |x| + 2^-134"
    target = torch.bfloat16


class FP16Codec(_FloatCast):
    """float32 -> float16: |x' - x| <= 2^-11 |x| + 2^-25 (denormal half-step); only applicable when
    every finite |x| <= 65504 (otherwise it would overflow to inf)."""

    name = "fp16"
    doc_bound = "|err| <= 2^-11 |x| + 2^-25, needs max|x| <= 65504"
    target = torch.float16
    limit = 65504.0
    needs = "absmax"


class Int8Codec(Codec):
    """float32 -> int8 with one per-tensor scale s = absmax/127: q = round(x/s), x' = q*s.
    |x' - x| <= absmax/254 + absmax * 2^-22 (half a step, plus float32 rounding). Finite tensors only."""

    name = "int8"
    lossless = False
    doc_bound = "|err| <= absmax/254 + absmax*2^-22"
    needs = "absmax"

    def view_dtype(self, dtype):
        return torch.float32 if dtype == torch.float32 else None

    def size(self, flat, info):
        return flat.numel() if info is not None and info.all_finite else None

    def encode(self, flat, info, force_torch=False):
        absmax = info.finite_max  # every element is finite (size): the largest magnitude
        scale = absmax / 127.0 if absmax > 0 else 1.0
        q = torch.round(flat * (1.0 / scale)).clamp_(-127, 127).to(torch.int8)
        return Encoded(self.name, flat.numel(), flat.dtype, (q,), scale=scale)

    def decode(self, enc, out, force_torch=False):
        torch.mul(enc.parts[0], enc.scale, out=out)


class FP8Codec(Int8Codec):
    """float32 -> float8 e4m3 with one per-tensor scale s = absmax/448 (e4m3's largest finite value):
    x' = fp8(x/s)*s. |x' - x| <= 2^-4 |x| + absmax * 2^-10 / 448 + absmax * 2^-22 (3 mantissa bits;
    the middle term is e4m3's denormal half-step, scaled). Finite tensors only."""

    name = "fp8"
    doc_bound = "|err| <= 2^-4|x| + absmax*2^-10/448 + absmax*2^-22"

    def encode(self, flat, info, force_torch=False):
        absmax = info.finite_max
        scale = absmax / 448.0 if absmax > 0 else 1.0
        q = (flat * (1.0 / scale)).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
        return Encoded(self.name, flat.numel(), flat.dtype, (q,), scale=scale)

    def decode(self, enc, out, force_torch=False):
        torch.mul(enc.parts[0].to(torch.float32), enc.scale, out=out)


class CodecPasses:
    """One tensor's bytes as the codecs see them: each dtype view and each one-pass statistic is made once
    and shared by the codecs that read it (the compress policy's choice, a compiled graph's saved tensor).

    ``view(dtype)`` returns the bytes as a flat 1-D tensor of ``dtype`` (no copy); ``nbytes`` is their size.
    ``wait``: compute statistics now (the host waits for them: a CPU tensor, or a caller that can afford a
    device synchronisation) or, where False, queue them (:class:`DeviceStats`): :meth:`smallest` then
    returns :data:`PENDING` until they have arrived. Ask again later through the same object, after
    :meth:`rebind` to the tensor's current views (the object keeps no reference to the bytes between).
    """

    def __init__(self, dtype: torch.dtype, nbytes: int, view: Callable[[torch.dtype], torch.Tensor],
                 force_torch: bool = False, wait: bool = True) -> None:
        self.dtype, self.nbytes, self._view, self.force_torch, self.wait = dtype, nbytes, view, force_torch, wait
        self._flat: dict[torch.dtype, torch.Tensor] = {}
        self._stats: dict[str, Any] = {}

    def flat(self, vdt: torch.dtype) -> torch.Tensor:
        got = self._flat.get(vdt)
        if got is None:
            got = self._flat[vdt] = self._view(vdt)
        return got

    def rebind(self, view: Callable[[torch.dtype], torch.Tensor] | None) -> None:
        """Views of the tensor from now on (None: drop them, keeping the statistics and those in flight)."""
        self._flat.clear()
        self._view = view if view is not None else _no_view

    def info(self, needs: str, flat: torch.Tensor) -> Any:
        """The statistics ``needs`` names, or :data:`PENDING` while queued ones have not arrived."""
        if not needs:
            return None
        got = self._stats.get(needs)
        if got is None:  # codecs that need the same statistics read the same bits (see view_dtype)
            kind = _STATS[needs]
            if self.wait or flat.device.type == "cpu" and not self.force_torch:
                got = self._stats[needs] = kind.of(flat, self.force_torch)
                return got
            got = self._stats[needs] = kind.later(flat)
        if type(got) is DeviceStats:
            done = got.result()
            if done is None:
                return PENDING
            got = self._stats[needs] = done
        return got

    def smallest(self, codecs: Iterable[Codec], limit: float) -> tuple[int, Codec, Any] | None | object:
        """``(size, codec, info)`` of the codec whose encoding is smallest and at most ``limit`` bytes
        (``info``: the statistics its ``encode`` takes), None where none applies within it, or
        :data:`PENDING` where queued statistics have not arrived yet (every codec's are queued at once)."""
        best: tuple[int, Codec, Any] | None = None
        pending = False
        for codec in codecs:
            vdt = codec.view_dtype(self.dtype)
            if vdt is None or self.nbytes == 0 or self.nbytes % vdt.itemsize:
                continue
            flat = self.flat(vdt)
            info = self.info(codec.needs, flat)
            if info is PENDING:
                pending = True
                continue
            size = codec.size(flat, info)
            if size is not None and size <= limit and (best is None or size < best[0]):
                best = (size, codec, self._stats.get(codec.needs))
        return PENDING if pending else best


PENDING = object()  # CodecPasses: the statistics a codec decides from are queued and have not arrived


def _no_view(dtype: torch.dtype) -> torch.Tensor:
    raise RuntimeError("CodecPasses: the tensor's views were dropped (rebind them before asking again)")


def _pack(flat: torch.Tensor, force_torch: bool) -> torch.Tensor:
    packed = torch.empty((flat.numel() + 7) // 8, dtype=torch.uint8, device=flat.device)
    kernel = _numba(_K_PACK, flat, force_torch)
    if kernel is not None:
        kernel(flat.numpy(), packed.numpy())
        return packed
    for s, e in _chunks(flat.numel()):
        packed[s // 8: (e + 7) // 8] = _torch_pack(flat[s:e] != 0)
    return packed


def _byte_lut(const: int) -> np.ndarray:
    """lut[b] = the 8 bytes (little-endian) that byte b unpacks to: ``const`` where bit i is set."""
    bits = (np.arange(256)[:, None] >> np.arange(8)) & 1
    return (bits * (const & 0xFF) << (8 * np.arange(8))).sum(1).astype(np.uint64).view(np.int64)


def _unpack_const(packed: torch.Tensor, const: int, out: torch.Tensor, force_torch: bool) -> None:
    kernel = _numba(_K_UNPACK, out, force_torch)
    if kernel is not None:
        arr = out.numpy()
        full = 0
        if arr.itemsize == 1 and out.data_ptr() % 8 == 0 and _K_UNPACK_BYTES.compiled() is not None:
            full = arr.shape[0] // 8               # 8 elements per int64 store: ~8x fewer stores
            _K_UNPACK_BYTES.compiled()(packed.numpy()[:full], _byte_lut(const), arr[: 8 * full].view(np.int64))
        if full * 8 < arr.shape[0]:
            kernel(packed.numpy()[full:], arr.dtype.type(const), arr[8 * full:])
        return
    for s, e in _chunks(out.numel()):
        mask = _torch_unpack(packed[s // 8: (e + 7) // 8], e - s)
        out[s:e] = mask.to(out.dtype) * const


LOSSLESS: dict[str, Codec] = {c.name: c for c in (BitmaskCodec(), BinaryCodec(), SparseCodec(), NarrowCodec())}
LOSSY: dict[str, Codec] = {c.name: c for c in (BF16Codec(), FP16Codec(), FP8Codec(), Int8Codec())}


def get_codec(name: str) -> Codec:
    """The codec called ``name``; an unknown name raises UnknownNameError listing them all."""
    codec = LOSSLESS.get(name) or LOSSY.get(name)
    if codec is None:
        raise UnknownNameError("codec", name, list(LOSSLESS) + list(LOSSY))
    return codec
