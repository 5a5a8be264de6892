"""hybridmem's custom ops for compiled graphs: each module's set defined once per process in one
``hybridmem`` fragment library of its own (:mod:`.codec_ops`, :mod:`.offload_ops`), and the table of host
tokens both sets hand their graphs in a saved tensor's place (:class:`TokenTable`)."""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable, Generic, Sequence, TypeVar

import torch

__all__ = ["TokenTable", "define_once", "tensor_fake", "token_fake"]

_LOCK = threading.Lock()
# name -> its library object: it must outlive the process's use of the ops it defines
_LIBS: dict[str, torch.library.Library] = {}

T = TypeVar("T")


def define_once(name: str, define: Callable[[torch.library.Library], None]) -> None:
    """Run ``define(lib)`` on a new ``hybridmem`` fragment library the first time ``name`` is asked for;
    later calls (from any thread) return at once."""
    if name in _LIBS:
        return
    with _LOCK:
        if name in _LIBS:
            return
        lib = torch.library.Library("hybridmem", "FRAGMENT")
        define(lib)
        _LIBS[name] = lib


class TokenTable(Generic[T]):
    """What a graph holds for a saved tensor (an encoding, a host copy), named by one-element int64 host
    tokens. An item lives as long as a token names it: each token's storage carries a finalizer, and the
    item goes (``on_drop(item)``) with the last of them, so autograd frees it with the backward's other
    saved tensors. ``what`` names the item in the error for a token whose item was freed."""

    def __init__(self, what: str, on_drop: Callable[[T], None] | None = None) -> None:
        self.what, self.on_drop = what, on_drop
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._items: dict[int, T] = {}
        self._tokens: dict[int, int] = {}          # key -> tokens alive that name its item

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: T) -> torch.Tensor:
        """Hold ``item``; its first token."""
        key = next(self._keys)
        with self._lock:
            self._items[key] = item
        return self.token(key)

    def token(self, key: int) -> torch.Tensor:
        """Another token for ``key``'s item (it stays while either is alive)."""
        token = torch.full((1,), key, dtype=torch.int64)
        with self._lock:
            self._tokens[key] = self._tokens.get(key, 0) + 1
        weakref.finalize(token.untyped_storage(), self._drop, key)
        return token

    def get(self, token: torch.Tensor, op: str) -> tuple[int, T]:
        """The key and item ``token`` names; an error naming ``op`` where the item was freed already."""
        key = int(token.item())       # a host tensor: no device is waited for
        with self._lock:
            item = self._items.get(key)
        if item is None:
            raise RuntimeError(f"hybridmem::{op}: no {self.what} for token {key}: its forward's saved tensors were "
                               "freed already (a second backward through a graph without retain_graph=True?)")
        return key, item

    def _drop(self, key: int) -> None:
        with self._lock:
            self._tokens[key] -= 1
            if self._tokens[key]:
                return                  # another token of this item is alive
            del self._tokens[key]
            item = self._items.pop(key, None)
        if item is not None and self.on_drop is not None:
            self.on_drop(item)


def token_fake(x: torch.Tensor, *_: Any) -> torch.Tensor:
    """The fake value of an op that returns a token: one int64 on the host, whatever the device."""
    return x.new_empty((1,), dtype=torch.int64, device="cpu")


def tensor_fake(token: torch.Tensor, size: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
                device: torch.device, *_: Any) -> torch.Tensor:
    """The fake value of an op that rebuilds a saved tensor from its token and geometry."""
    return token.new_empty_strided(tuple(size), tuple(stride), dtype=dtype, device=device)
