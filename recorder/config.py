"""The monitor configuration: mindstudio-probe 1.2.1's config JSON, parsed and validated up front.

:func:`parse_config` turns the raw dict into a frozen :class:`MonitorConfig` with every key of the
reference's config table and its default; anything wrong raises
:class:`~trainrec.schema.errors.ConfigError` naming the key, before any training time is spent.
:func:`load_config` reads a file (path, and line/column for invalid JSON). The dynamic-config
watcher validates edits with :func:`parse_config`. Where the reference's documentation and code
differ (unknown ops are errors, ints accepted for floats, selectors checked): docs/config.md."""

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

from .config_sections import is_number, parse_api_xy, parse_cc, parse_targets, parse_watchdog, validate_alert

log = logging.getLogger(__name__)

VALID_OPS = ("min", "max", "norm", "mean", "zeros", "nans")
IGNORED_OPS = ("id",)
FORMATS = ("tensorboard", "csv", "api")
_STAMP_RE = re.compile(r"^[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}$")


@dataclass(frozen=True)
class MonitorConfig:
    """A validated monitor config. Field names are the reference's keys; ``raw`` is the input dict."""

    targets: dict = field(default_factory=dict)  # name -> {slot: config_sections.Selector}
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
    stall_watchdog: dict = field(default_factory=dict)  # trainrec's: see config_sections.parse_watchdog
    api_xy: dict = field(default_factory=dict)  # trainrec's: see config_sections.parse_api_xy
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
        if not is_number(v) or not v >= 0 or not math.isfinite(v):
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
    targets = parse_targets(raw.get("targets"), source)
    kw["targets"] = targets
    if "alert" in raw:
        kw["alert"] = dict(raw["alert"]) if isinstance(raw["alert"], dict) else raw["alert"]
        kw["alert_rules"] = validate_alert(raw["alert"], source)
    if "cc_distribution" in raw:
        kw["cc_distribution"] = parse_cc(raw["cc_distribution"], source)
    if "stall_watchdog" in raw:
        kw["stall_watchdog"] = parse_watchdog(raw["stall_watchdog"], source)
    if "api_xy" in raw:
        kw["api_xy"] = parse_api_xy(raw["api_xy"], source)
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
