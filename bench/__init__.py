"""Benchmarks for hybridmem: the model zoo (``bench.zoo``) and the benchmark scripts built on it."""
