"""The native allocator device: exact live/peak bytes of the CPU allocator, a hard cap, and eviction at
allocation time, with nothing per op in Python.

    meter = cpumeter.load()          # None when unavailable: see unavailable_reason()
    if meter is not None:
        meter.install()
        loss = model(x).sum(); loss.backward()
        meter.peak_bytes
        meter.uninstall()

With a budget (:meth:`CpuAllocatorMeter.set_budget`) the wrapper is the managed CPU device: an allocation
that would take its bytes over the budget first frees *registered* storages (saved activations the
runtime can regenerate, :meth:`CpuAllocatorMeter.register`) whose only references are the runtime's, then
raises ``torch.OutOfMemoryError``; no Python runs inside the allocator. Built against CUDA (where torch
has CUDA and its headers are installed), the same registry answers the CUDA caching allocator's
free-memory callback (:meth:`CpuAllocatorMeter.set_cuda_budget`).

PyTorch keeps no allocator statistics on the CPU, so ``_cpumeter.cpp`` (next to this file) wraps
the allocator that ``c10::GetCPUAllocator()`` returns and installs the wrapper with
``c10::SetCPUAllocator``. Every allocation made through it is counted (bytes requested, i.e. the
storage's ``nbytes``) until its storage is freed, also when the free happens after ``uninstall()``.
Memory allocated before ``install()`` (or by other allocators: pinned memory, other devices) is not
counted, and its frees are not seen. The allocator is process-global: allocations on every thread
count. A storage allocated while installed keeps the wrapper as its allocator, so its resizes are
counted even after ``uninstall()``.

The wrapper supports the raw interface (``raw_allocate``/``raw_deallocate``), which ideep/oneDNN
use for their buffers: they free through whatever allocator is current *at the free*. A buffer
allocated before install and freed while installed is handed to the wrapped allocator (not counted);
one allocated while installed and freed after uninstall stays counted (and known to :meth:`lookup`)
until its address is allocated through the meter again. Convolutions free their oneDNN buffers
before returning, so this only matters when install/uninstall happens while such a buffer is alive.

The source is compiled on first use with the system C++ compiler and cached (:mod:`.build` says how and
why not through ``torch.utils.cpp_extension``). ``HYBRIDMEM_NATIVE=0`` disables it. Any failure (no
compiler, compile or load error) makes :func:`load` return None and :func:`unavailable_reason` say why;
nothing is raised on import. The loaded library is never unloaded: deleters of live tensors point into it.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from .build import open_library

__all__ = ["CpuAllocatorMeter", "load", "unavailable_reason", "library_path", "cuda_note"]

_LOCK = threading.Lock()
_TRIED = False
_METER: CpuAllocatorMeter | None = None
_REASON: str | None = None
_LIB_PATH: Path | None = None
_CUDA_NOTE: str | None = None  # why the library has no CUDA hook (None when it has one or was not built)
_CUDA_STATS = {"allocated": 0, "peak": 1, "reserved": 2, "ooms": 3}  # hm_cuda_stat's `which`


class CpuAllocatorMeter:
    """Thin wrapper over the native meter's C functions (one per process; get it from :func:`load`).

    The meter is process-global: it counts allocations made on every thread while installed.
    ``current_bytes``/``peak_bytes`` count only allocations made through it (see the module docstring).
    """

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self._lib = lib
        # The registry calls that take or drop a storage reference may release a Python object: they
        # must keep the GIL (PyDLL); everything else releases it (CDLL) like any allocator call.
        self._py = ctypes.PyDLL(str(path))
        _declare(self._py)
        self.path = path  # the loaded shared library
        self.cuda_hook = bool(lib.hm_cuda_hook())  # built against CUDA: the caching-allocator callback
        self._drain_buf = (ctypes.c_int64 * 256)()
        self._users = 0                # acquire() calls not yet released
        self._found_installed = False  # installed when the first of them came: left so by the last release

    def acquire(self) -> None:
        """Install for one user among several (a runtime, a compiled step's measurement, a capture): the
        meter stays installed until every user released it, and is then left as the first found it. Plain
        :meth:`install`/:meth:`uninstall` are for a caller that owns the allocator alone."""
        if self._users == 0:
            self._found_installed = self.installed
            self.install()
        self._users += 1

    def release(self) -> None:
        """One user of :meth:`acquire` is done (a no-op where none is left)."""
        if self._users == 0:
            return
        self._users -= 1
        if self._users == 0 and not self._found_installed:
            self.uninstall()

    def install(self) -> None:
        """Makes the meter the CPU allocator (idempotent). Raises RuntimeError if that did not take effect."""
        status = self._lib.hm_install()
        if status == -1:
            raise RuntimeError("hybridmem cpumeter: cannot install: the meter is still installed under "
                               "another allocator that replaced it; uninstall that one first")
        if status != 1:
            raise RuntimeError("hybridmem cpumeter: c10::SetCPUAllocator did not take effect at any "
                               "priority; the CPU allocator is unchanged")

    def uninstall(self) -> None:
        """Restores the allocator that was current before :meth:`install` (no-op when not installed).

        Raises RuntimeError if another allocator replaced the meter since install (the meter is then left
        in place under it, since restoring would drop that allocator) or if the restore did not take effect.
        """
        status = self._lib.hm_uninstall()
        if status == -1:
            raise RuntimeError("hybridmem cpumeter: cannot uninstall: another allocator replaced the meter "
                               "as the CPU allocator after install; uninstall that one first")
        if status == -2:
            raise RuntimeError("hybridmem cpumeter: restoring the previous CPU allocator did not take effect")

    @property
    def installed(self) -> bool:
        """True when ``c10::GetCPUAllocator()`` is the meter now."""
        return bool(self._lib.hm_installed())

    @property
    def current_bytes(self) -> int:
        """Bytes of live allocations made through the meter."""
        return int(self._lib.hm_current())

    @property
    def current_fn(self) -> Any:
        """The C function behind :attr:`current_bytes` (ctypes), for callers that read it per op."""
        return self._lib.hm_current

    @property
    def peak_bytes(self) -> int:
        """Largest ``current_bytes`` since the library was loaded or :meth:`reset_peak`."""
        return int(self._lib.hm_peak())

    @property
    def serial(self) -> int:
        """Number of allocations counted so far (monotonic; the serial of the latest one)."""
        return int(self._lib.hm_serial())

    def reset_peak(self) -> None:
        """Sets ``peak_bytes`` to ``current_bytes`` (call it while no other thread allocates)."""
        self._lib.hm_reset_peak()

    # ---- the cap -----------------------------------------------------------------------------
    def set_budget(self, budget: int | None) -> None:
        """Caps ``current_bytes`` at ``budget`` (None: no cap). Past it an allocation frees registered
        storages, then raises ``torch.OutOfMemoryError``."""
        self._lib.hm_set_budget(-1 if budget is None else int(budget))

    @property
    def budget(self) -> int | None:
        b = int(self._lib.hm_budget())
        return None if b < 0 else b

    def set_soft(self, on: bool) -> None:
        """Soft cap: an allocation past the budget that freeing registered storages cannot make room for goes
        through and is noted (:meth:`soft_take`) instead of raising. For code with no hook around the op
        that allocates (a steady-state step), which recovers at its next hook."""
        self._lib.hm_set_soft(1 if on else 0)

    def soft_take(self) -> tuple[int, int, int]:
        """``(count, bytes, held)``: the refusals the soft cap let through since the last call, the first
        one's request and the bytes held then. Resets the count."""
        out = (ctypes.c_int64 * 2)()
        n = int(self._lib.hm_soft_take(out))
        return (n, int(out[0]), int(out[1])) if n else (0, 0, 0)

    def add_external(self, nbytes: int) -> None:
        """Counts ``nbytes`` more (negative: fewer) held outside the wrapper: memory allocated before it
        was installed (parameters, inputs) that the device holds all the same."""
        self._lib.hm_add_external(int(nbytes))

    def cap_exempt(self, enter: bool) -> None:
        """Exempts (``True``) or stops exempting this thread's allocations from the cap (nested)."""
        self._lib.hm_cap_exempt(1 if enter else 0)

    def window_reset(self) -> None:
        """Starts a second peak window at the current level (see :attr:`window_peak`)."""
        self._lib.hm_window_reset()

    @property
    def window_peak(self) -> int:
        """Largest ``current_bytes`` since :meth:`window_reset` (per-op scratch during capture)."""
        return int(self._lib.hm_window_peak())

    @property
    def refused(self) -> int:
        """Allocations refused past the budget so far."""
        return int(self._lib.hm_refused())

    @property
    def reclaimed_bytes(self) -> int:
        """Bytes of registered storages freed at allocation time so far."""
        return int(self._lib.hm_reclaimed_bytes())

    # ---- registry of evictable storages ------------------------------------------------------
    def register(self, key: int, storage: torch.UntypedStorage, limit: int, priority: float) -> bool:
        """Lets the allocator free ``storage``'s data while its use count is <= ``limit`` (count the
        caller's references plus one for the registry's). Lower ``priority`` goes first."""
        return bool(self._py.hm_reg_add(key, storage._cdata, limit, priority))

    def claim(self, key: int) -> int:
        """Takes ``key`` out of the registry: 1 = its data is there, 0 = the allocator freed it,
        -1 = unknown. Call it before reading a registered storage."""
        return int(self._py.hm_reg_claim(key))

    def drain(self) -> list[int]:
        """Keys of registered storages the allocator freed since the last call."""
        out: list[int] = []
        buf = self._drain_buf
        while True:
            n = int(self._lib.hm_reg_drain(buf, len(buf)))
            out.extend(buf[:n])
            if n < len(buf):
                return out

    @property
    def pending_drops(self) -> int:
        """Number of freed keys :meth:`drain` would return."""
        return int(self._lib.hm_reg_pending())

    def set_cuda_budget(self, device: int, budget: int | None, headroom: int = 0) -> None:
        """CUDA (needs :attr:`cuda_hook`): on a caching-allocator cache miss, free registered CUDA
        storages while ``memory_allocated`` is above ``budget - headroom``."""
        if not self.cuda_hook:
            raise RuntimeError("hybridmem's native library was built without CUDA: " + (_CUDA_NOTE or ""))
        self._lib.hm_cuda_set_budget(int(device), -1 if budget is None else int(budget), int(headroom))

    def cuda_need(self, reserved: int, budget: int | None, headroom: int, slack: int | None = None) -> int:
        """The bytes the CUDA callback frees on a cache miss with ``reserved`` bytes reserved (the same C
        function; no CUDA needed): those by which ``reserved + slack`` passes ``budget - headroom``, else 0.
        ``slack``: the expandable-segment page rounding the callback allows for (default: its own)."""
        s = int(self._lib.hm_cuda_slack()) if slack is None else int(slack)
        return int(self._lib.hm_cuda_need(int(reserved), s, -1 if budget is None else int(budget), int(headroom)))

    @property
    def cuda_registered(self) -> bool:
        """True when c10's CUDA free-memory callback registry holds hybridmem's callback."""
        return self.cuda_hook and bool(self._lib.hm_cuda_registered())

    @property
    def cuda_calls(self) -> int:
        """How often the CUDA caching allocator called the callback (cache misses while a budget is set)."""
        return int(self._lib.hm_cuda_calls()) if self.cuda_hook else 0

    @property
    def cuda_freed_bytes(self) -> int:
        """Bytes the callback freed for the CUDA caching allocator so far."""
        return int(self._lib.hm_cuda_freed()) if self.cuda_hook else 0

    def cuda_reader(self, which: str, device: int) -> Callable[[], int]:
        """A function of no argument reading one caching-allocator counter of CUDA device ``device`` in C
        (-1 where the allocator cannot answer). ``which``: ``allocated``, ``peak``, ``reserved`` (bytes) or
        ``ooms`` (refusals). Needs :attr:`cuda_hook`."""
        if not self.cuda_hook:
            raise RuntimeError("hybridmem's native library was built without CUDA: " + (_CUDA_NOTE or ""))
        code = _CUDA_STATS.get(which)
        if code is None:
            raise ValueError(f"cuda_reader({which!r}): expected one of {sorted(_CUDA_STATS)}")
        return functools.partial(self._lib.hm_cuda_stat, int(device), code)

    def lookup(self, data_ptr: int) -> tuple[int, int] | None:
        """``(bytes, serial)`` of the live allocation made through the meter whose data pointer is
        ``data_ptr`` (use ``t.untyped_storage().data_ptr()``, the storage's base), else None."""
        if not isinstance(data_ptr, int) or isinstance(data_ptr, bool) or data_ptr < 0:
            raise TypeError(f"lookup(data_ptr): expected a non-negative int address, got {data_ptr!r}")
        nbytes, serial = ctypes.c_int64(), ctypes.c_int64()
        if not self._lib.hm_lookup(data_ptr, ctypes.byref(nbytes), ctypes.byref(serial)):
            return None
        return nbytes.value, serial.value

    @property
    def serial_of_fn(self) -> Any:
        """The C function behind :meth:`serial_of` (ctypes), for callers that save the method call."""
        return self._lib.hm_serial_of

    def serial_of(self, data_ptr: int) -> int:
        """The serial of the live allocation made through the meter at ``data_ptr``, else -1 (the fast
        form of :meth:`lookup` for hot paths: no checks, no out-parameters)."""
        return self._lib.hm_serial_of(data_ptr)

    def __repr__(self) -> str:
        return (f"CpuAllocatorMeter(installed={self.installed}, current_bytes={self.current_bytes}, "
                f"peak_bytes={self.peak_bytes}, serial={self.serial})")


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (one line), or None when it did not (or was not called yet)."""
    return _REASON


def cuda_note() -> str | None:
    """Why the native library was built without the CUDA caching-allocator hook, or None."""
    return _CUDA_NOTE


def _after_fork_in_child() -> None:
    # A forked child (DataLoader worker) inherits the parent's cap and registry: start it unmanaged.
    if _METER is not None:
        _METER._lib.hm_after_fork_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def library_path() -> Path | None:
    """Path of the loaded shared library, or None."""
    return _LIB_PATH


def load() -> CpuAllocatorMeter | None:
    """The process's meter, building the library on first use; None when unavailable (never raises)."""
    global _TRIED, _METER, _REASON, _LIB_PATH
    with _LOCK:
        if not _TRIED:
            _TRIED = True
            try:
                _METER, _REASON = _load()
            except Exception as e:  # never raise: the meter is optional
                _METER, _REASON = None, f"{type(e).__name__}: {e}"
            if _METER is not None:
                _LIB_PATH = _METER.path
        return _METER


def _load() -> tuple[CpuAllocatorMeter | None, str | None]:
    global _CUDA_NOTE
    if os.environ.get("HYBRIDMEM_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by HYBRIDMEM_NATIVE=0"
    opened = open_library()
    _CUDA_NOTE = opened.cuda_note
    if opened.lib is None or opened.path is None:
        return None, opened.reason
    _declare(opened.lib)
    return CpuAllocatorMeter(opened.lib, opened.path), None


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32 = ctypes.c_int64, ctypes.c_int
    for name, res, args in [
        ("hm_install", i32, []), ("hm_uninstall", i32, []), ("hm_installed", i32, []),
        ("hm_priority", i32, []), ("hm_current", i64, []), ("hm_peak", i64, []),
        ("hm_reset_peak", None, []), ("hm_serial", i64, []),
        ("hm_orphan_frees", i64, []), ("hm_stale_entries", i64, []),
        ("hm_raw_allocate", ctypes.c_size_t, [i64]), ("hm_raw_deallocate", i32, [ctypes.c_size_t]),
        ("hm_lookup", i32, [ctypes.c_size_t, ctypes.POINTER(i64), ctypes.POINTER(i64)]),
        ("hm_serial_of", i64, [ctypes.c_size_t]),
        ("hm_set_budget", None, [i64]), ("hm_budget", i64, []), ("hm_add_external", i64, [i64]),
        ("hm_set_soft", None, [i32]), ("hm_soft_take", i64, [ctypes.POINTER(i64)]),
        ("hm_cap_exempt", i32, [i32]), ("hm_window_reset", None, []),
        ("hm_window_peak", i64, []), ("hm_refused", i64, []), ("hm_reclaimed_bytes", i64, []),
        ("hm_reg_add", i32, [i64, ctypes.c_size_t, i64, ctypes.c_double]),
        ("hm_reg_claim", i32, [i64]), ("hm_reg_drain", i64, [ctypes.POINTER(i64), i64]),
        ("hm_reg_pending", i64, []), ("hm_after_fork_child", None, []), ("hm_cuda_hook", i32, []),
        ("hm_cuda_need", i64, [i64, i64, i64, i64]), ("hm_cuda_slack", i64, []),
    ]:
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    if lib.hm_cuda_hook():
        for name, res, args in [("hm_cuda_set_budget", None, [i32, i64, i64]), ("hm_cuda_calls", i64, []),
                                ("hm_cuda_registered", i32, []),
                                ("hm_cuda_freed", i64, []), ("hm_cuda_stat", i64, [i32, i32])]:
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args
