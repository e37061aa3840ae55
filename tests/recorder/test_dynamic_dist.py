"""Two real gloo ranks sharing one config file switch at the same step.

Rank 1's loader waits much longer before reading (settle 0.4 s against 0.02 s), so the ranks see every
change at different steps; the agreement round must still make them decide at one step.
"""

from __future__ import annotations

import json

import pytest
from ranks import run_rank_scripts

pytestmark = pytest.mark.dist

RANK_SCRIPT = r"""
import json, logging, os, sys, time
import torch
import torch.distributed as dist
from trainrec.recorder.dynamic import DynamicConfigWatcher
from trainrec.schema.events import ConfigChanged, ConfigRejected

rank = int(os.environ["RANK"])
path = sys.argv[1]
dist.init_process_group("gloo", rank=rank, world_size=2)
wrote = []
class H(logging.Handler):
    def emit(self, record):
        if "wrote switch=false back" in record.getMessage():
            wrote.append(record.getMessage())
logging.getLogger("trainrec").addHandler(H())
logging.getLogger("trainrec").setLevel(logging.INFO)

def validate(raw):
    return dict(raw)

events = []
w = DynamicConfigWatcher(path, validate=validate, emit=events.append, rank=rank, writes_back=rank == 0,
                         settle=0.02 if rank == 0 else 0.4, invalid_grace=0.0, sync_period=0.02)
w.start()
grad = torch.ones(1000)
updates, first_seen, texts, seen_at = [], {}, [], []
phase, phase_step, end_step = 0, None, None

def edit(doc):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)

for step in range(4000):
    dist.all_reduce(grad)  # the training's own collective: ranks run in lockstep, as under DDP
    time.sleep(0.003)
    latest = w._latest
    if latest is not None and latest.identity not in first_seen:
        first_seen[latest.identity] = step
    u = w.poll(step)
    if u is not None:
        updates.append([step, u.content_hash, u.switch, u.raw.get("collect_times")])
        seen_at.append(first_seen[w._agreed_identity])  # when this rank itself first read it
        if u.switch and phase == 1:
            phase, phase_step = 2, step
        elif u.switch and phase == 6:
            end_step = step + 10
    n_changed = sum(isinstance(e, ConfigChanged) for e in events)
    n_rejected = sum(isinstance(e, ConfigRejected) for e in events)
    if phase == 0 and step == 20:
        phase = 1
        if rank == 0:
            edit({"switch": True, "collect_times": 3})
    elif phase == 2 and step == phase_step + 3:  # every rank counts 3 collections from the same step
        w.collection_finished(step)
        phase = 3
    elif phase == 3 and n_changed == 3:  # the write-back, seen and agreed by every rank
        phase = 4
        texts.append(open(path).read())
    elif phase == 4:
        phase = 5
        if rank == 0:
            with open(path, "w") as f:
                f.write('{"switch": true, "collect_times": 5,}')
    elif phase == 5 and n_rejected == 1:
        phase = 6
        if rank == 0:
            edit({"switch": True, "collect_times": 5})
    if end_step is not None and step == end_step:
        break
w.close()
dist.barrier()  # nobody tears the group down while a peer still talks to it
dist.destroy_process_group()
out = {
    "updates": updates,
    "events": [[type(e).__name__, e.step, e.content_hash] for e in events],
    "seen_at": seen_at,
    "wrote": len(wrote),
    "texts": texts,
    "last_step": step,
}
print("RESULT " + json.dumps(out))
"""


def test_two_gloo_ranks_switch_at_the_same_step(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"switch": False, "collect_times": 3}, indent=2))
    stdouts = run_rank_scripts(RANK_SCRIPT, [str(path)], 2, tmp_path, timeout=180)
    outs = [json.loads([x for x in o.splitlines() if x.startswith("RESULT ")][-1][len("RESULT ") :]) for o in stdouts]
    r0, r1 = outs
    assert r0["last_step"] < 3999, "the scenario did not finish"
    # Both ranks decided everything at the same steps: start, (write-back seen), rejection, restart.
    assert r0["updates"] == r1["updates"]
    assert [u[2:] for u in r0["updates"]] == [[True, 3], [True, 5]]
    assert r0["events"] == r1["events"]
    kinds = [e[0] for e in r0["events"]]
    assert kinds == [
        "ConfigChanged",
        "ConfigChanged",
        "ConfigChanged",
        "ConfigChanged",
        "ConfigRejected",
        "ConfigChanged",
    ]
    # ...although each rank read the changes at its own step, rank 1 well after rank 0.
    for (step, *_), seen0, seen1 in zip(r0["updates"], r0["seen_at"], r1["seen_at"], strict=True):
        assert step >= max(seen0, seen1) and seen1 > seen0
    assert max(b - a for a, b in zip(r0["seen_at"], r1["seen_at"], strict=True)) > 10
    # Only rank 0 wrote switch=false back, and both ranks saw it.
    assert (r0["wrote"], r1["wrote"]) == (1, 0)
    assert json.loads(r0["texts"][0]) == {"switch": False, "collect_times": 3} == json.loads(r1["texts"][0])
    assert json.loads(path.read_text()) == {"switch": True, "collect_times": 5}
