"""The zoo models the runtime tests train: which are fast, which are slow, and each one's tiny case."""
from __future__ import annotations

from functools import lru_cache

from hybridmem import zoo

from .runtime import Case

# VGG-16 at this size is not here: its peak is its first convolution's backward (the input, the gradient
# being made and the kernel's scratch), where no saved activation is left to evict, so no budget below the
# monitor-only peak can work. tests/test_real_bytes.py covers it at the small size.
FAST = ("resnet50", "mobilenet", "unet", "transformer", "gpt")
SLOW = ("resnet101", "resnet152")
OPTIM = "sgd-plain"  # momentum buffers would only add a constant to every number


@lru_cache(maxsize=None)
def zoo_case(name: str) -> Case:
    """The zoo model ``name`` at the tiny size with batch 8, as a runtime test case (built once)."""
    e = zoo.build(name, "tiny", batch=8)
    args, kwargs = e.args_kwargs()
    return Case(name, e.model, args, kwargs, e.loss_fn)
