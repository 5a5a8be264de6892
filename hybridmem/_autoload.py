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
without the budget the user asked for. ``HYBRIDMEM_VERBOSE=1`` prints ``hybridmem.stats()`` at exit;
``HYBRIDMEM_REPORT=run.json`` saves the run's stats and tensor log there at exit
(:func:`hybridmem.runfile.save_run`), for ``hybridmem report run.json``.
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys
TYPE_CHECKING = False  # typing costs every process start milliseconds: annotations only
if TYPE_CHECKING:
    from typing import Any, Mapping, Sequence

# The rest of hybridmem (and so torch) is imported inside the functions that need it: this module runs
# at interpreter start, before the program's own `import torch`.
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
        report = report_path()
        from . import runtime
        runtime.enable()  # everything comes from the environment (and HYBRIDMEM_CONFIG's YAML)
    except (ValueError, HybridMemError, FileNotFoundError) as e:
        print(f"hybridmem: cannot enable from the environment: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as e:  # anything else: still one line, never a traceback out of `import torch`
        print(f"hybridmem: cannot enable from the environment: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if os.environ.get("WORLD_SIZE") or os.environ.get("LOCAL_RANK"):  # torchrun and similar launchers
        from .runtime.distributed import prepare_clean_exit
        prepare_clean_exit()  # the process group's threads joined before the interpreter finalizes
    # enabled again (`hybridmem run` after the start-up hook): the exit hooks still run once
    atexit.unregister(_print_stats)
    atexit.unregister(_save_report)
    if runtime.current.rt is not None and runtime.current.rt.cfg.verbose:
        atexit.register(_print_stats)
    if report is not None:
        atexit.register(_save_report, report)


def _print_stats() -> None:
    from . import runtime

    if runtime.enabled():
        print(runtime.stats(), file=sys.stderr)


def report_path(environ: Mapping[str, str] | None = None) -> str | None:
    """Where ``HYBRIDMEM_REPORT`` asks the run file to go (None: not set).

    A ``.json`` name is required: ``hybridmem report`` recognises run files by it. Under torchrun
    (``WORLD_SIZE`` > 1) each rank writes its own file, ``run.rank<RANK>.json``, instead of all
    writing the same one.
    """
    env = os.environ if environ is None else environ
    path = (env.get("HYBRIDMEM_REPORT") or "").strip()
    if not path:
        return None
    if not path.lower().endswith(".json"):
        raise ValueError(f"HYBRIDMEM_REPORT={path!r}: give a .json file name (e.g. run.json), the kind "
                         "`hybridmem report` reads")
    try:
        world = int(env.get("WORLD_SIZE") or 1)
    except ValueError:
        world = 1
    if world > 1:
        path = f"{path[:-5]}.rank{env.get('RANK', '0')}.json"
    return path


def _save_report(path: str) -> None:
    """At exit: the run's stats (and tensor log) as a run file for ``hybridmem report PATH``."""
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        return  # a spawned worker (DataLoader, ...) re-enabled from the environment: the parent reports
    from . import runtime
    from .runfile import save_run

    if not runtime.enabled():
        print(f"hybridmem: HYBRIDMEM_REPORT={path}: not written, hybridmem was disabled before exit "
              "(save it with hybridmem.runfile.save_run(path, hybridmem.stats()) before disable())",
              file=sys.stderr)
        return
    st = runtime.stats()
    if hasattr(st, "regions"):     # hybridmem.compile.CompileStats: no decision report to render
        print(f"hybridmem: HYBRIDMEM_REPORT={path}: not written: run files hold the eager runtime's decisions; "
              f"this run compiled its steps (HYBRIDMEM_COMPILE):\n{st}", file=sys.stderr)
        return
    try:
        extra = {"argv": list(sys.argv), "pid": os.getpid(),
                 "environment": {k: v for k, v in os.environ.items() if k.startswith("HYBRIDMEM_")}}
        save_run(path, st, device=st.device, extra=extra)
    except Exception as e:  # at exit nothing can be raised to the program: say it and move on
        print(f"hybridmem: HYBRIDMEM_REPORT={path}: could not write the run file: {type(e).__name__}: {e}",
              file=sys.stderr)
        return
    if runtime.current.rt is not None and runtime.current.rt.cfg.verbose:
        print(f"hybridmem: wrote {path} (render it with: hybridmem report {path})", file=sys.stderr)


class _TorchImportHook:
    """Enables hybridmem once ``torch`` has been imported (a meta path finder by duck typing: importlib.abc
    would cost the start of every process milliseconds).

    It also counts the ``hybridmem.*`` modules being executed. Enabling imports the runtime, and the runtime
    imports most of hybridmem: when the import of torch came from a hybridmem module (``hybridmem run``'s
    own imports, or a program that imports ``hybridmem.solvers`` before torch), that module and the ones
    importing it are half-initialized, and enabling right then fails on a circular import. Enabling then
    waits until the outermost of them has finished."""

    installed = False
    depth = 0          # hybridmem modules executing now, nested
    pending = False    # torch was imported while depth > 0: enable when depth returns to 0

    @classmethod
    def install(cls) -> None:
        if not cls.installed:
            sys.meta_path.insert(0, cls())
            cls.installed = True

    @classmethod
    def uninstall(cls) -> None:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, cls)]
        cls.installed = False

    @classmethod
    def enable_now_or_later(cls) -> None:
        if cls.depth:
            cls.pending = True
            return
        cls.pending = False
        cls.uninstall()
        _enable_from_env()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "torch" and not fullname.startswith("hybridmem."):
            return None
        spec = None
        for finder in sys.meta_path:  # the other finders, in order: what the import would have found
            find = None if isinstance(finder, _TorchImportHook) else getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is not None and spec.loader is not None:
            spec.loader = (_EnablingLoader if fullname == "torch" else _CountingLoader)(spec.loader)
        return spec


class _EnablingLoader:
    """Wraps torch's loader: run torch's ``__init__``, then enable hybridmem (now, or after the hybridmem
    module that imported torch)."""

    def __init__(self, inner: Any):
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _TorchImportHook.enable_now_or_later()

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ... of the real loader
        return getattr(self.inner, name)


class _CountingLoader(_EnablingLoader):
    """Wraps a hybridmem module's loader: counts it as executing; the outermost enables if torch came in."""

    def exec_module(self, module: Any) -> None:
        hook = _TorchImportHook
        hook.depth += 1
        try:
            self.inner.exec_module(module)
        finally:
            hook.depth -= 1
            module.__loader__ = module.__spec__.loader = self.inner  # no trace of the wrapper left
        if hook.pending and not hook.depth:
            hook.enable_now_or_later()


def run_script(argv: Sequence[str], settings: Mapping[str, str] | None = None) -> int:
    """Run ``argv[0]`` as ``__main__`` with ``sys.argv = argv`` and hybridmem enabled from
    ``settings`` (``HYBRIDMEM_*`` names, placed in the environment so child processes inherit them)
    and the environment. Used by ``hybridmem run [options] script.py args...``; returns the exit status."""

    if not argv:
        raise ValueError("give the script to run, e.g. hybridmem run --budget 8GiB train.py")
    script = argv[0]
    if not os.path.isfile(script):  # the CLI says which command: "hybridmem run: error: ..."
        raise FileNotFoundError(f"no such script: {script}")
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
