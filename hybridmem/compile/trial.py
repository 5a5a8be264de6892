"""The real peak of a compiled region, measured once when it compiles, before any step runs it.

A plan is made on the joint graph counted op by op; Inductor then fuses ops into kernels, orders them its
own way and calls library kernels with scratch of their own, so the step it generates can hold more than
the count (a 3-convolution ConvNet: 3 % over its budget with the 11 % margin, where Inductor computed a
recomputed BatchNorm-ReLU inside the next BatchNorm's backward kernel). Only running the generated code
says what it holds. :func:`run` calls the compiled region once on the example inputs ``torch.compile``
gave the backend (the first call's parameters, buffers and batch), then its backward with
``torch.autograd.grad`` (ones as the outputs' gradients), and reads the allocator's peak in between:
the native CPU meter (:mod:`hybridmem.native.cpumeter`) on the CPU, the caching allocator on CUDA.

Nothing the user holds changes: random ops draw from a copy of the random state (``fork_rng``), the
inputs the region writes in place (BatchNorm's running statistics) get their values back, and no
``.grad`` is written. It costs one training step of the region, at compile time.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import re
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from ..graph.capture import scratch_meter

__all__ = ["Trial", "run"]


@dataclass
class Trial:
    """One run of a compiled region's forward and backward."""

    peak_bytes: int          # its inputs' storages plus the most the run allocated beyond what was live before
    seconds: float
    refused: bool = False    # the run passed its cap and stopped there: ``peak_bytes`` is the least it needed
    # CUDA: what the device's allocator held besides the inputs when the run began (cuBLAS and cuDNN
    # workspaces, the program's other tensors): in every step's max_memory_allocated, in no count
    device_other_bytes: int = 0


class NotMeasurable(Exception):
    """The region cannot be run here (the message says why)."""


def mutated_inputs(n_inputs: int) -> set[int] | None:
    """Which of the compiled region's ``n_inputs`` inputs it writes in place, as AOTAutograd found while
    compiling it (None where that cannot be read)."""
    from torch._guards import TracingContext
    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    info = getattr(meta, "input_info", None)
    if info is None or len(info) != n_inputs:
        return None
    return {i for i, x in enumerate(info) if x.mutates_data or x.mutates_metadata}


def run(compiled: Callable[..., Any], example_inputs: Sequence[Any], device: torch.device,
        mutated: set[int] | None = None, cap_bytes: int | None = None, level: int | None = None,
        hold_outputs: bool = True) -> Trial:
    """Run ``compiled`` (a region as ``torch.compile``'s backend returns it) once forward and backward on
    ``example_inputs`` and measure its peak; raises :class:`NotMeasurable` where it cannot.

    ``mutated``: the inputs it writes in place (:func:`mutated_inputs`; None: any that does not require
    grad may be), whose values are copied to the host first and put back after. ``cap_bytes`` (CPU): the
    most the run may hold; an allocation past it is refused (the native meter's cap) and the run stops
    there, so that a plan that does not fit never holds more than the budget, at compile time either (on
    CUDA the run is measured, not capped). ``level``: the CPU meter's count when the compile began: what
    the compile allocated since and still holds counts, as the first step (which compiles) holds it.
    ``hold_outputs``: the outputs are held through the backward (else dropped after the forward), as the
    plan counted them."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if any(isinstance(x, FakeTensor) or x.device != device for x in tensors):
        raise NotMeasurable(f"its inputs are not all real tensors on {device}")
    with ExitStack() as stack:
        meter = None
        if device.type == "cpu":
            meter, note = scratch_meter(stack)
            if meter is None:
                raise NotMeasurable(note)
        elif device.type != "cuda":
            raise NotMeasurable(f"no allocator statistics on {device.type}")
        stack.enter_context(unset_fake_temporarily())
        stack.enter_context(_forked_rng(device))
        stack.enter_context(torch.enable_grad())
        gc.collect()    # the compile's garbage (its tensors freed by the collector) goes before the window
        window = _Window(device, meter)
        # the values of what the region may write in place (it writes no tensor that requires grad), copied to
        # the host outside torch's allocator (on the CPU, NumPy's): not device memory of the step
        kept = [(x, x._version, _host_copy(x)) for i, x in enumerate(example_inputs)
                if isinstance(x, torch.Tensor) and not x.requires_grad and x.numel()
                and (mutated is None or i in mutated)]
        # held beside the run: the inputs' storages (parameters, buffers, the batch: live before the window),
        # what the compile holds (on the CPU: Dynamo's copy of the random state, and what it allocated since)
        fixed = sum({x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in tensors}.values())
        if meter is not None:
            fixed += _cpu_rng_bytes() + (max(window.base - level, 0) if level is not None else 0)
        needed = None
        try:
            if meter is not None and cap_bytes is not None:
                _cap(stack, meter, window.base + max(cap_bytes - fixed, 0))
            t0 = time.perf_counter()
            try:
                _step(compiled, list(example_inputs), tensors, hold_outputs)
            except torch.OutOfMemoryError as e:
                asked = _asked(str(e))       # the bytes held when it was refused, with the allocation asked for
                if asked is None or meter is None:
                    raise
                needed = max(asked - window.base, 0)
            seconds = time.perf_counter() - t0
            peak = window.peak()
        finally:
            for x, version, value in kept:
                if x._version != version:
                    with torch.no_grad():
                        x.copy_(torch.from_numpy(value).view(x.dtype).view(x.shape) if isinstance(value, np.ndarray)
                                else value)
    if needed is not None:
        gc.collect()     # the stopped run's tensors, held by the exception's frames
        return Trial(peak_bytes=fixed + max(peak, needed), seconds=seconds, refused=True)
    other = max(window.base - fixed, 0) if device.type == "cuda" else 0
    return Trial(peak_bytes=fixed + peak, seconds=seconds, device_other_bytes=other)


@contextlib.contextmanager
def _forked_rng(device: torch.device) -> Iterator[None]:
    """``torch.random.fork_rng``, its copies of the random state held outside torch's allocator (NumPy's): a
    tensor would count in the window (5 KiB on the CPU)."""
    cpu = torch.get_rng_state().numpy().copy()
    cuda = torch.cuda.get_rng_state(device).numpy().copy() if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.set_rng_state(torch.from_numpy(cpu))
        if cuda is not None:
            torch.cuda.set_rng_state(torch.from_numpy(cuda), device)


@functools.cache
def _cpu_rng_bytes() -> int:
    """Bytes of the CPU random state as a tensor: Dynamo holds one while it compiles (it puts the state back
    after tracing)."""
    return torch.get_rng_state().numel()


def _host_copy(x: torch.Tensor) -> Any:
    """``x``'s values on the host, outside the device's allocator: a NumPy array of a CPU tensor's bytes
    (whatever its dtype), a host tensor for a CUDA one."""
    if x.device.type == "cpu":
        return x.detach().contiguous().view(-1).view(torch.uint8).numpy().copy()
    return x.detach().to("cpu", copy=True)


def _cap(stack: ExitStack, meter: Any, cap: int) -> None:
    """Refuse allocations past ``cap`` bytes of the meter's count until ``stack`` closes (the scratch meter
    exempts this thread from any cap: undone here for the run)."""
    old = meter.budget
    meter.set_budget(cap)
    stack.callback(meter.set_budget, old)
    meter.cap_exempt(False)
    stack.callback(meter.cap_exempt, True)


_REFUSED = re.compile(r"hybridmem: CPU allocator budget exceeded\. Tried to allocate .*?\((\d+) bytes\) with "
                      r".*?\((\d+) bytes\) held")


def _asked(message: str) -> int | None:
    """The meter's count had the refused allocation been made (from its message); None: not the meter's."""
    m = _REFUSED.search(message)
    return None if m is None else int(m.group(1)) + int(m.group(2))


class _Window:
    """The most the device's allocator held beyond its level when this was made."""

    def __init__(self, device: torch.device, meter: Any) -> None:
        self.device, self.meter = device, meter
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self.base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            self.base = meter.current_bytes
            meter.window_reset()

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return max(int(torch.cuda.max_memory_allocated(self.device)) - self.base, 0)
        return max(int(self.meter.window_peak) - self.base, 0)


def _step(compiled: Callable[..., Any], args: list[Any], tensors: list[torch.Tensor], hold: bool) -> None:
    """The region's forward, then its backward with ones as the outputs' gradients (the gradient of their
    sum: the outputs need not be held for it; no ``.grad`` is written)."""
    out = compiled(*args)
    del args
    outs = [o for o in (out if isinstance(out, (list, tuple)) else (out,))
            if isinstance(o, torch.Tensor) and o.requires_grad]
    inputs = [x for x in tensors if x.requires_grad]
    if not outs or not inputs:
        return
    total = sum(o.sum() for o in outs)
    if not hold:
        del out, outs
    torch.autograd.grad(total, inputs, allow_unused=True)
