"""CSV projection of a rank's log, in the reference's files, columns and number format.

One file ``{kind}_{start}-{end}.csv`` per data type and window of ``step_count_per_record`` steps,
with the reference's header and row order, numbers rounded as the reference rounds them; the layout
is in docs/exports.md. The log itself is never rounded: rounding happens here, at projection time.
Output goes to a :class:`CsvSink`; creating files is the caller's business (``trainrec.tools``).
"""

from __future__ import annotations

import bisect
import csv
import functools
import logging
import math
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from trainrec.analyzers.csv_format import prefix_block, render_frames, round_like_reference
from trainrec.analyzers.frames import KindFrame, Note, Rewind, RowLayout, reference_rows
from trainrec.analyzers.projection import Projector, StepAssembler
from trainrec.analyzers.selection import SeenSteps, StepSet
from trainrec.schema.events import CSV_FILE_PREFIX, SLOT_INPUT, SLOT_INPUT_GRAD, Event

log = logging.getLogger(__name__)

__all__ = ["CsvProjector", "CsvSink", "CsvSummary", "csv_header", "export_csv", "format_rows", "window_of"]

ACTV_KINDS = ("actv", "actv_grad")
# CsvProjector renders the frames it has projected together once they hold this many values (or at
# flush/finish): memory for their text stays at a few MB
PENDING_VALUES = 1 << 16
_SIDES = {"actv": ("input", "output"), "actv_grad": ("input_grad", "output_grad")}


class CsvSink(Protocol):
    def append(self, kind: str, start: int, end: int, header: str, text: bytes, step: int) -> None:
        """Append ``text`` (whole UTF-8 lines of ``step``) to the window file, creating it with ``header`` first."""

    def rewind(self, step: int) -> Iterable[tuple[str, int]] | None:
        """Forget the rows of steps >= ``step`` written by this export; optionally, ``(file prefix,
        start)`` of the window files that are gone (their columns are chosen again)."""


@dataclass
class CsvSummary:
    """What a CSV projection wrote (the files: the sink's)."""

    rows: int = 0
    values: int = 0
    steps: SeenSteps = field(default_factory=SeenSteps)
    dropped_steps: list = field(default_factory=list)
    bad_records: int = 0


def window_of(step: int, step_count_per_record: int) -> tuple[int, int]:
    """The reference's file window of a step: ``(start, end)``, both inclusive."""
    start = (step // step_count_per_record) * step_count_per_record
    return start, start + step_count_per_record - 1


def csv_header(kind: str, ops: Iterable[str]) -> str:
    return _csv_header(kind, tuple(ops))


@functools.lru_cache(maxsize=256)  # a live export asks for every frame: a few kinds and op lists
def _csv_header(kind: str, ops: tuple[str, ...]) -> str:
    if kind in _SIDES:
        cols = [f"{side}.{op}" for side in _SIDES[kind] for op in ops]
        return ",".join(["vpp_stage", "module_name", "step", *map(_quote, cols)])
    return ",".join(["vpp_stage", "param_name", "step", *map(_quote, ops)])


def ops_from_header(header: str) -> tuple[str, ...]:
    """The ops of a window file's header line (:func:`csv_header`'s inverse); ValueError where it is none."""
    cols = next(csv.reader([header.rstrip("\r\n")]), [])
    if len(cols) < 4 or cols[0] != "vpp_stage" or cols[2] != "step" or cols[1] not in ("param_name", "module_name"):
        raise ValueError(f"not a window file header: {header[:200]!r}")
    rest = cols[3:]
    if cols[1] == "param_name":
        return tuple(rest)
    side = rest[0].split(".", 1)[0] + "."
    return tuple(c[len(side):] for c in rest if c.startswith(side))


def _quote(text: str) -> str:
    """csv.QUOTE_MINIMAL, as pandas writes a field."""
    if any(c in text for c in ',"\n\r'):
        return '"' + text.replace('"', '""') + '"'
    return text


def format_rows(values: np.ndarray, ndigits: int | None) -> list[str]:
    """Each row of a 2-D array as comma-separated numbers, formatted like the reference's CSV.

    The plain, one-``repr``-per-value definition; the export uses the vectorised
    :func:`~trainrec.analyzers.csv_format.render_rows`, which the tests hold to this.
    """
    if ndigits is None:
        # Shortest text that reads back to the stored value (float32 stays float32-short).
        return [",".join(row) for row in values.astype(str).tolist()]
    if values.dtype == np.float32:
        # a float32 statistic as the shortest decimal that reads back to it, where that has at most
        # ndigits fraction digits (csv_format's module docstring)
        values = np.array([[_short_decimal(v, ndigits) for v in row] for row in values.tolist()], dtype=np.float64)
    rounded = round_like_reference(values, ndigits)
    return [",".join(map(repr, row)) for row in rounded.tolist()]


def _short_decimal(v: float, ndigits: int) -> float:
    """The plain definition of :func:`~trainrec.analyzers.csv_format.float32_as_decimal` for one value."""
    if not math.isfinite(v) or v == 0:
        return v
    text = np.format_float_positional(np.float32(v), unique=True, trim="-")
    return float(text) if abs(v) < 1e22 and len(text.partition(".")[2]) <= min(ndigits, 22) else v


@dataclass(eq=False)
class _CsvLayout:
    prefixes: list[str]  # "vpp,name," per output row
    take: np.ndarray | None  # actv: (m, 2) frame-row index per side, -1 when absent
    rows: np.ndarray | None = None  # other kinds: the frame rows written, where not all (reference_rows)
    block: tuple = ()  # the prefixes as a byte matrix and mask (csv_format.prefix_block)

    def __post_init__(self) -> None:
        self.block = prefix_block(self.prefixes)


def _csv_layout(lay: RowLayout) -> _CsvLayout:
    if lay.kind not in ACTV_KINDS:
        rows = reference_rows(lay)  # grad_unreduced: the last micro step's, as the reference's files
        idx = range(len(lay)) if rows is None else rows.tolist()
        prefixes = [f"{int(lay.vpps[i])},{_quote(lay.names[i])}," for i in idx]
        return _CsvLayout(prefixes, None, rows)
    order: dict[tuple[int, str, int], int] = {}
    pairs: list[list[int]] = []
    for i, (v, n, m, s) in enumerate(zip(lay.vpps.tolist(), lay.names, lay.micros.tolist(), lay.slots.tolist(), strict=True)):
        key = (v, n, m)
        j = order.get(key)
        if j is None:
            j = order[key] = len(pairs)
            pairs.append([-1, -1])
        pairs[j][0 if s in (SLOT_INPUT, SLOT_INPUT_GRAD) else 1] = i
    keys = list(order)
    if lay.kind == "actv":
        # the reference's activation rows: grouped by module (in the order modules first appear), each
        # with its micro steps
        first: dict[tuple[int, str], int] = {}
        for v, n, _ in keys:
            first.setdefault((v, n), len(first))
        perm = sorted(range(len(keys)), key=lambda j: first[keys[j][:2]])
    else:
        # activation-gradient rows in the order modules' backward passes end (input gradient), micro
        # step by micro step; a module whose input has no gradient sorts by its output gradient
        perm = sorted(range(len(keys)), key=lambda j: pairs[j][0] if pairs[j][0] >= 0 else pairs[j][1])
    keys = [keys[j] for j in perm]
    pairs = [pairs[j] for j in perm]
    prefixes = [f"{v},{_quote(f'{n}_{m}')}," for (v, n, m) in keys]
    return _CsvLayout(prefixes, np.array(pairs, dtype=np.int64).reshape(-1, 2))


class _WindowOps:
    """The ops of each window file's header, per file prefix (the sink's key): a window's rows keep the
    columns its first step gave it. 10 bytes per window (starts in order, an index into the few distinct op lists),
    so a live export's memory does not grow with the files it writes."""

    def __init__(self, existing: Callable[[str, int], tuple[str, ...] | None] | None = None) -> None:
        self._starts: dict[str, array] = {}
        self._idx: dict[str, array] = {}
        self._table: list[tuple[str, ...]] = []
        self._existing = existing

    def ops(self, kind: str, start: int, ops: tuple[str, ...]) -> tuple[str, ...]:
        """The window's ops; where the window is new to this export, those of the file the sink already
        has for it (``existing``: a live export going on where an earlier one ended), else ``ops``."""
        starts = self._starts.get(kind)
        if starts is None:
            starts = self._starts[kind] = array("q")
            self._idx[kind] = array("H")
        idx = self._idx[kind]
        if starts and starts[-1] == start:
            return self._table[idx[-1]]
        i = bisect.bisect_left(starts, start)
        if i < len(starts) and starts[i] == start:
            return self._table[idx[i]]
        if self._existing is not None:
            ops = self._existing(kind, start) or ops
        try:
            j = self._table.index(ops)
        except ValueError:
            j = len(self._table)
            self._table.append(ops)
        starts.insert(i, start)
        idx.insert(i, j)
        return ops

    def forget(self, kind: str, start: int) -> None:
        starts = self._starts.get(kind)
        if starts is None:
            return
        i = bisect.bisect_left(starts, start)
        if i < len(starts) and starts[i] == start:
            del starts[i]
            del self._idx[kind][i]

    def drop_from(self, step: int) -> None:
        """Forget the windows that begin at ``step`` or later (a rewind removed their files)."""
        for kind, starts in self._starts.items():
            i = bisect.bisect_left(starts, step)
            del starts[i:]
            del self._idx[kind][i:]


class CsvProjector(Projector):
    """Feeds events of one rank, appends CSV rows to ``sink`` as steps complete."""

    def __init__(
        self,
        sink: CsvSink,
        *,
        kinds: Iterable[str] | None = None,
        steps: StepSet | None = None,
        ndigits: int | None = 6,
        step_count_per_record: int = 1,
        rewind: bool = False,
    ) -> None:
        if step_count_per_record < 1:
            raise ValueError(f"step_count_per_record must be >= 1, not {step_count_per_record}")
        if ndigits is not None and ndigits < 0:
            raise ValueError(f"ndigits must be >= 0 (or None for full precision), not {ndigits}")
        self.sink = sink
        self.ndigits = ndigits
        self.per_record = step_count_per_record
        self.rewind = rewind
        self.assembler = StepAssembler(kinds, steps, notes=False)
        self.summary = CsvSummary()
        self._windows = _WindowOps(getattr(sink, "existing_ops", None))
        self._warned: set = set()
        # frames projected but not yet rendered: their numbers are formatted together (flush)
        self._pending: list[tuple] = []
        self._pending_values = 0

    def flush(self) -> None:
        """Render the frames projected so far and append them to the sink, in order."""
        pending = self._pending
        if not pending:
            return
        self._pending = []
        self._pending_values = 0
        bodies = render_frames([frame for _, frame in pending], self.ndigits)
        for ((prefix, start, end, header, step), _), body in zip(pending, bodies, strict=True):
            self.sink.append(prefix, start, end, header, body, step)

    def _finished(self) -> None:
        self.flush()

    def _item(self, item) -> None:
        if isinstance(item, KindFrame):
            self._frame(item)
        elif isinstance(item, Rewind) and self.rewind:
            self.flush()
            removed = self.sink.rewind(item.step) or ()
            self._windows.drop_from(item.step)
            for prefix, start in removed:  # a window emptied by the rewind takes the next rows' ops
                self._windows.forget(prefix, start)
            self.summary.steps.drop_from(item.step)
            self._warned = {w for w in self._warned if w[1] < item.step}
        elif isinstance(item, Note):  # pragma: no cover - the assembler is built without notes
            pass

    def _frame(self, frame: KindFrame) -> None:
        kind = frame.kind
        start, end = window_of(frame.step, self.per_record)
        ops = frame.ops
        values = frame.values
        prefix = CSV_FILE_PREFIX.get(kind, kind)  # mg_direction goes to the reference's "other" files
        wops = self._windows.ops(prefix, start, ops)
        if wops != ops:
            values = self._remap(frame, wops)
            ops = wops
        lay = frame.layout
        cl = lay.cache.get("csv")
        if cl is None:
            cl = lay.cache["csv"] = _csv_layout(lay)
        if cl.rows is not None:
            values = values[cl.rows]
        if cl.take is not None:
            k = len(ops)
            grouped = np.full((len(cl.take), 2 * k), np.nan, dtype=values.dtype)
            for side in (0, 1):
                idx = cl.take[:, side]
                ok = idx >= 0
                grouped[ok, side * k : (side + 1) * k] = values[idx[ok]]
            values = grouped
        # (where its text goes, what render_frames makes it of)
        self._pending.append(((prefix, start, end, csv_header(kind, ops), frame.step),
                              (cl.block, f"{frame.step},".encode(), values)))
        self._pending_values += values.size
        if self._pending_values >= PENDING_VALUES:
            self.flush()
        s = self.summary
        s.rows += len(cl.prefixes)
        s.values += values.size
        s.steps.add(frame.step)

    def _remap(self, frame: KindFrame, wops: tuple[str, ...]) -> np.ndarray:
        ops = frame.ops
        extra = [o for o in ops if o not in wops]
        if extra and (frame.kind, frame.step) not in self._warned:
            self._warned.add((frame.kind, frame.step))
            log.warning(
                "trainrec export: %s step %d has ops %s that the header of its file (ops %s) lacks; "
                "they are left out of the CSV",
                frame.kind, frame.step, ", ".join(extra), ", ".join(wops),
            )
        out = np.full((len(frame.values), len(wops)), np.nan, dtype=frame.values.dtype)
        for j, o in enumerate(wops):
            if o in ops:
                out[:, j] = frame.values[:, ops.index(o)]
        return out


def export_csv(
    events: Iterable[Event],
    sink: CsvSink,
    *,
    kinds: Iterable[str] | None = None,
    steps: StepSet | None = None,
    ndigits: int | None = 6,
    step_count_per_record: int = 1,
    clean: bool = True,
) -> CsvSummary:
    """Project a whole stream of one rank's events to ``sink``."""
    p = CsvProjector(sink, kinds=kinds, steps=steps, ndigits=ndigits, step_count_per_record=step_count_per_record)
    p.feed_all(events)
    return p.finish(clean)
