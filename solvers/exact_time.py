"""The simulator's clock inside the MILP (``link="exact"``, small uncoarsened problems).

The other link models time copies on the compute clock *without* stalls or recomputes, which is safe
(those only stretch the compute stream, so copies end no later than modelled) but blind to what they
buy: a stall at op ``t`` waiting on a swap-in also lets a swap-out that was still in flight end, so
the bytes of a tensor freed behind that copy (released only when it ends) are gone at op ``t``'s
memory check. Plans at the tightest budgets rely on that.

Here every instant the simulator computes is a variable in microseconds, equal to it, not just bounded:

    a[t]    start of stage t (a[0] = 0, a[t+1] = z[t] + op[t])
    w       the instant each replay before op t (in producer order) checks memory: after the previous
            replay and the swap-ins of its sources landing at t; the replay ends at w + its cost
    z[t]    op t starts: max(clock after the replays, arrival of each swap-in op t reads first at t)
    H_j     the H2D stream free after swap-in option j (FIFO in issue order; the copy begins at
            max(a[q], stream free, end of the tensor's swap-out)); the option's arrival
    G_i     the D2H stream free after swap-out option i (begins at max(a[t+1], stream free))
    Eo[k]   end of candidate k's swap-out

Each is the *maximum* of its terms (:func:`exact_max`: one selector binary per term), because a
variable only bounded below could be raised at will: the model would then buy memory with a stall the
simulator never makes. A term may be conditional on decisions (a copy that is issued, a replay that
runs); an absent term neither bounds nor can be selected.

Memory. A free (or the natural end) of a tensor whose swap-out is in flight releases its bytes when
the copy ends. Every such release behind candidate k's swap-out happens at ``Eo[k]``, so stage s still
holds one ghost copy per present -> absent transition since the swap-out unless ``Eo[k] <= a[s]``
(the stage's first memory check), ``<= w`` (a replay's) or ``<= z[s]`` (the op's). Binaries ``e`` say
a release is credited at a check; they can be 1 only when the copy has ended by then. Ghosts count in
the row of each check: the stage's start (before the op's outputs and workspace), each replay that
runs, and the op.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mip import BINARY, CONTINUOUS, xsum

from ._common import Problem

ROW_SCALE = 1e3            # ghost rows scaled up: CBC keeps rows to ~1e-6 whatever tolerance it is given, and
                           # 1e-6 of a ghost copy of a 10 MB tensor is 10 bytes over the budget
RELEASE_MARGIN = 1e-4      # microseconds: a release is credited only if the copy ended this much before
                           # the check (the simulator compares exactly; the solver's tolerances do not)


@dataclass
class Replay:
    """One replay before op ``t`` (of producer ``pid``, serving candidates ``ks``): its decision ``v``,
    the instant of its memory check ``w`` (after waiting for its sources) and the ghosts then."""

    t: int
    pid: int
    v: Any
    ks: list[int]
    w: Any
    ghosts: list[tuple[int, Any]] = field(default_factory=list)


@dataclass
class Clock:
    """The timing variables of one exact model (microseconds)."""

    z: dict[int, Any] = field(default_factory=dict)              # op start per stage
    a: list[Any] = field(default_factory=list)                   # stage start (expressions), length T + 1
    arrival: dict[tuple[int, int, int], Any] = field(default_factory=dict)   # swap-in option -> H_j
    swap_out_end: dict[int, Any] = field(default_factory=dict)   # candidate -> Eo[k]
    end: Any = None                                              # the step: all streams idle
    ghost_pre: dict[int, list[tuple[int, Any]]] = field(default_factory=dict)   # stage -> [(k, gp)]
    ghost_op: dict[int, list[tuple[int, Any]]] = field(default_factory=dict)    # stage -> [(k, go)]
    replays: dict[int, list[Replay]] = field(default_factory=dict)              # stage -> in run order


def exact_max(m: Any, target: Any, terms: list[tuple[Any, list[Any]]], big: float, name: str) -> None:
    """Constrain ``target`` to equal the largest of the present ``terms`` (``(expression, conditions)``;
    a term is present when all its binary conditions are 1; at least one term has none)."""
    if len(terms) == 1:
        m += target == terms[0][0], name
        return
    sel = []
    for i, (e, conds) in enumerate(terms):
        m += target >= e - big * (len(conds) - xsum(conds)) if conds else target >= e, f"{name}_ge{i}"
        w = m.add_var(f"{name}_w{i}", var_type=BINARY)
        for j, c in enumerate(conds):
            m += w <= c, f"{name}_w{i}_{j}"
        m += target <= e + big * (1 - w), f"{name}_le{i}"
        sel.append(w)
    m += xsum(sel) == 1, f"{name}_one"


def horizon_us(p: Problem, n_in: int, unit: float) -> float:
    """An upper bound on every instant of the step: compute, every possible replay and every copy."""
    C = p.candidates
    s = float(p.cum[-1]) + sum(c.recompute_s * (c.end - c.start) + c.d2h_s + c.h2d_s * n_in for c in C)
    return s / unit * 1.01 + 1.0


def add_clock(sm: Any, present: Any, unit: float) -> Clock:
    """Add the clock, the copies' FIFO streams, the release credits and the ghost bytes to ``sm``'s model.

    ``sm.P`` keys are ``(t, t, k)`` (one swap-out option per issue stage), ``sm.Y`` keys ``(q, u, k)``
    with ``u`` the first stage reading the copy; ``present(t, k)`` is the model's presence expression.
    """
    m, p = sm.m, sm.problem
    C, T = p.candidates, p.T
    op = [float(x) / unit for x in p.op_s]
    n_in = max((sum(1 for key in sm.Y if key[2] == k) for k in range(len(C))), default=0)
    big = horizon_us(p, max(n_in, 1), unit)
    clk = Clock()

    def var(name: str) -> Any:
        return m.add_var(name, var_type=CONTINUOUS, lb=0.0, ub=big)

    outs: dict[int, list[tuple[int, Any]]] = {}          # issue stage -> [(k, v)] in candidate order
    for (t, _, k), v in sorted(sm.P.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        outs.setdefault(t, []).append((k, v))
    ins: dict[int, list[tuple[tuple[int, int, int], Any]]] = {}
    for key, y in sorted(sm.Y.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        ins.setdefault(key[0], []).append((key, y))
    for k in {k for (_, _, k) in sm.P}:
        clk.swap_out_end[k] = var(f"Eo_{k}")

    # replay units per stage, in the simulator's order (the plan lists recomputes by producer)
    units: dict[int, list[tuple[int, Any, float, set[int], list[int]]]] = {}
    for (t, pid), x in sm.X.items():
        ks = [k for k in range(len(C)) if p.producers(k)[0] == pid and (t, k) in sm.R]
        src = {p.index[j] for k in ks for j in C[k].src if j in p.index} - set(ks)
        units.setdefault(t, []).append((pid, x, C[ks[0]].recompute_s, src, ks))
    for (t, k), r in sm.R.items():
        if (t, p.producers(k)[0]) in sm.X:
            continue
        src = {p.index[j] for j in C[k].src if j in p.index} - {k}
        units.setdefault(t, []).append((p.producers(k)[0], r, C[k].recompute_s, src, [k]))
    op_reads = [set() for _ in range(T)]
    for k, c in enumerate(C):
        for u in c.uses:
            op_reads[u].add(k)

    a: Any = 0.0
    h2d_free: Any = 0.0
    d2h_free: Any = 0.0
    for t in range(T):
        clk.a.append(a)
        # swap-ins issued at the start of t, FIFO behind everything issued before
        for key, y in ins.get(t, ()):
            q, u, k = key
            h = C[k].h2d_s / unit
            nxt = var(f"H_{q}_{u}_{k}")
            exact_max(m, nxt, [(h2d_free, []), (a + h, [y]), (h2d_free + h, [y]),
                               (clk.swap_out_end[k] + h, [y])], big, f"h2d_{q}_{u}_{k}")
            clk.arrival[key] = h2d_free = nxt
        landing = [(key, y) for key, y in sm.Y.items() if key[1] == t]
        # replays before op t, each after the swap-ins of its sources that land now
        c_: Any = a
        for pid, v, cost, src, ks in sorted(units.get(t, ()), key=lambda u_: u_[0]):
            waits = [(clk.arrival[key], [v, y]) for key, y in landing if key[2] in src]
            if waits:
                w = var(f"w_{t}_{pid}")
                exact_max(m, w, [(c_, []), *waits], big, f"replay_clock_{t}_{pid}")
            else:
                w = c_
            clk.replays.setdefault(t, []).append(Replay(t, pid, v, ks, w))
            c_ = w + cost / unit * v
        # op t waits for the swap-ins it reads first here
        z = var(f"z_{t}")
        exact_max(m, z, [(c_, []), *[(clk.arrival[key], [y]) for key, y in landing if key[2] in op_reads[t]]],
                  big, f"op_clock_{t}")
        clk.z[t] = z
        a = z + op[t]
        # swap-outs issued after op t, FIFO behind the earlier ones
        for k, v in outs.get(t, ()):
            d = C[k].d2h_s / unit
            nxt = var(f"G_{t}_{k}")
            exact_max(m, nxt, [(d2h_free, []), (a + d, [v]), (d2h_free + d, [v])], big, f"d2h_{t}_{k}")
            eo = clk.swap_out_end[k]
            m += eo >= nxt - big * (1 - v), f"out_end_ge_{t}_{k}"
            m += eo <= nxt + big * (1 - v), f"out_end_le_{t}_{k}"
            d2h_free = nxt
    clk.a.append(a)
    clk.end = var("step_end")
    for i, e in enumerate((a, h2d_free, d2h_free)):
        m += clk.end >= e, f"step_end_{i}"

    # ghost copies: frees behind an unfinished swap-out, released when it ends
    by_k: dict[int, list[tuple[int, Any]]] = {}
    for (t, _, k), v in sm.P.items():
        by_k.setdefault(k, []).append((t, v))
    for k, opts in by_k.items():
        c = C[k]
        t0 = min(t for t, _ in opts)
        drop = {}
        for r in range(t0, c.end):
            drop[r] = var(f"drop_{r}_{k}")
            m += ROW_SCALE * drop[r] >= ROW_SCALE * (present(r, k) - present(r + 1, k)), f"drop_{r}_{k}"
        eo = clk.swap_out_end[k]
        for s in range(t0 + 1, c.end + 1):
            checks = [("pre", clk.a[s], None, clk.ghost_pre.setdefault(s, [])),
                      ("op", clk.z[s], None, clk.ghost_op.setdefault(s, []))]
            checks += [(f"replay{rp.pid}", rp.w, rp.v, rp.ghosts) for rp in clk.replays.get(s, ())]
            for tag, instant, runs, rows in checks:
                e = m.add_var(f"credit_{tag}_{s}_{k}", var_type=BINARY)
                m += eo <= instant - RELEASE_MARGIN + big * (1 - e), f"credit_{tag}_{s}_{k}"
                g = var(f"ghost_{tag}_{s}_{k}")
                for t, v in opts:
                    if t < s:
                        n = s - t
                        gone = n * (1 - v) + n * e + (n * (1 - runs) if runs is not None else 0)
                        m += ROW_SCALE * g >= ROW_SCALE * (xsum(drop[r] for r in range(t, s)) - gone), \
                            f"ghost_{tag}_{s}_{t}_{k}"
                rows.append((k, g))
    return clk


def replay_bytes(p: Problem, ks: list[int], t: int) -> int:
    """What a replay before op ``t`` serving candidates ``ks`` adds while it runs, as the simulator
    counts it: every output of the replayed stages (the candidates' own included) and the largest
    workspace among them."""
    g = p.graph
    writers = g.writers()
    order = sorted({r for k in ks for x in (p.candidates[k].members or (p.candidates[k].tensor,))
                    for r in g.replay_stages(x, t, writers=writers)})
    outs = {y for r in order for y in g.stages[r].outputs}
    return int(sum(g.tensors[y].nbytes for y in outs) + max(g.stages[r].workspace for r in order))
