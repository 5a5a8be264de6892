"""``torch.utils.checkpoint`` regions under a budget: the runtime manages their tensors itself.

Left alone, a checkpointed region hides its activations (its saved-tensor hooks are the innermost pair)
and recomputes the whole region at once in backward: a burst no eviction of ours can lower, so a model
with its own checkpointing (``gradient_checkpointing_enable()`` in transformers) could not go as low
as without it (a 6-block MLP: 15.05 MiB against 14.55 MiB). Under a budget (the online scorer, no
plan: a plan was captured with the regions as they are) on the thread the runtime manages, a region
whose inputs need gradients runs as plain code instead: its tensors are saved through hybridmem, which
recomputes them (as checkpoint would), swaps or compresses them only as far as the budget needs, so
the lowest feasible budget is the one without checkpointing. Results are bit-identical either way
(a region computes the same ops once instead of twice). Monitor-only, with a plan, on other threads,
and for a reentrant region none of whose inputs needs gradients (checkpoint then gives the region's
parameters no gradients, which a plain call would change), checkpoint works as usual.

The two entry points are module globals of ``torch.utils.checkpoint`` looked up at each call (so a
``functools.partial(checkpoint, ...)`` bound before ``enable()`` is covered): ``_checkpoint_hook``
(non-reentrant regions) and ``CheckpointFunction`` (reentrant ones). They are wrapped once, on the
first managed ``install``, and defer to the originals whenever no runtime manages the calling thread.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.checkpoint as _ckpt

_managing: Callable[[], Any] = lambda: None  # the runtime taking regions over on this thread, or None
_installed = False


def install(managing: Callable[[], Any]) -> bool:
    """Wrap checkpoint's entry points (once); ``managing()`` names the runtime that takes regions over on
    the calling thread (or None). Returns False where this torch lacks them (regions left to checkpoint)."""
    global _managing, _installed
    _managing = managing
    if _installed:
        return True
    hook, function = getattr(_ckpt, "_checkpoint_hook", None), getattr(_ckpt, "CheckpointFunction", None)
    if not (isinstance(hook, type) and isinstance(function, type)):
        return False
    _ckpt._checkpoint_hook = _hook_class(hook)
    _ckpt.CheckpointFunction = _ReentrantRegion(function)
    _installed = True
    return True


def _hook_class(original: type) -> type:
    class _CheckpointHook(original):  # type: ignore[misc, valid-type]
        """checkpoint's forward hooks, or the managing runtime's own pair (the region runs plainly)."""

        def __init__(self, frame: Any) -> None:
            rt = _managing()
            if rt is None:
                super().__init__(frame)
            else:
                torch.autograd.graph.saved_tensors_hooks.__init__(self, rt._pack_hook, rt._unpack_hook)

    _CheckpointHook.__name__ = _CheckpointHook.__qualname__ = original.__name__
    return _CheckpointHook


class _ReentrantRegion:
    """Stands in for ``CheckpointFunction``: ``apply`` runs the region plainly where the runtime takes it."""

    def __init__(self, original: type) -> None:
        self.original = original

    def apply(self, function: Callable[..., Any], preserve: bool, *args: Any) -> Any:
        if _managing() is not None and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return function(*args)
        return self.original.apply(function, preserve, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)
