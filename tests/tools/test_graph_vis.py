"""`trainrec graph compare --vis`: the .vis file served by the real tb-graph-ascend plugin in a real
TensorBoard on 127.0.0.1: listed, loaded, its config and node lists read, and every node of both
sides resolved through the plugin's getNodeInfo with its counterpart."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "analyzers"))

from graph_runs import DUMP_DIR, copy_dump  # noqa: E402
from ranks import free_port  # noqa: E402
from trainrec.tools.cli import main  # noqa: E402


def _get(url: str, data: dict | None = None, timeout: float = 20) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(data).encode() if data is not None else None,
                                 method="POST" if data is not None else "GET")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def _dumps(tmp_path) -> str:
    """A bench copy of the hand-made dump: one API renamed (unmatched); at step 1 fc2's output halved."""
    bench = copy_dump(tmp_path)
    for step in (0, 1):
        path = os.path.join(bench, f"step{step}", "rank", "dump.json")
        with open(path) as f:
            dump = json.loads(f.read().replace('"Functional.relu.0.forward"', '"Functional.gelu.0.forward"'))
        if step == 1:
            dump["data"]["Module.fc2.Linear.forward.0"]["output"][0]["Norm"] /= 2
        with open(path, "w") as f:
            json.dump(dump, f)
    return bench


class _TensorBoard:
    """A real TensorBoard (with whatever plugins are installed) on 127.0.0.1, stopped on exit."""

    def __init__(self, logdir) -> None:
        pytest.importorskip("server.plugin", reason="tb-graph-ascend is not installed (pip install tb-graph-ascend)")
        tb = shutil.which("tensorboard", path=os.path.dirname(sys.executable)) or shutil.which("tensorboard")
        if tb is None:
            pytest.skip("no tensorboard command")
        port = free_port()
        self.base = f"http://127.0.0.1:{port}/data/plugin/graph_ascend"
        self.proc = subprocess.Popen([tb, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self):
        deadline = time.monotonic() + 60
        while True:
            try:
                self.meta = json.loads(self.get("load_meta_dir", timeout=2))
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def get(self, what: str, data: dict | None = None, timeout: float = 20) -> bytes:
        return _get(f"{self.base}/{what}", data, timeout)

    def post(self, what: str, data: dict) -> dict:
        return json.loads(self.get(what, data))


def test_vis_file_in_tensorboard_with_tb_graph_ascend(tmp_path, capsys):
    bench = _dumps(tmp_path)
    logdir = tmp_path / "logdir"
    assert main(["graph", "compare", DUMP_DIR, bench, "-o", str(logdir / "run1"), "--vis", "-oc"]) == 0
    capsys.readouterr()
    with _TensorBoard(logdir) as tb:
        assert tb.meta["data"] == {"run1": {"type": "json", "tags": ["compare"]}}
        stream = tb.get("loadGraphData?run=run1&tag=compare&type=json&lang=en").decode()
        assert '"done": true' in stream.strip().splitlines()[-1]
        md = {"metaData": {"run": "run1", "tag": "compare", "type": "json", "microStep": -1, "lang": "en"}}
        config = tb.post("loadGraphConfigInfo", md)
        assert config["success"] and not config["data"]["isSingleGraph"] and config["data"]["task"] == "summary"
        lists = tb.post("loadGraphAllNodeList", md)["data"]
        assert lists["npuUnMatchNodes"] == ["Functional.relu.0.forward"]
        assert lists["benchUnMatchNodes"] == ["Functional.gelu.0.forward"]
        assert len(lists["npuNodeList"]) == 13
        _every_node_resolves(tb, md, lists)
        node = _node(tb, md, "Module.fc1.Linear.forward.0")
        out0 = node["output_data"]["Module.fc1.Linear.forward.0.output.0"]
        assert out0["shape"] == [4, 16] and out0["NormRelativeErr"] == 0.0 and node["data"]["precision_index"] == 0.0
        fc2 = _node(tb, md, "Module.fc2.Linear.forward.0")
        assert fc2["data"]["precision_index"] == 1.0  # the file shows step 1, the first divergent one
        assert fc2["output_data"]["Module.fc2.Linear.forward.0.output.0"]["NormRelativeErr"] == 1.0


def _node(tb, md: dict, name: str) -> dict:
    return tb.post("getNodeInfo", {**md, "nodeInfo": {"nodeName": name, "nodeType": "NPU"}})["data"]["npu"]


def _every_node_resolves(tb, md: dict, lists: dict) -> None:
    unmatched = set(lists["npuUnMatchNodes"]) | set(lists["benchUnMatchNodes"])
    for side, names in (("NPU", lists["npuNodeList"]), ("Bench", lists["benchNodeList"])):
        for name in names:
            info = tb.post("getNodeInfo", {**md, "nodeInfo": {"nodeName": name, "nodeType": side}})
            assert info["success"], (side, name, info)
            own = info["data"]["npu" if side == "NPU" else "bench"]
            other = info["data"]["bench" if side == "NPU" else "npu"]
            assert own["id"] == name and "stack_info" in own
            assert (other is None) == (name in unmatched), (side, name)


def test_vis_db_steps_and_ranks_in_tensorboard(tmp_path, capsys, monkeypatch):
    from graph_runs import record_run

    bench = _dumps(tmp_path)
    logdir = tmp_path / "logdir"
    assert main(["graph", "compare", DUMP_DIR, bench, "-o", str(logdir / "dumps"), "--vis-db"]) == 0
    run = tmp_path / "ranks"
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("TRAINREC_RUN_ID", "visdb-ranks")
    for rank, scale_at in ((0, None), (1, None), (2, 1)):
        monkeypatch.setenv("RANK", str(rank))
        record_run(run, steps=3, scale_at=scale_at)
    assert main(["graph", "ranks", str(run), "--scope", "all", "-o", str(logdir / "ranks"), "--vis-db"]) == 0
    capsys.readouterr()
    with _TensorBoard(logdir) as tb:
        assert tb.meta["data"]["dumps"] == {"type": "db", "tags": ["compare"]}
        assert tb.meta["data"]["ranks"] == {"type": "db", "tags": ["ranks"]}
        for run_name, tag, ranks, steps in (("dumps", "compare", [0], [0, 1]), ("ranks", "ranks", [1, 2], [0, 1, 2])):
            # (the plugin hands its result dict to the response as is: the body is its keys, "success" when
            # the database opened, "successerror" when not)
            assert tb.get(f"loadGraphData?run={run_name}&tag={tag}&type=db&lang=en") == b"success"
            base = {"run": run_name, "tag": tag, "type": "db", "microStep": -1, "lang": "en"}
            config = tb.post("loadGraphConfigInfo", {"metaData": base})["data"]
            assert (config["ranks"], config["steps"]) == (ranks, steps)  # the Rank and Step dropdowns
            for rank in ranks:
                for step in steps:
                    md = {"metaData": {**base, "rank": rank, "step": step}}
                    lists = tb.post("loadGraphAllNodeList", md)["data"]
                    assert lists["npuNodeList"] and len(lists["npuNodeList"]) == len(lists["benchNodeList"])
                    _every_node_resolves(tb, md, lists)
        md = {"metaData": {"run": "ranks", "tag": "ranks", "type": "db", "microStep": -1, "lang": "en"}}
        assert tb.get("loadGraphData?run=ranks&tag=ranks&type=db&lang=en") == b"success"
        tb.post("loadGraphConfigInfo", md)
        scaled = "Module.blk.Scaled.forward.0"
        precision = {(r, s): _node(tb, {"metaData": {**md["metaData"], "rank": r, "step": s}}, scaled)["data"]["precision_index"]
                     for r in (1, 2) for s in (0, 1)}
        assert precision == {(1, 0): 0.0, (1, 1): 0.0, (2, 0): 0.0, (2, 1): 1.0}
