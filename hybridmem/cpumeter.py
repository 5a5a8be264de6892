"""Native CPU allocator meter: exact live/peak bytes of the CPU allocator, with nothing per op in Python.

    meter = cpumeter.load()          # None when unavailable: see unavailable_reason()
    if meter is not None:
        meter.install()
        loss = model(x).sum(); loss.backward()
        meter.peak_bytes
        meter.uninstall()

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

The source is compiled on first use with the system C++ compiler (``$CXX``, else ``c++``/``g++``)
against torch's c10 headers and ``libc10`` (a few seconds, no pybind11), cached in
``$HYBRIDMEM_CACHE_DIR`` or ``~/.cache/hybridmem`` (a temporary directory when neither is writable)
under a name hashing the source, the torch version, the compiler and its flags, and loaded with
:mod:`ctypes`. ``HYBRIDMEM_NATIVE=0`` disables it. Any failure (no compiler, compile or load error)
makes :func:`load` return None and :func:`unavailable_reason` say why; nothing is raised on import.
The loaded library is never unloaded: deleters of live tensors point into it.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

__all__ = ["CpuAllocatorMeter", "load", "unavailable_reason", "library_path"]

_SOURCE = Path(__file__).with_name("_cpumeter.cpp")
_LOCK = threading.Lock()
_TRIED = False
_METER: CpuAllocatorMeter | None = None
_REASON: str | None = None
_LIB_PATH: Path | None = None


class CpuAllocatorMeter:
    """Thin wrapper over the native meter's C functions (one per process; get it from :func:`load`).

    The meter is process-global: it counts allocations made on every thread while installed.
    ``current_bytes``/``peak_bytes`` count only allocations made through it (see the module docstring).
    """

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self._lib = lib
        self.path = path  # the loaded shared library

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
    def peak_bytes(self) -> int:
        """Largest ``current_bytes`` since the library was loaded or :meth:`reset_peak`."""
        return int(self._lib.hm_peak())

    @property
    def serial(self) -> int:
        """Number of allocations counted so far (monotonic; the serial of the latest one)."""
        return int(self._lib.hm_serial())

    @property
    def live_count(self) -> int:
        """Number of live allocations made through the meter."""
        return int(self._lib.hm_live_count())

    def reset_peak(self) -> None:
        """Sets ``peak_bytes`` to ``current_bytes`` (call it while no other thread allocates)."""
        self._lib.hm_reset_peak()

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


def _compiler() -> list[str] | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shlex.split(cxx)
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def _flags() -> list[str]:
    torch_dir = Path(torch.__file__).resolve().parent
    lib_dir = torch_dir / "lib"
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    # Placed after the source on the command line: with -lc10 before it the linker drops libc10
    # and dlopen fails with "undefined symbol: typeinfo for c10::Allocator". The rpath makes the
    # library resolve to the libc10 torch already loaded (same path, so the loader reuses it).
    return ["-O2", "-shared", "-fPIC", "-std=c++17", "-fvisibility=hidden",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", str(torch_dir / "include"),
            "-L", str(lib_dir), f"-Wl,-rpath,{lib_dir}", "-lc10"]


def _cache_dirs() -> list[Path]:
    env = os.environ.get("HYBRIDMEM_CACHE_DIR")
    if env:
        return [Path(env)]
    return [Path.home() / ".cache" / "hybridmem",
            Path(tempfile.gettempdir()) / f"hybridmem-{os.getuid() if hasattr(os, 'getuid') else 'user'}"]


def _writable_dir(candidates: list[Path]) -> Path | None:
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    return None


def _load() -> tuple[CpuAllocatorMeter | None, str | None]:
    if os.environ.get("HYBRIDMEM_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by HYBRIDMEM_NATIVE=0"
    if not sys.platform.startswith("linux"):
        return None, f"native CPU meter supports Linux only (platform {sys.platform})"
    if not _SOURCE.is_file():
        return None, f"source {_SOURCE} is missing"
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler found (set $CXX or install c++/g++)"
    source = _SOURCE.read_bytes()
    flags = _flags()
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(),
                                     " ".join(cxx + flags).encode()])).hexdigest()[:16]
    directory = _writable_dir(_cache_dirs())
    if directory is None:
        return None, f"no writable cache directory among {[str(d) for d in _cache_dirs()]}"
    target = directory / f"_cpumeter-{key}.so"
    cached = target.is_file()
    if not cached:
        error = _build(cxx, flags, directory, target)
        if error is not None:
            return None, error
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        if not cached:
            return None, f"loading {target} failed: {e}"
        # A damaged cache entry (e.g. a disk filled up mid-copy): build it again once.
        error = _build(cxx, flags, directory, target)
        if error is not None:
            return None, error
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as e2:
            return None, f"loading {target} failed: {e2}"
    _declare(lib)
    return CpuAllocatorMeter(lib, target), None


def _build(cxx: list[str], flags: list[str], directory: Path, target: Path) -> str | None:
    """Compiles into a temporary file in ``directory`` and renames it onto ``target`` (atomic: two
    processes building at once both end with a complete library). Returns an error line or None."""
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=directory)
    os.close(fd)
    cmd = [*cxx, str(_SOURCE), "-o", tmp, *flags]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        os.unlink(tmp)
        return f"compiler {cxx[0]!r} could not run: {e}"
    if proc.returncode != 0:
        os.unlink(tmp)
        first = next((line for line in proc.stderr.splitlines() if "error" in line.lower()),
                     proc.stderr.strip().splitlines()[0] if proc.stderr.strip() else "")
        return f"compiling {_SOURCE.name} with {cxx[0]!r} failed (exit {proc.returncode}): {first.strip()}"
    os.replace(tmp, target)
    return None


def _declare(lib: ctypes.CDLL) -> None:
    i64, i32 = ctypes.c_int64, ctypes.c_int
    for name, res, args in [
        ("hm_install", i32, []), ("hm_uninstall", i32, []), ("hm_installed", i32, []),
        ("hm_priority", i32, []), ("hm_current", i64, []), ("hm_peak", i64, []),
        ("hm_reset_peak", None, []), ("hm_serial", i64, []), ("hm_live_count", i64, []),
        ("hm_orphan_frees", i64, []), ("hm_stale_entries", i64, []),
        ("hm_raw_allocate", ctypes.c_size_t, [i64]), ("hm_raw_deallocate", i32, [ctypes.c_size_t]),
        ("hm_lookup", i32, [ctypes.c_size_t, ctypes.POINTER(i64), ctypes.POINTER(i64)]),
        ("hm_serial_of", i64, [ctypes.c_size_t]),
    ]:
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
