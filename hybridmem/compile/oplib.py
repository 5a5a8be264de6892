"""hybridmem's custom ops for compiled graphs: each module's set defined once per process in one
``hybridmem`` fragment library of its own (:mod:`.codec_ops`, :mod:`.offload_ops`)."""
from __future__ import annotations

import threading
from typing import Callable

import torch

_LOCK = threading.Lock()
# name -> its library object: it must outlive the process's use of the ops it defines
_LIBS: dict[str, torch.library.Library] = {}


def define_once(name: str, define: Callable[[torch.library.Library], None]) -> None:
    """Run ``define(lib)`` on a new ``hybridmem`` fragment library the first time ``name`` is asked for;
    later calls (from any thread) return at once."""
    if name in _LIBS:
        return
    with _LOCK:
        if name in _LIBS:
            return
        lib = torch.library.Library("hybridmem", "FRAGMENT")
        define(lib)
        _LIBS[name] = lib
