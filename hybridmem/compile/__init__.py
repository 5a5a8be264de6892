"""torch.compile with hybridmem: an STR plan applied in AOTAutograd's partition of each compiled region
(:mod:`hybridmem.compile.backend`)."""
from .backend import COMPILERS, POLICIES, CompileBackend, compile_backend
from .stats import CompileStats, RegionStats

__all__ = ["COMPILERS", "POLICIES", "CompileBackend", "CompileStats", "RegionStats", "compile_backend"]
