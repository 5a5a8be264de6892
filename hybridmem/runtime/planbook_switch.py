"""The runtime's half of plan books: each step's plan picked by its input shapes.

The book itself (keys, file format, lookup) is :mod:`hybridmem.graph.planbook`; planning a book is
:mod:`hybridmem.planbooks`.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..errors import StalePlanError
from ..graph.plan import Plan
from ..graph.planbook import PlanBook, ShapeKey
from .follow import PlanFollower
from .parts import BucketRuntime

__all__ = ["RootCallWatcher", "BucketSwitch"]


class RootCallWatcher:
    """Calls ``on_step(key)`` with the :class:`ShapeKey` of each outermost module call made with grad
    enabled: the model's inputs (under ``DistributedDataParallel`` too: its wrapper is the outermost
    module and receives the same inputs). The runtime takes the first such call after its step
    boundary as the step's shapes.

    Global module hooks see every module without knowing the model; depth is counted so a nested
    call costs one integer update. Install only while a plan book is in use.

    Global forward *pre*-hooks get no keyword arguments in torch 2.x (``with_kwargs`` exists only for
    module-local hooks), and models like the zoo's transformer take keyword inputs. The outermost
    call's keywords are read from the calling frame of ``Module._call_impl``, used only if that
    frame's ``args`` is the very tuple the hook received (so a torch that calls hooks differently falls
    back to positional inputs, never to someone else's keywords).
    """

    def __init__(self, on_step: Callable[[ShapeKey], None]):
        self.on_step = on_step
        self.depth = 0
        self.keywords_seen = True   # False once a root call's keywords could not be read
        self._handles: list[Any] = []

    def install(self) -> "RootCallWatcher":
        if not self._handles:
            self._handles = [register_module_forward_pre_hook(self._pre),
                             register_module_forward_hook(self._post, always_call=True)]
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.depth = 0

    def _pre(self, module: Any, args: tuple) -> None:
        self.depth += 1
        if self.depth == 1 and torch.is_grad_enabled():
            self.on_step(ShapeKey.of(*args, **self._caller_kwargs(args)))

    def _post(self, module: Any, args: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)

    def _caller_kwargs(self, args: tuple) -> dict[str, Any]:
        f = sys._getframe(2)  # 0: _caller_kwargs, 1: _pre, 2: the loop in Module._call_impl
        loc = f.f_locals
        kw = loc.get("kwargs")
        if loc.get("args") is args and isinstance(kw, dict):
            return kw
        self.keywords_seen = False
        return {}


class BucketSwitch:
    """The runtime's plan choice per step: a :class:`PlanBook`, looked up by each step's input shapes.

    A :class:`RootCallWatcher` sees the model's outermost call before the step's first op; the
    bucket's follower (one per bucket, each verifying its plan's op signature on the bucket's first
    step, as a single plan does on step 1) becomes the runtime's follower for that step, or none: the
    online scorer alone, which always enforces the budget. A plan whose signature does not match is
    refused for its bucket only (noted in ``Stats.notes`` and ``book.refused``); training goes on.

    ``usage[key]`` counts steps per bucket by how they ran: ``plan`` (the follower was following at the
    step's end), ``verify`` (the bucket's first step, on the scorer while checking the signature),
    ``scorer`` (no plan), ``refused`` / ``diverged``.
    """

    def __init__(self, book: PlanBook, rt: BucketRuntime):
        self.book = book
        self.rt = rt
        self.followers: dict[ShapeKey, Any] = {}
        self.usage: dict[ShapeKey, dict[str, int]] = {}
        self.key: ShapeKey | None = None
        self._mode_at_start = "scorer"
        self.watcher = RootCallWatcher(self.step_shapes)

    def install(self) -> None:
        self.watcher.install()

    def uninstall(self) -> None:
        self.watcher.remove()

    def step_shapes(self, key: ShapeKey) -> None:
        """Root-call callback: pick the follower for the step about to start."""
        if getattr(self.rt.steps, "phase", 0) != 0:
            return  # a second model call inside one step: the step's first call decided
        f = self.followers.get(key, _MISSING)
        if f is _MISSING:
            plan = self.book.lookup(key, budget=self.rt.budget)
            f = self.followers[key] = None if plan is None else self._follower(key, plan)
            why = self.book.why_not(key, self.rt.budget) if plan is None else ""
            self.rt.stats.note(f"plan book: input shapes {key}: " + (why + "; online scorer" if why else
                                                                      "plan found, verified on its first step"))
        self.key = key
        self.rt.follower = f   # the dispatch mode reads it from the runtime per op
        self._mode_at_start = "scorer" if f is None else "verify" if f.state == "pending" else f.state

    def step_ended(self) -> None:
        """Call at the runtime's step end, after the follower's own ``step_ended``."""
        if self.key is None:
            return
        f = self.followers.get(self.key)
        how = "scorer" if f is None else self._mode_at_start if self._mode_at_start == "verify" else \
            "plan" if f.state == "following" else f.state
        counts = self.usage.setdefault(self.key, {})
        counts[how] = counts.get(how, 0) + 1

    def _follower(self, key: ShapeKey, plan: Plan) -> Any:
        book, rt = self.book, self.rt

        class BucketFollower(PlanFollower):
            def _verify(self) -> None:
                try:
                    super()._verify()
                except StalePlanError as e:  # refuse this bucket, keep training on the scorer
                    book.refused[key] = str(e)
                    rt.stats.note(f"plan book: input shapes {key}: plan refused: {e}")

        return BucketFollower(plan, rt)


_MISSING = object()
