// trainrec run report: draws the data embedded in this page (no network). Each kind's matrices are
// decoded from base64 only when that kind is first shown.
"use strict";
(function () {
  const M = JSON.parse(document.getElementById("model").textContent);
  const $ = (id) => document.getElementById(id);
  const el = (tag, attrs, text) => {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const cache = {}, LEVELS = 0x7fff - 4;
  function matrix(kind, op) {
    const key = kind + "/" + op;
    if (!(key in cache)) {
      const node = document.getElementById("d-" + kind + "-" + op);
      if (!node) { cache[key] = null; return null; }
      const bin = atob(node.textContent.trim());
      const bytes = new Uint8Array(bin.length);
      for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
      // u16 codes of log10|v| over the matrix's [lo, hi] (cmd_report.log_codes)
      const codes = new Uint16Array(bytes.buffer), [lo, hi] = kindMeta[kind].scales[op], span = (hi - lo) || 1;
      const out = new Float32Array(codes.length), special = [NaN, 0, Infinity, -Infinity];
      for (let i = 0; i < codes.length; i++) {
        const c = codes[i], mag = c & 0x7fff;
        out[i] = mag < 4 ? special[mag] : (c & 0x8000 ? -1 : 1) * Math.pow(10, lo + ((mag - 4) / LEVELS) * span);
      }
      cache[key] = out;
    }
    return cache[key];
  }
  const fmt = (v) => (typeof v === "string" ? v : Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(3) : +v.toPrecision(4));
  const kindMeta = Object.fromEntries(M.kinds.map((k) => [k.kind, k]));
  const state = { kind: M.kinds.length ? M.kinds[0].kind : null, op: null, sel: null, curves: [] };
  window.trainrecReport = state;

  // ------------------------------------------------------------------ summary
  function summary() {
    const box = $("ending");
    for (const e of M.ending) {
      const row = el("div", { class: "end end-" + e.state });
      row.append(el("b", {}, "rank " + e.rank + ": " + e.state), el("span", {}, " " + e.text));
      box.append(row);
    }
  }

  // ------------------------------------------------------------------ step times
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];
  function axes(ctx, w, h, x0, x1, y0, y1, pad) {
    ctx.strokeStyle = "#999"; ctx.fillStyle = "#444"; ctx.font = "11px sans-serif";
    ctx.strokeRect(pad, 4, w - pad - 4, h - pad - 4);
    ctx.fillText(fmt(y1), 2, 14); ctx.fillText(fmt(y0), 2, h - pad);
    ctx.fillText(String(x0), pad, h - 4); ctx.fillText(String(x1), w - 40, h - 4);
  }
  function stepChart() {
    const cv = $("steps"), ctx = cv.getContext("2d"), w = cv.width, h = cv.height, pad = 50;
    const ranks = Object.keys(M.steps);
    let x0 = Infinity, x1 = -Infinity, y1 = 0;
    for (const r of ranks) {
      const [s, d] = M.steps[r];
      if (s.length) { x0 = Math.min(x0, s[0]); x1 = Math.max(x1, s[s.length - 1]); }
      for (const v of d) y1 = Math.max(y1, v);
    }
    if (!isFinite(x0)) { ctx.fillText("no steps ended", 10, 20); return; }
    if (x1 === x0) x1 = x0 + 1;
    y1 = y1 || 1;
    const X = (s) => pad + ((s - x0) / (x1 - x0)) * (w - pad - 8), Y = (v) => h - pad - (v / y1) * (h - pad - 8);
    axes(ctx, w, h, x0, x1, 0, y1, pad);
    for (const m of M.marks) {
      ctx.strokeStyle = m.type === "resume" ? "#e08000" : "#3060d0";
      ctx.beginPath(); ctx.moveTo(X(m.step), 4); ctx.lineTo(X(m.step), h - pad); ctx.stroke();
    }
    ranks.forEach((r, i) => {
      const [s, d] = M.steps[r];
      ctx.strokeStyle = COLORS[i % COLORS.length]; ctx.beginPath();
      s.forEach((st, j) => (j ? ctx.lineTo(X(st), Y(d[j])) : ctx.moveTo(X(st), Y(d[j]))));
      ctx.stroke();
    });
    ctx.fillStyle = "#d00";
    for (const a of M.anomalies) ctx.fillRect(X(a.step) - 1, h - pad + 2, 3, 8);
    const legend = $("steps-legend");
    ranks.forEach((r, i) => {
      const c = el("span", { class: "key" }, "rank " + r + " (" + M.step_counts[r] + " steps)");
      c.style.borderColor = COLORS[i % COLORS.length]; legend.append(c);
    });
  }

  // ------------------------------------------------------------------ heatmap
  function color(t) { // 0..1 -> viridis-like
    const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
    const x = Math.min(1, Math.max(0, t)) * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(x)), f = x - i;
    return stops[i].map((c, k) => Math.round(c + f * (stops[i + 1][k] - c)));
  }
  function geometry(meta) {
    // (a canvas taller than 32k pixels is not drawn: 1 pixel a row for very large models)
    const ch = Math.max(meta.labels.length > 8000 ? 1 : 2, Math.min(14, Math.floor(600 / Math.max(1, meta.labels.length))));
    const cw = Math.max(2, Math.min(24, Math.floor(900 / Math.max(1, meta.bins))));
    return { cw, ch };
  }
  function showKind(kind, op) {
    const meta = kindMeta[kind];
    if (!meta) return;
    state.kind = kind;
    state.op = op && meta.ops.includes(op) ? op : meta.ops.includes("norm") ? "norm" : meta.ops[0];
    document.querySelectorAll("#kinds button").forEach((b) => b.classList.toggle("on", b.dataset.kind === kind));
    const sel = $("op"); sel.innerHTML = "";
    for (const o of meta.ops) sel.append(el("option", { value: o }, o));
    sel.value = state.op;
    drawHeatmap();
  }
  function drawHeatmap() {
    const meta = kindMeta[state.kind], data = matrix(state.kind, state.op);
    const rows = meta.labels.length, bins = meta.bins, { cw, ch } = geometry(meta);
    const cv = $("heatmap"); cv.width = bins * cw; cv.height = rows * ch;
    const ctx = cv.getContext("2d");
    const logs = [];
    for (const v of data) if (isFinite(v) && v !== 0) logs.push(Math.log10(Math.abs(v)));
    logs.sort((a, b) => a - b);
    const lo = logs.length ? logs[Math.floor(logs.length * 0.02)] : 0, hi = logs.length ? logs[Math.floor(logs.length * 0.98)] : 1;
    const img = ctx.createImageData(bins, rows);
    for (let r = 0; r < rows; r++) for (let b = 0; b < bins; b++) {
      const v = data[r * bins + b], p = (r * bins + b) * 4;
      let c;
      if (Number.isNaN(v)) c = [225, 225, 225];
      else if (!isFinite(v)) c = [230, 0, 200];
      else c = v === 0 ? color(0) : color((Math.log10(Math.abs(v)) - lo) / (hi - lo || 1));
      img.data[p] = c[0]; img.data[p + 1] = c[1]; img.data[p + 2] = c[2]; img.data[p + 3] = 255;
    }
    const off = document.createElement("canvas"); off.width = bins; off.height = rows;
    off.getContext("2d").putImageData(img, 0, 0);
    ctx.imageSmoothingEnabled = false; ctx.drawImage(off, 0, 0, bins * cw, rows * ch);
    for (const m of M.marks) {  // config switches and resumes: a line before their step's bin
      const b = Math.floor((m.step - meta.first_step) / meta.width);
      if (b <= 0 || b >= bins) continue;
      ctx.fillStyle = m.type === "resume" ? "#e08000" : "#3060d0";
      ctx.fillRect(b * cw - 1, 0, 2, rows * ch);
    }
    ctx.fillStyle = "#d00";
    for (const a of M.anomalies) if (a.kind === state.kind && a.row !== null) ctx.fillRect(a.col * cw, a.row * ch, Math.max(2, cw / 3), Math.max(2, ch / 3));
    if (state.sel && state.sel.kind === state.kind) {
      ctx.strokeStyle = "#f00"; ctx.lineWidth = 2;
      ctx.strokeRect(state.sel.col * cw - 1, state.sel.row * ch - 1, cw + 2, ch + 2);
    }
    const labels = $("labels"); labels.innerHTML = ""; labels.style.lineHeight = ch + "px"; labels.style.fontSize = Math.min(12, ch) + "px";
    if (ch >= 8) for (const l of meta.labels) labels.append(el("div", { title: l }, l));
    $("scale").textContent = "log10|" + state.op + "| from " + lo.toFixed(2) + " to " + hi.toFixed(2) +
      "; " + rows + " tensors x " + bins + " bins of " + meta.width + " step(s) from step " + meta.first_step +
      " (a bin shows its largest value, min its smallest); grey: not recorded";
    drawCurves();
  }
  function stepsOf(meta, col) { const a = meta.first_step + col * meta.width; return meta.width > 1 ? a + ".." + (a + meta.width - 1) : String(a); }
  function select(kind, op, row, col, anomaly) {
    if (state.kind !== kind || (op && state.op !== op)) showKind(kind, op);
    const meta = kindMeta[kind];
    state.sel = { kind, op: state.op, row, col, anomaly: anomaly === undefined ? null : anomaly };
    const key = kind + "/" + row;
    if (!state.curves.some((c) => c.key === key)) state.curves.push({ key, kind, row });
    if (state.curves.length > 6) state.curves.shift();
    const v = matrix(kind, state.op)[row * meta.bins + col];
    $("selection").textContent = kind + " " + state.op + " of " + meta.labels[row] + " at step " + stepsOf(meta, col) + ": " + fmt(v);
    document.querySelectorAll("#anomalies tr").forEach((tr) => tr.classList.toggle("on", tr.dataset.i === String(state.sel.anomaly)));
    drawHeatmap();
  }
  function onHeatmap(ev, click) {
    const meta = kindMeta[state.kind], { cw, ch } = geometry(meta), rect = ev.target.getBoundingClientRect();
    const col = Math.floor((ev.clientX - rect.left) / cw), row = Math.floor((ev.clientY - rect.top) / ch);
    if (row < 0 || col < 0 || row >= meta.labels.length || col >= meta.bins) return;
    if (click) { select(state.kind, state.op, row, col); return; }
    const v = matrix(state.kind, state.op)[row * meta.bins + col];
    $("hover").textContent = meta.labels[row] + " @ step " + stepsOf(meta, col) + ": " + fmt(v);
  }

  // ------------------------------------------------------------------ curves
  function drawCurves() {
    const cv = $("curves"), ctx = cv.getContext("2d"), w = cv.width, h = cv.height, pad = 50;
    ctx.clearRect(0, 0, w, h);
    const series = state.curves.filter((c) => kindMeta[c.kind]).map((c) => ({ c, meta: kindMeta[c.kind], data: matrix(c.kind, state.op) }));
    const legend = $("curves-legend"); legend.innerHTML = "";
    if (!series.length) { ctx.fillStyle = "#666"; ctx.fillText("click a heatmap cell or an anomaly to draw its tensor here", 10, 20); return; }
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const s of series) {
      x0 = Math.min(x0, s.meta.first_step); x1 = Math.max(x1, s.meta.first_step + s.meta.bins * s.meta.width);
      if (!s.data) continue;
      for (let b = 0; b < s.meta.bins; b++) { const v = s.data[s.c.row * s.meta.bins + b]; if (isFinite(v)) { y0 = Math.min(y0, v); y1 = Math.max(y1, v); } }
    }
    if (!isFinite(y0)) { y0 = 0; y1 = 1; }
    const log = $("curves-log").checked && y0 > 0;  // a log axis where every value drawn is positive
    const T = (v) => (log ? Math.log10(v) : v);
    let t0 = T(y0), t1 = T(y1);
    if (t1 === t0) t1 = t0 + 1;
    const X = (s) => pad + ((s - x0) / (x1 - x0 || 1)) * (w - pad - 8), Y = (v) => h - pad - ((T(v) - t0) / (t1 - t0)) * (h - pad - 8);
    axes(ctx, w, h, x0, x1, y0, y1, pad);
    if (log) ctx.fillText("log", 2, 28);
    series.forEach((s, i) => {
      ctx.strokeStyle = COLORS[i % COLORS.length]; ctx.beginPath(); let on = false;
      if (s.data) for (let b = 0; b < s.meta.bins; b++) {
        const v = s.data[s.c.row * s.meta.bins + b], x = X(s.meta.first_step + b * s.meta.width);
        if (!isFinite(v)) { on = false; continue; }
        on ? ctx.lineTo(x, Y(v)) : ctx.moveTo(x, Y(v)); on = true;
      }
      ctx.stroke();
      const k = el("span", { class: "key" }, s.c.kind + " " + state.op + " " + s.meta.labels[s.c.row]);
      k.style.borderColor = COLORS[i % COLORS.length]; legend.append(k);
    });
  }

  // ------------------------------------------------------------------ anomalies
  function anomalyList() {
    const body = $("anomalies");
    if (!M.anomalies.length) {
      const tr = el("tr", { class: "none" });
      tr.append(el("td", { colspan: "7" }, "no anomalies recorded"));
      body.append(tr);
      return;
    }
    for (const a of M.anomalies) {
      const tr = el("tr", { "data-i": String(a.i) });
      const link = el("a", { href: "#heatmap-section", class: "anomaly-link" }, String(a.step));
      link.addEventListener("click", (ev) => {
        if (a.row === null || !kindMeta[a.kind]) { ev.preventDefault(); $("selection").textContent = "no heatmap row for " + a.name; return; }
        select(a.kind, kindMeta[a.kind].ops.includes(a.op) ? a.op : null, a.row, a.col, a.i);
      });
      const td = el("td"); td.append(link); tr.append(td);
      for (const v of [a.rank, a.kind, a.name, a.op, fmt(a.value) + " (baseline " + fmt(a.baseline) + ")", a.rule + (a.message ? ": " + a.message : "")]) tr.append(el("td", {}, String(v)));
      body.append(tr);
    }
  }
  function marksList() {
    const ul = $("marks");
    if (!M.marks.length) ul.append(el("li", {}, "none"));
    for (const m of M.marks) ul.append(el("li", { class: "mark-" + m.type }, "step " + m.step + ", rank " + m.rank + ": " + m.text));
  }

  summary(); stepChart(); anomalyList(); marksList();
  const kinds = $("kinds");
  for (const k of M.kinds) {
    const b = el("button", { "data-kind": k.kind }, k.kind + " (" + k.labels.length + ")");
    b.addEventListener("click", () => showKind(k.kind, state.op)); kinds.append(b);
  }
  $("op").addEventListener("change", (e) => { state.op = e.target.value; drawHeatmap(); });
  $("curves-log").addEventListener("change", drawCurves);
  $("heatmap").addEventListener("mousemove", (e) => onHeatmap(e, false));
  $("heatmap").addEventListener("click", (e) => onHeatmap(e, true));
  if (state.kind) {
    showKind(state.kind);
    for (const pick of M.curves) select(pick.kind, null, pick.row, kindMeta[pick.kind].bins - 1);
    if (M.curves.length) { state.sel = null; $("selection").textContent = "nothing selected"; drawHeatmap(); }
  } else $("heatmap-section").append(el("p", {}, "no statistics recorded"));
  document.body.dataset.ready = "1";
})();
