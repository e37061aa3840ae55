"""Helpers of the LogWriter tests: rank directories, sample records, reading back, waiting, and small
scripts run in a child process with this interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

from trainrec.recorder.writer import LogWriter
from trainrec.replay.reader import LogReader, read_log
from trainrec.schema.events import OPS, Event, TensorStatsRecorded, pack_array

TIMEOUT = 60  # seconds any subprocess or wait may take on a loaded machine


def rank_dir(tmp_path, rank: int = 0) -> str:
    return str(tmp_path / f"Nov30_11-13-33-rank{rank}-0000abcd")


def stats_event(step: int, ids: list[int], rank: int = 0) -> TensorStatsRecorded:
    n = len(ids)
    return TensorStatsRecorded(
        rank=rank,
        step=step,
        wall=100.0 + step,
        kind="actv",
        ops=OPS,
        name_ids=pack_array("I", ids),
        values=pack_array("f", [step + r * 0.5 + o for r in range(n) for o in range(len(OPS))]),
        micro_steps=pack_array("H", [1] * n),
        call_ids=pack_array("I", range(n)),
        slots=bytes([2] * n),
        vpp_stages=bytes(n),
    )


def read(path: str) -> tuple[LogReader, list[Event]]:
    reader, events = read_log(path)
    return reader, events


def wait_for(predicate, what: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    delay = 0.005
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def script(body: str) -> str:
    return textwrap.dedent(body)


def spawn(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=TIMEOUT, check=False
    )


def stall(w: LogWriter) -> threading.Event:
    """Park the worker inside a deferred callable until the returned event is set."""
    release = threading.Event()
    entered = threading.Event()

    def park():
        entered.set()
        release.wait(TIMEOUT)
        return ()

    w.write(park)
    assert entered.wait(TIMEOUT)
    return release
