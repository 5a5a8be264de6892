import copy
import re
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from hybridmem.graph.ops import is_stage_op, op_info
from hybridmem.graph.capture import CaptureError, capture, run_step
from hybridmem.graph.merge import merge_stages, module_groups
from hybridmem.graph.ir import Graph
from hybridmem.runtime.meter import Meter, profiler_peak

aten = torch.ops.aten


pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in the root conftest.py


# ---- small models ----------------------------------------------------------------------------------
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(inplace=True), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True),
                                  nn.Dropout(0.25))
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


class DictModel(nn.Module):
    """Keyword inputs, dict output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, scale=None):
        h = torch.tanh(self.a(x)) * scale
        return {"logits": self.b(h), "hidden": h}


class Attention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.proj, self.heads = nn.Linear(d, 3 * d), nn.Linear(d, d), heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TiedLM(nn.Module):
    def __init__(self, vocab=40, d=12):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.relu(self.mix(self.emb(ids))))


def lm_loss(logits):
    return logits.logsumexp(-1).mean()


CASES = {
    "mlp": (mlp, lambda: torch.randn(8, 16), None),
    "convbn": (ConvBN, lambda: torch.randn(4, 3, 12, 12), None),
    "dict": (DictModel, lambda: {"x": torch.randn(5, 8), "scale": torch.full((8,), 0.5)},
             lambda out: out["logits"].pow(2).mean()),
    "attention": (Attention, lambda: torch.randn(2, 6, 16), None),
    "tied": (TiedLM, lambda: (torch.randint(0, 40, (3, 7)),), lm_loss),
}


def meter_peak(model, inputs, loss_fn) -> int:
    """The CPU allocator's real peak of one step, read independently of hybridmem: the distinct storages
    alive at the start (parameters, gradients, buffers, inputs) + torch.profiler's peak during the step."""
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None),
               *_input_tensors(inputs)]
    state = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    peak = profiler_peak(run_step, model, inputs, loss_fn)
    for p in model.parameters():
        p.grad = None
    return state + peak


def _input_tensors(inputs) -> list:
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    values = inputs.values() if isinstance(inputs, dict) else inputs
    return [t for t in values if isinstance(t, torch.Tensor)]


def snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            [None if p.grad is None else (p.grad, p.grad.clone()) for p in model.parameters()])


def assert_unchanged(model, snap):
    state, grads = snap
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), f"{k} changed by capture"
    for p, g in zip(model.parameters(), grads):
        if g is None:
            assert p.grad is None
        else:
            assert p.grad is g[0] and torch.equal(p.grad, g[1])


# ---- graphs of small models ------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_graph_validates_round_trips_and_matches_meter(name, tmp_path):
    make_model, make_inputs, loss_fn = CASES[name]
    model, inputs = make_model(), make_inputs()
    snap = snapshot(model)
    g = capture(model, inputs, loss_fn)
    assert_unchanged(model, snap)
    g.validate()
    for suffix in (".yaml", ".json"):
        h = Graph.load(g.save(tmp_path / f"g{suffix}"))
        assert h.content_hash() == g.content_hash() and h.structure_hash() == g.structure_hash()
    # keep-all peak of the graph == simulated-device peak of the same step (exact on the CPU)
    assert g.peak_bytes() == meter_peak(model, inputs, loss_fn)
    # forward stages first, then backward; ids unique; every stage is an op the runtime counts
    phases = [s.phase for s in g.stages]
    assert phases == sorted(phases, key=["forward", "backward"].index) and "backward" in phases
    assert len({s.id for s in g.stages}) == g.num_stages
    assert g.meta["num_ops"] == g.num_stages and g.meta["device"] == "cpu"
    assert g.meta["model"] == type(model).__name__ and g.meta["torch"] == torch.__version__
    # fixed tensors: every parameter (tied ones once), never freed
    params = [t for t in g.tensors if t.kind == "param"]
    assert len(params) == len(list(model.parameters()))
    assert all(t.producer == -1 and t.freed_after is None for t in params)
    # measured costs on the CPU
    assert g.meta["cost_model"] == "measured"
    assert [s.cost_s for s in g.stages] == g.meta["measured_cost_s"]


def test_mlp_stages_tensors_and_modules():
    model, x = mlp(), torch.randn(8, 16, requires_grad=True)
    g = capture(model, x)
    assert x.grad is None  # an input that requires grad gets no .grad from capture
    fwd = [s for s in g.stages if s.phase == "forward"]
    assert [(s.module, s.op) for s in fwd] == [("0", "addmm"), ("1", "relu"), ("2", "addmm"), ("3", "relu"),
                                              ("4", "addmm"), ("", "sum")]
    assert fwd[0].id == "forward/0/addmm#0" and fwd[0].flops == 2 * 8 * 16 * 32
    # backward ops are attributed to the module whose forward created their autograd node
    bwd = {s.module for s in g.stages if s.phase == "backward"}
    assert {"0", "1", "2", "3", "4"} <= bwd
    names = {t.name: t for t in g.tensors if t.producer < 0}
    assert names["input[0]"].kind == "input" and names["0.weight"].kind == "param"
    # ReLU outputs are saved for backward and freed by it; the loss lives until the end of backward
    relu_out = g.tensors[g.stages[1].outputs[0]]
    assert relu_out.saved and relu_out.kind == "activation" and relu_out.freed_after > g.num_forward
    grads = [t for t in g.tensors if t.kind == "grad" and t.freed_after is None]
    assert sum(t.nbytes for t in grads) == sum(p.numel() * 4 for p in model.parameters()) + x.numel() * 4
    assert all(s.bytes_accessed > 0 for s in g.stages)


def test_convbn_flags_inplace_and_no_side_effects():
    model, x = ConvBN().train(), torch.randn(4, 3, 12, 12)
    model.head.weight.grad = torch.ones_like(model.head.weight)  # pre-existing grad: must survive
    snap = snapshot(model)
    rng = torch.get_rng_state()
    g = capture(model, x)
    assert_unchanged(model, snap)
    assert model.body[1].num_batches_tracked.item() == 0
    assert torch.equal(torch.get_rng_state(), rng)
    by_op = {s.op: s for s in g.stages}
    # BatchNorm in training updates running stats: a side effect (and so does num_batches_tracked += 1)
    bn = next(s for s in g.stages if "batch_norm" in s.op and s.phase == "forward")
    assert bn.side_effect and bn.module == "body.1"
    assert by_op["add_.Tensor"].side_effect
    # dropout draws random numbers
    assert by_op["bernoulli_.float"].rng and sum(s.rng for s in g.stages) == 1
    # ReLU(inplace=True): a stage that writes its input and produces no new storage
    relu_ = [s for s in g.stages if s.op == "relu_"]
    assert len(relu_) == 2 and all(s.outputs == [] and len(s.inputs) == 1 for s in relu_)
    assert [g.stages[i].op for i, _ in g.meta["mutations"]].count("relu_") == 2
    # conv backward sits in the conv modules; CPU ops are all deterministic
    assert {s.module for s in g.stages if s.op == "convolution_backward"} == {"body.0", "body.3"}
    assert all(s.deterministic for s in g.stages)
    kinds = {t.name: t.kind for t in g.tensors if t.producer < 0}
    assert kinds["body.1.running_mean"] == "buffer" and kinds["body.0.weight"] == "param"
    assert g.peak_bytes() == meter_peak(model, x, None)


def test_meta_capture_matches_cpu_and_leaves_the_model_alone():
    model, x = mlp(), torch.randn(8, 16)
    snap = snapshot(model)
    g_cpu = capture(model, x)
    g_meta = capture(model, x, device="meta")
    assert_unchanged(model, snap)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert g_meta.meta["device"] == "meta" and "measured_cost_s" not in g_meta.meta
    assert [s.id for s in g_meta.stages] == [s.id for s in g_cpu.stages]
    assert g_meta.structure_hash() == g_cpu.structure_hash()
    assert g_meta.peak_bytes() == g_cpu.peak_bytes()
    costs = pytest.importorskip("hybridmem.graph.costs")
    device = costs.get_cost_model(costs.DEFAULT_DEVICE)
    assert g_meta.meta["cost_model"] == device.name  # an analytic device model on meta
    assert [s.cost_s for s in g_meta.stages] == pytest.approx(list(device.op_times(g_meta)))
    with pytest.raises(ValueError, match="measured"):
        capture(model, x, device="meta", cost_model="measured")
    # a model already on meta is captured in place; CPU-held loss targets are moved to meta
    with torch.device("meta"):
        m2 = mlp()
    target = torch.randint(0, 4, (8,))
    g2 = capture(m2, x, loss_fn=lambda out: F.cross_entropy(out, target), device="meta")
    assert g2.num_stages > g_meta.num_stages and all(p.grad is None for p in m2.parameters())
    # on meta the graph targets CUDA: ops non-deterministic there are flagged
    emb = nn.Embedding(10, 4)
    g3 = capture(emb, torch.tensor([[1, 2, 2]]), device="meta")
    assert not next(s for s in g3.stages if s.op == "embedding_dense_backward").deterministic


def test_checkpointed_model_matches_meter():
    # torch.utils.checkpoint stops its recomputation by raising through the module hooks: capture must
    # not keep that exception (its traceback holds recomputed tensors) and must match the meter.
    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
            self.b = nn.Linear(8, 2)

        def forward(self, x):
            return self.b(torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=False))

    model, x = Checkpointed(), torch.randn(4, 8)
    g = capture(model, x)
    # the real peak also holds the RNG state checkpoint copies when it starts and when it recomputes:
    # tensors made outside any aten op, which no op-level capture sees
    rng = torch.get_rng_state().numel()
    assert 0 <= meter_peak(model, x, None) - g.peak_bytes() <= 2 * rng
    recomputed = [s for s in g.stages if s.phase == "backward" and s.op in ("addmm", "relu")]
    assert [s.module for s in recomputed] == ["a.0", "a.1"]


def test_cost_model_object_is_used():
    class Flat:
        name = "flat"

        def op_time(self, stage):
            return 1e-3 * stage.ops

    g = capture(mlp(), torch.randn(8, 16), cost_model=Flat())
    assert g.meta["cost_model"] == "flat" and all(s.cost_s == 1e-3 for s in g.stages)
    assert len(g.meta["measured_cost_s"]) == g.num_stages  # still measured on a real run
    costs = pytest.importorskip("hybridmem.graph.costs")
    g = capture(mlp(), torch.randn(8, 16), cost_model="h100")
    assert g.meta["cost_model"] == costs.get_cost_model("h100").name and g.compute_time() > 0
    with pytest.raises(ValueError, match="unknown device model"):
        capture(mlp(), torch.randn(8, 16), cost_model="no-such-gpu")


def test_attention_flops_and_saved():
    g = capture(Attention(), torch.randn(2, 6, 16))
    attn = next(s for s in g.stages if "attention" in s.op and s.phase == "forward")
    assert attn.flops == 4 * 2 * 2 * 6 * 6 * 8  # two batched matmuls of (b*h) x 6 x 8 x 6
    assert g.saved_bytes() > 0


# ---- merging -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_module_granularity_preserves_peak_and_cost(name):
    make_model, make_inputs, loss_fn = CASES[name]
    g = capture(make_model(), make_inputs(), loss_fn)
    m = merge_stages(g, module_groups(g))
    m.validate()
    assert m.num_stages < g.num_stages
    assert m.peak_bytes() == g.peak_bytes()
    assert m.compute_time() == pytest.approx(g.compute_time(), rel=1e-12)
    assert sum(s.ops for s in m.stages) == g.num_stages
    assert sum(s.flops for s in m.stages) == sum(s.flops for s in g.stages)
    assert len({s.id for s in m.stages}) == m.num_stages
    assert sum(m.meta["measured_cost_s"]) == pytest.approx(sum(g.meta["measured_cost_s"]))
    # a merged stage's memory is the maximum of its members' memory, unless the tensors crossing its
    # boundary alone need more (an input its first op frees + an output of its last op: an atomic
    # stage holds both); then it has no workspace
    before, after = g.memory_profile(), m.memory_profile()
    for gi, grp in enumerate(module_groups(g)):
        most = before[grp[0]:grp[-1] + 1].max()
        assert after[gi] == most or (after[gi] > most and m.stages[gi].workspace == 0)


def test_capture_module_granularity_and_whole_graph_merge():
    model, x = ConvBN(), torch.randn(2, 3, 8, 8)
    gm = capture(model, x, granularity="module")
    assert gm.meta["granularity"] == "module" and gm.meta["merged_from_stages"] > gm.num_stages
    bn = next(s for s in gm.stages if s.module == "body.1" and s.phase == "forward")
    assert bn.side_effect and "+" in bn.op and bn.ops >= 2
    g = capture(model, x)
    one = merge_stages(g, [list(range(g.num_forward)), list(range(g.num_forward, g.num_stages))])
    assert one.num_stages == 2 and one.peak_bytes() == g.peak_bytes()
    assert one.stages[0].rng and not one.stages[1].rng
    with pytest.raises(ValueError, match="cover"):
        merge_stages(g, [[0, 1], [3]])
    with pytest.raises(ValueError, match="mixes phases"):
        merge_stages(g, [list(range(g.num_stages))])


def test_in_place_writes_are_recorded_and_replayed():
    model, x = ConvBN().train(), torch.randn(2, 3, 8, 8)
    g = capture(model, x)
    assert g.meta["writes_recorded"] is True and g.writes_recorded
    bn = next(s for s in g.stages if s.op == "native_batch_norm" and s.phase == "forward")
    relu = next(s for s in g.stages if s.op == "relu_")
    y = bn.outputs[0]                                   # BN's output storage, which relu_ overwrites
    assert relu.writes == [y] and relu.inputs == [y] and relu.outputs == []
    # BN writes its running statistics (buffers) in place too
    assert {g.tensors[j].name for j in bn.writes} == {"body.1.running_mean", "body.1.running_var"}
    assert g.tensors[y].saved  # ReLU's backward reads its output: the storage after relu_ wrote it
    # a recompute of it replays BN and then relu_ (and only BN when issued before relu_ runs)
    assert g.replay_stages(y) == [bn.index, relu.index] and g.replay_stages(y, before=relu.index) == [bn.index]
    assert not any(s.writes for s in g.stages if s.op in ("convolution", "mean.dim", "addmm"))
    # merging keeps a write into a tensor made in another group, drops one made inside its own group
    gm = capture(model, x, granularity="module")
    mrelu = next(s for s in gm.stages if s.module == "body.2" and s.phase == "forward")
    mbn = next(s for s in gm.stages if s.module == "body.1" and s.phase == "forward")
    assert mrelu.writes == mrelu.inputs and gm.tensors[mrelu.writes[0]].producer == mbn.index
    assert gm.replay_stages(mrelu.writes[0]) == [mbn.index, mrelu.index]
    whole = merge_stages(g, [list(range(g.num_forward)), list(range(g.num_forward, g.num_stages))])
    assert all(whole.tensors[j].producer < 0 for j in whole.stages[0].writes)  # only the BN buffers are left


class _VersionWrites(TorchDispatchMode):
    """Ground truth independent of the op schemas: which stage wrote which storage, from version counters.

    Autograd bumps a tensor's version after the kernel returns, above this mode; so a storage whose version
    grew since it was last seen was written by the last stage that took it as an argument."""

    def __init__(self):
        super().__init__()
        self.k, self.prod, self.seen, self.last, self.keep, self.pairs = 0, {}, {}, {}, [], set()

    def check(self, t):
        st, v = id(t.untyped_storage()), t._version
        if st in self.seen and v > self.seen[st] and st in self.prod and st in self.last:
            self.pairs.add((self.last[st][0], *self.prod[st]))  # (writer, producer stage, output position)
        self.seen[st] = max(v, self.seen.get(st, v))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ts = [b for a in (*args, *kwargs.values()) for b in (a if isinstance(a, (list, tuple)) else (a,))
              if isinstance(b, torch.Tensor)]
        for t in ts:
            self.check(t)
        out = func(*args, **kwargs)
        if is_stage_op(func):
            for t in ts:
                self.last[id(t.untyped_storage())] = (self.k, t)
            n_new = 0
            for o in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(o, torch.Tensor) and id(o.untyped_storage()) not in self.seen:
                    st = o.untyped_storage()
                    self.prod[id(st)] = (self.k, n_new)  # (producer stage, position among its new storages)
                    self.seen[id(st)] = o._version
                    self.keep.append(st)  # keep ids unique
                    n_new += 1
            self.k += 1
        return out

    def finish(self):
        for _, t in list(self.last.values()):
            self.check(t)


def test_zoo_resnet50_in_place_writers_match_version_counters():
    e = zoo.build("resnet50", "tiny")
    g = capture(e.model, e.inputs, e.loss_fn)
    truth = _VersionWrites()
    with truth:
        run_step(e.model, e.inputs, e.loss_fn)
    truth.finish()
    assert truth.k == g.num_stages
    nf = g.num_forward
    want = {x for x in truth.pairs if x[0] < nf}
    got = {(s.index, g.tensors[j].producer, g.stages[g.tensors[j].producer].outputs.index(j))
           for s in g.stages[:nf] for j in s.writes if g.tensors[j].producer >= 0}
    assert got == want and len(want) == 49 + 16  # a relu_ after every BN (49), an add_ per bottleneck (16)
    # so every saved tensor written in place has its writers, and a recompute of it replays them in order
    writers = g.writers()
    n_written = 0
    for t in g.tensors:
        if t.saved and t.evictable:
            pos = g.stages[t.producer].outputs.index(t.id)
            truth_w = sorted(w for w, p, k in want if (p, k) == (t.producer, pos))
            replay = g.replay_stages(t.id, writers=writers)
            # the producer and its in-place writers, after the stages that rebuild sources gone by then
            assert replay[-1 - len(truth_w):] == [t.producer, *truth_w], t
            assert all(r < t.producer for r in replay[:-1 - len(truth_w)]), (t, replay)
            n_written += bool(truth_w)
    assert n_written == 49  # the BN outputs relu_ overwrote (add_ writes a BN output that relu_ then writes)


# ---- errors ----------------------------------------------------------------------------------------------
def test_errors_are_clear():
    with pytest.raises(ValueError, match="'op', 'module'"):
        capture(mlp(), torch.randn(2, 16), granularity="layer")
    with pytest.raises(TypeError, match="inputs must be a tensor"):
        capture(mlp(), 3.0)
    with pytest.raises(ValueError, match=r"shape \(2, 4\)"):
        capture(mlp(), torch.randn(2, 16), loss_fn=lambda out: out * 2)
    with pytest.raises(TypeError, match="loss_fn"):
        capture(DictModel(), {"x": torch.randn(2, 8), "scale": torch.ones(8)})

    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(3, 3))

        def forward(self, x):
            return self.inner(x)

    model = Broken()
    with pytest.raises(CaptureError, match=r"module 'inner.1'.*mat1 and mat2") as e:
        capture(model, torch.randn(2, 4))
    assert isinstance(e.value.__cause__, RuntimeError)
    assert all(p.grad is None for p in model.parameters())
    assert not model.inner[0]._forward_hooks and not model.inner[0]._forward_pre_hooks  # hooks removed


def test_is_stage_op():
    for f in (aten.view.default, aten.t.default, aten.transpose.int, aten.expand.default, aten.as_strided.default,
              aten.detach.default, aten.alias.default, aten._unsafe_view.default, aten.split.Tensor,
              aten.sym_size.int, aten._local_scalar_dense.default, aten.t_.default):
        assert not is_stage_op(f), f
    for f in (aten.relu_.default, aten.add.Tensor, aten.mm.default, aten.clone.default, aten._to_copy.default,
              aten._foreach_add_.List, aten.copy_.default, aten.native_batch_norm.default):
        assert is_stage_op(f), f
    assert op_info(aten.bernoulli_.float).rng and not op_info(aten.add.Tensor).rng
    assert op_info(aten.add.Tensor).name == "add.Tensor" and op_info(aten.mm.default).name == "mm"


# ---- optimizer state ---------------------------------------------------------------------------------------
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9, centered=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),   # creates its state in the constructor
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),  # cannot step on meta
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2),         # calls .item(): sized on a CPU copy
}


def real_state(model, inputs, loss_fn, make_opt):
    """Bytes of the state a real step creates (a copy of the model): what the graph must hold."""
    m = copy.deepcopy(model)
    opt = make_opt(m.parameters())
    run_step(m, inputs, loss_fn)
    opt.step()
    storages = {id(v.untyped_storage()): v.untyped_storage().nbytes()
                for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)}
    return sum(storages.values())


def optimizer_snapshot(opt):
    return ([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            {id(p): dict(st) for p, st in opt.state.items()})


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_state_sizes_match_a_real_step(name):
    """The graph holds exactly the state a real step creates, as fixed tensors of kind "optimizer"; the
    user's optimizer and model are not changed; the structure hash changes when there is state."""
    model, x = ConvBN(), torch.randn(4, 3, 12, 12)
    opt = OPTIMIZERS[name](model.parameters())
    snap, osnap = snapshot(model), optimizer_snapshot(opt)
    g0 = capture(model, x, optimizer=None)  # without its state (the default finds the optimizer)
    g = capture(model, x, optimizer=opt)
    assert_unchanged(model, snap)
    assert optimizer_snapshot(opt) == osnap  # no step taken, no state created or dropped
    want = real_state(model, x, None, OPTIMIZERS[name])
    info = g.meta["optimizer"]
    assert info["class"] == type(opt).__name__ and info["state_bytes"] == want
    assert info["source"] == {"adagrad": "existing", "asgd": "cpu-copy", "adam-fused": "meta-unfused"}.get(name, "meta")
    state = [t for t in g.tensors if t.kind == "optimizer"]
    assert sum(t.nbytes for t in state) == want and len(state) == info["tensors"]
    assert all(t.producer == -1 and t.freed_after is None and not t.evictable and not t.consumers for t in state)
    assert g.tensors[:len(g0.tensors)] == g0.tensors  # appended: the step's tensor ids do not move
    assert g.peak_bytes() == g0.peak_bytes() + want and g.fixed_bytes() == g0.fixed_bytes() + want
    assert (g.structure_hash() != g0.structure_hash()) == (want > 0)
    if name == "sgd-momentum":
        assert want == sum(p.numel() * 4 for p in model.parameters())
        assert {t.name for t in state} == {f"optimizer.{n}.momentum_buffer" for n, _ in model.named_parameters()}
        assert capture(model, x, optimizer=opt, granularity="module").peak_bytes() == g.peak_bytes()
    # the same state on meta (a CPU model: its step counters are on its device too)
    assert capture(model, x, optimizer=opt, device="meta").meta["optimizer"]["state_bytes"] == want


def test_optimizer_state_of_an_adam_step_matches_meter():
    """Compared: the keep-all peak of the graph captured with optimizer=Adam, and the meter's peak over a real
    step (forward, backward, ``opt.step()``) taken after one warm-up step, so that the state exists from
    the start as the graph assumes. The batch is large enough that the peak is in the backward pass: Adam's
    own step (parameters + gradients + state + the per-parameter temporaries of its update) stays below
    it. On the first step the state appears only in ``opt.step()``, so that peak is at most the graph's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    x = torch.randn(256, 16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = capture(model, x, optimizer=opt)
    assert g.meta["optimizer"]["state_bytes"] == 2 * sum(p.numel() * 4 for p in model.parameters()) + 4 * 6

    def metered_step(model, opt):
        m = Meter("cpu")
        m.track(model, x, opt)
        with m:
            run_step(model, x, None)
            opt.step()
        opt.zero_grad(set_to_none=True)
        return m.peak_bytes

    first = metered_step(model, opt)
    assert len(opt.state) == len(list(model.parameters()))
    assert metered_step(model, opt) == g.peak_bytes()
    assert first <= g.peak_bytes()
    assert g.peak_bytes() == capture(model, x, optimizer=opt).peak_bytes()  # now read from the existing state


def test_optimizer_state_only_for_parameters_that_get_gradients():
    """A frozen parameter and one the step does not use get no state, as in a real step."""
    class Partial(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.unused, self.b = nn.Linear(8, 8), nn.Linear(8, 100), nn.Linear(8, 2)
            self.a.bias.requires_grad_(False)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    model, x = Partial(), torch.randn(4, 8)
    make = lambda ps: torch.optim.Adam(ps)  # noqa: E731
    g = capture(model, x, optimizer=make(model.parameters()))
    assert g.meta["optimizer"]["state_bytes"] == real_state(model, x, None, make)
    names = {t.name.rsplit(".", 1)[0] for t in g.tensors if t.kind == "optimizer"}
    assert names == {"optimizer.a.weight", "optimizer.b.weight", "optimizer.b.bias"}
    gm = capture(model, x, optimizer=make(model.parameters()), device="meta")
    assert gm.meta["optimizer"]["state_bytes"] == g.meta["optimizer"]["state_bytes"]


def test_optimizer_errors_and_global_hooks():
    model, x = mlp(), torch.randn(4, 16)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        capture(model, x, optimizer="adam")
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(CaptureError, match="LBFGS.*closure.*step the optimizer once before capture"):
        capture(model, x, optimizer=lbfgs)

    def closure():
        lbfgs.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    lbfgs.step(closure)  # its state now exists: read as it is (the history lists too)
    g = capture(model, x, optimizer=lbfgs)
    held = {id(v.untyped_storage()): v.untyped_storage().nbytes() for st in lbfgs.state.values() for v in st.values()
            if isinstance(v, torch.Tensor)}
    held.update({id(v.untyped_storage()): v.untyped_storage().nbytes() for st in lbfgs.state.values()
                 for lst in st.values() if isinstance(lst, list) for v in lst if isinstance(v, torch.Tensor)})
    assert g.meta["optimizer"]["source"] == "existing" and g.meta["optimizer"]["state_bytes"] == sum(held.values()) > 0
    # the sizing step is not a step of the user's: global optimizer hooks do not see it
    seen = []
    handle = register_optimizer_step_pre_hook(lambda o, a, k: seen.append(o))
    try:
        capture(model, x, optimizer=torch.optim.Adam(model.parameters()))
    finally:
        handle.remove()
    assert seen == []


# ---- FACTORY() -> (model, inputs, loss_fn, optimizer) and --optimizer (hybridmem plan / capture) -------------
def factory_with_optimizer():
    """A ``MODULE:FACTORY`` for the command line that returns the step's optimizer too."""
    model = mlp()
    return model, torch.randn(8, 16), None, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def factory_with_bad_optimizer():
    model = mlp()
    return model, torch.randn(8, 16), None, "adam"


def test_factory_optimizer_reaches_capture_and_plan(capsys):
    import json

    from hybridmem.cli import main
    from hybridmem.factory import load_model, parse_optimizer

    spec = load_model("tests.test_capture:factory_with_optimizer")
    assert isinstance(spec.optimizer, torch.optim.SGD)
    momentum = sum(p.numel() * 4 for p in mlp().parameters())

    def captured(*flags):
        assert main(["capture", "--model", "tests.test_capture:factory_with_optimizer", "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    with_state, without = captured(), captured("--optimizer", "none")
    assert with_state["optimizer_state_bytes"] == momentum and without["optimizer_state_bytes"] == 0
    assert with_state["peak_bytes"] == without["peak_bytes"] + momentum
    assert with_state["structure_hash"] != without["structure_hash"]
    adam = captured("--optimizer", "adam:betas=0.9/0.99,amsgrad=true")  # replaces the factory's optimizer
    assert adam["optimizer_state_bytes"] == 3 * momentum + 4 * 6
    # plan: the budget's percentage is of the keep-all peak with the state; the summary shows the state
    assert main(["plan", "--model", "tests.test_capture:factory_with_optimizer", "--budget", "100%", "--solver",
                 "keep-all", "--device", "cpu", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["optimizer_state_bytes"] == momentum and out["keep_all_peak_bytes"] == with_state["peak_bytes"]
    assert parse_optimizer("SGD:lr=0.1,momentum=0.9,nesterov=true") == ("sgd", {"lr": 0.1, "momentum": 0.9,
                                                                                  "nesterov": True})
    for argv, message in [
        (["capture", "--model", "tests.test_capture:factory_with_bad_optimizer"], "4th value.*torch.optim.Optimizer"),
        (["capture", "--model", "tests.test_capture:mlp", "--optimizer", "lamb"], "unknown optimizer 'lamb'.*adamw"),
        (["capture", "--model", "tests.test_capture:mlp", "--optimizer", "sgd:momentum"], "not key=value"),
        (["capture", "--model", "tests.test_capture:mlp", "--optimizer", "sgd:momentum=fast"], "not a number"),
        (["capture", "--model", "tests.test_capture:factory_with_optimizer", "--optimizer", "sgd:colour=1"],
         "SGD refused the options"),
        (["plan", "--model", "tests.test_capture:mlp", "--budget", "90%", "--optimizer", "adam", "--shapes", "2x3",
          "-o", "book"], "--optimizer cannot be combined with --shapes"),
        (["plan", "--graph", "g.yaml", "--budget", "90%", "--optimizer", "adam"], "--optimizer applies to --model"),
    ]:
        assert main(argv) == 2, argv
        assert re.search(message, capsys.readouterr().err), (argv, message)


# ---- bench zoo -------------------------------------------------------------------------------------------
zoo = pytest.importorskip("hybridmem.zoo", reason="hybridmem/zoo.py not available")


@pytest.mark.parametrize("name", zoo.MODELS)
def test_zoo_graph_peak_matches_meter(name):
    e = zoo.build(name, "tiny")
    g = capture(e.model, e.inputs, e.loss_fn)
    g.validate()
    torch.manual_seed(0)
    peak = meter_peak(e.model, e.inputs, e.loss_fn)
    assert abs(g.peak_bytes() - peak) <= 0.02 * peak, (g.peak_bytes(), peak)


def test_resnet50_paper_meta_capture():
    # how fast this is, is measured in bench/test_bench_foundation.py (target <= 5 s)
    e = zoo.build("resnet50", "paper", device="meta")
    g = capture(e.model, e.inputs, e.loss_fn, device="meta")
    assert g.num_stages > 400 and g.peak_bytes() > 4 * 2**30
    assert g.meta["input_shapes"] == [[64, 3, 224, 224]]

_DYNAMO_CHECK = r"""
import contextlib, sys, torch
import hybridmem.graph.capture as C
from hybridmem.factory import load_model
spec = load_model("resnet50", size="tiny", device="meta")
g = C.capture(spec.model, spec.inputs, spec.loss_fn, device="meta", optimizer=spec.optimizer)
print("deferred", "torch._dynamo" in sys.modules, "_dynamo" in torch.__dict__)
C.dynamo_deferred = contextlib.nullcontext
g2 = C.capture(spec.model, spec.inputs, spec.loss_fn, device="meta", optimizer=spec.optimizer)
a, b = (x.to_dict(with_hash=False) for x in (g, g2))
a["meta"].pop("capture_s"); b["meta"].pop("capture_s")
print("same", a == b)
import torch._dynamo
print("real", hasattr(torch._dynamo, "optimize"), torch._dynamo is sys.modules["torch._dynamo"])
"""


def test_meta_capture_does_not_import_dynamo_and_records_the_same_graph():
    """On meta the decompositions' ``torch._disable_dynamo`` wrappers find a stand-in: the capture does
    not import torch._dynamo (about a second), records the graph it records with the real one, and a
    later import gets the real module. A fresh interpreter: other tests import torch._dynamo."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _DYNAMO_CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "deferred False False" in out.stdout
    assert "same True" in out.stdout
    assert "real True True" in out.stdout
