"""A tiny progress bar for long benchmark work (plan sweeps, measured runs).

It draws on stderr and only when a person is watching: both stdout and stderr must be terminals, so
``hybridmem bench > log.txt``, CI logs and pytest capture stay clean. ``HYBRIDMEM_PROGRESS=1`` forces it
on, ``=0`` off, ``=log`` writes one plain line per :meth:`Progress.note` instead (for background runs
whose stderr goes to a file). No dependency (tqdm is not one of ours)::

    with Progress(total=len(jobs), label="plans") as bar:
        for job in jobs:
            bar.note(job.name)
            run(job)
            bar.update()
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Iterable, Iterator, TypeVar

T = TypeVar("T")


def progress_enabled(stream: IO[str] | None = None) -> bool:
    """Whether bars are drawn: the environment override, else both output streams are terminals."""
    env = os.environ.get("HYBRIDMEM_PROGRESS", "").strip().lower()
    if env == "log":
        return False
    if env in ("0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    stream = stream or sys.stderr
    return _isatty(sys.stdout) and _isatty(stream)


def _isatty(s: object) -> bool:
    try:
        return bool(s.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


@dataclass
class Progress:
    """One bar: ``[#####.....] 5/10 label  note  12s, ~12s left``. Redraws at most 10 times a second."""

    total: int
    label: str = ""
    stream: IO[str] | None = None
    width: int = 24
    enabled: bool | None = None
    done: int = 0
    _note: str = ""
    _start: float = field(default_factory=time.perf_counter)
    _last_draw: float = 0.0

    def __post_init__(self) -> None:
        self.stream = self.stream or sys.stderr
        self._log = self.enabled is None and os.environ.get("HYBRIDMEM_PROGRESS", "").strip().lower() == "log"
        if self.enabled is None:
            self.enabled = progress_enabled(self.stream)

    def __enter__(self) -> "Progress":
        self._draw(force=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def note(self, text: str) -> None:
        """Say what is being worked on now (shown after the count)."""
        self._note = text
        if self._log:
            elapsed = time.perf_counter() - self._start
            self.stream.write(f"[{self.done}/{self.total} {self.label}] {text}  {_secs(elapsed)}\n")  # type: ignore[union-attr]
            self.stream.flush()  # type: ignore[union-attr]
        self._draw(force=True)

    def update(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n) if self.total else self.done + n
        self._draw()

    def close(self) -> None:
        if self.enabled:
            self._draw(force=True)
            self.stream.write("\n")  # type: ignore[union-attr]
            self.stream.flush()  # type: ignore[union-attr]
            self.enabled = False  # closing twice draws nothing

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last_draw < 0.1 and self.done < self.total:
            return
        self._last_draw = now
        elapsed = now - self._start
        frac = self.done / self.total if self.total else 0.0
        filled = int(round(frac * self.width))
        eta = f", ~{_secs(elapsed / frac - elapsed)} left" if 0 < frac < 1 else ""
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {self.label}"
                f"  {self._note[:40]}  {_secs(elapsed)}{eta}")
        cols = _columns()
        self.stream.write("\r" + line[: cols - 1].ljust(cols - 1))  # type: ignore[union-attr]
        self.stream.flush()  # type: ignore[union-attr]


def track(items: Iterable[T], label: str = "", total: int | None = None) -> Iterator[T]:
    """Iterate ``items`` with a bar (``total`` defaults to ``len(items)``)."""
    seq = list(items) if total is None and not hasattr(items, "__len__") else items
    n = total if total is not None else len(seq)  # type: ignore[arg-type]
    with Progress(n, label) as bar:
        for item in seq:
            yield item
            bar.update()


def _secs(s: float) -> str:
    s = max(0.0, s)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.1f}min"


def _columns() -> int:
    try:
        return max(40, os.get_terminal_size(sys.stderr.fileno()).columns)
    except (OSError, ValueError, AttributeError):
        return 100
