"""Replay the committed golden logs (``tests/golden/v*/``) and compare with their expected content exactly.

The golden files are made once by ``tests/golden/make_golden.py`` and never regenerated silently: a
failure here means the current reader no longer reads a released format the way it did. Schema
growth is allowed: a field appended to an event class after the golden file was written must decode
to its default, every other field must match, and no field may disappear.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import os
import shutil
import sys

import pytest
from trainrec.replay.reader import LogReader, read_log
from trainrec.replay.run import open_run
from trainrec.schema import errors
from trainrec.schema.events import EVENT_TYPES, TAGS, UnknownEvent

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
EXPECTED = sorted(glob.glob(os.path.join(GOLDEN, "v*", "*.json")))


def _load_maker():
    if GOLDEN not in sys.path:  # the script's scenario modules beside it, as when it runs as a script
        sys.path.insert(0, GOLDEN)
    spec = importlib.util.spec_from_file_location("make_golden", os.path.join(GOLDEN, "make_golden.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_golden"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


mg = _load_maker()
_CLASSES = {cls.__name__: cls for cls in (*TAGS.values(), UnknownEvent)}


def _load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out[f.name] = mg.value_to_json(value)
    return out


def compare_events(got: list, expected: list[dict], masked: dict) -> list[str]:
    """Differences between decoded events and their expected JSON form (empty when they agree)."""
    diffs = []
    if len(got) != len(expected):
        diffs.append(f"{len(got)} events decoded, {len(expected)} expected")
    for i, (ev, want) in enumerate(zip(got, expected, strict=False)):
        have = mg.apply_mask(mg.event_to_json(ev), masked)
        if have["type"] != want["type"]:
            diffs.append(f"event {i}: {have['type']} decoded, {want['type']} expected")
            continue
        defaults = _defaults(_CLASSES[want["type"]])
        for name, value in want["fields"].items():
            if name not in have["fields"]:
                diffs.append(f"event {i} ({want['type']}): field {name!r} disappeared")
            elif have["fields"][name] != value:
                diffs.append(f"event {i} ({want['type']}).{name}: {have['fields'][name]!r} != {value!r}")
        for name, value in have["fields"].items():
            if name not in want["fields"] and value != defaults[name]:
                diffs.append(f"event {i} ({want['type']}): new field {name!r} is {value!r}, not its default")
    return diffs


def _outcome(reader: LogReader) -> dict:
    return {
        "problems": [{"offset": p.offset, "skipped": p.skipped} for p in reader.problems],
        "gaps": [{"offset": g.offset, "expected": g.expected, "got": g.got} for g in reader.gaps],
        "pending_bytes": reader.pending_bytes,
        "closed_cleanly": reader.closed_cleanly,
    }


def _want_outcome(doc: dict) -> dict:
    return {k: doc[k] for k in ("problems", "gaps", "pending_bytes", "closed_cleanly")}


def _ids():
    return [os.path.relpath(p, GOLDEN) for p in EXPECTED]


def test_golden_files_are_present():
    committed = {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(GOLDEN, "v1", "*.json"))}
    assert committed == set(mg.SCENARIOS), "run tests/golden/make_golden.py for the missing scenarios"
    for p in EXPECTED:
        assert os.path.isfile(os.path.join(os.path.dirname(p), _load(p)["log"]))


def test_every_event_type_has_a_golden_record():
    seen = {e["type"] for p in EXPECTED for e in _load(p).get("events", ())}
    assert {cls.__name__ for cls in EVENT_TYPES} | {"UnknownEvent"} <= seen


@pytest.mark.parametrize("expected_path", EXPECTED, ids=_ids())
def test_golden_log_replays_exactly(expected_path):
    doc = _load(expected_path)
    log_path = os.path.join(os.path.dirname(expected_path), doc["log"])
    if "error" in doc:
        with pytest.raises(getattr(errors, doc["error"])) as info:
            read_log(log_path)
        assert log_path in str(info.value)
        return
    reader, events = read_log(log_path)
    assert reader.version == doc["format_version"]
    assert compare_events(events, doc["events"], doc["masked"]) == []
    assert _outcome(reader) == _want_outcome(doc)


@pytest.mark.parametrize("expected_path", EXPECTED, ids=_ids())
def test_golden_log_read_while_growing_gives_the_same(expected_path, tmp_path):
    """The file appended in small pieces and polled after each: the same events, damage and tail."""
    doc = _load(expected_path)
    if "error" in doc:
        return
    with open(os.path.join(os.path.dirname(expected_path), doc["log"]), "rb") as f:
        data = f.read()
    for chunk in (13, 997):
        path = str(tmp_path / f"growing-{chunk}.trl")
        reader = LogReader(path)
        events = []
        with open(path, "wb", buffering=0) as out:
            for i in range(0, len(data), chunk):
                out.write(data[i : i + chunk])
                events.extend(reader.poll())
        assert compare_events(events, doc["events"], doc["masked"]) == [], chunk
        assert _outcome(reader) == _want_outcome(doc), chunk


@pytest.mark.parametrize(
    "expected_path", [p for p in EXPECTED if "error" not in _load(p)], ids=lambda p: os.path.relpath(p, GOLDEN)
)
def test_golden_log_opens_as_a_run(expected_path, tmp_path):
    """A single log file is a RUN: open_run replays it with the same events."""
    doc = _load(expected_path)
    src = os.path.join(os.path.dirname(expected_path), doc["log"])
    path = str(tmp_path / "trainrec-00000.trl")
    shutil.copyfile(src, path)
    run = open_run(path)
    assert compare_events(list(run.events()), doc["events"], doc["masked"]) == []


def test_make_golden_refuses_to_overwrite_without_regenerate(tmp_path, capsys):
    out = str(tmp_path / "v1")
    assert mg.main(["--out", out, "compat", "torn_tail"]) == 0
    path = os.path.join(out, "compat.trl")
    with open(path, "ab") as f:
        f.write(b"local edit")
    assert mg.main(["--out", out, "compat"]) == 1
    assert "not overwritten" in capsys.readouterr().err
    with open(path, "rb") as f:
        assert f.read().endswith(b"local edit")
    assert mg.main(["--out", out, "--regenerate", "compat"]) == 0
    with open(path, "rb") as f, open(os.path.join(GOLDEN, "v1", "compat.trl"), "rb") as g:
        assert f.read() == g.read()  # deterministic: the committed bytes again


def test_deterministic_scenarios_build_identically():
    for name, build in mg.SCENARIOS.items():
        if name == "logwriter":
            continue
        assert build().data == build().data, name
