"""Progress bars for long benchmark work (plan sweeps, measured runs), drawn by tqdm.

A bar appears only when a person is watching: both stdout and stderr must be terminals, so
``hybridmem bench > log.txt``, CI logs and pytest capture stay clean. ``HYBRIDMEM_PROGRESS=1`` forces it
on, ``=0`` off, ``=log`` writes one plain line per :meth:`Progress.note` instead (for background runs
whose stderr goes to a file)::

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
from typing import IO

from tqdm import tqdm

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _mode() -> str:
    """``HYBRIDMEM_PROGRESS`` as one of ``on``, ``off``, ``log`` or ``auto`` (unset or unrecognised)."""
    env = os.environ.get("HYBRIDMEM_PROGRESS", "").strip().lower()
    return "log" if env == "log" else "on" if env in _ON else "off" if env in _OFF else "auto"


def progress_enabled(stream: IO[str] | None = None) -> bool:
    """Whether bars are drawn: the environment override, else both output streams are terminals."""
    mode = _mode()
    if mode != "auto":
        return mode == "on"
    return _isatty(sys.stdout) and _isatty(stream or sys.stderr)


def _isatty(s: object) -> bool:
    try:
        return bool(s.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


class Progress:
    """One bar (``plans resnet50 h100-80gb: 40%|####      | 4/10 [00:12<00:18] capuchin``), or one log
    line per :meth:`note` under ``HYBRIDMEM_PROGRESS=log``, or nothing."""

    def __init__(self, total: int, label: str = "", stream: IO[str] | None = None,
                 enabled: bool | None = None) -> None:
        self.total, self.label, self.done = total, label, 0
        self.stream = stream or sys.stderr
        self._log = enabled is None and _mode() == "log"
        self._start = time.perf_counter()
        draw = progress_enabled(self.stream) if enabled is None else enabled
        # mininterval: redraw at most 10 times a second; dynamic_ncols: follow the terminal's width
        self._bar = tqdm(total=total, desc=label, file=self.stream, mininterval=0.1, dynamic_ncols=True,
                         leave=True) if draw else None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def note(self, text: str) -> None:
        """Say what is being worked on now (shown after the count)."""
        if self._log:
            elapsed = time.perf_counter() - self._start
            self.stream.write(f"[{self.done}/{self.total} {self.label}] {text}  {elapsed:.0f}s\n")
            self.stream.flush()
        if self._bar is not None:
            self._bar.set_postfix_str(text[:40])

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None  # closing twice draws nothing
