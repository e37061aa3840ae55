"""The TensorBoard projection, read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import os

import numpy as np
from export_logs import rank_dir, stats_record, write_rank_log
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from trainrec.analyzers.export_tb import TbProjector, export_tb
from trainrec.analyzers.tb_encode import ScalarTemplate, event_bytes
from trainrec.recorder.writer import LogWriter
from trainrec.replay.reader import LogReader
from trainrec.schema.events import OPS, RunResumed, StepEnded
from trainrec.schema.layout import list_logs
from trainrec.schema.naming import reference_tag
from trainrec.tools.tb_event_file import TbEventFile


def _events(rdir):
    for path in list_logs(rdir):
        yield from LogReader(path)


def load(directory) -> EventAccumulator:
    ea = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def scalars(directory) -> dict:
    ea = load(directory)
    return {tag: [(e.step, e.wall_time, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def test_every_tag_and_step_has_the_recorded_float32(tmp_path):
    rdir = rank_dir(tmp_path, 3)
    expected, _ = write_rank_log(rdir, rank=3, steps=range(4))
    out = tmp_path / "tb"
    with TbEventFile(str(out / "events.out.tfevents.1.test")) as f:
        summary = export_tb(_events(rdir), f)
    got = scalars(out)
    want: dict = {}
    for (kind, step, vpp, name, micro, slot), vals in expected.items():
        base = reference_tag(kind, name, slot, micro, 3, vpp)
        for op, v in zip(OPS, vals, strict=True):
            want.setdefault(f"{base}_{op}", []).append((step, v))
    assert set(got) == set(want) | {"trainrec/anomaly_count"}
    for tag, points in want.items():
        steps = [s for s, _, _ in got[tag]]
        assert steps == [s for s, _ in points], tag
        got_v = np.array([v for _, _, v in got[tag]], dtype=np.float32)
        np.testing.assert_array_equal(got_v, np.array([v for _, v in points], dtype=np.float32), err_msg=tag)
    assert summary.scalars == sum(len(p) for p in want.values())
    # wall times are the recorded ones
    assert got["0:embed.weight_min"][1][1] == 1001.0


def test_reference_tag_names(tmp_path):
    rdir = rank_dir(tmp_path, 0)
    write_rank_log(rdir, steps=range(1))
    out = tmp_path / "tb"
    with TbEventFile(str(out / "events.out.tfevents.1.test")) as f:
        export_tb(_events(rdir), f)
    tags = set(scalars(out))
    for tag in (
        "0:embed_0/rank0/input_min",
        "0:0.self_attn_1/rank0/output_norm",
        "0:embed_0/rank0/output_grad_nans",
        "1:head.weight/rank0/acc_grad_min",
        "0:embed.weight/rank0/post_grad_max",
        "0:embed.weight_min",
        "0:embed.weight/rank0/exp_avg_mean",
        "0:embed.weight/rank0/efxp_avg_sq_mean",
    ):
        assert tag in tags, tag
    assert "0:embed_0/rank0/input_grad_min" not in tags  # never recorded: no scalar


def test_anomalies_and_config_switches_are_text(tmp_path):
    rdir = rank_dir(tmp_path, 0)
    write_rank_log(rdir, steps=range(4))
    out = tmp_path / "tb"
    with TbEventFile(str(out / "events.out.tfevents.1.test")) as f:
        summary = export_tb(_events(rdir), f)
    ea = load(out)
    assert set(ea.Tags()["tensors"]) == {"trainrec/anomalies/text_summary", "trainrec/config/text_summary"}
    anomalies = ea.Tensors("trainrec/anomalies/text_summary")
    assert [e.step for e in anomalies] == [2]
    text = anomalies[0].tensor_proto.string_val[0].decode()
    assert "AnomalyTurbulence" in text and "0:embed.weight/rank0/post_grad" in text and "norm=5.0" in text
    config = ea.Tensors("trainrec/config/text_summary")
    assert "config applied" in config[0].tensor_proto.string_val[0].decode()
    assert [(e.step, e.value) for e in ea.Scalars("trainrec/anomaly_count")] == [(2, 1.0)]
    assert summary.notes == 2


def test_live_rewind_makes_tensorboard_drop_superseded_points(tmp_path):
    """A resume seen while following one log: SessionLog.START at the resume step purges later points."""
    rdir = rank_dir(tmp_path, 0)
    with LogWriter(rdir, rank=0, run_id="rw", flush_interval=0.02) as w:
        ids = w.intern(["p"], step=-1)
        for s in range(5):
            w.write(stats_record(0, s, "param", ids, np.full((1, 6), s, np.float32)))
            w.write(StepEnded(rank=0, step=s, wall=1000.0 + s))
        w.write(RunResumed(rank=0, step=3, wall=2000.0, last_step=2))
        for s in range(3, 6):
            w.write(stats_record(0, s, "param", ids, np.full((1, 6), 10 * s, np.float32), wall=2000.0 + s))
            w.write(StepEnded(rank=0, step=s, wall=2000.0 + s))
    out = tmp_path / "tb"
    with TbEventFile(str(out / "events.out.tfevents.1.test")) as f:
        p = TbProjector(f, rewind=True)
        p.feed_all(_events(rdir))
        p.finish()
    got = scalars(out)["0:p_min"]
    assert [(s, v) for s, _, v in got] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]


def test_template_encoding_round_trips(tmp_path):
    tags = ["a", "b/ü", "x" * 300]
    tmpl = ScalarTemplate(tags)
    path = tmp_path / "events.out.tfevents.1.t"
    with TbEventFile(str(path)) as f:
        for step, vals in ((0, [1.5, -2.0, 3.25]), (7, [np.nan, np.inf, -0.0]), (300, [1e-30, 3e38, 0.1])):
            f.write(event_bytes(10.0 + step, step, summary=tmpl.summary(np.array(vals))))
    got = scalars(tmp_path)
    assert [(s, w) for s, w, _ in got["a"]] == [(0, 10.0), (7, 17.0), (300, 310.0)]
    assert np.isnan(got["a"][1][2]) and got["b/ü"][1][2] == np.inf
    assert got["x" * 300][2][2] == np.float32(0.1)
    assert os.path.getsize(path) > 0


def test_grad_unreduced_tags_hold_the_last_micro_step(tmp_path):
    """grad_unreduced tags have no micro step (the reference's acc_grad): each step's point is the
    gradient accumulated at the last micro step, once."""
    from test_export_csv import _unreduced_per_micro_step_log

    rdir = rank_dir(tmp_path, 0)
    last = _unreduced_per_micro_step_log(rdir)
    out = tmp_path / "tb"
    with TbEventFile(str(out / "events.out.tfevents.1.test")) as f:
        export_tb(_events(rdir), f)
    got = scalars(out)
    for (step, name), vals in last.items():
        for op, v in zip(OPS, vals, strict=True):
            points = [p for p in got[f"{reference_tag('grad_unreduced', name, 0, 0, 0, 0)}_{op}"] if p[0] == step]
            assert len(points) == 1 and np.float32(points[0][2]) == v, (step, name, op, points)
