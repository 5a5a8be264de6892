"""Where a compiled graph's swaps copy, and what they cost there.

A saved tensor the plan swaps goes to the host after its last forward read and comes back before its first
backward read. On CUDA the copies run beside the compute stream: by PyTorch's activation-offloading pass where
its stream ops trace (:func:`stream_ops_work`; its reloads ordered by timing the backward's nodes,
:func:`reload_timing`), else by hybridmem's offload ops (:mod:`hybridmem.compile.offload_ops`). There the
simulator's count holds: a copy costs the step only what the compute stream waits for it. Where nothing copies
beside the compute stream (:func:`overlap` is False), each copy runs on it and the step pays the whole copy:
:func:`serial_time` is a plan's predicted step time there, and :func:`cheaper` keeps a plan that swaps only
where it beats the plan made without swapping.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch
from torch import fx

from ..graph.costs import NO_LINK_BW, DeviceModel, get_cost_model, without_swaps as no_swap
from ..graph.simulate import simulate
from .fxnodes import node_flops, node_nbytes, tensor_vals

__all__ = ["NO_LINK_BW", "cheaper", "no_swap", "node_ms", "overlap", "reload_timing", "serial_time",
           "stream_ops_work"]


def overlap(device: torch.device) -> bool:
    """Whether a compiled graph's swaps on ``device`` copy beside its compute stream: on CUDA, by PyTorch's
    offloading pass or hybridmem's offload ops; elsewhere no stream runs beside the compute."""
    return device.type == "cuda"


def serial_time(g: Any, plan: Any, model: Any) -> float:
    """Predicted step time of ``plan`` on graph ``g`` with its copies on the compute stream: the simulator with
    ``model``'s copies not overlapping (``copies_overlap=False``), which charges each swap's copy out and back
    in full."""
    serial = replace(model, copies_overlap=False) if isinstance(model, DeviceModel) else model
    return float(simulate(g, plan, serial, budget=None, check_hash=False).time_s)


def cheaper(g: Any, plan: Any, model: Any, solve: Callable[[Any], Any]) -> tuple[Any, float, str]:
    """Where swaps copy on the compute stream: ``plan`` (made by ``model``, which counts copies as overlapped)
    charged :func:`serial_time`, or the plan ``solve(no_swap(model))`` makes, whichever is predicted faster;
    with its predicted step time and a note. ``solve`` raises BudgetInfeasibleError where nothing fits
    without swapping (``plan`` then stands)."""
    from ..errors import BudgetInfeasibleError

    serial = serial_time(g, plan, model)
    try:
        other = solve(no_swap(model))
    except BudgetInfeasibleError:
        return plan, serial, "swaps copy on the compute stream (charged in full): no plan fits without them"
    other_s = float(simulate(g, other, model, budget=None, check_hash=False).time_s)
    if other_s < serial:
        return other, other_s, (f"recomputes rather than swaps: its swaps would copy on the compute stream "
                                f"({serial:.4f} s against {other_s:.4f} s predicted)")
    return plan, serial, f"swaps copy on the compute stream (charged in full: {serial:.4f} s predicted)"


@functools.cache
def stream_ops_work() -> bool:
    """Whether PyTorch's stream ops, which its offloading pass inserts to copy beside the compute stream, trace
    under fake tensors: torch 2.11's ``streams::record_stream`` has another op's fake implementation (Inductor
    raised "missing 1 required positional argument: 'to_dealloc'" on an H200)."""
    try:
        import torch._dynamo.variables.streams  # noqa: F401  (registers the ops, where this module holds them)
    except ImportError:
        pass
    try:
        op = torch.ops.streams.record_stream.default
    except (AttributeError, RuntimeError):
        return True             # no such op: the pass does not insert it
    from torch._subclasses.fake_tensor import FakeTensorMode
    try:
        with FakeTensorMode():
            op(torch.empty(1), 0)
    except TypeError:
        return False
    except Exception:           # noqa: BLE001  (anything else is not this fault: let the compile say)
        return True
    return True


@contextlib.contextmanager
def reload_timing(model: Any) -> Iterator[str | None]:
    """PyTorch's offloading pass places each reload early enough to overlap the backward's compute, timing that
    compute by running its nodes on the device; Inductor's deterministic mode (``torch.use_deterministic_algorithms``)
    forbids such runs and the compile would fail. There, the nodes are timed by the plan's cost model ``model``
    instead (:func:`node_ms`: nothing runs); yields the note saying so, else None."""
    from torch._inductor import config as iconfig
    if not iconfig.deterministic:
        yield None
        return
    try:
        from torch._functorch._activation_offloading import activation_offloading as ao
    except ImportError:
        ao = None
    timed = getattr(ao, "benchmark_node", None)
    if timed is None:          # another layout of PyTorch's pass: its reloads wait at their first use
        from torch._functorch import config as fconfig
        with fconfig.patch(activation_reload_prefetch=False):
            yield ("reloads not prefetched: Inductor's deterministic mode forbids timing the backward's nodes "
                   "on the device, and this PyTorch's offloading pass cannot be given estimates")
        return
    ao.benchmark_node = node_ms(model)
    try:
        yield ("reloads ordered by the cost model's estimate of the backward's nodes (Inductor's deterministic "
               "mode forbids timing them on the device)")
    finally:
        ao.benchmark_node = timed


def node_ms(model: Any) -> Any:
    """Milliseconds of one graph node by ``model`` (a :class:`DeviceModel`): its FLOPs or the bytes it reads and
    writes, whichever bounds it, counted as the joint graph counts a stage's (:mod:`hybridmem.compile.joint`)."""
    if not isinstance(model, DeviceModel):
        model = get_cost_model("cpu")

    def ms(node: fx.Node) -> float:
        tensors = [t for v in (*(a.meta.get("val") for a in node.all_input_nodes), node.meta.get("val"))
                   for t in tensor_vals(v)]
        dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else None
        return model.roofline(node_flops(node), sum(node_nbytes(t) for t in tensors), dtype) * 1e3

    return ms
