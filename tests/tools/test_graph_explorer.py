"""`trainrec graph compare --model-explorer`: Model Explorer's graph JSON and node data, read back by
ai-edge-model-explorer's own dataclasses (the way its node data runner reads a graph: dacite)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "analyzers"))

from graph_runs import record_run  # noqa: E402
from trainrec.tools.cli import main  # noqa: E402


def test_explorer_files_load_in_model_explorer(tmp_path, capsys):
    me = pytest.importorskip("model_explorer")
    from dacite import from_dict

    bench = record_run(tmp_path / "bench", steps=3)
    scaled = record_run(tmp_path / "scaled", steps=3, scale_at=1)
    out = tmp_path / "out"
    assert main(["graph", "compare", scaled, bench, "-o", str(out), "--model-explorer"]) == 0
    capsys.readouterr()
    graphs = json.loads((out / "explorer_graph.json").read_text())
    assert "step 1" in graphs["label"]
    loaded = [from_dict(data_class=me.graph_builder.Graph, data=g) for g in graphs["graphs"]]
    nodes = {n.id: n for n in loaded[0].nodes}
    assert "Module.blk.Scaled.forward.0" in nodes
    lin = nodes["Module.blk.lin.Linear.forward.0"]
    assert lin.namespace == "Module.Net.forward.0/Module.blk.Scaled.forward.0"
    assert [e.sourceNodeId for e in lin.incomingEdges] == ["Module.act.ReLU.forward.0"]  # execution order
    assert all(e.sourceNodeId in nodes for n in nodes.values() for e in n.incomingEdges)
    assert any(a.key == "output.0" and a.value.startswith("Max ") for a in lin.attrs)
    data = json.loads((out / "explorer_node_data.json").read_text())
    node_data = me.node_data_builder.ModelNodeData(
        graphsData={gid: from_dict(data_class=me.node_data_builder.GraphNodeData, data=d) for gid, d in data.items()})
    results = node_data.graphsData["debug"].results
    assert results["Module.blk.Scaled.forward.0"].value == 1.0
    assert results["Module.blk.lin.Linear.forward.0"].value == 0.0
    assert set(results) <= set(nodes)
    assert json.loads(node_data.to_json_string())["debug"]["thresholds"][-1]["value"] == 1.0
