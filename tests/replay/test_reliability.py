"""Reliability of replay on damaged and hostile logs (issue 35): duplicated blocks, forged sequence
numbers and header flags, a name table lost to one flipped bit, a pid reused by another process, and
frames built to blow up a reader's memory. Every log here is written by the real LogWriter, in a
process of its own where a process matters."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import time
import zlib

import msgpack
import numpy as np
import pytest
from hostile_logs import frames, good_log, rewrite
from logbuild import frame_spans, rank_dir, write_rank
from trainrec.replay.follow import writer_gone, writer_running
from trainrec.replay.names import NameResolver
from trainrec.replay.reader import LogReader, read_log
from trainrec.replay.run import open_run
from trainrec.schema import framing, procid
from trainrec.schema.events import NamesInterned, NamesRepeated, TensorStatsRecorded

TIMEOUT = 60
HERE = os.path.dirname(os.path.abspath(__file__))


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _put(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


# ---------------------------------------------------------------------------------------------- duplicates
@pytest.mark.parametrize("block", [None, 4096, 1000])
def test_a_block_written_twice_is_read_once_and_reported(tmp_path, block):
    """A copy tool that retried a block: frame-aligned (None) or at any byte boundary."""
    path, _ = write_rank(rank_dir(tmp_path, 0), steps=range(40))
    data = _bytes(path)
    _, clean = read_log(path)
    spans = frame_spans(data)
    if block is None:
        a, b = spans[10][0], spans[20][0]
    else:
        a, b = block, 2 * block
    _put(path, data[:b] + data[a:b] + data[b:])
    reader, events = read_log(path)
    assert events == clean  # every record once, nothing lost
    assert reader.duplicates > 0 and reader.lost_frames == 0
    assert any("duplicate frame(s) dropped" in p.what for p in reader.problems)


def test_a_record_with_an_old_number_and_other_content_is_not_taken_for_a_duplicate(tmp_path):
    path = good_log(str(tmp_path))
    head, wires = frames(path)
    wires[5][1] = 3  # the number of an earlier record, but not its content
    from hostile_logs import write_frames

    write_frames(path, head, wires)
    reader, events = read_log(path)
    assert reader.duplicates == 0 and any(g.got < g.expected for g in reader.gaps)
    assert len(events) == len(wires)


# ---------------------------------------------------------------------------------- forged numbers, flags
def test_a_forged_sequence_number_is_not_reported_as_frames_lost(tmp_path):
    path = good_log(str(tmp_path))
    offset = rewrite(path, "ts", lambda w: w.__setitem__(1, w[1] + 999_835), which=1)
    reader, events = read_log(path)
    (gap,) = reader.gaps
    assert gap.offset == offset and gap.lost == 0 and reader.lost_frames == 0
    assert "sequence number is wrong, no frame lost" in str(gap)
    assert len(events) == len(frames(path)[1])


def test_frames_cut_out_cleanly_are_still_frames_lost(tmp_path):
    path = good_log(str(tmp_path))
    data = _bytes(path)
    spans = frame_spans(data)
    _put(path, data[: spans[4][0]] + data[spans[7][0] :])
    reader, _ = read_log(path)
    assert reader.lost_frames == 3 and reader.gaps[0].most is None


def test_undefined_header_flags_are_reported_and_the_records_read(tmp_path):
    path = good_log(str(tmp_path))
    data = bytearray(_bytes(path))
    data[12:16] = struct.pack("<I", 0x8000_0001)
    _put(path, bytes(data))
    reader, events = read_log(path)
    assert reader.flags == 0x8000_0001
    assert [(p.offset, p.skipped) for p in reader.problems] == [(12, 0)]
    assert "flags 0x80000001" in reader.problems[0].what and len(events) == len(frames(path)[1])


# ------------------------------------------------------------------------------------------------ names
def test_one_flipped_bit_in_the_name_table_costs_no_name(tmp_path):
    names = [f"model.layers.{i}.mlp.weight" for i in range(300)]
    path, _ = write_rank(rank_dir(tmp_path, 0), steps=range(5), names=names)
    data = bytearray(_bytes(path))
    spans = frame_spans(bytes(data))
    start, end = spans[1]  # NamesInterned, right after FileOpened
    data[(start + end) // 2] ^= 0x10
    _put(path, bytes(data))
    reader, events = read_log(path)
    assert reader.lost_frames == 1 and len(reader.problems) == 1
    resolver = NameResolver()
    resolved = []
    for ev in events:
        resolver.feed(ev)
        if isinstance(ev, TensorStatsRecorded):
            resolved += resolver.names(ev)
    assert resolved and not any(n.startswith("<unknown name") for n in resolved)
    assert isinstance(events[1], NamesInterned) and isinstance(events[2], NamesRepeated)


def test_the_copy_of_a_name_table_is_not_replayed_twice(tmp_path):
    path, _ = write_rank(rank_dir(tmp_path, 0), steps=range(2))
    run = open_run(path)
    rows = run.to_rows()
    keys = list(zip(rows["step"], rows["kind"], rows["name"], rows["op"], strict=True))
    assert len(keys) == len(set(keys)) > 0


# -------------------------------------------------------------------------------------- liveness by start
_WRITER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {here!r})
    from logbuild import rank_dir, stats
    from trainrec.recorder.writer import LogWriter
    from trainrec.schema.events import StepBegan
    w = LogWriter(rank_dir({out!r}, 0), rank=0, world_size=1, run_id="reused", flush_interval=0.01)
    ids = w.intern(["a"])
    for s in range(3):
        w.write(StepBegan(rank=0, step=s))
        w.write(stats(0, s, ids))
    w.flush(timeout=10)
    print(w.path, flush=True)
    time.sleep(600)
""")


def _killed_writer_log(out: str) -> str:
    """A log whose real writer process was killed with SIGKILL (never closed)."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER.format(here=HERE, out=out)], stdout=subprocess.PIPE,
                            text=True)
    try:
        path = proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait(TIMEOUT)
        proc.stdout.close()
    assert path.endswith(".trl")
    return path


@pytest.fixture
def stand_in():
    """Makes a live process of this host that is not the log's writer, started after the writer died
    (start times count in clock ticks of 10 ms): what holds the dead writer's pid once the kernel gives
    that pid out again."""
    procs = []

    def start():
        time.sleep(0.05)
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        return procs[-1]

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(TIMEOUT)


def test_a_pid_reused_by_another_process_is_not_the_writer(tmp_path, stand_in):
    path = _killed_writer_log(str(tmp_path / "out"))
    stand_in = stand_in()
    header = read_log(path)[0].header
    assert header.proc_start and header.writer_id and header.boot_id == procid.boot_id()
    assert writer_gone(header)
    # the header as it stands after the pid was given to the stand-in: same pid, another start time
    rewrite(path, "fo", lambda w: w.__setitem__(8, stand_in.pid))
    moved = read_log(path)[0].header
    assert moved.pid == stand_in.pid and moved.proc_start == header.proc_start
    assert procid.pid_running(stand_in.pid) and not writer_running(moved) and writer_gone(moved)
    from trainrec.replay.integrity import findings
    from trainrec.replay.summary import summarize

    (unclosed,) = findings(summarize(open_run(path)))
    assert f"its writer, pid {stand_in.pid}, is gone" in unclosed.what
    # the control: a header naming the stand-in's own start time is taken as running
    rewrite(path, "fo", lambda w: w.__setitem__(-2, procid.start_ticks(stand_in.pid)))
    assert writer_running(read_log(path)[0].header)
    (unclosed,) = findings(summarize(open_run(path)))
    assert f"still being written, pid {stand_in.pid}" in unclosed.what


def test_dump_follow_ends_where_the_pid_was_reused(tmp_path, stand_in):
    out = str(tmp_path / "out")
    path = _killed_writer_log(out)
    stand_in = stand_in()
    rewrite(path, "fo", lambda w: w.__setitem__(8, stand_in.pid))
    cmd = [sys.executable, "-m", "trainrec.tools.cli", "dump", out, "-f", "--poll-interval", "0.05"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert "FileOpened" in done.stdout and "writing the run is gone" in done.stderr


# -------------------------------------------------------------------------------------- hostile frames
def _frame(payload: bytes) -> bytes:
    prefix = struct.pack("<III", framing.FRAME_MAGIC, len(payload), zlib.crc32(payload))
    return prefix + struct.pack("<I", zlib.crc32(prefix)) + payload


def _wire_head(tag: str, n_fields: int) -> bytes:
    """The msgpack array header of a wire list of ``n_fields`` after the envelope, and its envelope."""
    return b"\xdd" + struct.pack(">I", 5 + n_fields) + msgpack.packb(tag) + msgpack.packb([1, 0, 0, 0.0])[1:]


HOSTILE = ("small_ints", "names", "nested", "map")


def hostile_payload(name: str, size: int = framing.MAX_FRAME) -> bytes:
    """Valid msgpack within the frame cap, built to cost a reader gigabytes if decoded whole."""
    n = size - 64
    if name == "small_ints":  # one flat array of small integers (a pointer each, once decoded)
        return b"\xdd" + struct.pack(">I", n) + b"\x01" * n
    if name == "names":  # a name table of 30 M one-character names
        return _wire_head("nm", 2) + b"\x00" + b"\xdd" + struct.pack(">I", n // 2) + b"\xa1a" * (n // 2)
    if name == "nested":  # arrays of a million small ints each: under any cap on one array's length
        inner = b"\xdd" + struct.pack(">I", 1 << 20) + b"\x01" * (1 << 20)
        k = n // len(inner)
        return _wire_head("ms", 1) + b"\xdc" + struct.pack(">H", k) + inner * k
    if name == "map":  # a config map of millions of entries
        k = n // 6
        entries = np.zeros(k, dtype=[("tag", "u1"), ("key", ">u4"), ("value", "u1")])
        entries["tag"], entries["key"] = 0xCE, np.arange(k)
        return (_wire_head("ca", 3) + msgpack.packb("") + msgpack.packb("") + b"\xdf" + struct.pack(">I", k)
                + entries.tobytes())
    raise KeyError(name)


def test_hostile_frames_are_corrupt_records_decoded_in_bounded_memory(tmp_path):
    """Each payload decoded in a process of its own: a corrupt record, and the process's peak memory
    stays a small multiple of the frame cap."""
    base = _bytes(good_log(str(tmp_path / "good")))
    for name in HOSTILE:
        path = str(tmp_path / f"{name}.trl")
        _put(path, base + _frame(hostile_payload(name)))
        script = textwrap.dedent(f"""
            from trainrec.replay.reader import read_log
            reader, events = read_log({path!r})
            print(len(events), len(reader.problems), reader.problems[-1].what if reader.problems else "")
            # (VmHWM: this program's peak; ru_maxrss would keep the forking test process's)
            print(next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmHWM")))
        """)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT)
        assert done.returncode == 0, (name, done.stderr)
        summary, peak_kib = done.stdout.splitlines()
        events, problems, what = summary.split(" ", 2)
        assert int(problems) == 1 and "undecodable record" in what, (name, summary)
        assert int(peak_kib) < 400 << 10, (name, int(peak_kib) >> 10)


def test_a_record_within_its_caps_still_decodes(tmp_path):
    names = tuple(f"n{i}" for i in range(200_000))  # a large model's name table
    path, _ = write_rank(rank_dir(tmp_path, 0), steps=range(1), names=list(names))
    _, events = read_log(path)
    assert next(ev for ev in events if isinstance(ev, NamesInterned)).names == names


def test_reader_on_a_duplicate_needs_no_reread(tmp_path):
    """A duplicate found across two polls of a growing file is one problem, the same as read whole."""
    path, _ = write_rank(rank_dir(tmp_path, 0), steps=range(10))
    data = _bytes(path)
    spans = frame_spans(data)
    damaged = data[: spans[8][0]] + data[spans[3][0] : spans[8][0]] + data[spans[8][0] :]
    whole = str(tmp_path / "whole.trl")
    _put(whole, damaged)
    grown = str(tmp_path / "grown.trl")
    _put(grown, b"")
    r = LogReader(grown)
    got = []
    for i in range(0, len(damaged), 97):
        with open(grown, "ab") as f:
            f.write(damaged[i : i + 97])
        got += r.poll()
    ref, events = read_log(whole)
    assert got == events and [(p.offset, p.skipped) for p in r.problems] == [
        (p.offset, p.skipped) for p in ref.problems]


def tiny_frames(count: int) -> bytes:
    """``count`` valid frames of StepBegan records all numbered 5, each a sequence going back."""
    return b"".join(_frame(msgpack.packb(["sb", 5, 0, k, 0.0])) for k in range(count))


def test_countless_damaged_frames_are_counted_not_listed(tmp_path):
    from trainrec.replay.integrity import findings
    from trainrec.replay.problems import MAX_LISTED
    from trainrec.replay.summary import summarize

    path = str(tmp_path / "trainrec-00000.trl")
    n = 3 * MAX_LISTED
    _put(path, framing.encode_file_header() + tiny_frames(n))
    reader, events = read_log(path)
    assert len(reader.gaps) == MAX_LISTED and reader.unlisted_gaps == n - MAX_LISTED
    assert len(events) == n  # (the records themselves decode: they are kept)
    found = findings(summarize(open_run(path)))
    assert any("more sequence gap(s), not listed one by one" in f.what for f in found)
