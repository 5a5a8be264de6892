"""Which thread a runtime belongs to, and how to let go of it from elsewhere.

Saved-tensor hooks and dispatch modes live in per-thread stacks: a runtime manages the thread that
installed it and no other. This module keeps that thread (:class:`OwnerThread`), warns once when a
model trains with gradients on another thread (its work would silently go unmanaged), and removes a
runtime's entries from the calling thread's stacks wherever they sit (:func:`leave_mode`,
:func:`drop_hooks`): a forked child inherits the forking thread's stacks, and its copy of the runtime
must go without the order checks of a normal ``disable()``.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

_get_ident = threading.get_ident


class OwnerThread:
    """The thread a runtime was installed on."""

    __slots__ = ("thread", "ident", "warned")

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.ident = -1
        self.warned = False

    def claim(self) -> None:
        self.thread = threading.current_thread()
        self.ident = _get_ident()

    def here(self) -> bool:
        return _get_ident() == self.ident

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    @property
    def name(self) -> str:
        return self.thread.name if self.thread is not None else "?"

    def foreign_module_call(self) -> None:
        """A module ran on another thread: warn once if it trains there (gradients on)."""
        if self.warned or not torch.is_grad_enabled():
            return
        self.warned = True
        warnings.warn(
            f"hybridmem: a module ran with gradients on thread {threading.current_thread().name!r}, but "
            f"hybridmem was enabled on thread {self.name!r}: its hooks are per thread, so this thread's "
            "activations are not managed and the budget is not enforced here. Call hybridmem.enable() "
            "(or enter hybridmem.session()) on the thread that trains.", RuntimeWarning, stacklevel=3)


def leave_mode(mode: Any) -> None:
    """Exit ``mode`` from whichever thread: taken out of this thread's dispatch-mode stack wherever it
    is (the modes above it stay, in order), then exited on top, so that torch restores its process-wide
    "in a dispatch mode" flags as a normal exit does."""
    take_mode(mode)
    torch._C._push_on_torch_dispatch_stack(mode)
    mode.__exit__(None, None, None)


def take_mode(mode: Any) -> bool:
    """Take ``mode`` out of this thread's dispatch-mode stack wherever it is, without exiting it (the modes
    above it stay, in order). Returns whether it was there."""
    above = []
    found = False
    while torch._C._len_torch_dispatch_stack() > 0:
        top = torch._C._pop_torch_dispatch_stack(None)
        if top is mode:
            found = True
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_dispatch_stack(m)
    return found


# thread ident -> (thread, dispatch mode or None, pack hook) that a runtime released on another thread left on
# that thread's stacks, passing everything through: each op still costs a Python call there until they go
_left: dict[int, list[tuple[threading.Thread | None, Any, Any]]] = {}


def let_go(owner: OwnerThread, pack: Any, mode: Any = None) -> None:
    """Release a runtime's hooks (the pair of ``pack``) and its entered dispatch ``mode`` (or None) from
    whichever thread: taken off this thread's stacks where they are; where they sit on the installing thread
    that still runs, left there, passing everything through, until that thread sweeps them."""
    here = drop_hooks(pack)
    if mode is not None:
        leave_mode(mode)
    if not here and owner.alive():
        _left.setdefault(owner.ident, []).append((owner.thread, mode, pack))


def sweep() -> None:
    """Remove from this thread's stacks what runtimes released on other threads left there (hybridmem's
    public calls do this first: ``enable()``, ``disable()``, ``enabled()``, ``stats()``); forget what
    threads that exited were left (their stacks went with them)."""
    if not _left:
        return
    for _, mode, pack in _left.pop(_get_ident(), ()):
        drop_hooks(pack)
        if mode is not None:
            take_mode(mode)
    for ident in [i for i, items in _left.items() if not any(t is not None and t.is_alive() for t, _, _ in items)]:
        del _left[ident]


def drop_hooks(pack: Any) -> bool:
    """Remove the saved-tensor hooks pair whose pack hook is ``pack`` from this thread's stack; the
    pairs above it stay, in order. Returns whether it was there."""
    above = []
    found = False
    while (top := torch._C._autograd._top_saved_tensors_default_hooks(True)) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        if top[0] == pack:
            found = True
            break
        above.append(top)
    for p, u in reversed(above):
        torch._C._autograd._push_saved_tensors_default_hooks(p, u)
    return found
