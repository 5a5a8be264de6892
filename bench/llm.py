"""Fine-tuning loops side by side: plain PyTorch, Hugging Face checkpointing, TRL's activation offloading and
hybridmem, on the loop a fine-tuning script runs.

    python bench/llm.py                                      # CPU: a small GPT-2, every row (minutes on 2 cores)
    python bench/llm.py --model llama --lora --bf16          # a Llama-style decoder (GQA), LoRA, bf16 autocast
    python bench/llm.py --size gpu --model llama             # CUDA: a ~1.1B Llama-style decoder, seq 512-2048, bf16
    python bench/llm.py --rows unmanaged,hf_ckpt --steps 6   # some rows

The loop: a model built from its config (``GPT2Config``, or ``LlamaConfig`` with grouped-query attention;
nothing downloaded), random token sequences of varied lengths padded per batch by ``DataCollatorWithPadding``
(``pad_to_multiple_of=8``, attention masks, the padding's labels -100) so that every micro-batch has a
sequence length of its own, AdamW, ``--accum`` micro-batches per optimizer step (2), bf16 autocast around the
forward (``--bf16``; on by default at ``--size gpu``), and a peft LoRA (r 8 on the attention's q, k, v and
output projections) with ``--lora``. Every row uses the same seeds and the same batches.

==================  ==============================================================================
row                 what runs
==================  ==============================================================================
unmanaged           the loop as written
hf_ckpt             Hugging Face's gradient checkpointing (``model.gradient_checkpointing_enable()``,
                    ``activation_checkpointing_enable`` where transformers has it)
offload             TRL's activation offloading (``trl.models.get_act_offloading_ctx_manager``, which
                    is torchtune's ``OffloadActivations``) around each micro-batch's forward and backward
offload+ckpt        the same with gradient checkpointing, as TRL runs it with both options
watch               ``hybridmem.session(budget=None)``: the runtime watching, evicting nothing
hybridmem@ckpt      hybridmem, default policies, budget = the hf_ckpt row's real peak
hybridmem@70        hybridmem, default policies, budget = 70 % of the watch row's peak (its own units)
==================  ==============================================================================

Each row runs in a subprocess of its own (a fresh allocator). Columns: ``steady``: hybridmem's
``stats().steady_steps`` (forward-backward passes run in the steady state, docs/reference.md "Steady state");
``ms`` the wall time of an optimizer step (its micro-batches and AdamW's step, the device synchronised),
median / min / p90 over the steps after the first ``WARMUP``; ``x`` the median over the unmanaged row's;
``peak``: on the CPU the real peak of the step, as ``shared/tools/real_peak.py`` measures it (the training
state's storages when the step starts + the CPU allocator's peak in the step from torch.profiler's memory
events; measured in a second run of the row, since the profiler slows the ops it watches), on CUDA
``torch.cuda.max_memory_allocated`` (and ``reserved``), the largest of any step; ``hm peak`` hybridmem's
own ``stats().peak_bytes``; ``within``: the peak at or under the budget; ``same``: every loss, every step's
gradients and the parameters after the steps bit-identical to the unmanaged row's. A row that fails shows the
error's first line. Results: ``--out DIR`` (``llm.md``, ``llm.json``; default ``$OUT`` or ``bench-results``).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

# cuBLAS reads this when it creates its handle: deterministic matrix products in every row
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing bench

ROWS = ("unmanaged", "hf_ckpt", "offload", "offload+ckpt", "watch", "hybridmem@ckpt", "hybridmem@70")
HYBRIDMEM_ROWS = ("watch", "hybridmem@ckpt", "hybridmem@70")
NEEDS = {"hybridmem@ckpt": "hf_ckpt", "hybridmem@70": "watch"}  # the row each budget comes from
SHARE = 0.7      # of the watch row's peak, for hybridmem@70
WARMUP = 2       # optimizer steps not timed: hybridmem's dispatch-mode and recorded passes
LORA_TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
                "gpt2": ["attn.c_attn", "attn.c_proj"]}  # GPT-2's q, k, v are one fused projection

# batch: sequences per micro-batch; lengths: the range each micro-batch's padded length is drawn from
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(batch=2, lengths=(16, 56), steps=4,
                 gpt2=dict(n_embd=32, n_layer=2, n_head=2, vocab_size=256),
                 llama=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=256)),
    "cpu": dict(batch=4, lengths=(64, 192), steps=8,
                gpt2=dict(n_embd=128, n_layer=4, n_head=4, vocab_size=2048),
                llama=dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=2048)),
    # GPT-2 small (124M) and a TinyLlama-shaped 1.1B decoder
    "gpu": dict(batch=4, lengths=(512, 2048), steps=8,
                gpt2=dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257),
                llama=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000)),
}


@dataclass
class Spec:
    """What every row of one run trains."""

    model: str = "gpt2"
    size: str = "cpu"
    steps: int = 8
    accum: int = 2
    bf16: bool = False
    lora: bool = False
    device: str = "cpu"
    seed: int = 0

    @property
    def shape(self) -> dict[str, Any]:
        return SIZES[self.size]


@dataclass
class Result:
    """One row: what it measured, or why it did not run."""

    row: str
    status: str = "ok"                  # ok, error, unavailable
    error: str = ""
    budget: int = 0
    times: list[float] = field(default_factory=list)      # seconds per optimizer step, after WARMUP
    peaks: list[int] = field(default_factory=list)        # real peak per step (CPU), max allocated (CUDA)
    reserved: list[int] = field(default_factory=list)     # CUDA: max reserved per step
    hm_peak: int = 0                    # hybridmem's stats().peak_bytes
    hm_steps: int = 0                   # hybridmem's stats().steps
    steady: int | None = None           # hybridmem's stats().steady_steps
    evicted: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    summary: str = ""                   # hybridmem's str(stats())
    lengths: list[int] = field(default_factory=list)      # padded length of each micro-batch
    losses: list[float] = field(default_factory=list)
    grads: list[str] = field(default_factory=list)        # a digest of the gradients of each step
    params: str = ""                    # a digest of the parameters after the steps
    same: str = "-"

    @property
    def peak(self) -> int:
        return max(self.peaks, default=0)

    @property
    def within(self) -> str:
        if not self.budget or self.status != "ok":
            return "-"
        return "yes" if self.peak <= self.budget and self.hm_peak <= self.budget else "NO"

    def ms(self, what: str) -> float:
        if not self.times:
            return 0.0
        ts = sorted(self.times)
        if what == "median":
            return statistics.median(ts) * 1e3
        if what == "min":
            return ts[0] * 1e3
        return ts[min(len(ts) - 1, round(0.9 * (len(ts) - 1)))] * 1e3  # p90, nearest rank


# ---- the loop's pieces ------------------------------------------------------------------------------
def tokenizer(vocab: int) -> Any:
    """A word-level tokenizer over ``vocab`` ids, built in memory (nothing downloaded); id 0 pads."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0")


def batch_lengths(spec: Spec) -> list[int]:
    """The padded length of every micro-batch: multiples of 8 in the size's range, a new one each batch
    while the range has new ones (a seeded permutation, repeated)."""
    lo, hi = spec.shape["lengths"]
    choices = list(range(lo, hi + 1, 8))
    order = torch.randperm(len(choices), generator=torch.Generator().manual_seed(spec.seed)).tolist()
    n = spec.steps * spec.accum
    return [choices[order[i % len(order)]] for i in range(n)]


def micro_batch(spec: Spec, collate: Callable, vocab: int, length: int, index: int) -> dict[str, torch.Tensor]:
    """Micro-batch ``index``: random sequences of ``length // 2`` to ``length`` tokens (the first exactly
    ``length``), padded by the collator; labels are the inputs with -100 where padded."""
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + index)
    n = spec.shape["batch"]
    sizes = [length] + torch.randint(length // 2, length + 1, (n - 1,), generator=g).tolist()
    features = [{"input_ids": torch.randint(1, vocab, (k,), generator=g).tolist()} for k in sizes]
    b = collate(features)
    b["labels"] = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
    return {k: v.to(spec.device) for k, v in b.items()}


def build_model(spec: Spec) -> torch.nn.Module:
    """The model from its config, seeded, on the device; with ``spec.lora`` a peft LoRA around it."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    hi = spec.shape["lengths"][1]
    cfg = dict(spec.shape[spec.model], use_cache=False)
    torch.manual_seed(spec.seed)
    with torch.device(spec.device):  # initialised where it trains: a 1B model's init on the host takes minutes
        if spec.model == "gpt2":
            model = GPT2LMHeadModel(GPT2Config(n_positions=hi, bos_token_id=1, eos_token_id=1, **cfg))
        else:
            model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=hi, bos_token_id=1, eos_token_id=1,
                                                 pad_token_id=0, **cfg))
    if spec.lora:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS[spec.model],
                          fan_in_fan_out=spec.model == "gpt2", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)
    model.train()
    return model


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Hugging Face's gradient checkpointing, under the name this transformers gives it."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def offload_context(model: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """TRL's activation offloading context (one object, entered per micro-batch as TRL's trainer does)."""
    from trl.models import get_act_offloading_ctx_manager

    ctx = get_act_offloading_ctx_manager(model)
    return lambda: ctx


def digest(tensors: list[torch.Tensor]) -> str:
    """A digest of the tensors' bytes: sha256 on the host; on a GPU, of per-tensor integer sums of the bits
    (any bit that differs changes a sum; nothing the size of the model is copied to the host)."""
    h = hashlib.sha256()
    if tensors and tensors[0].device.type != "cpu":
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        sums = torch.stack([t.detach().contiguous().view(ints[t.element_size()]).sum(dtype=torch.int64)
                            for t in tensors])
        h.update(sums.cpu().numpy().tobytes())
    else:
        for t in tensors:
            h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# ---- one row, in its own process ----------------------------------------------------------------------
def _sync(spec: Spec) -> None:
    if spec.device.startswith("cuda"):
        torch.cuda.synchronize()


def _real_peak() -> Callable[..., int]:
    from bench.fidelity import real_peak_fn  # shared/tools/real_peak.py where it is, else the same method

    return real_peak_fn()


def _session(row: str, spec: Spec, budget: int) -> contextlib.AbstractContextManager:
    if row not in HYBRIDMEM_ROWS:
        return contextlib.nullcontext()
    import hybridmem

    return hybridmem.session(budget=None if row == "watch" else budget, device=spec.device)


def train(spec: Spec, row: str, measure: str, budget: int, res: Result) -> None:
    """The row's loop: ``spec.steps`` optimizer steps, timed (``measure="time"``) or each measured by
    ``real_peak`` (``"peak"``, CPU)."""
    from transformers import DataCollatorWithPadding

    vocab = spec.shape[spec.model]["vocab_size"]
    collate = DataCollatorWithPadding(tokenizer(vocab), pad_to_multiple_of=8, return_tensors="pt")
    lengths = batch_lengths(spec)
    model = build_model(spec)
    if row in ("hf_ckpt", "offload+ckpt"):
        enable_checkpointing(model)
    ctx = offload_context(model) if row.startswith("offload") else contextlib.nullcontext
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3 if spec.lora else 1e-4, weight_decay=0.01)
    autocast = (lambda: torch.autocast(torch.device(spec.device).type, dtype=torch.bfloat16)) if spec.bf16 \
        else contextlib.nullcontext
    real_peak = _real_peak() if measure == "peak" else None
    losses: list[torch.Tensor] = []

    def step(micro: list[dict[str, torch.Tensor]]) -> None:
        for b in micro:
            with ctx():  # TRL enters it around forward and backward (SFTTrainer.training_step)
                with autocast():
                    loss = model(**b).loss / spec.accum
                loss.backward()
            losses.append(loss.detach())
        opt.step()

    with _session(row, spec, budget) as s:
        try:
            for k in range(spec.steps):
                micro = [micro_batch(spec, collate, vocab, lengths[k * spec.accum + i], k * spec.accum + i)
                         for i in range(spec.accum)]
                res.lengths += [b["input_ids"].shape[1] for b in micro]
                torch.manual_seed(1000 + k)  # dropout: the same masks in every row
                _sync(spec)
                if spec.device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                if real_peak is not None:
                    inputs = [t for b in micro for t in b.values()]
                    res.peaks.append(real_peak(lambda m=micro: step(m), model, opt, inputs))
                else:
                    step(micro)
                _sync(spec)
                if k >= WARMUP and measure == "time":
                    res.times.append(time.perf_counter() - t0)
                if spec.device.startswith("cuda"):
                    res.peaks.append(torch.cuda.max_memory_allocated())
                    res.reserved.append(torch.cuda.max_memory_reserved())
                res.grads.append(digest([p.grad for p in params if p.grad is not None]))
                opt.zero_grad(set_to_none=True)  # outside the measured step, as real_peak asks
                del micro
        finally:
            res.losses = [x.item() for x in losses]
            if s is not None:
                _hybridmem_figures(s.stats(), res)
    res.params = digest([p.detach() for p in params])


def _hybridmem_figures(st: Any, res: Result) -> None:
    res.hm_peak, res.hm_steps, res.steady = st.peak_bytes, st.steps, st.steady_steps
    res.evicted = {n: p.evicted_bytes for n, p in st.policies.items() if p.evicted_bytes}
    res.notes = list(st.notes)
    res.summary = str(st)


def first_line(e: BaseException) -> str:
    """``Type: first line of the message``, with the budget a hybridmem OutOfMemoryError names."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    out = f"{type(e).__name__}: {msg}"
    named = getattr(e, "min_budget_bytes", None)
    return out + (f" (named minimum {named / 2**20:.1f} MiB)" if named else "")


def child(job: dict[str, Any]) -> None:
    """Run one row's pass and write its Result as JSON to ``job["result"]``."""
    spec = Spec(**job["spec"])
    if spec.device.startswith("cuda"):  # deterministic kernels: rows bit-identical where they must be
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.set_num_threads(1)  # stable figures on shared cores
    res = Result(job["row"], budget=job["budget"])
    try:
        if job["row"].startswith("offload"):
            _check_offload()
        train(spec, job["row"], job["measure"], job["budget"], res)
    except Unavailable as e:
        res.status, res.error = "unavailable", str(e)
    except BaseException as e:  # noqa: BLE001  (the row says what ended it; the next rows still run)
        traceback.print_exception(e, file=sys.stderr)
        res.status, res.error = "error", first_line(e) + _where(spec, res)
    Path(job["result"]).write_text(json.dumps(asdict(res)))


def _where(spec: Spec, res: Result) -> str:
    """The step an error stopped and its micro-batches' lengths (a new length is a new input shape)."""
    if not res.lengths:
        return " [before the first step]"
    k = len(res.lengths) // spec.accum
    return f" [in step {k} of {spec.steps}, lengths {', '.join(map(str, res.lengths[-spec.accum:]))}]"


class Unavailable(Exception):
    """A row this machine or these packages cannot run."""


def _check_offload() -> None:
    try:
        import trl.models  # noqa: F401
    except ImportError as e:
        raise Unavailable(f"trl does not import ({e}; pip install trl)") from None
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if acc is None:  # TRL's OffloadActivations reads the accelerator's type when it is built
        raise Unavailable("TRL's OffloadActivations needs an accelerator to offload from (none on this machine)")


# ---- the rows, side by side -----------------------------------------------------------------------------
def run_pass(spec: Spec, row: str, measure: str, budget: int, timeout: float) -> Result:
    """One row's pass in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        job = dict(spec=asdict(spec), row=row, measure=measure, budget=budget, result=str(out))
        env = {**os.environ, **({} if spec.device.startswith("cuda") else {"OMP_NUM_THREADS": "1"})}
        env = {k: v for k, v in env.items() if not k.startswith("HYBRIDMEM_")}  # each row sets its own
        try:
            p = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], env=env, cwd=ROOT,
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Result(row, status="error", budget=budget, error=f"timed out after {timeout:.0f} s")
        if out.is_file():
            res = Result(**json.loads(out.read_text()))
        else:
            tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
            res = Result(row, status="error", budget=budget, error=f"exit status {p.returncode}: {tail[:300]}")
        if res.status == "error":
            sys.stderr.write(p.stderr[-4000:])
        return res


def run_row(spec: Spec, row: str, budgets: dict[str, int], timeout: float) -> Result:
    """The row's passes (on the CPU a timed one and one measuring real peaks), merged into one Result."""
    budget = 0
    if row in NEEDS:
        base = budgets.get(NEEDS[row])
        if not base:
            return Result(row, status="error", error=f"needs the {NEEDS[row]} row's peak: add {NEEDS[row]} to --rows "
                          "(before it) or see why that row failed")
        budget = int(SHARE * base) if row == "hybridmem@70" else base
    res = run_pass(spec, row, "time", budget, timeout)
    if spec.device.startswith("cuda") or res.status != "ok":
        return res
    peak = run_pass(spec, row, "peak", budget, timeout)
    if peak.status != "ok":
        peak.error = f"in the run measuring real peaks: {peak.error}"
        return peak
    res.peaks = peak.peaks
    if (peak.losses, peak.grads, peak.params) != (res.losses, res.grads, res.params):
        res.notes.append("the run measuring real peaks trained differently from the timed run")
    if budget and peak.hm_peak > res.hm_peak:  # the budget binds both runs: the within column reads the larger
        res.hm_peak = peak.hm_peak
    return res


def same_as(r: Result, base: Result) -> str:
    """``yes``, or where the row first differs from the unmanaged row."""
    for what, a, b in (("loss", r.losses, base.losses), ("gradients", r.grads, base.grads)):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"no: {what} of {'micro-batch' if what == 'loss' else 'step'} {i + 1}"
        if len(a) != len(b):
            return f"no: {len(a)} {what} vs {len(b)}"
    return "yes" if r.params == base.params else "no: parameters"


def budgets_from(res: Result, spec: Spec) -> dict[str, int]:
    """What later rows take their budget from: hf_ckpt's real peak, the watch row's own peak."""
    if res.status != "ok":
        return {}
    if res.row == "watch":
        return {"watch": res.hm_peak}
    return {res.row: res.peak}


# ---- report -------------------------------------------------------------------------------------------
def _mib(n: int | None) -> str:
    return "-" if not n else f"{n / 2**20:.1f}"


def note(r: Result) -> str:
    """Why a row's steady state was short, and whether its two runs trained alike: the notes that say so
    (all of them are in the JSON)."""
    keep = ("steady state left", "steady state: not used", "steady state: one program", "trained differently")
    return "; ".join(n[:160] for n in r.notes if n.startswith(keep))


def table(results: list[Result], spec: Spec) -> list[str]:
    cuda = spec.device.startswith("cuda")
    base = next((r for r in results if r.row == "unmanaged" and r.status == "ok"), None)
    peak_head = "peak alloc / reserved MiB" if cuda else "real peak MiB"
    lines = [f"| row | budget MiB | {peak_head} | hm peak MiB | within | steady | ms median / min / p90 | x | same "
             "| note |", "|" + "---|" * 10]
    for r in results:
        if r.status != "ok":
            lines.append(f"| {r.row} | {_mib(r.budget)} | - | - | - | - | - | - | - | {r.status}: {r.error} |")
            continue
        peak = f"{_mib(r.peak)} / {_mib(max(r.reserved, default=0))}" if cuda else _mib(r.peak)
        x = f"{r.ms('median') / base.ms('median'):.2f}" if base and base.ms("median") and r.times else "-"
        steady = "-" if r.steady is None or r.row == "watch" else f"{r.steady} of {r.hm_steps}"
        lines.append(f"| {r.row} | {_mib(r.budget)} | {peak} | {_mib(r.hm_peak)} | {r.within} | {steady} | "
                     f"{r.ms('median'):.0f} / {r.ms('min'):.0f} / {r.ms('p90'):.0f} | {x} | {r.same} | {note(r)} |")
    return lines


def environment(spec: Spec) -> list[str]:
    """When, where and what: the machine, the packages' versions, the loop."""
    import importlib.metadata as md

    def version(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"
    cuda = spec.device.startswith("cuda")
    dev = torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or 'host'}, 1 torch thread per row)"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    shape, (lo, hi) = spec.shape, spec.shape["lengths"]
    config = ", ".join(f"{k} {v}" for k, v in shape[spec.model].items())
    return [f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {dev}, torch {torch.__version__}, "
            f"transformers {version('transformers')}, peft {version('peft')}, trl {version('trl')}, "
            f"Python {platform.python_version()}; load average {load} at the end (other processes share the "
            "cores: compare rows of one run)",
            f"- {spec.model} at size {spec.size} ({config}), batch {shape['batch']}, padded lengths {lo}-{hi} (a new "
            f"one per micro-batch), {spec.steps} steps of {spec.accum} micro-batches, AdamW, bf16 autocast "
            f"{'on' if spec.bf16 else 'off'}, LoRA {'r 8 on q, k, v, o' if spec.lora else 'off'}; timed: the steps "
            f"after the first {WARMUP}"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--size", default="cpu", choices=sorted(SIZES), help="cpu (default), gpu (CUDA), tiny (tests)")
    ap.add_argument("--model", default="gpt2", choices=("gpt2", "llama"))
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per row (default: the size's)")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--lora", action="store_true", help="peft LoRA, r 8 on q, k, v, o")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="bf16 autocast around the forward (default: on at --size gpu, else off)")
    ap.add_argument("--device", default=None, help="default: cuda at --size gpu, else cpu")
    ap.add_argument("--row-timeout", type=float, default=900.0, help="seconds a row's process may run")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "bench-results"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        return a
    rows = [r for r in a.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        ap.error(f"--rows: unknown {unknown or 'none given'}; accepted: {', '.join(ROWS)}")
    a.rows = rows
    a.steps = SIZES[a.size]["steps"] if a.steps is None else a.steps
    if a.steps <= WARMUP:
        ap.error(f"--steps {a.steps}: expected more than the {WARMUP} untimed steps")
    if a.accum < 1:
        ap.error(f"--accum {a.accum}: expected 1 or more micro-batches per step")
    a.device = a.device or ("cuda" if a.size == "gpu" else "cpu")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: this torch sees no CUDA device (--size cpu runs on the CPU)")
    a.bf16 = a.size == "gpu" if a.bf16 is None else a.bf16
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.child is not None:
        child(json.loads(a.child))
        return 0
    spec = Spec(model=a.model, size=a.size, steps=a.steps, accum=a.accum, bf16=a.bf16, lora=a.lora, device=a.device)
    results = list(run_rows(spec, a.rows, a.row_timeout))
    env = environment(spec)
    text = "\n".join(["## Fine-tuning loops side by side (`python bench/llm.py`)", "", *env, "",
                      *table(results, spec)]) + "\n"
    print(text)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "llm.md").write_text(text)
    (a.out / "llm.json").write_text(json.dumps(
        {"environment": env, "spec": asdict(spec), "warmup": WARMUP,
         "results": [asdict(r) | {"peak": r.peak, "within": r.within,
                                  "ms": {w: r.ms(w) for w in ("median", "min", "p90")}} for r in results]}, indent=1))
    return 0


def run_rows(spec: Spec, rows: list[str], timeout: float) -> Iterator[Result]:
    """Each row in order, its budget from the rows before it, compared with the unmanaged row."""
    budgets: dict[str, int] = {}
    base: Result | None = None
    for row in rows:
        res = run_row(spec, row, budgets, timeout)
        budgets |= budgets_from(res, spec)
        if row == "unmanaged" and res.status == "ok":
            base = res
        elif base is not None and res.status == "ok":
            res.same = same_as(res, base)
        print(f"# {row}: {res.status}" + (f", {res.error}" if res.error else
              f", {res.ms('median'):.0f} ms, peak {_mib(res.peak)} MiB, same {res.same}"), file=sys.stderr, flush=True)
        yield res


if __name__ == "__main__":
    sys.exit(main())
