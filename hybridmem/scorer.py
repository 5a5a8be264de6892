"""Online victim selection: rank eviction candidates DTR-style over flat arrays, in Numba.

Each candidate ``i`` (one (tensor, policy) pair, prepared by the runtime) has a regeneration cost in
seconds, the bytes its eviction frees and the runtime clock of its last access. Its score is::

    score_i = cost_i / (bytes_i * staleness_i),   staleness_i = max(now - last_access_i, 0) + eps

Low scores are cheap to regenerate, free many bytes and have not been used for a while: they go first.
:func:`select_victims` picks the lowest scores until ``need`` bytes are covered::

    idx = select_victims(costs, nbytes, last_access, now=clock, need=missing_bytes)

The kernels compile on first use (not at import). ``cache=True`` is tried first; when Numba cannot
write a cache (read-only install, no writable HOME or NUMBA_CACHE_DIR) they compile uncached, and when
Numba cannot import or compile at all a numpy implementation with identical results takes over.
``HYBRIDMEM_SCORER=numpy`` (or ``HYBRIDMEM_NUMBA=0``, which also turns off the Numba codecs) forces
the fallback. ``BACKEND`` says which one runs ("numba" or "numpy").
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ._jit import lazy_njit

__all__ = ["select_victims", "score", "BACKEND", "backend", "lazy_njit", "EPS"]

EPS = 1e-6          # staleness floor: a tensor touched at `now` is very expensive to evict, not infinitely
_GREEDY_ROUNDS = 8  # argmin passes before switching to a sort: a few victims stay O(n)


# --------------------------------------------------------------------------------------------------
# Kernels: plain Python that Numba compiles. A jitted function can only call jitted functions, so
# helpers are listed as `deps` and swapped in as globals before the kernel compiles. The numpy path
# mirrors the arithmetic op for op: both give bit-identical scores and the same order (ties: lowest
# index first). error_model="numpy": no ZeroDivisionError check, which is what lets LLVM vectorize the
# divisions (26 us -> 5 us for 10k scores on this machine's Zen 3).
# --------------------------------------------------------------------------------------------------

def _fmin_py(x):
    """Smallest value of a NaN-free array. Compiled with fastmath nnan/nsz so it becomes vminpd."""
    m = np.inf
    for i in range(x.shape[0]):
        v = x[i]
        m = v if v < m else m
    return m


_fmin = _fmin_py  # replaced by the compiled helper before _select_kernel compiles


def _score_kernel(costs, nbytes, last_access, now, eps, out):
    for i in range(costs.shape[0]):
        st = now - last_access[i]
        st = 0.0 if st < 0.0 else st              # NaN stays NaN
        out[i] = costs[i] / (nbytes[i] * (st + eps))


def _argmin_eligible(scores):
    """First index of the smallest score, or -1 when all are +inf (not eligible)."""
    m = _fmin(scores)
    if not m < np.inf:
        return -1
    for i in range(scores.shape[0]):
        if scores[i] == m:
            return i
    return -1


def _select_kernel(costs, nbytes, last_access, now, need, eps, mask, use_mask, out):
    """Victims in eviction order into ``out``; returns how many, or -1 when more than
    ``_GREEDY_ROUNDS`` victims are needed (or ``need`` cannot be covered): then the numpy path, which
    sorts, gives the answer (the same one the kernel would). Semantics: :func:`select_victims`."""
    n = costs.shape[0]
    scores = np.empty(n)
    # pass 1, branch-free so it vectorizes; +inf marks "not eligible" (NaN and infinite scores too)
    if use_mask:
        for i in range(n):
            st = now - last_access[i]
            st = 0.0 if st < 0.0 else st
            s = costs[i] / (nbytes[i] * (st + eps))
            ok = (nbytes[i] > 0) & (s < np.inf) & mask[i]
            scores[i] = s if ok else np.inf
    else:
        for i in range(n):
            st = now - last_access[i]
            st = 0.0 if st < 0.0 else st
            s = costs[i] / (nbytes[i] * (st + eps))
            ok = (nbytes[i] > 0) & (s < np.inf)
            scores[i] = s if ok else np.inf
    best = _argmin_eligible(scores)              # vectorized min + first match
    if best < 0:
        return 0
    out[0] = best
    if nbytes[best] >= need:                      # common case under pressure: one victim, ~2 passes
        return 1
    # eligible total and the cheapest candidate covering `need` alone (by cost / staleness)
    total = 0
    single = -1
    single_h = np.inf
    for i in range(n):
        if scores[i] < np.inf:
            b = nbytes[i]
            total += b
            if b >= need:
                st = now - last_access[i]
                st = 0.0 if st < 0.0 else st
                h = costs[i] / (st + eps)
                if single < 0 or h < single_h:
                    single = i
                    single_h = h
    if total < need:
        return -1                                 # cannot cover: the caller sorts everything (numpy)
    # greedy: a few argmin passes (O(n) each); more victims than that -> the caller sorts (numpy)
    covered = 0
    k = 0
    while True:
        i = out[k]
        scores[i] = np.inf
        covered += nbytes[i]
        k += 1
        if covered >= need:
            break
        if k >= _GREEDY_ROUNDS:
            return -1
        out[k] = _argmin_eligible(scores)
    # shortcut: one candidate that covers `need` alone for no more (cost / staleness) than the set
    if k > 1 and single >= 0:
        acc = 0.0
        for q in range(k):
            i = out[q]
            st = now - last_access[i]
            st = 0.0 if st < 0.0 else st
            acc += costs[i] / (st + eps)
        if single_h <= acc:
            out[0] = single
            return 1
    return k


def _warm_select() -> tuple:
    c = np.ones(3)
    return (c, np.ones(3, np.int64), np.zeros(3), 1.0, 2, EPS, np.ones(0, np.bool_), False,
            np.empty(_GREEDY_ROUNDS, np.int64))


def _warm_score() -> tuple:
    return (np.ones(2), np.ones(2, np.int64), np.zeros(2), 1.0, EPS, np.empty(2))


_NUMPY_ERRORS = {"error_model": "numpy"}
_FMIN = lazy_njit(_fmin_py, lambda: (np.ones(2),), fastmath={"nnan", "nsz"}, **_NUMPY_ERRORS)
_ARGMIN = lazy_njit(_argmin_eligible, lambda: (np.ones(2),), deps={"_fmin": _FMIN}, **_NUMPY_ERRORS)
_SELECT = lazy_njit(_select_kernel, _warm_select, deps={"_argmin_eligible": _ARGMIN}, **_NUMPY_ERRORS)
_SCORE = lazy_njit(_score_kernel, _warm_score, **_NUMPY_ERRORS)


# --------------------------------------------------------------------------------------------------
# numpy fallback: same arithmetic, same order
# --------------------------------------------------------------------------------------------------

def _staleness_np(last_access: np.ndarray, now: float) -> np.ndarray:
    st = now - last_access
    return np.where(st < 0.0, 0.0, st)


def _select_numpy(costs, nbytes, last_access, now, need, eps, mask, use_mask) -> np.ndarray:
    st = _staleness_np(last_access, now)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scores = costs / (nbytes * (st + eps))
        h = costs / (st + eps)
    ok = (nbytes > 0) & (scores < np.inf)          # NaN < inf is False: NaN scores are not eligible
    if use_mask:
        ok &= mask
    idx = np.flatnonzero(ok)
    if idx.size == 0:
        return np.empty(0, np.int64)
    best = idx[np.argmin(scores[idx])]
    if nbytes[best] >= need:
        return np.array([best], np.int64)
    order = idx[np.argsort(scores[idx], kind="mergesort")]
    cum = np.cumsum(nbytes[order])
    if cum[-1] < need:
        return order.astype(np.int64)
    k = int(np.searchsorted(cum, need)) + 1          # first prefix whose bytes reach `need`
    picks = order[:k]
    single_idx = idx[nbytes[idx] >= need]
    if k > 1 and single_idx.size:
        single = single_idx[np.argmin(h[single_idx])]
        if h[single] <= np.cumsum(h[picks])[-1]:     # cumsum: sequential like the kernel, not pairwise
            return np.array([single], np.int64)
    return picks.astype(np.int64)


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------

def backend() -> str:
    """"numba" when the compiled kernels run, "numpy" otherwise (resolves, i.e. compiles, on first use)."""
    return "numba" if _SELECT.compiled() is not None else "numpy"


def __getattr__(name: str) -> Any:
    # BACKEND is computed on first access so that importing this module compiles nothing
    if name == "BACKEND":
        return backend()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _as(a: Any, dtype: Any, n: int | None, what: str) -> np.ndarray:
    arr = np.ascontiguousarray(a, dtype=dtype)
    if arr.ndim != 1 or (n is not None and arr.shape[0] != n):
        raise ValueError(f"{what}: expected a 1-D array of length {n}, got shape {arr.shape}")
    return arr


def score(costs: np.ndarray, nbytes: np.ndarray, last_access: np.ndarray, now: float,
          eps: float = EPS) -> np.ndarray:
    """``cost / (bytes * (max(now - last_access, 0) + eps))`` per candidate (float64; lower evicts first)."""
    costs = _as(costs, np.float64, None, "costs")
    n = costs.shape[0]
    nbytes, last_access = _as(nbytes, np.int64, n, "nbytes"), _as(last_access, np.float64, n, "last_access")
    kernel = _SCORE.compiled()
    if kernel is None:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return costs / (nbytes * (_staleness_np(last_access, float(now)) + eps))
    out = np.empty(n)
    kernel(costs, nbytes, last_access, float(now), float(eps), out)
    return out


def select_victims(costs: np.ndarray, nbytes: np.ndarray, last_access: np.ndarray, now: float, need: int,
                   evictable: np.ndarray | None = None, eps: float = EPS, jit: bool = True) -> np.ndarray:
    """Indices of candidates to evict, in order, until their bytes cover ``need`` (int64; may be empty).

    Greedy by ascending :func:`score` (ties: lowest index), except that when one candidate covers
    ``need`` alone for no more ``cost / staleness`` than the whole greedy set, that one is returned.
    Eligible: ``evictable`` (all when ``None``), ``nbytes > 0`` and a finite score (NaN or infinite
    costs, NaN clocks are skipped). If the eligible bytes cannot cover ``need``, all eligible
    candidates come back, lowest score first: the caller compares their sum with ``need``.
    Cost: O(n) for up to 8 victims (the usual case), O(n log n) beyond. ``jit=False``: the numpy mirror
    (the same victims, without the kernel's compile on first use: for callers that run it a few times).
    """
    costs = _as(costs, np.float64, None, "costs")
    n = costs.shape[0]
    nbytes, last_access = _as(nbytes, np.int64, n, "nbytes"), _as(last_access, np.float64, n, "last_access")
    need = int(need)
    if need <= 0 or n == 0:
        return np.empty(0, np.int64)
    use_mask = evictable is not None
    mask = _as(evictable, np.bool_, n, "evictable") if use_mask else _NO_MASK
    kernel = _SELECT.compiled() if jit else None
    if kernel is None:
        return _select_numpy(costs, nbytes, last_access, float(now), need, float(eps), mask, use_mask)
    out = np.empty(_GREEDY_ROUNDS, np.int64)
    k = kernel(costs, nbytes, last_access, float(now), need, float(eps), mask, use_mask, out)
    if k < 0:  # many victims: O(n log n) either way, numpy's sort is as fast and keeps the kernel small
        return _select_numpy(costs, nbytes, last_access, float(now), need, float(eps), mask, use_mask)
    return out[:k]


_NO_MASK = np.ones(0, np.bool_)
