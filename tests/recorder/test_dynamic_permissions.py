"""Permission denied (reading the config, writing switch=false back) never stops training.

Root ignores file permissions, so when the tests run as root the scenario runs in a child process
whose capability bounding set lacks CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (``setpriv``): it is still
uid 0 and owns the files, but their permission bits now apply to it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

SCENARIO = r"""
import json, logging, os, sys, time
from trainrec.recorder.dynamic import DynamicConfigWatcher
from trainrec.schema.events import ConfigChanged, ConfigRejected

d = sys.argv[1]
path = os.path.join(d, "config.json")
with open(path, "w") as f:
    json.dump({"switch": False, "collect_times": 1}, f, indent=2)
warnings = []
class H(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())
logging.getLogger("trainrec").addHandler(H())
events, updates = [], []
w = DynamicConfigWatcher(path, validate=dict, emit=events.append, rank=0, writes_back=True, health_interval=0.2)
w.start()
step = 0
def until(pred, what, timeout=10.0):
    global step
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        u = w.poll(step)
        if u is not None:
            updates.append(step)
        step += 1
        time.sleep(0.002)
        if pred():
            return
    raise SystemExit(f"timed out waiting for {what}")
n_rej = lambda: sum(isinstance(e, ConfigRejected) for e in events)
until(lambda: step > 5, "a few steps")
os.chmod(path, 0)
until(lambda: n_rej() == 1, "the read to be refused")
until(lambda: step > 60, "more steps")  # one message, not one per step
os.chmod(path, 0o644)
until(lambda: w._agreed_identity == w._latest.identity and w._latest.kind == "valid", "readable again")
with open(path, "w") as f:
    json.dump({"switch": True, "collect_times": 1}, f, indent=2)
until(lambda: updates, "the start")
os.chmod(d, 0o555)
w.collection_finished(step)
until(lambda: n_rej() == 2, "the failed write-back to be reported")
until(lambda: step > updates[0] + 60, "more steps")
os.chmod(d, 0o755)
w.close()
out = {
    "warnings": warnings,
    "updates": updates,
    "rejected": [[e.step, e.reason, list(e.keys)] for e in events if isinstance(e, ConfigRejected)],
    "changed": [[e.step, list(e.changed_keys)] for e in events if isinstance(e, ConfigChanged)],
    "file": open(path).read(),
}
print(json.dumps(out))
"""


def test_permission_denied_read_and_write_back(tmp_path):
    cmd = [sys.executable, "-c", SCENARIO, str(tmp_path)]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: permissions cannot be denied")
        cmd = [setpriv, "--bounding-set=-dac_override,-dac_read_search", *cmd]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        os.chmod(tmp_path, 0o755)
    if proc.returncode != 0:
        pytest.fail(f"scenario failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (read_rej, write_rej) = out["rejected"]
    assert "cannot read config file" in read_rej[1] and "Permission denied" in read_rej[1]
    assert read_rej[1].endswith("monitoring stays off") and read_rej[2] == []
    assert "could not write switch=false back" in write_rej[1] and ": Permission denied;" in write_rej[1]
    assert write_rej[2] == ["switch"]
    assert len(out["warnings"]) == 2  # exactly one message per problem
    assert len(out["updates"]) == 1  # training went on; the start happened once the file was readable
    assert json.loads(out["file"])["switch"] is True  # the write-back could not happen
