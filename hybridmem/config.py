"""Config: one place that reads settings from keyword arguments, ``HYBRIDMEM_*`` variables and YAML.

Precedence (highest first): keyword arguments, environment variables, the YAML file
(``config=`` or ``HYBRIDMEM_CONFIG``), defaults. Unknown keys and bad values are errors.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

import yaml

from .devices import BARE_MIN, parse_device_budget  # noqa: F401  (BARE_MIN: its old place)
from .graph.units import parse_bytes

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
    "HYBRIDMEM_COMPILE": "compile",
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
    # statistics, or on the CPU hybridmem.native.cpumeter; nothing per op), "ops" (every op through a dispatch
    # mode: the cap's units, stages, min_budget_bytes), "auto" (allocator on CUDA, and on the CPU where the
    # native meter builds, else ops).
    monitor: str = "auto"
    # torch.compile without a backend uses hybridmem's under the budget (hybridmem.compile.session)
    compile: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # plugin-specific settings (YAML 'plugins:' section)
    # setting -> where its value came from, as given (see _source): errors found later, when the runtime
    # uses the setting (a device, a policy's options), name it
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def source(self, key: str) -> str:
        """Where setting ``key`` came from, for error messages: ``HYBRIDMEM_X='...'``, ``FILE: 'key'``, ..."""
        return self.sources.get(key) or _source("config", key, getattr(self, key))

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
        source = config if config is not None else (env.get("HYBRIDMEM_CONFIG") or None)  # empty: unset
        if isinstance(source, Config):
            base = source
        elif source is not None:
            base = _apply(base, _read_yaml(source) if isinstance(source, (str, Path)) else dict(source),
                          where=str(source) if isinstance(source, (str, Path)) else "config")
        from_env = {f: env[v] for v, f in ENV_VARS.items() if env.get(v) not in (None, "")}
        base = _apply(base, from_env, where="environment")
        return _apply(base, {k: v for k, v in kwargs.items() if v is not None}, where="arguments")


def _read_yaml(path: str | Path) -> dict[str, Any]:
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


TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE + FALSE:
        return value.strip().lower() in TRUE
    raise ValueError(f"{key} must be true or false, got {value!r}; accepted: true, false, "
                     f"{', '.join(TRUE[:1] + FALSE[:1] + TRUE[2:] + FALSE[2:])}")


def _as_budget(value: Any, key: str) -> Any:
    return parse_device_budget(value)  # percentages stay strings: they need the device


def _as_monitor(value: Any, key: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in MONITORS:
        raise ValueError(f"monitor must be one of {', '.join(MONITORS)}, got {value!r}")
    return value.strip().lower()


def _as_extra(value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"plugins/extra must be a mapping, got {type(value).__name__}")
    return value


# setting -> validator(value, key) returning the value to store; raises ValueError
_CHECKS = {"policies": _as_names, "lossy": _as_names, "verbose": _as_bool, "budget": _as_budget,
           "monitor": _as_monitor, "extra": _as_extra, "compile": _as_bool}


def checks() -> dict[str, Any]:
    """Each setting's validator, ``check(value, key)``: what the command line checks its flags with."""
    return dict(_CHECKS)


def _source(where: str, key: str, value: Any) -> str:
    """Where a setting came from, for error messages: the variable, the file and key, or the argument."""
    if where == "environment":
        var = next(v for v, f in ENV_VARS.items() if f == key)
        return f"{var}={value!r}"
    if where == "arguments":
        return f"argument {key}={value!r}"
    return f"{where}: '{'plugins' if key == 'extra' else key}'"  # a file name, or "config" (a mapping)


def _apply(cfg: Config, values: Mapping[str, Any], *, where: str) -> Config:
    if "plugins" in values:  # the YAML/mapping spelling of ``extra`` (plugin-specific settings)
        if "extra" in values:
            raise ValueError(f"both 'plugins' and 'extra' in {where}: they are one setting, give it once")
        values = {("extra" if k == "plugins" else k): v for k, v in values.items()}
    known = {f.name for f in fields(Config)} - {"sources"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown} in {where}; accepted: {sorted(known)}")
    out = dict(values)
    for key, check in _CHECKS.items():
        if key in out and out[key] is not None:
            try:
                out[key] = check(out[key], key)
            except ValueError as e:
                raise ValueError(f"{_source(where, key, values[key])}: {e}") from None
    if "policies" in out and not out["policies"] and out.get("budget", cfg.budget) is not None:
        raise ValueError(f"{_source(where, 'policies', values['policies'])}: policies is empty: name at "
                         "least one of swap, recompute, compress")
    return replace(cfg, **out, sources={**cfg.sources, **{k: _source(where, k, values[k]) for k in out}})
