"""``python -m trainrec.tools.anomaly_analyse``: the reference's anomaly JSON and trainrec runs, the
reference's output schema, bad input; checked against files written by mindstudio-probe 1.2.1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from trainrec.analyzers.ranking import kind_of_tag
from trainrec.tools.anomaly_analyse import main

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "analyzers"))
from anomaly_logs import write_rank  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "anomaly_data")
ALERT = {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True}
FIELDS = ["rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id", "tag_name", "message", "group_mates"]
MSPROBE_PY = os.path.join(HERE, os.pardir, os.pardir, "benchmarks", ".venv-msprobe", "bin", "python")


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def analyse(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def reference_dir(tmp_path):
    d = tmp_path / "anomaly_detected"
    shutil.copytree(os.path.join(GOLDEN, "msprobe-1.2.1"), d)
    return d


@pytest.fixture(scope="module")
def our_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("out"))
    dump = os.path.join(out, "anomaly_detected")
    write_rank(out, 0, alert=ALERT, dump_dir=dump, inject=(20, 3, 100.0), steps=26, seed=3)
    write_rank(out, 1, alert=ALERT, dump_dir=dump, inject=(20, 1, 100.0), steps=26, seed=3)
    return out


def test_reference_files_rank_like_the_reference_except_params(reference_dir, capsys):
    code, out, err = analyse(capsys, "-d", reference_dir, "-k", 1000)
    assert code == 0, err
    ours = json.loads((reference_dir / "anomaly_analyse.json").read_text())
    with open(os.path.join(GOLDEN, "msprobe-1.2.1-anomaly_analyse-all.json")) as f:
        theirs = json.load(f)
    with open(os.path.join(GOLDEN, "msprobe-1.2.1", "rank0", "anomaly.json")) as f:
        dumped = json.load(f)
    assert set(ours) == set(theirs) == set(dumped)
    assert all(ours[k] == dumped[k] and list(ours[k]) == FIELDS for k in ours)  # entries pass through as they are
    # the same order for everything but parameter tags, which the reference sorted first in each step
    non_param = [k for k in theirs if kind_of_tag(theirs[k]["tag_name"]) != "param"]
    assert [k for k in ours if k in set(non_param)] == non_param
    for step in {v["step"] for v in ours.values()}:
        keys = [k for k in ours if ours[k]["step"] == step]
        kinds = [kind_of_tag(ours[k]["tag_name"]) for k in keys]
        if "param" in kinds:
            # parameters sit at the optimizer step: after every forward/backward/reduction anomaly
            first_param = kinds.index("param")
            assert all(k == "param" for k in kinds[first_param:])
            ref_kinds = [kind_of_tag(theirs[k]["tag_name"]) for k in theirs if theirs[k]["step"] == step]
            assert ref_kinds[0] == "param"
    assert out.startswith(f"Top {len(ours)} of {len(dumped)} anomaly entries in execution order")


def test_top_k_and_steps_on_reference_files(reference_dir, capsys, tmp_path):
    code, out, _ = analyse(capsys, "-d", reference_dir, "-k", 3, "-s", "[9, 10]", "-o", tmp_path / "res")
    assert code == 0
    top = json.loads((tmp_path / "res" / "anomaly_analyse.json").read_text())
    assert len(top) == 3 and {v["step"] for v in top.values()} == {9}
    # step 9, the injection: the first anomaly in execution order is the forward pass
    assert next(iter(top)) == "0:fc1_0/rank0/output_step_9_call_1"
    assert out.splitlines()[1] == "0: " + top["0:fc1_0/rank0/output_step_9_call_1"]["message"]
    dumped = json.loads((reference_dir / "rank0" / "anomaly.json").read_text())
    at_steps = sum(v["step"] in (9, 10) for v in dumped.values())
    assert 3 < at_steps < len(dumped)  # the count is of the selected steps, not of all of them
    assert out.splitlines()[0].startswith(f"Top 3 of {at_steps} anomaly entries at steps 9,10 in execution order")
    code, _, _ = analyse(capsys, "-d", reference_dir, "-k", 2, "-o", tmp_path / "x.json")
    assert code == 0 and len(json.loads((tmp_path / "x.json").read_text())) == 2



def test_written_with_the_reference_permissions(reference_dir, capsys, tmp_path):
    # the reference's anomaly_analyse.json is rw-r----- (msprobe's save_json), as everything trainrec writes
    old = os.umask(0o022)
    try:
        code, _, _ = analyse(capsys, "-d", reference_dir, "-k", 3)
        assert code == 0
        assert oct((reference_dir / "anomaly_analyse.json").stat().st_mode & 0o777) == "0o640"
        code, _, _ = analyse(capsys, "-d", reference_dir, "-k", 3, "-o", tmp_path / "new" / "res")
        assert code == 0
        assert oct((tmp_path / "new" / "res" / "anomaly_analyse.json").stat().st_mode & 0o777) == "0o640"
        assert oct((tmp_path / "new" / "res").stat().st_mode & 0o777) == "0o750"
        assert oct((tmp_path / "new").stat().st_mode & 0o777) == "0o750"
    finally:
        os.umask(old)

def test_a_trainrec_run_in_the_reference_schema(our_run, capsys):
    code, out, err = analyse(capsys, "-d", our_run, "-k", 4)
    assert code == 0, err
    top = load(os.path.join(our_run, "anomaly_analyse.json"))
    assert len(top) == 4
    assert all(list(v) == FIELDS for v in top.values())
    first = next(iter(top.values()))
    # rank 1's anomaly is at layer 1, earlier in the forward pass than rank 0's at layer 3
    assert (first["rank"], first["step"], first["tag_name"]) == (1, 20, "0:layer1_0/rank1/output")
    # a rank directory and a log file work too; the latter writes beside the log
    rank_dir = next(os.path.join(our_run, d) for d in sorted(os.listdir(our_run)) if "-rank0-" in d)
    code, _, _ = analyse(capsys, "-d", rank_dir, "-k", 1)
    top0 = load(os.path.join(rank_dir, "anomaly_analyse.json"))
    assert code == 0 and next(iter(top0.values()))["tag_name"] == "0:layer3_0/rank0/output"


def test_the_dump_of_a_trainrec_run_ranks_the_same_as_its_log(our_run, capsys, tmp_path):
    code, _, _ = analyse(capsys, "-d", our_run, "-k", 6, "-o", tmp_path / "from_log.json")
    assert code == 0
    code, _, _ = analyse(capsys, "-d", os.path.join(our_run, "anomaly_detected"), "-k", 6, "-o", tmp_path / "from_json.json")
    assert code == 0
    from_log = json.loads((tmp_path / "from_log.json").read_text())
    from_json = json.loads((tmp_path / "from_json.json").read_text())
    assert list(from_log) == list(from_json)


def test_a_malformed_file_among_good_ones(reference_dir, capsys, tmp_path):
    (reference_dir / "rank1").mkdir()
    (reference_dir / "rank1" / "anomaly.json").write_text('{"0:x_step_1_call_0": {"rank": 1,')
    (reference_dir / "rank2").mkdir()
    (reference_dir / "rank2" / "anomaly.json").write_text(json.dumps({"k": {"rank": 2, "step": "one"}}))
    code, out, err = analyse(capsys, "-d", reference_dir, "-k", 5)
    assert code == 0
    assert f"{reference_dir / 'rank1' / 'anomaly.json'}: not valid JSON" in err
    assert "rank2" in err and "'k' lacks" in err
    assert len(json.loads((reference_dir / "anomaly_analyse.json").read_text())) == 5
    assert out.startswith("Top 5 of 117 anomaly entries")


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["-k", "0"], "the top k number must be greater than 0"),
        (["-k", "-3"], "the top k number must be greater than 0"),
        (["-s", "[100, 101]"], "steps 100,101 are outside the recorded range"),
        (["-s", "{1: 2}"], "bad step range"),
    ],
)
def test_bad_arguments(reference_dir, capsys, argv, text):
    code, _, err = analyse(capsys, "-d", reference_dir, *argv)
    assert code == 2
    assert text in err
    assert not (reference_dir / "anomaly_analyse.json").exists()


def test_no_anomalies_and_no_data(tmp_path, capsys):
    empty = tmp_path / "empty"
    (empty / "rank0").mkdir(parents=True)
    (empty / "rank0" / "anomaly.json").write_text("{}")
    code, out, _ = analyse(capsys, "-d", empty)
    assert code == 0 and "no anomalies found" in out
    assert json.loads((empty / "anomaly_analyse.json").read_text()) == {}
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    code, _, err = analyse(capsys, "-d", nothing)
    assert code == 2 and "no anomaly data here" in err
    code, _, err = analyse(capsys, "-d", tmp_path / "missing")
    assert code == 2 and "no such file or directory" in err
    broken = tmp_path / "broken"
    (broken / "rank0").mkdir(parents=True)
    (broken / "rank0" / "anomaly.json").write_text("not json")
    code, _, err = analyse(capsys, "-d", broken)
    assert code == 2 and "could be read" in err


def test_module_entry_point(reference_dir):
    proc = subprocess.run([sys.executable, "-m", "trainrec.tools.anomaly_analyse", "-d", str(reference_dir), "-k", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Top 2 of 117 anomaly entries")


@pytest.mark.skipif(not os.path.exists(MSPROBE_PY), reason="the reference's venv (benchmarks/.venv-msprobe) is absent")
def test_the_reference_tool_reads_our_dump_and_agrees(our_run, tmp_path, capsys):
    d = tmp_path / "anomaly_detected"
    shutil.copytree(os.path.join(our_run, "anomaly_detected"), d, ignore=shutil.ignore_patterns("anomaly_analyse.json"))
    proc = subprocess.run([MSPROBE_PY, "-m", "msprobe.pytorch.monitor.anomaly_analyse", "-d", str(d), "-k", "1000"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = load(d / "anomaly_analyse.json")
    code, _, _ = analyse(capsys, "-d", d, "-k", 1000, "-o", tmp_path / "ours.json")
    ours = load(tmp_path / "ours.json")
    assert code == 0 and len(theirs) > 20
    assert ours == theirs  # the same entries, untouched
    # the same order (no parameter anomalies here); the reference breaks ties between ranks by
    # directory listing order, trainrec by rank
    def point(v):
        return (v["step"], v["micro_step"], v["call_id"])

    assert [point(v) for v in ours.values()] == [point(v) for v in theirs.values()]
    vals = list(ours.values())
    assert all(a["rank"] <= b["rank"] for a, b in zip(vals, vals[1:], strict=False) if point(a) == point(b))
