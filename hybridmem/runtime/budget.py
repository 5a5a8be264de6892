"""Moved to :mod:`hybridmem.devices`, the one budget parser and resolver; this path stays for a release."""
from ..devices import device_budget_bytes  # noqa: F401
