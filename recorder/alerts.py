"""Anomaly alerts while recording: the ``alert`` config run on the writer thread.

The recorder builds one :class:`AlertEngine` per rank and calls :meth:`AlertEngine.observe` for every
stats record it collected, on its writer thread (inside the callable handed to ``LogWriter.write``), so
detection costs the training thread nothing and needs no device sync: it runs on the numpy values that
are written anyway. The rule math is :mod:`trainrec.schema.rules`, the same code a replay uses.

``observe`` returns :class:`~trainrec.schema.events.AnomalyDetected` events for the recorder to write,
logs alerts (rate-limited: the first ``log_limit`` anomalies of a step, then one summary line per
step), and with ``alert.dump: true`` maintains the reference-compatible
``{dump_dir}/rank{R}/anomaly.json`` (see :class:`AnomalyJsonDump`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from trainrec.schema import layout
from trainrec.schema.detector import Detector, reference_entry
from trainrec.schema.events import AnomalyDetected
from trainrec.schema.rule_config import rules_from_config, validate_alert_config

log = logging.getLogger(__name__)

__all__ = ["AlertEngine", "AnomalyJsonDump", "validate_alert_config"]

ANOMALY_JSON = "anomaly.json"


class AnomalyJsonDump:
    """The reference's per-rank ``anomaly.json``, kept valid after every write and only appended to.

    The file is one JSON object (``{key: entry, ...}`` as the reference writes it). New entries are
    written over the closing brace, followed by a new closing brace, so each write costs the size of
    the new entries, not of the whole file (the reference reloads and rewrites it every step).
    An ``anomaly.json`` already there from an earlier run is renamed to ``anomaly-{mtime}.json``
    beside it (the reference deletes it), unless ``resume`` is true, in which case its entries are
    kept and new ones are added to them.
    """

    def __init__(self, dump_dir: str, rank: int, *, resume: bool = False) -> None:
        self.dir = os.path.join(dump_dir, f"rank{rank}")
        self.path = os.path.join(self.dir, ANOMALY_JSON)
        made_dir = not os.path.isdir(self.dir)
        layout.make_dirs(self.dir)
        self._keys: set[str] = set()
        self._count = 0
        self.written = 0  # entries this object added (not those of a resumed run's file)
        self._file = None
        self._aside: str | None = None  # where an earlier run's anomaly.json was moved
        self._made_dir = made_dir
        if os.path.exists(self.path):
            if resume and self._adopt():
                return
            self._move_aside()
        self._file = open(self.path, "x+b", opener=layout.private_opener)  # noqa: SIM115 - kept open, closed by close()
        self._file.write(b"{\n}\n")
        self._file.flush()
        self._end = 1  # offset of the closing brace's line

    def _adopt(self) -> bool:
        """Continue an existing file of the same run; False when it is not a JSON object."""
        try:
            with open(self.path, "rb") as f:
                data = json.loads(f.read() or b"{}")
        except (OSError, ValueError) as exc:
            log.warning("trainrec: cannot continue %s (%s); starting a new file", self.path, exc)
            return False
        if not isinstance(data, dict):
            return False
        self._keys.update(data)
        self._count = len(data)
        tmp = self.path + ".tmp"
        with open(tmp, "wb", opener=layout.private_opener) as f:
            f.write(self._render_all(data))
        os.replace(tmp, self.path)
        self._file = open(self.path, "r+b")  # noqa: SIM115
        self._file.seek(0, os.SEEK_END)
        self._end = self._file.tell() - 3  # the closing "\n}\n"
        return True

    @staticmethod
    def _render_all(data: dict) -> bytes:
        if not data:
            return b"{\n}\n"
        body = ",\n".join(AnomalyJsonDump._render(k, v) for k, v in data.items())
        return ("{\n" + body + "\n}\n").encode()

    @staticmethod
    def _render(key: str, value: dict) -> str:
        return f" {json.dumps(key)}: {json.dumps(value)}"

    def _move_aside(self) -> None:
        try:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(self.path)))
        except OSError:
            stamp = time.strftime("%Y%m%d-%H%M%S")
        for i in range(1000):
            aside = os.path.join(self.dir, f"anomaly-{stamp}{'' if i == 0 else f'-{i}'}.json")
            if not os.path.exists(aside):
                os.replace(self.path, aside)
                self._aside = aside
                log.warning("trainrec: kept the earlier %s as %s", self.path, aside)
                return

    @property
    def count(self) -> int:
        return self._count

    def write(self, anomalies: Sequence[AnomalyDetected]) -> None:
        """Append the reference entries of ``anomalies``. Several ops of one tag, step and call share
        the reference's key: as in the reference, the last one of a batch is kept; later batches never
        overwrite a key already written."""
        if self._file is None or not anomalies:
            return
        batch: dict[str, dict] = {}
        for ev in anomalies:
            key, value = reference_entry(ev)
            if key not in self._keys:
                batch[key] = value
        if not batch:
            return
        parts = [self._render(k, v) for k, v in batch.items()]
        lead = "\n" if not self._keys else ",\n"
        data = (lead + ",\n".join(parts) + "\n}\n").encode()
        f = self._file
        f.seek(self._end)
        f.write(data)
        f.flush()
        self._end += len(data) - 3  # back onto the new closing brace ("\n}\n" is 3 bytes)
        self._keys.update(batch)
        self._count += len(batch)
        self.written += len(batch)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            finally:
                self._file = None

    def discard(self) -> None:
        """Undo a dump that wrote nothing (its monitor failed on its config at start-up): the empty file
        goes, an earlier run's file moved aside comes back, a directory made for it goes if empty."""
        if self._file is None or self._keys:
            return
        self.close()
        try:
            os.remove(self.path)
            if self._aside is not None:
                os.replace(self._aside, self.path)
            if self._made_dir:
                os.rmdir(self.dir)
                os.rmdir(os.path.dirname(self.dir))  # anomaly_detected, when nothing else is in it
        except OSError:
            pass


class AlertEngine:
    """Anomaly detection for one rank while recording (see the module docstring).

    ``alert_cfg`` is the reference's ``alert`` config; it is validated here (ConfigError naming the
    key). ``dump_dir`` is where ``rank{R}/anomaly.json`` goes when ``alert.dump`` is true
    (the recorder passes ``{output dir}/anomaly_detected``).
    """

    def __init__(
        self,
        alert_cfg: Any,
        *,
        rank: int,
        pp_stage: int = 0,
        group_mates: Sequence[int] = (),
        dump_dir: str | None = None,
        resume: bool = False,
        log_limit: int = 5,
    ) -> None:
        self.config = validate_alert_config(alert_cfg)
        self.rank = rank
        self.pp_stage = pp_stage
        self.group_mates = tuple(int(m) for m in group_mates)
        self.detector = Detector(rules_from_config(self.config))
        self.log_limit = log_limit
        self.total = 0
        self._step: int | None = None
        self._step_count = 0
        self._closed = False
        self.dump: AnomalyJsonDump | None = None
        if self.config["dump"] and self.detector.rules:
            if dump_dir is None:
                log.warning("trainrec: alert.dump is true but no dump directory was given; not dumping")
            else:
                self.dump = AnomalyJsonDump(dump_dir, rank, resume=resume)

    @property
    def enabled(self) -> bool:
        return bool(self.detector.rules)

    def observe(
        self,
        *,
        step: int,
        kind: str,
        ops: Sequence[str],
        names: list[str],
        values: np.ndarray,
        micro_steps: np.ndarray | None = None,
        call_ids: np.ndarray | None = None,
        slots: np.ndarray | None = None,
        vpp_stages: np.ndarray | None = None,
        wall: float | None = None,
        placeholders: np.ndarray | None = None,
    ) -> list[AnomalyDetected]:
        """Judge one stats record; returns the anomalies (to be written to the log). ``placeholders``:
        per row, nonzero where the row is a NaN row standing for no tensor (skipped, see
        :meth:`Detector.observe`)."""
        if self._closed or not self.detector.rules:
            return []
        if self._step is not None and step != self._step:
            self._summarise()
        if step != self._step:
            self._step = step
            self._step_count = 0
        found = self.detector.observe(
            rank=self.rank, step=step, kind=kind, ops=ops, names=names, values=values,
            micro_steps=micro_steps, call_ids=call_ids, slots=slots, vpp_stages=vpp_stages,
            pp_stage=self.pp_stage, group_mates=self.group_mates, wall=time.time() if wall is None else wall,
            placeholders=placeholders,
        )
        if not found:
            return found
        for ev in found:
            if self._step_count < self.log_limit:
                log.warning("trainrec: rank %d: %s (value %.6g, baseline %.6g)", self.rank, ev.message,
                            ev.value, ev.baseline)
            self._step_count += 1
        self.total += len(found)
        if self.dump is not None:
            try:
                self.dump.write(found)
            except OSError as exc:
                log.error("trainrec: cannot write %s (%s); anomaly dump stopped", self.dump.path, exc)
                self.dump.close()
                self.dump = None
        return found

    def _summarise(self) -> None:
        if self._step_count > self.log_limit:
            log.warning("trainrec: rank %d step %s: %d anomalies (%d shown above)", self.rank, self._step,
                        self._step_count, self.log_limit)

    def discard(self) -> None:
        """Close, and undo the dump file where nothing was detected (see AnomalyJsonDump.discard)."""
        if self.dump is not None:
            self.dump.discard()
        self.close()

    def close(self) -> None:
        """Log the last step's summary and close the dump file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._summarise()
        if self.dump is not None:
            self.dump.close()
        if self.total:
            where = ""
            if self.dump is not None:
                # (the reference's file keys entries by tag, step and call: several ops of one tensor
                # share an entry; the log has every one)
                written = self.dump.written
                where = (f"; see {self.dump.path}" if written >= self.total else
                         f"; {written} entries in {self.dump.path}, where anomalies of several ops of one "
                         "tensor in one call share an entry (the log has every one: trainrec anomalies)")
            log.warning("trainrec: rank %d: %d anomalies in total%s", self.rank, self.total, where)
