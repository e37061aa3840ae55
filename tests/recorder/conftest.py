"""Fixtures shared by the recorder tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def out(tmp_path, monkeypatch):
    """The monitor's output directory for this test (``MONITOR_OUTPUT_DIR``), dynamic mode off."""
    d = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(d))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    return d
