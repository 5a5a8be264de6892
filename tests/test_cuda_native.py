"""The native library's CUDA branch compiles wherever CUDA's headers are (a CPU-only torch included), and its
free-memory callback asks which device missed before reading any device's statistics (CUDA review R13) and
whether the current stream captures a graph (R8): the object file compiled with ``HM_WITH_CUDA`` refers to
``c10::cuda::current_device`` and ``cudaStreamIsCapturing``."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from hybridmem.native import cpumeter

SOURCE = Path(cpumeter.__file__).with_name("_cpumeter.cpp")
TORCH = Path(torch.__file__).resolve().parent


def _cuda_include() -> Path | None:
    roots = [Path(os.environ[k]) for k in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(k)]
    roots += [Path("/usr/local/cuda"), *sorted(Path("/usr/local").glob("cuda-*"))]
    roots += sorted((TORCH.parent / "nvidia").glob("cu*"))
    return next((r / "include" for r in roots if (r / "include" / "cuda_runtime_api.h").is_file()), None)


CXX = shutil.which("c++") or shutil.which("g++")
NM = shutil.which("nm")
INCLUDE = _cuda_include()


@pytest.mark.skipif(CXX is None or NM is None or INCLUDE is None or not (TORCH / "include/c10/cuda").is_dir(),
                    reason="needs a C++ compiler, nm, CUDA's headers and torch's c10/cuda headers")
def test_the_cuda_callback_compiles_and_asks_which_device_missed(tmp_path) -> None:
    macros = TORCH / "include/c10/cuda/impl/cuda_cmake_macros.h"
    extra: list[str] = []
    if not macros.is_file():  # a CPU-only wheel ships c10/cuda without its generated header
        stub = tmp_path / "stub/c10/cuda/impl/cuda_cmake_macros.h"
        stub.parent.mkdir(parents=True)
        stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        extra = ["-I", str(tmp_path / "stub")]
    obj = tmp_path / "cpumeter_cuda.o"
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    cmd = [CXX, "-c", "-O0", "-fPIC", "-std=c++20", "-DHM_WITH_CUDA", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *extra,
           "-I", str(TORCH / "include"), "-I", str(INCLUDE), str(SOURCE), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    symbols = subprocess.run([NM, "-C", str(obj)], capture_output=True, text=True, check=True).stdout
    undefined = {line.split(None, 1)[1] for line in symbols.splitlines() if line.split()[0] == "U"}
    defined = {line.split(None, 2)[2] for line in symbols.splitlines() if len(line.split()) > 2}
    assert any(s.startswith("c10::cuda::current_device") for s in undefined), sorted(undefined)
    assert "cudaStreamIsCapturing" in undefined  # and leaves a graph capture alone (R8)
    assert {"hm_cuda_need", "hm_cuda_slack", "hm_cuda_set_budget", "hm_cuda_stat"} <= defined
