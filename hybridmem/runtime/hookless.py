"""Steady steps far from the budget, run without the runtime's saved-tensor hooks.

A light steady step (its program never came near the budget: :mod:`.steady`, light packs) keeps every saved
tensor as it is, so its pack and unpack hooks cost host time and nothing else. Where the program's light steps
rose at most ``light_rise`` bytes above their start at a save, a step of the same input shapes that starts at
``base`` bytes and would keep half the budget free with the largest rise between two hooks on top
(``base + light_rise + headroom <= budget - budget // 2``: the light packs' own test, made once for the step)
runs with the runtime's hooks taken off autograd's stack: autograd saves as it does without hybridmem. The
allocator's cap still holds; nothing is evictable in such a step, so an allocation past it gets the error that
names a budget, as a light step would.

Without an unpack hook the backward pass is seen through the root module's outputs: a pre-hook on their autograd
nodes tells the step tracker when backward reaches them, and a hook on the root's first trainable parameter when
its gradient accumulates (a loss built from something else than the outputs). The hooks go back on the stack at the
next step's first module call and when the runtime is disabled. Such a step needs no module call seen either: the
runtime takes its global module pre-hook off too (:class:`GlobalPreHook`), so that torch calls each module's
forward directly, and puts it back when the step ends.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

_top = torch._C._autograd._top_saved_tensors_default_hooks
_push = torch._C._autograd._push_saved_tensors_default_hooks
_pop = torch._C._autograd._pop_saved_tensors_default_hooks
# autograd nodes of the root's outputs given a pre-hook: the loss or the logits come first in what models
# return; a few more cover a loss computed from a later output
OUTPUT_NODES = 4


class Hookless:
    """Takes the runtime's hooks (``pack``, ``unpack``) off the stack for a step, and puts them back.
    ``backward_seen``: tells the step tracker that the backward pass started (``StepTracker.backward_seen``).

    The stack is thread-local and the autograd engine restores it after a backward pass, so what ends a step
    (the engine's callback) cannot put the hooks back: :meth:`restore` does, at the next step's first module
    call (before its inputs decide whether it runs without them) and when the runtime is disabled, at the
    place they were taken from (under contexts opened since, e.g. a ``save_on_cpu`` around the next step)."""

    def __init__(self, pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor],
                 backward_seen: Callable[[], None]):
        self.pack, self.unpack, self.backward_seen = pack, unpack, backward_seen
        self.active = False        # the step going on runs without the hooks
        self.off = False           # the hooks are off the stack of the thread that runs the steps
        self.below: Any = None     # the stack's top under them when they were taken off
        self.steps = 0             # steps run without them
        self.outputs_seen = False  # the root's last call returned a tensor with an autograd node
        self._param_hook: Any = None  # on the root's first trainable parameter (watch_parameters)

    def start(self) -> bool:
        """Run the step going on without the hooks: take them off the stack where they are on its top (no
        context opened above them). Whether the step runs without them."""
        if self.active or not self.outputs_seen:
            return False
        if not self.off:
            top = _top(False)
            if top is None or top[0] != self.pack:
                return False
            _pop()
            self.below, self.off = _top(False), True
        self.active = True
        self.steps += 1
        return True

    def step_ended(self) -> None:
        """The step ended (inside the engine's callback: the hooks stay off until :meth:`restore`)."""
        self.active = False

    def restore(self) -> None:
        """Put the hooks back on the stack (on the thread that took them off; nothing if they are on it)."""
        self.active = False
        if not self.off:
            return
        self.off = False
        above = []   # contexts opened since: they go back on top of the hooks, as they were opened above them
        while (top := _top(False)) is not None and top != self.below:
            above.append(top)
            _pop()
        _push(self.pack, self.unpack)
        for pack, unpack in reversed(above):
            _push(pack, unpack)

    def root_returned(self, out: Any, watch: bool = False) -> None:
        """The root module returned ``out`` (its forward hook): in a step without hooks, the backward pass is
        seen when it reaches the autograd node of one of its tensors; with ``watch``, in any step (one whose
        saves a context opened above the hooks takes: no unpack of theirs sees it)."""
        nodes: list[Any] = []
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (fn := t.grad_fn) is not None and fn not in nodes:
                nodes.append(fn)
                if len(nodes) == OUTPUT_NODES:
                    break
        self.outputs_seen = bool(nodes)
        if not self.active:
            for fn in nodes if watch else ():
                fn.register_prehook(self._seen)
            return
        if not nodes:  # nothing backward could be seen by: the rest of the step runs with the hooks
            self.restore()
            return
        for fn in nodes:
            fn.register_prehook(self._reached)

    def watch_parameters(self, module: torch.nn.Module) -> None:
        """Also see the backward pass where the root's first trainable parameter accumulates its gradient: a loss
        that reaches none of the root's output nodes (one built from a tensor a forward hook captured) still
        reaches the parameters it trains."""
        self.unwatch()
        for param in module.parameters():
            if param.requires_grad:
                try:
                    self._param_hook = param.register_post_accumulate_grad_hook(self._accumulated)
                except RuntimeError:  # a parameter type without the hook (the output nodes still tell)
                    pass
                return

    def unwatch(self) -> None:
        """Take the parameter's hook off (the runtime is disabled: no hook stays on the model)."""
        if self._param_hook is not None:
            self._param_hook.remove()
            self._param_hook = None

    def _accumulated(self, param: torch.Tensor) -> None:
        if self.active:
            self.backward_seen()

    def _reached(self, grad_outputs: Any) -> None:
        if self.active:
            self.backward_seen()

    def _seen(self, grad_outputs: Any) -> None:
        self.backward_seen()


class GlobalPreHook:
    """torch's global module forward pre-hook ``fn`` (every module call), which a step without hooks takes off
    (:meth:`pause`: with no global hook, torch calls each module's forward directly, the fast path) and puts back
    (:meth:`resume`: a process-wide table, so any thread may, the step's end running in the engine's callback)."""

    def __init__(self, fn: Callable[[torch.nn.Module, Any], None]):
        self.fn = fn
        self.paused = False
        self._handle: Any = None

    def install(self) -> None:
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self.fn)
        self.paused = False

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.paused = False

    def pause(self) -> None:
        if self._handle is not None and not self.paused:
            self._handle.remove()
            self.paused = True

    def resume(self, missed: torch.nn.Module | None = None, args: Any = ()) -> None:
        """Put the hook back. ``missed``: a module whose call it did not see (its own pre-hook found the hook
        paused), given to it now with ``args``."""
        if self.paused:
            self.install()
            if missed is not None:
                self.fn(missed, args)


class RootHooks:
    """Hooks on the root: the module that started the first step, held weakly. A pre-hook with keyword arguments
    (the global one sees none) gives ``called(module, args, kwargs)`` the step's inputs, a forward hook gives
    ``returned(module, args, out)`` its outputs, and ``hookless`` watches its first trainable parameter. The
    callbacks are bound methods, held weakly too (the model does not keep a runtime alive). :meth:`off` at
    ``disable()`` (a disabled runtime leaves no hook on the model), :meth:`on` at the next install, before the
    root's next call: a hook registered inside a call runs from the call after (torch reads a module's hooks
    before running them)."""

    def __init__(self, hookless: Hookless, called: Callable[..., None], returned: Callable[..., None]):
        self.hookless = hookless
        self._called, self._returned = weakref.WeakMethod(called), weakref.WeakMethod(returned)
        self._root: weakref.ref | None = None
        self._handles: tuple[Any, ...] = ()

    def module(self) -> torch.nn.Module | None:
        """The root, while it lives."""
        return self._root() if self._root is not None else None

    def attach(self, module: torch.nn.Module) -> None:
        """``module`` is the root from now on (the first model, or one made after it was gone)."""
        self.off()
        self._root = weakref.ref(module)
        self.on()

    def on(self) -> None:
        root = self.module()
        if root is None or self._handles:
            return
        called, returned = self._called, self._returned

        def pre(m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if (fn := called()) is not None:
                fn(m, args, kwargs)

        def post(m: torch.nn.Module, args: tuple, out: Any) -> None:
            if (fn := returned()) is not None:
                fn(m, args, out)

        self._handles = (root.register_forward_pre_hook(pre, with_kwargs=True), root.register_forward_hook(post))
        self.hookless.watch_parameters(root)

    def off(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = ()
        self.hookless.unwatch()
