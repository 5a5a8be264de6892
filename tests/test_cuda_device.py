"""The native device's CUDA wiring, on the CPU, with torch's CUDA entry points stood in for (CUDA review
R6, R7, R13).

- R6: turning on expandable segments keeps the user's other allocator settings (torch re-parses the whole
  string it is given), and uninstall puts the old settings string and the old memory fraction back;
- R7: in a forked child of a CUDA-initialised process (where every CUDA call raises) the release calls
  none and completes; also through a real ``os.fork``;
- R13: enable leaves the user's ``max_memory_allocated`` alone (``reset_stats`` resets it), and the
  callback's headroom keeps two expandable-segment roundings and the workspace under the cap.
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import hybridmem.runtime as runtime
from hybridmem.native import allocconf
from hybridmem.native.allocconf import EXPANDABLE_SLACK, SavedAllocator, prefer_expandable_segments
from hybridmem.runtime.native_device import NativeDevice
from hybridmem.runtime.meter import Meter

MIB = 1 << 20
TOTAL = 80 << 30
FORKED = "Cannot re-initialize CUDA in forked subprocess"


class FakeAllocator:
    """torch's allocator settings string and per-process memory fraction, as the entry points see them."""

    def __init__(self, settings: str = "", fraction: float = 1.0):
        self.settings, self.fraction = settings, fraction
        self.sets: list[str] = []
        self.peak_resets = 0
        self.bad_fork = False

    def set_settings(self, s: str) -> None:
        self._cuda("set allocator settings")
        self.sets.append(s)
        self.settings = s

    def set_fraction(self, f: float, device: Any = None) -> None:
        self._cuda("set_per_process_memory_fraction")
        self.fraction = f

    def get_fraction(self, device: Any = None) -> float:
        self._cuda("get_per_process_memory_fraction")
        return self.fraction

    def _cuda(self, what: str) -> None:
        if self.bad_fork:
            raise RuntimeError(f"{FORKED} ({what})")

    def reset_peak(self, device: Any = None) -> None:
        self._cuda("reset_peak_memory_stats")
        self.peak_resets += 1


@pytest.fixture
def alloc(monkeypatch) -> FakeAllocator:
    a = FakeAllocator("roundup_power2_divisions:4", 0.5)
    for var in allocconf.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: a.settings, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", a.set_settings, raising=False)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", a.get_fraction)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", a.set_fraction)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(total_memory=TOTAL))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: a._cuda("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: a._cuda("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", a.reset_peak)
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: a.bad_fork)
    # a CPU build has no allocator statistics: the meter's counters are stood in for by each test
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda i: {}, raising=False)
    return a


def _device(peak: int = 0, allocated: int = 0, workspace: int = 0) -> tuple[NativeDevice, SimpleNamespace, list]:
    """A NativeDevice for cuda:0 over stand-ins of the runtime's parts and of the native library."""
    calls: list = []
    meter = Meter("cuda:0")
    meter.cuda = SimpleNamespace(peak=lambda: peak, allocated=lambda: allocated)
    notes: list[str] = []
    rt = SimpleNamespace(
        device=torch.device("cuda", 0), budget=8 << 30, cfg=SimpleNamespace(extra={}), meter=meter,
        residency=SimpleNamespace(slack=(8 << 30) // 64 if workspace else MIB, workspace=workspace,
                                  reserve=workspace, relieve_oom=None, exhausted=None),
        stats=SimpleNamespace(notes=notes, note=notes.append),
        store=SimpleNamespace(native=None, unregister_all=lambda: calls.append("unregister_all")),
        fsdp_sync=SimpleNamespace(on_gather=None))
    native = SimpleNamespace(set_cuda_budget=lambda i, b, h=0: calls.append(("cuda_budget", i, b, h)))
    return NativeDevice(native, rt), rt, calls


# ---- R6 ------------------------------------------------------------------------------------------------
def test_expandable_segments_keep_the_users_settings_and_uninstall_restores_them(alloc) -> None:
    dev, rt, _ = _device()
    dev.install()
    assert alloc.settings == "roundup_power2_divisions:4,expandable_segments:True"
    assert alloc.fraction == pytest.approx((8 << 30) / TOTAL)
    dev.lift(True)                               # a surveyed step: uncapped means the user's own cap
    assert alloc.fraction == 0.5
    dev.lift(False)
    dev.uninstall()
    assert alloc.fraction == 0.5                 # the old fraction, not 1.0
    # the old string; expandable segments named off (parsing a string leaves that key as it was)
    assert alloc.settings == "roundup_power2_divisions:4,expandable_segments:False"


def test_settings_that_name_expandable_segments_are_left_alone(alloc) -> None:
    alloc.settings = "expandable_segments:False,max_split_size_mb:256"
    assert "as its settings" in prefer_expandable_segments()
    dev, _, _ = _device()
    dev.install()
    dev.uninstall()
    assert alloc.sets == [] and alloc.fraction == 0.5


def test_without_torchs_getter_the_environments_settings_are_kept(alloc, monkeypatch) -> None:
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    note = prefer_expandable_segments()
    assert alloc.settings == "max_split_size_mb:128,expandable_segments:True", note
    SavedAllocator(torch.device("cuda", 0), "max_split_size_mb:128", 0.75).restore()
    assert alloc.settings == "max_split_size_mb:128,expandable_segments:False" and alloc.fraction == 0.75


# ---- R7 ------------------------------------------------------------------------------------------------
def test_release_in_a_forked_child_calls_no_cuda_and_completes(alloc) -> None:
    dev, rt, calls = _device()
    dev.install()
    alloc.bad_fork = True                        # now every CUDA call raises, as in a fork of a CUDA parent
    dev.uninstall()
    assert calls[-2:] == ["unregister_all", ("cuda_budget", 0, None, 0)]
    assert rt.store.native is None and alloc.fraction != 0.5  # nothing restored: the child has no CUDA


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_real_fork_releases_the_parents_cuda_runtime_without_calling_cuda(alloc, monkeypatch) -> None:
    dev, rt, calls = _device()
    dev.install()
    parent = os.getpid()
    alloc.bad_fork = False
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: os.getpid() != parent)
    monkeypatch.setattr(alloc, "_cuda", lambda what: _raise_in_child(parent, what))
    fake_rt = SimpleNamespace(release=dev.uninstall)
    monkeypatch.setattr(runtime.current, "rt", fake_rt)
    unraisable: list = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    pid = os.fork()
    if pid == 0:  # the child: the at-fork handler has run
        ok = runtime.current.rt is None and not unraisable and ("cuda_budget", 0, None, 0) in calls
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    runtime.current.rt = None
    dev.uninstall()
    assert os.waitstatus_to_exitcode(status) == 0


def _raise_in_child(parent: int, what: str) -> None:
    if os.getpid() != parent:
        raise RuntimeError(f"{FORKED} ({what})")


# ---- R13 and R3's headroom --------------------------------------------------------------------------
def test_enable_leaves_the_users_peak_reading_alone(alloc) -> None:
    dev, rt, _ = _device(peak=6 << 30, allocated=1 << 30)  # the user's peak from before enable
    dev.install()
    rt.meter.reset_peak()                        # what the runtime's install does next
    assert alloc.peak_resets == 0 and any("peak" in n for n in rt.stats.notes)
    rt.meter.reset_peak()                        # hybridmem.reset_stats(): the user asks
    assert alloc.peak_resets == 1


def test_the_callback_keeps_two_segment_roundings_and_the_workspace_under_the_cap(alloc) -> None:
    dev, rt, calls = _device(workspace=64 * MIB)
    dev.install()
    (_, _, budget, headroom), = [c for c in calls if c[0] == "cuda_budget"]
    assert headroom >= 2 * EXPANDABLE_SLACK + 64 * MIB
    assert rt.residency.reserve == 2 * EXPANDABLE_SLACK + 64 * MIB  # the dispatch mode's room at each op too
    small, rt, calls = _device()                 # slack 1 MiB, no workspace
    small.install()
    assert [c[3] for c in calls if c[0] == "cuda_budget"] == [2 * EXPANDABLE_SLACK]
    assert rt.residency.reserve == 2 * EXPANDABLE_SLACK
