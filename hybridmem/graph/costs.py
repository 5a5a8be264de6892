"""Cost models: the one place that says how long an op, a copy or a compression takes on a device.

Two kinds share one small interface (:class:`CostModel`):

- :class:`DeviceModel`: analytic, from datasheet numbers. An op costs a roofline,
  ``max(flops / (peak[dtype] * efficiency), bytes_accessed / (hbm * hbm_efficiency)) + ops * launch``;
  a copy costs ``nbytes / link bandwidth`` in its direction; a compression costs the memory traffic of
  reading the input and writing the output at the codec's share of the HBM bandwidth.
- :class:`MeasuredCostModel`: per-stage seconds measured on a real run (``graph.meta["measured_cost_s"]``),
  with a :class:`DeviceModel` underneath for copies and codecs.

The numbers and their sources are in ``docs/devices.md``. Names are looked up with :func:`get_cost_model`::

    m = get_cost_model("h100-80gb")
    m.op_time(stage), m.copy_time(64 << 20, "d2h"), m.compress_time(64 << 20, "bf16")
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from ..errors import UnknownNameError
from .units import host_memory

if TYPE_CHECKING:
    from .ir import Graph, Stage

TFLOPS = 1e12
GBPS = 1e9
GIB = 2**30

DEFAULT_DEVICE = "h100-80gb"

# dtype spellings seen in graphs (torch str(dtype), numpy names, short forms) -> peak-table key
_DTYPE_KEYS = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "tf32": "tf32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8",
    "fp8": "fp8",
}
_LOW_PRECISION = ("float16", "bfloat16", "fp8")


def dtype_key(dtype: str | None) -> str:
    """Normalise a dtype name to a peak-table key (``float32``, ``float16``, ``bfloat16``, ``fp8``).

    Integer, boolean, float64 and unknown dtypes map to ``float32``: ops on them are rare and small in a
    training step, and the CUDA-core rate is the honest guess for them.
    """
    if not dtype:
        return "float32"
    d = str(dtype).removeprefix("torch.").lower()
    return _DTYPE_KEYS.get(d, "float32")


@dataclass(frozen=True)
class Codec:
    """A compression codec for the ``compress`` policy: a bytes/throughput model.

    Time = launch + (input + output bytes) / (HBM bandwidth * hbm_efficiency * speed). ``speed`` is the
    codec's throughput as a share of a plain memory-bound copy (1.0 for a dtype cast, less for codecs
    that make several passes or do real entropy work).
    """

    name: str
    ratio: float              # default compressed bytes / original bytes
    lossless: bool
    compress_speed: float     # share of the effective HBM bandwidth while compressing
    decompress_speed: float   # ... and while decompressing


# Assumptions, not measurements (docs/devices.md): casts stream at memory speed; zero-value compression
# (a bitmap plus the non-zeros, as in cDMA) needs a scan and a compaction pass; an LZ-style codec on a
# GPU (nvCOMP class) runs at a few percent of HBM bandwidth, decompression somewhat faster.
CODECS: dict[str, Codec] = {
    "": Codec("", 0.5, True, 1.0, 1.0),            # unnamed: treated as a memory-bound transform
    "fp16": Codec("fp16", 0.5, False, 1.0, 1.0),
    "bf16": Codec("bf16", 0.5, False, 1.0, 1.0),
    "fp8": Codec("fp8", 0.25, False, 1.0, 1.0),
    "zvc": Codec("zvc", 0.5, True, 0.5, 0.5),
    "lz4": Codec("lz4", 0.6, True, 0.03, 0.08),
}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise UnknownNameError("codec", name, [k for k in CODECS if k]) from None


@runtime_checkable
class CostModel(Protocol):
    """What the simulator and the solvers need from a cost model."""

    name: str
    memory_bytes: int

    def op_time(self, stage: "Stage", dtype: str | None = None) -> float: ...

    def op_times(self, graph: "Graph") -> np.ndarray: ...

    def copy_time(self, nbytes: int, direction: str) -> float: ...

    def compress_time(self, nbytes: int, codec: str = "", ratio: float | None = None) -> float: ...

    def decompress_time(self, nbytes: int, codec: str = "", ratio: float | None = None) -> float: ...


_DIRECTIONS = {"h2d": "h2d", "in": "h2d", "swap_in": "h2d", "d2h": "d2h", "out": "d2h", "swap_out": "d2h"}


@dataclass(frozen=True)
class DeviceModel:
    """Analytic cost model of one accelerator (or of the CPU acting as a simulated device).

    ``peak_flops`` maps dtype keys (``float32``, ``tf32``, ``float16``, ``bfloat16``, ``fp8``) to dense
    peak FLOP/s (tensor-core rates where the chip has them, no structured sparsity). ``h2d_bw``/``d2h_bw``
    are *achieved* pinned-memory copy rates over the host link, not the link's spec. ``efficiency`` is the
    achieved share of peak FLOP/s for the matmul/conv-like ops that dominate FLOPs; ``hbm_efficiency`` the
    achieved share of peak memory bandwidth for streaming ops. ``launch_s`` is charged once per original op.
    ``copies_overlap``: whether swaps copy beside the compute stream (a GPU's copy engines); where they do
    not (the CPU as a simulated device: a swap is a copy on the calling thread) the simulator charges each
    copy to the compute stream in full. ``host_save_s``: what the runtime's saved-tensor hooks (a pack and an
    unpack per tensor autograd saves) cost the step, charged once per save to a plan that evicts anything:
    on the CPU the ops wait for them (one thread runs both); 0 where the device runs ahead of the host.
    """

    name: str
    peak_flops: Mapping[str, float] = field(hash=False)
    hbm_bw: float                 # B/s, datasheet peak
    h2d_bw: float                 # B/s, achieved host -> device (pinned)
    d2h_bw: float                 # B/s, achieved device -> host (pinned)
    memory_bytes: int
    efficiency: float = 0.5
    hbm_efficiency: float = 0.8
    launch_s: float = 5e-6
    allow_tf32: bool = False      # float32 matmuls on tensor cores (torch.backends.cuda.matmul.allow_tf32)
    copies_overlap: bool = True   # swaps copy beside the compute stream
    host_save_s: float = 0.0      # the runtime's host seconds per saved tensor the step waits for
    link: str = ""                # what the host link is, for reports
    notes: str = ""

    def peak(self, dtype: str | None = None) -> float:
        """Dense peak FLOP/s for ``dtype``; a dtype the chip lacks falls back to its nearest rate."""
        key = dtype_key(dtype)
        if key == "float32" and self.allow_tf32 and "tf32" in self.peak_flops:
            key = "tf32"
        p = self.peak_flops.get(key)
        if p is None and key in _LOW_PRECISION:  # e.g. fp8 on an A100: runs as fp16/bf16
            p = self.peak_flops.get("bfloat16") or self.peak_flops.get("float16")
        return p if p is not None else self.peak_flops["float32"]

    def op_time(self, stage: "Stage", dtype: str | None = None) -> float:
        """Roofline seconds of one stage: compute- or memory-bound, plus launch overhead per op."""
        return self.roofline(stage.flops, stage.bytes_accessed, dtype, stage.ops)

    def roofline(self, flops: float, nbytes: float, dtype: str | None = None, ops: int = 1) -> float:
        """Seconds of ``ops`` kernels that do ``flops`` and move ``nbytes``: compute- or memory-bound, plus
        launch overhead per op."""
        compute = flops / (self.peak(dtype) * self.efficiency)
        memory = nbytes / (self.hbm_bw * self.hbm_efficiency)
        return max(compute, memory) + max(ops, 1) * self.launch_s

    def op_times(self, graph: "Graph") -> np.ndarray:
        """Seconds of every stage; the compute dtype of a stage is taken from its first output (or input)."""
        n = graph.num_stages
        flops = np.fromiter((s.flops for s in graph.stages), np.float64, n)
        nbytes = np.fromiter((s.bytes_accessed for s in graph.stages), np.float64, n)
        ops = np.fromiter((max(s.ops, 1) for s in graph.stages), np.float64, n)
        peaks = np.fromiter((self.peak(stage_dtype(graph, s)) for s in graph.stages), np.float64, n)
        return np.maximum(flops / (peaks * self.efficiency), nbytes / (self.hbm_bw * self.hbm_efficiency)) \
            + ops * self.launch_s

    def copy_time(self, nbytes: int, direction: str) -> float:
        """Seconds to copy ``nbytes`` over the host link; ``direction`` is ``h2d`` or ``d2h``."""
        d = _DIRECTIONS.get(direction)
        if d is None:
            raise UnknownNameError("copy direction", direction, ["h2d", "d2h"])
        return nbytes / (self.h2d_bw if d == "h2d" else self.d2h_bw)

    def _codec_time(self, nbytes: int, codec: str, ratio: float | None, speed_attr: str) -> float:
        c = get_codec(codec)
        r = c.ratio if ratio is None else ratio
        traffic = nbytes * (1.0 + r)      # read one form, write the other
        return self.launch_s + traffic / (self.hbm_bw * self.hbm_efficiency * getattr(c, speed_attr))

    def compress_time(self, nbytes: int, codec: str = "", ratio: float | None = None) -> float:
        """Seconds on the compute stream to compress ``nbytes`` with ``codec`` (to ``nbytes * ratio``)."""
        return self._codec_time(nbytes, codec, ratio, "compress_speed")

    def decompress_time(self, nbytes: int, codec: str = "", ratio: float | None = None) -> float:
        """Seconds on the compute stream to restore ``nbytes`` from their compressed form."""
        return self._codec_time(nbytes, codec, ratio, "decompress_speed")


@dataclass(frozen=True, init=False)
class MeasuredCostModel:
    """Per-stage seconds measured on a real run; copies and codecs come from ``base``.

    ``stage_s[i]`` is the time of stage ``i``; a graph with another number of stages is refused.
    ``outside_s``: what a step spends outside its ops (the autograd engine, Python, freeing memory), which
    every step pays whatever its plan; :meth:`from_graph` reads it from a capture's timed warm-up step.
    """

    stage_s: tuple[float, ...]
    base: DeviceModel
    name: str = "measured"
    outside_s: float = 0.0

    def __init__(self, stage_s: Sequence[float], base: "DeviceModel | str" = "cpu", name: str = "measured",
                 outside_s: float = 0.0):
        object.__setattr__(self, "stage_s", tuple(float(x) for x in stage_s))
        object.__setattr__(self, "base", get_cost_model(base) if isinstance(base, str) else base)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "outside_s", float(outside_s))
        if any(not x >= 0 for x in self.stage_s) or not self.outside_s >= 0:
            raise ValueError("measured stage seconds and outside_s must be non-negative numbers")

    @classmethod
    def from_graph(cls, graph: "Graph", base: "DeviceModel | str | None" = None) -> "MeasuredCostModel":
        """Read ``graph.meta["measured_cost_s"]``, and ``outside_s`` from ``graph.meta["step_s"]`` where the capture
        timed a warm-up step (:func:`outside_ops_s`); ``base`` defaults to ``graph.meta["device"]`` or ``cpu``."""
        measured = graph.meta.get("measured_cost_s")
        if measured is None:
            raise ValueError("graph.meta has no 'measured_cost_s': capture with timing, or use an analytic "
                             f"device model ({', '.join(sorted(DEVICES))})")
        if base is None:
            dev = str(graph.meta.get("device", "cpu"))
            base = dev if _canonical(dev) in DEVICES else "cpu"
        m = cls(measured, base)
        m._check(graph.num_stages)
        object.__setattr__(m, "outside_s", outside_ops_s(graph))
        return m

    @property
    def memory_bytes(self) -> int:  # type: ignore[override]
        return self.base.memory_bytes

    @property
    def copies_overlap(self) -> bool:
        return self.base.copies_overlap

    @property
    def host_save_s(self) -> float:
        return self.base.host_save_s

    def _check(self, n: int) -> None:
        if len(self.stage_s) != n:
            raise ValueError(f"measured costs cover {len(self.stage_s)} stages but the graph has {n}: "
                             "they were measured on another graph")

    def op_time(self, stage: "Stage", dtype: str | None = None) -> float:
        try:
            return self.stage_s[stage.index]
        except IndexError:
            raise ValueError(f"no measured time for stage {stage.index} (have {len(self.stage_s)})") from None

    def op_times(self, graph: "Graph") -> np.ndarray:
        self._check(graph.num_stages)
        return np.asarray(self.stage_s, dtype=np.float64)

    def copy_time(self, nbytes: int, direction: str) -> float:
        return self.base.copy_time(nbytes, direction)

    def compress_time(self, nbytes: int, codec: str = "", ratio: float | None = None) -> float:
        return self.base.compress_time(nbytes, codec, ratio)

    def decompress_time(self, nbytes: int, codec: str = "", ratio: float | None = None) -> float:
        return self.base.decompress_time(nbytes, codec, ratio)


NO_LINK_BW = 1e-3                     # B/s: the host link of a device that cannot swap (planners avoid it)


def without_swaps(model: "CostModel") -> "CostModel":
    """``model`` with a host link so slow that every swap costs more than any recompute: the planners
    recompute (or keep) instead. Its copies overlap the compute stream, so a swapped tensor's bytes would
    leave only when its copy ends, long after the step: no plan fits by swapping (on the compute stream the
    copy would end, however late, and free them). A model of another kind is returned as it is."""
    if isinstance(model, MeasuredCostModel):
        return MeasuredCostModel(model.stage_s, without_swaps(model.base), model.name, model.outside_s)
    if not isinstance(model, DeviceModel):
        return model
    return replace(model, h2d_bw=NO_LINK_BW, d2h_bw=NO_LINK_BW, copies_overlap=True, name=f"{model.name} (no swap)")


def planning_model(graph: "Graph", device: "str | CostModel") -> "CostModel":
    """The cost model a plan of ``graph`` for ``device`` is made and judged with: on the device the graph was
    captured on (the CPU), with the op times that capture measured (``meta["measured_cost_s"]``), what its
    timed warm-up step spent outside them, and ``device``'s copies and codecs; else ``device``'s own model (a
    meta capture, or another device)."""
    model = get_cost_model(device)
    measured = graph.meta.get("measured_cost_s")
    if (isinstance(model, DeviceModel) and model.name == "cpu" and graph.meta.get("device") == "cpu"
            and isinstance(measured, list) and len(measured) == graph.num_stages):
        return MeasuredCostModel(measured, model, outside_s=outside_ops_s(graph))
    return model


def outside_ops_s(graph: "Graph") -> float:
    """Seconds a step of ``graph`` spends outside its ops: the capture's timed warm-up step (forward and
    backward, ``meta["step_s"]``) less the measured times of its forward and backward ops; 0 without one."""
    step = graph.meta.get("step_s")
    measured = graph.meta.get("measured_cost_s")
    if not isinstance(step, (int, float)) or not isinstance(measured, list) or len(measured) != graph.num_stages:
        return 0.0
    ops = sum(t for t, s in zip(measured, graph.stages) if s.phase in ("forward", "backward"))
    return max(0.0, float(step) - ops)


def copies_overlap(model: Any) -> bool:
    """Whether ``model``'s swaps copy beside the compute stream (a model that does not say: they do)."""
    return bool(getattr(model, "copies_overlap", True))


def stage_dtype(graph: "Graph", stage: "Stage") -> str:
    """The dtype a stage computes in: that of its first output, else its first input, else float32."""
    ids = stage.outputs or stage.inputs
    return graph.tensors[ids[0]].dtype if ids else "float32"


def _host_memory() -> int:
    return host_memory() or 16 * GIB  # a platform that does not say: a small machine


# Datasheet numbers (peak, dense) and achieved host-link assumptions: see docs/devices.md for sources.
# H100 SXM5 and H200 SXM share the Hopper GH100 compute (dense, no sparsity); they differ in HBM only.
_HOPPER_FLOPS = {"float32": 67 * TFLOPS, "tf32": 494.5 * TFLOPS, "float16": 989.4 * TFLOPS,
                 "bfloat16": 989.4 * TFLOPS, "fp8": 1978.9 * TFLOPS}

DEVICES: dict[str, DeviceModel] = {
    m.name: m for m in (
        DeviceModel(
            "v100-16gb",
            {"float32": 15.7 * TFLOPS, "float16": 125 * TFLOPS, "bfloat16": 15.7 * TFLOPS},
            hbm_bw=900 * GBPS, h2d_bw=12 * GBPS, d2h_bw=12 * GBPS, memory_bytes=16 * GIB,
            link="PCIe 3.0 x16 (15.75 GB/s spec per direction; ~12 GB/s achieved pinned)",
            notes="V100 SXM2 16GB; no bf16 tensor cores (bf16 runs at the fp32 rate)"),
        DeviceModel(
            "a100-80gb",
            {"float32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS, "float16": 312 * TFLOPS, "bfloat16": 312 * TFLOPS},
            hbm_bw=2039 * GBPS, h2d_bw=24 * GBPS, d2h_bw=24 * GBPS, memory_bytes=80 * GIB,
            link="PCIe 4.0 x16 (31.5 GB/s spec per direction; ~24 GB/s achieved pinned)",
            notes="A100 SXM4 80GB; no fp8 (falls back to the bf16 rate)"),
        DeviceModel(
            "h100-80gb",
            dict(_HOPPER_FLOPS),
            hbm_bw=3350 * GBPS, h2d_bw=50 * GBPS, d2h_bw=50 * GBPS, memory_bytes=80 * GIB,
            link="PCIe 5.0 x16 (63 GB/s spec per direction; ~50 GB/s achieved pinned)",
            notes="H100 SXM5 80GB HBM3"),
        DeviceModel(
            "h200",
            dict(_HOPPER_FLOPS),
            hbm_bw=4800 * GBPS, h2d_bw=50 * GBPS, d2h_bw=50 * GBPS, memory_bytes=141 * GIB,
            link="PCIe 5.0 x16 (63 GB/s spec per direction; ~50 GB/s achieved pinned)",
            notes="H200 SXM 141GB HBM3e; compute as H100 SXM"),
        DeviceModel(
            "cpu",
            # 2 vCPUs of an AMD EPYC (Zen 3, AVX2, 2 x 256-bit FMA/cycle) at 2.45 GHz: 2*2.45e9*32 FLOP/s
            # fp32. No native half-precision FMA: fp16/bf16 run at the fp32 rate at best.
            {"float32": 156.8e9, "float16": 156.8e9, "bfloat16": 156.8e9},
            # what the swap policy's copies achieve here (python -m bench.copy_rate): back into the budgeted
            # allocator's new pages ~2 GB/s, out into numpy's ~6 GB/s for tensors of 64 MiB and more
            hbm_bw=20 * GBPS, h2d_bw=2 * GBPS, d2h_bw=6 * GBPS, memory_bytes=_host_memory(),
            copies_overlap=False, host_save_s=50e-6,
            link="memcpy on the calling thread into newly allocated pages (2 / 6 GB/s measured, 2 cores)",
            notes="this development machine as a simulated device; op rates nominal, copy rate measured"),
    )
}

_ALIASES = {"v100": "v100-16gb", "a100": "a100-80gb", "h100": "h100-80gb", "h200-141gb": "h200"}


def _canonical(name: str) -> str:
    n = name.strip().lower()
    return _ALIASES.get(n, n)


def get_cost_model(name: "str | CostModel") -> "DeviceModel | CostModel":
    """The cost model called ``name`` (case-insensitive; ``h100`` = ``h100-80gb``); a model passes through.

    An unknown name raises :class:`~hybridmem.errors.UnknownNameError` listing the known ones.
    """
    if not isinstance(name, str):
        if isinstance(name, CostModel):
            return name
        raise TypeError(f"expected a device name or a cost model, got {type(name).__name__}")
    key = _canonical(name)
    if key not in DEVICES:
        raise UnknownNameError("device model", name, list(DEVICES))
    return DEVICES[key]


def apply_costs(graph: "Graph", model: "str | CostModel") -> "Graph":
    """A copy of ``graph`` with every ``Stage.cost_s`` set by ``model``; ``meta["cost_model"]`` names it."""
    m = get_cost_model(model)
    times = m.op_times(graph)
    out = copy.deepcopy(graph)
    for s, t in zip(out.stages, times):
        s.cost_s = float(t)
    out.meta["cost_model"] = m.name
    return out


def resolve_cost_model(cost_model: Any) -> Any:
    """``capture(cost_model=)``: a cost model object, ``"measured"``, or None (decided after the run)."""
    if cost_model is None or cost_model == "measured":
        return cost_model
    if isinstance(cost_model, str):
        return get_cost_model(cost_model)
    if not callable(getattr(cost_model, "op_time", None)):
        raise TypeError(f"cost_model must have an op_time(stage) -> seconds method (or be a name); "
                        f"got {type(cost_model).__name__}")
    return cost_model


def set_stage_costs(graph: "Graph", cost_model: Any, measured: list[float] | None) -> str:
    """Set every ``Stage.cost_s`` of a captured graph in place: the measured op times (``"measured"``, or
    no model on a real run), else the model's (default: :data:`DEFAULT_DEVICE`). Return the model's name
    for ``graph.meta``."""
    if cost_model == "measured" or (cost_model is None and measured is not None):
        if measured is None:
            raise ValueError("cost_model='measured' needs a real run: op times cannot be measured on meta")
        for s, dt in zip(graph.stages, measured):
            s.cost_s = dt
        return "measured"
    model = cost_model if cost_model is not None else get_cost_model(DEFAULT_DEVICE)
    if callable(getattr(model, "op_times", None)):  # vectorised and dtype-aware (this module's models)
        times = [float(t) for t in model.op_times(graph)]
    else:
        times = [float(model.op_time(s)) for s in graph.stages]
    for s, t in zip(graph.stages, times):
        s.cost_s = t
    return str(getattr(model, "name", type(model).__name__))

