"""Every command on logs with hostile records (valid CRCs, absurd contents): a clear line naming file
and offset, never a traceback, bounded memory; ``check`` reports them as damage."""

from __future__ import annotations

import glob
import os
import struct
import sys
import threading

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "replay"))
from hostile_logs import STAMP, F, good_log, rewrite  # noqa: E402
from trainrec.tools.cli import main  # noqa: E402

_CASES = {
    "slot_250": ("ts", lambda w: w.__setitem__(F + 7, bytes([250, 250])), "slot 250 is not a known slot"),
    "group_mates_str": ("fo", lambda w: w.__setitem__(F + 11, ["a", None]), "group_mates holds 'a'"),
    "world_size_huge": ("fo", lambda w: w.__setitem__(F + 1, 2**40), "world size 1099511627776"),
    "first_id_huge": ("nm", lambda w: w.__setitem__(F, 2**40), "first name id 1099511627776"),
    "name_ids_unknown": ("ts", lambda w: w.__setitem__(F + 3, b"\xff" * 8), "name id 4294967295 was never interned"),
}


@pytest.fixture(params=sorted(_CASES))
def hostile(request, tmp_path):
    tag, change, what = _CASES[request.param]
    out = str(tmp_path / "out")
    path = good_log(out)
    offset = rewrite(path, tag, change)
    return out, path, offset, what


_COMMANDS = [
    ["inspect"],
    ["dump"],
    ["dump", "--per-record"],
    ["anomalies"],
    ["anomalies", "--rule", "AnomalyTurbulence", "--threshold", "0.3"],
    ["export", "csv"],
    ["export", "tb"],
    ["export", "parquet"],
    ["report"],
]


def test_check_reports_the_record_as_damage(hostile, capsys):
    out, path, offset, what = hostile
    assert main(["check", out]) == 1
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if what in ln)
    assert line.startswith("damage") and f" {offset} " in line and os.path.basename(path) in line


@pytest.mark.parametrize("cmd", _COMMANDS, ids=" ".join)
def test_no_command_tracebacks_and_each_says_where(hostile, cmd, capsys, tmp_path):
    out, path, offset, what = hostile
    argv = [*cmd, out] if cmd[0] != "export" else ["export", cmd[1], out, "-o", str(tmp_path / "exported")]
    if cmd[0] == "report":
        argv += ["-o", str(tmp_path / "report.html")]
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc in (0, 1)
    if cmd[0] != "inspect":
        assert f"{path} at byte {offset}: " in captured.err and what in captured.err
    else:
        assert "damage: rank" in captured.out or "DAMAGE" in captured.out


@pytest.mark.parametrize("ndigits", [18, 19, 20, 25, 30, 400, 2**64 - 1])
def test_export_csv_takes_any_ndigits_a_run_recorded(tmp_path, capsys, ndigits):
    out = str(tmp_path / "out")
    good_log(out, config={"ndigits": ndigits})
    assert main(["export", "csv", out, "-o", str(tmp_path / "csv")]) == 0
    err = capsys.readouterr().err
    assert ("rounds every value to nan" in err) == (ndigits > 308)
    text = next((tmp_path / "csv").rglob("*.csv")).read_text().splitlines()
    assert len(text) > 1 and (("nan" in text[1]) == (ndigits > 308))


def _unfollowable(tmp_path, kind: str) -> str:
    out = str(tmp_path / "out")
    path = good_log(out)
    if kind == "not_a_log":
        with open(path, "wb") as f:
            f.write(b"hello world, this is text\n" * 10)
    elif kind == "bad_version":
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<I", 99))
    elif kind == "as_dir":
        os.remove(path)
        os.mkdir(path)
    elif kind == "no_permission":
        os.chmod(path, 0)
    return out


@pytest.mark.parametrize("kind", ["not_a_log", "bad_version", "as_dir", "no_permission"])
@pytest.mark.parametrize("target", ["output", "rankdir", "file"])
def test_dump_follow_of_logs_that_cannot_be_read_says_so_like_dump(tmp_path, capsys, kind, target):
    out = _unfollowable(tmp_path, kind)
    if kind == "no_permission" and os.access(glob.glob(f"{out}/*/*.trl")[0], os.R_OK):
        pytest.skip("running as a user that reads any file")
    if kind == "as_dir" and target == "file":
        pytest.skip("a directory given as RUN is followed until logs appear in it")
    run = {"output": out, "rankdir": glob.glob(f"{out}/*")[0], "file": glob.glob(f"{out}/*/*.trl")[0]}[target]
    assert main(["dump", run]) == 2
    plain = capsys.readouterr().err
    result: list = []
    t = threading.Thread(target=lambda: result.append(main(["dump", "-f", "--poll-interval", "0.02", run])),
                         daemon=True)
    t.start()
    t.join(10)
    assert result == [2], "dump -f kept waiting"
    assert capsys.readouterr().err == plain


def test_dump_follow_still_waits_for_a_run_whose_logs_have_not_appeared(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    result: list = []
    t = threading.Thread(target=lambda: result.append(main(["dump", "-f", "--poll-interval", "0.02", str(out)])),
                         daemon=True)
    t.start()
    t.join(0.5)
    assert result == []  # waiting for the first log
    good_log(str(out))
    t.join(10)
    assert result == [0] and '"type":"FileClosed"' in capsys.readouterr().out


@pytest.mark.parametrize("exists", [False, True])
def test_dump_follow_says_once_that_it_waits_for_a_log_and_where(tmp_path, capsys, exists):
    """A mistyped RUN (or one given before training made it) was waited for without a word: the
    command sat there with no output, as if the run had nothing to show."""
    out = tmp_path / "out"
    if exists:
        out.mkdir()
    result: list = []
    t = threading.Thread(target=lambda: result.append(main(["dump", "-f", "--poll-interval", "0.02", str(out)])),
                         daemon=True)
    t.start()
    t.join(0.5)
    assert result == []
    err = capsys.readouterr().err
    what = "has no trainrec log yet" if exists else "does not exist yet"
    assert err.count("trainrec dump: waiting") == 1 and f"{out} {what}" in err, err
    good_log(str(out))
    t.join(10)
    assert result == [0] and "waiting" not in capsys.readouterr().err


def test_dump_follow_of_a_run_id_not_there_says_it_waits_for_that_run(tmp_path, capsys):
    out = str(tmp_path / "out")
    good_log(out)
    result: list = []
    t = threading.Thread(target=lambda: result.append(main(["dump", "-f", "--poll-interval", "0.02", "--run-id", "zzz",
                                                            out])), daemon=True)
    t.start()
    t.join(0.5)
    assert result == []
    assert f"waiting for a log: {out} has no log of run id 'zzz' yet" in capsys.readouterr().err
    from trainrec.recorder.writer import LogWriter

    LogWriter(os.path.join(out, f"{STAMP}-rank0-0000feed"), rank=0, world_size=1, run_id="zzz1").close()
    t.join(10)
    assert result == [0]


def test_dump_follow_of_a_rank_the_closed_run_does_not_have_is_an_error_like_dump(tmp_path, capsys):
    """It printed nothing and exited 0, where plain dump names the ranks the run has."""
    out = str(tmp_path / "out")
    good_log(out)
    assert main(["dump", "--rank", "5", out]) == 2
    plain = capsys.readouterr().err
    assert main(["dump", "-f", "--poll-interval", "0.02", "--rank", "5", out]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and cap.err == plain and "rank(s) [5] not in run 'hostile' (ranks: [0])" in plain


def test_an_empty_log_is_a_note_given_as_file_rank_directory_or_output_directory(tmp_path, capsys):
    out = tmp_path / "out"
    log = out / f"{STAMP}-rank0-0000beef" / "trainrec-00000.trl"
    log.parent.mkdir(parents=True)
    log.write_bytes(b"")
    for run in (out, log.parent, log):
        assert main(["check", str(run)]) == 0
        text = capsys.readouterr().out
        assert "empty file: no file header and nothing recorded" in text and "OK (1 note(s))" in text


def test_export_of_a_log_appended_after_its_close_writes_each_value_once(tmp_path, capsys):
    out = str(tmp_path / "out")
    path = good_log(out)
    assert main(["export", "csv", out, "-o", str(tmp_path / "once")]) == 0
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "ab") as f:
        f.write(data[16:])
    capsys.readouterr()
    assert main(["export", "csv", out, "-o", str(tmp_path / "twice")]) == 0
    assert f"{path} at byte {len(data)}: records after the FileClosed record, ignored" in capsys.readouterr().err
    once = {p.relative_to(tmp_path / "once"): p.read_bytes() for p in (tmp_path / "once").rglob("*.csv")}
    twice = {p.relative_to(tmp_path / "twice"): p.read_bytes() for p in (tmp_path / "twice").rglob("*.csv")}
    assert once == twice and once
    assert main(["check", out]) == 1


@pytest.mark.parametrize("fmt", ["csv", "tb"])
def test_export_says_what_it_leaves_out_of_a_kind_it_does_not_know(tmp_path, capsys, fmt):
    """A record of a data type a newer trainrec may add is not exported, and the export says so."""
    out = str(tmp_path / "out")
    path = good_log(out)
    rewrite(path, "ts", lambda w: w.__setitem__(F, "future_kind"))
    assert main(["export", fmt, out, "-o", str(tmp_path / "x")]) == 0
    err = capsys.readouterr().err
    assert "data types this trainrec does not know are not exported: 'future_kind' (1)" in err
