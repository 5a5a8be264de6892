"""Puts the repository root on sys.path so tests and benchmarks can import ``bench``."""
