"""Builds and opens the native library (``_cpumeter.cpp``, next to this file) on first use.

The source is compiled with the system C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``) against
torch's c10 headers and ``libc10`` (a few seconds, no pybind11), cached in ``$HYBRIDMEM_CACHE_DIR`` or
``~/.cache/hybridmem`` (a temporary directory when neither is writable) under a name hashing the source,
the torch version, the compiler and its flags, and opened with :mod:`ctypes`. Where torch has CUDA and
CUDA's headers are found (a toolkit under ``$CUDA_HOME``/``$CUDA_PATH``/``/usr/local/cuda``, or the
``nvidia-cuda-runtime`` wheels next to torch) it is built with the caching allocator's free-memory
callback; ``HYBRIDMEM_CUDA_HOOK=0`` leaves that out. Processes building at once each compile into a
temporary file and rename it onto the cached name (atomic): no lock, and a build killed half-way leaves
at most a stray ``.tmp.so``, never a half-written library under the cached name.

Why not ``torch.utils.cpp_extension.load``, which knows torch's include paths and ABI flags and caches and
locks by itself: it needs ninja (no dependency of torch), a build killed half-way leaves its lock file and
hangs every later ``load``, a cached load costs about 100 times this one's (it imports setuptools and runs
ninja), and it finds no CUDA headers without a toolkit. Measured, with the command to measure again:
docs/benchmarks.md, "Measured constants and design choices".
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
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["SOURCE", "Opened", "open_library"]

SOURCE = Path(__file__).with_name("_cpumeter.cpp")


@dataclass(frozen=True)
class Opened:
    """What :func:`open_library` found: the opened library and its path, or why there is none."""

    lib: ctypes.CDLL | None
    path: Path | None
    reason: str | None = None      # why ``lib`` is None (one line)
    cuda_note: str | None = None   # why the library has no CUDA hook (None when it has one or was not built)


def open_library(source: Path = SOURCE) -> Opened:
    """The native library built from ``source``, from the cache or compiled now. Returns the reason instead
    of raising for what the environment lacks (platform, compiler, cache directory) or a failed build."""
    if not sys.platform.startswith("linux"):
        return Opened(None, None, f"native CPU meter supports Linux only (platform {sys.platform})")
    if not source.is_file():
        return Opened(None, None, f"source {source} is missing")
    cxx = _compiler()
    if cxx is None:
        return Opened(None, None, "no C++ compiler found (set $CXX or install c++/g++)")
    flags, note = _flags()
    key = hashlib.sha256(b"\0".join([source.read_bytes(), torch.__version__.encode(),
                                     " ".join(cxx + flags).encode()])).hexdigest()[:16]
    directory = _writable_dir(_cache_dirs())
    if directory is None:
        return Opened(None, None, f"no writable cache directory among {[str(d) for d in _cache_dirs()]}", note)
    target = directory / f"_cpumeter-{key}.so"
    cached = target.is_file()
    if not cached:
        error = _build(cxx, flags, source, directory, target)
        if error is not None:
            return Opened(None, None, error, note)
    try:
        return Opened(ctypes.CDLL(str(target)), target, None, note)
    except OSError as e:
        if not cached:
            return Opened(None, None, f"loading {target} failed: {e}", note)
    # A damaged cache entry (e.g. a disk filled up mid-copy): build it again once.
    error = _build(cxx, flags, source, directory, target)
    if error is not None:
        return Opened(None, None, error, note)
    try:
        return Opened(ctypes.CDLL(str(target)), target, None, note)
    except OSError as e:
        return Opened(None, None, f"loading {target} failed: {e}", note)


def _compiler() -> list[str] | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shlex.split(cxx)
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def _cuda_flags(torch_dir: Path) -> tuple[list[str], str | None]:
    """Extra flags for the CUDA caching-allocator hook, or ([], why not)."""
    if os.environ.get("HYBRIDMEM_CUDA_HOOK", "1").strip().lower() in ("0", "false", "no", "off"):
        return [], "disabled by HYBRIDMEM_CUDA_HOOK=0"
    if torch.version.cuda is None:
        return [], "this torch build has no CUDA"
    lib_dir = torch_dir / "lib"
    if not (lib_dir / "libc10_cuda.so").is_file():
        return [], f"libc10_cuda.so not found in {lib_dir}"
    includes = [torch_dir / "include"]
    # cuda_runtime_api.h: a CUDA toolkit, or the nvidia-cuda-runtime / -crt wheels next to torch
    roots = [Path(os.environ[k]) for k in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(k)] + [Path("/usr/local/cuda")]
    nvidia = torch_dir.parent / "nvidia"
    roots += sorted(nvidia.glob("cu*")) + sorted(nvidia.glob("cuda_runtime")) + sorted(nvidia.glob("cuda_crt"))
    found = [r / "include" for r in roots if (r / "include").is_dir()]
    if not any((d / "cuda_runtime_api.h").is_file() for d in found):
        return [], "CUDA headers (cuda_runtime_api.h) not found: set CUDA_HOME or pip install nvidia-cuda-runtime"
    flags = ["-DHM_WITH_CUDA"]
    for d in includes + found:
        flags += ["-I", str(d)]
    return flags + ["-lc10_cuda"], None


def _flags() -> tuple[list[str], str | None]:
    """The compiler flags, and why they leave the CUDA hook out (None when they include it)."""
    torch_dir = Path(torch.__file__).resolve().parent
    lib_dir = torch_dir / "lib"
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    cuda, note = _cuda_flags(torch_dir)
    # Placed after the source on the command line: with -lc10 before it the linker drops libc10
    # and dlopen fails with "undefined symbol: typeinfo for c10::Allocator". The rpath makes the
    # library resolve to the libc10 torch already loaded (same path, so the loader reuses it).
    return ["-O2", "-shared", "-fPIC", "-std=c++20", "-fvisibility=hidden",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", str(torch_dir / "include"),
            "-L", str(lib_dir), f"-Wl,-rpath,{lib_dir}", "-lc10", *cuda], note


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


def _build(cxx: list[str], flags: list[str], source: Path, directory: Path, target: Path) -> str | None:
    """Compiles into a temporary file in ``directory`` and renames it onto ``target`` (atomic: two
    processes building at once both end with a complete library). Returns an error line or None."""
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=directory)
    os.close(fd)
    cmd = [*cxx, str(source), "-o", tmp, *flags]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        os.unlink(tmp)
        return f"compiler {cxx[0]!r} could not run: {e}"
    if proc.returncode != 0:
        os.unlink(tmp)
        first = next((line for line in proc.stderr.splitlines() if "error" in line.lower()),
                     proc.stderr.strip().splitlines()[0] if proc.stderr.strip() else "")
        return f"compiling {source.name} with {cxx[0]!r} failed (exit {proc.returncode}): {first.strip()}"
    os.replace(tmp, target)
    return None
