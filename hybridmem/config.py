"""Config: one place that reads settings from keyword arguments, ``HYBRIDMEM_*`` variables and YAML.

Precedence (highest first): keyword arguments, environment variables, the YAML file
(``config=`` or ``HYBRIDMEM_CONFIG``), defaults. Unknown keys and bad values are errors.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from .units import parse_bytes

DEFAULT_POLICIES = ("swap", "recompute", "compress")

# environment variable -> Config field
ENV_VARS = {
    "HYBRIDMEM_BUDGET": "budget",
    "HYBRIDMEM_POLICIES": "policies",
    "HYBRIDMEM_PLAN": "plan",
    "HYBRIDMEM_DEVICE": "device",
    "HYBRIDMEM_LOSSY": "lossy",
    "HYBRIDMEM_VERBOSE": "verbose",
    "HYBRIDMEM_MONITOR": "monitor",
}

MONITORS = ("auto", "allocator", "ops")


@dataclass
class Config:
    """Runtime settings. ``budget=None`` means monitor only (measure, never evict)."""

    budget: int | str | None = None      # bytes, '8GiB', or on CUDA '60%'
    policies: tuple[str, ...] = DEFAULT_POLICIES
    plan: str | None = None              # path of a plan file (or a directory of per-shape plans)
    device: str | None = None            # 'cpu' (simulated device) or 'cuda[:i]'; None = auto
    lossy: tuple[str, ...] = ()          # lossy codecs allowed for compress (e.g. 'bf16'); none by default
    verbose: bool = False
    # Without a budget or plan, what measures: "allocator" (the allocator's own counters: CUDA's
    # statistics, or on the CPU hybridmem.cpumeter; nothing per op), "ops" (every op through a dispatch
    # mode: the cap's units, stages, min_budget_bytes), "auto" (CPU: allocator where the native meter
    # builds, else ops; CUDA: ops).
    monitor: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)  # plugin-specific settings (YAML 'plugins:' section)

    def budget_bytes(self, device_total: int | None = None) -> int | None:
        if self.budget is None:
            return None
        return parse_bytes(self.budget, what="budget", total=device_total)

    @classmethod
    def resolve(cls, config: "str | Path | Mapping[str, Any] | Config | None" = None,
                env: Mapping[str, str] | None = None, **kwargs: Any) -> "Config":
        """Merge defaults < YAML < environment < keyword arguments (``None`` kwargs are ignored)."""
        env = os.environ if env is None else env
        base = cls()
        source = config if config is not None else env.get("HYBRIDMEM_CONFIG")
        if isinstance(source, Config):
            base = source
        elif source is not None:
            base = _apply(base, _read_yaml(source) if isinstance(source, (str, Path)) else dict(source),
                          where=str(source) if isinstance(source, (str, Path)) else "config")
        from_env = {f: env[v] for v, f in ENV_VARS.items() if env.get(v) not in (None, "")}
        base = _apply(base, from_env, where="environment")
        return _apply(base, {k: v for k, v in kwargs.items() if v is not None}, where="arguments")


def _read_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a mapping of settings, got {type(data).__name__}")
    return data


def _as_names(value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v for v in (p.strip() for p in value.split(",")) if v]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} must be a list of names or a comma-separated string, got {value!r}")
    return tuple(value)


def _apply(cfg: Config, values: Mapping[str, Any], *, where: str) -> Config:
    if "plugins" in values:  # the YAML/mapping spelling of ``extra`` (plugin-specific settings)
        if "extra" in values:
            raise ValueError(f"both 'plugins' and 'extra' in {where}: they are one setting, give it once")
        values = {("extra" if k == "plugins" else k): v for k, v in values.items()}
    known = {f.name for f in fields(Config)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown} in {where}; accepted: {sorted(known)}")
    out = dict(values)
    if "policies" in out:
        out["policies"] = _as_names(out["policies"], "policies")
        if not out["policies"] and out.get("budget", cfg.budget) is not None:
            raise ValueError("policies is empty: name at least one of swap, recompute, compress")
    if "lossy" in out:
        out["lossy"] = _as_names(out["lossy"], "lossy")
    if "verbose" in out and isinstance(out["verbose"], str):
        out["verbose"] = out["verbose"].strip().lower() in ("1", "true", "yes", "on")
    if "budget" in out and out["budget"] is not None:
        b = out["budget"]
        if isinstance(b, str) and b.strip().lower() in ("none", "off", "monitor"):
            out["budget"] = None
        elif not (isinstance(b, str) and b.strip().endswith("%")):
            out["budget"] = parse_bytes(b, what="budget")  # validate early, percentages need the device
    if "monitor" in out:
        m = out["monitor"]
        if not isinstance(m, str) or m.strip().lower() not in MONITORS:
            raise ValueError(f"monitor must be one of {', '.join(MONITORS)}, got {m!r}")
        out["monitor"] = m.strip().lower()
    if "extra" in out and not isinstance(out["extra"], dict):
        raise ValueError(f"plugins/extra must be a mapping, got {type(out['extra']).__name__}")
    return replace(cfg, **out)
