"""The process's enabled runtime: the state behind ``hybridmem.enable()``, ``disable()``, ``stats()``
and ``enabled()`` (:mod:`hybridmem.runtime`), read by the runtime's own pieces too (``torch.utils.checkpoint``
regions, :func:`~.compose.regions_runtime`). A module of its own so that both import it and neither the other."""
from __future__ import annotations

import os
import warnings
from typing import Any

from .threads import sweep

rt: Any = None      # the enabled Runtime (or CompileSession), if any
orphan: Any = None  # the runtime last released because its thread exited (its stats stay readable)


def live() -> Any:
    """The enabled runtime; one whose thread has exited is released first (its hooks died with it). What
    a release on another thread left on this thread's stacks goes first (runtime.threads, ``sweep``)."""
    global rt, orphan
    sweep()
    r = rt
    if r is not None and not r.owner.here() and not r.owner.alive():
        rt, orphan = None, r
        r.release()
        return None
    return r


def _after_fork_in_child() -> None:
    """A forked child starts unmanaged: its copy of the runtime would count the parent's bytes against
    the parent's budget. The child may enable its own. The release calls no CUDA where the parent had
    initialised it (``runtime.native_device``: any CUDA call raises in such a child); whatever else fails in it
    is said once as a warning, and the child goes on unmanaged (an exception here would only reach
    ``sys.unraisablehook`` and stop the release halfway)."""
    global rt, orphan
    r, rt, orphan = rt, None, None
    if r is None:
        return
    try:
        r.release()
    except Exception as e:  # noqa: BLE001  (a fork handler cannot raise to anyone)
        warnings.warn(f"hybridmem: a forked child could not fully release its parent's runtime "
                      f"({type(e).__name__}: {e}); the child runs unmanaged", RuntimeWarning, stacklevel=1)


os.register_at_fork(after_in_child=_after_fork_in_child)
