"""The CSV projection: the reference's files, columns and number format, from real logs."""

from __future__ import annotations

import csv
import os
import warnings

import numpy as np
import pandas as pd
import pytest
from export_logs import MODULES, PARAMS, rank_dir, stats_record, write_rank_log
from trainrec.analyzers.export_csv import CsvProjector, csv_header, export_csv, format_rows, window_of
from trainrec.analyzers.selection import parse_steps
from trainrec.recorder.writer import LogWriter
from trainrec.replay.reader import LogReader
from trainrec.schema.events import OPS, StepEnded
from trainrec.tools.csv_dir_sink import CsvDirSink


def _events(rdir):
    from trainrec.schema.layout import list_logs

    for path in list_logs(rdir):
        yield from LogReader(path)


def _export(tmp_path, rdir, **kw):
    out = tmp_path / "csv"
    sink = CsvDirSink(str(out))
    summary = export_csv(_events(rdir), sink, **kw)
    sink.close()
    return out, summary


def _read(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _expected_row(expected, kind, step, vpp, label):
    """The reference's row values for a CSV row label (actv: name_micro, input side then output side)."""
    if kind in ("actv", "actv_grad"):
        name, micro = label.rsplit("_", 1)
        sides = (1, 2) if kind == "actv" else (3, 4)
        parts = [expected.get((kind, step, vpp, name, int(micro), s)) for s in sides]
        return np.concatenate([p if p is not None else np.full(len(OPS), np.nan, np.float32) for p in parts])
    return expected[(kind, step, vpp, label, 0, 0)]


def _as_decimal(values, ndigits: int) -> np.ndarray:
    """float32 statistics as the export takes them before the reference's rounding: each the shortest
    decimal that reads back to it (numpy's float32 text) where that has at most ``ndigits`` fraction
    digits, else its exact double (the plain, one value at a time definition)."""
    from trainrec.analyzers.export_csv import _short_decimal

    return np.array([_short_decimal(x, ndigits) for x in np.asarray(values, dtype=np.float32).tolist()])


def test_files_headers_and_rounded_values(tmp_path):
    rdir = rank_dir(tmp_path, 0)
    expected, _ = write_rank_log(rdir, steps=range(3))
    out, summary = _export(tmp_path, rdir)
    kinds = ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param", "exp_avg", "exp_avg_sq")
    assert sorted(os.listdir(out)) == sorted(f"{k}_{s}-{s}.csv" for k in kinds for s in range(3))
    assert list(summary.steps) == [0, 1, 2]
    checked = 0
    for kind in kinds:
        for step in range(3):
            rows = _read(out / f"{kind}_{step}-{step}.csv")
            assert ",".join(rows[0]) == csv_header(kind, OPS)
            if kind == "actv":
                assert rows[0][:5] == ["vpp_stage", "module_name", "step", "input.min", "input.max"]
                assert rows[0][9] == "output.min" and rows[0][-1] == "output.nans"
            elif kind == "actv_grad":
                assert rows[0][3] == "input_grad.min" and rows[0][-1] == "output_grad.nans"
            else:
                assert rows[0] == ["vpp_stage", "param_name", "step", *OPS]
            labels = [r[1] for r in rows[1:]]
            if kind == "actv":  # the reference's order: by module, then micro step
                assert labels == [f"{m}_{mi}" for m in MODULES for mi in range(2)]
            elif kind == "actv_grad":  # as recorded, micro step by micro step (the reference's too)
                assert labels == [f"{m}_{mi}" for mi in range(2) for m in MODULES]
            else:
                assert labels == PARAMS
            for r in rows[1:]:
                assert r[2] == str(step)
                want = np.round(_as_decimal(_expected_row(expected, kind, step, int(r[0]), r[1]), 6), 6)
                assert r[3:] == [repr(float(x)) for x in want]
                got = np.array([float(x) for x in r[3:]])
                np.testing.assert_array_equal(got, want)
                checked += 1
    assert checked == 3 * (2 * 10 + 5 * 5)


def test_pandas_reads_what_the_reference_writes(tmp_path):
    """Byte-equal to the reference's own writing path, DataFrame(rows).round(6).fillna('nan').to_csv,
    of the float32 statistics taken as their shortest decimals (_as_decimal)."""
    rdir = rank_dir(tmp_path, 0)
    expected, _ = write_rank_log(rdir, steps=range(2), kinds=("actv", "grad_reduced", "param"))
    out, _ = _export(tmp_path, rdir)
    for kind in ("actv", "grad_reduced", "param"):
        for step in range(2):
            ours = (out / f"{kind}_{step}-{step}.csv").read_text()
            header = csv_header(kind, OPS).split(",")
            rows = []
            if kind == "actv":  # the reference's row order: by module, then micro step
                for i, m in enumerate(MODULES):
                    for mi in range(2):
                        vpp = 0 if i < 3 else 1
                        vals = _expected_row(expected, kind, step, vpp, f"{m}_{mi}")
                        rows.append([str(vpp), f"{m}_{mi}", step, *_as_decimal(vals, 6).tolist()])
            else:
                for i, p in enumerate(PARAMS):
                    vpp = 0 if i < 3 else 1
                    vals = expected[(kind, step, vpp, p, 0, 0)]
                    rows.append([str(vpp), p, step, *_as_decimal(vals, 6).tolist()])
            ref = tmp_path / "ref.csv"
            pd.DataFrame(columns=header).to_csv(ref, index=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # pandas deprecates fillna("nan") on float columns
                pd.DataFrame(rows).round(6).fillna("nan").to_csv(ref, mode="a+", header=False, index=False)
            assert ours == ref.read_text()
            df = pd.read_csv(out / f"{kind}_{step}-{step}.csv")
            assert list(df.columns) == header
            assert len(df) == len(rows)


def test_step_count_per_record_and_selection(tmp_path):
    rdir = rank_dir(tmp_path, 0)
    expected, _ = write_rank_log(rdir, steps=range(7), kinds=("grad_reduced", "param"))
    out, summary = _export(tmp_path, rdir, step_count_per_record=3, kinds=["param"], steps=parse_steps("1-4,6"))
    assert sorted(os.listdir(out)) == ["param_0-2.csv", "param_3-5.csv", "param_6-8.csv"]
    assert list(summary.steps) == [1, 2, 3, 4, 6]
    rows = _read(out / "param_0-2.csv")
    assert rows[0][0] == "vpp_stage" and sum(r[0] == "vpp_stage" for r in rows) == 1
    assert [int(r[2]) for r in rows[1:]] == [1] * 5 + [2] * 5
    assert window_of(7, 3) == (6, 8) and window_of(0, 1) == (0, 0)


@pytest.mark.parametrize("ndigits", [0, 3, None])
def test_ndigits(tmp_path, ndigits):
    rdir = rank_dir(tmp_path, 0)
    expected, _ = write_rank_log(rdir, steps=range(1), kinds=("param",))
    out, _ = _export(tmp_path, rdir, ndigits=ndigits)
    for r in _read(out / "param_0-0.csv")[1:]:
        want = expected[("param", 0, int(r[0]), r[1], 0, 0)]
        got = np.array([float(x) for x in r[3:]])
        if ndigits is None:
            np.testing.assert_array_equal(got.astype(np.float32), want)  # full precision: float32 exact
        else:
            np.testing.assert_array_equal(got, np.round(want.astype(np.float64), ndigits))


def test_format_rows_matches_repr_and_pandas():
    rng = np.random.default_rng(3)
    v = rng.standard_normal((200, 6)) * 10.0 ** rng.integers(-9, 18, (200, 6))
    v[::7, 2] = np.nan
    v[::5, 1] = -1e-12
    v[3, 3] = np.inf
    lines = format_rows(v, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = pd.DataFrame(v).round(6).fillna("nan").to_csv(header=False, index=False)
    assert "\n".join(lines) + "\n" == ref


def test_duplicates_last_wins_and_records_merge(tmp_path):
    """Two records of one kind and step: rows merge in first-appearance order, a repeated row keeps its last values."""
    rdir = rank_dir(tmp_path, 0)
    with LogWriter(rdir, rank=0, run_id="dup", flush_interval=0.02) as w:
        ids = w.intern(["a", "b", "c"], step=-1)
        first = np.arange(12, dtype=np.float32).reshape(2, 6)
        second = np.arange(100, 112, dtype=np.float32).reshape(2, 6)
        w.write(stats_record(0, 5, "param", [ids[0], ids[1]], first))
        w.write(stats_record(0, 5, "param", [ids[1], ids[2]], second))
        w.write(StepEnded(rank=0, step=5, wall=1.0))
    out, _ = _export(tmp_path, rdir)
    rows = _read(out / "param_5-5.csv")[1:]
    assert [r[1] for r in rows] == ["a", "b", "c"]
    assert [float(x) for x in rows[1][3:]] == list(map(float, second[0]))
    assert [float(x) for x in rows[0][3:]] == list(map(float, first[0]))


def test_torn_last_step_is_not_exported(tmp_path):
    rdir = rank_dir(tmp_path, 0)
    w = LogWriter(rdir, rank=0, run_id="torn", flush_interval=0.02)
    write_rank_log(rdir, steps=range(2), kinds=("param",), close=False, writer=w)
    ids = list(range(len(MODULES), len(MODULES) + len(PARAMS)))
    w.write(stats_record(0, 2, "param", ids, np.ones((len(ids), 6), np.float32)))  # step 2 never ends
    w.flush()
    out = tmp_path / "csv"
    sink = CsvDirSink(str(out))
    p = CsvProjector(sink)
    p.feed_all(_events(rdir))
    summary = p.finish(clean=False)
    sink.close()
    w.close()
    assert summary.dropped_steps == [2]
    assert sorted(os.listdir(out)) == ["param_0-0.csv", "param_1-1.csv"]


def test_bad_options():
    with pytest.raises(ValueError, match="step_count_per_record"):
        CsvProjector(None, step_count_per_record=0)
    with pytest.raises(ValueError, match="ndigits"):
        CsvProjector(None, ndigits=-1)
    with pytest.raises(ValueError, match="unknown data type 'bogus'; valid types: actv"):
        from trainrec.analyzers.selection import parse_kinds

        parse_kinds("param,bogus")
    with pytest.raises(ValueError, match="bad step range"):
        parse_steps("1-x")
    assert 15 in parse_steps("10-20,30") and 30 in parse_steps("10-20,30") and 21 not in parse_steps("10-20,30")
    assert 10**6 in parse_steps("5-")


@pytest.mark.parametrize("ndigits", [0, 1, 4, 5, 6, 8, 9, 12])
def test_vectorised_text_is_repr_of_the_rounded_double(ndigits):
    from trainrec.analyzers.csv_format import prefix_block, render_rows, value_chars

    rng = np.random.default_rng(ndigits)
    v = rng.standard_normal(30000) * 10.0 ** rng.integers(-14, 20, 30000)
    v[::50], v[::51], v[::52], v[::53], v[::57] = np.nan, -np.inf, np.inf, -1e-12, 0.0
    v[::59], v[::61], v[::67] = -0.0, 1e16, 9.999999e15
    v[::71] = np.round(v[::71])
    v[::73] = rng.standard_normal(len(v[::73])) * 10.0 ** rng.integers(20, 38, len(v[::73]))  # past 1e22
    chars, mask = value_chars(v, ndigits)
    got = [bytes(chars[i][mask[i]]).decode() for i in range(len(v))]
    assert got == [repr(x) for x in np.round(v, ndigits).tolist()]
    # float32: the shortest decimal that reads back to the value, where it has at most ndigits
    # fraction digits (numpy's own shortest float32 text decides), else the value's exact double
    v32 = v.astype(np.float32)
    chars, mask = value_chars(v32, ndigits)
    got = [bytes(chars[i][mask[i]]).decode() for i in range(len(v32))]
    want = [repr(float(x)) for x in np.round(_as_decimal(v32, ndigits), ndigits)]
    assert got == want
    assert format_rows(v32[:600].reshape(100, 6), ndigits) == [",".join(want[i : i + 6]) for i in range(0, 600, 6)]
    m = v[:600].reshape(100, 6)
    body = render_rows(prefix_block([f"{i % 2},näme{i}," for i in range(100)]), b"42,", m, ndigits)
    assert body.decode() == "".join(f"{i % 2},näme{i},42,{r}\n" for i, r in enumerate(format_rows(m, ndigits)))


@pytest.mark.parametrize("ndigits", [*range(13, 31), 300, 308, 309, 10**6, 2**63 - 1, 2**70])
def test_text_is_repr_of_the_reference_rounding_for_any_ndigits(ndigits):
    # The reference's writer (pd.DataFrame.round(ndigits), numpy's round) takes any C long: its
    # multiply overflows for large ones (1e300 -> inf at 16 decimals, every value nan from 309 on).
    from trainrec.analyzers.csv_format import value_chars

    rng = np.random.default_rng(ndigits % 1000)
    v = rng.standard_normal(3000) * 10.0 ** rng.integers(-300, 300, 3000)
    v[::50], v[::51], v[::52], v[::53], v[::57], v[::59] = np.nan, -np.inf, np.inf, -1e-12, 0.0, 1.0001e-4
    with np.errstate(over="ignore", invalid="ignore"):
        # beyond what numpy's round takes (a C int): every value nan, as from 309 on
        want = [repr(x) for x in np.round(v, ndigits).tolist()] if ndigits <= 10**6 else ["nan"] * len(v)
    chars, mask = value_chars(v, ndigits)
    got = [bytes(chars[i][mask[i]]).decode() for i in range(len(v))]
    assert got == want
    assert [",".join(got[:6])] == format_rows(v[:6].reshape(1, 6), ndigits)


def test_frames_rendered_together_equal_each_rendered_alone():
    """A live export's poll renders its steps' frames in one pass (render_frames): the text of each
    frame is what rendering it alone gives, whatever mix of column counts, prefix widths, middles and
    empty frames the poll holds."""
    from trainrec.analyzers.csv_format import prefix_block, render_frames

    rng = np.random.default_rng(3)
    frames, expected = [], []
    for j, (n, k) in enumerate([(5, 6), (0, 6), (3, 12), (7, 6), (1, 2), (4, 12)]):
        values = rng.standard_normal((n, k)) * 10.0 ** rng.integers(-6, 8, (n, k))
        values[values > 1e6] = np.nan
        prefixes = [f"{i % 3},{'w' * (j + i)}.weight," for i in range(n)]
        middle = f"{j * 97}," .encode()
        frames.append((prefix_block(prefixes), middle, values))
        expected.append("".join(f"{p}{middle.decode()}{r}\n" for p, r in zip(prefixes, format_rows(values, 6),
                                                                              strict=True)).encode())
    assert render_frames(frames, 6) == expected
    with pytest.raises(ValueError, match="2 rows of values for 3 row prefixes"):
        render_frames([(prefix_block(["a,", "b,", "c,"]), b"1,", np.zeros((2, 6)))], 6)


def _unreduced_per_micro_step_log(rdir, micro_steps: int = 3):
    """grad_unreduced as the recorder writes it with gradient accumulation: one row per parameter and
    micro step (the micro steps in one record, and a last micro step in a record of its own)."""
    w = LogWriter(rdir, rank=0, world_size=1, run_id="run-x", flush_interval=0.02)
    ids = w.intern(PARAMS, step=-1)
    rng = np.random.default_rng(5)
    last = {}
    for step in range(2):
        head = [(pid, m) for m in range(micro_steps - 1) for pid in ids]
        vals = rng.standard_normal((len(head), len(OPS))).astype(np.float32)
        w.write(stats_record(0, step, "grad_unreduced", [p for p, _ in head], vals, micro=[m for _, m in head]))
        tail = rng.standard_normal((len(ids), len(OPS))).astype(np.float32)
        w.write(stats_record(0, step, "grad_unreduced", ids, tail, micro=[micro_steps - 1] * len(ids)))
        for j, name in enumerate(PARAMS):
            last[(step, name)] = tail[j]
        w.write(StepEnded(rank=0, step=step, wall=1000.9 + step, duration=0.9, collected=True))
    w.close()
    return last


def test_grad_unreduced_has_the_reference_one_row_per_parameter_the_last_micro_step(tmp_path):
    """The reference writes one acc_grad row per step and parameter, the gradient accumulated at the last
    micro step, in a file without a micro-step column: rows of the earlier micro steps would be
    duplicated (name, step) rows there (its csv2tensorboard raises on them)."""
    rdir = rank_dir(tmp_path, 0)
    last = _unreduced_per_micro_step_log(rdir)
    out, _ = _export(tmp_path, rdir, ndigits=None)
    for step in range(2):
        rows = _read(out / f"grad_unreduced_{step}-{step}.csv")[1:]
        assert [r[1] for r in rows] == PARAMS
        for r in rows:
            np.testing.assert_array_equal(np.array([float(x) for x in r[3:]], dtype=np.float32), last[(step, r[1])])


def test_dir_sink_rewind_trims_and_removes_window_files_per_kind(tmp_path):
    sink = CsvDirSink(str(tmp_path))
    for step in range(6):
        for kind in ("param", "grad_reduced"):
            start = step // 2 * 2
            sink.append(kind, start, start + 1, "vpp_stage,param_name,step,norm", f"0,w,{step},{step}.5\n".encode(), step)
    sink.rewind(3)
    assert sorted(os.listdir(tmp_path)) == ["grad_reduced_0-1.csv", "grad_reduced_2-3.csv", "param_0-1.csv", "param_2-3.csv"]
    assert (tmp_path / "param_2-3.csv").read_text() == "vpp_stage,param_name,step,norm\n0,w,2,2.5\n"
    sink.append("param", 2, 3, "vpp_stage,param_name,step,norm", b"0,w,3,30.5\n", 3)  # appended, header kept once
    sink.append("param", 4, 5, "vpp_stage,param_name,step,norm", b"0,w,4,40.5\n", 4)
    sink.close()
    assert (tmp_path / "param_2-3.csv").read_text() == "vpp_stage,param_name,step,norm\n0,w,2,2.5\n0,w,3,30.5\n"
    sink.rewind(2)  # a window that begins at the rewound step goes whole
    assert sink.files == [str(tmp_path / f) for f in ("grad_reduced_0-1.csv", "param_0-1.csv")]
    assert sorted(os.listdir(tmp_path)) == ["grad_reduced_0-1.csv", "param_0-1.csv"]
    # a window whose rows all go is removed too (its header may not fit the resumed run's rows)
    sink.append("param", 2, 3, "vpp_stage,param_name,step,norm", b"0,w,3,3.5\n", 3)
    assert sink.rewind(3) == [("param", 2)]
    assert not (tmp_path / "param_2-3.csv").exists()
    sink.append("param", 4, 5, "vpp_stage,param_name,step,norm", b"0,w,4,4.5\n", 4)
    os.remove(tmp_path / "param_4-5.csv")  # gone already (another export): no error
    assert sink.rewind(1) == [("param", 4)]
    assert sorted(os.listdir(tmp_path)) == ["grad_reduced_0-1.csv", "param_0-1.csv"]
    assert (tmp_path / "param_0-1.csv").read_text() == "vpp_stage,param_name,step,norm\n0,w,0,0.5\n"


def test_the_reference_csv_prefix_other_names_mg_direction():
    from trainrec.analyzers.selection import parse_kinds

    assert parse_kinds("param,other") == ("param", "mg_direction")
    assert parse_kinds(["other", "mg_direction"]) == ("mg_direction",)
    with pytest.raises(ValueError, match=r"unknown data type 'others'; valid types: .*mg_direction.* \(other for mg_direction\)"):
        parse_kinds("others")


def test_float32_statistics_print_without_the_binary_expansions_digits():
    """The reference's norm and mean are float64; trainrec's statistics are float32. At an ndigits
    beyond float32's precision (the reference's documented 12), a value prints as the shortest decimal
    that reads back to it, not as the digits of its binary expansion."""
    from trainrec.analyzers.csv_format import value_chars

    def text(values, ndigits):
        chars, mask = value_chars(np.array(values, dtype=np.float32), ndigits)
        return [bytes(chars[i][mask[i]]).decode() for i in range(len(values))]

    assert text([9.1, 1.4e-05, -0.3, 3.0, 123456.7], 12) == ["9.1", "1.4e-05", "-0.3", "3.0", "123456.7"]
    assert text([9.1, 32.10919], 6) == ["9.1", "32.10919"]  # binary expansions: 9.100000, 32.109192
    assert text([1.6500299], 6) == ["1.65003"]  # more than 6 fraction digits in float32: rounded as before
    assert text([1.6500299], 12) == ["1.6500299"]
    assert format_rows(np.array([[9.1, 32.10919]], dtype=np.float32), 12) == ["9.1,32.10919"]
    # subnormal, huge and near-power-of-ten float32 values, against the plain definition
    edge = np.array([1e-40, 1.5e-45, -2e-38, 3.4e38, 1e21, 9.999999e21, 1e22, 99.99999, 1000.0, 0.001, 1e9 + 64,
                     123456789.0, 16.0, 15.999999, 8.000001, -0.0, 0.0], dtype=np.float32)
    for nd in (0, 3, 6, 9, 12, 22, 30, 45):
        want = [repr(float(x)) for x in np.round(_as_decimal(edge, nd), nd)]
        assert text(edge, nd) == want, nd
