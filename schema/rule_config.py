"""The ``alert`` config and rule arguments: checking them and making :mod:`.rules`' rules from them.

Errors are :class:`ConfigError` naming the offending key (``alert.rules[0].args.threshold``) and file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError
from .rules import RULES, Rule

__all__ = ["make_rule", "rule_arguments", "rules_from_config", "validate_alert_config"]

# Argument specs: name -> (kind, required, minimum, minimum inclusive)
_ARG_SPECS: dict[str, dict[str, tuple[str, bool, float | None, bool]]] = {
    "AnomalyTurbulence": {
        "threshold": ("float", True, 0.0, True),  # 0 flags every change (msprobe 1.2.1 accepts it)
        "window": ("int", False, 1, True),
        "warmup": ("int", False, 0, True),
        "noise": ("float", False, 0.0, True),
        "floor": ("float", False, 0.0, True),
        "nan": ("bool", False, None, True),
        "sudden": ("bool", False, None, True),
        "range_floor": ("float", False, 0.0, True),
    },
    "NaNInf": {},
    "ZScore": {
        "threshold": ("float", False, 0.0, False),
        "window": ("int", False, 2, True),
        "warmup": ("int", False, 0, True),
        "floor": ("float", False, 0.0, True),
    },
}


def rule_arguments(rule_name: str) -> tuple[str, ...]:
    """The argument names a rule accepts."""
    return tuple(_ARG_SPECS[rule_name])


def _check_arg(rule: str, name: str, value: Any, key: str, source: str | None) -> Any:
    kind, _required, minimum, inclusive = _ARG_SPECS[rule][name]
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"must be true or false, not {value!r}", key=key, source=source)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"must be a number, not {value!r}", key=key, source=source)
    if kind == "int":
        if isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"must be a whole number, not {value!r}", key=key, source=source)
        value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"must be finite, not {value!r}", key=key, source=source)
    if minimum is not None and (value < minimum or (value == minimum and not inclusive)):
        bound = ">=" if inclusive else ">"
        raise ConfigError(f"must be {bound} {minimum}, not {value!r}", key=key, source=source)
    return value


def make_rule(rule_name: str, args: Mapping[str, Any] | None = None, *, key: str = "rule",
              source: str | None = None) -> Rule:
    """Build a rule from its name and arguments, validating them.

    A ConfigError names ``{key}.rule_name`` or ``{key}.args.{name}``.
    """
    if not isinstance(rule_name, str) or rule_name not in RULES:
        raise ConfigError(
            f"unknown rule {rule_name!r}; known rules: {', '.join(sorted(RULES))}", key=f"{key}.rule_name",
            source=source,
        )
    args = {} if args is None else args
    if not isinstance(args, Mapping):
        raise ConfigError(f"rule arguments must be an object, not {args!r}", key=f"{key}.args", source=source)
    specs = _ARG_SPECS[rule_name]
    clean: dict[str, Any] = {}
    for name, value in args.items():
        if name not in specs:
            known = ", ".join(specs) or "none"
            raise ConfigError(f"unknown argument of {rule_name} (known: {known})", key=f"{key}.args.{name}",
                              source=source)
        clean[name] = _check_arg(rule_name, name, value, f"{key}.args.{name}", source)
    for name, spec in specs.items():
        if spec[1] and name not in clean:
            raise ConfigError(f"{rule_name} needs the argument {name!r}", key=f"{key}.args.{name}", source=source)
    return RULES[rule_name](**clean)


def validate_alert_config(raw: Any, *, source: str | None = None) -> dict[str, Any]:
    """Check the reference's ``alert`` config and return it normalised.

    ``{"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": false}``
    becomes the same dict with validated, typed args. Raises ConfigError naming the offending key.
    """
    if raw is None:
        return {"rules": [], "dump": False}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"must be an object, not {raw!r}", key="alert", source=source)
    unknown = set(raw) - {"rules", "dump"}
    if unknown:
        raise ConfigError("unknown key (known: rules, dump)", key=f"alert.{sorted(unknown)[0]}", source=source)
    rules = raw.get("rules", [])
    if rules is None:
        rules = []
    if not isinstance(rules, list):
        raise ConfigError(f"must be a list of rules, not {rules!r}", key="alert.rules", source=source)
    out_rules = []
    for i, spec in enumerate(rules):
        key = f"alert.rules[{i}]"
        if not isinstance(spec, Mapping):
            raise ConfigError(f"must be an object with rule_name and args, not {spec!r}", key=key, source=source)
        extra = set(spec) - {"rule_name", "args"}
        if extra:
            raise ConfigError("unknown key (known: rule_name, args)", key=f"{key}.{sorted(extra)[0]}", source=source)
        if "rule_name" not in spec:
            raise ConfigError("missing", key=f"{key}.rule_name", source=source)
        args = spec.get("args") or {}
        rule = make_rule(spec["rule_name"], args, key=key, source=source)
        out_rules.append({"rule_name": rule.name, "args": {k: rule.args[k] for k in args}})
    dump = raw.get("dump")
    if dump is None:  # absent or null: not set
        dump = False
    if not isinstance(dump, bool):
        raise ConfigError(f"must be true or false, not {dump!r}", key="alert.dump", source=source)
    return {"rules": out_rules, "dump": dump}


def rules_from_config(alert_cfg: Any) -> list[Rule]:
    """Fresh rule instances (with empty state) for a validated or raw ``alert`` config."""
    cfg = validate_alert_config(alert_cfg)
    return [make_rule(r["rule_name"], r["args"]) for r in cfg["rules"]]
