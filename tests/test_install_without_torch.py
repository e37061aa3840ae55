"""`pip install trainrec` without torch: replay, the analyzers and the CLI work; the recorder says what to install.

A fresh venv (no torch in it) gets a plain ``pip install`` of a copy of this source tree, its
dependencies from the package index (pip's cache is reused). Then ``trainrec inspect``, ``check``,
``anomalies`` and ``export csv`` on golden logs must give what the development install (with torch)
gives, and ``import trainrec.recorder`` must fail with the message that names ``pip install torch``.
Needs the package index: ``-m 'not network'`` leaves it out offline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.network

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "v1")
with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as _f:  # the folders package-dir maps
    SUBPACKAGES = tuple(re.findall(r'^"trainrec\.\w+" = "(\w+)"$', _f.read(), flags=re.M))
DEV_TRAINREC = os.path.join(os.path.dirname(sys.executable), "trainrec")  # the dev install's command


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory):
    """A venv with trainrec installed from a copy of the source tree (so no build files land in the
    checkout), and no torch."""
    assert "recorder" in SUBPACKAGES and "tools" in SUBPACKAGES, SUBPACKAGES
    base = tmp_path_factory.mktemp("no_torch")
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(os.path.join(ROOT, name), src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for name in SUBPACKAGES:
        shutil.copytree(os.path.join(ROOT, name), src / name, ignore=skip)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          str(src)], capture_output=True, text=True, timeout=900, check=False)
    assert pip.returncode == 0, f"pip install of trainrec without torch failed:\n{pip.stdout}\n{pip.stderr}"
    return venv


def _run(argv: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, cwd=cwd)


def test_the_venv_has_no_torch(bare_venv, tmp_path):
    proc = _run([str(bare_venv / "bin" / "python"), "-c", "import torch"], tmp_path)
    assert proc.returncode != 0 and "No module named 'torch'" in proc.stderr


@pytest.mark.parametrize("argv", [
    ["inspect", "every_event.trl"],
    ["check", "logwriter.trl"],
    ["check", "torn_tail.trl"],
    ["anomalies", "every_event.trl", "--rule", "NaNInf"],
], ids=lambda a: "-".join(a[:2]))
def test_replay_commands_match_the_torch_install(bare_venv, tmp_path, argv):
    command = [argv[0], os.path.join(GOLDEN, argv[1]), *argv[2:]]
    bare = _run([str(bare_venv / "bin" / "trainrec"), *command], tmp_path)
    dev = _run([DEV_TRAINREC, *command], tmp_path)
    assert "Traceback" not in bare.stderr, bare.stderr
    assert (bare.returncode, bare.stdout, bare.stderr) == (dev.returncode, dev.stdout, dev.stderr)
    assert bare.stdout.strip(), f"trainrec {argv[0]} printed nothing"


@pytest.mark.parametrize("golden", ["every_event.trl", "logwriter.trl"])
def test_export_csv_matches_the_torch_install(bare_venv, tmp_path, golden):
    log = os.path.join(GOLDEN, golden)
    outputs = {}
    for label, trainrec in (("bare", str(bare_venv / "bin" / "trainrec")), ("dev", DEV_TRAINREC)):
        out = tmp_path / label
        proc = _run([trainrec, "export", "csv", log, "-o", str(out)], tmp_path)
        assert proc.returncode == 0, proc.stderr
        files = {}
        for dirpath, _dirs, names in os.walk(out):
            for name in names:
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    files[os.path.relpath(path, out)] = f.read()
        manifest = json.loads(files.pop(".trainrec-export.json"))
        manifest.pop("created")  # (a time stamp)
        outputs[label] = files, manifest
    files, manifest = outputs["bare"]
    assert files == outputs["dev"][0] and manifest == outputs["dev"][1]
    assert manifest["source"] == log and manifest["format"] == "csv"
    csvs = [text for name, text in files.items() if name.endswith(".csv")]
    assert csvs and all(len(text.splitlines()) >= 2 for text in csvs), files  # a header and rows in each


def test_importing_the_recorder_says_how_to_install_torch(bare_venv, tmp_path):
    proc = _run([str(bare_venv / "bin" / "python"), "-c", "import trainrec.recorder"], tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: trainrec.recorder records PyTorch training and needs torch")
    assert "`pip install torch`" in last and "trainrec[torch]" in last
    assert "During handling" not in proc.stderr  # one error, not torch's chained under ours
    for module in ("trainrec.integrations.accelerate", "trainrec.recorder.fused"):  # the recorder behind them
        proc = _run([str(bare_venv / "bin" / "python"), "-c", f"import {module}"], tmp_path)
        assert "`pip install torch`" in proc.stderr.strip().splitlines()[-1], (module, proc.stderr)


def test_the_live_export_process_starts_without_torch(bare_venv, tmp_path):
    """What the recorder starts by module name (a runtime edge recorder -> tools) needs no torch itself."""
    proc = _run([str(bare_venv / "bin" / "python"), "-m", "trainrec.tools.live_export", "--help"], tmp_path)
    assert proc.returncode == 0 and "--rank-dir" in proc.stdout, proc.stderr
