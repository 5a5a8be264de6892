"""Low-level pieces below the runtime that depend on torch and the standard library only.

``cpumeter``: the native CPU allocator wrapper (``_cpumeter.cpp``), which ``build`` compiles on first use
and caches; ``counters``: the CUDA caching allocator's counters, read through it; ``allocconf``: the CUDA
allocator settings a budget needs; ``capture``: whether a CUDA graph is being captured. graph/,
compile/, plugins/ and the runtime import these; nothing here imports them back
(``tests/test_layers.py``). Nothing is imported here, so ``import hybridmem.native.capture`` does not
build the library.
"""
