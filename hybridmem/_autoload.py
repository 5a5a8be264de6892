"""Enable hybridmem from ``HYBRIDMEM_*`` environment variables, with no change to the program.

``hybridmem_autoload.pth`` (installed into site-packages) runs at every interpreter start and calls
:func:`maybe_enable` only when ``HYBRIDMEM_BUDGET``, ``HYBRIDMEM_PLAN`` or ``HYBRIDMEM_CONFIG`` is set,
so an ordinary ``python`` start pays one ``os.environ`` lookup. When set, nothing heavy is imported
either: if torch is not imported yet, a meta-path hook enables the runtime right after the program's
own ``import torch`` completes (a program that never imports torch never loads it).

    HYBRIDMEM_BUDGET=8GiB python train.py
    HYBRIDMEM_BUDGET=60% HYBRIDMEM_POLICIES=swap,recompute python train.py     # CUDA: of device memory
    hybridmem run --budget 8GiB train.py --epochs 3                             # the same, explicitly

A malformed setting stops the program with a one-line message (exit status 2) rather than training
without the budget the user asked for. ``HYBRIDMEM_VERBOSE=1`` prints ``hybridmem.stats()`` at exit.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from typing import Any, Mapping, Sequence

TRIGGERS = ("HYBRIDMEM_BUDGET", "HYBRIDMEM_PLAN", "HYBRIDMEM_CONFIG")


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return any(env.get(k) for k in TRIGGERS)


def maybe_enable(environ: Mapping[str, str] | None = None) -> bool:
    """Enable the runtime if a trigger variable is set (now, or once torch is imported).
    Returns whether it is (or will be) enabled."""
    if not wanted(environ):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "autograd", None) is not None:
        _enable_from_env()
    else:
        _TorchImportHook.install()
    return True


def _enable_from_env() -> None:
    from .errors import HybridMemError

    try:
        from . import runtime
        runtime.enable()  # everything comes from the environment (and HYBRIDMEM_CONFIG's YAML)
    except (ValueError, HybridMemError, FileNotFoundError) as e:
        print(f"hybridmem: cannot enable from the environment: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if runtime._current is not None and runtime._current.cfg.verbose:
        import atexit
        atexit.register(_print_stats)


def _print_stats() -> None:
    from . import runtime

    if runtime.enabled():
        print(runtime.stats(), file=sys.stderr)


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Finds ``torch`` through the other finders and enables hybridmem once its module has run."""

    installed = False

    @classmethod
    def install(cls) -> None:
        if not cls.installed:
            sys.meta_path.insert(0, cls())
            cls.installed = True

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us again
        type(self).installed = False
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    break
        if spec is not None and spec.loader is not None:
            spec.loader = _EnablingLoader(spec.loader)
        return spec


class _EnablingLoader(importlib.abc.Loader):
    """Wraps torch's loader: run torch's ``__init__``, then enable hybridmem."""

    def __init__(self, inner: Any):
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _enable_from_env()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ... of the real loader
        return getattr(self.inner, name)


def run_script(argv: Sequence[str], settings: Mapping[str, str] | None = None) -> int:
    """Run ``argv[0]`` as ``__main__`` with ``sys.argv = argv`` and hybridmem enabled from
    ``settings`` (``HYBRIDMEM_*`` names, placed in the environment so child processes inherit them)
    and the environment. Used by ``hybridmem run [options] script.py args...``; returns the exit status."""
    import runpy

    if not argv:
        raise ValueError("hybridmem run: give the script to run, e.g. hybridmem run --budget 8GiB train.py")
    script = argv[0]
    if not os.path.isfile(script):
        raise FileNotFoundError(f"hybridmem run: no such script: {script}")
    os.environ.update({k: str(v) for k, v in (settings or {}).items()})
    if not wanted():
        print("hybridmem run: no budget, plan or config given: running monitor-only", file=sys.stderr)
        os.environ["HYBRIDMEM_BUDGET"] = "none"
    maybe_enable()
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    return 0
