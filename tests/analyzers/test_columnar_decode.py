"""Re-detection reading stats records as columns (what ``anomalies --rule`` does, serial and ``-j 2``)
against the record-by-record AnomalyScan over fully decoded events, on a run with hostile records: one
the columns path hands to the codec (which takes it), one that does not decode, one failing its CRC."""

from __future__ import annotations

import os
import sys

import pytest
from trainrec.analyzers.anomalies import AnomalyScan
from trainrec.analyzers.ranking import rank_anomalies
from trainrec.replay.run import open_run
from trainrec.schema import framing
from trainrec.schema.rule_config import make_rule
from trainrec.tools.anomaly_parts import damage_notes, scan_parts
from varied_logs import write_varied_run

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "replay"))
from hostile_logs import F, frames, write_frames  # noqa: E402

SLOTS = F + 7


def _rewrite(path: str, change) -> list[int]:
    """Re-frame a log after ``change(wires)`` (valid CRCs); returns each frame's offset."""
    head, wires = frames(path)
    change(wires)
    return write_frames(path, head, wires)


def _hostile(wires: list[list]) -> None:
    stats = [w for w in wires if w[0] == "ts"]
    stats[5][4] = int(stats[5][4])  # wall as an int: not the columns path's, the codec's (as a float)
    actv = [w for w in stats if w[SLOTS]]
    actv[7][SLOTS] = b"\x09" * len(actv[7][SLOTS])  # a slot that is no slot: an undecodable record


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory) -> str:
    out = write_varied_run(str(tmp_path_factory.mktemp("hostile")), ranks=3, steps=40, seed=3, jump=0.03)
    rdir = sorted(d for d in os.listdir(out) if "-rank0-" in d)[0]
    path = os.path.join(out, rdir, sorted(os.listdir(os.path.join(out, rdir)))[0])
    offsets = _rewrite(path, _hostile)
    with open(path, "r+b") as f:  # a flipped bit in a later frame's payload: its CRC fails
        f.seek(offsets[len(offsets) * 2 // 3] + framing.FRAME_HEADER_SIZE + 3)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    return out


def _key(events) -> list[str]:
    return [repr(e) for e in events]  # (repr: NaN values compare equal)


@pytest.mark.parametrize("rule", [("AnomalyTurbulence", {"threshold": 0.3}), ("NaNInf", {}), ("ZScore", {"threshold": 3})])
def test_columns_redetect_as_full_decode(hostile_run, rule):
    run = open_run(hostile_run)
    serial = AnomalyScan([make_rule(*rule)]).feed_all(run.events())
    notes = damage_notes(run, run.ranks)
    assert serial.detected
    assert any("undecodable record" in n for _, n in notes) and any("CRC" in n for _, n in notes)
    for jobs in (1, 2):
        part = scan_parts(open_run(hostile_run), [make_rule(*rule)], None, jobs=jobs, progress=False)
        assert _key(rank_anomalies(part.detected)) == _key(rank_anomalies(serial.detected))
        assert (part.first_step, part.last_step, part.ranks, part.stats_records, part.bad_records,
                part.skipped_steps) == (serial.first_step, serial.last_step, serial.ranks, serial.stats_records,
                                        serial.bad_records, serial.skipped_steps)
        assert part.notes == notes
