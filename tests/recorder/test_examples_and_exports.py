"""The examples run as documented, and format csv starts the live projection with the config's settings."""

from __future__ import annotations

import csv
import glob
import importlib.util
import os
import subprocess
import sys

import pytest
from trainmon_util import (
    deepspeed_missing,
    events_of,
    make,
    rank_dirs,
    train_batches,
    train_random,
    write_config,
)
from trainrec.recorder import TrainerMon
from trainrec.schema.events import TensorStatsRecorded

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_NO_DEEPSPEED = pytest.mark.skipif(deepspeed_missing() is not None, reason=deepspeed_missing() or "")
_NO_HF = pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                            or importlib.util.find_spec("accelerate") is None,
                            reason="transformers and accelerate are not installed")


@pytest.mark.parametrize(("script", "args"), [
    ("plain_loop.py", ["--steps", "3", "--grad-acc", "2"]),
    ("hf_trainer_callback.py", ["--steps", "2"]),
    pytest.param("hf_trainer_callback.py", ["--hf", "--steps", "2"], marks=_NO_HF),
    pytest.param("deepspeed_zero.py", ["--steps", "2", "--stage", "3", "--grad-acc", "2"], marks=_NO_DEEPSPEED),
])
def test_examples_record_a_run(tmp_path, script, args):
    env = dict(os.environ, MONITOR_OUTPUT_DIR=str(tmp_path / "out"))
    env.pop("DYNAMIC_MONITOR", None)
    res = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args], env=env,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    ev = events_of(tmp_path / "out")
    kinds = {e.kind for e in ev if isinstance(e, TensorStatsRecorded)}
    assert {"actv", "actv_grad", "grad_unreduced", "grad_reduced", "param", "exp_avg", "update"} <= kinds
    assert ev[-1].__class__.__name__ == "FileClosed"


def _four_steps_recorded(tmp_path, cfg: dict) -> str:
    """Four plain training steps under a TrainerMon with ``cfg`` (its live export included); the rank
    directory, after close() has waited for the export to finish."""
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False)
    model, opt = make()
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    train_batches(model, opt, steps=4, grad_acc=1)
    mon.close()  # waits for the projection to read FileClosed and exit
    (d,) = rank_dirs(tmp_path / "out")
    return d


@pytest.mark.parametrize("fmt", [None, "tensorboard"])
def test_format_tensorboard_the_default_writes_the_references_scalars(tmp_path, monkeypatch, fmt):
    """format "tensorboard" (also where the config has no format: the reference's default) ends with an
    event file in the rank directory, with the reference's tags, one value per collected step."""
    pytest.importorskip("trainrec.tools.live_export")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = {"wg_distribution": True, "ops": ["norm", "max"], "step_interval": 2}
    if fmt:
        cfg["format"] = fmt
    d = _four_steps_recorded(tmp_path, cfg)
    (events,) = glob.glob(os.path.join(d, "events.out.tfevents.*"))
    ea = EventAccumulator(events)
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"0:head.weight/rank0/post_grad_norm", "0:head.weight/rank0/acc_grad_max"} <= tags
    assert all(t.rsplit("_", 1)[1] in ("norm", "max") for t in tags)
    assert [e.step for e in ea.Scalars("0:head.weight/rank0/post_grad_norm")] == [0, 2]
    assert not glob.glob(os.path.join(d, "*.csv"))


def test_format_csv_starts_the_live_projection(tmp_path, monkeypatch):
    pytest.importorskip("trainrec.tools.live_export")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    cfg = {"wg_distribution": True, "ops": ["norm", "max"], "format": "csv", "ndigits": 3,
           "step_count_per_record": 2}
    d = _four_steps_recorded(tmp_path, cfg)
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(d, "grad_reduced_*.csv")))
    assert files == ["grad_reduced_0-1.csv", "grad_reduced_2-3.csv"]
    with open(os.path.join(d, "grad_reduced_0-1.csv")) as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["vpp_stage", "param_name", "step", "norm", "max"]
    assert all(len(v.split(".")[-1]) <= 3 for r in rows[1:] for v in r[3:] if "." in v)

    # `trainrec export csv RUN` (as the README says, to remake what the live export missed) takes the
    # run's own ndigits and step_count_per_record: the same files, byte for byte
    from trainrec.tools.cli import main

    assert main(["export", "csv", str(tmp_path / "out"), "-o", str(tmp_path / "again")]) == 0
    live = sorted(glob.glob(os.path.join(d, "*.csv")))
    again = os.path.join(tmp_path / "again", os.path.basename(d))
    assert sorted(os.listdir(again)) == [os.path.basename(p) for p in live]
    for p in live:
        with open(p, "rb") as f, open(os.path.join(again, os.path.basename(p)), "rb") as g:
            assert f.read() == g.read(), p
    # given on the command line, they win
    assert main(["export", "csv", str(tmp_path / "out"), "-o", str(tmp_path / "mine"), "--ndigits", "5",
                 "--step-count-per-record", "1"]) == 0
    assert sorted(os.listdir(os.path.join(tmp_path / "mine", os.path.basename(d))))[:2] == [
        "grad_reduced_0-0.csv", "grad_reduced_1-1.csv"]


def test_what_the_recorder_writes_has_the_references_permissions(tmp_path, monkeypatch):
    """Files rw-r----- and directories rwxr-x---, as the reference writes them (its file utilities), for
    everything a run writes: the output directory itself, the rank directory, the log, the live export's
    CSV files and its own, the anomaly dump; and for what `trainrec export` writes."""
    pytest.importorskip("trainrec.tools.live_export")
    import stat

    from trainrec.tools.cli import main

    old = os.umask(0o022)
    try:
        monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out" / "deeper"))
        cfg = {"wg_distribution": True, "ops": ["norm"], "format": "csv",
               "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True}}
        mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False)
        model, opt = make()
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
        train_batches(model, opt, steps=3, grad_acc=1)
        mon.close()
        assert main(["export", "csv", str(tmp_path / "out" / "deeper"), "-o", str(tmp_path / "out" / "again")]) == 0
    finally:
        os.umask(old)
    modes = {}
    for root, _dirs, files in os.walk(tmp_path / "out"):
        modes[root] = stat.S_IMODE(os.stat(root).st_mode)
        for name in files:
            modes[os.path.join(root, name)] = stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode)
    names = {os.path.basename(p) for p in modes}
    assert {"trainrec-00000.trl", "grad_reduced_0-0.csv", "live_export.out", "live_export.done", "anomaly.json",
            "again"} <= names, names
    wrong = {p: oct(m) for p, m in modes.items() if m != (0o750 if os.path.isdir(p) else 0o640)}
    assert wrong == {}


def _step1_row_labels(tmp_path, monkeypatch, model_cls, cfg):
    """Record 2 steps of 2 micro steps of ``model_cls()`` with format csv; the row labels (column 2) of
    step 1's file of a kind, as ``names(kind)``."""
    import torch

    pytest.importorskip("trainrec.tools.live_export")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    torch.manual_seed(0)
    model = model_cls()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = TrainerMon(write_config(tmp_path, {**cfg, "format": "csv", "ops": ["norm"]}), params_have_main_grad=False)
    mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opt)
    train_random(model, opt)
    mon.close()
    (d,) = rank_dirs(tmp_path / "out")

    def names(kind):
        with open(os.path.join(d, f"{kind}_1-1.csv")) as f:
            return [row[1] for row in list(csv.reader(f))[1:]]

    return names


def test_csv_row_order_with_gradient_accumulation_is_the_references(tmp_path, monkeypatch):
    """Row order as mindstudio-probe 1.2.1 writes it (run here on this model, grad_acc_steps=2, step
    1's files): activations grouped by module, in the order modules first finished a forward, each
    with its micro steps; activation gradients micro step by micro step, in the order modules'
    backward passes ended (its full backward hook fires with the input gradient: a container after
    the modules inside it; the root, whose input has no gradient, first). Scripts that read rows by
    position rely on it."""
    import torch

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
            self.c = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.c(self.inner(self.a(x)))

    names = _step1_row_labels(tmp_path, monkeypatch, M, {"xy_distribution": True, "all_xy": True,
                                                          "wg_distribution": True})
    assert names("actv") == ["a_0", "a_1", "inner.0_0", "inner.0_1", "inner.1_0", "inner.1_1", "inner_0", "inner_1",
                             "c_0", "c_1", "_0", "_1"]
    assert names("actv_grad") == ["_0", "c_0", "inner.1_0", "inner.0_0", "inner_0", "a_0",
                                  "_1", "c_1", "inner.1_1", "inner.0_1", "inner_1", "a_1"]
    assert names("grad_unreduced") == ["c.bias", "c.weight", "inner.0.bias", "inner.0.weight", "a.bias", "a.weight"]
    assert names("grad_reduced") == ["a.weight", "a.bias", "inner.0.weight", "inner.0.bias", "c.weight", "c.bias"]


def test_grad_unreduced_rows_in_the_order_parameters_first_got_a_gradient(tmp_path, monkeypatch):
    """A parameter used in a later micro step only (a branch) comes after the others, as in the
    reference's file (run here: late, shared, a, branch); it came before ``a``, in the last micro
    step's order."""
    import torch

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.late, self.a, self.branch, self.shared = (torch.nn.Linear(4, 4) for _ in range(4))
            self.n = 0

        def forward(self, x):
            self.n += 1
            h = self.a(x)
            if self.n % 2 == 0:
                h = self.branch(h)
            return self.late(self.shared(h))

    names = _step1_row_labels(tmp_path, monkeypatch, M, {"wg_distribution": True})
    assert names("grad_unreduced") == [
        "late.bias", "late.weight", "shared.bias", "shared.weight", "a.bias", "a.weight", "branch.bias",
        "branch.weight"]
