"""The live CSV/TensorBoard export is a process of its own: where it dies while training goes on (a kill,
a full or read-only disk, an error of its own), the training process says so, once, while it runs and
not only in live_export.out (which a full disk may not even hold); a projection that ends well, or that
the recorder stops itself, says nothing."""

from __future__ import annotations

import logging
import signal
import time

import torch
import torch.nn as nn
from trainrec.recorder import record, step_cycle

LOGGER = "trainrec.recorder.runinfo"


def _train(model, opt, n):
    for _ in range(n):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _said(caplog):
    return [r.getMessage() for r in caplog.records if "live csv export" in r.getMessage()]


def test_a_live_export_killed_mid_run_is_reported_while_training_goes_on(out, caplog, monkeypatch):
    monkeypatch.setattr(step_cycle, "_LIVE_CHECK_S", 0.0)  # look at every step boundary
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        rec = record(model, opt, config={"wg_distribution": True, "format": "csv"}, output_dir=str(out))
        try:
            proc = rec.session.output.live.proc
            assert proc is not None
            _train(model, opt, 2)
            assert not _said(caplog)
            proc.send_signal(signal.SIGKILL)
            deadline = time.monotonic() + 20
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            _train(model, opt, 2)  # the next step boundary looks
            said = _said(caplog)
            assert len(said) == 1 and "killed by signal 9" in said[0] and "trainrec export csv" in said[0], said
            _train(model, opt, 2)
        finally:
            rec.close()
    assert len(_said(caplog)) == 1  # once


def test_a_live_export_that_ends_well_says_nothing(out, caplog, monkeypatch):
    monkeypatch.setattr(step_cycle, "_LIVE_CHECK_S", 0.0, raising=False)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with record(model, opt, config={"wg_distribution": True, "format": "csv"}, output_dir=str(out)):
            _train(model, opt, 3)
    assert not _said(caplog)
