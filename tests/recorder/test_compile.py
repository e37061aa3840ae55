"""A model compiled with ``torch.compile``: its module hooks are inlined into the compiled forward.
The monitor's hooks run as Python on the real tensors (a graph break each), dynamo never compiles the
monitor's own code, and what is recorded equals what the same model records uncompiled, under the
names of the model the user wrote (no ``_orig_mod.`` prefix). The ``aot_eager`` backend runs dynamo
and AOTAutograd as inductor would, without generating C++ (seconds instead of a minute here)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from trainmon_util import assert_close, events_of, loss_of, make, stats_table, write_config
from trainrec.recorder import TrainerMon, chunk_hooks
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import HookFailed

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile is torch 2.0+")
RECORDER_DIR = os.path.dirname(os.path.abspath(__import__("trainrec.recorder").recorder.__file__))
STEPS = 8


def _run(tmp_path, name: str, compiled: str | None) -> tuple[list, dict]:
    out = tmp_path / name
    os.environ["MONITOR_OUTPUT_DIR"] = str(out)
    cfg = write_config(tmp_path, {"xy_distribution": True, "all_xy": True, "wg_distribution": True,
                                  "param_distribution": True, "mv_distribution": True, "ur_distribution": True,
                                  "targets": {"layers.0": {}, "head": {}, "pair": {}}, "step_interval": 2,
                                  "ops": ["norm", "min", "max", "mean"]}, f"{name}.json")
    model, opt = make(seed=0)
    net = torch.compile(model, backend="aot_eager") if compiled == "before" else model
    mon = TrainerMon(cfg, params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(net, optimizer=opt)
    if compiled == "after":  # the monitor holds the model itself and learns of the compilation at its first step
        net = torch.compile(model, backend="aot_eager")
    graphs_at: dict[int, int] = {}
    for step in range(STEPS):
        loss_of(net, step).backward()
        opt.step()
        opt.zero_grad()
        graphs_at[step] = len(_compiled_frames)
    mon.close()
    return events_of(out), graphs_at


_compiled_frames: list = []


@pytest.fixture
def compiled_frames():
    """The code objects dynamo compiles, through its bytecode hook."""
    from torch._dynamo.convert_frame import register_bytecode_hook

    _compiled_frames.clear()
    handle = register_bytecode_hook(lambda code, new_code: _compiled_frames.append(code))
    torch._dynamo.reset()
    yield _compiled_frames
    handle.remove()
    torch._dynamo.reset()


# dynamo's own: it reads .grad of the non-leaf tensors a resumed frame (after a graph break) is given
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor")
@pytest.mark.parametrize("when", ["before", "after"])
def test_compiled_model_records_what_the_eager_model_records(tmp_path, monkeypatch, compiled_frames, when):
    """``before``: the compiled model is given to the monitor, whose hooks are made for it from the
    start. ``after``: the model is compiled once the monitor holds it (the hooks are plain, cheaper in
    eager mode); the first compiled forward tells the monitor, and the next collected step's hooks are
    made for it."""
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path))  # restored after the test
    eager_ev, _ = _run(tmp_path, "eager", compiled=None)
    compiled_frames.clear()
    comp_ev, graphs_at = _run(tmp_path, "compiled", compiled=when)
    assert compiled_frames, "dynamo compiled nothing: the model did not run compiled"
    ours = [(k, f"{os.path.basename(c.co_filename)}:{c.co_name}:{c.co_firstlineno}")
            for k, c in enumerate(compiled_frames) if c.co_filename.startswith(RECORDER_DIR)]
    if when == "before":
        assert ours == [], f"dynamo compiled the monitor's own code: {ours}"
    else:  # at most the chunk hooks' wrapper, which notices the compilation, in the first step
        chunk_hook = chunk_hooks._run_hook.__code__.co_consts
        assert all(k < graphs_at[0] and any(getattr(c, "co_firstlineno", None) == int(name.rsplit(":", 1)[1])
                                            and getattr(c, "co_name", None) == "hook" for c in chunk_hook)
                   for k, name in ours), ours
    # collected and skipped steps alternate: after both have been seen, nothing is compiled again
    assert graphs_at[STEPS - 1] == graphs_at[3], graphs_at
    assert not [e for e in comp_ev if isinstance(e, HookFailed)]
    for kind in ("actv", "actv_grad", "grad_unreduced", "grad_reduced", "param", "exp_avg", "update"):
        want, got = stats_table(eager_ev, kind), stats_table(comp_ev, kind)
        assert want, kind
        assert set(got) == set(want), (kind, sorted(set(got) ^ set(want))[:6])
        assert {k[0] for k in got} == set(range(0, STEPS, 2))
        for key, row in want.items():
            nan = {op for op, v in row.items() if math.isnan(v)}  # a slot without a tensor: NaN in both
            assert nan == {op for op, v in got[key].items() if math.isnan(v)}, (kind, key)
            assert_close({op: v for op, v in got[key].items() if op not in nan},
                         {op: v for op, v in row.items() if op not in nan}, rtol=1e-4, atol=1e-6, what=f"{kind} {key}")
    names = {k[1] for k in stats_table(comp_ev, "actv")}
    assert names and not any("_orig_mod" in n for n in names), names


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # dynamo's own
def test_a_compiled_optimizer_step_runs_the_monitors_hooks_uncompiled(tmp_path, monkeypatch, compiled_frames):
    """The optimizer step compiled (its step hooks are then traced with it): the monitor's pre- and
    post-step hooks run as Python, dynamo compiles none of the monitor's code (a traced hook reached
    the statistics kernel, which dynamo cannot trace, with a warning the suite makes an error), and the
    rows equal those of the step uncompiled."""
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = {"wg_distribution": True, "mv_distribution": True, "ops": ["norm", "max"]}
    tables = []
    for compiled in (False, True):
        model, opt = make(seed=0)
        mon = TrainerMon(dict(cfg), output_dir=str(tmp_path / str(compiled)), live_export=False)
        mon.monitor_gnorm_with_ad(model, optimizer=opt)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for s in range(3):
            loss_of(model, s).backward()
            step()
            opt.zero_grad()
        mon.close()
        ev = events_of(tmp_path / str(compiled))
        tables.append({kind: stats_table(ev, kind) for kind in ("grad_reduced", "exp_avg", "exp_avg_sq")})
    assert compiled_frames, "dynamo compiled nothing: the step did not run compiled"
    assert not [c for c in compiled_frames if c.co_filename.startswith(RECORDER_DIR)]
    for kind, want in tables[0].items():
        assert want and set(tables[1][kind]) == set(want), kind
        for key, row in want.items():
            assert_close(tables[1][kind][key], row, rtol=1e-5, atol=1e-7, what=f"{kind} {key}")


def _sequential():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_model_compiled_with_fullgraph_records_weight_gradients_and_refuses_activations(
        tmp_path, monkeypatch, compiled_frames):
    """``torch.compile(model, fullgraph=True)``, where a graph break is an error. The hooks on the model
    chunk go on the compiled wrapper, outside the graph (those of a ``torch.nn`` container are traced
    with its forward): weight gradients, per micro step, and parameters equal the uncompiled model's.
    The module hooks ``xy_distribution`` needs would be graph breaks inside the graph: a ConfigError
    at start-up, naming the key, rather than dynamo's error out of the first forward."""
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    cfg = {"wg_distribution": True, "param_distribution": True, "ops": ["norm", "min", "max", "mean"]}
    tables = []
    for compiled in (False, True):
        model, opt = _sequential()
        net = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        mon = TrainerMon(dict(cfg), output_dir=str(tmp_path / str(compiled)), live_export=False)
        mon.monitor_gnorm_with_ad(net, grad_acc_steps=2, optimizer=opt)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for _ in range(2):
                net(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        mon.close()
        ev = events_of(tmp_path / str(compiled))
        tables.append({kind: stats_table(ev, kind) for kind in ("grad_unreduced", "grad_reduced", "param")})
    assert compiled_frames, "dynamo compiled nothing: the model did not run compiled"
    assert len(tables[0]["grad_unreduced"]) == 3 * 2 * 4
    for kind, want in tables[0].items():
        assert want and set(tables[1][kind]) == set(want), kind
        for key, row in want.items():
            assert_close(tables[1][kind][key], row, rtol=1e-5, atol=1e-7, what=f"{kind} {key}")

    model, opt = _sequential()
    net = torch.compile(model, backend="aot_eager", fullgraph=True)
    mon = TrainerMon({"xy_distribution": True, "wg_distribution": True}, output_dir=str(tmp_path / "xy"),
                     live_export=False)
    with pytest.raises(ConfigError, match="'xy_distribution'.*fullgraph=True"):
        mon.monitor_gnorm_with_ad(net, optimizer=opt)
    mon.close()
