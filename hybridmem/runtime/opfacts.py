"""What the runtime needs to know about one op, computed once and cached by ``id(func)`` (hashing an
``OpOverload`` runs Python): read per op by the dispatch mode (:mod:`.dispatch_mode`) and the plan follower
(:mod:`.follow`)."""
from __future__ import annotations

from typing import Any, NamedTuple

from ..graph.ops import op_info
from .distributed import is_collective
from .lineage import replay_info

__all__ = ["OpFacts", "FACTS", "facts", "op_name"]


class OpFacts(NamedTuple):
    """What the mode needs to know about one op, computed once."""

    name: str
    stage: bool
    fresh: tuple[bool, ...]     # per return: a new storage
    any_fresh: bool
    writes: bool                # writes some argument in place
    maybe_rng: bool             # may draw random numbers (checked per call only then)
    collective: bool = False    # c10d / fsdp op (hybridmem.runtime.distributed.is_collective)
    may_resize: bool = False    # may resize a storage it writes (the meter re-reads its size)


FACTS: dict[int, OpFacts] = {}  # by id(func); per op read as ``FACTS.get(id(func)) or facts(func)``


def facts(func: Any) -> OpFacts:
    f = FACTS.get(id(func))
    if f is None:
        info = op_info(func)
        ri = replay_info(func)
        fresh = ri.fresh
        f = FACTS[id(func)] = OpFacts(info.name, info.stage, fresh, any(fresh),
                                      bool(ri.written or info.written_kw or info.bn_training >= 0),
                                      info.rng or info.dropout_arg >= 0, is_collective(func),
                                      info.may_resize)
    return f


def op_name(func: Any) -> str:
    """The op's name as its facts give it."""
    f = FACTS.get(id(func))
    return (f if f is not None else facts(func)).name
