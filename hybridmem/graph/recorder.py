"""The recorder behind :func:`~hybridmem.graph.capture.capture`: a dispatch mode that turns each aten op
of one training step into a :class:`Stage` and each storage into a :class:`TensorInfo` (the rules are in
capture's docstring)."""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .flops import op_flops
from .ir import Stage, TensorInfo
from .ops import op_info, uses_rng, written_tensors
from .outputs import output_tensors

Tensor = torch.Tensor


@dataclass
class Fixed:
    kind: str
    name: str


class Recorder:
    """Mutable capture state: tensors by storage, stages, module stack, node -> module map."""

    def __init__(self, fixed: dict[int, Fixed], measure: bool, sync: Callable[[], None] | None,
                 to_meta: bool, target_cuda: bool, param_module: dict[int, str]):
        self.fixed = fixed                      # id(storage) -> kind/name of pre-existing storages
        self.param_module = param_module        # id(param tensor) -> module path (AccumulateGrad)
        self.tensors: list[TensorInfo] = []
        self.refs: list[weakref.ref | None] = []  # keep weakrefs alive (their callbacks set freed_after)
        self.sid: dict[int, int] = {}           # id(live storage) -> tensor index
        self.stages: list[Stage] = []
        self.measured: list[float] = []
        self.mutations: list[list[int]] = []
        self.counts: dict[tuple[str, str, str], int] = {}
        self.phase = "forward"
        self.stack: list[str] = [""]
        self.seq_module: dict[int, str] = {}
        self.last_seq = torch.autograd._get_sequence_nr()
        self.closed = False
        self.measure, self.sync = measure, sync
        self.to_meta = to_meta
        self.meta_copies: dict[int, Tensor] = {}  # id(non-meta storage) -> its meta stand-in (meta capture)
        self.target_cuda = target_cuda and not torch.are_deterministic_algorithms_enabled()
        self.last_op = ""
        self.native: Any = None     # the native allocator device (CPU capture): per-op scratch
        self.error = 0              # id() of the last exception seen leaving a module
        self.error_module = ""
        self.paused = False         # ops run unrecorded (the optimizer's unrecorded first step)
        self.saves = 0              # pack-hook calls: each is a pack and an unpack of the runtime's hooks

    # -- tensors ---------------------------------------------------------------------------------
    def tid(self, t: Tensor, producer: int) -> tuple[int, bool]:
        """Tensor index of ``t``'s storage, registering it if new; returns (index, is_new)."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return -1, False
        k = id(st)
        i = self.sid.get(k)
        if i is not None:
            return i, False
        i = len(self.tensors)
        if producer < 0:
            f = self.fixed.get(k)
            kind, name = (f.kind, f.name) if f is not None else ("state", "")
        else:
            kind, name = ("grad" if self.phase == "backward" else "activation"), ""
        self.tensors.append(TensorInfo(id=i, nbytes=st.nbytes(), dtype=str(t.dtype).removeprefix("torch."),
                                       shape=tuple(t.shape), kind=kind, producer=producer, name=name))
        self.sid[k] = i
        self.refs.append(weakref.ref(st, lambda r, k=k, i=i: self._freed(k, i)))
        return i, True

    def _freed(self, k: int, i: int) -> None:
        if self.sid.get(k) == i:
            del self.sid[k]
        if self.closed:
            return  # freed after the step ended: it outlived the step
        t = self.tensors[i]
        t.freed_after = max(len(self.stages) - 1, t.producer, 0)

    def saved(self, t: Tensor) -> Tensor:
        """Pack hook: mark the storage saved; return a detached alias (no reference to the grad_fn, so
        a saved output does not form a cycle with its own node and is freed as without the hook)."""
        i, _ = self.tid(t, -1)
        if i >= 0:
            self.tensors[i].saved = True
        self.saves += 1
        return t.detach()

    # -- modules ---------------------------------------------------------------------------------
    def module_of_backward(self) -> str:
        node = torch._C._current_autograd_node()
        if node is None:
            return ""
        m = self.seq_module.get(node._sequence_nr())
        if m is not None:
            return m
        var = getattr(node, "variable", None)  # AccumulateGrad: the parameter it accumulates into
        if var is not None:
            return self.param_module.get(id(var), "")
        return ""

    def note_nodes(self) -> None:
        """Attribute autograd nodes created since the last op to the module running now."""
        cur = torch.autograd._get_sequence_nr()
        if cur != self.last_seq:
            m = self.stack[-1]
            for s in range(self.last_seq, cur):
                self.seq_module[s] = m
            self.last_seq = cur

    # -- ops -------------------------------------------------------------------------------------
    def meta_args(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Meta capture: replace stray non-meta tensors (loss targets, constants) by meta stand-ins."""
        def conv(a: Any) -> Any:
            if isinstance(a, Tensor) and a.device.type != "meta":
                st = a.untyped_storage()
                m = self.meta_copies.get(id(st))
                if m is None:
                    m = torch.empty_like(a, device="meta")
                    self.meta_copies[id(st)] = m  # keeps the stand-in alive: one tensor per storage
                    f = self.fixed.get(id(st))
                    self.fixed[id(m.untyped_storage())] = f or Fixed("input", "")
                return m
            if isinstance(a, (list, tuple)) and any(isinstance(b, Tensor) for b in a):
                return type(a)(conv(b) for b in a)
            return a
        return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        info = op_info(func)
        self.last_op = info.name
        if self.phase == "forward":
            self.note_nodes()
        if not info.stage:
            out = func(*args, **kwargs)
            for t in arg_tensors(args, kwargs):
                self.tid(t, -1)
            for t in output_tensors(out):  # a view allocates nothing; anything new goes to the last stage
                i, new = self.tid(t, len(self.stages) - 1)
                if new and self.stages:
                    self.stages[-1].outputs.append(i)
            return out

        index = len(self.stages)
        inputs: dict[int, None] = {}
        in_bytes: dict[int, int] = {}
        for t in arg_tensors(args, kwargs):
            i, _ = self.tid(t, -1)
            if i >= 0:
                inputs[i] = None
                in_bytes[i] = max(in_bytes.get(i, 0), min(self.tensors[i].nbytes, tensor_bytes(t)))
        native = self.native
        if native is not None:
            held = native.current_bytes
            native.window_reset()
        if self.measure:
            if self.sync:
                self.sync()
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            if self.sync:
                self.sync()
            dt = time.perf_counter() - t0
        else:
            out = func(*args, **kwargs)
            dt = 0.0
        outputs: list[int] = []
        out_bytes = 0
        for t in output_tensors(out):
            i, new = self.tid(t, index)
            if new:
                outputs.append(i)
                out_bytes += self.tensors[i].nbytes
        # scratch: what the allocator held at its peak inside the op beyond what was live and the outputs
        workspace = max(0, native.window_peak - held - out_bytes) if native is not None else 0
        written = []
        for w in written_tensors(func, args, kwargs):
            st = w.untyped_storage()
            j = self.sid.get(id(st))
            if j is not None:
                written.append(j)
                if info.may_resize and st.nbytes() > self.tensors[j].nbytes:
                    self.tensors[j].nbytes = st.nbytes()  # resized in place: a tensor has one size, its largest
        side_effect = any(self.tensors[j].producer < 0 for j in written)
        for j in written:
            self.mutations.append([index, j])
            out_bytes += in_bytes.get(j, 0)  # an in-place op writes what it reads
        # in backward a module forward runs only when something recomputes it (checkpointing)
        module = self.stack[-1] if self.phase == "forward" or len(self.stack) > 1 else self.module_of_backward()
        key = (self.phase, module, info.name)
        k = self.counts.get(key, 0)
        self.counts[key] = k + 1
        self.stages.append(Stage(
            index=index, id=f"{self.phase}/{module}/{info.name}#{k}", op=info.name, module=module,
            phase=self.phase, flops=op_flops(func, args, kwargs, out), bytes_accessed=sum(in_bytes.values()) + out_bytes,
            inputs=list(inputs), outputs=outputs, rng=uses_rng(func, args, kwargs), side_effect=side_effect,
            deterministic=not (info.cuda_nondeterministic and self.target_cuda),
            # storages that existed before the op and that it wrote: a recompute of one replays this op too
            writes=[j for j in dict.fromkeys(written) if j in inputs and j not in outputs], workspace=workspace))
        self.measured.append(dt)
        return out


class CaptureMode(TorchDispatchMode):
    def __init__(self, rec: Recorder):
        super().__init__()
        self.rec = rec

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # eager only: skip the per-op torch._disable_dynamo wrapper (see MeterMode)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.rec.paused:
            return func(*args, **kwargs)
        if self.rec.to_meta:
            args, kwargs = self.rec.meta_args(args, kwargs)
        return self.rec.run(func, args, kwargs)


def arg_tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    out: list[Tensor] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(b for b in a if isinstance(b, Tensor))
    return out


def tensor_bytes(t: Tensor) -> int:
    return t.numel() * t.element_size()
