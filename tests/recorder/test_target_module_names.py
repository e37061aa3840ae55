"""Names activations are recorded under when ``targets`` names a module, with ``squash_name`` on (the
reference's ``_is_target_module``): the squashed name where a key gives the squashed form, the full
name where a key gives only the full name (the documented ``language_model.encoder.layers.0``), and
the squashed name for every module under ``all_xy``."""

from __future__ import annotations

import pytest
from trainmon_util import events_of, stats_table, train


@pytest.mark.parametrize(("all_xy", "want"), [
    (False, {"layers.1", "0.0", "pair"}),
    (True, {"1", "0.0", "pair"}),
])
def test_a_module_targeted_by_its_full_name_keeps_it(tmp_path, out, all_xy, want):
    cfg = {"xy_distribution": True, "all_xy": all_xy, "ops": ["norm"],
           "targets": {"layers.1": {}, "0.0": {}, "0:pair": {}}}
    train(tmp_path, cfg, steps=1)
    ev = events_of(out)
    names = {k[1] for k in stats_table(ev, "actv")} | {k[1] for k in stats_table(ev, "actv_grad")}
    assert want <= names
    if not all_xy:
        assert names == want
    else:
        assert "layers.1" not in names


def test_a_full_name_that_is_another_modules_squashed_name_stays_squashed(tmp_path, out):
    """``layers.0`` by its full name, where ``blocks.layer.layers.0`` squashes to ``layers.0`` too:
    the key matches both, and recording the first under its full name would give them one name."""
    import torch
    from trainmon_util import write_config
    from trainrec.recorder import TrainerMon

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 3)])

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(3, 3)])
            self.blocks = torch.nn.Module()
            self.blocks.layer = Inner()

        def forward(self, x):
            return self.blocks.layer.layers[0](self.layers[0](x))

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"xy_distribution": True, "ops": ["norm"], "targets": {"layers.0": {}}}
    mon = TrainerMon(write_config(tmp_path, cfg), params_have_main_grad=False, live_export=False)
    mon.monitor_gnorm_with_ad(model, optimizer=opt)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    mon.close()
    names = [k[1] for k in stats_table(events_of(out), "actv")]
    assert sorted(set(names)) == ["0", "layers.0"]  # one name each (without the check: both "layers.0")


@pytest.mark.parametrize("target", ["head", "head.weight", "0:head", "emb"])
def test_a_tied_parameter_is_selected_through_either_module(out, target):
    """An output layer tied to the embedding (GPT-2's ``lm_head``): ``named_parameters()`` lists the
    shared weight once, as ``emb.weight``. A target naming the output layer selects it too (it selected
    nothing, silently, and ``head.weight`` was a ConfigError), recorded under that one name."""
    import torch
    from trainrec.recorder import record

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.mid = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.mid(self.emb(x)))

    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(model, opt, config={"wg_distribution": True, "ops": ["norm"], "targets": {target: {}}},
                output_dir=str(out)):
        model(torch.tensor([1, 2, 3])).sum().backward()
        want = model.emb.weight.grad.norm().item()
        opt.step()
    rows = stats_table(events_of(out), "grad_reduced")
    assert list(rows) == [(0, "emb.weight", "", 0)]
    assert rows[(0, "emb.weight", "", 0)]["norm"] == pytest.approx(want, rel=1e-6)
