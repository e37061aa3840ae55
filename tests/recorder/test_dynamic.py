"""DynamicConfigWatcher in one process: real files, a real watchdog observer, bounded waits."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest
from trainrec.recorder.dynamic import DynamicConfigWatcher, filesystem_type
from trainrec.recorder.writer import LogWriter
from trainrec.replay.reader import read_log
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import ConfigChanged, ConfigRejected

LOGGER = "trainrec.recorder.dyn"  # dynamic, dynfile, dynsync


def validate(raw: dict) -> dict:
    """A small stand-in for the recorder's parse_config."""
    for key in raw:
        if key not in ("switch", "collect_times", "start_step", "step_interval", "ops", "targets"):
            raise ConfigError("unknown key", key=key)
    ct = raw.get("collect_times", 100000000)
    if not isinstance(ct, int) or isinstance(ct, bool) or ct < 1:
        raise ConfigError(f"expected a positive integer, got {ct!r}", key="collect_times")
    return dict(raw)


def write(path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def doc(**kw) -> str:
    return json.dumps(kw, indent=4) + "\n"


class Loop:
    """A stand-in training loop: poll at every step end, a short sleep as the step's work."""

    def __init__(self, watcher: DynamicConfigWatcher, step_time: float = 0.002) -> None:
        self.w = watcher
        self.step = 0
        self.step_time = step_time
        self.updates: list = []

    def once(self):
        u = self.w.poll(self.step)
        if u is not None:
            self.updates.append((self.step, u))
        self.step += 1
        time.sleep(self.step_time)
        return u

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.once()

    def until(self, pred, what: str, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            u = self.once()
            if pred(u):
                return u
        pytest.fail(f"timed out after {timeout} s waiting for {what} (step {self.step})")

    def until_update(self, what: str = "an update", timeout: float = 10.0):
        return self.until(lambda u: u is not None, what, timeout)


@pytest.fixture
def make(tmp_path):
    made = []

    def _make(text: str | None = None, *, name: str = "config.json", directory=None, **kw):
        d = directory or tmp_path / "conf"
        d.mkdir(exist_ok=True)
        path = d / name
        if text is not None:
            write(path, text)
        events: list = []
        kw.setdefault("validate", validate)
        kw.setdefault("health_interval", 0.2)
        kw.setdefault("poll_interval", 0.1)
        w = DynamicConfigWatcher(
            str(path), emit=events.append, rank=0, writes_back=kw.pop("writes_back", True), **kw
        )
        w.start()
        made.append(w)
        return w, path, events, Loop(w)

    yield _make
    for w in made:
        w.close()


def of(events, cls):
    return [e for e in events if isinstance(e, cls)]


def warnings_in(caplog):
    return [r for r in caplog.records if r.name.startswith(LOGGER) and r.levelno >= logging.WARNING]


def test_first_start_needs_no_change(make):
    w, path, events, loop = make(doc(switch=True, collect_times=2))
    assert w.mode == "watchdog"
    u = loop.once()
    assert u is not None and u.switch and loop.updates[0][0] == 0  # applied from step 1
    assert u.raw == {"switch": True, "collect_times": 2} and u.config == u.raw
    assert u.changed_keys == ("collect_times", "switch")
    (ch,) = of(events, ConfigChanged)
    assert ch.step == 0 and ch.content_hash == u.content_hash and ch.path == str(path)
    loop.steps(20)
    assert len(loop.updates) == 1


def test_start_stop_rewrite_restart(make, caplog):
    text = '{\n  "ops": ["norm", "max"],\n  "switch": false,\n  "collect_times": 3,\n  "targets": {"a.b": {}}\n}\n'
    w, path, events, loop = make(text)
    caplog.set_level(logging.INFO, logger="trainrec.recorder")
    loop.steps(10)
    assert loop.updates == [] and not w.active
    edited_at = loop.step
    write(path, text.replace('"switch": false', '"switch": true'))
    u = loop.until_update("the start")
    start_step = loop.updates[0][0]
    assert start_step >= edited_at and u.switch and u.changed_keys == ("switch",) and w.active
    assert of(events, ConfigChanged)[-1].step == start_step

    # The recorder collects 3 times, then tells the watcher; switch:false is written back.
    loop.steps(3)
    finished_at = loop.step
    w.collection_finished(finished_at)
    loop.until(lambda u: path.read_text() != text.replace('"switch": false', '"switch": true'), "write-back")
    assert path.read_text() == text  # only the value changed: key order, indent, spacing kept
    assert not w.active
    assert any(f"collect_times reached; monitoring stops after step {finished_at}" in r.getMessage()
               for r in caplog.records)

    # Our own write is seen as a change, but starts nothing.
    n_changed = len(of(events, ConfigChanged))
    loop.until(lambda u: len(of(events, ConfigChanged)) > n_changed, "the write-back to be seen")
    assert of(events, ConfigChanged)[-1].changed_keys == ("switch",)
    loop.steps(30)
    assert len(loop.updates) == 1

    # Restart by a second edit, with another collect_times.
    write(
        path,
        text.replace('"switch": false', '"switch": true').replace('"collect_times": 3', '"collect_times": 5'),
    )
    u = loop.until_update("the restart")
    assert u.switch and u.raw["collect_times"] == 5 and u.changed_keys == ("collect_times", "switch")
    assert len(loop.updates) == 2 and not warnings_in(caplog) and not of(events, ConfigRejected)


def test_invalid_edit_while_monitoring_keeps_old_config(make, caplog):
    w, path, events, loop = make(doc(switch=True, collect_times=4))
    loop.until_update("the first start")
    write(path, '{\n    "switch": true,\n    "collect_times": 4,\n}\n')  # trailing comma
    loop.until(lambda u: of(events, ConfigRejected), "the rejection")
    (rej,) = of(events, ConfigRejected)
    assert (
        "invalid JSON at line 4 column 1" in rej.reason
        and "goes on with the config in effect since step 1" in rej.reason
    )
    assert rej.keys == () and w.active
    (warn,) = warnings_in(caplog)
    assert "line 4 column 1" in warn.getMessage()
    loop.steps(50)  # one message per change, not per step
    assert len(warnings_in(caplog)) == 1 and len(of(events, ConfigRejected)) == 1
    assert len(loop.updates) == 1 and w.active

    # A config error names the key; the old config still goes on.
    write(path, doc(switch=True, collect_times=0))
    loop.until(lambda u: len(of(events, ConfigRejected)) == 2, "the second rejection")
    rej = of(events, ConfigRejected)[-1]
    assert rej.keys == ("collect_times",) and "'collect_times'" in rej.reason and str(path) in rej.reason
    assert of(events, ConfigChanged)[-1].changed_keys == ("collect_times",)
    assert len(loop.updates) == 1 and w.active


def test_invalid_edit_while_idle_has_no_effect(make, caplog):
    w, path, events, loop = make(doc(switch=False))
    loop.steps(5)
    write(path, '{"switch": true, "collect_times": "many"}')
    loop.until(lambda u: of(events, ConfigRejected), "the rejection")
    (rej,) = of(events, ConfigRejected)
    assert rej.reason.endswith("monitoring stays off") and rej.keys == ("collect_times",)
    write(path, '{"switch": "yes"}')
    loop.until(lambda u: len(of(events, ConfigRejected)) == 2, "the second rejection")
    assert of(events, ConfigRejected)[-1].keys == ("switch",)
    loop.steps(20)
    assert loop.updates == [] and not w.active and len(warnings_in(caplog)) == 2


def test_replaced_by_rename_like_an_editor(make):
    w, path, events, loop = make(doc(switch=False))
    loop.steps(5)
    tmp = path.parent / ".config.json.swp"
    write(tmp, doc(switch=True, collect_times=7))
    os.replace(tmp, path)
    u = loop.until_update("the start after a rename")
    assert u.raw == {"switch": True, "collect_times": 7}
    # A second rename-save (vim-style: move the old file away, write a new one).
    os.rename(path, path.parent / "config.json~")
    write(path, doc(switch=True, collect_times=8))
    u = loop.until_update("the update after the second save")
    assert u.raw["collect_times"] == 8 and not of(events, ConfigRejected)


def test_half_written_file_is_not_rejected(make):
    # A generous grace (default 0.3 s) so that a loaded machine oversleeping the pause cannot flake.
    w, path, events, loop = make(doc(switch=False), invalid_grace=1.0)
    loop.steps(5)
    full = doc(switch=True, collect_times=3, ops=["norm", "min", "max"])
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, full[:20].encode())  # an editor saving in two writes, with a pause
        time.sleep(0.2)  # longer than the settle time (0.05 s): the first half is read and does not parse
        os.write(fd, full[20:].encode())
    finally:
        os.close(fd)
    u = loop.until_update("the completed file")
    assert u.raw["ops"] == ["norm", "min", "max"]
    assert not of(events, ConfigRejected)


def test_a_file_left_empty_says_so(make):
    # Truncated by an editor that then waits longer than the grace: the rejection says what it saw.
    w, path, events, loop = make(doc(switch=True), invalid_grace=0.05)
    loop.until_update("the first start")
    write(path, "  \n")
    loop.until(lambda u: of(events, ConfigRejected), "the rejection")
    (rej,) = of(events, ConfigRejected)
    assert "is empty" in rej.reason and "invalid JSON" not in rej.reason and "goes on" in rej.reason


def test_deleted_file_then_recreated(make, caplog):
    w, path, events, loop = make(doc(switch=True))
    loop.until_update("the first start")
    os.unlink(path)
    loop.until(lambda u: of(events, ConfigRejected), "the deletion to be reported")
    (rej,) = of(events, ConfigRejected)
    assert "does not exist (it was deleted)" in rej.reason and "goes on" in rej.reason and w.active
    loop.steps(30)
    assert len(warnings_in(caplog)) == 1 and len(loop.updates) == 1
    write(path, doc(switch=True, collect_times=2))
    u = loop.until_update("the recreated file")
    assert u.raw["collect_times"] == 2


def test_missing_at_start_then_created(make):
    w, path, events, loop = make(None)
    loop.once()
    (rej,) = of(events, ConfigRejected)
    assert "does not exist" in rej.reason and rej.step == 0
    write(path, doc(switch=True))
    loop.until_update("the created file")


def test_directory_replaced(make, caplog):
    w, path, events, loop = make(doc(switch=False))
    loop.steps(3)
    d = path.parent
    os.rename(d, d.parent / "conf.old")
    d.mkdir()
    write(path, doc(switch=True, collect_times=9))
    u = loop.until_update("the config in the new directory")
    assert u.raw["collect_times"] == 9 and w.mode == "watchdog"
    assert any("was replaced" in r.getMessage() for r in warnings_in(caplog))
    write(path, doc(switch=True, collect_times=10))  # and the new directory is watched
    assert loop.until_update("an edit in the new directory").raw["collect_times"] == 10


def test_directory_removed_and_back(make, caplog):
    w, path, events, loop = make(doc(switch=True))
    loop.until_update("the first start")
    shutil.rmtree(path.parent)
    loop.until(lambda u: of(events, ConfigRejected), "the removal to be reported")
    assert "its directory does not exist" in of(events, ConfigRejected)[0].reason
    loop.until(lambda u: w.mode == "poll", "the fallback")
    path.parent.mkdir()
    write(path, doc(switch=True, collect_times=4))
    assert loop.until_update("the config in the recreated directory").raw["collect_times"] == 4
    loop.until(lambda u: w.mode == "watchdog", "watchdog to be re-armed")
    (warning,) = warnings_in(caplog)  # one message: the rejection naming the problem
    assert "its directory does not exist" in warning.getMessage()


def test_switch_false_while_monitoring_stops(make):
    w, path, events, loop = make(doc(switch=True, collect_times=100))
    loop.until_update("the first start")
    write(path, doc(switch=False, collect_times=100))
    u = loop.until_update("the stop")
    assert u.switch is False and not w.active
    w.collection_finished(loop.step)  # a recorder that calls it anyway: nothing to write back
    loop.steps(20)
    assert json.loads(path.read_text()) == {"switch": False, "collect_times": 100}


def test_switch_false_stops_even_where_another_key_is_wrong(make, caplog):
    # The user asks to stop; a typo elsewhere in the file (checked again when it is switched on) is said,
    # and does not keep a collection going that was asked to stop.
    w, path, events, loop = make(doc(switch=True, collect_times=100))
    loop.until_update("the first start")
    write(path, doc(switch=False, colect_times=100))
    u = loop.until_update("the stop")
    assert u.switch is False and not w.active
    (rej,) = of(events, ConfigRejected)
    assert rej.keys == ("colect_times",) and "switch is false: monitoring stops after step" in rej.reason
    assert "colect_times" in warnings_in(caplog)[0].getMessage()
    # idle: such a file changes nothing and is said once
    write(path, doc(switch=False, colect_times=5))
    loop.until(lambda u: len(of(events, ConfigRejected)) == 2, "the second rejection")
    assert of(events, ConfigRejected)[-1].reason.endswith("monitoring stays off")
    loop.steps(10)
    assert len(loop.updates) == 2


def test_touch_restarts_when_the_file_says_switch_true(make):
    # The non-writing ranks' view: collection finished, nobody wrote switch:false back.
    w, path, events, loop = make(doc(switch=True, collect_times=1), writes_back=False)
    loop.until_update("the first start")
    w.collection_finished(loop.step)
    loop.steps(20)
    assert len(loop.updates) == 1 and not w.active
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # `touch`: the documented restart
    u = loop.until_update("the restart by touch")
    assert u.switch and u.changed_keys == ()


def test_save_without_change_while_monitoring_goes_on(make):
    w, path, events, loop = make(doc(switch=True))
    loop.until_update("the first start")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    n = len(of(events, ConfigChanged))
    loop.until(lambda u: len(of(events, ConfigChanged)) > n, "the touch to be seen")
    assert len(loop.updates) == 1 and w.active


def test_resave_with_the_same_values_while_monitoring_goes_on_and_is_written_back(make):
    # Deleted and recreated, or saved by another tool with its own indentation: the same config, other
    # bytes. Monitoring goes on (its collect_times count is not restarted), and switch:false is
    # written back into the file as it is now.
    w, path, events, loop = make(doc(switch=True, collect_times=5))
    loop.until_update("the first start")
    os.remove(path)
    loop.until(lambda u: len(of(events, ConfigRejected)) == 1, "the deletion to be seen")
    write(path, json.dumps({"collect_times": 5, "switch": True}))
    n = len(of(events, ConfigChanged))
    loop.until(lambda u: len(of(events, ConfigChanged)) > n, "the re-creation to be seen")
    loop.steps(5)
    assert len(loop.updates) == 1 and w.active
    w.collection_finished(loop.step)
    deadline = time.monotonic() + 10
    while json.loads(path.read_text())["switch"] and time.monotonic() < deadline:
        loop.once()
    assert path.read_text() == json.dumps({"collect_times": 5, "switch": False})


def test_write_back_leaves_a_newer_user_edit_alone(make):
    w, path, events, loop = make(doc(switch=True, collect_times=1))
    loop.until_update("the first start")
    newer = doc(switch=True, collect_times=6)
    write(path, newer)
    w.collection_finished(loop.step)  # races with the user's edit: the edit wins
    u = loop.until_update("the user's edit")
    assert u.raw["collect_times"] == 6 and path.read_text() == newer


def test_write_back_keeps_symlink_and_mode(make, tmp_path):
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    real = real_dir / "cfg.json"
    write(real, '{"switch": true,\t"collect_times": 1}')
    os.chmod(real, 0o640)
    link_dir = tmp_path / "conf"
    link_dir.mkdir()
    os.symlink(real, link_dir / "config.json")
    w, path, events, loop = make(None)
    loop.until_update("the first start")
    w.collection_finished(loop.step)
    loop.until(lambda u: "false" in real.read_text(), "the write-back")
    assert real.read_text() == '{"switch": false,\t"collect_times": 1}'
    assert os.path.islink(path) and (os.stat(real).st_mode & 0o777) == 0o640
    assert not [p for p in os.listdir(real_dir) if p.endswith(".trainrec-tmp")]


def test_a_symlinked_config_sees_edits_of_its_target_and_a_configmap_swap(make, tmp_path, caplog):
    """An edit of a link's target happens in another directory, and Kubernetes' ConfigMap volumes
    swap a ``..data`` link to a new directory: neither is an event on the link's path. A config path
    that is a symbolic link is checked by stat (of its target) instead of by inotify."""
    conf = tmp_path / "conf"
    conf.mkdir()
    v1 = conf / "..2026_v1"
    v1.mkdir()
    write(v1 / "config.json", doc(switch=False))
    os.symlink("..2026_v1", conf / "..data")
    os.symlink("..data/config.json", conf / "config.json")
    with caplog.at_level(logging.INFO, logger="trainrec"):
        w, path, events, loop = make(None)
    assert w.mode == "poll-only" and any("is a symbolic link" in r.getMessage() for r in caplog.records)
    loop.steps(3)
    write(v1 / "config.json", doc(switch=True, collect_times=2))  # the target edited in place
    assert loop.until_update("the edit of the link's target").switch
    v2 = conf / "..2026_v2"  # the ConfigMap update: a new directory, then the link swapped atomically
    v2.mkdir()
    write(v2 / "config.json", doc(switch=False))
    os.symlink("..2026_v2", conf / "..data_tmp")
    os.replace(conf / "..data_tmp", conf / "..data")
    assert loop.until_update("the ConfigMap swap").switch is False


def test_stat_fallback_without_watchdog(make):
    w, path, events, loop = make(doc(switch=False), use_watchdog=False)
    assert w.mode == "poll-only"
    loop.steps(3)
    write(path, doc(switch=True, collect_times=2))
    assert loop.until_update("the start seen by stat polling").raw["collect_times"] == 2
    w.collection_finished(loop.step)
    loop.until(lambda u: '"switch": false' in path.read_text(), "the write-back")
    loop.steps(30)
    assert len(loop.updates) == 1


def test_emit_failure_does_not_stop_training(make, tmp_path):
    def broken(event):
        raise OSError("disk full")

    path = tmp_path / "c.json"
    write(path, doc(switch=True))
    w = DynamicConfigWatcher(str(path), validate=validate, emit=broken, rank=0, writes_back=True)
    w.start()
    try:
        assert w.poll(0) is not None
    finally:
        w.close()


def test_replayed_log_shows_each_switch_at_its_step(tmp_path):
    """The events go through a real LogWriter and come back from the reader at the right steps."""
    path = tmp_path / "config.json"
    write(path, doc(switch=False, collect_times=2))
    writer = LogWriter(str(tmp_path / "Nov30_00-00-00-rank0-00000000"), rank=0)
    seen: list = []

    def emit(event):
        seen.append(event)
        writer.write(event)

    w = DynamicConfigWatcher(str(path), validate=validate, emit=emit, rank=0, writes_back=True)
    w.start()
    loop = Loop(w)
    try:
        loop.steps(5)
        write(path, doc(switch=True, collect_times=2))
        loop.until_update("the start")
        loop.steps(2)
        w.collection_finished(loop.step - 1)
        loop.until(lambda u: len(of(seen, ConfigChanged)) == 3, "the write-back to be seen")
        write(path, "{oops")
        loop.until(lambda u: of(seen, ConfigRejected), "the rejection")
    finally:
        w.close()
        writer.close()
    _, events = read_log(writer.path)
    changed = of(events, ConfigChanged)
    rejected = of(events, ConfigRejected)
    start = loop.updates[0][0]
    assert changed[0].step == 0 and changed[0].changed_keys == ("collect_times", "switch")
    assert changed[1].step == start and changed[1].changed_keys == ("switch",)
    assert changed[2].step > start and changed[2].changed_keys == ("switch",)  # the write-back, seen
    assert (
        len(rejected) == 1 and rejected[0].step > changed[2].step and "line 1 column 2" in rejected[0].reason
    )


def test_filesystem_type_of_tmp(tmp_path):
    assert filesystem_type(str(tmp_path)) != ""


def test_with_the_recorders_parse_config(make, caplog):
    from trainrec.recorder.config import MonitorConfig, parse_config

    w, path, events, loop = make(None)
    src = str(path)
    write(path, doc(switch=True, ops=["norm"], collect_times=2))
    w.close()
    events.clear()
    w = DynamicConfigWatcher(
        src, validate=lambda raw: parse_config(raw, src), emit=events.append, rank=0, writes_back=True
    )
    w.start()
    try:
        loop = Loop(w)
        u = loop.until_update("the first start")
        assert isinstance(u.config, MonitorConfig) and u.config.collect_times == 2 and u.config.switch
        write(path, doc(switch=True, ops=["norm", "bogus"], collect_times=2))
        loop.until(lambda u: of(events, ConfigRejected), "the rejection")
        (rej,) = of(events, ConfigRejected)
        assert rej.keys == ("ops",) and f"{src}: config key 'ops': unknown op 'bogus'" in rej.reason
        assert rej.reason.endswith("monitoring goes on with the config in effect since step 1") and w.active
        (warning,) = warnings_in(caplog)
        assert "unknown op 'bogus'" in warning.getMessage()
    finally:
        w.close()


def test_watchdog_unavailable_falls_back_to_stat_checks(make, monkeypatch, caplog):
    import errno

    from watchdog.observers import Observer

    def exhausted(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "inotify watch limit reached")

    monkeypatch.setattr(Observer, "schedule", exhausted)
    w, path, events, loop = make(doc(switch=False))
    assert w.mode == "poll"
    write(path, doc(switch=True, collect_times=2))
    assert loop.until_update("the start seen by stat checks").raw["collect_times"] == 2
    (warning,) = warnings_in(caplog)  # said once, and the retries to watch again are backed off
    assert (
        "inotify watch limit reached" in warning.getMessage() and "mtime/size/inode" in warning.getMessage()
    )


def test_network_filesystem_uses_stat_checks(make, monkeypatch, caplog):
    from trainrec.recorder import dynfile

    monkeypatch.setattr(dynfile, "filesystem_type", lambda path: "nfs4")
    w, path, events, loop = make(doc(switch=False))
    assert w.mode == "poll-only"
    (warning,) = warnings_in(caplog)
    assert "nfs4 filesystem" in warning.getMessage()
    write(path, doc(switch=True))
    loop.until_update("the start seen by stat checks")


def test_an_edit_saved_while_switch_false_is_written_back_is_kept(make, monkeypatch):
    """The write-back checks the file again right before its rename: an edit the user saves while the
    new content is being written and fsynced (the slow part) is kept, not replaced by switch=false."""
    from trainrec.recorder import jsonedit

    w, path, events, loop = make(doc(switch=True, collect_times=1))
    loop.until_update("the first start")
    edit = doc(switch=True, collect_times=7)
    real_fsync = jsonedit.os.fsync
    saved = []

    def fsync_with_a_concurrent_save(fd):
        if not saved:
            saved.append(True)
            write(path, edit)  # the user saves while the write-back's temporary file is being fsynced
        return real_fsync(fd)

    monkeypatch.setattr(jsonedit.os, "fsync", fsync_with_a_concurrent_save)
    w.collection_finished(loop.step)
    loop.until(lambda u: saved and not any(n.endswith(".trainrec-tmp") for n in os.listdir(path.parent)),
               "the write-back attempt")
    loop.steps(5)
    assert saved and path.read_text() == edit
    assert sorted(os.listdir(path.parent)) == ["config.json"]
