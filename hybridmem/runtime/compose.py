"""The runtime object: builds the pieces for one configuration, installs and removes the hooks.

Its other jobs live beside it: the hooks that start steps and save and read tensors
(:mod:`.step_hooks`), and the choice between the dispatch mode and the steady state
(:mod:`.steady_control`); :class:`Runtime` is made of them.

Pieces (one job each): :class:`~.activations.ProducedTable` (which storages are activations),
:class:`~.saved.SavedStore` (saved-tensor hooks and entries), :class:`~.residency.Residency` (the cap:
evict, regenerate, out-of-memory), :class:`~.lineage.Recorder`/:class:`~.replay.Replayer` (recompute),
:class:`~.steps.StepTracker`, :class:`~.estimate.OutputEstimator`, :class:`~.follow.PlanFollower`,
and :class:`~.dispatch_mode.RuntimeMode`, which calls them around every op.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from hybridmem.plugins.base import Policy, get_policy, known_policy_names

from ..graph.planbook import PlanBook, is_book
from .planbook_switch import BucketSwitch
from ..config import Config
from ..devices import cost_model_for, device_budget_bytes, resolve_device
from .distributed import FsdpStorageSync
from ..errors import UnknownNameError
from .meter import Meter
from ..graph.units import fmt_bytes, parse_bytes
from ..graph.plan import Plan
from . import ckpt, current
from ..native.allocconf import SavedAllocator
from ..native.cpumeter import load, unavailable_reason
from .estimate import OutputEstimator
from .native_device import cuda_usable, native_device
from .module_state import FixedMarker
from .follow import PlanFollower
from .lineage import OpCost, Recorder
from .replay import Replayer
from .dispatch_mode import RuntimeMode
from .monitor import NOTE as MONITOR_NOTE, NOTE_CUDA as MONITOR_NOTE_CUDA, AllocatorMonitor, CudaAllocatorView
from .hookless import Hookless, RootHooks
from .prefetch import Prefetcher
from .activations import ProducedTable
from .program import StepProgram
from .residency import Around, NoMode, Residency
from .saved import SavedStore
from .steady_control import SteadyControl
from .step_hooks import StepHooks
from .stats import Stats, StatsRecorder, TensorLog
from .steps import Clock, StepTracker
from .threads import OwnerThread, let_go

# keys of the 'plugins' section that are not policies
RUNTIME_EXTRA = ("cost_model", "cuda_cap", "expandable", "light", "steady", "steady_cuda", "survey", "verify",
                 "workspace")


def check_extra(cfg: Config) -> None:
    """The 'plugins' section: per-policy option mappings (checked by the policy) and the runtime's keys."""
    if not cfg.extra:
        return
    policies = known_policy_names()
    for key, value in cfg.extra.items():
        if key not in RUNTIME_EXTRA and key not in policies:
            raise ValueError(f"{cfg.source('extra')}: unknown key {key!r}; accepted: the policies {policies} "
                             f"(each a mapping of its options) and {list(RUNTIME_EXTRA)}")
        if key in ("expandable", "steady", "steady_cuda", "survey", "verify") and not isinstance(value, bool):
            raise ValueError(f"{cfg.source('extra')}: {key}: expected true or false, got {value!r}")
        if key == "workspace":
            parse_bytes(value, what=f"{cfg.source('extra')}: workspace")   # bytes, e.g. 64MiB
        if key in policies and value is not None and not isinstance(value, dict):
            raise ValueError(f"{cfg.source('extra')}: {key}: expected a mapping of the policy's options, "
                             f"got {value!r}")


def prefixed(e: ValueError, where: str) -> ValueError:
    """``e`` (same type, so UnknownNameError stays one) with its message led by where the setting came from."""
    e.args = (f"{where}: {e.args[0] if e.args else e}", *e.args[1:])
    return e


@contextmanager
def named(cfg: Config, key: str) -> Iterator[None]:
    """Errors about setting ``key`` name where it came from (variable, file, argument)."""
    try:
        yield
    except ValueError as e:
        raise prefixed(e, cfg.source(key)) from None


def regions_runtime() -> "Runtime | None":
    """The runtime that takes ``torch.utils.checkpoint`` regions over on the calling thread, if any."""
    rt = current.rt  # read per call: the runtime enabled now
    if rt is not None and rt.takes_regions and rt.mode is not None and rt.owner.here():
        return rt
    return None


def resolve_plan(plan: Any) -> Plan | None:
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        if is_book(plan):
            return None  # a plan book (folder): the Runtime picks a plan per step (BucketSwitch)
        return Plan.load(plan)
    raise ValueError(f"plan must be a Plan, a path to a plan file, or None; got {type(plan).__name__}")


class Runtime(StepHooks, SteadyControl):
    """One enabled configuration. ``install`` starts managing the calling thread; ``uninstall`` stops."""

    def __init__(self, cfg: Config, plan: Plan | None = None):
        self.cfg = cfg
        with named(cfg, "device"):
            self.device = resolve_device(cfg.device)
        with named(cfg, "budget"):
            self.budget = device_budget_bytes(cfg.budget, self.device)
        if self.budget is None and plan is not None and plan.budget_bytes:
            self.budget = plan.budget_bytes  # the online scorer keeps the plan's budget where it is left
        self.plan = plan
        self.stats = StatsRecorder(tensor_log=TensorLog())  # bounded: the report's per-tensor measured rows
        self.clock = Clock()
        self.meter = Meter(self.device)  # the runtime enforces the budget itself, before each op
        self.fsdp_sync = FsdpStorageSync(self.meter)  # FSDP's resize_ is not an op: re-read at collectives
        self.produced = ProducedTable(self.meter)
        self.policies = self._make_policies(cfg)
        self.steps = StepTracker(self._step_started, self._step_ended)
        # light steady steps far from the budget run with the saved-tensor hooks off the stack
        self.hookless = Hookless(self._pack_hook, self._unpack_hook, self.steps.backward_seen)
        self.root_hooks = RootHooks(self.hookless, self._root_called, self._root_returned)
        # Prefetching pays where copies overlap compute (CUDA side streams); on the simulated CPU
        # device a prefetch is a synchronous regeneration done early, memory spent for nothing.
        self.prefetcher: Prefetcher | None = None
        if self.device.type == "cuda" and self.budget is not None and any(
                n != "recompute" for n in self.policies):
            self.prefetcher = Prefetcher(self.steps)
        # A step the budget cannot hold goes on uncapped to measure what it needs (runtime.survey)
        survey = self.budget is not None and cfg.extra.get("survey", True)
        around = Around(in_step=self.steps.in_step, state_to_come=self._state_to_come,
                        on_budget=self._working_budget, lift_cap=self._lift_cap if survey else None)
        store_of = partial(SavedStore, self.device, self.produced, self.stats, self.clock, order=self.prefetcher)
        self.residency = Residency(store_of, self.policies, self.meter, self.stats, self.budget, around,
                                   workspace=self._workspace(cfg), verify=bool(cfg.extra.get("verify", False)))
        self.store = self.residency.store
        book = PlanBook.load(cfg.plan) if plan is None and is_book(cfg.plan) else None
        manages = self.budget is not None or plan is not None or book is not None
        self.recorder: Recorder | None = None
        self.replayer: Replayer | None = None
        if manages and "recompute" in self.policies:
            self.recorder = Recorder(self.produced.get, torch.are_deterministic_algorithms_enabled,
                                     OpCost(cost_model_for(self.device, cfg.extra.get("cost_model"))),
                                     self.fsdp_sync.resizable, self._random_recorded)
            self.replayer = Replayer(self.residency.fetch, self.residency.adopt_replayed, self.steps.epoch,
                                     self.store.claim, self.store.drain, self.store.register_again,
                                     self.meter.retry_oom)
        self.owner = OwnerThread()
        self.fixed = FixedMarker(self.produced, self.meter, self._module_called, self.stats.optimizer_stepped)
        self.estimator = OutputEstimator()
        self.follower = PlanFollower(plan, self) if plan is not None else None
        if self.follower is not None:
            self.stats.plan = "pending"
        self.buckets = BucketSwitch(book, self) if book is not None else None
        hints = self.residency.hints.values()  # the policies' optional methods, bound once (plugins.base.PolicyHints)
        for h in hints:
            if h.bind is not None:
                h.bind(self)
        # policies that learn from each step (swap: the share of its copies compute hid)
        self._policy_step_ends = [h.step_ended for h in hints if h.step_ended is not None]
        self.mode: RuntimeMode | None = None
        self._hooks: Any = None
        self._build_monitor(cfg, manages)
        # The budget caps what the allocator holds, enforced at allocation time (runtime.native_device).
        self.native = native_device(self, manages)
        self.op_peak = self._op_peak()
        # Nothing is ever evicted without a budget or a plan: saved tensors need no entries, only counting.
        self._pack = self.store.pack if manages else self.store.pack_counting
        # torch.utils.checkpoint regions run plainly under the online scorer's budget (runtime.ckpt)
        self.takes_regions = self.budget is not None and plan is None and book is None and not self.light
        self._init_steady(cfg)
        self._init_hooks()
        self.survey_error: torch.OutOfMemoryError | None = None  # set by uninstall (runtime.survey)

    def _workspace(self, cfg: Config) -> int:
        """``plugins: {workspace: ...}``: room kept free beside the count at each op (0 without a budget)."""
        room = parse_bytes(cfg.extra.get("workspace") or 0, what="plugins: workspace")
        if not room or self.budget is None:
            return 0
        if room >= self.budget:
            raise ValueError(f"plugins: workspace {fmt_bytes(room)}: expected less than the budget "
                             f"({fmt_bytes(self.budget)}); it is the room kept free beside the count")
        # kernels allocate workspaces inside an op, where the count does not see them: cuDNN runs a
        # convolution with another plan (rounding differently) where the cap refuses its plan's workspace
        self.stats.note(f"{fmt_bytes(room)} kept free beside the count at each op for kernels' workspaces")
        return room

    def _lift_cap(self, lifted: bool) -> None:
        """Lift the native device's cap for a step the budget cannot hold (runtime.survey), or put it back;
        where only the dispatch mode enforces the budget, nothing to do."""
        if self.native is not None:
            self.native.lift(lifted)

    def _build_monitor(self, cfg: Config, manages: bool) -> None:
        """Monitor-only through the allocator's counters with counting hooks, nothing per op (runtime.monitor):
        the native meter on the CPU, the caching allocator's counters on CUDA. ``plugins: {light: true}`` on
        CUDA: only its statistics, no hooks (saved bytes and steps not counted)."""
        self.allocator: AllocatorMonitor | None = None
        self.light = False
        kind = self._monitor_kind(cfg, manages)
        if kind == "allocator" and self.device.type == "cuda":
            if cfg.extra.get("light", False):
                self.light = True
            else:
                assert self.meter.cuda is not None
                self.allocator = AllocatorMonitor(CudaAllocatorView(self.device, self.meter.cuda), self.stats)
                self.stats.note(MONITOR_NOTE_CUDA)
        elif kind == "allocator":
            self.allocator = AllocatorMonitor(load(), self.stats)  # _monitor_kind checked it loads
            self.stats.note(MONITOR_NOTE)

    @property
    def program(self) -> StepProgram | None:
        """The program the next step starts with (the one recorded or followed last)."""
        return self.programs.last

    def _op_peak(self) -> tuple[Any, Any]:
        """(start, read): ``read(start())`` after an op is the bytes at its peak (a surveyed step measures each
        op): the native device's window on the CPU; on CUDA the caching allocator's peak where the op raised
        it (its own peak, exactly), else the bytes after it; the count after it elsewhere."""
        meter = self.meter
        native = self.native.native if self.native is not None else None
        if meter.cuda is not None:
            peak, now = meter.cuda.peak, meter.cuda.allocated
            return peak, lambda before: p if (p := peak()) > before else now()
        if native is not None:
            return (lambda: native.window_reset()), (lambda _: native.window_peak)
        return (lambda: 0), (lambda _: meter.current_bytes)

    def _monitor_kind(self, cfg: Config, manages: bool) -> str:
        """``"allocator"`` or ``"ops"`` (see ``Config.monitor``); errors for what cannot be honoured."""
        if manages:
            if cfg.monitor == "allocator":
                raise ValueError("monitor='allocator' measures without a budget or a plan; under a budget the "
                                 "runtime meters every op: use monitor='auto' or 'ops'")
            return "ops"
        if self.device.type == "cuda":
            return "ops" if cfg.monitor == "ops" else "allocator"
        if cfg.monitor == "ops":
            return "ops"
        if load() is not None:
            return "allocator"
        why = unavailable_reason() or "unknown reason"
        if cfg.monitor == "allocator":
            raise ValueError(f"monitor='allocator' on the CPU needs hybridmem's native meter, which is not "
                             f"available here: {why}; use monitor='ops' (or 'auto')")
        self.stats.note(f"monitor: per op (the native CPU meter is not available: {why})")
        return "ops"

    @staticmethod
    def _make_policies(cfg: Config) -> dict[str, Policy]:
        check_extra(cfg)
        out: dict[str, Policy] = {}
        for name in cfg.policies:
            options = dict(cfg.extra.get(name) or {})
            if name == "compress" and cfg.lossy and "lossy" not in options:
                options["lossy"] = cfg.lossy
            try:
                out[name] = get_policy(name, **options)
            except UnknownNameError as e:  # a policy's name, or a codec's (compress)
                raise prefixed(e, cfg.source("policies" if e.what == "policy" else "lossy" if cfg.lossy
                                             else "extra")) from None
            except ValueError as e:
                raise prefixed(e, cfg.source("extra")) from None
        return out

    # ---- install / uninstall -----------------------------------------------------------------
    def install(self, reset_peak: bool = True) -> None:
        self.owner.claim()
        if self.allocator is not None:
            self.allocator.install(reset_peak)
            return
        if self.native is not None:
            self.native.install()
        if reset_peak:
            self.meter.reset_peak()
        if self.light:
            return
        self.mode = RuntimeMode(self.meter, self)
        self.residency.mode = self.mode
        if self.device.type == "cuda":
            self.meter.on_pressure = self.residency.relieve_oom  # allocation failure: evict, retry
            if self.budget is not None and self.cfg.extra.get("cuda_cap", False):
                self.meter.budget_bytes = self.budget
                self._saved_alloc = SavedAllocator.now(self.device)
                self.meter.apply_cuda_cap()
        self.mode.__enter__()
        self.mode_on = True
        if self.buckets is not None:
            self.buckets.install()  # before FixedMarker's hook, where the step starts: it picks the plan
        self.fixed.install()
        self.root_hooks.on()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack_hook, self._unpack_hook)
        self._hooks.__enter__()
        if self.takes_regions and not ckpt.install(regions_runtime):
            self.stats.note("torch.utils.checkpoint regions are left to checkpoint (this torch lacks the "
                            "entry points hybridmem takes them over by)")

    def uninstall(self) -> None:
        if not self.owner.here():
            self.release()
            return
        if self.allocator is not None:
            self.allocator.uninstall()
            return
        if self.light or self.mode is None:
            return
        self.hookless.restore()  # disabled after a step run without the hooks: they go back first, then off
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] != self._pack_hook:
            raise RuntimeError("hybridmem.disable() called inside another saved_tensors_hooks context "
                               "(e.g. torch.autograd.graph.save_on_cpu) opened after enable(): leave it first")
        if self.mode_on and _get_current_dispatch_mode() is not self.mode:
            raise RuntimeError("hybridmem.disable() called inside another TorchDispatchMode entered after "
                               "enable(): leave it first")
        self._hooks.__exit__(None, None, None)
        if self.mode_on:
            self.mode.__exit__(None, None, None)
        # a step measured over the budget and not yet reported: disable() raises it once this is undone
        self.survey_error = self.residency.end_survey()
        self._detach()

    def release(self) -> None:
        """``uninstall`` from a thread other than the installing one: that thread exited (its stacks went
        with it), this is a forked child of it, or another thread takes over. The global hooks go; what
        this thread's stacks hold of the runtime is removed; what a still-running installing thread's
        stacks hold passes everything through from now on."""
        if self.allocator is not None:
            self.allocator.release()
            return
        if self.light or self.mode is None:
            return
        self.mode.quiet_depth += 1
        self.residency.end_survey()
        let_go(self.owner, self._pack_hook, self.mode if self.mode_on else None)
        self._detach()

    def _detach(self) -> None:
        self.fixed.uninstall()
        self.root_hooks.off()
        if self.buckets is not None:
            self.buckets.uninstall()
        self._hooks = None
        self.mode = None
        self.mode_on = False
        self._soft_on = False  # (the device's uninstall turns the soft cap off)
        self.programs.unbind()  # no tensor of the last step stays reachable from a disabled runtime
        self._module = None
        self._steady = None
        self._packfn = self._pack
        self.residency.mode = NoMode()  # entries still alive regenerate unmetered from now on
        if self.native is not None:
            self.native.uninstall()
        elif self.device.type == "cuda" and self.cfg.extra.get("cuda_cap", False):
            if cuda_usable():
                self._saved_alloc.restore()

    # ---- stats ---------------------------------------------------------------------------------
    def snapshot(self) -> Stats:
        self.store.drain()
        src: Any = self.allocator if self.allocator is not None else self.meter
        return self.stats.snapshot(device=str(self.device), budget=self.budget, peak=src.peak_bytes,
                                   current=src.current_bytes)

    def reset_stats(self) -> None:
        (self.allocator if self.allocator is not None else self.meter).reset_peak()
        self.stats.reset()


