"""``trainrec export parquet RUN -o DIR``: the statistics as a Parquet dataset (needs pyarrow: the
``parquet`` extra).

Layout, Hive-partitioned by kind and rank, one file per partition::

    DIR/.trainrec-export.json
    DIR/kind=grad_reduced/rank=0/part-0.parquet

Columns, wide by op: ``step, micro_step, call_id, name, vpp_stage, slot, placeholder``, then one
column per op (``min, max, norm, mean, zeros, nans``), float32 as the log holds them (``--float64``
widens), null where the record did not have that op.

Every file has the same schema, so pandas (``pd.read_parquet(DIR)``), polars
(``pl.read_parquet(f"{DIR}/**/*.parquet", hive_partitioning=True)``) and DuckDB
(``read_parquet('DIR/**/*.parquet', hive_partitioning=true)``) read the whole directory as it is,
with ``kind`` and ``rank`` from the paths. Rows come as :meth:`trainrec.replay.Run.stats` gives them
(resumes applied, names resolved).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from trainrec.analyzers.wide_stats import OPS, SLOT_NAMES, WideBatch, WideStats
from trainrec.schema.errors import TrainrecError

from .export_output import _remove_output, prepare_output
from .progress import reading
from .runarg import add_run_arguments, check_steps, note_damage, open_run_from_args

_STATS_COLUMNS = ("step", "micro_step", "call_id", "vpp_stage", "name")  # Parquet min/max per row group
COMPRESSIONS = ("none", "snappy", "zstd", "lz4", "gzip")


def add_parquet_parser(fsub, types_arg, steps_arg) -> None:
    q = fsub.add_parser("parquet", help="export the statistics as a Parquet dataset (pyarrow)",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(q)
    q.add_argument("-o", "--output", required=True, metavar="DIR", help="directory to write (must not exist or be empty)")
    q.add_argument("--types", type=types_arg, action="append", metavar="TYPES", help="data types, comma separated (default all)")
    q.add_argument("--steps", type=steps_arg("step"), metavar="RANGES", help="steps to export, e.g. 10-20,30")
    q.add_argument("--ranks", type=steps_arg("rank"), metavar="RANGES", help="ranks to export, e.g. 0,2-3")
    q.add_argument("--compression", choices=COMPRESSIONS, default="snappy", help="Parquet codec (default snappy)")
    q.add_argument("--float64", action="store_true", help="value columns as float64 (default float32, as recorded)")
    q.add_argument("--force", action="store_true", help="replace DIR when it holds a previous trainrec export")
    q.set_defaults(func=run)


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise TrainrecError("export parquet needs pyarrow: pip install 'trainrec[parquet]' (or pyarrow)") from None
    return pa, pq


def arrow_schema(pa, float64: bool = False):
    fields = [
        pa.field("step", pa.int64()), pa.field("micro_step", pa.int32()), pa.field("call_id", pa.int64()),
        pa.field("name", pa.dictionary(pa.int32(), pa.string())), pa.field("vpp_stage", pa.int32()),
        pa.field("slot", pa.dictionary(pa.int8(), pa.string())), pa.field("placeholder", pa.bool_()),
    ]
    value_type = pa.float64() if float64 else pa.float32()
    fields += [pa.field(op, value_type) for op in OPS]
    return pa.schema(fields)


def to_table(pa, schema, batch: WideBatch, names: list[str]):
    """A pyarrow table of ``batch``: names and slots stay dictionary-encoded (no string per row)."""
    name_dict = pa.array(names, type=pa.string())
    cols = [
        pa.array(batch.step), pa.array(batch.micro_step), pa.array(batch.call_id),
        pa.DictionaryArray.from_arrays(pa.array(batch.name), name_dict),
        pa.array(batch.vpp_stage),
        pa.DictionaryArray.from_arrays(pa.array(batch.slot), pa.array(list(SLOT_NAMES), type=pa.string())),
        pa.array(batch.placeholder),
    ]
    for op in OPS:
        mask = batch.valid[op]
        cols.append(pa.array(batch.values[op], mask=None if mask is None else ~mask))
    return pa.Table.from_arrays(cols, schema=schema)


class ParquetSink:
    """One ParquetWriter per (kind, rank) partition, each batch a row group; closes them all."""

    def __init__(self, out: str, compression: str, float64: bool = False) -> None:
        self.pa, self.pq = _pyarrow()
        self.out = out
        self.compression = None if compression == "none" else compression
        self.schema = arrow_schema(self.pa, float64)
        self._writers: dict[tuple[str, int], object] = {}
        self.files: list[str] = []
        self.rows = 0
        self.values = 0

    def write(self, batch: WideBatch, names: list[str]) -> None:
        key = (batch.kind, batch.rank)
        writer = self._writers.get(key)
        if writer is None:
            part = os.path.join(self.out, f"kind={batch.kind}", f"rank={batch.rank}")
            os.makedirs(part, exist_ok=True)
            path = os.path.join(part, "part-0.parquet")
            # store_schema=False: readers see plain strings, not pandas categoricals (the file keeps the
            # names dictionary-encoded either way); no dictionary for values, statistics for keys only:
            # both cost most of the write time for floats that seldom repeat
            writer = self._writers[key] = self.pq.ParquetWriter(
                path, self.schema, compression=self.compression, store_schema=False,
                use_dictionary=["name", "slot"], write_statistics=list(_STATS_COLUMNS))
            self.files.append(path)
        writer.write_table(to_table(self.pa, self.schema, batch, names), row_group_size=len(batch))
        self.rows += len(batch)
        self.values += batch.value_count

    def close(self) -> None:
        while self._writers:
            _, writer = self._writers.popitem()
            writer.close()


def export_parquet(run, out: str, *, kinds=None, steps=None, ranks=None, compression: str = "snappy",
                   float64: bool = False) -> tuple[ParquetSink, WideStats]:
    """Write the run's statistics under ``out`` (which must exist); returns the sink and the gatherer."""
    sink = ParquetSink(out, compression, float64)
    wide = WideStats(kinds, steps, dtype=np.float64 if float64 else np.float32)
    try:
        for rank in run.ranks if ranks is None else [r for r in run.ranks if r in ranks]:
            for batch in wide.feed(run.events(rank, steps=None if steps is None else steps.ranges)):
                sink.write(batch, wide.names)
            for batch in wide.finish():
                sink.write(batch, wide.names)
    finally:
        sink.close()
    return sink, wide


def run(args) -> int:
    _pyarrow()
    run_ = open_run_from_args(args, notes=True)
    kinds = None
    if args.types:
        kinds = [k for group in args.types for k in group]
    ranks = [r for r in run_.ranks if args.ranks is None or r in args.ranks]
    if not ranks:
        raise TrainrecError(f"no rank matches --ranks {args.ranks.text()} (ranks: {run_.ranks})")
    out = os.path.abspath(args.output)
    for dirs in run_.rank_dirs.values():
        for d in dirs:
            if out == os.path.abspath(d) or out.startswith(os.path.abspath(d) + os.sep):
                raise TrainrecError(f"output directory {out} is inside the run's rank directory {d}")
    record = {"format": "parquet", "source": os.path.abspath(args.run), "runs": [run_.run_id],
              "types": kinds, "steps": args.steps.text() if args.steps else None,
              "ranks": args.ranks.text() if args.ranks else None, "created": time.time()}
    created = not os.path.exists(out)
    prepare_output(out, args.force, record)
    t0 = time.perf_counter()
    try:
        with reading(run_, "export parquet"):
            sink, wide = export_parquet(run_, out, kinds=kinds, steps=args.steps, ranks=ranks,
                                        compression=args.compression, float64=args.float64)
    except OSError as exc:
        raise TrainrecError(f"export to {out} failed: {exc}") from exc
    elapsed = time.perf_counter() - t0
    note_damage(run_, "export", ranks)
    seen = sorted(wide.steps_seen)
    if args.steps is not None and not seen:
        err = check_steps(args.steps, None, None, f"run {run_.run_id}")
        print(f"trainrec export: error: {err}; nothing exported", file=sys.stderr)
        _remove_output(out, created)
        return 2
    if not sink.rows:
        print(f"trainrec export: nothing to export: no statistics in run {run_.run_id}", file=sys.stderr)
        _remove_output(out, created)
        return 1
    for kind, rows in sorted(wide.dropped_kinds.items()):
        print(f"trainrec export: kind {kind[:80]!r} is not a plain name (letters, digits, _): its {rows} rows are "
              "not exported", file=sys.stderr)
    for op, rows in sorted(wide.dropped_ops.items()):
        print(f"trainrec export: op {op!r} is not one of {', '.join(OPS)}: its {rows} values are not exported",
              file=sys.stderr)
    if wide.double_records and not args.float64:
        print(f"trainrec export: {wide.double_records} record(s) hold float64 values, written as float32; "
              "pass --float64 to keep them exact", file=sys.stderr)
    superseded = sum(run_.superseded.values())
    if superseded:
        print(f"trainrec export: {superseded} record(s) superseded by a resume were left out", file=sys.stderr)
    steps = f"{seen[0]}..{seen[-1]} ({len(seen)} steps)"
    print(f"exported run {run_.run_id or '(no id)'}: ranks {', '.join(map(str, ranks))}, steps {steps}: "
          f"{sink.values} values in {sink.rows} rows, {len(sink.files)} Parquet files to {out} in {elapsed:.2f} s")
    return 0
