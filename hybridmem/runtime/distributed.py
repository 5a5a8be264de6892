"""torch.distributed glue: what the runtime must know under DDP and FSDP, and a loopback launcher.

hybridmem runs unchanged inside ``DistributedDataParallel`` and FSDP2 (``fully_shard``): one runtime
(and one budget) per rank, its saved-tensor hooks and dispatch mode on the training thread of each
rank. What was measured on torch 2.13 CPU with ``gloo`` (docs/distributed.md):

- **DDP**: the reducer's gradient hooks run inside backward under the runtime's mode (it sees
  ``c10d::allreduce_`` and the bucket copies as ops); nothing it touches is saved for backward.
- **FSDP2** runs on the CPU with gloo. Its unsharded parameters are ``nn.Parameter`` objects over
  all-gather output storages that FSDP allocates *during the step* (``aten::empty`` in the first step,
  then ``storage.resize_`` to full size before each use and to 0 after it) and fills with
  ``fsdp::split_with_sizes_copy``. To a runtime that calls "produced by an op while enabled" an
  activation, they look like activations: ``weight.t()`` saved by a linear layer would become an
  entry, count as saved-activation bytes and be a swap/compress candidate while FSDP may have
  resized its storage to 0. :func:`is_parameter_view` is the guard the runtime applies when it first
  sees a saved storage; :class:`FsdpStorageSync` keeps the simulated device's meter right about the
  storages FSDP resizes (``storage.resize_`` is not an op, so the meter cannot see it) and tells
  lineage not to replay from them (a recompute in backward may run before FSDP gathers them again).
  FSDP's sharded parameters and gradients are DTensors, whose own storage is a data-less stand-in of
  the global size: :func:`plain_storages` gives the local shard's.
- Collective ops (namespaces ``c10d``, ``_c10d_functional``, ``fsdp``, ...) are never replayed by
  recompute (lineage refuses non-aten ops): replaying one on a single rank would hang the others. The
  ``c10d`` schemas do not say which arguments they write (:func:`collective_writes` does): an
  activation all-reduced in place must not be recomputed from its producer alone.

:func:`launch` starts ``world_size`` processes on 127.0.0.1 with the ``gloo`` backend, runs
``fn(rank, world_size, *args)`` in each and returns what each returned (tests, benchmarks, docs).

:func:`prepare_clean_exit` (called before the script when hybridmem is enabled from the environment or by
``hybridmem run`` under torchrun) makes sure the process group's C++ threads are joined before the
interpreter finalizes: on torch 2.13 a gloo worker that needs the GIL during finalization (a Python
callback, or dropping the runtime's saved-tensor hooks that a collective's callback carried over from the
training thread) dies in ``pthread_exit`` inside a
``noexcept`` frame and the rank aborts with "terminate called without an active exception".
"""
from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import queue as _queue
import socket
import sys
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_traceable_wrapper_subclass as _is_wrapper_subclass

__all__ = ["COLLECTIVE_NAMESPACES", "is_collective", "collective_writes", "is_parameter_view", "plain_storages",
           "is_traceable_wrapper_subclass", "FsdpStorageSync", "launch", "free_port", "RankError", "rank_info",
           "prepare_clean_exit", "release_process_groups", "backend_threads"]

# Namespaces of ops that talk to other ranks or manage FSDP's communication buffers.
COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd",
                                   "fsdp", "_dtensor"})

_COLLECTIVE: dict[Any, bool] = {}


def is_collective(func: Any) -> bool:
    """Whether an op (``OpOverload``) is a collective or FSDP buffer op; one dict lookup once cached."""
    v = _COLLECTIVE.get(func)
    if v is None:
        v = _COLLECTIVE[func] = getattr(func, "namespace", "aten") in COLLECTIVE_NAMESPACES
    return v


# c10d ops that write no argument: everything else in the namespace writes its first argument (the output
# tensors, or the tensors reduced/broadcast in place) while its schema carries no alias annotation.
_C10D_NO_WRITE = frozenset({"send", "barrier", "monitored_barrier_", "check_for_nan"})


def collective_writes(func: Any) -> tuple[int, ...]:
    """Positional arguments a collective writes although its schema does not say so.

    ``c10d::allreduce_(Tensor[] tensors, ...)`` reduces ``tensors`` in place, ``_allgather_base_``
    fills its first argument, and so on, but none of the ``c10d`` schemas annotates the write (the
    ``_c10d_functional`` ones do). A runtime that learns writes from schemas would otherwise believe
    an activation all-reduced in place (tensor-parallel layers) still holds its producer's output,
    and a recompute would silently drop the all-reduce. ``fsdp::all_gather_copy_in`` writes its second
    argument (the all-gather buffer) and returns views of it.
    """
    ns = getattr(func, "namespace", "aten")
    name = getattr(func, "_opname", "")
    if ns == "c10d":
        return () if name in _C10D_NO_WRITE else (0,)
    if ns == "fsdp" and name == "all_gather_copy_in":
        return (1,)
    return ()


def is_parameter_view(t: torch.Tensor) -> bool:
    """Whether a tensor autograd saves is a parameter or a view of one (``weight.t()``).

    Catches what storage matching against ``module.parameters()`` misses: FSDP's unsharded
    parameters (``nn.Parameter`` over all-gather outputs made during the step; the module's
    registered parameters are the sharded DTensors between forwards) and parameters created after
    ``enable()``. A leaf that requires grad counts too: autograd accumulates into it, so it is state
    of the program, not an activation of the step. Cheap: meant for the first pack of a storage.
    """
    root = t._base if t._base is not None else t
    return isinstance(root, torch.nn.Parameter) or (root.requires_grad and root.is_leaf)


def plain_storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages that really hold a tensor's bytes on this rank.

    A ``DTensor`` (FSDP2's sharded parameters and gradients, tensor-parallel activations) is a wrapper
    subclass: ``untyped_storage()`` returns a storage with no data whose ``nbytes()`` is the *global*
    size, while the bytes live in its local shard. The dispatch mode sees the wrapper (DTensor runs
    the local ops while the mode is popped), so a meter must count the inner tensors instead: world
    size times fewer bytes, and the right ones. Plain tensors and parameters: one storage, fast path.
    """
    tp = type(t)
    if tp is torch.Tensor or tp is torch.nn.Parameter:
        return [t.untyped_storage()]
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, n) for n in names)  # torch 2.13's DTensor also names its DeviceMesh here
        return [st for x in inner if isinstance(x, torch.Tensor) for st in plain_storages(x)]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError, TypeError):
        return []  # sparse, nested: no plain storage


def is_traceable_wrapper_subclass(t: Any) -> bool:
    return _is_wrapper_subclass(t)


@dataclass
class _Resizable:
    ref: weakref.ref          # the storage FSDP resizes
    nbytes: int               # bytes the meter counts for it now


class FsdpStorageSync:
    """Keeps a simulated-device :class:`~hybridmem.runtime.meter.Meter` right about storages FSDP resizes.

    FSDP2 frees an unsharded parameter with ``storage.resize_(0)`` after use and brings it back with
    ``resize_(full)`` before the next all-gather: neither is an op, so the meter (which counts a
    storage's bytes when it first sees it) would count every unsharded parameter as resident from its
    first all-gather on. The storages FSDP writes with ``fsdp::split_with_sizes_copy`` are remembered
    here and their sizes re-read at every collective op (FSDP issues one per unshard and per reshard's
    reduce-scatter, so the error is bounded by the ops between two collectives) and at step end.
    On CUDA the allocator sees ``resize_`` itself: this is a no-op there.
    """

    def __init__(self, meter: Any):
        self.meter = meter
        self.active = bool(getattr(meter, "simulated", False))  # re-read sizes (simulated device only)
        self._storages: dict[int, _Resizable] = {}
        # told the bytes of each all-gather's outputs: FSDP allocates them by resize_, which is no op, so
        # the runtime cannot make room just before; it keeps that much free instead (runtime.native_device)
        self.on_gather: Any = None

    def after_op(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Call after each op for which :func:`is_collective` holds."""
        if getattr(func, "_opname", "") == "split_with_sizes_copy" and func.namespace == "fsdp":
            outs = kwargs.get("out") or ()
            for t in outs:
                self._remember(t.untyped_storage())
            if self.on_gather is not None:
                self.on_gather(sum(t.untyped_storage().nbytes() for t in outs))
        if self.active:
            self.refresh()

    def resizable(self, st: torch.UntypedStorage) -> bool:
        """Whether FSDP frees and refills this storage (an unsharded parameter) between uses.

        Lineage must not reference it: a recompute in backward may run before FSDP gathers the
        parameter again (its module's backward comes after the consumer's), and would read a storage
        of size 0. The runtime's recorder treats such an argument as opaque (not replayable), so the
        activation is swapped or compressed instead. On every device (CUDA too)."""
        return id(st) in self._storages

    def _remember(self, st: torch.UntypedStorage) -> None:
        k = id(st)
        if k not in self._storages:
            self._storages[k] = _Resizable(weakref.ref(st, lambda r, k=k: self._storages.pop(k, None)), -1)

    def refresh(self) -> int:
        """Re-read the remembered storages' sizes into the meter; returns how many changed."""
        if not self.active:
            return 0
        changed = 0
        for r in list(self._storages.values()):
            st = r.ref()
            if st is None:
                continue
            n = st.nbytes()
            if n != r.nbytes:
                self.meter.refresh(st)
                r.nbytes = n
                changed += 1
        return changed

    def __len__(self) -> int:
        return len(self._storages)


# ---- launching ranks on loopback ----------------------------------------------------------------------
class RankError(RuntimeError):
    """A rank raised or did not finish; the message carries each failing rank's traceback."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous of :func:`launch` and torchrun tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_info() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: from the process group if initialised, else the
    ``RANK``/``WORLD_SIZE`` variables torchrun sets, else ``(0, 1)``."""

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _rank_main(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, queue: Any,
               threads: int) -> None:

    torch.set_num_threads(threads)  # also keeps a forked child out of the parent's OpenMP pool
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            queue.put((rank, True, fn(rank, world, *args)))
        finally:
            if dist.is_initialized():  # fn may have destroyed it (tests of release_process_groups)
                dist.destroy_process_group()
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def launch(fn: Callable[..., Any], world_size: int = 2, args: Sequence[Any] = (), *, timeout: float = 120.0,
           start_method: str = "fork", threads: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes joined by a ``gloo`` process
    group on 127.0.0.1 (a free port); return the ranks' results in rank order.

    ``fork`` (default) starts in milliseconds because the children inherit the imported torch; it is
    safe on the CPU as long as the parent has not initialised CUDA (use ``spawn`` then, and a
    picklable ``fn``). Results travel through a queue: return plain data (numbers, strings, lists).
    A rank that raises, or a rank still running after ``timeout`` seconds, raises :class:`RankError`.
    """

    ctx = mp.get_context(start_method)
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, tuple(args), q, threads), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = q.get(timeout=min(left, 1.0))
            except _queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in errors]
                for r in dead:  # exited without reporting (killed, or a crash in C++)
                    if procs[r].exitcode not in (0, None):
                        errors[r] = f"exited with code {procs[r].exitcode} without a result"
                continue
            (results if ok else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()  # one of ours, started above: a rank left waiting for a failed peer
                p.join(timeout=5)
    missing = [r for r in range(world_size) if r not in results and r not in errors]
    if errors or missing:
        parts = [f"rank {r} failed:\n{errors[r]}" for r in sorted(errors)]
        parts += [f"rank {r} did not finish within {timeout:.0f} s" for r in missing]
        raise RankError("\n".join(parts))
    return [results[r] for r in range(world_size)]


# ---- a clean exit: the process group's threads joined while the interpreter is intact ------------------
_EXIT_PREPARED = False


def prepare_clean_exit() -> None:
    """Make the process group of the program about to run release its C++ threads before the interpreter
    finalizes: call before the program's ``init_process_group`` (``hybridmem run`` does, before the
    script). Idempotent; a no-op where ``torch.distributed`` is not built.

    Why (torch 2.13, gloo; reproduced with plain torch, see docs/distributed.md): ``destroy_process_group``
    does not free the default group. ``torch.distributed.nn.functional`` binds ``group=group.WORLD`` as
    the default argument of ten functions when it is first imported, and DDP's constructor imports it
    (through ``torch.distributed._shard``), so after DDP the group lives until the interpreter's last
    garbage collection. Its destructor then joins the gloo worker threads *while Python is finalizing*,
    and a worker that takes the GIL then (a Python callback of a collective that completes late, or a
    collective's callback dropping the saved-tensor hooks and dispatch modes it carried over from the
    training thread, which hybridmem's runtime installs) exits through ``pthread_exit`` inside a
    ``noexcept`` destructor: ``std::terminate``, "terminate called without an active exception", SIGABRT.

    Two steps: import ``torch.distributed.nn`` now, while no group exists, so those defaults are ``None``
    (which means the default group at call time, as it should); and at exit (an ``atexit`` hook registered
    now, so it runs after the program's own) :func:`release_process_groups`.
    """
    global _EXIT_PREPARED
    if _EXIT_PREPARED:
        return


    if not dist.is_available():
        return
    if not dist.is_initialized():  # too late otherwise: the defaults would bind the live group
        import torch.distributed.nn  # noqa: F401
    atexit.register(release_process_groups)
    _EXIT_PREPARED = True


def release_process_groups() -> list[str]:
    """Destroy the default process group if the program left it initialized, then collect garbage so that
    the groups nothing references any more (DDP's reducer sits in reference cycles) are destroyed now,
    joining their worker threads while the interpreter can still serve them the GIL.

    Returns the torch/gloo threads still alive afterwards (:func:`backend_threads`): empty unless the
    program itself still references a group or a DDP module at exit. Never raises: it runs at exit."""


    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # at exit: report, do not mask the program's own exit status
        print(f"hybridmem: destroy_process_group at exit failed: {type(e).__name__}: {e}", file=sys.stderr)
    gc.collect()
    return backend_threads()


_BACKEND_THREADS = ("gloo", "nccl")  # gloo_tcp_loop, pt_gloo_runloop; pt_nccl_*


def backend_threads() -> list[str]:
    """Names of this process's native threads that belong to torch.distributed backends (gloo's
    ``gloo_tcp_loop``, ``pt_gloo_runloop``, ...), read from ``/proc/self/task``; empty where that is not
    available (not Linux). The threads a Python ``threading.enumerate()`` does not show."""
    names: list[str] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # exited meanwhile
        if any(k in name for k in _BACKEND_THREADS):
            names.append(name)
    return sorted(names)
