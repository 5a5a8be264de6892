"""The LP relaxation of the STR MILP (:mod:`solvers.milp` with ``relax=True``): its values, in the shape the
source-tracing rounding (:mod:`solvers.relax`) reads them, and a solve that runs beside the caller.

:func:`solve` builds and solves the relaxation in-process. :class:`Background` does the same in a forked
child process while the parent goes on (the ``approx`` portfolio plans its heuristic starts meanwhile):
CBC holds the GIL while it solves, so a thread would not overlap; a child does, on a second core. A child
that does not report by its deadline is stopped and the LP counts as not solved.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any

from . import milp
from ._common import Problem

KILL_GRACE_S = 1.0         # past its deadline, before a child still solving is stopped


@dataclass
class LPValues:
    S: dict[tuple[int, int], float]
    R: dict[tuple[int, int], float]
    P_by_k: dict[int, dict[int, float]]
    Y_by_k: dict[int, dict[tuple[int, int, int], float]]


@dataclass
class Solved:
    """An LP solve: the solver's result (``schedule`` is always None) and, when optimal, its values."""
    result: milp.SolveResult
    values: LPValues | None


def lp_values(sm: Any) -> LPValues:
    def v(x: Any) -> float:
        return float(x.x or 0.0)
    P_by_k: dict[int, dict[int, float]] = {}
    for (t, _, k), x in sm.P.items():
        d = P_by_k.setdefault(k, {})
        d[t] = d.get(t, 0.0) + v(x)
    Y_by_k: dict[int, dict[tuple[int, int, int], float]] = {}
    for key, x in sm.Y.items():
        val = v(x)
        if val > 1e-6:
            Y_by_k.setdefault(key[2], {})[key] = val
    return LPValues({kk: v(x) for kk, x in sm.S.items()}, {kk: v(x) for kk, x in sm.R.items()}, P_by_k, Y_by_k)


def solve(p: Problem, time_limit: float | None = None, verbose: bool = False, **model_options: Any) -> Solved:
    """Build and solve the relaxation of ``p`` (``model_options`` go to :func:`solvers.milp.build_model`)."""
    sm = milp.build_model(p, relax=True, verbose=verbose, **model_options)
    res = milp.solve(sm, relax=True, time_limit=time_limit)
    ok = res.objective is not None and res.status == "optimal"
    return Solved(res, lp_values(sm) if ok else None)


class Background:
    """:func:`solve` started now in a forked child; :meth:`result` waits for it (in-process where ``fork``
    is unavailable: then the solve runs when the result is asked for)."""

    def __init__(self, p: Problem, time_limit: float | None = None, **model_options: Any):
        self.p, self.time_limit, self.options = p, time_limit, model_options
        self.t0 = time.monotonic()
        self._done: Solved | None = None
        self._proc: Any = None
        if "fork" not in mp.get_all_start_methods():
            return
        ctx = mp.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(send, p, time_limit, model_options), daemon=True)
        self._proc.start()
        send.close()

    def result(self) -> Solved:
        if self._done is not None:
            return self._done
        if self._proc is None:
            self._done = solve(self.p, self.time_limit, **self.options)
            return self._done
        wait = None if self.time_limit is None else self.t0 + self.time_limit + KILL_GRACE_S - time.monotonic()
        got: Solved | None = None
        try:
            if self._recv.poll(None if wait is None else max(wait, 0.0)):
                got = self._recv.recv()
        except (EOFError, OSError):
            got = None                       # the child died without a result
        finally:
            self.close()
        self._done = got if got is not None else Solved(
            milp.SolveResult(milp.TIME_LIMIT_STATUS if self.time_limit is not None else "crashed",
                             None, None, None, time.monotonic() - self.t0, None, 0, 0, 0.0), None)
        return self._done

    def close(self) -> None:
        """Stop the child if it still runs (a caller that no longer needs the LP)."""
        if self._proc is None:
            return
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(timeout=1.0)
        self._recv.close()
        self._proc = None
        if self._done is None:
            self._done = Solved(milp.SolveResult("stopped", None, None, None, 0.0, None, 0, 0, 0.0), None)


def _child(conn: Any, p: Problem, time_limit: float | None, model_options: dict[str, Any]) -> None:
    try:
        conn.send(solve(p, time_limit, **model_options))
    except BaseException as e:       # report, never hang the parent
        conn.send(Solved(milp.SolveResult(f"error: {type(e).__name__}: {e}", None, None, None, 0.0, None, 0, 0, 0.0),
                         None))
    finally:
        conn.close()
