"""Names activations are recorded under when ``targets`` names a module, with ``squash_name`` on (the
reference's ``_is_target_module``): the squashed name where a key gives the squashed form, the full
name where a key gives only the full name (the documented ``language_model.encoder.layers.0``), and
the squashed name for every module under ``all_xy``."""

from __future__ import annotations

import pytest
from test_monitor_options import train
from trainmon_util import events_of, stats_table


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
