"""The config's sections that are objects, each parsed and checked into what :class:`.config.MonitorConfig`
holds: ``targets`` (with their input/output selectors), ``alert``, ``cc_distribution``, and trainrec's
``stall_watchdog`` and ``api_xy``. Anything wrong raises ConfigError naming the key."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from trainrec.schema.errors import ConfigError

SLOT_KEYS = ("input", "output", "input_grad", "output_grad")
RULE_NAMES = ("AnomalyTurbulence",)
_SELECTOR_RE = re.compile(r"^(?:tensor|tuple\[(\d+)\](?::(\d+))?)$")


@dataclass(frozen=True)
class Selector:
    """Which element of a module's input/output a target takes: the whole tensor or ``tuple[n]:i``."""

    spec: str
    length: int | None = None  # None for "tensor"
    index: int = 0

    @property
    def is_tensor(self) -> bool:
        return self.length is None


def parse_selector(spec: Any, key: str, source: str | None = None) -> Selector:
    """Parse ``"tensor"``, ``"tuple[2]"`` or ``"tuple[2]:0"``; raises ConfigError naming ``key``."""
    if not isinstance(spec, str):
        raise ConfigError(f"expected a selector string like 'tensor' or 'tuple[2]:0', got {spec!r}", key, source)
    m = _SELECTOR_RE.match(spec.strip())
    if not m:
        raise ConfigError(f"expected 'tensor', 'tuple[N]' or 'tuple[N]:i', got {spec!r}", key, source)
    if m.group(1) is None:
        return Selector(spec=spec.strip())
    length = int(m.group(1))
    index = int(m.group(2) or 0)
    if not 0 <= index < length:
        raise ConfigError(f"index {index} is outside tuple[{length}] in {spec!r}", key, source)
    return Selector(spec=spec.strip(), length=length, index=index)


@dataclass(frozen=True)
class AlertRule:
    rule_name: str
    threshold: float


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_targets(raw: Any, source: str | None) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"expected an object {{module_or_param_name: {{field: selector}}}}, got {type(raw).__name__}",
                          "targets", source)
    out = {}
    for name, fields in raw.items():
        if not isinstance(name, str):
            raise ConfigError(f"expected module/parameter names as keys, got {name!r}", "targets", source)
        if not isinstance(fields, dict):
            raise ConfigError(
                f"expected an object like {{\"input\": \"tensor\"}}, got {type(fields).__name__}",
                f"targets.{name}", source,
            )
        sel = {}
        for slot, spec in fields.items():
            if slot not in SLOT_KEYS:
                raise ConfigError(f"unknown field {slot!r}; expected one of {', '.join(SLOT_KEYS)}",
                                  f"targets.{name}", source)
            sel[slot] = parse_selector(spec, f"targets.{name}.{slot}", source)
        if name == "" and sel:
            # "" stands for every module (the root's name): no one selector fits every module's inputs
            raise ConfigError("the empty name means every module, and a selector cannot fit the inputs and "
                              "outputs of every one: name the module it is for", "targets.", source)
        out[name] = sel
    return out


def parse_alert(raw: Any, source: str | None) -> tuple:
    if not isinstance(raw, dict):
        raise ConfigError(f"expected an object with 'rules' and 'dump', got {type(raw).__name__}", "alert", source)
    for k in raw:
        if k not in ("rules", "dump"):
            raise ConfigError(f"unknown key {k!r}; expected 'rules' and/or 'dump'", "alert", source)
    if raw.get("dump") is not None and not isinstance(raw["dump"], bool):  # null: not set
        raise ConfigError(f"expected true or false, got {raw['dump']!r}", "alert.dump", source)
    rules = raw.get("rules", [])
    if not isinstance(rules, list):
        raise ConfigError(f"expected a list of rules, got {type(rules).__name__}", "alert.rules", source)
    out = []
    for i, rule in enumerate(rules):
        key = f"alert.rules[{i}]"
        if not isinstance(rule, dict):
            raise ConfigError(f"expected an object with rule_name and args, got {rule!r}", key, source)
        name = rule.get("rule_name")
        if name not in RULE_NAMES:
            raise ConfigError(f"unknown rule_name {name!r}; expected one of {', '.join(RULE_NAMES)}",
                              f"{key}.rule_name", source)
        args = rule.get("args", {})
        if not isinstance(args, dict):
            raise ConfigError(f"expected an object like {{\"threshold\": 0.5}}, got {args!r}", f"{key}.args", source)
        threshold = args.get("threshold", 0.5)
        if not is_number(threshold) or threshold < 0:
            raise ConfigError(f"expected a number >= 0, got {threshold!r}", f"{key}.args.threshold", source)
        out.append(AlertRule(name, float(threshold)))
    return tuple(out)


def validate_alert(raw: Any, source: str | None) -> tuple:
    """The alert section, checked by the anomaly rules' own validator when it is available."""
    try:
        from trainrec.schema.rule_config import validate_alert_config
    except ImportError:
        return parse_alert(raw, source)
    norm = validate_alert_config(raw, source=source)
    return tuple(AlertRule(r["rule_name"], float(r["args"].get("threshold", 0.5))) for r in norm["rules"])


def parse_cc(raw: Any, source: str | None) -> dict:
    if not isinstance(raw, dict):
        raise ConfigError(f"expected an object, got {type(raw).__name__}", "cc_distribution", source)
    # cc_metadata_only is trainrec's: the calls' metadata alone, no statistics (cheap enough to leave on)
    kinds = {"enable": bool, "cc_codeline": list, "cc_pre_hook": bool, "cc_log_only": bool, "cc_metadata_only": bool}
    for k, v in raw.items():
        if k not in kinds:
            raise ConfigError(f"unknown key {k!r}; expected one of {', '.join(kinds)}", "cc_distribution", source)
        if not isinstance(v, kinds[k]):
            raise ConfigError(f"expected {kinds[k].__name__}, got {v!r}", f"cc_distribution.{k}", source)
    for i, pattern in enumerate(raw.get("cc_codeline", [])):
        if not isinstance(pattern, str):
            raise ConfigError(f"expected a regular expression string like 'train.py\\\\[23\\\\]', got {pattern!r}",
                              f"cc_distribution.cc_codeline[{i}]", source)
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"not a valid regular expression: {exc}", f"cc_distribution.cc_codeline[{i}]",
                              source) from None
    return dict(raw)


WATCHDOG_DEFAULTS = {"enable": True, "factor": 5.0, "min_seconds": 60.0}


def _switch_object(raw: Any, defaults: dict, key: str, source: str | None) -> dict:
    """A trainrec key that is ``true``/``false`` or an object of ``defaults``' keys: the object, with
    unknown keys refused and ``enable`` checked (the other values are the caller's to check)."""
    if isinstance(raw, bool):
        return dict(defaults, enable=raw)
    if not isinstance(raw, dict):
        raise ConfigError(f"expected true, false or an object with {', '.join(defaults)}, got {raw!r}", key, source)
    for k, v in raw.items():
        if k not in defaults:
            raise ConfigError(f"unknown key {k!r}; expected one of {', '.join(defaults)}", key, source)
        if k == "enable" and not isinstance(v, bool):
            raise ConfigError(f"expected true or false, got {v!r}", f"{key}.enable", source)
    return dict(defaults, **raw)


def parse_watchdog(raw: Any, source: str | None) -> dict:
    """``stall_watchdog`` (trainrec's key): ``true``, or ``{"enable", "factor", "min_seconds"}``: a step
    running longer than ``factor`` times the median step, and ``min_seconds`` at least, is a stall."""
    out = _switch_object(raw, WATCHDOG_DEFAULTS, "stall_watchdog", source)
    for k in ("factor", "min_seconds"):
        v = out[k]
        if not is_number(v) or not math.isfinite(v) or v <= (1 if k == "factor" else 0):
            raise ConfigError(f"expected a finite number > {1 if k == 'factor' else 0}, got {v!r}",
                              f"stall_watchdog.{k}", source)
        out[k] = float(v)
    return out


API_XY_DEFAULTS = {"enable": True, "stack": False, "backward": True}


def parse_api_xy(raw: Any, source: str | None) -> dict:
    """``api_xy`` (trainrec's key): ``true``, or ``{"enable", "stack", "backward"}``: the API level, the
    torch functions and tensor methods called inside monitored forward passes (msprobe's ``mix`` level),
    with each call's stack where ``stack`` is true and the gradients through each call in backward
    unless ``backward`` is false (see :mod:`.api_calls`, :mod:`.api_backward`)."""
    out = _switch_object(raw, API_XY_DEFAULTS, "api_xy", source)
    for k in ("stack", "backward"):
        if not isinstance(out[k], bool):
            raise ConfigError(f"expected true or false, got {out[k]!r}", f"api_xy.{k}", source)
    return out
