"""csv2tensorboard_by_step on reference-format CSV (written by hand, per the documented layout) and ours."""

from __future__ import annotations

import logging
import math
import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "analyzers"))

from export_logs import rank_dir, write_rank_log  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from trainrec.schema.errors import NotARunError  # noqa: E402
from trainrec.tools.cli import main  # noqa: E402
from trainrec.tools.csv2tb import csv2tensorboard_by_step  # noqa: E402

ACTV_HEADER = ("vpp_stage,module_name,step,input.min,input.max,input.norm,input.mean,input.zeros,input.nans,"
               "output.min,output.max,output.norm,output.mean,output.zeros,output.nans")
ACTV_GRAD_HEADER = ACTV_HEADER.replace("input.", "input_grad.").replace("output.", "output_grad.")
PARAM_HEADER = "vpp_stage,param_name,step,min,max,norm,mean,zeros,nans"


def _write(path, header, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(header + "\n" + "".join(r + "\n" for r in rows))


@pytest.fixture
def reference_dirs(tmp_path):
    """A monitor_path as the reference leaves it with format csv (rows from msprobe-monitor.md)."""
    mon = tmp_path / "monitor_output"
    r0 = mon / "Dec03_21-34-40-rank0-4700973a"
    r1 = mon / "Dec03_21-34-42-rank1-89d900c7"
    late = mon / "Dec03_23-00-00-rank0-0badc0de"
    for step in (3, 4):
        _write(r0 / f"actv_{step}-{step}.csv", ACTV_HEADER, [
            f"0,embed_0,{step},14.0,4066.0,37521.728372,1993.929688,0.0,0.0,-4.761022,4.302607,256.313491,-0.0069,0.0,0.0",
            f"0,0.self_attn_0,{step},-1.5,1.5,2.0,0.0,0.0,0.0,-1.0,1.0,1.0,{step}.5,0.0,0.0",
        ])
        _write(r0 / f"actv_grad_{step}-{step}.csv", ACTV_GRAD_HEADER, [
            f"0,_0,{step},nan,nan,nan,nan,nan,nan,-0.003906,1.4e-05,0.062494,-0.0,0.0,0.0",
        ])
    _write(r0 / "grad_reduced_2-3.csv", PARAM_HEADER, [
        "0,embed.weight,2,-0.000389,0.000335,0.014429,0.0,0.940682,0.0",
        "0,embed.weight,3,-0.000389,0.000335,0.5,0.0,0.940682,0.0",
    ])
    _write(r0 / "exp_avg_sq_3-3.csv", PARAM_HEADER, ["0,embed.weight,3,0.0,0.0,0.0,0.0,1.0,0.0"])
    _write(r0 / "other_3-3.csv", PARAM_HEADER, ["0,embed.weight,3,0.503428,0.503428,0.503428,0.503428,0.0,0.0"])
    _write(r1 / "param_3-3.csv", PARAM_HEADER, ["1,head.bias,3,-0.007633,0.001957,0.064417,-0.0,0.0,0.0"])
    _write(late / "param_3-3.csv", PARAM_HEADER, ["0,late.bias,3,1,1,1,1,0,0"])
    return mon


def _scalars(directory):
    ea = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    ea.Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


def test_reference_csv_directories(reference_dirs, tmp_path):
    out = tmp_path / "tb"
    got = csv2tensorboard_by_step(str(reference_dirs), "Dec03_21-34-40", "Dec03_21-34-42", output_dirpath=str(out))
    assert got == str(out)
    assert sorted(os.listdir(out)) == ["rank0", "rank1"]  # the 23:00 launch is outside the range
    assert sorted(os.listdir(out / "rank0")) == ["actv", "actv_grad", "exp_avg_sq", "grad_reduced"]  # no "other"
    actv = _scalars(out / "rank0" / "actv")
    assert actv["vp0:embed_0/input.min"] == [(3, 14.0), (4, 14.0)]
    assert actv["vp0:embed_0/input.norm"][0][1] == np.float32(37521.728372)
    assert actv["vp0:0.self_attn_0/output.mean"] == [(3, 3.5), (4, 4.5)]
    assert len(actv) == 2 * 12
    grad = _scalars(out / "rank0" / "actv_grad")
    assert math.isnan(grad["vp0:_0/input_grad.min"][0][1])
    assert grad["vp0:_0/output_grad.max"] == [(3, np.float32(1.4e-05)), (4, np.float32(1.4e-05))]
    reduced = _scalars(out / "rank0" / "grad_reduced")
    assert reduced["vp0:embed.weight/norm"] == [(2, np.float32(0.014429)), (3, 0.5)]
    assert _scalars(out / "rank1" / "param")["vp1:head.bias/norm"] == [(3, np.float32(0.064417))]


def test_default_output_dir_types_and_processes(reference_dirs):
    got = csv2tensorboard_by_step(str(reference_dirs), "Dec03_21-34-40", "Dec03_21-34-40", process_num=2,
                                  data_type_list=["actv", "grad_reduced"])
    assert os.path.dirname(got) == str(reference_dirs)
    assert re.fullmatch(r"[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}-csv2tensorboard_by_step", os.path.basename(got))
    assert sorted(os.listdir(got)) == ["rank0"]
    assert sorted(os.listdir(os.path.join(got, "rank0"))) == ["actv", "grad_reduced"]


def test_duplicated_steps_keep_the_last_and_launches_stay_apart(reference_dirs, tmp_path, caplog):
    r0 = reference_dirs / "Dec03_21-34-40-rank0-4700973a"
    # an appended resume wrote step 3 again into the same file
    with open(r0 / "actv_3-3.csv", "a") as f:
        f.write("0,embed_0,3,99.0,4066.0,37521.728372,1993.929688,0.0,0.0,-4.761022,4.302607,256.3,-0.0069,0.0,0.0\n")
    out = tmp_path / "tb"
    with caplog.at_level(logging.WARNING):
        csv2tensorboard_by_step(str(reference_dirs), None, None, output_dirpath=str(out))
    assert "duplicated (name, step)" in caplog.text
    assert sorted(os.listdir(out)) == [
        "rank0_Dec03_21-34-40-rank0-4700973a", "rank0_Dec03_23-00-00-rank0-0badc0de", "rank1"]
    actv = _scalars(out / "rank0_Dec03_21-34-40-rank0-4700973a" / "actv")
    assert actv["vp0:embed_0/input.min"] == [(3, 99.0), (4, 14.0)]
    # the data types after the duplicate are still converted
    assert "grad_reduced" in os.listdir(out / "rank0_Dec03_21-34-40-rank0-4700973a")
    assert _scalars(out / "rank0_Dec03_23-00-00-rank0-0badc0de" / "param")["vp0:late.bias/min"] == [(3, 1.0)]


def test_bad_input(reference_dirs, tmp_path):
    with pytest.raises(NotARunError, match="no rank directory stamped in Jan01_00-00-00 .. Jan02_00-00-00"):
        csv2tensorboard_by_step(str(reference_dirs), "Jan01_00-00-00", "Jan02_00-00-00", output_dirpath=str(tmp_path / "x"))
    with pytest.raises(ValueError, match="illegal timestamp"):
        csv2tensorboard_by_step(str(reference_dirs), "yesterday", None)
    with pytest.raises(ValueError, match="after time_end"):
        csv2tensorboard_by_step(str(reference_dirs), "Dec03_21-34-42", "Dec03_21-34-40")
    with pytest.raises(ValueError, match="process_num"):
        csv2tensorboard_by_step(str(reference_dirs), None, None, process_num=0)
    with pytest.raises(ValueError, match=r"data type\(grads\) is not supported"):
        csv2tensorboard_by_step(str(reference_dirs), None, None, data_type_list=["grads"])
    with pytest.raises(NotARunError, match="not a directory"):
        csv2tensorboard_by_step(str(tmp_path / "nope"), None, None)


def test_our_csv_export_converts_to_the_recorded_values(tmp_path):
    rdir = rank_dir(tmp_path / "run", 0)
    expected, _ = write_rank_log(rdir, steps=range(3), kinds=("actv", "param"))
    assert main(["export", "csv", str(tmp_path / "run"), "-o", str(tmp_path / "csv"), "--ndigits", "full"]) == 0
    out = tmp_path / "tb"
    csv2tensorboard_by_step(str(tmp_path / "csv"), None, None, output_dirpath=str(out), process_num=2)
    param = _scalars(out / "rank0" / "param")
    actv = _scalars(out / "rank0" / "actv")
    n = 0
    for (kind, step, vpp, name, micro, slot), vals in expected.items():
        for op, v in zip(("min", "max", "norm", "mean", "zeros", "nans"), vals, strict=True):
            if kind == "param":
                tag = f"vp{vpp}:{name}/{op}"
                series = param[tag]
            else:
                tag = f"vp{vpp}:{name}_{micro}/{'input' if slot == 1 else 'output'}.{op}"
                series = actv[tag]
            got = dict(series)[step]
            assert (math.isnan(got) and math.isnan(v)) or np.float32(got) == v, tag
            n += 1
    assert n == len(expected) * 6


MSPROBE_PY = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks", ".venv-msprobe", "bin", "python")


@pytest.mark.skipif(not os.path.exists(MSPROBE_PY), reason="the reference's venv (benchmarks/.venv-msprobe) is absent")
def test_the_reference_csv2tb_reads_our_csv_directories_as_ours_does(tmp_path):
    """mindstudio-probe's own csv2tensorboard_by_step on trainrec's CSV export (rank directories that
    also hold the log and live_export.out, as the recorder leaves them) gives the same scalars as
    trainrec's csv2tb."""
    import subprocess

    rdir = rank_dir(tmp_path / "run", 0)
    write_rank_log(rdir, steps=range(3))
    csv_dir = tmp_path / "csv"
    assert main(["export", "csv", str(tmp_path / "run"), "-o", str(csv_dir)]) == 0
    (rank_out,) = [p for p in csv_dir.iterdir() if p.is_dir()]
    (rank_out / "trainrec-00000.trl").write_bytes(b"TRLOG")  # what the recorder leaves beside the CSV files
    (rank_out / "live_export.out").write_text("")
    # the reference never closes its SummaryWriters (made in pool workers, which exit without a flush),
    # so its event files lose their last events at random: its writers flush after every scalar here
    script = ("import sys\nimport msprobe.pytorch.monitor.csv2tb as m\n"
              "class W(m.SummaryWriter):\n"
              "    def add_scalar(self, *a, **k):\n        super().add_scalar(*a, **k)\n        self.flush()\n"
              "m.SummaryWriter = W\n"
              "m.csv2tensorboard_by_step(sys.argv[1], output_dirpath=sys.argv[2])\n")
    proc = subprocess.run([MSPROBE_PY, "-c", script, str(csv_dir), str(tmp_path / "theirs")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    csv2tensorboard_by_step(str(csv_dir), None, None, output_dirpath=str(tmp_path / "ours"), process_num=1)
    kinds = sorted(p.name for p in (tmp_path / "theirs" / "rank0").iterdir())
    assert kinds == ["actv", "actv_grad", "exp_avg", "exp_avg_sq", "grad_reduced", "grad_unreduced", "param"]
    for kind in kinds:
        theirs = _scalars(tmp_path / "theirs" / "rank0" / kind)
        ours = _scalars(tmp_path / "ours" / "rank0" / kind)
        assert theirs and sorted(theirs) == sorted(ours), kind
        for tag, series in theirs.items():
            assert len(series) == 3 and all(
                a[0] == b[0] and (a[1] == b[1] or (math.isnan(a[1]) and math.isnan(b[1])))
                for a, b in zip(series, ours[tag], strict=True)), (kind, tag)


def test_written_with_the_reference_permissions(reference_dirs, tmp_path):
    """The directories it makes are rwxr-x--- (msprobe's create_directory; as everything trainrec writes);
    they were rwxr-xr-x under the usual umask."""
    old = os.umask(0o022)
    try:
        out = tmp_path / "new" / "tb"
        csv2tensorboard_by_step(str(reference_dirs), "Dec03_21-34-40", "Dec03_21-34-40", output_dirpath=str(out),
                                data_type_list=["actv"])
    finally:
        os.umask(old)
    for d in (tmp_path / "new", out, out / "rank0", out / "rank0" / "actv"):
        assert oct(d.stat().st_mode & 0o777) == "0o750", d
