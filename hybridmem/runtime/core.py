"""The runtime object: builds the pieces for one configuration, installs and removes the hooks.

Pieces (one job each): :class:`~.produced.ProducedTable` (which storages are activations),
:class:`~.saved.SavedStore` (saved-tensor hooks and entries), :class:`~.residency.Residency` (the cap:
evict, regenerate, out-of-memory), :class:`~.lineage.Recorder`/:class:`~.replay.Replayer` (recompute),
:class:`~.steps.StepTracker`, :class:`~.estimate.OutputEstimator`, :class:`~.follow.PlanFollower`,
and :class:`~.mode.RuntimeMode`, which calls them around every op.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from hybridmem.plugins.base import Policy, get_policy, known_policy_names

from ..graph.planbook import PlanBook, is_book
from .buckets import BucketSwitch
from ..config import Config
from ..devices import cost_model_for, device_budget_bytes, resolve_device
from .distributed import FsdpStorageSync
from ..errors import CaptureError, UnknownNameError
from .meter import Meter
from ..graph.units import fmt_bytes, parse_bytes
from ..graph.outputs import storage_of
from ..graph.optstate import optimizer_state
from ..graph.plan import Plan
from .ledger import TensorLog
from . import ckpt
from ..native.allocconf import SavedAllocator
from ..native.capture import capturing
from ..native.cpumeter import load, unavailable_reason
from .estimate import OutputEstimator
from .device import cuda_usable, native_device, planned_first
from .fixed import FixedMarker
from .follow import PlanFollower
from .lineage import OpCost, Recorder
from .replay import Replayer
from .rng import rng_state
from .mode import RuntimeMode
from .monitor import NOTE as MONITOR_NOTE, NOTE_CUDA as MONITOR_NOTE_CUDA, AllocatorMonitor, CudaAllocatorView
from .prefetch import Prefetcher
from .produced import ProducedTable
from .program import ProgramRecorder, StepProgram
from .programs import ProgramSet, signature_of
from .residency import NoMode, Residency
from .saved import REGISTER_BELOW, Saved, SavedStore
from .steady import SteadyParts, SteadyStep
from .stats import Stats, StatsRecorder
from .steps import FORWARD, IDLE, Clock, StepTracker
from .threads import OwnerThread, drop_hooks, leave_mode


# A step with new input sizes follows the program of the nearest ones this many times before it is recorded
SCALED_FOLLOWS = 2

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
    from . import _current  # the package's state, read per call (the package imports core lazily)

    rt = _current
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


class Runtime:
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
        self.stats = StatsRecorder()
        self.stats.tensor_log = TensorLog()  # bounded: the report's per-tensor measured rows
        self.clock = Clock()
        self.meter = Meter(self.device)  # the runtime enforces the budget itself, before each op
        self.fsdp_sync = FsdpStorageSync(self.meter)  # FSDP's resize_ is not an op: re-read at collectives
        self.produced = ProducedTable(self.meter)
        self.store = SavedStore(self.device, self.produced, self.stats, self.clock)
        self.policies = self._make_policies(cfg)
        self.residency = Residency(self.store, self.policies, self.meter, self.stats, self.budget)
        if cfg.extra.get("verify", False):
            self.residency.verify = {}
        room = parse_bytes(cfg.extra.get("workspace") or 0, what="plugins: workspace")
        if room and self.budget is not None:
            if room >= self.budget:
                raise ValueError(f"plugins: workspace {fmt_bytes(room)}: expected less than the budget "
                                 f"({fmt_bytes(self.budget)}); it is the room kept free beside the count")
            # kernels allocate workspaces inside an op, where the count does not see them: cuDNN runs a
            # convolution with another plan (rounding differently) where the cap refuses its plan's workspace
            self.residency.reserve += room
            self.residency.workspace = room
            self.stats.note(f"{fmt_bytes(room)} kept free beside the count at each op for kernels' workspaces")
        book = PlanBook.load(cfg.plan) if plan is None and is_book(cfg.plan) else None
        manages = self.budget is not None or plan is not None or book is not None
        self.recorder: Recorder | None = None
        self.replayer: Replayer | None = None
        if manages and "recompute" in self.policies:
            self.recorder = Recorder(self.produced.get, torch.are_deterministic_algorithms_enabled,
                                     OpCost(cost_model_for(self.device, cfg.extra.get("cost_model"))), self.fsdp_sync.resizable)
            self.replayer = Replayer(self.residency.fetch, self.residency.adopt_replayed, lambda: self.steps.steps,
                                     self.store.claim, self.store.drain, self.store.register_again,
                                     self.meter.retry_oom)
        self.steps = StepTracker(self._step_started, self._step_ended)
        self.residency.in_step = lambda: self.steps.phase != IDLE
        self.residency.on_budget = self._working_budget
        self.residency.state_to_come = self._state_to_come
        self.owner = OwnerThread()
        self.fixed = FixedMarker(self.produced, self.meter, self._module_called, self.stats.optimizer_stepped)
        self.prefetcher: Prefetcher | None = None
        # Prefetching pays where copies overlap compute (CUDA side streams); on the simulated CPU
        # device a prefetch is a synchronous regeneration done early, memory spent for nothing.
        if self.device.type == "cuda" and self.budget is not None and any(
                n != "recompute" for n in self.policies):
            self.prefetcher = Prefetcher(self.residency, self.steps)
            self.store.on_saved, self.store.on_read = self.prefetcher.saved, self.prefetcher.read
        self.estimator = OutputEstimator()
        self.follower = PlanFollower(plan, self) if plan is not None else None
        if self.follower is not None:
            self.stats.plan = "pending"
        self.buckets = BucketSwitch(book, self) if book is not None else None
        for p in self.policies.values():
            bind = getattr(p, "bind", None)
            if bind is not None:
                bind(self)
        # policies that learn from each step (swap: the share of its copies compute hid)
        self._policy_step_ends = [h for p in self.policies.values() if (h := getattr(p, "step_ended", None))]
        self.mode: RuntimeMode | None = None
        self._hooks: Any = None
        # Monitor-only through the allocator's counters with counting hooks, nothing per op (runtime.monitor):
        # the native meter on the CPU, the caching allocator's counters on CUDA. ``plugins: {light: true}`` on
        # CUDA: only its statistics, no hooks (saved bytes and steps not counted).
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
        # The budget caps what the allocator holds, enforced at allocation time (runtime.device).
        self.native = native_device(self, manages)
        # A step the budget cannot hold goes on uncapped to measure what it needs (runtime.survey)
        if self.budget is not None and cfg.extra.get("survey", True):
            self.residency.lift_cap = self.native.lift if self.native is not None else _no_cap
        # a steady step's cap lets a refusal through, for its next hook to recover from (_recover)
        self._soft = self.native is not None and self.residency.lift_cap is not None
        self._soft_on = False  # the soft cap is on now (a steady step's own ops run)
        self._retired: StepProgram | None = None  # the program a refusal retired this step
        self.op_peak = self._op_peak()
        # Nothing is ever evicted without a budget or a plan: saved tensors need no entries, only counting.
        self._pack = self.store.pack if manages else self.store.pack_counting
        # torch.utils.checkpoint regions run plainly under the online scorer's budget (runtime.ckpt)
        self.takes_regions = self.budget is not None and plan is None and book is None and not self.light
        # Steady state (runtime.program, runtime.steady): a step like the recorded one runs with the
        # saved-tensor hooks alone. It needs the allocator to enforce the budget (the native device) and no
        # per-stage work: a followed plan's recomputes become the allocator's order (_finish_program); what
        # the recorded step evicted by swap or compress is evicted as it is saved.
        self.steady_possible = (self.native is not None and self.buckets is None and cfg.extra.get("steady", True))
        if self.steady_possible and self.device.type == "cuda" and not cfg.extra.get("steady_cuda", True):
            self.steady_possible = False
            self.stats.note("steady state: off on CUDA (plugins: {steady_cuda: false}): each op stays under the "
                            "dispatch mode")
        self._steady_parts = SteadyParts(
            self._pack, self.store.pack_bound, self._bind, self._steady_after, self._diverged, self.store.keep,
            self._far, self.stats.saved, self._offload, self.store.sole_owner,
            # prefetch pays where copies overlap compute (CUDA side streams); on the simulated CPU device it
            # is a synchronous regeneration done early, memory spent for nothing
            self._prefetch_one if self.device.type == "cuda" else None, self.store.claim, self._pack_plain)
        self._registrable = self.store.registrable  # the allocator's order without a plan (runtime.device)
        self.plan_recomputes: set[Any] = set()      # program nodes a followed plan recomputes (steady state)
        self.programs = ProgramSet()  # recorded programs by input signature (runtime.programs)
        self._below: Any = None  # the dispatch mode under this runtime's when it left it for the steady state
        self._scaled_seen: dict[Any, int] = {}  # signature -> steps that followed a program of other sizes
        # the native CPU meter's peak window: how far the bytes rose between saves and reads of a recording
        self._window = self.native.native if self.native is not None and self.device.type == "cpu" else None
        self._gap_base, self._gap_most = -1, 0
        self._program_rec: ProgramRecorder | None = None
        self._steady: SteadyStep | None = None
        self._packfn: Any = self._pack
        self._evicted_before: dict[str, int] = {}
        self._registered_before = 0
        self._refused_before = 0
        self._rescues_before: dict[str, int] = {}
        self._calls = 0                      # module calls in this step (random ops' states are read at them)
        self._last_random_call = -1          # the module call after which the last random op ran
        self._module: torch.nn.Module | None = None
        self._root_hook: Any = None  # the pre-hook that reads the step's inputs (_watch_inputs)
        if self.recorder is not None:
            self.recorder.on_random = self._random_recorded
        self.mode_on = False  # the dispatch mode is entered (off during steady-state steps)
        self.survey_error: torch.OutOfMemoryError | None = None  # set by uninstall (runtime.survey)

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
        drop_hooks(self._pack_hook)
        if self.mode_on:
            leave_mode(self.mode)
        self._detach()

    def _detach(self) -> None:
        self.fixed.uninstall()
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

    # ---- steps ---------------------------------------------------------------------------------
    def _module_called(self, module: torch.nn.Module) -> None:
        """Global module pre-hook (every thread): steps start on the installing thread only."""
        if not self.owner.here():
            self.owner.foreign_module_call()
            return
        steps = self.steps
        if self.steady_possible and steps.phase != FORWARD and torch.is_grad_enabled() \
                and torch._C._current_graph_task_id() == -1:
            self._choose_step()  # a step starts here: with the dispatch mode, or in the steady state
        steps.module_called()
        self._calls += 1
        self._module = module
        if self._calls == 1 and self._root_hook is None:
            self._watch_inputs(module)
        steady = self._steady
        if steady is None:
            return
        if steady.off:
            if not self.mode_on and steps.phase == FORWARD and torch._C._current_graph_task_id() == -1 \
                    and not self.mode.quiet_depth and _get_current_dispatch_mode() is self._below:
                # the step left its program part-way: the dispatch mode takes the rest of it over from this
                # module call, evicting as the budget needs (the allocator alone frees only what is registered)
                self._enter_mode()
        elif self._calls in steady.program.random_at:
            why = steady.program.module_called(self._calls, module, self._rng_now)
            if why:
                steady.leave(why)

    def _watch_inputs(self, module: torch.nn.Module) -> None:
        """A pre-hook with keyword arguments on the module that starts steps (global pre-hooks see no
        keywords): from the next step on, its tensor arguments (the batch) are given to the program."""
        me = weakref.ref(self)

        def hook(m: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            rt = me()
            if rt is not None and rt.mode is not None and rt._calls == 1:
                rt._step_inputs([*(a for a in args if isinstance(a, torch.Tensor)),
                                 *(kwargs[k] for k in sorted(kwargs) if isinstance(kwargs[k], torch.Tensor))])

        self._root_hook = module.register_forward_pre_hook(hook, with_kwargs=True)

    def _step_inputs(self, tensors: list[torch.Tensor]) -> None:
        if self.recorder is not None:
            self.recorder.as_inputs(tensors)
        count = self.store.count_external
        if count is not None:
            # the batch is training state even where autograd saves none of it (an attention mask)
            for t in tensors:
                st = storage_of(t) if t.device == self.device else None
                if st is not None:
                    count(st)
        steady = self._steady
        if steady is not None and not steady.off:
            why = steady.program.bind_inputs(tensors)
            if why and steady.k == 0:
                self._restart_step(steady, tensors)  # no op has run: follow their program, or record one
            elif why:
                steady.leave(why)
        if self._program_rec is not None:
            self._program_rec.step_inputs(tensors)

    def _restart_step(self, steady: SteadyStep, tensors: list[torch.Tensor]) -> None:
        """The step's inputs differ from those of the program it started with (another sequence length or
        batch): follow the program recorded for their signature, or run this step under the dispatch mode and
        record one. Called at the step's first module call, before any of its ops."""
        steady.program.unbind()
        sig = signature_of((t.shape, t.dtype) for t in tensors)
        prog = self.programs.get(sig)
        if prog is None and (prog := self._scaled_program(sig)) is not None:
            self._follow(prog, scaled=True)
            return
        if prog is not None:
            steady = self._follow(prog)
            prog.bind_inputs(tensors)
            if 1 in prog.random_at and self._module is not None:  # the random ops after this very call
                why = prog.module_called(1, self._module, self._rng_now)
                if why:
                    steady.leave(why)
            return
        self._steady = None
        self._enter_mode()
        if self.programs.may_record(self.steps.steps):
            self._begin_recording()
        else:
            self._packfn = self._pack

    def _follow(self, prog: StepProgram, scaled: bool = False) -> SteadyStep:
        """Run the step that starts in the steady state, following ``prog``."""
        prog.start_step()
        self._steady = steady = SteadyStep(prog, self._steady_parts, scaled=scaled,
                                           swap=scaled and "swap" in self.policies)
        self._packfn = steady
        if self._soft:
            self._soften(True)
        return steady

    def _soften(self, on: bool) -> None:
        self._soft_on = on
        self.native.soften(on)

    def _offload(self, e: Any, policy: str) -> bool:
        """Evict a steady step's entry now by ``policy`` (SteadyParts.offload); the allocations it makes are
        refused, not let through (the policy stands another in, or keeps the tensor)."""
        if not self._soft_on:
            return self.residency.evict_early(e, policy)
        self._soften(False)
        try:
            return self.residency.evict_early(e, policy)
        finally:
            self._soften(True)

    def _enter_mode(self) -> None:
        """The dispatch mode runs the step from here: it retries a refused op itself (no soft cap)."""
        if self._soft_on:
            self._soften(False)
            self._recover()
        self.mode.__enter__()
        self.mode_on = True

    def _scaled_program(self, sig: Any) -> StepProgram | None:
        """A program recorded at larger sizes that a step of signature ``sig`` may follow (runtime.steady,
        ``_pack_scaled``): the first ``SCALED_FOLLOWS`` times that signature comes; the next time it is
        recorded (its own program rebuilds by recompute what a scaled step swaps)."""
        seen = self._scaled_seen.get(sig, 0)
        if seen >= SCALED_FOLLOWS:
            return None
        near = self.programs.covering(sig)
        if near is None or (near.recomputed and "swap" not in self.policies):
            return None  # what the recorded step recomputed could not be evicted at another size
        if len(self._scaled_seen) >= 4096:
            self._scaled_seen.clear()
        self._scaled_seen[sig] = seen + 1
        return near

    def _pack_plain(self, t: torch.Tensor, st: torch.UntypedStorage) -> Any:
        return self.store.pack_slot(t, st, self.produced.add(st), False)

    def _rng_now(self) -> Any:
        return rng_state(self.device)

    def _random_recorded(self, rec: Any, explicit: bool) -> None:
        """The recorder recorded a random op: note after which module call it was the first one."""
        first = not explicit and self._last_random_call != self._calls
        self._last_random_call = self._calls
        if self._program_rec is not None:
            self._program_rec.random_at(rec, self._calls if first else 0, self._module)

    def _pack_hook(self, t: torch.Tensor) -> Any:
        if capturing():  # CUDA graph capture: kept as it is (no eviction, pinned allocation, event or RNG read)
            return self.store.keep(t)
        return self._packfn(t)

    def _unpack_hook(self, h: Any) -> torch.Tensor:
        if capturing():  # kept during capture: no steady-state bookkeeping, no eviction for room
            return self.store.unpack(h)
        steady = self._steady
        if steady is not None:
            if not self.steps.in_backward:
                self.steps.backward_seen()  # no op is observed in the steady state: the first read says it
            if self.store.pending:
                # backward makes no saves: what the forward left pending, and entries rebuilt since, are
                # registered here, as the dispatch mode does before an op that nears the budget (mode._cap)
                self._steady_after()
            if type(h) is not Saved or not self._soft_on:
                steady.unpacked(h)
                t = self.store.unpack(h)
            else:  # a rebuild or prefetch allocates: refused, the runtime's own work retries after evicting
                self._soften(False)
                try:
                    steady.unpacked(h)
                    t = self.store.unpack(h)
                finally:
                    self._soften(True)
            self._steady_after()  # what this read rebuilt may be freed for the op reading it; room for that op
            return t
        if self._program_rec is not None and type(h) is Saved:
            self._gap()
            self._program_rec.read(h.entry)
        return self.store.unpack(h)

    def _working_budget(self, budget: int) -> None:
        """The budget the dispatch mode makes room under (a surveyed step raises it: runtime.survey)."""
        if self.mode is not None:
            self.mode.budget = budget

    def _prefetch_one(self, e: Any) -> bool:
        return bool(self.residency.prefetch_one(e))

    def _choose_step(self) -> None:
        """Before a step starts: steady state if a program is ready and the dispatch mode can be left
        (nothing entered above it), else the dispatch mode, recording a program."""
        prog, mode = self.programs.last, self.mode
        if mode is None:
            return
        follower = self.follower
        verifying = follower is not None and follower.state == "pending"
        if verifying:
            prog = None                 # step 1 verifies the plan under the dispatch mode
        if prog is not None and (not self.mode_on or _get_current_dispatch_mode() is mode):
            if self.mode_on:
                mode.__exit__(None, None, None)
                self.mode_on = False
                self._below = _get_current_dispatch_mode()  # a mode entered before enable(), if any
            self._follow(prog)
            self._program_rec = None
            return
        if not self.mode_on:
            self._enter_mode()
        self._steady = None
        # The first step is not recorded: the optimizer's state appears after it, so later steps hold more.
        # (With a plan, the first step verifies it: the step after, which follows it, is recorded.)
        if self.steps.steps >= 1 and not verifying and self.programs.may_record(self.steps.steps):
            self._program_rec = ProgramRecorder()
            self._packfn = self._pack_recording
        else:
            self._program_rec = None
            self._packfn = self._pack

    def _pack_recording(self, t: torch.Tensor) -> Any:
        self._gap()
        h = self._pack(t)
        rec = self._program_rec
        if rec is not None:
            rec.saved(t, h.entry if type(h) is Saved else None)
        return h

    def _gap(self) -> None:
        """In a recording step, at each save and read: the most the allocator's bytes rose between two of them
        (what a steady step, which sees only saves and reads, keeps free after each: ``headroom``)."""
        window = self._window
        if window is None or self.residency.survey is not None:  # the survey reads the same window
            return
        peak = window.window_peak
        if self._gap_base >= 0 and peak - self._gap_base > self._gap_most:
            self._gap_most = peak - self._gap_base
        window.window_reset()
        self._gap_base = self.meter.current_bytes

    def _bind(self, node: Any, st: torch.UntypedStorage) -> Any:
        slot = self.produced.add(st)
        slot.node, node.storage = node, slot
        return slot

    def _far(self) -> bool:
        """Whether the device is far from its budget (at least half of it free)."""
        return self.budget is None or self.budget - self.meter.current_bytes >= self.budget // 2

    def _steady_after(self) -> None:
        """After each save and read of a steady step: what the dispatch mode does before each op, per saved
        tensor. A step whose recording came near the budget registers each entry as it is made (the allocator
        frees it at allocation time); and the most new bytes an op of the recorded step needed stay free, by
        eviction where the allocator alone could not free them (an op's own allocations cannot be retried
        without the dispatch mode)."""
        budget = self.budget
        if budget is None or self.residency.survey is not None:  # a surveyed step only measures
            return
        steady = self._steady
        store = self.store
        free = budget - self.meter.current_bytes
        if free < 0 and self._soft_on:
            self._soften(False)
            self._recover()
            self._soften(True)
            free = budget - self.meter.current_bytes
        if store.pending and ((steady is not None and steady.program.pressure) or free < budget // REGISTER_BELOW):
            store.register_pending()
        room = steady.headroom if steady is not None else 0
        if free < room and not self.plan_recomputes:  # a followed plan's order is the allocator's (planned_first)
            soft = self._soft_on  # evicting may allocate (an encoding): the runtime's own work is never let through
            if soft:
                self._soften(False)
            self.residency.relieve(room - free)
            if soft:
                self._soften(True)

    def _recover(self) -> None:
        """A steady step is over its budget: the soft cap let an allocation through that the allocator alone
        could not make room for (or bytes were counted late: a batch). Evict with every policy, as the
        dispatch mode does around a refused op; where nothing more can go, the budget is too small for the
        step and the survey measures the one it needs (runtime.survey). A refusal retires the program: the
        next step of its shape is recorded again, under the dispatch mode, which makes room around each op.
        Called with the soft cap off: what it evicts may allocate."""
        count, nbytes, held = self.native.let_through()
        budget, residency, steady = self.budget, self.residency, self._steady
        assert budget is not None
        if count and steady is not None and residency.survey is None:
            self.stats.cap_overruns += count
            if residency.need(nbytes, held) > budget:  # the dispatch mode could not have made room either
                residency.exhausted(nbytes, "an allocation of a steady-state step", held)
                return
        over = self.meter.current_bytes - budget
        if over > 0:
            residency.relieve(over)
        if count and steady is not None and residency.survey is None and self._retired is None:
            self._retired = steady.program
            self.stats.note(f"steady state: at step {self.steps.steps + 1} an allocation of {fmt_bytes(nbytes)} "
                            f"went {fmt_bytes(max(held + nbytes - self.budget, 0))} past the budget (the allocator "
                            "alone could not free enough; the step evicted to recover): its input shape is "
                            "recorded again under the dispatch mode")

    def _diverged(self, why: str) -> None:
        steady = self._steady
        resume = self.programs.left(steady.program if steady is not None else None, self.steps.steps + 1)
        self.stats.note(f"steady state left at step {self.steps.steps + 1}: {why}; the dispatch mode runs "
                        f"again from the next step" + ("" if not resume else
                                                       f" (the steps keep changing: recording again at step "
                                                       f"{resume + 1})"))
        if self.follower is not None and self.follower.state == "following":
            self.stats.plan_note = (f"{_first_clause(self.stats.plan_note)}; steady state left at step "
                                    f"{self.steps.steps + 1} ({why}): the dispatch mode follows the plan again")

    def _finish_program(self, stages: int) -> None:
        """End of a recording step: keep its program if later steps may follow it."""
        rec, self._program_rec = self._program_rec, None
        self.residency.on_evicted = None
        why = self._steady_refusal(rec)
        prog = None
        if rec is not None and not why:
            prog = rec.finish(self._module_state())
            why = prog.cannot_rebuild(rec.evicted) or self._offload_refusal(prog)
        pressure = self._pressure()
        if prog is None or why:
            self.stats.note(f"steady state: not used ({why})")
            return
        prog.stages, prog.pressure = stages, pressure
        if self.mode is not None:
            prog.headroom = max(self.mode.most_new, self._gap_most) + self.residency.reserve
        for old in self.programs.add(prog):
            old.unbind()
        self.stats.programs = self.programs.recorded
        if len(self.programs) > 1:
            self.stats.note("steady state: one program per input shape (smaller inputs follow the program of "
                            "larger ones, swapping what it recomputed, until they are recorded; larger ones than "
                            "any before are recorded at once)")
        if prog.offload:
            by = {n: sum(1 for p in prog.offload.values() if p == n) for n in sorted(set(prog.offload.values()))}
            self.stats.note(f"steady state from step {self.steps.steps + 1}: "
                            + ", ".join(f"{c} saved tensor(s) evicted by {n}" for n, c in by.items())
                            + " as they are saved (the recorded step evicted them)"
                            + ("; swap-ins prefetched in the recorded read order" if "swap" in by
                               and self._steady_parts.prefetch is not None else ""))
        if self.recorder is not None:
            self.recorder.keep = self.programs.keep()
        follower = self.follower
        if follower is not None and follower.state == "following":
            # what the plan recomputes goes first when the allocator frees; the rest after it, so that real
            # bytes the plan did not count (kernel scratch) are still made room for
            self.plan_recomputes = set(follower.recomputed)
            self.store.registrable = planned_first(self._registrable, self.plan_recomputes)
            self.stats.plan_note = (f"{_first_clause(self.stats.plan_note)}; from step {self.steps.steps + 1} in "
                                    f"the steady state: the allocator frees the {len(follower.recomputed)} "
                                    "storages the plan recomputes first, at allocation time")

    def _steady_refusal(self, rec: ProgramRecorder | None) -> str:
        if rec is None or not rec.saves:
            return "the step saved nothing"
        if not self.steps.modules:
            return "steps start at module calls only"
        refused = self._refusals() - self._refused_before
        rescues = {n: c - self._rescues_before.get(n, 0) for n, c in self.residency.rescues.items()}
        # what swap or compress evicted to make room is evicted as it is saved in the steady state; what
        # recompute evicted (or nothing, where the retry fitted) only the dispatch mode would evict again
        if refused and (rescues.get("recompute", 0) or not any(rescues.values())):
            # the allocator alone (all a steady-state step has) could not free enough there: the dispatch
            # mode evicted the rest around the op it retried
            return f"the allocator alone ran out {refused} time(s) in the recorded step; the dispatch mode made room"
        return ""

    def _refusals(self) -> int:
        """Allocations refused in ops (or in regenerations) so far that the dispatch mode caught, made room for
        and retried; not those of the policies' own work at the cap (an encoding refused its buffer), which
        another policy stood in for."""
        return self.meter.oom_retries if self.native is not None else 0

    def _offload_refusal(self, prog: StepProgram) -> str:
        """Why the program cannot evict at pack what its recorded step compressed, or "". On CUDA compress
        may only use a codec that decides without reading the bytes on the host (a bool mask's bitmask):
        the others wait for the device. Those saves are swapped instead where swap is a policy."""
        if self.device.type != "cuda":
            return ""
        compress = self.policies.get("compress")
        for k, policy in list(prog.offload.items()):
            codec = prog.codecs.get(k, "")
            if policy != "compress" or compress is None or not compress.reads_bytes_to_decide(codec):
                continue
            if "swap" not in self.policies:
                return (f"the recorded step compressed a tensor with the {codec!r} codec, which decides from the "
                        "tensor's bytes (on CUDA a host wait for the device in each step); add swap to the "
                        "policies to have the steady state swap such tensors instead")
            prog.offload[k] = "swap"
        return ""

    def _pressure(self) -> bool:
        """Whether the step that is ending came near its budget (entries registered or evicted)."""
        return (self.store.registrations > self._registered_before
                or any(p.evicted > self._evicted_before.get(n, 0) for n, p in self.stats.policies.items()))

    def _module_state(self) -> set[int]:
        """Storage ids of the parameters and buffers of every module called so far."""
        out: set[int] = set()
        for r in self.fixed.modules():
            for t in (*r._parameters.values(), *r._buffers.values()):
                if t is not None:
                    out.add(id(t.untyped_storage()))
        return out

    def _step_started(self) -> None:
        self._calls, self._last_random_call, self._module = 0, -1, None
        self.store.epoch += 1
        self.stats.step_started()
        self.estimator.new_step()
        self.residency.forget_offers()
        if self.follower is not None:
            self.follower.step_started()
        if self._program_rec is not None:
            self._count_from_here(self._program_rec)
        else:
            self.residency.on_evicted = None

    def _begin_recording(self) -> None:
        """Record this step's program (the step has started; none of its ops has run)."""
        self._program_rec = ProgramRecorder()
        self._packfn = self._pack_recording
        self._count_from_here(self._program_rec)

    def _count_from_here(self, rec: ProgramRecorder) -> None:
        """What the recorded step evicts, registers and is refused is counted from here."""
        self._evicted_before = {n: p.evicted for n, p in self.stats.policies.items()}
        self._registered_before = self.store.registrations
        self._refused_before = self._refusals()
        self._rescues_before = dict(self.residency.rescues)
        self.residency.on_evicted = rec.evicted_entry
        if self.mode is not None:
            self.mode.most_new = 0
        self._gap_base, self._gap_most = -1, 0

    def _step_ended(self, stages: int) -> None:
        self._module = None
        if self._soft_on:
            self._soften(False)
            self._recover()  # a refusal in the step's last ops, after its last read
        survey = self.residency.survey
        if survey is not None:
            survey.steps_ended += 1  # a step over the budget, measured: raised from backward() below
        steady = self._steady
        if steady is not None:
            self._steady = None
            self._packfn = self._pack
            stages = steady.program.stages
            self.stats.steady_steps += 1
            if self._retired is not None:
                self._retired, retired = None, self._retired
                self.programs.drop(retired)
                retired.unbind()
            elif steady.complete:
                self.programs.followed()
            elif not steady.off:
                self._steady = steady  # _diverged reads the program the step left
                self._diverged(f"the step saved {steady.k} tensors where the recorded step saved "
                               f"{len(steady.saves)}")
                self._steady = None
        elif self._program_rec is not None:
            self._finish_program(stages)
        self.store.drain()
        for hook in self._policy_step_ends:
            hook()
        self.stats.step_done(stages)
        self.fsdp_sync.refresh()
        if self.recorder is not None:
            self.recorder.end_step()
        if self.prefetcher is not None:
            self.prefetcher.step_ended()
        if self.follower is not None and steady is None:  # a steady step ran no op the follower sees
            self.follower.step_ended(stages)
        if self.buckets is not None:
            self.buckets.step_ended()
        if survey is not None:  # the step ran on uncapped to measure what it needs (runtime.survey)
            with self.residency.mode.quiet():  # sizing an optimizer's state runs ops on meta copies
                to_come = self._state_to_come()
            if to_come and survey.steps_ended == 1:
                # the optimizers' first step is to come, and every later step holds their state: measure the
                # next step too, evicting from its start as a run at what this one needed with that state would
                survey.carry(to_come)
                self.residency.evict_as_needed()
                return
            if steady is not None and survey.steps_ended == 1:
                # a steady step runs no op the survey can measure (only replays): the next step runs under the
                # dispatch mode, still uncapped, and measures every op before the budget is named
                survey.note(self.meter.peak_bytes, "the peak of a steady-state step (held uncapped)", True)
                survey.carry(0)
                for prog in self.programs.clear():
                    prog.unbind()
                self.residency.evict_as_needed()
                return
            raise self.residency.end_survey()

    def _state_to_come(self) -> int:
        """Bytes of state on this device that the optimizers stepping the model will hold and hold none of yet
        (their first step makes it), sized without stepping them."""
        total = 0
        for opt in self.fixed.optimizers():
            if any(opt.state.get(p) for g in opt.param_groups for p in g["params"]):
                continue
            try:
                states, _ = optimizer_state(opt)
            except (CaptureError, RuntimeError, TypeError):  # an optimizer that cannot be sized without a step
                continue
            total += sum(t.nbytes for t in states if t.on_device and t.param.device == self.device)
        return total

    # ---- stats ---------------------------------------------------------------------------------
    def snapshot(self) -> Stats:
        self.store.drain()
        src: Any = self.allocator if self.allocator is not None else self.meter
        return self.stats.snapshot(device=str(self.device), budget=self.budget, peak=src.peak_bytes,
                                   current=src.current_bytes)

    def reset_stats(self) -> None:
        (self.allocator if self.allocator is not None else self.meter).reset_peak()
        self.stats.reset()


def _no_cap(lifted: bool) -> None:
    """Lifting the cap where only the dispatch mode enforces it (no native device): nothing to do."""


def _first_clause(note: str) -> str:
    """A plan note without what the steady state added to it (``; ...``)."""
    return note.split("; ", 1)[0]
