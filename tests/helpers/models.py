"""Models the zoo does not build, written from their published structure, for tests (the torchvision-style
builders live in :mod:`bench.fidelity_models`, which the fidelity benchmark shares)."""
from bench.fidelity_models import BasicBlock

__all__ = ["BasicBlock"]
