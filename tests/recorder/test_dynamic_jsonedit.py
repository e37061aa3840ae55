"""The switch=false rewrite: a minimal textual edit where possible, else a re-dump in the user's style."""

from __future__ import annotations

import json
import os

import pytest
from trainrec.recorder.jsonedit import atomic_write, detect_indent, set_top_level


@pytest.mark.parametrize(
    "before, after",
    [
        ('{"switch": true}', '{"switch": false}'),
        ('{\n    "ops": ["norm"],\n    "switch" :  true ,\n    "x": 1\n}\n', None),
        ('{\r\n\t"switch": true,\r\n\t"a": "é"\r\n}\r\n', None),
        ('{"a": {"switch": true}, "b": [{"switch": true}], "switch": true}', None),
        ('{"s": "\\"switch\\": true", "switch": true}', None),
        ('{"switch": "yes"}', '{"switch": false}'),
        ('{"switch": true, "switch": 1}', '{"switch": false, "switch": false}'),  # duplicates: every one
    ],
)
def test_minimal_edit_changes_only_the_value(before, after):
    out = set_top_level(before, "switch", False)
    if after is None:
        # The last "true" is the top-level value: it changes and nothing else does.
        head, _, tail = before.rpartition("true")
        after = head + "false" + tail
    assert out == after
    assert json.loads(out)["switch"] is False


def test_nested_and_string_occurrences_are_untouched():
    text = '{"targets": {"switch": true}, "note": "switch: true", "switch": true}'
    out = set_top_level(text, "switch", False)
    assert json.loads(out) == {"targets": {"switch": True}, "note": "switch: true", "switch": False}


@pytest.mark.parametrize(
    "text, indent",
    [('{"a": 1}', None), ('{\n  "a": 1\n}', 2), ('{\n    "a": 1\n}', 4), ('{\n\t"a": 1\n}', "\t")],
)
def test_detect_indent(text, indent):
    assert detect_indent(text) == indent


def test_missing_key_redumps_in_the_users_style():
    text = '{\r\n\t"ops": ["norm", "max"],\r\n\t"collect_times": 3\r\n}\r\n'
    out = set_top_level(text, "switch", False)
    assert (
        out
        == '{\r\n\t"ops": [\r\n\t\t"norm",\r\n\t\t"max"\r\n\t],\r\n\t"collect_times": 3,\r\n\t"switch": false\r\n}\r\n'
    )
    assert list(json.loads(out)) == ["ops", "collect_times", "switch"]  # key order kept, new key last


def test_object_value_redumps_and_keeps_non_ascii():
    text = '{\n  "switch": {"on": true},\n  "name": "模型"\n}'
    out = set_top_level(text, "switch", False)
    assert out == '{\n  "switch": false,\n  "name": "模型"\n}'


def test_bom_is_kept():
    out = set_top_level('\ufeff{"switch": true}\n', "switch", False)
    assert out == '\ufeff{"switch": false}\n'


def test_not_an_object_is_refused():
    with pytest.raises(ValueError, match="not a JSON object"):
        set_top_level("[1, 2]", "switch", False)


def test_atomic_write_replaces_and_cleans_up(tmp_path):
    target = tmp_path / "c.json"
    target.write_text("old")
    os.chmod(target, 0o600)
    ino = os.stat(target).st_ino
    assert atomic_write(str(target), b"new") == str(target)
    assert target.read_bytes() == b"new" and os.stat(target).st_ino != ino
    assert (os.stat(target).st_mode & 0o777) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["c.json"]


def test_atomic_write_failure_leaves_the_old_file(tmp_path):
    target = tmp_path / "c.json"
    target.write_text("old")
    (tmp_path / "blocker").mkdir()
    with pytest.raises(OSError):
        atomic_write(str(tmp_path / "blocker"), b"new")  # cannot replace a directory by a file
    assert target.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["blocker", "c.json"]  # no temp file left behind
