"""The graph viewer in a real headless Chromium, from file://: it loads without console errors, expands
a node, finds one by name, changes step (colours follow), fills the node table with both sides'
statistics, and filters unmatched nodes. Screenshots are left in the test's tmp_path."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "analyzers"))

from browser import headless_chromium  # noqa: E402
from graph_runs import DUMP_DIR, copy_dump, record_run  # noqa: E402
from trainrec.tools.cli import main  # noqa: E402

SCALED = "Module.blk.Scaled.forward.0"


def _browser():
    return headless_chromium("1400,1100")


def _row(browser, side: str, name: str):
    from selenium.webdriver.common.by import By

    rows = browser.find_elements(By.CSS_SELECTOR, f"#tree-{side} .row[data-name='{name}']")
    return rows[0] if rows else None


def test_compare_page_expand_search_step_table(tmp_path):
    bench = record_run(tmp_path / "bench", steps=3)
    scaled = record_run(tmp_path / "scaled", steps=3, scale_at=1)
    assert main(["graph", "compare", scaled, bench, "-o", str(tmp_path / "out")]) == 0
    browser = _browser()
    try:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys
        from selenium.webdriver.support.ui import Select

        browser.get((tmp_path / "out" / "compare.html").as_uri())
        assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1"
        assert "First divergence: step 1, node " + SCALED in browser.find_element(By.ID, "verdict").text
        # lazily drawn: the top module's children exist only once it is expanded
        assert _row(browser, "debug", SCALED) is None
        _row(browser, "debug", "Module.Net.forward.0").find_element(By.CLASS_NAME, "tog").click()
        assert _row(browser, "debug", SCALED) is not None and _row(browser, "bench", SCALED) is None
        assert _row(browser, "debug", SCALED).get_attribute("data-bucket") == "pass"  # step 0
        # another step: the scaled node is an error on both sides
        Select(browser.find_element(By.ID, "step")).select_by_visible_text("step 1")
        assert _row(browser, "debug", SCALED).get_attribute("data-bucket") == "error"
        # search: expands the path on both sides, selects the first hit and fills the table
        box = browser.find_element(By.ID, "search")
        box.send_keys("blk.lin.Linear.forward", Keys.ENTER)
        assert browser.find_element(By.ID, "search-count").text == "2 found"
        hit = _row(browser, "debug", "Module.blk.lin.Linear.forward.0")
        assert "sel" in hit.get_attribute("class") and hit.get_attribute("data-bucket") == "pass"
        box.send_keys(Keys.ENTER)  # the next hit: the bench side's node
        assert "sel" in _row(browser, "bench", "Module.blk.lin.Linear.forward.0").get_attribute("class")
        _row(browser, "debug", SCALED).click()
        assert browser.find_element(By.ID, "node-name").text.startswith(SCALED)
        heads = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#node-table th")]
        cells = {tr.get_attribute("data-port"): dict(zip(heads, [td.text for td in tr.find_elements(By.TAG_NAME, "td")],
                                                         strict=True))
                 for tr in browser.find_elements(By.CSS_SELECTOR, "#node-table tr[data-port]")}
        assert set(cells) == {"input.0", "output.0"}
        out = cells["output.0"]
        assert float(out["debug Norm"]) == pytest.approx(2 * float(out["bench Norm"]), rel=1e-5)
        assert float(out["NormRelativeErr"]) == pytest.approx(1.0, rel=1e-5)
        assert float(out["MaxRelativeErr"]) == pytest.approx(1.0, rel=1e-5)
        assert float(cells["input.0"]["NormRelativeErr"]) == 0
        browser.save_screenshot(str(tmp_path / "compare.png"))
        assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    finally:
        browser.quit()
    assert (tmp_path / "compare.png").stat().st_size > 10_000


def test_unmatched_filter_on_a_dump_comparison(tmp_path):
    bench = copy_dump(tmp_path)
    for step in (0, 1):
        path = os.path.join(bench, f"step{step}", "rank", "dump.json")
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(text.replace('"Functional.relu.0.forward"', '"Functional.gelu.0.forward"'))
    assert main(["graph", "compare", DUMP_DIR, bench, "-o", str(tmp_path / "out")]) == 0
    browser = _browser()
    try:
        from selenium.webdriver.common.by import By

        browser.get((tmp_path / "out" / "compare.html").as_uri())
        relu = _row(browser, "debug", "Functional.relu.0.forward")
        assert "unm" in relu.get_attribute("class")
        assert "unm" not in _row(browser, "debug", "Module.fc1.Linear.forward.0").get_attribute("class")
        browser.find_element(By.ID, "unmatched").click()
        shown = [r.get_attribute("data-name") for r in browser.find_elements(By.CSS_SELECTOR, "#tree-debug .row")]
        assert shown == ["Functional.relu.0.forward"]
        shown = [r.get_attribute("data-name") for r in browser.find_elements(By.CSS_SELECTOR, "#tree-bench .row")]
        assert shown == ["Functional.gelu.0.forward"]
        relu = _row(browser, "debug", "Functional.relu.0.forward")
        relu.click()
        assert "File train.py" in browser.find_element(By.ID, "stack").text
        heads = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#node-table th")]
        row = browser.find_element(By.CSS_SELECTOR, "#node-table tr[data-port='output.0']")
        assert dict(zip(heads, [td.text for td in row.find_elements(By.TAG_NAME, "td")], strict=True))[
            "dtype, shape"] == "float32 [4, 16]"
        browser.save_screenshot(str(tmp_path / "unmatched.png"))
        assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    finally:
        browser.quit()


def test_ranks_page_selects_a_rank(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("TRAINREC_RUN_ID", "page-ranks")
    for rank, scale_at in ((0, None), (1, None), (2, 1)):
        monkeypatch.setenv("RANK", str(rank))
        record_run(out, steps=3, scale_at=scale_at)
    assert main(["graph", "ranks", str(out), "--scope", "all", "-o", str(tmp_path / "r")]) == 0
    assert "FIRST DEPARTURE: rank 2 at step 1" in capsys.readouterr().out
    browser = _browser()
    try:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import Select

        browser.get((tmp_path / "r" / "ranks.html").as_uri())
        assert browser.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1"
        ranks = Select(browser.find_element(By.ID, "rank"))
        assert [o.text for o in ranks.options] == ["rank 1 vs rank 0", "rank 2 vs rank 0"]
        assert "No divergence" in browser.find_element(By.ID, "verdict").text
        ranks.select_by_visible_text("rank 2 vs rank 0")
        assert "First divergence: step 1, node " + SCALED in browser.find_element(By.ID, "verdict").text
        assert "(rank 2)" in browser.find_element(By.CSS_SELECTOR, "#pane-debug h2").text
        assert "(rank 2) vs" in browser.find_element(By.ID, "title").text
        browser.find_element(By.ID, "goto-first").click()  # jumps to the step and the node
        assert Select(browser.find_element(By.ID, "step")).first_selected_option.text == "step 1"
        row = _row(browser, "debug", SCALED)
        assert "sel" in row.get_attribute("class") and row.get_attribute("data-bucket") == "error"
        assert _row(browser, "bench", SCALED).get_attribute("data-bucket") == "error"  # its counterpart shown too
        browser.save_screenshot(str(tmp_path / "ranks.png"))
        assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    finally:
        browser.quit()
