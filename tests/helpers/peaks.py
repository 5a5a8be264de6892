"""The real peak of a training step, as acceptance measures it: ``shared/tools/real_peak.py`` beside the
checkout, else the same measurement from torch.profiler's memory events and the state's storages
(:func:`bench.fidelity.real_peak_fn`)."""
from bench.fidelity import real_peak_fn

real_peak = real_peak_fn()

__all__ = ["real_peak"]
