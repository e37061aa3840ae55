"""The monitor configuration: mindstudio-probe 1.2.1's config JSON, parsed and validated up front.

:func:`parse_config` turns the raw dict into a frozen :class:`MonitorConfig` with every key of the
reference's config table and its default; anything wrong (unknown key, wrong type, unknown op,
malformed selector) raises :class:`~trainrec.schema.errors.ConfigError` naming the key and what was
expected, before any training time is spent. :func:`load_config` reads a file and adds the path (and
line/column for invalid JSON). The dynamic-config watcher calls :func:`parse_config` to validate
edits.

Differences from the reference, where its documentation promises more than its code does:

- ``ops``: an unknown op is an error (the reference warns and drops it); an empty or missing list
  means ``["norm"]`` as documented. ``"id"`` is accepted for compatibility and ignored.
- Threshold and ``eps`` accept ints (``1`` as well as ``1.0``).
- Selectors (``"tensor"``, ``"tuple[N]"``, ``"tuple[N]:i"``) are checked for syntax here and against
  the module's real inputs/outputs at its first call (a ConfigError in the run's first step).
"""

from __future__ import annotations

import dataclasses
import difflib
import errno
import json
import logging
import math
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

from trainrec.schema.errors import ConfigError
from trainrec.schema.events import MAX_STEP

log = logging.getLogger(__name__)

VALID_OPS = ("min", "max", "norm", "mean", "zeros", "nans")
IGNORED_OPS = ("id",)
FORMATS = ("tensorboard", "csv", "api")
SLOT_KEYS = ("input", "output", "input_grad", "output_grad")
RULE_NAMES = ("AnomalyTurbulence",)
_SELECTOR_RE = re.compile(r"^(?:tensor|tuple\[(\d+)\](?::(\d+))?)$")
_STAMP_RE = re.compile(r"^[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}$")


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


@dataclass(frozen=True)
class MonitorConfig:
    """A validated monitor config. Field names are the reference's keys; ``raw`` is the input dict."""

    targets: dict = field(default_factory=dict)  # name -> {slot: Selector}
    switch: bool = False
    start_step: int = 0
    collect_times: int = 100_000_000
    step_interval: int = 1
    print_struct: bool = False
    module_ranks: tuple = ()
    ur_distribution: bool = False
    xy_distribution: bool = False
    all_xy: bool = False
    forward_only: bool = False
    backward_only: bool = False
    mv_distribution: bool = False
    wg_distribution: bool = False
    param_distribution: bool = False
    mg_direction: bool = False
    alert: dict | None = None
    alert_rules: tuple = ()
    cc_distribution: dict = field(default_factory=dict)
    stall_watchdog: dict = field(default_factory=dict)  # trainrec's: see _parse_watchdog
    api_xy: dict = field(default_factory=dict)  # trainrec's: see _parse_api_xy
    format: str = "tensorboard"
    ops: tuple = ("norm",)
    eps: float = 1e-8
    ndigits: int = 6
    step_count_per_record: int = 1
    append_output: tuple = ()
    squash_name: bool = True
    raw: dict = field(default_factory=dict, compare=False)

    @property
    def api_level(self) -> bool:
        """Whether the API level records (``api_xy`` on, with the module forward calls it nests under)."""
        return bool(self.api_xy.get("enable")) and self.xy_distribution and not self.backward_only

    @property
    def everything(self) -> bool:
        """True when no targets are configured: every module / parameter is monitored."""
        return not self.targets or set(self.targets) == {""}

    def first_collected(self, step: int) -> int:
        """The first step from ``step`` on that :meth:`is_collected` takes (with no collections yet)."""
        s = max(step, self.start_step)
        return s + (-(s - self.start_step)) % self.step_interval

    def is_collected(self, step: int, collections: int) -> bool:
        """Whether ``step`` is collected, given ``collections`` steps collected so far."""
        return (
            step >= self.start_step
            and (step - self.start_step) % self.step_interval == 0
            and collections < self.collect_times
        )


_MAX_STEP = MAX_STEP - 1  # step numbers a log holds


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_BOOL_KEYS = (
    "switch", "print_struct", "ur_distribution", "xy_distribution", "all_xy", "forward_only",
    "backward_only", "mv_distribution", "wg_distribution", "param_distribution", "mg_direction",
    "squash_name",
)
KNOWN_KEYS = frozenset(
    _BOOL_KEYS
    + ("targets", "start_step", "collect_times", "step_interval", "module_ranks", "alert", "cc_distribution",
       "stall_watchdog", "api_xy", "format", "ops", "eps", "ndigits", "step_count_per_record", "append_output", "mg_distribution")
)


def _parse_targets(raw: Any, source: str | None) -> dict:
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


def _parse_alert(raw: Any, source: str | None) -> tuple:
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
        if not _is_number(threshold) or threshold < 0:
            raise ConfigError(f"expected a number >= 0, got {threshold!r}", f"{key}.args.threshold", source)
        out.append(AlertRule(name, float(threshold)))
    return tuple(out)


def _validate_alert(raw: Any, source: str | None) -> tuple:
    """The alert section, checked by the anomaly rules' own validator when it is available."""
    try:
        from trainrec.schema.rule_config import validate_alert_config
    except ImportError:
        return _parse_alert(raw, source)
    norm = validate_alert_config(raw, source=source)
    return tuple(AlertRule(r["rule_name"], float(r["args"].get("threshold", 0.5))) for r in norm["rules"])


def _parse_cc(raw: Any, source: str | None) -> dict:
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


def _parse_watchdog(raw: Any, source: str | None) -> dict:
    """``stall_watchdog`` (trainrec's key): ``true``, or ``{"enable", "factor", "min_seconds"}``: a step
    running longer than ``factor`` times the median step, and ``min_seconds`` at least, is a stall."""
    out = _switch_object(raw, WATCHDOG_DEFAULTS, "stall_watchdog", source)
    for k in ("factor", "min_seconds"):
        v = out[k]
        if not _is_number(v) or not math.isfinite(v) or v <= (1 if k == "factor" else 0):
            raise ConfigError(f"expected a finite number > {1 if k == 'factor' else 0}, got {v!r}",
                              f"stall_watchdog.{k}", source)
        out[k] = float(v)
    return out


API_XY_DEFAULTS = {"enable": True, "stack": False, "backward": True}


def _parse_api_xy(raw: Any, source: str | None) -> dict:
    """``api_xy`` (trainrec's key): ``true``, or ``{"enable", "stack", "backward"}``: the API level, the
    torch functions and tensor methods called inside monitored forward passes (msprobe's ``mix`` level),
    with each call's stack where ``stack`` is true and the gradients through each call in backward
    unless ``backward`` is false (see :mod:`.api_calls`, :mod:`.api_backward`)."""
    out = _switch_object(raw, API_XY_DEFAULTS, "api_xy", source)
    for k in ("stack", "backward"):
        if not isinstance(out[k], bool):
            raise ConfigError(f"expected true or false, got {out[k]!r}", f"api_xy.{k}", source)
    return out


# keys of other mindstudio-probe versions: what the 1.2.1 config (this one) says instead
_KEY_HINTS = {
    "dynamic_on": " (a later mindstudio-probe's; in 1.2.1's config, as here, dynamic start and stop is the "
                  "environment variable DYNAMIC_MONITOR=True with the key 'switch')",
}


def env_choice(name: str, values: tuple[str, ...], default: str) -> str:
    """The environment variable ``name`` where it is one of ``values``; else ``default``, with a
    warning for a value it does not take (a typo would otherwise leave the default on without a word)."""
    value = os.environ.get(name, default)
    if value in values:
        return value
    log.warning("trainrec: %s=%r is not one of its values (%s); ignored: the default applies", name, value,
                ", ".join(v for v in values if v))
    return default


def parse_config(raw: dict, source: str | None = None) -> MonitorConfig:
    """Validate a raw config dict; ``source`` (a path) is named in errors. Raises ConfigError."""
    if not isinstance(raw, dict):
        raise ConfigError(f"expected a JSON object at the top level, got {type(raw).__name__}", None, source)
    for key in raw:
        if key not in KNOWN_KEYS:
            hint = _KEY_HINTS.get(key, "")
            close = difflib.get_close_matches(str(key).lower(), sorted(KNOWN_KEYS), n=1, cutoff=0.8)
            if not hint and close:
                hint = f" (did you mean {close[0]!r}?)"
            raise ConfigError(f"unknown key{hint}; expected one of {', '.join(sorted(KNOWN_KEYS))}", key, source)
    kw: dict[str, Any] = {}
    for key in _BOOL_KEYS:
        if key in raw:
            if not isinstance(raw[key], bool):
                raise ConfigError(f"expected true or false, got {raw[key]!r}", key, source)
            kw[key] = raw[key]
    if "mg_distribution" in raw:  # the reference validates it as a bool and never reads it
        if not isinstance(raw["mg_distribution"], bool):
            raise ConfigError(f"expected true or false, got {raw['mg_distribution']!r}", "mg_distribution", source)
        if raw["mg_distribution"]:
            log.warning("trainrec: mg_distribution has no effect (nor has it in msprobe 1.2.1, which only "
                        "validates it); mg_direction records the gradient/momentum sign agreement")
    # collect_times 0: nothing is collected (msprobe 1.2.1 turns monitoring on only where it is > 0)
    # (upper bounds: step numbers a log can hold; float32 values carry about 9
    # significant digits, and the CSV writer rounds to at most 30 places)
    for key, lo, hi in (("start_step", 0, _MAX_STEP), ("collect_times", 0, _MAX_STEP), ("step_interval", 1, _MAX_STEP),
                        ("ndigits", 0, 30), ("step_count_per_record", 1, 1_000_000)):
        if key in raw:
            v = raw[key]
            if not _is_int(v) or v < lo:
                raise ConfigError(f"expected an integer >= {lo}, got {v!r}", key, source)
            if v > hi:
                raise ConfigError(f"expected an integer <= {hi}, got {v!r}", key, source)
            kw[key] = v
    if "eps" in raw:
        v = raw["eps"]
        if not _is_number(v) or not v >= 0 or not math.isfinite(v):
            raise ConfigError(f"expected a finite number >= 0, got {v!r}", "eps", source)
        kw["eps"] = float(v)
    if "module_ranks" in raw:
        v = raw["module_ranks"]
        if not isinstance(v, list) or not all(_is_int(r) and r >= 0 for r in v):
            raise ConfigError(f"expected a list of rank integers >= 0, got {v!r}", "module_ranks", source)
        kw["module_ranks"] = tuple(v)
    if "format" in raw:
        v = raw["format"]
        if v not in FORMATS:
            raise ConfigError(f"expected one of {', '.join(FORMATS)}, got {v!r}", "format", source)
        kw["format"] = v
    if "ops" in raw:
        v = raw["ops"]
        if not isinstance(v, list):
            raise ConfigError(f"expected a list of ops from {', '.join(VALID_OPS)}, got {v!r}", "ops", source)
        ops = []
        for op in v:
            if op in IGNORED_OPS:
                log.warning("trainrec: op %r is accepted for compatibility and not recorded", op)
                continue
            if op not in VALID_OPS:
                raise ConfigError(f"unknown op {op!r}; expected some of {', '.join(VALID_OPS)}", "ops", source)
            if op not in ops:
                ops.append(op)
        kw["ops"] = tuple(ops) or ("norm",)
    if "append_output" in raw:
        v = raw["append_output"]
        if not isinstance(v, list) or (v and (len(v) != 2 or not all(isinstance(s, str) and _STAMP_RE.match(s)
                                                                       for s in v))):
            raise ConfigError(f"expected [] or two time stamps like [\"Dec03_21-34-40\", \"Dec03_21-34-41\"], got {v!r}",
                              "append_output", source)
        kw["append_output"] = tuple(v)
    targets = _parse_targets(raw.get("targets"), source)
    kw["targets"] = targets
    if "alert" in raw:
        kw["alert"] = dict(raw["alert"]) if isinstance(raw["alert"], dict) else raw["alert"]
        kw["alert_rules"] = _validate_alert(raw["alert"], source)
    if "cc_distribution" in raw:
        kw["cc_distribution"] = _parse_cc(raw["cc_distribution"], source)
    if "stall_watchdog" in raw:
        kw["stall_watchdog"] = _parse_watchdog(raw["stall_watchdog"], source)
    if "api_xy" in raw:
        kw["api_xy"] = _parse_api_xy(raw["api_xy"], source)
        if kw["api_xy"]["enable"] and (not kw.get("xy_distribution") or kw.get("backward_only")):
            # (a warning, not an error: reload_xy() and a dynamic edit may turn xy off under it)
            log.warning("trainrec: api_xy records API calls inside the module forward calls that xy_distribution "
                        "records, and nests them there: with xy_distribution off (or backward_only) it records "
                        "nothing%s", f" ({source})" if source else "")
    if kw.get("forward_only") and kw.get("backward_only"):
        raise ConfigError("forward_only and backward_only cannot both be true", "backward_only", source)
    # The reference: no targets with xy_distribution means every module (all_xy).
    if (not targets or set(targets) == {""}) and kw.get("xy_distribution"):
        kw["all_xy"] = True
    return MonitorConfig(raw=dict(raw), **kw)


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def read_regular_file(path) -> bytes:
    """The bytes of ``path``, refusing anything but a regular file: a FIFO or a device as the config would
    block the reader for good (opened without blocking, then checked). Raises OSError saying what it is."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with open(fd, "rb", closefd=True) as f:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):  # (as open() says it)
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(mode):
            what = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise OSError(errno.EINVAL, f"it is {what}, not a regular file (a config is read from a regular file "
                                        "only: reading this one could block for good)")
        os.set_blocking(fd, True)
        return f.read()


def load_config(path: str) -> MonitorConfig:
    """Read and validate a config file; errors name the path (and line/column for invalid JSON)."""
    if not isinstance(path, (str, bytes, os.PathLike)) or not os.fspath(path):
        # (an int would be opened as a file descriptor, and closed after reading)
        raise ConfigError(f"expected the path of a config JSON file (TrainerMon and record also take a config "
                          f"dict), got {path!r}")
    try:
        text = read_regular_file(path).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError("config file not found", None, str(path)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte {exc.start})", None, str(path)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read the config file: {exc.strerror or exc}", None, str(path)) from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", None, str(path)) from None
    except RecursionError:
        raise ConfigError("invalid JSON: nested too deeply", None, str(path)) from None
    return parse_config(raw, str(path))


def config_to_dict(config: MonitorConfig) -> dict:
    """The raw dict a config came from (for ConfigApplied events)."""
    return dict(config.raw)


def replace(config: MonitorConfig, **changes: Any) -> MonitorConfig:
    return dataclasses.replace(config, **changes)
