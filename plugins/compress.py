"""Compress policy: replace a saved tensor's device bytes by a smaller encoding on the same device.

Lossless codecs (``bitmask``, ``binary``, ``sparse``, ``narrow``: see :mod:`hybridmem.plugins.codecs`) are picked
per tensor when the encoding is at most ``max_ratio`` of the storage; lossy ones (``bf16``, ``fp16``,
``fp8``, ``int8``) only when named::

    policy = CompressPolicy()                   # lossless only: regenerate() is bit-identical
    policy = CompressPolicy(lossy=("bf16",))    # bf16 where no lossless codec pays

Deciding costs one pass over the tensor (bit statistics; for integer tensors also their range); the
decision is cached per entry and reused while the storage and its version counter are unchanged.
:meth:`CompressPolicy.estimate` asks the same question without caching or counting anything.

On CUDA the pass is queued and its results copied to pinned host memory behind it (``wait_for_stats``):
until they have arrived the tensor is not applicable (the runtime evicts another meanwhile), and the
next time it is asked the decision is read from them. No decision waits for the device; codecs that
decide without the bytes (``bitmask`` for bool tensors, ``bf16``) decide at once.
"""
from __future__ import annotations

import copy
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, Iterable

import torch

from hybridmem.errors import UnknownNameError
from hybridmem.graph.costs import get_cost_model
from hybridmem.entry import Entry

from .base import EntryView, EvictionDeclined, PolicyHints
from .codecs import (LOSSLESS, LOSSY, PENDING, Analysis, Codec, CodecPasses, Encoded, Geometry, Span, Stamp,
                     entry_version, flat_view, supported)

# Encode/decode throughput in bytes of the original per second, for cost() without a cost model.
# CPU: best of many rounds on the development machine (2 shared Zen 3 cores, 1 thread, 16 MiB inputs:
# bench/test_bench_scorer.py), rounded down to allow for load. CUDA: guesses for memory-bound passes
# (not yet measured on a GPU).
_THROUGHPUT = {
    "cpu": {"bitmask": (4e9, 6e9), "binary": (6e9, 6e9), "sparse": (1.5e9, 1.2e9), "narrow": (1e9, 1e9),
            "bf16": (5e9, 5e9), "fp16": (5e9, 5e9), "fp8": (0.4e9, 0.2e9),
            "int8": (0.4e9, 1.5e9)},
    "cuda": {"bitmask": (1e11, 1e11), "binary": (1e11, 1e11), "sparse": (3e10, 5e10), "narrow": (1e11, 1e11),
             "bf16": (2e11, 2e11), "fp16": (1e11, 2e11), "fp8": (5e10, 2e11),
             "int8": (5e10, 2e11)},
}
# hybridmem.graph.costs knows codecs by the kind of work: a cast, zero-value compression, a plain transform
_COST_MODEL_CODEC = {"sparse": "zvc", "bitmask": "", "binary": "", "narrow": "", "bf16": "bf16", "fp16": "fp16",
                     "fp8": "fp8", "int8": "fp8"}
_LATENCY = {"cpu": 20e-6, "cuda": 50e-6}   # per call: a few kernel launches / Python overhead


@dataclass(frozen=True)
class _Choice:
    codec: Codec | None               # None: nothing pays (cached negative decision)
    size: int
    stamp: Stamp | None               # the bytes it was decided for
    info: Analysis | Span | None      # the statistics the codec's encode() takes


@dataclass(eq=False)
class _Compressed:
    enc: Encoded
    geom: Geometry
    choice: _Choice
    version: int                          # entry_version() at eviction
    ready: torch.Tensor | None = None     # decoded ahead of use by prefetch()


class CompressPolicy:
    """Evict by compressing in place on the device; regenerate by decoding.

    ``lossy``: names of lossy codecs allowed (default none; the policy is then lossless).
    ``lossless_codecs``: which lossless codecs to try. ``max_ratio``: a codec is applicable only if its
    encoding is at most this fraction of the storage. ``prefer_lossless``: a lossless codec that pays
    wins over a smaller lossy one. ``cost_model``: a :mod:`hybridmem.graph.costs` model or its name
    (``compress_time`` / ``decompress_time(nbytes, codec, ratio)``); default: the measured table above.
    ``force_torch``: use the torch kernels on the CPU too (tests; they are the CUDA kernels).
    ``wait_for_stats``: whether a decision may wait for its statistics; default: on the CPU (the host
    computes them), never on CUDA (they are queued and read once arrived: see the module docstring).
    """

    name = "compress"
    # Evicting allocates the encoded copy before the original's bytes go: the runtime keeps room for it. The
    # copy stays on the device (``device_tensors`` names it); lossy codecs make it unverifiable (__init__).
    hints = PolicyHints(allocates_to_evict=True)

    def __init__(self, lossy: Iterable[str] = (), lossless_codecs: Iterable[str] = tuple(LOSSLESS),
                 max_ratio: float = 0.6, prefer_lossless: bool = True, cost_model: Any = None,
                 force_torch: bool = False, wait_for_stats: bool | None = None):
        known = list(LOSSLESS) + list(LOSSY)
        if isinstance(lossy, str):
            lossy = (lossy,) if lossy else ()
        for n in (*lossy, *lossless_codecs):
            if n not in LOSSLESS and n not in LOSSY:
                raise UnknownNameError("codec", n, known)
        self.lossless_codecs = [LOSSLESS[n] for n in lossless_codecs if n in LOSSLESS]
        self.lossy_codecs = [LOSSY[n] for n in lossy if n in LOSSY]
        bad = [n for n in lossless_codecs if n in LOSSY]
        if bad:
            raise ValueError(f"lossy codecs {bad} must be given in lossy=, not lossless_codecs=")
        self.lossless = not self.lossy_codecs
        self.hints = replace(self.hints, verifiable=self.lossless)  # a lossy decode differs from what was evicted
        self.max_ratio = float(max_ratio)
        self.prefer_lossless = prefer_lossless
        self.force_torch = force_torch          # tests: exercise the torch kernels on CPU
        self.wait_for_stats = wait_for_stats
        self.cost_model = _resolve_cost_model(cost_model)
        self._choices: weakref.WeakKeyDictionary[EntryView, _Choice] = weakref.WeakKeyDictionary()
        # the last choice made per recorded lineage node: what the scorer is offered for a later step's save
        # of the same node before its own bytes are read (a steady-state step binds its saves to the recorded
        # program's nodes). On the CPU the analysis reads every byte of a candidate at each scoring pass:
        # MobileNetV2's steady step spent 140 ms of 1.2 s analysing candidates it did not compress.
        self._hints: weakref.WeakKeyDictionary[Any, _Choice] = weakref.WeakKeyDictionary()
        self._handles: weakref.WeakKeyDictionary[EntryView, _Compressed] = weakref.WeakKeyDictionary()
        # decisions whose statistics are queued on the device: (the bytes they are for, the passes)
        self._pending: weakref.WeakKeyDictionary[EntryView, tuple[Stamp, CodecPasses]] = weakref.WeakKeyDictionary()
        self.stats: dict[str, float] = {
            "evictions": 0, "regenerations": 0, "prefetches": 0, "bytes_in": 0, "bytes_out": 0,
            "encode_s": 0.0, "decode_s": 0.0, "exposed_s": 0.0, "analyses": 0, "analyze_s": 0.0,
            "analyses_refused": 0, "analyses_pending": 0,
        }
        self.codec_counts: dict[str, int] = {}

    # ---- decision --------------------------------------------------------------------------------
    def choose(self, entry: EntryView) -> _Choice | None:
        """The codec for ``entry``'s current bytes (cached), or None when none pays or applies."""
        t = entry.tensor
        if not supported(t):
            return None
        cached = self._choices.get(entry)
        if cached is not None and cached.stamp is not None and cached.stamp.matches(entry):
            return cached if cached.codec is not None else None
        pending = self._pending.pop(entry, None)
        passes = pending[1] if pending is not None and pending[0].matches(entry) else None
        t0 = time.perf_counter()
        try:
            stamp = Stamp.of(entry)
            choice, passes = self._decide(t, stamp, passes)
            if choice is None:  # statistics queued on the device, not arrived: not compressible for now
                passes.rebind(None)  # hold no reference to the bytes meanwhile
                self._pending[entry] = (stamp, passes)
                self.stats["analyses_pending"] += 1
                return None
        except torch.OutOfMemoryError:
            # The analysis needs scratch on the tensor's device (CUDA: torch kernels), and it runs when the
            # runtime is making room, at the cap. Not compressible for now, decided again next time asked;
            # the other policies evict meanwhile.
            self.stats["analyses_refused"] += 1
            return None
        finally:
            self.stats["analyze_s"] += time.perf_counter() - t0
        self.stats["analyses"] += 1
        self._choices[entry] = choice
        self._hint(entry, choice)
        return choice if choice.codec is not None else None

    def offer(self, entry: EntryView) -> _Choice | None:
        """The choice the scorer is offered: the one decided for ``entry``'s current bytes, else the one made
        for the same recorded node before (its size, not its statistics: :meth:`evict` decides on the bytes
        themselves and declines where that differs), else decided now."""
        cached = self._choices.get(entry)
        if cached is not None and cached.stamp is not None and cached.stamp.matches(entry):
            return cached if cached.codec is not None else None
        hint = self._hint_for(entry)
        if hint is not None:
            return hint if hint.codec is not None else None
        return self.choose(entry)

    def _hint_for(self, entry: EntryView) -> _Choice | None:
        hint = self._hints.get(entry.lineage) if _weakable(entry.lineage) else None
        return hint if hint is not None and hint.size <= entry.nbytes and supported(entry.tensor) else None

    def _hint(self, entry: EntryView, choice: _Choice) -> None:
        if _weakable(entry.lineage):
            self._hints[entry.lineage] = _Choice(choice.codec, choice.size, None, None)

    def _decide(self, t: torch.Tensor, stamp: Stamp | None, passes: CodecPasses | None = None,
                wait: bool | None = None) -> tuple[_Choice | None, CodecPasses]:
        """The choice for ``t``'s bytes, or None while statistics queued on the device have not arrived
        (ask again with the returned passes). ``passes``: those of an earlier call for the same bytes."""
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        limit = self.max_ratio * nbytes
        view = lambda vdt: flat_view(storage, vdt, t.device)  # noqa: E731
        if passes is None:
            if wait is None:
                wait = self.wait_for_stats if self.wait_for_stats is not None else t.device.type != "cuda"
            passes = CodecPasses(t.dtype, nbytes, view, self.force_torch, wait)
        else:
            passes.rebind(view)
        best = passes.smallest(self.lossless_codecs, limit)
        if best is not PENDING and self.lossy_codecs and (best is None or not self.prefer_lossless):
            # a lossy codec wins only where it is strictly smaller (sizes are whole bytes)
            lossy = passes.smallest(self.lossy_codecs, limit if best is None else min(limit, best[0] - 1))
            best = lossy if lossy is PENDING else lossy or best
        if best is PENDING:
            return None, passes
        passes.rebind(None)
        if best is None:
            return _Choice(None, nbytes, stamp, None), passes
        return _Choice(best[1], best[0], stamp, best[2]), passes

    def reads_bytes_to_decide(self, codec: str) -> bool:
        """Whether choosing ``codec`` for a tensor reads statistics of its bytes (a device wait where they are
        not queued ahead): True for every codec but ``bitmask`` and ``bf16``, and for an unknown name."""
        c = LOSSLESS.get(codec) or LOSSY.get(codec)
        return c is None or c.reads_bytes

    def estimate(self, entry: EntryView) -> tuple[str | None, int]:
        """(codec, bytes saved) that evicting ``entry`` now would give: decided afresh, nothing cached
        or counted, the tensor only read (it waits for the statistics: not for a training step). For budgets
        and reports (a compress-only budget is the monitor peak minus a share of what this says for the
        step's saved tensors)."""
        t = entry.tensor
        if not supported(t):
            return None, 0
        choice, _ = self._decide(t, None, wait=True)
        if choice is None or choice.codec is None:
            return None, 0
        return choice.codec.name, max(0, entry.nbytes - choice.size)

    # ---- Policy protocol -------------------------------------------------------------------------
    def applicable(self, entry: EntryView) -> bool:
        return self.offer(entry) is not None

    def savings(self, entry: EntryView) -> int:
        choice = self.offer(entry)
        return 0 if choice is None else max(0, entry.nbytes - choice.size)

    def ratio(self, entry: EntryView) -> float:
        """Compressed / original bytes (1.0 when not applicable): what the simulator's plan needs."""
        choice = self.choose(entry)
        return 1.0 if choice is None or entry.nbytes == 0 else choice.size / entry.nbytes

    def cost(self, entry: EntryView) -> float:
        """Compute-stream seconds lost: encoding at eviction plus decoding at regeneration."""
        choice = self.offer(entry)
        if choice is None:
            return float("inf")
        ratio = choice.size / entry.nbytes if entry.nbytes else 1.0
        return self.codec_time(choice.codec.name, entry.nbytes, entry.device.type, ratio)

    def codec_time(self, codec: str, nbytes: int, device_type: str = "cpu", ratio: float | None = None) -> float:
        """Encode + decode seconds: from the cost model when one is set, else the measured table."""
        m = self.cost_model
        if m is not None and hasattr(m, "compress_time"):
            name = _COST_MODEL_CODEC.get(codec, "")
            dec = getattr(m, "decompress_time", m.compress_time)
            return float(m.compress_time(nbytes, name, ratio) + dec(nbytes, name, ratio))
        return sum(codec_seconds(codec, nbytes, device_type))

    def evict(self, entry: EntryView) -> _Compressed:
        hint = self._hint_for(entry)
        choice = self.choose(entry)
        if choice is None:
            if hint is not None and hint.codec is not None:  # offered by an earlier choice for the same node
                raise EvictionDeclined(f"compress: no codec pays for entry {entry.uid}'s bytes now")
            raise ValueError(f"compress: no codec applies to entry {entry.uid} "
                             f"({entry.dtype}, {entry.nbytes} bytes); check applicable() first")
        t = entry.tensor
        assert t is not None
        codec = choice.codec
        assert codec is not None
        t0 = time.perf_counter()
        flat = flat_view(t.untyped_storage(), codec.view_dtype(t.dtype), t.device)
        enc = codec.encode(flat, choice.info, self.force_torch)
        self.stats["encode_s"] += time.perf_counter() - t0
        handle = _Compressed(enc, Geometry.of(t), choice, entry_version(entry))
        del t, flat
        self._handles[entry] = handle
        self._choices.pop(entry, None)
        entry.tensor, entry.handle, entry.policy = None, handle, self.name
        self.stats["evictions"] += 1
        self.stats["bytes_in"] += handle.geom.nbytes
        self.stats["bytes_out"] += enc.nbytes
        self.codec_counts[codec.name] = self.codec_counts.get(codec.name, 0) + 1
        return handle

    def prefetch(self, entry: EntryView) -> None:
        """Decode now (on CUDA: queued kernels) so regenerate() only hands the tensor over."""
        handle = self._handle(entry)
        if handle is not None and handle.ready is None:
            handle.ready = self._decode(handle)
            self.stats["prefetches"] += 1

    def regenerate(self, entry: EntryView) -> torch.Tensor:
        if entry.tensor is not None:
            return entry.tensor
        handle = self._handle(entry)
        if handle is None:
            raise KeyError(f"compress: entry {entry.uid} was not evicted by this policy")
        if handle.ready is None:
            t0 = time.perf_counter()
            t = self._decode(handle)
            self.stats["exposed_s"] += time.perf_counter() - t0
        else:
            t = handle.ready
        del self._handles[entry]
        entry.tensor, entry.handle, entry.policy = t, None, None
        if hasattr(entry, "vshift"):            # keep tensor._version + vshift continuous, as adopt() does
            entry.vshift = handle.version - t._version
        # same bytes (lossless) or their decoded form (lossy): the decision still holds, no new pass
        self._choices[entry] = _Choice(handle.choice.codec, handle.choice.size, Stamp.of(entry),
                                       handle.choice.info)
        self.stats["regenerations"] += 1
        return t

    def device_tensors(self, handle: _Compressed) -> list[torch.Tensor]:
        """The device memory an eviction keeps (for the runtime's meter)."""
        return list(handle.enc.parts)

    def release(self, entry: EntryView) -> None:
        """Forget ``entry`` (its compressed bytes are freed with the handle)."""
        self._handles.pop(entry, None)
        self._choices.pop(entry, None)
        if entry.policy == self.name:
            entry.handle, entry.policy = None, None

    # ---- helpers ---------------------------------------------------------------------------------
    def _handle(self, entry: EntryView) -> _Compressed | None:
        h = self._handles.get(entry)
        return h if h is not None else (entry.handle if isinstance(entry.handle, _Compressed) else None)

    def _decode(self, handle: _Compressed) -> torch.Tensor:
        t0 = time.perf_counter()
        g, enc = handle.geom, handle.enc
        storage = torch.empty(g.nbytes, dtype=torch.uint8, device=g.device).untyped_storage()
        out = flat_view(storage, enc.dtype, g.device)
        LOSSLESS.get(enc.codec, LOSSY.get(enc.codec)).decode(enc, out, self.force_torch)
        self.stats["decode_s"] += time.perf_counter() - t0
        return g.rebuild(storage)


def codec_seconds(codec: str, nbytes: int, device_type: str = "cpu") -> tuple[float, float]:
    """(encode, decode) seconds of ``nbytes`` with ``codec`` on a device of this type, from the measured
    throughput table above (CUDA: its guesses)."""
    enc_bw, dec_bw = _THROUGHPUT.get(device_type, _THROUGHPUT["cuda"])[codec]
    latency = _LATENCY.get(device_type, _LATENCY["cuda"])
    return nbytes / enc_bw + latency, nbytes / dec_bw + latency


def _weakable(obj: Any) -> bool:
    """Whether ``obj`` (an entry's lineage) can key the hints: a recorded node, not None."""
    return obj is not None and hasattr(type(obj), "__weakref__")


def _resolve_cost_model(spec: Any) -> Any:
    if spec is None or not isinstance(spec, str):
        return spec
    return get_cost_model(spec)


def compressible_share(model: torch.nn.Module, loss_of: Any, exclude: Iterable[torch.Tensor] = (),
                       seed: int | None = None, policy: "CompressPolicy | None" = None) -> tuple[int, dict[str, int]]:
    """What the lossless codecs could save on one training step's saved activations.

    ``loss_of(model) -> loss`` runs the forward pass; it runs on a deep copy of ``model`` (so that
    BatchNorm statistics, gradients and the caller's model are left alone), under saved-tensor hooks
    that collect every storage autograd saves except parameters, buffers and ``exclude`` (the inputs).
    After the loss, when all of them are alive, ``policy`` (default: a lossless :class:`CompressPolicy`)
    is asked about each once (:meth:`CompressPolicy.estimate`: nothing cached or counted).
    ``seed``: the RNG seed to run the forward pass with (inside ``fork_rng``: the caller's RNG state is
    kept), so that dropout masks match a training step seeded the same way.

    Returns ``(saved_bytes, {codec: bytes it would save})``. Used for issue 3's compress-only budget
    (the monitor peak minus a share of this) by the tests and ``bench/gpu_check.py``.
    """

    policy = policy or CompressPolicy()
    model = copy.deepcopy(model)
    fixed = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers(), *exclude)}
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in fixed and st._cdata not in saved:
            saved[st._cdata] = torch.empty(0, dtype=t.dtype, device=t.device).set_(st)  # the whole storage
        # detached: an op's own output saved as itself would hold its node, which holds it (a reference cycle
        # through C++ that Python's collector cannot free: the model copy and every activation leaked)
        return t.detach()

    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_of(model)
        out: dict[str, int] = {}
        for t in saved.values():
            codec, saves = policy.estimate(Entry(tensor=t, nbytes=t.untyped_storage().nbytes(), dtype=t.dtype,
                                                 device=t.device))
            if codec is not None:
                out[codec] = out.get(codec, 0) + saves
    del loss
    return sum(t.untyped_storage().nbytes() for t in saved.values()), out
