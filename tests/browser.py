"""A real headless Chromium for the tests of HTML pages (Debian's chromium and chromium-driver, through
selenium); the test is skipped, saying what to install, where they are absent."""

from __future__ import annotations

import shutil

import pytest


def headless_chromium(window: str = "1400,1100"):
    """A selenium Chrome driver on a headless Chromium, logging the page's console (``browser``)."""
    binary = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no Chromium and chromedriver here (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", f"--window-size={window}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=opts)
