"""Benchmarks for hybridmem: the model zoo (``hybridmem.zoo``) and the benchmark scripts built on it."""
