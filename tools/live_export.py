"""Live CSV/TensorBoard export of one rank directory, following its log while training writes it.

The recorder starts it for ``"format": "csv"`` or ``"tensorboard"`` configs, so the reference's
files are written during training by the same projection code as ``trainrec export``, never by the
training hooks::

    python -m trainrec.tools.live_export --format csv|tensorboard --rank-dir RANK_DIR [--out DIR]
        [--ndigits N] [--step-count-per-record M] [--parent-pid PID] [--poll-interval S]
        [--idle-timeout S] [--nice N]

It stops after the last log file's ``FileClosed``, once ``--parent-pid`` is gone and a last poll
brings nothing, after ``--idle-timeout``, or on SIGTERM/SIGINT. Ended the first way it writes
``live_export.done`` (the log files it projected whole, its options), so a resumed launch's export
goes on from there (docs/config.md, "Closing, crashes and resuming"); the record is removed before
any file changes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

from trainrec.analyzers.export_csv import CsvProjector
from trainrec.analyzers.export_tb import TbProjector
from trainrec.analyzers.projection import StepAssembler
from trainrec.replay.follow import RunFollower, pid_alive
from trainrec.schema import layout

from .csv_dir_sink import CsvDirSink
from .tb_event_file import TbEventFile, tb_file_name

log = logging.getLogger(__name__)

__all__ = ["LiveResult", "live_export", "main"]

FORMATS = ("csv", "tensorboard")


@dataclass
class LiveResult:
    """How a live export ended."""

    reason: str  # "closed", "parent gone", "idle", "stopped"
    steps: int
    files: list[str]
    dropped_steps: list[int]


def live_export(
    rank_dir: str,
    fmt: str,
    out: str | None = None,
    *,
    ndigits: int | None = 6,
    step_count_per_record: int = 1,
    parent_pid: int | None = None,
    poll_interval: float = 0.5,
    idle_timeout: float | None = None,
    stop: threading.Event | None = None,
) -> LiveResult:
    """Follow ``rank_dir`` and export until the log is closed (see the module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if poll_interval <= 0:
        raise ValueError("poll_interval must be positive")
    out = out or rank_dir
    stop = stop or threading.Event()
    last_data = time.monotonic()

    def parent_gone() -> bool:
        return parent_pid is not None and not pid_alive(parent_pid)

    def idle() -> bool:
        return idle_timeout is not None and time.monotonic() - last_data >= idle_timeout

    # Wait for the first log file (the recorder may start us before its writer creates it).
    while not layout.list_logs(rank_dir):
        if stop.is_set() or parent_gone() or idle():
            reason = "stopped" if stop.is_set() else ("parent gone" if parent_gone() else "idle")
            return LiveResult(reason, 0, [], [])
        stop.wait(poll_interval)

    options = {"format": fmt, "ndigits": ndigits, "step_count_per_record": step_count_per_record}
    done = _read_done_record(out, rank_dir, options)
    if done is None:
        _remove_done_record(out)  # this export writes everything again: until it ends, no record holds
    follower = RunFollower(rank_dir, skip_files=done.logs if done else ())
    first = follower.poll()
    if done is not None and not follower.readers and parent_pid is None:
        # run again on a directory exported whole, and nothing since: the files are there already
        return LiveResult("closed", 0, [], [])
    sink: CsvDirSink | TbEventFile
    if fmt == "csv":
        sink = CsvDirSink(out)
        if done is not None:
            sink.adopt(step_count_per_record, done.kinds)
        proj: CsvProjector | TbProjector = CsvProjector(
            sink, ndigits=ndigits, step_count_per_record=step_count_per_record, rewind=True
        )
    else:
        if done is not None:
            sink = TbEventFile(os.path.join(out, done.tb_file), append=True)
        else:
            header = next((r.header for r in follower.readers.values() if r.header is not None), None)
            start = header.start_time if header is not None else time.time()
            host = header.host if header is not None else socket.gethostname()
            sink = TbEventFile(os.path.join(out, tb_file_name(start, host)), wall=start)
        proj = TbProjector(sink, rewind=True)
    if done is not None:
        proj.assembler.continue_after(done.saw_step_end, done.last_step_ended)
    record_held = done is not None  # removed before this export changes a file
    reason = "stopped"
    clean = False
    try:
        events, first = first, None  # the first poll's events: let go once projected
        frozen = False
        while True:
            if not frozen and parent_gone():
                # the training process is gone: export what it wrote (one more look for new files), and
                # never follow the next launch's file, whose own export writes the same window files
                events = (events or []) + follower.poll()
                follower.stop_discovering(lambda h: h is None or h.pid in (0, parent_pid))
                frozen = True
            if events:
                last_data = time.monotonic()
                if record_held:
                    _remove_done_record(out)
                    record_held = False
                for ev in events:
                    if stop.is_set():  # SIGTERM in a long batch (a backlog's poll):
                        break  # stop between events, and close the files written so far whole
                    proj.feed(ev)
                proj.flush()
                sink.flush()
            elif follower.closed:
                # Every followed file ended with FileClosed; one more look for a file started meanwhile.
                more = follower.poll()
                if not more:
                    reason, clean = "closed", True
                    break
                events = more
                continue
            elif parent_gone():
                more = follower.poll()
                if not more:
                    reason = "parent gone"
                    break
                events = more
                continue
            elif idle():
                reason = "idle"
                break
            if stop.is_set():
                break
            if not events:
                stop.wait(poll_interval)
            events = follower.poll()
    finally:
        summary = proj.finish(clean)
        sink.close()
    if clean:
        _write_done_record(out, (done.logs if done else []) + list(follower.readers), options, sink, proj.assembler)
    files = sink.files if isinstance(sink, CsvDirSink) else [sink.path]
    return LiveResult(reason, len(summary.steps), files, list(summary.dropped_steps))


# ---------------------------------------------------------------------------------------- resuming
DONE_FILE = "live_export.done"


@dataclass
class _Done:
    logs: list[str]  # paths of the log files projected whole, in order
    tb_file: str | None
    kinds: list[str]  # the CSV file prefixes it wrote
    saw_step_end: bool
    last_step_ended: int


def _read_done_record(out: str, rank_dir: str, options: dict) -> _Done | None:
    """The log files an earlier export of this rank directory into ``out`` projected whole, where it
    ended cleanly with the same options, so a resumed launch's export goes on from the next file.
    None where there is no such record or it no longer fits (a file changed, missing or not among the
    directory's first ones; other options)."""
    path = os.path.join(out, DONE_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 20)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read %s (%s): exporting the whole log again", path, exc)
        return None
    try:
        rec = json.loads(raw)
        names = [(str(n), int(size)) for n, size in rec["logs"]]
        tb_file, kinds = rec["tb_file"], [str(k) for k in rec["kinds"]]
        saw_step_end, last_step_ended = bool(rec["saw_step_end"]), int(rec["last_step_ended"])
        fits = rec["version"] == 1 and all(k in rec and rec[k] == v for k, v in options.items()) and names
    except Exception:  # noqa: BLE001 - anything but a record of ours (a recursion error included)
        log.warning("%s is not an export record: exporting the whole log again", path)
        return None
    logs = layout.list_logs(rank_dir)
    if not fits or len(logs) < len(names):
        return None
    for p, (name, size) in zip(logs, names, strict=False):
        try:
            if os.path.basename(p) != name or os.path.getsize(p) != size:
                return None
        except OSError:
            return None
    if options["format"] != "csv" and not (isinstance(tb_file, str) and os.path.basename(tb_file) == tb_file
                                           and os.path.isfile(os.path.join(out, tb_file))):
        return None
    return _Done(logs[: len(names)], tb_file, kinds, saw_step_end, last_step_ended)


def _remove_done_record(out: str) -> None:
    try:
        os.remove(os.path.join(out, DONE_FILE))
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove %s (%s)", os.path.join(out, DONE_FILE), exc)


def _write_done_record(out: str, logs: list[str], options: dict, sink: CsvDirSink | TbEventFile,
                       assembler: StepAssembler) -> None:
    csv_sink = isinstance(sink, CsvDirSink)
    rec = {"version": 1, **options, "logs": [[os.path.basename(p), os.path.getsize(p)] for p in logs],
           "tb_file": None if csv_sink else os.path.basename(sink.path), "kinds": sink.kinds if csv_sink else [],
           "saw_step_end": assembler.saw_step_end, "last_step_ended": assembler.last_step_ended}
    path = os.path.join(out, DONE_FILE)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8", opener=layout.private_opener) as f:
            json.dump(rec, f)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write %s (%s): a resumed launch's export will read the whole log again", path, exc)
        try:
            os.remove(tmp)
        except OSError:
            pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainrec.tools.live_export",
        description="Follow one rank directory's trainrec log and write the reference's CSV or TensorBoard files.",
    )
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--rank-dir", required=True, help="the rank directory to follow")
    p.add_argument("--out", help="output directory (default: the rank directory)")
    p.add_argument("--ndigits", type=int, default=6, help="CSV decimals (default 6; -1: full precision)")
    p.add_argument("--step-count-per-record", type=int, default=1, help="steps per CSV file (default 1)")
    p.add_argument("--parent-pid", type=int, help="stop once this process is gone and no more data comes")
    p.add_argument("--poll-interval", type=float, default=0.5, help="seconds between polls (default 0.5)")
    p.add_argument("--idle-timeout", type=float, help="stop after this many seconds without new data")
    p.add_argument("--nice", type=int, default=0,
                   help="raise this process's niceness by N first (the recorder passes 19: the export yields the "
                        "CPU to training where cores are short, and still runs where they are idle)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="trainrec live_export: %(message)s")
    if args.step_count_per_record < 1:
        print("trainrec live_export: --step-count-per-record must be >= 1", file=sys.stderr)
        return 2
    if args.nice > 0 and hasattr(os, "nice"):
        try:
            os.nice(args.nice)
        except OSError as exc:
            log.warning("could not lower the priority: %s", exc)
    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        res = live_export(
            args.rank_dir, args.format, args.out, ndigits=None if args.ndigits < 0 else args.ndigits,
            step_count_per_record=args.step_count_per_record, parent_pid=args.parent_pid,
            poll_interval=args.poll_interval, idle_timeout=args.idle_timeout, stop=stop,
        )
    except (OSError, ValueError) as exc:
        print(f"trainrec live_export: error: {exc}", file=sys.stderr)
        return 2
    if res.dropped_steps:
        log.warning("step(s) %s did not end before the log stopped; not exported", ", ".join(map(str, res.dropped_steps)))
    log.info("stopped (%s) after %d steps", res.reason, res.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
