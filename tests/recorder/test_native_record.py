"""The native face, record(): chunks, manual and detected steps, and its argument errors."""

from __future__ import annotations

import glob
import threading
import time

import pytest
import torch
from trainmon_util import events_of, loss_of, make, new_threads, stats_table, steps_with
from trainrec.recorder import TrainerMon
from trainrec.recorder.names import squash_all
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import ModuleStructureRecorded, TensorStatsRecorded


def test_native_record_with_chunks_and_manual_steps(tmp_path, out):
    from trainrec.recorder import record

    model, _ = make()
    chunks = [model.layers[0], model.layers[1]]
    with record(chunks, config={"param_distribution": True, "xy_distribution": True, "ops": ["norm"]},
                output_dir=str(tmp_path / "native")) as rec:
        for s in range(2):
            loss_of(model, s).backward()
            rec.step()
        assert rec.step_count == 2
    ev = events_of(tmp_path / "native")
    par = stats_table(ev, "param")
    assert {(k[0], k[1]) for k in par} >= {(0, "0.weight"), (1, "weight")}
    ms = [e.vpp_stage for e in ev if isinstance(e, ModuleStructureRecorded)]
    assert ms == [0, 1]
    vpps = {v for e in ev if isinstance(e, TensorStatsRecorded) for v in e.column("vpp_stages")}
    assert vpps == {0, 1}


def test_native_record_detects_steps_through_the_optimizer(tmp_path, out):
    from trainrec.recorder import record

    model, opt = make()
    with record(model, opt, output_dir=str(tmp_path / "native")) as rec:
        loss_of(model, 0).backward()
        opt.step()
        with pytest.raises(RuntimeError):
            rec.step()
        assert set(rec.metrics("grad_reduced")) == {f"0:{n}/rank0/post_grad" for n in squash_all(
            [n for n, _ in model.named_parameters()]).values()}
        with pytest.raises(ValueError, match="unknown kind 'wg'; expected one of actv, actv_grad"):
            rec.metrics("wg")  # a typo is not an empty result
    ev = events_of(tmp_path / "native")
    assert steps_with(ev, "grad_reduced") == [0] and steps_with(ev, "param") == [0]


def test_native_record_without_steps_warns_and_start_iteration_numbers_steps(tmp_path, out, caplog, monkeypatch):
    """No optimizer and no rec.step(): every backward pass goes into step 0, and a warning says what to
    call (nothing did); start_iteration numbers the steps (the keyword was start_step, which is also a
    config key of another meaning, and a TypeError now says so)."""
    from trainrec.recorder import failures, record

    monkeypatch.setattr(failures, "_warned", set())
    model, _ = make()
    with pytest.raises(TypeError, match="start_step is a config key"):
        record(model, start_step=3, output_dir=str(tmp_path / "bad"))
    with caplog.at_level("WARNING", logger="trainrec"), record(
            model, config={"wg_distribution": True, "ops": ["norm"]}, output_dir=str(tmp_path / "native")):
        for s in range(3):
            loss_of(model, s).backward()
            model.zero_grad()
    assert [r for r in caplog.records if "step() was not called" in r.getMessage()]
    with record(model, config={"wg_distribution": True, "ops": ["norm"]}, start_iteration=5,
                output_dir=str(tmp_path / "numbered")) as rec:
        loss_of(model, 0).backward()
        rec.step()
    assert steps_with(events_of(tmp_path / "numbered"), "grad_reduced") == [5]


def test_native_record_with_a_bad_config_leaves_no_log_open(tmp_path, out):
    """A target that matches nothing: the ConfigError comes out of record(), and the monitor it made is
    closed (its log closed cleanly, its threads gone), not left running until the process exits."""
    from trainrec.recorder import record

    model, _ = make()
    before = set(threading.enumerate())
    with pytest.raises(ConfigError, match="matches no module") as ei:
        record(model, config={"xy_distribution": True, "targets": {"nope": {}}}, output_dir=str(tmp_path / "bad"))
    assert str(ei.value).startswith("config key 'targets.nope': matches no module")  # no file to name
    with pytest.raises(ConfigError) as ei:
        record(model, config={"bogus": 1}, output_dir=str(tmp_path / "bad"))
    assert str(ei.value).startswith("config dict: config key 'bogus': unknown key; expected one of ")
    assert glob.glob(str(tmp_path / "bad" / "*")) == []  # nothing recorded: its empty log and directory went
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and new_threads(before):
        time.sleep(0.02)
    assert new_threads(before) == []  # close() ran: the writer and spill threads stopped


class _PlainSGD:
    """An optimizer that is no torch Optimizer (no step hooks to find steps by)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        self.params = list(params)
        self.lr = lr

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            p -= self.lr * p.grad


@pytest.mark.parametrize("case", ["model None", "model a str", "model and optimizer swapped", "model []",
                                  "model [module, 3]", "optimizer a str", "optimizer the model", "optimizer []",
                                  "optimizer [opt, 3]", "optimizer no torch Optimizer", "grad_acc_steps 0"])
def test_native_record_with_a_wrong_model_or_optimizer_says_what_is_wrong_and_leaves_nothing(tmp_path, out, case):
    """A model or optimizer of the wrong type is one error out of record() that names the argument (an
    optimizer whose steps cannot be hooked was a warning, then steps never counted and rec.step()
    refused; a model that is no module an AttributeError from inside), and no empty log is left."""
    from trainrec.recorder import record

    model, opt = make()
    args, kwargs, what = {
        "model None": ((None, opt), {}, "model"),
        "model a str": (("model", opt), {}, "model"),
        "model and optimizer swapped": ((opt, model), {}, "model"),
        "model []": (([], opt), {}, "model"),
        "model [module, 3]": (([model, 3], opt), {}, "model"),
        "optimizer a str": ((model, "adam"), {}, "optimizer"),
        "optimizer the model": ((model, model), {}, "optimizer"),
        "optimizer []": ((model, []), {}, "optimizer"),
        "optimizer [opt, 3]": ((model, [opt, 3]), {}, "optimizer"),
        "optimizer no torch Optimizer": ((model, _PlainSGD(model.parameters())), {}, "optimizer"),
        "grad_acc_steps 0": ((model, opt), {"grad_acc_steps": 0}, "grad_acc_steps"),
    }[case]
    with pytest.raises((TypeError, ConfigError), match=what) as ei:
        record(*args, config={"wg_distribution": True}, output_dir=str(tmp_path / "bad"), **kwargs)
    if case == "optimizer no torch Optimizer":
        assert "rec.step()" in str(ei.value)  # what to do instead
    assert glob.glob(str(tmp_path / "bad" / "*")) == []


@pytest.mark.parametrize("output_dir", [5, ["out"]])
def test_an_output_dir_that_is_no_path_is_named(tmp_path, out, output_dir):
    """output_dir of the wrong type says so, naming it (it was os.path's bare 'expected str, bytes or
    os.PathLike object, not int', from wherever the path was first joined)."""
    from trainrec.recorder import record

    model, opt = make()
    with pytest.raises(TypeError, match="output_dir: expected a directory path"):
        record(model, opt, config={"wg_distribution": True}, output_dir=output_dir)
    with pytest.raises(TypeError, match="output_dir: expected a directory path"):
        TrainerMon({"wg_distribution": True}, output_dir=output_dir)


@pytest.mark.parametrize("config", [5, ["config.json"], ""])
def test_native_record_with_a_config_that_is_neither_dict_nor_path_says_so(tmp_path, out, config):
    from trainrec.recorder import record

    model, _ = make()
    with pytest.raises(ConfigError, match="expected the path of a config JSON file"):
        record(model, config=config, output_dir=str(tmp_path / "bad"))
