"""End to end: two real gloo ranks train a CPU model under TrainerMon with ``alert`` configured; one
layer's weights are scaled at a known step. The recorded anomalies, the reference-format dump and the
re-detection from the recorded statistics all put that layer first."""

from __future__ import annotations

import json
import os

import pytest
from ranks import run_rank_scripts
from trainrec.replay.run import open_run
from trainrec.tools.anomaly_analyse import main as analyse_main
from trainrec.tools.cli import main as cli_main

pytestmark = pytest.mark.dist

STEPS, INJECT = 14, 11

RANK_SCRIPT = r"""
import os, sys
import torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from trainrec.recorder.monitor import TrainerMon

torch.set_num_threads(1)
out, steps, inject = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
torch.manual_seed(0)

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.norm, self.act = nn.Linear(d, d), nn.LayerNorm(d), nn.ReLU()
    def forward(self, x):
        return self.act(self.norm(self.fc(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.layers = nn.ModuleList([Block(64) for _ in range(3)])
        self.head = nn.Linear(64, 4)
    def forward(self, x):
        h = self.inp(x)
        for b in self.layers:
            h = b(h)
        return self.head(h)

net = Net()
model = DDP(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
# one pipeline stage per rank group of one: both ranks are data-parallel replicas at pp stage 0
groups = [dist.new_group([0]), dist.new_group([1])]
cfg = {"xy_distribution": True, "all_xy": True, "wg_distribution": True, "param_distribution": True,
       "mv_distribution": True, "ops": ["nans", "zeros", "mean", "norm", "max", "min"], "format": "csv",
       "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True}}
mon = TrainerMon(cfg, process_group=groups[rank], params_have_main_grad=False, output_dir=out, live_export=False)
mon.monitor_gnorm_with_ad(model, grad_acc_steps=2, optimizer=opt)
g = torch.Generator().manual_seed(100 + rank)
w = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
data = [torch.randn(32, 16, generator=g) for _ in range(2)]
for step in range(steps):
    if step == inject:
        with torch.no_grad():
            net.layers[1].fc.weight.mul_(100)
    for micro in range(2):
        ctx = model.no_sync() if micro == 0 else torch.enable_grad()
        with ctx:
            (((model(data[micro]) - data[micro] @ w) ** 2).mean() / 2).backward()
    opt.step()
    opt.zero_grad()
mon.close()
dist.barrier()
dist.destroy_process_group()
print("DONE", rank)
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("monitor_output"))
    stdouts = run_rank_scripts(RANK_SCRIPT, [out, str(STEPS), str(INJECT)], 2, tmp_path_factory.mktemp("ranks"), 240)
    assert all("DONE" in o for o in stdouts)
    return out


def _cli_json(capsys, *argv):
    assert cli_main(["anomalies", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_injected_layer_is_ranked_first(trained, capsys):
    recorded = _cli_json(capsys, trained, "--all")
    first = recorded[0]
    assert (first["step"], first["micro_step"], first["phase"], first["rank"]) == (INJECT, 0, "fwd", 0)
    assert first["tag_name"] == "0:1.fc_0/rank0/output"
    assert abs(first["value"]) > 50 * abs(first["baseline"])
    # the same point on the other data-parallel rank follows, before anything downstream
    assert recorded[4]["tag_name"] == "0:1.fc_0/rank1/output"
    # the defaults do not flood: nothing was flagged in the steps before the injection
    assert [r for r in recorded if r["step"] < INJECT] == []
    # the log records a pp stage and group mates for every rank
    assert {(r["rank"], r["pp_stage"], tuple(r["group_mates"])) for r in recorded} == {(0, 0, (0,)), (1, 0, (1,))}


def test_redetection_from_the_statistics(trained, capsys):
    recorded = _cli_json(capsys, trained, "--all")
    again = _cli_json(capsys, trained, "--all", "--rule", "AnomalyTurbulence", "--threshold", 0.5)
    ident = lambda r: (r["rank"], r["step"], r["micro_step"], r["call_id"], r["tag_name"], r["op"])  # noqa: E731
    assert [ident(r) for r in again] == [ident(r) for r in recorded]
    strict = _cli_json(capsys, trained, "--all", "--rule", "AnomalyTurbulence", "--threshold", 20)
    loose = _cli_json(capsys, trained, "--all", "--rule", "AnomalyTurbulence", "--threshold", 0.2)
    assert {ident(r) for r in strict} < {ident(r) for r in recorded} <= {ident(r) for r in loose}
    assert ident(strict[0])[:5] == ident(recorded[0])[:5]  # the same first tensor (another of its ops, maybe)
    nan = _cli_json(capsys, trained, "--all", "--rule", "NaNInf")
    assert nan == []


def test_the_reference_format_dump_ranks_the_same(trained, capsys, tmp_path):
    dump = os.path.join(trained, "anomaly_detected")
    assert sorted(os.listdir(dump)) == ["rank0", "rank1"]
    code = analyse_main(["-d", dump, "-k", "3", "-o", str(tmp_path)])
    capsys.readouterr()
    assert code == 0
    with open(tmp_path / "anomaly_analyse.json") as f:
        top = json.load(f)
    first_key, first = next(iter(top.items()))
    assert first_key == f"0:1.fc_0/rank0/output_step_{INJECT}_call_{first['call_id']}"
    assert list(first) == ["rank", "step", "micro_step", "pp_stage", "vpp_stage", "call_id", "tag_name", "message",
                           "group_mates"]
    assert first["message"].startswith("Rule AnomalyTurbulence reports anomaly signal in ('0:1.fc_0/rank0/output', ")
    # and the dump holds what the log holds (one entry per tag, step and call, as the reference keys it)
    events = list(open_run(trained).events(types=["AnomalyDetected"]))
    keys = {f"{e.tag_name}_step_{e.step}_call_{e.call_id}" for e in events}
    dumped = set()
    for r in ("rank0", "rank1"):
        with open(os.path.join(dump, r, "anomaly.json")) as f:
            dumped |= set(json.load(f))
    assert dumped == keys


def test_ranking_the_log_keeps_the_entry_the_dump_keeps(trained, capsys, tmp_path):
    """Several ops of one tensor flagged at one step and call share the reference's key: anomaly_analyse
    on the log keeps the entry the live anomaly.json kept (the last op in the config's order), not
    another op's."""
    dumped = {}
    for r in ("rank0", "rank1"):
        with open(os.path.join(trained, "anomaly_detected", r, "anomaly.json")) as f:
            dumped.update(json.load(f))
    events = list(open_run(trained).events(types=["AnomalyDetected"]))
    ops_per_key: dict = {}
    for e in events:
        ops_per_key.setdefault(f"{e.tag_name}_step_{e.step}_call_{e.call_id}", set()).add(e.op)
    assert any(len(ops) > 1 for ops in ops_per_key.values())  # the case in question occurs in this run
    assert analyse_main(["-d", trained, "-k", str(len(ops_per_key)), "-o", str(tmp_path)]) == 0
    capsys.readouterr()
    with open(tmp_path / "anomaly_analyse.json") as f:
        top = json.load(f)
    assert set(top) == set(dumped)
    assert {k: v["message"] for k, v in top.items()} == {k: v["message"] for k, v in dumped.items()}
