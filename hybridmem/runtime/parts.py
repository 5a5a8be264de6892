"""What each piece built around the runtime reads of it, as narrow protocols.

:class:`~.compose.Runtime` builds :class:`~.dispatch_mode.RuntimeMode`, :class:`~.follow.PlanFollower`,
:class:`~.planbook_switch.BucketSwitch` and :class:`~.native_device.NativeDevice` and hands each itself; each reads a
few of its attributes. The protocols below list exactly those, so that the pieces import nothing from
the runtime (no import circle) and a test can hand them a small stand-in. A protocol is only a type: the pieces
read the runtime's attributes directly, as before, at no cost per op. This module imports only the
runtime's lower pieces, never the runtime object or the modules that take these protocols.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from hybridmem.plugins.base import Policy

from ..config import Config
from .distributed import FsdpStorageSync
from .estimate import OutputEstimator
from .lineage import Recorder
from .meter import Meter
from .prefetch import Prefetcher
from .activations import ProducedTable
from .residency import Residency
from .saved import SavedStore
from .stats import StatsRecorder
from .steps import Clock, StepTracker

__all__ = ["FollowerRuntime", "BucketRuntime", "ModeRuntime", "DeviceRuntime"]


class FollowerRuntime(Protocol):
    """What :class:`~.follow.PlanFollower` reads: where a plan's actions go and where its state is noted."""

    device: torch.device
    policies: dict[str, Policy]
    residency: Residency
    store: SavedStore
    stats: StatsRecorder
    steps: StepTracker


class BucketRuntime(FollowerRuntime, Protocol):
    """What :class:`~.planbook_switch.BucketSwitch` reads and sets: the budget a bucket's plan is looked up by, and
    the follower of the step about to start (the runtime's and its mode's). It hands the runtime on to the
    followers it makes."""

    budget: int | None
    follower: Any   # the step's PlanFollower, or None (the online scorer alone); set per step
    mode: Any       # the RuntimeMode while installed, else None; its follower is set too


class ModeRuntime(Protocol):
    """What :class:`~.dispatch_mode.RuntimeMode` reads: the pieces it calls around each op (bound to its own
    attributes once, at construction), and per call the few that change while it lives."""

    budget: int | None
    recorder: Recorder | None
    follower: Any   # PlanFollower or None; read per op (a plan book switches it between steps)
    prefetcher: Prefetcher | None
    steps: StepTracker
    estimator: OutputEstimator
    produced: ProducedTable
    residency: Residency
    store: SavedStore
    stats: StatsRecorder
    clock: Clock
    buckets: object | None       # a BucketSwitch: the follower may change per step
    mode: Any                    # this mode while installed; None once let go of (passes ops through)
    mode_on: bool                # the mode is entered (off during a steady-state step)
    native: object | None        # the NativeDevice, where the allocator caps each allocation
    fsdp_sync: FsdpStorageSync
    op_peak: tuple[Callable[[], Any], Callable[[Any], int]]   # (start, read): an op's peak, measured


class DeviceRuntime(Protocol):
    """What :class:`~.native_device.NativeDevice` and :func:`~.native_device.native_device` read and wire."""

    cfg: Config
    device: torch.device
    budget: int | None
    policies: dict[str, Policy]
    meter: Meter
    residency: Residency
    store: SavedStore
    stats: StatsRecorder
    fsdp_sync: FsdpStorageSync
