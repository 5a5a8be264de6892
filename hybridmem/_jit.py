"""Numba kernels compiled on first use, never at import, shared by the online scorer
(:mod:`hybridmem.scorer`) and the CPU codecs (:mod:`hybridmem.plugins.codecs`).

``HYBRIDMEM_SCORER=numpy`` or ``HYBRIDMEM_NUMBA=0`` turns Numba off everywhere: callers then take their
numpy/torch path.
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Callable

__all__ = ["lazy_njit"]


def _numba_disabled() -> bool:
    """``HYBRIDMEM_SCORER=numpy`` or ``HYBRIDMEM_NUMBA=0``: no Numba anywhere (scorer and CPU codecs)."""
    return (os.environ.get("HYBRIDMEM_SCORER", "").strip().lower() == "numpy"
            or os.environ.get("HYBRIDMEM_NUMBA", "").strip().lower() in ("0", "false", "no", "off"))


class lazy_njit:
    """Compile ``py_func`` with Numba on first use; never at import.

    ``cache=True`` first (a warm start skips the compile, 0.3-0.5 s per kernel). Numba raises at
    *decoration* when no cache locator is writable, so decoration happens here, guarded, and is retried
    with ``cache=False``. ``deps`` maps global names the kernel calls to other ``lazy_njit`` helpers: they
    compile first and replace those globals. ``compiled()`` returns the dispatcher after a trial call with
    ``warmup()``'s arguments, or ``None`` when Numba is unavailable or fails (callers then take their
    numpy/torch path; ``error`` says why).
    """

    def __init__(self, py_func: Callable[..., Any], warmup: Callable[[], tuple] | None = None,
                 deps: dict[str, "lazy_njit"] | None = None, **options: Any):
        self.py_func, self.warmup, self.deps, self.options = py_func, warmup, deps or {}, options
        self._lock = threading.RLock()
        self._resolved = False
        self._dispatcher: Any = None
        self.cached = False
        self.error: str | None = None

    def compiled(self) -> Any:
        if self._resolved:
            return self._dispatcher
        with self._lock:
            if not self._resolved:
                self._dispatcher = self._compile()
                self._resolved = True
        return self._dispatcher

    def _compile(self) -> Any:
        if _numba_disabled():
            self.error = "disabled by HYBRIDMEM_SCORER=numpy / HYBRIDMEM_NUMBA=0"
            return None
        try:
            import numba  # lazy: heavy (llvmlite), and optional at run time (the numpy scorer stands in)
        except Exception as e:  # not installed, or broken (llvmlite mismatch, ...)
            self.error = f"numba import failed: {type(e).__name__}: {e}"
            return None
        for name, dep in self.deps.items():
            disp = dep.compiled()
            if disp is None:
                self.error = f"helper {name} unavailable: {dep.error}"
                return None
            self.py_func.__globals__[name] = disp
        for cache in (True, False):
            try:
                with warnings.catch_warnings():
                    # a cache that cannot be *saved* only warns; the compiled code still runs
                    warnings.simplefilter("ignore", category=getattr(numba, "NumbaWarning", Warning))
                    disp = numba.njit(cache=cache, nogil=True, **self.options)(self.py_func)
                    if self.warmup is not None:
                        disp(*self.warmup())
                self.cached = cache
                return disp
            except Exception as e:
                self.error = f"numba compile (cache={cache}) failed: {type(e).__name__}: {e}"
        return None
