"""Collective recording (``cc_distribution``) on a real gloo group of two ranks, and its config.

One spawned group runs every recording check (the calls, their sequence numbers per process group,
p2p and async forms, statistics before and after, call sites and the ``cc_codeline`` filter, the
wrappers removed on close) and prints what it found as JSON; the test compares that with the log.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from ranks import run_rank_scripts
from trainrec.recorder.config import parse_config
from trainrec.replay.run import open_run
from trainrec.schema.errors import ConfigError
from trainrec.schema.events import CollectiveCalled, CollectiveCompleted, unpack_array

pytestmark = pytest.mark.dist

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from trainrec.recorder import record
    from trainrec.recorder import collectives
    pair = dist.new_group([0, 1])
    original = dist.all_reduce
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"wg_distribution": True, "ops": ["norm", "max"],
           "cc_distribution": {"enable": True, "cc_pre_hook": True, "cc_codeline": [sys.argv[2]]}}
    found = {}
    with record(model, opt, cfg, output_dir=sys.argv[1]) as rec:
        found["wrapped"] = dist.all_reduce is not original and collectives.installed()
        x = torch.full((2, 3), float(rank + 1))
        dist.all_reduce(x)                                    # WORLD #0: 1 + 2 = 3 everywhere
        out = [torch.empty(2) for _ in range(2)]
        dist.all_gather(out, torch.full((2,), float(rank)), group=pair)   # pair #0
        dist.broadcast(x, src=1, group=pair)                  # pair #1
        if rank == 0:
            work = dist.isend(torch.arange(3.0), dst=1)       # WORLD #1
        else:
            work = dist.irecv(torch.empty(3), src=0)
        work.wait()
        dist.barrier()                                         # WORLD #2
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        def metric_sync():                                     # not a line cc_codeline names
            dist.all_reduce(torch.ones(1))                     # WORLD #3: counted, not recorded
        metric_sync()
        dist.all_reduce(torch.ones(5), async_op=True).wait()   # WORLD #4
    found["unwrapped"] = dist.all_reduce is original and not collectives.installed()
    print(json.dumps(found))
""")


@pytest.fixture(scope="module")
def group_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cc")
    out = tmp / "out"
    # cc_codeline: the lines of the script's calls, but metric_sync's (nor the line calling it)
    calls = ("all_reduce(", "all_gather(", "broadcast(", "isend(", "irecv(", "barrier(")
    lines = [str(i) for i, line in enumerate(SCRIPT.splitlines(), 1)
             if any(c in line for c in calls) and "not recorded" not in line]
    outputs = run_rank_scripts(SCRIPT, [str(out), rf"<string>\[({'|'.join(lines)})\]"], 2, tmp, timeout=180)
    return [json.loads(o.strip().splitlines()[-1]) for o in outputs], open_run(str(out))


def test_calls_are_recorded_with_group_sequence_numbers_shapes_and_peers(group_run):
    found, run = group_run
    assert all(f["wrapped"] and f["unwrapped"] for f in found)  # installed while open, removed on close
    for r in (0, 1):
        calls = [e for e in run.events(rank=r) if isinstance(e, CollectiveCalled)]
        got = [(e.op, tuple(e.group_ranks), e.group_seq, e.shapes, e.async_op, e.peer) for e in calls]
        p2p = ("isend", ((3,),), 1) if r == 0 else ("irecv", ((3,),), 0)
        assert got == [
            ("all_reduce", (0, 1), 0, ((2, 3),), False, -1),
            ("all_gather", (0, 1), 0, ((2,), (2,), (2,)), False, -1),
            ("broadcast", (0, 1), 1, ((2, 3),), False, 1),
            (p2p[0], (0, 1), 1, p2p[1], True, p2p[2]),
            ("barrier", (0, 1), 2, (), False, -1),
            ("all_reduce", (0, 1), 4, ((5,),), True, -1),  # #3 was left out by cc_codeline
        ]
        assert calls[0].group != calls[1].group  # WORLD and the new group: numbered apart
        assert all(e.dtypes == ("float32",) * len(e.shapes) for e in calls)
        assert calls[0].reduce_op == "SUM" and calls[2].reduce_op == ""
        assert all(e.codeline.startswith("<string>[") for e in calls)


def test_statistics_before_and_after_a_call(group_run):
    _, run = group_run
    for r in (0, 1):
        evs = list(run.events(rank=r))
        first = next(e for e in evs if isinstance(e, CollectiveCalled))
        assert first.ops == ("norm", "max")
        before = list(unpack_array("f", first.pre_values))
        assert before == pytest.approx([6 ** 0.5 * (r + 1), r + 1])  # six values of rank + 1
        done = [e for e in evs if isinstance(e, CollectiveCompleted)]
        assert done[0].group_seq == 0 and done[0].op == "all_reduce"
        assert list(unpack_array("f", done[0].values)) == pytest.approx([6 ** 0.5 * 3, 3])  # the sum
        # async calls get no statistics after them (their result is not there when the call returns),
        # nor does a call without tensors (the barrier)
        assert [e.op for e in done] == ["all_reduce", "all_gather", "broadcast"]


@pytest.mark.parametrize("cc, key", [
    ({"enable": True, "cc_codeline": ["train.py\\[("]}, "cc_distribution.cc_codeline[0]"),
    ({"enable": True, "cc_codeline": [3]}, "cc_distribution.cc_codeline[0]"),
    ({"enable": True, "cc_metadata_only": "yes"}, "cc_distribution.cc_metadata_only"),
])
def test_bad_cc_options_are_config_errors(cc, key):
    with pytest.raises(ConfigError) as info:
        parse_config({"cc_distribution": cc})
    assert info.value.key == key


@pytest.mark.parametrize("raw, want", [
    (True, {"enable": True, "factor": 5.0, "min_seconds": 60.0}),
    ({"factor": 3, "min_seconds": 0.5}, {"enable": True, "factor": 3.0, "min_seconds": 0.5}),
    (False, {"enable": False, "factor": 5.0, "min_seconds": 60.0}),
])
def test_stall_watchdog_config(raw, want):
    assert parse_config({"stall_watchdog": raw}).stall_watchdog == want


@pytest.mark.parametrize("raw, key", [
    ({"factor": 1}, "stall_watchdog.factor"), ({"min_seconds": 0}, "stall_watchdog.min_seconds"),
    ({"every": 3}, "stall_watchdog"), ("on", "stall_watchdog"), ({"enable": 1}, "stall_watchdog.enable"),
])
def test_bad_stall_watchdog_config(raw, key):
    with pytest.raises(ConfigError) as info:
        parse_config({"stall_watchdog": raw})
    assert info.value.key == key
