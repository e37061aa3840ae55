"""The one progress bar: drawn on a terminal (a real pseudo-terminal here) by every command that reads
a whole run, in the export's style; nothing where stderr is not a terminal."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "analyzers"))

from export_logs import rank_dir, write_rank_log  # noqa: E402
from trainrec.tools.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    for r in range(2):
        write_rank_log(rank_dir(d, r), rank=r, steps=range(4), seed=r)
    return d


def _on_a_terminal(argv: list[str]) -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal and no delay before the bar; (exit code, stderr text)."""
    code = ("import sys, trainrec.tools.progress as p; p.DELAY = 0.0\n"
            "from trainrec.tools.cli import main\n"
            f"sys.exit(main({argv!r}))\n")
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=slave)
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # the other end closed
                break
            if not data:
                break
            chunks.append(data)
        return proc.wait(timeout=120), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(master)


@pytest.mark.parametrize("argv", [
    ["inspect", "{run}"],
    ["check", "{run}"],
    ["anomalies", "{run}"],
    ["report", "{run}", "-o", "{tmp}/r.html"],
    ["export", "parquet", "{run}", "-o", "{tmp}/pq"],
])
def test_commands_that_read_a_run_draw_the_bar_on_a_terminal(run_dir, tmp_path, argv):
    if "parquet" in argv:
        pytest.importorskip("pyarrow")
    args = [a.format(run=run_dir, tmp=tmp_path) for a in argv]
    rc, err = _on_a_terminal(args)
    assert rc == 0, err
    label = "export parquet" if "parquet" in argv else argv[0]
    lines = [line for line in err.replace("\r\n", "\n").split("\n") if f"\r{label} [" in line]
    assert len(lines) == 1, err  # one line, redrawn in place
    final = lines[0].rsplit("\r", 1)[-1]
    assert final.startswith(f"{label} [{'#' * 30}] 100% ") and " MB " in final and final.endswith(" s")


def test_nothing_is_drawn_off_a_terminal(run_dir, tmp_path, capsys):
    assert main(["report", str(run_dir), "-o", str(tmp_path / "r.html")]) == 0
    assert "[" not in capsys.readouterr().err
