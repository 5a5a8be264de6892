"""Moved to :mod:`hybridmem.entry` (plugins build entries too); this path stays, as the same module object."""
import sys

from .. import entry

sys.modules[__name__] = entry
