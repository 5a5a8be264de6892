"""Tests of the benchmark model zoo (hybridmem/zoo.py): tiny sizes train on the CPU, paper sizes on meta."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from hybridmem.zoo import MODELS, PAPER_MODELS, SIZES, ZooEntry, build, config, count_parameters, size_table

# Exact parameter counts at paper size. The CNNs match torchvision's models of the same name,
# GPT matches GPT-2 small, and the encoder is BERT-base without token-type embeddings plus a
# 2-class head: a check that the architectures are the real ones, not look-alikes.
PAPER_PARAMETERS = {
    "vgg16": 138_357_544,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
    "mobilenet": 3_504_872,
    "unet": 31_037_698,
    "transformer": 109_482_242,
    "gpt": 124_439_808,
}


pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in the root conftest.py


@pytest.fixture(scope="module")
def meta_warm():
    """Pays torch's one-off cost of loading meta kernels (about 2 s) outside the timed tests."""
    build("resnet50", "tiny", device="meta").loss().backward()


def _step(entry: ZooEntry, rng_seed: int = 0) -> torch.Tensor:
    torch.manual_seed(rng_seed)  # dropout draws from the global RNG at forward time
    loss = entry.loss()
    loss.backward()
    return loss


def test_model_lists():
    assert set(PAPER_MODELS) <= set(MODELS)
    assert len(set(MODELS)) == len(MODELS) == 8
    assert set(PAPER_PARAMETERS) == set(MODELS)
    assert SIZES == ("tiny", "small", "bench", "paper")


@pytest.mark.parametrize("name", MODELS)
def test_tiny_trains_on_cpu(name: str):
    entry = build(name, "tiny")
    assert entry.name == name and entry.size == "tiny" and entry.description
    assert entry.model.training
    loss = _step(entry)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert torch.isfinite(loss)
    for pname, p in entry.model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient for {pname}"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient for {pname}"
    assert any(p.grad.abs().sum() > 0 for p in entry.model.parameters())


@pytest.mark.parametrize("name", MODELS)
def test_same_seed_is_bit_identical(name: str):
    a, b = build(name, "tiny", seed=3), build(name, "tiny", seed=3)
    loss_a, loss_b = _step(a), _step(b)
    assert torch.equal(loss_a, loss_b)
    for (pname, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa.grad, pb.grad), f"{name}: gradient of {pname} differs"
    other = build(name, "tiny", seed=4)
    assert not torch.equal(_step(other), loss_a)


def test_build_leaves_global_rng_alone():
    state = torch.get_rng_state()
    build("resnet50", "tiny", seed=123)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("name", MODELS)
def test_paper_size_on_meta(name: str, meta_warm):
    entry = build(name, "paper", device="meta")
    assert count_parameters(entry.model) == PAPER_PARAMETERS[name]
    assert all(p.device.type == "meta" for p in entry.model.parameters())
    loss = entry.loss()
    assert loss.device.type == "meta" and loss.dim() == 0
    loss.backward()
    assert all(p.grad is not None for p in entry.model.parameters())


def test_paper_resnet_on_meta(meta_warm):
    # build and forward times are measured in bench/test_bench_foundation.py
    entry = build("resnet50", "paper", device="meta")
    assert entry.config.batch == 64 and entry.inputs.shape == (64, 3, 224, 224)
    assert entry.loss().device.type == "meta"


def test_paper_sizes_match_the_paper():
    assert config("vgg16", "paper").batch == 256
    assert config("mobilenet", "paper").batch == 512
    assert config("unet", "paper").batch == 32
    assert config("resnet50", "paper").image == 224
    enc = config("transformer", "paper")
    assert (enc.layers, enc.hidden, enc.heads, enc.seq) == (12, 768, 12, 128)
    assert config("gpt", "paper").layers == 12


def test_call_conventions():
    enc = build("transformer", "tiny")
    assert isinstance(enc.inputs, dict) and set(enc.inputs) == {"input_ids", "attention_mask"}
    assert enc.inputs["attention_mask"].dtype == torch.bool
    out = enc.model(**enc.inputs)
    assert isinstance(out, dict) and out["logits"].shape == (2, enc.config.num_classes)

    gpt = build("gpt", "tiny")
    assert isinstance(gpt.inputs, tuple) and len(gpt.inputs) == 2
    ids, targets = gpt.inputs
    assert torch.equal(ids[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one
    logits, loss = gpt.model(*gpt.inputs)
    assert logits.shape == (*ids.shape, gpt.config.vocab) and loss.dim() == 0
    assert gpt.model.lm_head.weight is gpt.model.tok.weight  # tied

    cnn = build("resnet50", "tiny")
    assert isinstance(cnn.inputs, torch.Tensor)
    assert cnn.args_kwargs() == ((cnn.inputs,), {})


@pytest.mark.parametrize("name", ["transformer", "gpt"])
def test_dropout_present(name: str):
    model = build(name, "tiny", device="meta").model
    assert any(isinstance(m, nn.Dropout) and m.p == 0.1 for m in model.modules())
    assert all(m.dropout == 0.1 for m in model.modules() if hasattr(m, "heads"))  # attention dropout


@pytest.mark.parametrize("name", MODELS)
def test_batch_override(name: str):
    entry = build(name, "paper", batch=5, device="meta")
    args, kwargs = entry.args_kwargs()
    for t in (*args, *kwargs.values()):
        assert t.shape[0] == 5
    with pytest.raises(ValueError):
        build(name, "tiny", batch=0)


def test_dtype_and_device():
    entry = build("unet", "tiny", dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in entry.model.parameters())
    assert entry.inputs.dtype == torch.float64
    assert torch.isfinite(_step(entry))
    meta = build("gpt", "tiny", device=torch.device("meta"), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and p.is_meta for p in meta.model.parameters())
    assert all(t.dtype == torch.long and t.is_meta for t in meta.inputs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_same_weights_and_inputs_on_cuda():
    cpu, gpu = build("mobilenet", "tiny", seed=7), build("mobilenet", "tiny", seed=7, device="cuda")
    assert torch.equal(cpu.inputs, gpu.inputs.cpu())
    for pa, pb in zip(cpu.model.parameters(), gpu.model.parameters()):
        assert pb.is_cuda and torch.equal(pa, pb.cpu())
    assert torch.isfinite(_step(gpu))


def test_unknown_name_or_size():
    with pytest.raises(ValueError) as err:
        build("alexnet")
    assert all(name in str(err.value) for name in MODELS)
    with pytest.raises(ValueError) as err:
        build("resnet50", "huge")
    assert all(size in str(err.value) for size in SIZES)


def test_docstring_table_is_current():
    import hybridmem.zoo

    assert size_table() in hybridmem.zoo.__doc__, "regenerate the table with `python -m hybridmem.zoo`"
