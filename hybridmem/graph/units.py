"""Byte sizes: parse ``512MiB`` / ``8GB`` / ``1.5e9`` / ``60%`` and print them back."""
from __future__ import annotations

import math
import os
import re

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")

ACCEPTED = ("an int of bytes", "a string like '512MiB', '8GB', '8GiB', '1.5e9'",
            "a percentage like '60%' (of device memory, or of the keep-all peak for plans)")


def _reject(value: object, what: str) -> ValueError:
    return ValueError(f"invalid {what} {value!r}: expected {', '.join(ACCEPTED)}")


def parse_bytes(value: int | float | str, *, what: str = "size", total: int | None = None) -> int:
    """Return ``value`` in bytes.

    ``total`` is what a percentage is relative to; without it a percentage is an error.
    Negative, non-finite and non-numeric values raise ``ValueError`` naming the accepted forms.
    """
    if isinstance(value, bool):
        raise _reject(value, what)
    if isinstance(value, int):
        if value < 0:
            raise _reject(value, what)
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise _reject(value, what)
        return int(value)
    if not isinstance(value, str):
        raise _reject(value, what)
    if m := _PERCENT.match(value):
        if total is None:
            raise ValueError(f"invalid {what} {value!r}: a percentage needs a reference size "
                             "(device memory on CUDA, or the keep-all peak for a plan)")
        return int(float(m.group(1)) / 100.0 * total)
    m = _SIZE.match(value)
    if not m or m.group(2).lower() not in _UNITS:
        raise _reject(value, what)
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(n):
        raise _reject(value, what)
    return int(n)


BUDGET_FORMS = ("a positive int of bytes", "a string like '512MiB', '8GB', '8GiB', '1.5e9'",
                "on CUDA a percentage of device memory in (0, 100] like '60%'", "'none' to only measure")


def parse_budget(value: object, *, total: int | None = None, forms: tuple[str, ...] = BUDGET_FORMS) -> int | str:
    """A runtime budget: a positive whole number of bytes (an int or a size string), or on CUDA a
    percentage in (0, 100], returned as is without ``total`` (the device's memory) and in bytes with it.
    Floats are refused: a budget is counted in whole bytes, and ``3.5`` is more likely a typo for
    ``"3.5GiB"`` than a budget. Capacity is checked where the device is known (:func:`check_capacity`).
    ``forms``: the accepted forms the error lists (the caller's, where it takes fewer)."""
    def reject(why: str) -> ValueError:
        return ValueError(f"invalid budget {value!r} ({why}): expected {', '.join(forms)}")

    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise reject(f"a {type(value).__name__}")
    if isinstance(value, str) and (m := _PERCENT.match(value)):
        if not 0 < float(m.group(1)) <= 100:
            raise reject("a percentage must be in (0, 100]")
        return value if total is None else max(1, parse_bytes(value, what="budget", total=total))
    if isinstance(value, str) and (m := _SIZE.match(value)) and m.group(2).lower() in ("", "b") \
            and not float(m.group(1)).is_integer():
        raise reject("not a whole number of bytes")
    try:
        n = parse_bytes(value, what="budget")
    except ValueError:
        raise reject("not a size") from None
    if n <= 0:
        raise reject("not positive")
    return n


def check_capacity(budget: int, capacity: int, of: str, given: object) -> int:
    """``budget`` (``given`` by the user) if ``capacity`` (the memory of ``of``) can hold it, else a
    ValueError naming both."""
    if budget > capacity:
        shown = repr(given) if isinstance(given, str) else f"{budget} bytes" if budget < 2**64 else \
            f"{float(budget):.4g} bytes"
        raise ValueError(f"invalid budget {shown}: more than the {of}'s memory ({fmt_bytes(capacity)}, "
                         f"{capacity} bytes); expected {', '.join(BUDGET_FORMS)}, at most that")
    return budget


def plan_budget_bytes(budget: object, keep_all_peak: int) -> int:
    """A budget when planning or simulating, in bytes: an int, a size string (``"8GiB"``), or a
    percentage of the step's keep-all peak (``"60%"``: of ``graph.peak_bytes()``, nothing evicted).
    The one place that percentage is resolved; at run time a percentage means something else
    (:func:`hybridmem.devices.device_budget_bytes`: of the CUDA device's memory)."""
    return parse_bytes(budget, what="budget", total=keep_all_peak if is_percentage(budget) else None)


def host_memory() -> int | None:
    """Physical memory of this machine in bytes (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def is_percentage(value: object) -> bool:
    return isinstance(value, str) and bool(_PERCENT.match(value))


def fmt_bytes(n: float) -> str:
    """Human-readable binary size: ``1.50 GiB``."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
