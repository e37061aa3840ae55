"""`trainrec report`: the model (pure), and the page in a real headless Chromium: it loads from
file:// without console errors, shows the heatmap and the anomaly list, and clicking an anomaly
selects its heatmap cell. A screenshot is left in the test's tmp_path (report.png)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "analyzers"))

from browser import headless_chromium  # noqa: E402
from export_logs import rank_dir, stats_record, write_rank_log  # noqa: E402
from trainrec.analyzers.report_model import KindGrid, ReportBuilder  # noqa: E402
from trainrec.recorder.writer import LogWriter  # noqa: E402
from trainrec.replay import open_run  # noqa: E402
from trainrec.schema.events import OPS, RunResumed, StepEnded  # noqa: E402
from trainrec.tools.cli import main  # noqa: E402
from trainrec.tools.cmd_report import log_codes  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Rank 0 closed cleanly, then resumed at step 4; rank 1 not closed (its writer, this process, still runs); anomalies at step 2."""
    d = tmp_path_factory.mktemp("run")
    write_rank_log(rank_dir(d, 0), rank=0, steps=range(6), seed=0)
    with LogWriter(rank_dir(d, 0), rank=0, world_size=2, run_id="run-x", flush_interval=0.02) as w:
        w.write(RunResumed(rank=0, step=4, wall=2000.0, last_step=3, reason="append_output"))
        ids = w.intern(["embed.weight"], step=4)
        for s in (4, 5, 6):
            w.write(stats_record(0, s, "param", ids, np.full((1, 6), 100.0 * s, np.float32)))
            w.write(StepEnded(rank=0, step=s, wall=2000.0 + s, duration=2.5, collected=True))
    write_rank_log(rank_dir(d, 1), rank=1, steps=range(5), seed=1, close=False)
    return d


def test_grid_folds_bins_keeping_the_largest_and_the_smallest_min():
    grid = KindGrid("param", first_step=0, max_bins=2)
    rows = grid.rows_of(["a", "b"])
    for step in range(3):
        grid.add(step, rows, OPS, np.array([[step, 10 * step, 1, 1, 0, 0], [-step, 1, 1, 1, 0, 0]], np.float32))
    assert grid.width == 2 and grid.bins == 2  # step 2 needed a third bin: folded to width 2
    for step in range(3, 8):
        grid.add(step, rows, OPS, np.array([[step, 10 * step, 1, 1, 0, 0], [-step, 1, 1, 1, 0, 0]], np.float32))
    assert grid.width == 4 and grid.bins == 2
    assert grid.matrix("min")[0].tolist() == [0, 4] and grid.matrix("min")[1].tolist() == [-3, -7]
    assert grid.matrix("max")[0].tolist() == [30, 70]
    grid.add(5, rows[:1], ("norm",), np.array([[99.0]], np.float32))
    assert grid.matrix("norm")[0].tolist() == [1, 99] and grid.bin_of(5) == 1
    grid.add(-4, rows[:1], ("norm",), np.array([[5.0]], np.float32))  # before the first step: shifted right
    grid.finish()
    assert grid.bins <= 2 and grid.first_step <= -4 and grid.matrix("norm")[0].tolist()[0] == 5.0


def test_model_of_a_run(run_dir):
    run = open_run(str(run_dir))
    builder = ReportBuilder(ranks=2)
    builder.feed(run.events())
    model = builder.model()
    assert model.step_counts == {0: 7, 1: 5}
    kinds = [g.kind for g in model.kinds]
    assert kinds[:2] == ["actv", "actv_grad"] and "param" in kinds
    param = next(g for g in model.kinds if g.kind == "param")
    row = param.index["rank 0 embed.weight"]
    assert param.matrix("norm")[row, 6] == 600.0  # the resumed launch's step 6
    assert [(a["step"], a["rank"], a["kind"]) for a in model.anomalies] == [(2, 0, "grad_reduced"), (2, 1, "grad_reduced")]
    grad = next(g for g in model.kinds if g.kind == "grad_reduced")
    a = model.anomalies[1]
    assert grad.labels[a["row"]] == "rank 1 embed.weight" and a["col"] == 2
    assert [m["type"] for m in model.marks].count("resume") == 1


def test_log_codes_keep_a_tenth_of_a_percent():
    v = np.array([[np.nan, 0.0, np.inf, -np.inf, 1e-8, -3.5, 7e5]], np.float32)
    codes, (lo, hi) = log_codes(v)
    assert codes[0, :4].tolist() == [0, 1, 2, 3] and codes[0, 5] & 0x8000
    mag = (codes[0, 4:] & 0x7FFF).astype(float)
    back = 10 ** (lo + (mag - 4) / (0x7FFF - 4) * (hi - lo)) * np.where(codes[0, 4:] & 0x8000, -1, 1)
    assert np.allclose(back, v[0, 4:], rtol=1e-3)


def test_cli_writes_one_file_and_refuses_bad_arguments(run_dir, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", str(run_dir), "-o", str(out), "--curve", "head"]) == 0
    text = out.read_text()
    assert "http://" not in text.replace("http://www.w3.org", "") and "https://" not in text and "src=" not in text
    assert "2 anomalies" in capsys.readouterr().out
    assert main(["report", str(run_dir), "-o", str(out), "--curve", "("]) == 2
    assert "not a regular expression" in capsys.readouterr().err


def _browser():
    return headless_chromium("1300,1800")


def test_the_page_in_headless_chromium(run_dir, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", str(run_dir), "-o", str(out), "--curve", "rank 1 head.weight"]) == 0
    browser = _browser()
    try:
        from selenium.webdriver.common.by import By

        browser.get(out.as_uri())
        assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1"
        heat = browser.find_element(By.ID, "heatmap")
        assert int(heat.get_attribute("width")) > 0 and int(heat.get_attribute("height")) > 0
        ending = browser.find_element(By.ID, "ending").text
        assert "rank 0: clean" in ending and "rank 1: running" in ending  # (its writer: this process)
        links = browser.find_elements(By.CSS_SELECTOR, "#anomalies a.anomaly-link")
        assert len(links) == 2
        links[1].click()
        sel = browser.execute_script("return window.trainrecReport.sel")
        assert (sel["kind"], sel["op"], sel["col"], sel["anomaly"]) == ("grad_reduced", "norm", 2, 1)
        labels = browser.execute_script("return JSON.parse(document.getElementById('model').textContent).kinds"
                                        ".find(k => k.kind === 'grad_reduced').labels")
        assert labels[sel["row"]] == "rank 1 embed.weight"
        assert "rank 1 embed.weight at step 2" in browser.find_element(By.ID, "selection").text
        assert browser.find_element(By.CSS_SELECTOR, "#anomalies tr.on").get_attribute("data-i") == "1"
        # another kind: its matrices are decoded then, and drawn
        browser.find_element(By.CSS_SELECTOR, "#kinds button[data-kind='actv']").click()
        assert browser.execute_script("return window.trainrecReport.kind") == "actv"
        browser.save_screenshot(str(tmp_path / "report.png"))
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
    finally:
        browser.quit()
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_a_page_without_anomalies_or_statistics_loads_cleanly(tmp_path):
    """The pages of a run with no anomalies, and of one with no statistics at all (steps only)."""
    write_rank_log(rank_dir(tmp_path / "quiet", 0), rank=0, steps=range(3), anomalies=False)
    with LogWriter(rank_dir(tmp_path / "bare", 0), rank=0, world_size=1, run_id="bare", flush_interval=0.02) as w:
        for s in range(3):
            w.write(StepEnded(rank=0, step=s, wall=1.0 + s, duration=0.1, collected=False))
    browser = _browser()
    try:
        from selenium.webdriver.common.by import By

        for name, has_stats in (("quiet", True), ("bare", False)):
            out = tmp_path / f"{name}.html"
            assert main(["report", str(tmp_path / name), "-o", str(out)]) == 0
            browser.get(out.as_uri())
            assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1"
            assert "no anomalies recorded" in browser.find_element(By.ID, "anomalies").text
            assert bool(browser.find_elements(By.CSS_SELECTOR, "#kinds button")) == has_stats
            assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    finally:
        browser.quit()


def test_how_a_run_ended_a_writer_that_died_mid_write(tmp_path):
    """A log written by a process now gone, cut inside its last record: crashed, with file and offset."""
    import glob
    import subprocess

    from trainrec.tools.cmd_report import endings

    helpers = os.path.join(os.path.dirname(__file__), "..", "analyzers")
    code = (f"import sys; sys.path.insert(0, {helpers!r})\n"
            "from export_logs import write_rank_log\n"
            f"write_rank_log({rank_dir(tmp_path / 'out', 0)!r}, rank=0, steps=range(2), anomalies=False)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    (log,) = glob.glob(str(tmp_path / "out" / "*" / "*.trl"))
    size = os.path.getsize(log)
    os.truncate(log, size - 3)  # (the FileClosed record, cut short)
    (end,) = endings(open_run(str(tmp_path / "out")))
    assert end["state"] == "crashed" and os.path.basename(log) in end["text"] and "torn record at byte" in end["text"]
