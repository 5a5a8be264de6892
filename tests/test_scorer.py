"""Online scorer: Numba and numpy agree, lowest score first, `need` covered, mask respected, guards hold."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hybridmem.runtime import scorer
from hybridmem.runtime.scorer import EPS, _select_numpy, score, select_victims


def _numpy(costs, nbytes, last, now, need, mask=None):
    m = np.ones(0, np.bool_) if mask is None else np.asarray(mask, np.bool_)
    return _select_numpy(np.asarray(costs, np.float64), np.asarray(nbytes, np.int64),
                         np.asarray(last, np.float64), float(now), int(need), EPS, m, mask is not None)


def _case(seed: int, n: int = 500):
    rng = np.random.default_rng(seed)
    costs = rng.random(n) * 1e-3
    nbytes = rng.integers(0, 1 << 20, n)
    last = rng.random(n) * 10
    costs[rng.random(n) < 0.03] = np.nan
    costs[rng.random(n) < 0.03] = np.inf
    last[rng.random(n) < 0.02] = 20.0                 # "in the future": staleness clamps at eps
    costs[:20] = costs[20:40]                          # exact ties
    nbytes[:20], last[:20] = nbytes[20:40], last[20:40]
    mask = rng.random(n) < 0.8
    return costs, nbytes, last, mask


def test_backend_is_numba_here():
    assert scorer.BACKEND == "numba", scorer._SELECT.error


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("need", [1, 3 << 20, 12 << 20, 400 << 20, 10**15])
def test_numba_matches_numpy(seed, need):
    costs, nbytes, last, mask = _case(seed)
    for m in (None, mask):
        got = select_victims(costs, nbytes, last, 10.0, need, m)
        want = _numpy(costs, nbytes, last, 10.0, need, m)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(score(costs, nbytes, last, 10.0), _score_numpy(costs, nbytes, last, 10.0))


def _score_numpy(costs, nbytes, last, now):
    st = np.where(now - last < 0, 0.0, now - last)
    with np.errstate(all="ignore"):
        return costs / (nbytes * (st + EPS))


def test_lowest_score_first_and_need_covered():
    costs = np.array([4.0, 1.0, 2.0, 3.0])
    nbytes = np.array([10, 10, 10, 10])
    last = np.zeros(4)
    assert select_victims(costs, nbytes, last, 1.0, need=5).tolist() == [1]
    got = select_victims(costs, nbytes, last, 1.0, need=25)
    assert got.tolist() == [1, 2, 3] and nbytes[got].sum() >= 25


def test_staleness_and_bytes_enter_the_score():
    costs = np.array([1.0, 1.0, 1.0])
    # same cost: the stalest, then the biggest wins
    assert select_victims(costs, np.array([10, 10, 10]), np.array([5.0, 1.0, 3.0]), 6.0, 1).tolist() == [1]
    assert select_victims(costs, np.array([10, 40, 20]), np.zeros(3), 6.0, 1).tolist() == [1]


def test_evictable_mask_and_ineligible_candidates():
    costs = np.array([0.1, 0.2, np.nan, np.inf, 0.3, 0.4])
    nbytes = np.array([10, 10, 10, 10, 0, 10])
    mask = np.array([False, True, True, True, True, True])
    got = select_victims(costs, nbytes, np.zeros(6), 1.0, need=1000, evictable=mask)
    assert got.tolist() == [1, 5]                     # not 0 (masked), 2 (NaN), 3 (inf), 4 (no bytes)
    assert select_victims(costs, nbytes, np.zeros(6), 1.0, 5, np.zeros(6, bool)).size == 0


def test_uncoverable_need_returns_everything_eligible_in_order():
    costs = np.array([3.0, 1.0, 2.0])
    got = select_victims(costs, np.array([1, 1, 1]), np.zeros(3), 1.0, need=100)
    assert got.tolist() == [1, 2, 0]


def test_single_candidate_shortcut():
    # greedy would take the two cheap-per-byte small ones; one big one covers `need` for less total
    costs = np.array([1.0, 1.0, 1.5])
    nbytes = np.array([60, 60, 100])
    got = select_victims(costs, nbytes, np.zeros(3), 1.0, need=100)
    assert got.tolist() == [2]
    np.testing.assert_array_equal(got, _numpy(costs, nbytes, np.zeros(3), 1.0, 100))
    # ... but not when the big one costs more than the set
    costs[2] = 2.5
    assert select_victims(costs, nbytes, np.zeros(3), 1.0, need=100).tolist() == [0, 1]


def test_many_victims_switch_to_sorting():
    n = 1000
    costs = np.linspace(1.0, 2.0, n)[::-1].copy()
    nbytes = np.full(n, 10)
    got = select_victims(costs, nbytes, np.zeros(n), 1.0, need=10 * 50)
    assert got.tolist() == list(range(n - 1, n - 51, -1))


def test_empty_and_bad_inputs():
    assert select_victims(np.ones(3), np.ones(3, np.int64), np.zeros(3), 1.0, need=0).size == 0
    assert select_victims(np.ones(0), np.ones(0, np.int64), np.zeros(0), 1.0, need=5).size == 0
    with pytest.raises(ValueError, match="length 3"):
        select_victims(np.ones(3), np.ones(2, np.int64), np.zeros(3), 1.0, need=5)


_SUBPROCESS = textwrap.dedent("""
    import json, sys, numpy as np
    from hybridmem.runtime import scorer
    assert "numba" not in sys.modules, "importing the scorer must not import (or compile) anything"
    {prelude}
    rng = np.random.default_rng(7)
    c, b, la = rng.random(2000), rng.integers(1, 1 << 20, 2000), rng.random(2000) * 10
    res = {{str(need): scorer.select_victims(c, b, la, 10.0, need).tolist() for need in (5, 5 << 20, 10**9)}}
    print(json.dumps({{"backend": scorer.BACKEND, "cached": scorer._SELECT.cached, "res": res,
                      "error": scorer._SELECT.error}}))
""")


def _run(prelude: str, env: dict[str, str] | None = None) -> dict:
    code = _SUBPROCESS.format(prelude=prelude)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _expected() -> dict:
    rng = np.random.default_rng(7)
    c, b, la = rng.random(2000), rng.integers(1, 1 << 20, 2000), rng.random(2000) * 10
    return {str(need): select_victims(c, b, la, 10.0, need).tolist() for need in (5, 5 << 20, 10**9)}


def test_fallback_without_numba_gives_identical_results():
    got = _run("sys.modules['numba'] = None  # import numba now fails")
    assert got["backend"] == "numpy" and "import failed" in got["error"]
    assert got["res"] == _expected()


def test_unwritable_cache_falls_back_to_uncached_numba(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")                            # paths below a regular file: unwritable, even as root
    env = {"NUMBA_CACHE_DIR": str(blocker / "numba"), "HOME": str(blocker / "home"),
           "XDG_CACHE_HOME": str(blocker / "xdg"),
           # the package folder is writable here; leave it out of the search as if it were read-only
           "NUMBA_CACHE_LOCATOR_CLASSES": "UserProvidedCacheLocator,UserWideCacheLocator"}
    prelude = textwrap.dedent("""
        import numba
        try:
            numba.njit(cache=True)(lambda x: x)
            raise SystemExit("expected numba to refuse cache=True in this environment")
        except RuntimeError as e:
            assert "no locator available" in str(e), e
    """)
    got = _run(prelude, env)
    assert got["backend"] == "numba" and got["cached"] is False
    assert got["res"] == _expected()

