"""Cost models: roofline op times, copies, codecs, lookup by name, measured costs."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hybridmem.graph.costs import (DEVICES, DeviceModel, MeasuredCostModel, apply_costs, dtype_key, get_cost_model)
from hybridmem.errors import UnknownNameError
from hybridmem.graph.ir import Graph, Stage, TensorInfo, link_consumers
from hybridmem.graph.simulate import simulate


def matmul_stage(n: int, dtype_bytes: int, ops: int = 1) -> Stage:
    """C = A @ B with n x n operands: 2 n^3 FLOPs, 3 n^2 elements moved."""
    return Stage(0, "forward/fc/mm#0", "aten.mm", flops=2.0 * n**3, bytes_accessed=3 * n * n * dtype_bytes, ops=ops)


def two_stage_graph(dtype: str = "bfloat16") -> Graph:
    ts = [TensorInfo(0, 8192 * 8192 * 2, dtype=dtype, kind="input"),
          TensorInfo(1, 8192 * 8192 * 2, dtype=dtype, producer=0, freed_after=1),
          TensorInfo(2, 8192 * 8192 * 2, dtype=dtype, producer=1)]
    ss = [Stage(0, "forward/a/mm#0", "aten.mm", flops=2.0 * 8192**3, bytes_accessed=3 * 8192**2 * 2,
                inputs=[0], outputs=[1]),
          Stage(1, "forward/a/relu#0", "aten.relu", bytes_accessed=2 * 8192**2 * 2, inputs=[1], outputs=[2])]
    link_consumers(ss, ts)
    return Graph(ss, ts, meta={"model": "toy"}).validate()


def test_known_devices_and_datasheet_numbers():
    assert {"v100-16gb", "a100-80gb", "h100-80gb", "h200", "cpu"} <= set(DEVICES)
    v100, a100, h100, h200 = (DEVICES[k] for k in ("v100-16gb", "a100-80gb", "h100-80gb", "h200"))
    assert v100.hbm_bw == 900e9 and v100.peak("float16") == 125e12 and v100.peak("float32") == 15.7e12
    assert a100.hbm_bw == 2039e9 and a100.peak("bfloat16") == 312e12 and a100.peak_flops["tf32"] == 156e12
    assert h100.hbm_bw == 3.35e12 and h100.peak("bfloat16") == pytest.approx(989.4e12)
    assert h200.hbm_bw == 4.8e12 and h200.peak_flops == h100.peak_flops
    assert h200.memory_bytes > h100.memory_bytes == 80 * 2**30
    for m in (v100, a100, h100, h200):  # achieved host links: below every PCIe spec, above nothing useful
        assert 5e9 <= m.h2d_bw <= 64e9 and 5e9 <= m.d2h_bw <= 64e9 and m.copies_overlap and m.host_save_s == 0
    cpu = DEVICES["cpu"]  # a swap copies on the calling thread into new pages (bench.copy_rate: ~2 GB/s)
    assert 1e9 <= cpu.h2d_bw <= 10e9 and not cpu.copies_overlap and 0 < cpu.host_save_s < 1e-3


def test_roofline_matmul_on_h100():
    h100 = get_cost_model("h100-80gb")
    st = matmul_stage(8192, 2)
    t = h100.op_time(st, "bfloat16")
    # 1.1 TFLOP at half of 989 TFLOP/s ~ 2.2 ms; compute-bound (HBM term ~0.15 ms); + 5 us launch
    assert t == pytest.approx(2 * 8192**3 / (989.4e12 * 0.5) + 5e-6)
    assert 1.5e-3 < t < 3e-3
    # fp32 without TF32 runs on CUDA cores at 67 TFLOP/s: ~15x slower; TF32 allowed: half the bf16 rate
    t32 = h100.op_time(matmul_stage(8192, 4), "float32")
    assert t32 == pytest.approx(2 * 8192**3 / (67e12 * 0.5) + 5e-6)
    tf32 = dataclasses.replace(h100, allow_tf32=True).op_time(matmul_stage(8192, 4), "float32")
    assert tf32 == pytest.approx(2 * 8192**3 / (494.5e12 * 0.5) + 5e-6)


def test_roofline_memory_bound_and_launch_overhead():
    h100 = get_cost_model("h100")
    relu = Stage(0, "f/relu#0", "aten.relu", flops=2**28, bytes_accessed=2 * 2**30)  # 1 GiB in, 1 GiB out
    assert h100.op_time(relu) == pytest.approx(2 * 2**30 / (3.35e12 * 0.8) + 5e-6)
    empty = Stage(0, "f/view#0", "aten.view", ops=3)
    assert h100.op_time(empty) == pytest.approx(15e-6)
    # the same op is faster on H200 (more HBM bandwidth), slower on A100 and V100
    times = [get_cost_model(d).op_time(relu) for d in ("h200", "h100-80gb", "a100-80gb", "v100-16gb")]
    assert times == sorted(times)


def test_dtype_fallbacks():
    a100, v100 = get_cost_model("a100-80gb"), get_cost_model("v100-16gb")
    assert a100.peak("float8_e4m3fn") == a100.peak("bfloat16")   # no fp8 on Ampere
    assert a100.peak("torch.int64") == a100.peak("float32") == 19.5e12
    assert a100.peak("torch.float16") == 312e12
    assert v100.peak("bfloat16") == v100.peak("float32")          # no bf16 tensor cores on Volta
    assert dtype_key("torch.bfloat16") == "bfloat16" and dtype_key(None) == "float32"


def test_copy_time_is_bytes_over_bandwidth():
    for m in DEVICES.values():
        assert m.copy_time(10**9, "h2d") == pytest.approx(1e9 / m.h2d_bw)
        assert m.copy_time(10**9, "d2h") == pytest.approx(1e9 / m.d2h_bw)
    h100 = get_cost_model("h100-80gb")
    assert h100.copy_time(50 * 10**9, "h2d") == pytest.approx(1.0)
    assert h100.copy_time(0, "d2h") == 0
    with pytest.raises(UnknownNameError, match="copy direction"):
        h100.copy_time(1, "sideways")


def test_compress_time_model_and_unknown_codec():
    h100 = get_cost_model("h100-80gb")
    eff_bw = 3.35e12 * 0.8
    assert h100.compress_time(2**30, "bf16") == pytest.approx(5e-6 + 1.5 * 2**30 / eff_bw)
    assert h100.compress_time(2**30, "fp8", 0.25) == pytest.approx(5e-6 + 1.25 * 2**30 / eff_bw)
    assert h100.decompress_time(2**30, "bf16") == pytest.approx(h100.compress_time(2**30, "bf16"))
    assert h100.compress_time(2**30, "lz4") > 10 * h100.compress_time(2**30, "bf16")
    with pytest.raises(UnknownNameError, match="codec"):
        h100.compress_time(1, "zip-9")


def test_get_cost_model_names():
    assert get_cost_model("H100") is DEVICES["h100-80gb"]
    assert get_cost_model("h200-141gb") is DEVICES["h200"]
    m = DeviceModel("custom", {"float32": 1e12}, hbm_bw=1e11, h2d_bw=1e10, d2h_bw=1e10, memory_bytes=2**30)
    assert get_cost_model(m) is m
    with pytest.raises(UnknownNameError) as e:
        get_cost_model("tpu-v5")
    assert "a100-80gb" in str(e.value) and "h200" in str(e.value) and e.value.name == "tpu-v5"
    hash(get_cost_model("cpu"))  # frozen and hashable


def test_op_times_follow_stage_dtype_and_apply_costs_copies():
    g = two_stage_graph("bfloat16")
    h100 = get_cost_model("h100-80gb")
    times = h100.op_times(g)
    assert times[0] == pytest.approx(h100.op_time(g.stages[0], "bfloat16"))
    assert times[1] == pytest.approx(h100.op_time(g.stages[1]))
    g2 = apply_costs(g, "h100-80gb")
    assert g2 is not g and g.stages[0].cost_s == 0 and g.meta.get("cost_model") is None
    assert [s.cost_s for s in g2.stages] == pytest.approx(list(times))
    assert g2.meta["cost_model"] == "h100-80gb" and g2.meta["model"] == "toy"
    assert simulate(g2, device=None).time_s == pytest.approx(float(times.sum()))


def test_measured_cost_model():
    g = two_stage_graph()
    g.meta["measured_cost_s"] = [0.25, 0.5]
    g.meta["device"] = "a100-80gb"
    m = MeasuredCostModel.from_graph(g)
    assert m.base.name == "a100-80gb" and m.op_time(g.stages[1]) == 0.5
    assert m.copy_time(24 * 10**9, "h2d") == pytest.approx(1.0)
    assert np.allclose(m.op_times(g), [0.25, 0.5])
    assert simulate(g, device="measured").time_s == pytest.approx(0.75)
    assert [s.cost_s for s in apply_costs(g, m).stages] == [0.25, 0.5]
    with pytest.raises(ValueError, match="3 stages"):
        MeasuredCostModel([0.1, 0.2, 0.3]).op_times(g)
    del g.meta["measured_cost_s"]
    with pytest.raises(ValueError, match="measured_cost_s"):
        MeasuredCostModel.from_graph(g)
