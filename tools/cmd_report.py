"""``trainrec report RUN -o report.html``: a run at a glance, as one self-contained HTML file (no network;
it opens from ``file://``).

It shows how the run ended on each rank (closed cleanly, crashed or killed, still running) and at
which step; the steps and step time per rank (stragglers stand out); a heatmap of tensor x step for
every recorded kind and op; curves of chosen tensors (``--curve REGEX``, or click a heatmap cell);
the anomalies on the step timeline and in a list whose entries select their heatmap cell; config
switches and resumes marked. Long runs are folded into at most ``--max-bins`` step bins (a bin
shows the largest value of its steps, ``min`` the smallest), and each kind's data is decoded only
when the page first shows it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import sys
import time
from html import escape

import numpy as np
from trainrec.analyzers.report_model import ReportBuilder, ReportModel
from trainrec.replay.follow import pid_alive
from trainrec.replay.run import Run
from trainrec.schema.errors import TrainrecError
from trainrec.schema.events import FileOpened

from .progress import reading
from .runarg import add_run_arguments, note_damage, open_run_from_args

_HERE = os.path.dirname(os.path.abspath(__file__))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="write a self-contained HTML report of a run",
                              description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n", 1)[1])
    add_run_arguments(p)
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the HTML file to write")
    p.add_argument("--curve", action="append", default=[], metavar="REGEX",
                   help="draw the tensors whose name matches REGEX (repeatable; at most 6 drawn)")
    p.add_argument("--max-bins", type=int, default=300, metavar="N", help="step bins per heatmap (default 300)")
    p.set_defaults(func=run)


def endings(run: Run) -> list[dict]:
    """Per rank: how its last log ended (``clean``, ``crashed``, ``running``, ``unclosed``) and a line saying so."""
    out = []
    readers = run.readers
    for rank in run.ranks:
        files = [p for p in run.files(rank) if p in readers]
        if not files:
            out.append({"rank": rank, "state": "unreadable", "text": "no readable log"})
            continue
        reader = readers[files[-1]]
        if reader.closed_cleanly:
            reason = getattr(reader.closed_event, "reason", "close")
            out.append({"rank": rank, "state": "clean", "text": f"closed cleanly ({reason})"})
            continue
        header = reader.header if isinstance(reader.header, FileOpened) else None
        alive = None
        if header is not None and header.pid and header.host == socket.gethostname():
            alive = pid_alive(header.pid)
        torn = reader.pending_bytes
        if alive:
            out.append({"rank": rank, "state": "running", "text": f"still being written (pid {header.pid})"})
        elif torn:
            out.append({"rank": rank, "state": "crashed", "text": f"not closed: {os.path.basename(files[-1])} ends in a "
                        f"torn record at byte {reader.offset} ({torn} bytes): the writer died mid-write"})
        else:
            out.append({"rank": rank, "state": "unclosed", "text": "not closed: the writer was killed or crashed "
                        "after its last flush" if alive is False else "not closed (killed, or still writing elsewhere)"})
    return out


LOG_LEVELS = 0x7FFF - 4  # magnitude codes 4..0x7FFF; 0 NaN, 1 zero, 2 +inf, 3 -inf; 0x8000: negative


def log_codes(values: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """``values`` as u16 codes of log10|v| spread over the matrix's own range ``[lo, hi]`` (about 0.1%
    apart where it spans ten decades): half a float32's bytes, and what a log-scaled heatmap needs."""
    v = values.astype(np.float64)
    finite = np.isfinite(v) & (v != 0)
    logs = np.log10(np.abs(v[finite])) if finite.any() else np.zeros(1)
    lo, hi = float(logs.min()), float(logs.max())
    codes = np.zeros(v.shape, dtype=np.uint16)
    codes[v == 0] = 1
    codes[v == np.inf] = 2
    codes[v == -np.inf] = 3
    if finite.any():
        span = (hi - lo) or 1.0
        mag = 4 + np.rint((np.log10(np.abs(v[finite])) - lo) / span * LOG_LEVELS).astype(np.uint16)
        codes[finite] = mag | np.where(v[finite] < 0, 0x8000, 0).astype(np.uint16)
    return codes, [lo, hi]


def page_data(run: Run, model: ReportModel, ends: list[dict], curves: list[str]) -> tuple[dict, dict[str, str]]:
    """The page's JSON model and its base64 matrices (``kind-op`` -> text)."""
    last = {}
    for rank, (steps, _) in model.steps.items():
        last[rank] = steps[-1] if steps else None
    for e in ends:
        if last.get(e["rank"]) is not None:
            e["text"] += f"; last step ended: {last[e['rank']]}"
    kinds, blobs = [], {}
    for grid in model.kinds:
        ops = [op for op in ("norm", "max", "min", "mean", "zeros", "nans") if op in grid.ops_seen]
        scales = {}
        for op in ops:
            codes, scales[op] = log_codes(grid.matrix(op))
            blobs[f"{grid.kind}-{op}"] = base64.b64encode(codes.astype("<u2").tobytes()).decode("ascii")
        kinds.append({"kind": grid.kind, "ops": ops, "labels": grid.labels, "bins": grid.bins, "width": grid.width,
                      "first_step": grid.first_step, "scales": scales})
    picks = []
    for pattern in curves:
        rx = re.compile(pattern)
        for grid in model.kinds:
            for row, label in enumerate(grid.labels):
                if rx.search(label) and len(picks) < 6:
                    picks.append({"kind": grid.kind, "row": row})
    data = {"run": {"id": run.run_id, "path": run.where, "world_size": run.world_size, "ranks": run.ranks},
            "ending": ends, "steps": {str(r): list(v) for r, v in model.steps.items()},
            "step_counts": {str(r): n for r, n in model.step_counts.items()}, "marks": model.marks,
            "anomalies": model.anomalies, "kinds": kinds, "curves": picks, "values": model.values}
    return data, blobs


def render(data: dict, blobs: dict[str, str]) -> str:
    with open(os.path.join(_HERE, "report_page.js"), encoding="utf-8") as f:
        script = f.read()
    with open(os.path.join(_HERE, "report_page.css"), encoding="utf-8") as f:
        style = f.read()
    model = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    blocks = "\n".join(f'<script type="application/octet-stream" id="d-{escape(k)}">{v}</script>' for k, v in blobs.items())
    title = f"trainrec report: run {data['run']['id'] or '(no id)'}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<style>{style}</style></head>
<body>
<h1>{escape(title)}</h1>
<p class="where">{escape(str(data['run']['path']))}: world size {data['run']['world_size']}, ranks {escape(', '.join(map(str, data['run']['ranks'])))}, {data['values']} values</p>
<section><h2>How it ended</h2><div id="ending"></div></section>
<section><h2>Steps and step time per rank</h2><canvas id="steps" width="1000" height="220"></canvas>
<div id="steps-legend" class="legend"></div>
<p class="note">vertical lines: config switches (blue) and resumes (orange); red ticks: anomalies</p></section>
<section id="heatmap-section"><h2>Heatmaps (tensor x step)</h2>
<div id="kinds"></div><label>op <select id="op"></select></label> <span id="scale" class="note"></span>
<div id="selection" class="selection">nothing selected</div><div id="hover" class="note">&nbsp;</div>
<div class="heat"><div id="labels"></div><div class="canvas-box"><canvas id="heatmap"></canvas></div></div></section>
<section><h2>Curves</h2><label class="note"><input type="checkbox" id="curves-log" checked> log scale (where all values are positive)</label><br><canvas id="curves" width="1000" height="240"></canvas><div id="curves-legend" class="legend"></div></section>
<section><h2>Anomalies</h2><table><thead><tr><th>step</th><th>rank</th><th>kind</th><th>tensor</th><th>op</th><th>value</th><th>rule</th></tr></thead>
<tbody id="anomalies"></tbody></table></section>
<section><h2>Config switches and resumes</h2><ul id="marks"></ul></section>
<script id="model" type="application/json">{model}</script>
{blocks}
<script>{script}</script>
</body></html>
"""


def build(run: Run, *, max_bins: int = 300, curves: list[str] | None = None) -> tuple[str, ReportModel]:
    """The page's HTML text and its model."""
    builder = ReportBuilder(max_bins=max_bins, ranks=len(run.ranks))
    for rank in run.ranks:
        builder.feed(run.events(rank))
    model = builder.model()
    data, blobs = page_data(run, model, endings(run), curves or [])
    return render(data, blobs), model


def run(args) -> int:
    if args.max_bins < 1:
        raise TrainrecError(f"--max-bins must be >= 1, not {args.max_bins}")
    for pattern in args.curve:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise TrainrecError(f"--curve {pattern!r} is not a regular expression: {exc}") from None
    run_ = open_run_from_args(args)
    t0 = time.perf_counter()
    with reading(run_, "report"):
        html, model = build(run_, max_bins=args.max_bins, curves=args.curve)
    note_damage(run_, "report", used="everything before it is shown")
    out = os.path.abspath(args.output)
    try:
        with open(out, "w", encoding="utf-8") as f:
            f.write(html)
    except OSError as exc:
        raise TrainrecError(f"cannot write {out}: {exc.strerror or exc}") from None
    elapsed = time.perf_counter() - t0
    steps = sum(model.step_counts.values())
    print(f"report of run {run_.run_id or '(no id)'}: ranks {', '.join(map(str, run_.ranks))}, {steps} steps, "
          f"{len(model.kinds)} kinds, {len(model.anomalies)} anomalies: {out} ({len(html) / 1e6:.1f} MB) "
          f"in {elapsed:.2f} s")
    if not model.kinds:
        print("trainrec report: note: the run holds no statistics: no heatmaps", file=sys.stderr)
    return 0
