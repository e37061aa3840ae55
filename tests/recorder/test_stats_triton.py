"""The Triton statistics engine (recorder/device_stats.py), its kernels run by Triton's interpreter on
CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1): values equal float64 references for every op,
dtype and layout, through the engine and through the whole recorder; launches do not grow with the
number of tensors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from test_stats_engine import OPS, cases
from torch.utils._python_dispatch import TorchDispatchMode
from trainmon_util import ALL_OPS, events_of, stats_table
from trainrec.recorder import record
from trainrec.recorder.adam_update import bias_corrections, device_update_and_ratio, update_and_ratio
from trainrec.recorder.stats import StatsEngine

pytest.importorskip("triton")
from trainrec.recorder import device_stats  # noqa: E402

if not device_stats.INTERPRET and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if device_stats.INTERPRET else "cuda"


@pytest.fixture(autouse=True)
def no_fallback(monkeypatch):
    """A failure of the Triton engine fails the test (the recorder itself warns and falls back to torch)."""

    def fail(self, exc):
        raise AssertionError("the Triton engine failed") from exc

    monkeypatch.setattr(StatsEngine, "_triton_failed", fail)


@pytest.fixture
def launches(monkeypatch):
    """The tensors of each batch the Triton engine measured (a list per call of TritonStats._run)."""
    seen: list = []
    real = device_stats.TritonStats._run

    def spy(self, xs, *args):
        seen.append(list(xs))
        return real(self, xs, *args)

    monkeypatch.setattr(device_stats.TritonStats, "_run", spy)
    return seen


def triton_engine(eps: float) -> StatsEngine:
    eng = StatsEngine(OPS, eps, backend="triton")
    assert DEVICE in eng.triton_devices and not eng.fused
    return eng


def ref(t: torch.Tensor | None, eps: float, scale: float = 1.0) -> list[float]:
    if t is None or t.numel() == 0:
        return [math.nan] * 6
    d = t.detach().to(torch.float64) * scale
    return [d.min().item(), d.max().item(), d.norm().item(), d.mean().item(),
            (d.abs() < eps).double().mean().item(), float(torch.isnan(d).sum())]


def assert_rows(rows: torch.Tensor, want: list[list[float]], rtol: float = 1e-4, what: str = "") -> None:
    got = rows.cpu().tolist()
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for op, a, b in zip(OPS, g, w, strict=True):
            ok = math.isnan(a) if math.isnan(b) else (a == b or abs(a - b) <= 1e-6 + rtol * abs(b))
            assert ok, f"{what} row {i} {op}: got {a}, want {b}"


@pytest.mark.parametrize("eps", [1e-8, 0.25])
def test_every_op_every_dtype_and_layout_matches_float64(eps, launches):
    """The shared cases (float32/64, bf16, fp16, transposed and sliced views, ints, bools, 0-d, inf,
    NaN): float64 references; the kernels measured the ones they read."""
    eng = triton_engine(eps)
    named = cases()
    rows = eng.compute([t.to(DEVICE) for _, t in named])
    for (name, t), row in zip(named, rows.cpu(), strict=True):
        assert_rows(row[None], [ref(t, eps)], what=name)
    measured = [t for batch in launches for t in batch if t is not None]
    assert {t.dtype for t in measured} == {torch.float32, torch.bfloat16, torch.float16}


def many(g: torch.Generator) -> list:
    """Many small tensors of three dtypes and a few larger ones (several programs each), with None,
    an empty tensor, non-contiguous views, NaN and inf among them."""
    xs: list = []
    for i in range(40):
        t = torch.randn(1 + 7 * i, generator=g)
        xs.append(t.to((torch.float32, torch.bfloat16, torch.float16)[i % 3]))
    big = torch.randn(300_001, generator=g)
    big[big.abs() < 0.01] = 0
    xs += [big, None, torch.randn(600, 400, generator=g).t(), torch.empty(0, 3),
           torch.randn(2, 3, 8, 8, generator=g).to(memory_format=torch.channels_last),
           torch.randn(70_000, generator=g).to(torch.bfloat16),
           torch.tensor([1.0, float("nan"), -2.0]), torch.tensor([float("inf"), 1.0]),
           torch.randn(50, 60, generator=g)[:, ::2]]
    return [None if t is None else t.to(DEVICE) for t in xs]


@pytest.mark.parametrize("eps", [1e-8, 0.3])
def test_many_tensors_in_one_batch(eps, launches):
    g = torch.Generator().manual_seed(1)
    xs = many(g)
    rows = triton_engine(eps).compute(xs)
    assert_rows(rows, [ref(t, eps) for t in xs], rtol=2e-4)
    assert len(launches) == 1 and len(launches[0]) == len(xs)


@pytest.mark.parametrize("as_tensors", [False, True])
def test_scales_give_the_statistics_of_the_scaled_tensor(as_tensors):
    g = torch.Generator().manual_seed(2)
    xs = [t for t in many(g) if t is not None]
    scales = [0.5 + i / 10 for i in range(len(xs))]
    given = [torch.tensor(s, device=DEVICE) for s in scales] if as_tensors else scales
    eps = 0.2
    rows = triton_engine(eps).compute(xs, given)
    assert_rows(rows, [ref(t, eps, s) for t, s in zip(xs, scales, strict=True)], rtol=2e-4)


def test_a_hooks_few_tensors_take_the_direct_launches(launches):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 50_000, generator=g).to(DEVICE)
    y = torch.randn(3, 7, generator=g).to(torch.bfloat16).to(DEVICE)
    eng = triton_engine(1e-8)
    rows = eng.rows([x, None, y, torch.empty(0, device=DEVICE)])
    assert_rows(rows, [ref(x, 1e-8), ref(None, 0), ref(y, 1e-8), ref(None, 0)])
    assert eng._triton._tables == {}  # (no table: the tensors were passed directly)


def test_tables_are_reused_and_see_new_values():
    """The table of addresses is reused while the tensors stay where they are; values changed in place
    are read again, and a tensor in new memory gets a new table."""
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(100 + i, generator=g).to(DEVICE) for i in range(6)]
    eng = triton_engine(1e-8)
    eng.compute(xs)
    xs[2].mul_(3)
    rows = eng.compute(xs)
    assert len(eng._triton._tables) == 1
    assert_rows(rows, [ref(t, 1e-8) for t in xs])
    xs[3] = xs[3] * 2
    assert_rows(eng.compute(xs), [ref(t, 1e-8) for t in xs])
    assert len(eng._triton._tables) == 2


def adam_entries(dtype: torch.dtype, steps: int = 3):
    """lookup-style entries (index, exp_avg, exp_avg_sq, step, group) after real AdamW steps."""
    torch.manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(n, device=DEVICE).to(dtype)) for n in (3, 40, 1000, 70_000, 5)]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        params[0].grad.zero_()  # a tensor whose v is 0 at first: ratio 0 there
        opt.step()
    group = opt.param_groups[0]
    return [(i, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], float(opt.state[p]["step"]), group)
            for i, p in enumerate(params)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_and_ratio_from_state_pairs(dtype):
    entries = adam_entries(dtype)
    eng = triton_engine(1e-8)
    pair = device_update_and_ratio(entries, eng)
    assert pair is not None
    scales, shifts = bias_corrections(entries)
    for got, what in zip(pair, ("update", "ratio"), strict=True):
        want = []
        for (_, m, v, _, _), c, shift in zip(entries, scales, shifts, strict=True):
            denom = v.double().sqrt().clamp_min(torch.finfo(v.dtype).tiny)
            want.append(ref(c * m.double() / (denom + (shift if what == "update" else 0.0)), 1e-8))
        assert_rows(got, want, rtol=1e-4, what=what)
    # torch's path (float32 states) agrees; for bf16 states it rounds sqrt(v) and the quotient to bf16
    if dtype is torch.float32:
        torch_eng = StatsEngine(OPS, 1e-8, backend="torch")
        torch_eng.host_paths = False
        for got, exp in zip(pair, update_and_ratio(entries, torch_eng.compute, True, True), strict=True):
            assert_rows(got, exp.cpu().tolist(), rtol=1e-4)


class CountOps(TorchDispatchMode):
    """Counts the torch ops dispatched on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def ops_of_a_step(layers: int, monitored: bool, tmp_path) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)]).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16, device=DEVICE)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def counted() -> int:
        for _ in range(2):  # warm-up: kernels compiled, tables made
            step()
        with CountOps() as mode:
            step()
        return mode.count

    if not monitored:
        return counted()
    cfg = {"wg_distribution": True, "ops": ALL_OPS}
    with record(model, opt, cfg, output_dir=str(tmp_path / f"out{layers}")):
        return counted()


def test_recorder_ops_per_step_do_not_grow_with_the_tensors(tmp_path, monkeypatch):
    """Config a (weight gradients, six ops) under the Triton backend: the torch ops the recorder adds to
    a collected step are the same for 4 and 24 layers (8 and 48 gradients)."""
    monkeypatch.setenv("TRAINREC_STATS_BACKEND", "triton")
    added = {n: ops_of_a_step(n, True, tmp_path) - ops_of_a_step(n, False, tmp_path) for n in (4, 24)}
    assert 0 < added[4] < 250, added  # (mostly the interpreter copying each launch's arguments)
    assert added[24] - added[4] <= 4, added


def test_record_on_triton_equals_torch_for_every_kind(tmp_path, monkeypatch):
    """record() with every kind on the Triton backend writes the rows the torch backend writes."""
    cfg = {"wg_distribution": True, "param_distribution": True, "mv_distribution": True,
           "ur_distribution": True, "xy_distribution": True, "all_xy": True, "ops": ALL_OPS}
    tables = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("TRAINREC_STATS_BACKEND", backend)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(DEVICE)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = tmp_path / backend
        with record(model, opt, cfg, output_dir=str(out)):
            for i in range(3):
                g = torch.Generator().manual_seed(i)
                model(torch.randn(5, 12, generator=g).to(DEVICE)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        events = events_of(out)
        tables[backend] = {kind: stats_table(events, kind) for kind in
                           ("grad_unreduced", "grad_reduced", "param", "exp_avg", "exp_avg_sq", "update", "ratio",
                            "actv", "actv_grad")}
    compared = 0
    for kind, want in tables["torch"].items():
        got = tables["triton"][kind]
        assert want and got.keys() == want.keys(), kind
        for key, row in want.items():
            for op, b in row.items():
                a = got[key][op]
                assert (math.isnan(a) and math.isnan(b)) or a == b or abs(a - b) <= 1e-6 + 2e-4 * abs(b), (kind, key, op, a, b)
                compared += 1
    assert compared > 700


@pytest.mark.skipif(not torch.cuda.is_available() or device_stats.INTERPRET, reason="needs a GPU (compiled kernels)")
def test_monitored_steps_never_synchronise_the_device(tmp_path, monkeypatch):
    """Every kind on the Triton backend: torch.cuda.set_sync_debug_mode("error") stays quiet through
    collected steps (the writer thread waits on the step's event; the training thread never waits)."""
    monkeypatch.setenv("TRAINREC_STATS_BACKEND", "triton")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    cfg = {"wg_distribution": True, "param_distribution": True, "mv_distribution": True, "ur_distribution": True,
           "xy_distribution": True, "all_xy": True, "ops": ALL_OPS, "format": "csv"}
    x = torch.randn(32, 64, device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    with record(model, opt, cfg, output_dir=str(tmp_path / "out")):
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with warnings.catch_warnings():  # (torch warns that the mode is a prototype)
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    rows = stats_table(events_of(tmp_path / "out"), "grad_reduced")
    assert {k[0] for k in rows} == {0, 1, 2, 3, 4}


COMPILE_FOR_HOPPER = """
import itertools, triton
from triton.backends.compiler import GPUTarget
from trainrec.recorder import device_stats as ds
tl = triton.language
target = GPUTarget("cuda", 90, 32)

def compile_(fn, sig, consts):
    sig = {**sig, **dict.fromkeys(consts, "constexpr")}
    src = triton.compiler.ASTSource(fn=fn, signature=sig,
                                    constexprs={(list(sig).index(k),): v for k, v in consts.items()})
    triton.compile(src, target=target)

variants = 0
for dt, mode, scales, aligned in itertools.product((tl.float32, tl.bfloat16, tl.float16), (0, 1, 2), (0, 1, 2),
                                                   (True, False)):
    if (mode + scales + int(aligned)) % 3:  # (a spread of the 54: each value of each switch)
        continue
    compile_(ds._table_partials, {"table": "*i64", "scale_aux": "*fp32", "shift_aux": "*fp32", "part": "*fp64",
                                  "P": "i32", "eps": "fp32"},
             {"DT": dt, "MODE": mode, "SCALES": scales, "TINY": 1e-30, "BLOCK": 2048, "CHUNK": 65536,
              "ALIGNED": aligned})
    variants += 1
for dts in (("fp32",) * 4, ("bf16", "fp64", "fp16", "fp64")):
    compile_(ds._direct_partials, {**{f"x{i}": "*" + d for i, d in enumerate(dts)}, **{f"n{i}": "i32" for i in range(4)},
                                   "part": "*fp64", "P": "i32", "eps": "fp32"}, {"BLOCK": 2048, "CHUNK": 65536})
    variants += 1
compile_(ds._combine, {"part": "*fp64", "out": "*fp32", "P": "i32"},
         {"PB": 256, "CHUNK": 65536, "NOPS": 2, "C_MIN": -1, "C_MAX": 1, "C_NORM": 0, "C_MEAN": -1, "C_ZEROS": -1,
          "C_NANS": -1})
print("compiled", variants + 1)
"""


def test_kernels_compile_for_hopper_without_a_gpu():
    """Triton's compiler (front end and ptxas) takes the kernels for sm_90 (the interpreter checks no
    types, so a GPU-only compile error would otherwise show on a GPU alone)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "21", done.stdout
