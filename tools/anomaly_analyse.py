"""Compatibility entry point for ``python -m msprobe.pytorch.monitor.anomaly_analyse``.

::

    python -m trainrec.tools.anomaly_analyse -d DIR [-o OUT] [-k 8] [-s "[20,21]"]

``DIR`` is a trainrec run or a directory of the reference's ``DIR/*/anomaly.json`` files. The top k
anomalies in execution order (:mod:`trainrec.analyzers.ranking`) are written as
``anomaly_analyse.json`` in the reference's schema into ``OUT`` (a directory or a ``.json`` path;
default ``DIR``) and listed. Differences from the reference: docs/python-api.md.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from collections.abc import Sequence

from trainrec.analyzers.anomalies import parse_reference_json, reference_json
from trainrec.analyzers.ranking import rank_anomalies
from trainrec.replay.run import open_run
from trainrec.schema import layout
from trainrec.schema.errors import FormatError, NotARunError, TrainrecError
from trainrec.schema.events import AnomalyDetected

from .cmd_anomalies import check_steps, parse_step_list, positive_k, scan_run, write_json
from .runarg import note_incomplete

ANALYSE_JSON = "anomaly_analyse.json"
ANOMALY_JSON = "anomaly.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainrec.tools.anomaly_analyse",
        description="Rank anomalies in execution order and write anomaly_analyse.json (msprobe-compatible).",
    )
    p.add_argument("-d", "--data_path", dest="data_path_dir", required=True, metavar="DIR",
                   help="a trainrec run, or a directory of rank*/anomaly.json files (e.g. monitor_output/anomaly_detected)")
    p.add_argument("-o", "--out_path", dest="out_path", default="", metavar="OUT",
                   help="directory for anomaly_analyse.json, or a .json path (default: DIR)")
    p.add_argument("-k", "--topk", dest="top_k_number", type=positive_k, default=8, metavar="K",
                   help="how many anomalies to keep (default 8)")
    p.add_argument("-s", "--step", dest="step_list", default="[]", metavar="STEPS",
                   help="steps to analyse: '[20,21]', '20,21' or '15-25' (default: all)")
    return p


def reference_files(data_dir: str) -> list[str]:
    """``DIR/*/anomaly.json``, sorted."""
    return sorted(p for p in glob.glob(os.path.join(glob.escape(data_dir), "*", ANOMALY_JSON)) if os.path.isfile(p))


def load_reference_dir(files: Sequence[str]) -> tuple[list[AnomalyDetected], list[str], int]:
    """Anomalies of every readable file, the problems (naming the files and entries that were
    skipped), and how many files were read."""
    anomalies: list[AnomalyDetected] = []
    problems: list[str] = []
    read = 0
    for path in files:
        try:
            with open(path, "rb") as f:
                data = f.read()
            found, bad = parse_reference_json(data, path)
        except OSError as exc:
            problems.append(f"{path}: cannot read ({exc.strerror or exc}); skipped")
            continue
        except FormatError as exc:
            problems.append(f"{exc}; skipped")
            continue
        read += 1
        anomalies.extend(found)
        problems.extend(bad)
    return anomalies, problems, read


def _is_trainrec_run(path: str) -> bool:
    if os.path.isfile(path):
        return True
    if layout.list_logs(path):
        return True
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(layout.list_logs(os.path.join(path, n)) for n in names)


def out_file(out_path: str, data_dir: str) -> str:
    if not out_path:
        base = data_dir if os.path.isdir(data_dir) else os.path.dirname(os.path.abspath(data_dir))
        return os.path.join(base, ANALYSE_JSON)
    if out_path.endswith(".json") and not os.path.isdir(out_path):
        return out_path
    return os.path.join(out_path, ANALYSE_JSON)


def analyse(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    data_dir = args.data_path_dir
    try:
        steps = parse_step_list(args.step_list)
    except ValueError as exc:
        print(f"anomaly_analyse: error: -s: {exc}", file=sys.stderr)
        return 2
    if not os.path.exists(data_dir):
        print(f"anomaly_analyse: error: {data_dir}: no such file or directory", file=sys.stderr)
        return 2
    if _is_trainrec_run(data_dir):
        r = open_run(data_dir)
        note_incomplete(r, "anomaly_analyse")
        scan = scan_run(r, ())
        anomalies, first, last = scan.recorded, scan.first_step, scan.last_step
        where = f"run {r.run_id or data_dir}"
        for path, err in r.file_errors.items():
            print(f"note: skipped {path}: {err}", file=sys.stderr)
    else:
        files = reference_files(data_dir)
        if not files:
            raise NotARunError(
                "no anomaly data here: expected a trainrec run (rank directories with trainrec-*.trl logs) "
                f"or rank directories with {ANOMALY_JSON} files (e.g. monitor_output/anomaly_detected)",
                data_dir,
            )
        anomalies, problems, read = load_reference_dir(files)
        for p in problems:
            print(f"warning: {p}", file=sys.stderr)
        if read == 0:
            print(f"anomaly_analyse: error: none of the {len(files)} anomaly files in {data_dir} could be read",
                  file=sys.stderr)
            return 2
        first = min((a.step for a in anomalies), default=None)
        last = max((a.step for a in anomalies), default=None)
        where = data_dir
    if anomalies:
        err = check_steps(steps, first, last, where)
        if err:
            print(f"anomaly_analyse: error: {err}", file=sys.stderr)
            return 2
    ranked = rank_anomalies(anomalies, None, steps)
    top = reference_json(ranked, args.top_k_number)
    target = out_file(args.out_path, data_dir)
    write_json(target, top)
    if not anomalies:
        print(f"no anomalies found in {where}; wrote an empty {target}")
    elif not top:
        print(f"no anomalies at steps {steps.text() if steps else ''} ({len(anomalies)} at other steps, "
              f"{first}..{last}); wrote an empty {target}")
    else:
        at = f" at steps {steps.text()}" if steps else ""
        entries = len(reference_json(ranked))  # (several ops of one tensor and call share an entry)
        print(f"Top {len(top)} of {entries} anomaly entries{at} in execution order (written to {target}):")
        for i, value in enumerate(top.values()):
            print(f"{i}: {value['message']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return analyse(argv)
    except TrainrecError as exc:
        print(f"anomaly_analyse: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
