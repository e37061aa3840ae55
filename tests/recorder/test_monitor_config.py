"""parse_config / load_config: every key of the reference's config table, defaults, and clear errors."""

from __future__ import annotations

import json

import pytest
from trainrec.recorder.config import MonitorConfig, load_config, parse_config
from trainrec.schema.errors import ConfigError

REFERENCE_EXAMPLE = {  # the config table's example (1.2.1 docs), plus alert and format
    "targets": {"language_model.encoder.layers.0": {"input": "tuple[2]:0", "output": "tensor",
                                                    "input_grad": "tuple[2]:0", "output_grad": "tuple[1]:0"}},
    "switch": False, "start_step": 0, "collect_times": 100000000, "step_interval": 1, "print_struct": False,
    "module_ranks": [0, 1, 2, 3], "ur_distribution": True, "xy_distribution": True, "all_xy": False,
    "forward_only": False, "backward_only": False, "mv_distribution": True, "wg_distribution": True,
    "param_distribution": True, "mg_direction": False,
    "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False},
    "cc_distribution": {"enable": False, "cc_codeline": [], "cc_pre_hook": False, "cc_log_only": False},
    "format": "csv", "ops": ["min", "max", "norm", "zeros", "nans", "mean"], "eps": 1e-8, "ndigits": 12,
    "step_count_per_record": 1, "append_output": [], "squash_name": True,
}


def test_defaults_of_every_key():
    c = parse_config({})
    assert c == MonitorConfig()
    assert (c.switch, c.start_step, c.collect_times, c.step_interval) == (False, 0, 100000000, 1)
    assert (c.print_struct, c.module_ranks, c.ur_distribution, c.xy_distribution, c.all_xy) == (False, (), False, False, False)
    assert (c.forward_only, c.backward_only, c.mv_distribution, c.wg_distribution) == (False, False, False, False)
    assert (c.param_distribution, c.mg_direction, c.alert, c.cc_distribution) == (False, False, None, {})
    assert (c.format, c.ops, c.eps, c.ndigits, c.step_count_per_record) == ("tensorboard", ("norm",), 1e-8, 6, 1)
    assert (c.append_output, c.squash_name, c.targets) == ((), True, {})
    assert c.everything


def test_reference_example_parses_and_keeps_raw():
    c = parse_config(json.loads(json.dumps(REFERENCE_EXAMPLE)))
    assert c.raw == REFERENCE_EXAMPLE
    sel = c.targets["language_model.encoder.layers.0"]
    assert (sel["input"].length, sel["input"].index) == (2, 0)
    assert sel["output"].is_tensor and sel["output_grad"].length == 1
    assert c.ops == ("min", "max", "norm", "zeros", "nans", "mean")
    assert c.alert_rules[0].threshold == 0.5 and c.module_ranks == (0, 1, 2, 3) and c.ndigits == 12


@pytest.mark.parametrize(
    ("raw", "key", "expect"),
    [
        ({"wg_distributon": True}, "wg_distributon", "unknown key"),
        ({"dynamic_on": True}, "dynamic_on", "with the key 'switch'"),
        ({"wg_distribution": 1}, "wg_distribution", "true or false"),
        ({"xy_distribution": "yes"}, "xy_distribution", "true or false"),
        ({"start_step": -1}, "start_step", "integer >= 0"),
        ({"step_interval": 0}, "step_interval", "integer >= 1"),
        ({"collect_times": 1.5}, "collect_times", "integer"),
        ({"collect_times": -1}, "collect_times", "integer >= 0"),
        ({"mg_distribution": "no"}, "mg_distribution", "true or false"),
        ({"ops": "norm"}, "ops", "list"),
        ({"ops": ["norm", "median"]}, "ops", "unknown op 'median'"),
        ({"format": "json"}, "format", "tensorboard, csv, api"),
        ({"eps": "1e-8"}, "eps", "number"),
        ({"module_ranks": [0, "1"]}, "module_ranks", "rank integers"),
        ({"module_ranks": [0, -1]}, "module_ranks", "rank integers >= 0"),
        ({"targets": []}, "targets", "object"),
        ({"targets": {"layers.0": "tensor"}}, "targets.layers.0", "object"),
        ({"targets": {"layers.0": {"inputs": "tensor"}}}, "targets.layers.0", "unknown field 'inputs'"),
        ({"targets": {"layers.0": {"input": "tuple(2):0"}}}, "targets.layers.0.input", "tuple[N]:i"),
        ({"targets": {"layers.0": {"input": "tuple[2]:2"}}}, "targets.layers.0.input", "outside tuple[2]"),
        ({"append_output": ["Dec03_21-34-40"]}, "append_output", "two time stamps"),
        ({"append_output": ["yesterday", "today"]}, "append_output", "two time stamps"),
        ({"step_count_per_record": 0}, "step_count_per_record", "integer >= 1"),
        ({"cc_distribution": {"enable": 1}}, "cc_distribution.enable", "bool"),
        ({"cc_distribution": {"what": True}}, "cc_distribution", "unknown key"),
        ({"alert": {"rules": [{"rule_name": "Nope"}]}}, "alert.rules[0].rule_name", "Nope"),
        ({"forward_only": True, "backward_only": True}, "backward_only", "cannot both"),
        ({"ndigits": 31}, "ndigits", "integer <= 30"),
        ({"collect_times": 10**30}, "collect_times", "integer <= 9007199254740991"),
        ({"start_step": 2**53}, "start_step", "integer <= "),
        ({"eps": float("nan")}, "eps", "finite number >= 0"),
        ({"eps": float("inf")}, "eps", "finite number >= 0"),
        ({"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": float("nan")}}]}},
         "alert.rules[0].args.threshold", "finite"),
    ],
)
def test_bad_values_name_the_key(raw, key, expect):
    with pytest.raises(ConfigError) as ei:
        parse_config(raw, "cfg.json")
    assert ei.value.key == key
    assert expect in str(ei.value) and "cfg.json" in str(ei.value)


@pytest.mark.parametrize(("key", "meant"), [("wg_distributon", "wg_distribution"), ("step_intervals", "step_interval"),
                                            ("Targets", "targets")])
def test_a_misspelt_key_names_the_key_it_resembles(key, meant):
    """The message listed all 26 keys, leaving the reader to find which one the typo was meant to be."""
    with pytest.raises(ConfigError) as ei:
        parse_config({key: True}, "cfg.json")
    assert f"config key {key!r}: unknown key (did you mean {meant!r}?); expected one of " in str(ei.value)


def test_an_unknown_key_like_none_gets_no_guess():
    with pytest.raises(ConfigError) as ei:
        parse_config({"bogus": True}, "cfg.json")
    assert "did you mean" not in str(ei.value)


def test_no_valid_op_means_norm_and_id_is_accepted(caplog):
    assert parse_config({"ops": []}).ops == ("norm",)
    assert parse_config({"ops": ["id"]}).ops == ("norm",)
    assert parse_config({"ops": ["max", "id", "max"]}).ops == ("max",)


def test_a_zero_threshold_is_accepted_as_the_reference_accepts_it():
    """msprobe 1.2.1 rejects a threshold < 0 only: a config of it with threshold 0.0 (flag every change)
    loads here too, and its rule runs."""
    import numpy as np
    from trainrec.schema.rule_config import rules_from_config

    alert = {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.0}}]}
    assert parse_config({"alert": alert}).alert_rules[0].threshold == 0.0
    (rule,) = rules_from_config(alert)
    assert rule.threshold == 0.0 and np.isfinite(rule.threshold)


def test_alert_dump_null_is_not_set():
    """``"dump": null`` (the reference takes any false value there): no dump, not an error."""
    c = parse_config({"alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}],
                                "dump": None}})
    assert not c.alert.get("dump")


def test_integer_threshold_and_eps_are_accepted():
    c = parse_config({"eps": 0, "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 1}}]}})
    assert c.eps == 0.0 and c.alert_rules[0].threshold == 1.0


def test_no_targets_with_xy_means_all_modules():
    assert parse_config({"xy_distribution": True}).all_xy
    assert parse_config({"xy_distribution": True, "targets": {"": {}}}).all_xy
    assert not parse_config({"xy_distribution": True, "targets": {"embed": {}}}).all_xy
    # "" is every module: a selector there cannot fit them all, and was silently ignored
    with pytest.raises(ConfigError, match="the empty name means every module") as ei:
        parse_config({"xy_distribution": True, "targets": {"": {"input": "tuple[2]:0"}}}, "c.json")
    assert ei.value.key == "targets." and str(ei.value).startswith("c.json: config key 'targets.': ")


def test_selector_tuple_without_index_means_index_0():
    c = parse_config({"targets": {"m": {"input": "tuple[3]"}}})
    assert (c.targets["m"]["input"].length, c.targets["m"]["input"].index) == (3, 0)


def test_is_collected_counts_from_start_step():
    c = parse_config({"start_step": 3, "step_interval": 2, "collect_times": 2})
    assert [s for s in range(12) if c.is_collected(s, 0)] == [3, 5, 7, 9, 11]
    assert not c.is_collected(7, 2)


def test_load_config_errors_name_path_and_position(tmp_path):
    with pytest.raises(ConfigError, match="not found") as ei:
        load_config(str(tmp_path / "missing.json"))
    assert "missing.json" in str(ei.value)
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "ops": ["norm"],\n  "wg_distribution": tru\n}\n')
    with pytest.raises(ConfigError, match=r"line 3 column 22") as ei:
        load_config(str(bad))
    assert "bad.json" in str(ei.value)
    top = tmp_path / "list.json"
    top.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(str(top))
    good = tmp_path / "good.json"
    good.write_text('{"wg_distribution": true}')
    assert load_config(str(good)).wg_distribution


def test_keys_the_reference_validates_but_its_table_omits():
    """msprobe 1.2.1's validate_config accepts mg_distribution (a bool it never reads) and collect_times 0
    (its monitor then never starts collecting): configs written for it load here too."""
    c = parse_config({"mg_distribution": False, "collect_times": 0})
    assert c.collect_times == 0 and not c.is_collected(0, 0) and not c.is_collected(5, 0)
    assert c.raw["mg_distribution"] is False


@pytest.mark.parametrize(("raw", "after", "first"), [
    ({}, 5, 5),
    ({"start_step": 18}, 14, 18),
    ({"step_interval": 4}, 5, 8),
    ({"step_interval": 4}, 8, 8),
    ({"start_step": 3, "step_interval": 5}, 9, 13),
    ({"start_step": 3, "step_interval": 5}, 0, 3),
])
def test_first_collected_step(raw, after, first):
    cfg = parse_config(raw)
    assert cfg.first_collected(after) == first
    assert cfg.is_collected(first, 0) and not any(cfg.is_collected(s, 0) for s in range(after, first))


@pytest.mark.parametrize(("data", "expect"), [
    (b'{"ops": ["norm"], "note": "\xff\xfe"}', "not UTF-8 text (byte 27)"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_a_config_file_that_cannot_be_read_as_json_names_the_file(tmp_path, data, expect):
    path = tmp_path / "bad.json"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as ei:
        load_config(str(path))
    assert expect in str(ei.value) and str(path) in str(ei.value)


@pytest.mark.parametrize("path", [None, "", 3, ["config.json"]])
def test_a_config_path_that_is_no_path_is_a_config_error(tmp_path, path):
    """TrainerMon(os.environ.get("MONITOR_CONFIG")) with the variable unset gave a TypeError from inside
    open(), and an int was opened as a file descriptor (and closed after reading)."""
    import os

    if path == 3:
        (tmp_path / "c.json").write_text('{"wg_distribution": true}')
        path = os.open(tmp_path / "c.json", os.O_RDONLY)
    try:
        with pytest.raises(ConfigError, match="expected the path of a config JSON file"):
            load_config(path)
        if isinstance(path, int):
            os.fstat(path)  # still open
    finally:
        if isinstance(path, int):
            os.close(path)


@pytest.mark.parametrize(("kwargs", "key"), [({"params_have_main_grad": "no"}, "params_have_main_grad"),
                                             ({"params_have_main_grad": 2}, "params_have_main_grad"),
                                             ({"opt_ty": "Nope"}, "opt_ty")])
def test_trainermon_arguments_of_the_wrong_kind_are_config_errors(kwargs, key, out):
    """TrainerMon's own arguments: a string for params_have_main_grad ("no" was taken as true) and an
    unknown opt_ty are one ConfigError naming the argument; True, False, 1 and 0 are taken."""
    from trainrec.recorder import TrainerMon

    with pytest.raises(ConfigError) as ei:
        TrainerMon({"wg_distribution": True}, live_export=False, **kwargs)
    assert ei.value.key == key
    assert str(ei.value).startswith(f"argument {key!r}: ")  # not "config key"
    for ok in (True, False, 1, 0):
        mon = TrainerMon({"wg_distribution": True}, params_have_main_grad=ok, live_export=False)
        assert mon.params_have_main_grad is bool(ok)
