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


def test_vis_file_in_tensorboard_with_tb_graph_ascend(tmp_path, capsys):
    pytest.importorskip("server.plugin", reason="tb-graph-ascend is not installed (pip install tb-graph-ascend)")
    tensorboard = shutil.which("tensorboard", path=os.path.dirname(sys.executable)) or shutil.which("tensorboard")
    if tensorboard is None:
        pytest.skip("no tensorboard command")
    bench = copy_dump(tmp_path)
    for step in (0, 1):  # one API renamed (unmatched); at step 1 fc2's output on the bench side halved
        path = os.path.join(bench, f"step{step}", "rank", "dump.json")
        with open(path) as f:
            dump = json.loads(f.read().replace('"Functional.relu.0.forward"', '"Functional.gelu.0.forward"'))
        if step == 1:
            dump["data"]["Module.fc2.Linear.forward.0"]["output"][0]["Norm"] /= 2
        with open(path, "w") as f:
            json.dump(dump, f)
    logdir = tmp_path / "logdir"
    out = logdir / "run1"
    assert main(["graph", "compare", DUMP_DIR, bench, "-o", str(out), "--vis", "-oc"]) == 0
    capsys.readouterr()
    port = free_port()
    proc = subprocess.Popen([tensorboard, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/data/plugin/graph_ascend"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                meta = json.loads(_get(f"{base}/load_meta_dir", timeout=2))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        assert meta["data"] == {"run1": {"type": "json", "tags": ["compare"]}}
        stream = _get(f"{base}/loadGraphData?run=run1&tag=compare&type=json&lang=en").decode()
        assert '"done": true' in stream.strip().splitlines()[-1]
        md = {"metaData": {"run": "run1", "tag": "compare", "type": "json", "microStep": -1, "lang": "en"}}
        config = json.loads(_get(f"{base}/loadGraphConfigInfo", md))
        assert config["success"] and not config["data"]["isSingleGraph"] and config["data"]["task"] == "summary"
        lists = json.loads(_get(f"{base}/loadGraphAllNodeList", md))["data"]
        assert lists["npuUnMatchNodes"] == ["Functional.relu.0.forward"]
        assert lists["benchUnMatchNodes"] == ["Functional.gelu.0.forward"]
        assert len(lists["npuNodeList"]) == 13
        for side, names in (("NPU", lists["npuNodeList"]), ("Bench", lists["benchNodeList"])):
            for name in names:
                info = json.loads(_get(f"{base}/getNodeInfo", {**md, "nodeInfo": {"nodeName": name, "nodeType": side}}))
                assert info["success"], (side, name, info)
                own = info["data"]["npu" if side == "NPU" else "bench"]
                other = info["data"]["bench" if side == "NPU" else "npu"]
                assert own["id"] == name
                unmatched = name in ("Functional.relu.0.forward", "Functional.gelu.0.forward")
                assert (other is None) == unmatched, (side, name)
        node = json.loads(_get(f"{base}/getNodeInfo", {**md, "nodeInfo": {"nodeName": "Module.fc1.Linear.forward.0",
                                                                            "nodeType": "NPU"}}))["data"]["npu"]
        out0 = node["output_data"]["Module.fc1.Linear.forward.0.output.0"]
        assert out0["shape"] == [4, 16] and out0["NormRelativeErr"] == 0.0 and node["data"]["precision_index"] == 0.0
        fc2 = json.loads(_get(f"{base}/getNodeInfo", {**md, "nodeInfo": {"nodeName": "Module.fc2.Linear.forward.0",
                                                                           "nodeType": "NPU"}}))["data"]["npu"]
        assert fc2["data"]["precision_index"] == 1.0  # the file shows step 1, the first divergent one
        assert fc2["output_data"]["Module.fc2.Linear.forward.0.output.0"]["NormRelativeErr"] == 1.0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
