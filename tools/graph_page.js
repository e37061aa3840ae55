// trainrec graph viewer: two hierarchies side by side, drawn lazily, coloured by precision bucket.
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("graph-data").textContent);
  const OPS = ["Max", "Min", "Mean", "Norm"];
  const BUCKETS = ["pass", "warning", "error"];
  const el = (tag, attrs, text) => {
    const e = document.createElement(tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const b64 = (s, Type) => {
    const bin = atob(s || ""), buf = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) buf[i] = bin.charCodeAt(i);
    return new Type(buf.buffer);
  };
  const sides = D.mode === "compare" ? ["debug", "bench"] : ["debug"];
  const S = {};
  let nodes = 0, prec = null, over = null;
  function load(page) {  // a rank's comparison (ranks pages), or the one comparison
    if (page) for (const k of ["debug", "bench", "precision", "overflow", "staticError", "verdict", "steps", "allSteps", "title"]) D[k] = page[k];
    for (const name of sides) {
      const g = D[name];
      const kids = g.names.map(() => []);
      g.parents.forEach((p, i) => { if (p >= 0) kids[p].push(i); });
      const unm = g.names.map((_, i) => g.match && g.match[i] < 0 && i > 0);
      const hasUnm = unm.slice();
      for (let i = g.names.length - 1; i > 0; i--) if (hasUnm[i] && g.parents[i] >= 0) hasUnm[g.parents[i]] = true;
      S[name] = { g, kids, unm, hasUnm, vals: b64(g.values, Float32Array), rows: new Map(), open: new Set() };
    }
    nodes = D.debug.names.length;
    prec = D.precision ? b64(D.precision, Uint8Array) : null;
    over = D.overflow ? b64(D.overflow, Uint8Array) : null;
  }
  load(D.rankPages ? D.rankPages[0] : null);
  let step = 0, onlyUnmatched = false, selected = null, searchHits = [], searchAt = -1;
  const allIndex = (s) => D.allSteps.indexOf(D.steps[s]);

  function code(side, i) {
    if (!prec) return -1;
    const di = side === "debug" ? i : S.bench.g.match[i];
    if (di < 0) return -1;
    const c = prec[allIndex(step) * nodes + di];
    return c === 255 ? -1 : c;
  }
  function paint(side, i, row) {
    const s = S[side];
    row.className = "row";
    if (D.mode === "compare") {
      if (s.unm[i]) row.classList.add("unm");
      else { const c = code(side, i); row.classList.add(c < 0 ? "nov" : "p" + c); row.dataset.bucket = c < 0 ? "none" : BUCKETS[c]; }
      if (over && side === "debug") { const o = over[allIndex(step) * nodes + i]; if (o) row.classList.add("ov" + o); }
    }
    if (selected && selected.side === side && selected.i === i) row.classList.add("sel");
  }
  function visible(side, i) { return !onlyUnmatched || S[side].hasUnm[i]; }
  function renderNode(side, i, into) {
    const s = S[side];
    const wrap = el("div", { class: "item" });
    const row = el("div", { "data-side": side, "data-i": String(i), "data-name": s.g.names[i] });
    const tog = el("span", { class: "tog" }, s.kids[i].length ? (s.open.has(i) ? "\u25be" : "\u25b8") : "");
    row.append(tog, el("span", { class: "label" }, s.g.names[i]));
    paint(side, i, row);
    const kids = el("div", { class: "kids" });
    wrap.append(row, kids);
    into.append(wrap);
    s.rows.set(i, row);
    tog.addEventListener("click", (ev) => { ev.stopPropagation(); toggle(side, i); });
    row.addEventListener("click", () => select(side, i));
    if (s.open.has(i)) renderKids(side, i, kids);
  }
  function renderKids(side, i, kidsDiv) {
    kidsDiv.textContent = "";
    for (const k of S[side].kids[i]) if (visible(side, k)) renderNode(side, k, kidsDiv);
  }
  function toggle(side, i) {
    const s = S[side], row = s.rows.get(i);
    if (s.open.has(i)) s.open.delete(i); else s.open.add(i);
    if (!row) return;
    row.querySelector(".tog").textContent = s.kids[i].length ? (s.open.has(i) ? "\u25be" : "\u25b8") : "";
    const kids = row.parentNode.querySelector(".kids");
    if (s.open.has(i)) renderKids(side, i, kids); else kids.textContent = "";
  }
  function drawTree(side) {
    const s = S[side], tree = document.getElementById("tree-" + side);
    s.rows = new Map();
    tree.textContent = "";
    s.open.add(0);
    renderKids(side, 0, tree);
  }
  function repaint() { for (const side of sides) for (const [i, row] of S[side].rows) paint(side, i, row); }
  function reveal(side, i) {
    const s = S[side], path = [];
    for (let p = s.g.parents[i]; p > 0; p = s.g.parents[p]) path.unshift(p);
    for (const p of path) if (!s.open.has(p)) s.open.add(p);
    drawTree(side);
    const row = s.rows.get(i);
    if (row) row.scrollIntoView({ block: "center" });
  }
  function fmt(v) { return v === undefined || Number.isNaN(v) ? "" : Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(4) : v.toFixed(6); }
  function stats(side, i, port) {
    const s = S[side], k = s.g.ports[i].indexOf(port);
    if (k < 0) return null;
    const base = (step * s.g.nPorts + s.g.portIdx[i][k]) * 4;
    return OPS.map((_, o) => s.vals[base + o]);
  }
  function meta(side, i, port) {
    const g = S[side].g, k = i >= 0 ? g.ports[i].indexOf(port) : -1;
    if (k < 0) return "";
    const [dtype, shape] = g.meta[i][k];
    return [dtype.replace("torch.", ""), shape ? "[" + shape.join(", ") + "]" : ""].filter(Boolean).join(" ");
  }
  function select(side, i) {
    selected = { side, i };
    repaint();
    const s = S[side];
    const di = side === "debug" ? i : (D.mode === "compare" ? S.bench.g.match[i] : -1);
    const bi = side === "bench" ? i : (D.mode === "compare" ? S.debug.g.match[i] : -1);
    const title = document.getElementById("node-name");
    title.textContent = s.g.names[i] + (D.mode === "compare" ? "  \u2194  " + (side === "debug" ? (bi >= 0 ? S.bench.g.names[bi] : "(unmatched)") : (di >= 0 ? S.debug.g.names[di] : "(unmatched)")) : "");
    const table = document.getElementById("node-table");
    table.textContent = "";
    const head = el("tr");
    head.append(el("th", {}, "port"), el("th", {}, "dtype, shape"));
    for (const o of OPS) head.append(el("th", {}, (D.mode === "compare" ? "debug " : "") + o));
    if (D.mode === "compare") {
      for (const o of OPS) head.append(el("th", {}, "bench " + o));
      for (const o of OPS) head.append(el("th", {}, o + "RelativeErr"));
    }
    table.append(head);
    const ports = [];
    if (di >= 0) for (const p of S.debug.g.ports[di]) ports.push(p);
    if (bi >= 0) for (const p of S.bench.g.ports[bi]) if (!ports.includes(p)) ports.push(p);
    for (const port of ports) {
      const tr = el("tr", { "data-port": port });
      tr.append(el("td", {}, port), el("td", {}, meta(di >= 0 ? "debug" : "bench", di >= 0 ? di : bi, port)));
      const a = di >= 0 ? stats("debug", di, port) : null;
      for (let o = 0; o < 4; o++) tr.append(el("td", {}, a ? fmt(a[o]) : ""));
      if (D.mode === "compare") {
        const b = bi >= 0 ? stats("bench", bi, port) : null;
        for (let o = 0; o < 4; o++) tr.append(el("td", {}, b ? fmt(b[o]) : ""));
        for (let o = 0; o < 4; o++) {
          const rel = a && b ? (a[o] === b[o] ? 0 : Math.abs(a[o] - b[o]) / Math.abs(b[o])) : NaN;
          tr.append(el("td", { class: "rel" }, fmt(rel)));
        }
      }
      table.append(tr);
    }
    const err = D.staticError && di >= 0 ? D.staticError[S.debug.g.names[di]] : "";
    document.getElementById("static-error").textContent = err ? "differs: " + err : "";
    const stack = (di >= 0 ? S.debug.g.stacks[di] : s.g.stacks[i]) || [];
    document.getElementById("stack").textContent = stack.join("\n") || "(no stack recorded)";
  }
  function goTo(side, i) {  // reveal a node, and its counterpart on the other side, and select it
    reveal(side, i);
    const other = side === "debug" ? "bench" : "debug";
    const j = D.mode === "compare" ? S[side].g.match[i] : -1;
    if (j >= 0) reveal(other, j);
    select(side, i);
  }
  function search(q) {
    q = q.trim().toLowerCase();
    if (!q) return;
    searchHits = [];
    for (const side of sides) S[side].g.names.forEach((n, i) => { if (i > 0 && n.toLowerCase().includes(q)) searchHits.push([side, i]); });
    searchAt = searchHits.length ? 0 : -1;
    document.getElementById("search-count").textContent = searchHits.length + " found";
    if (searchAt >= 0) goTo(...searchHits[0]);
  }

  // ---------------------------------------------------------------- page
  document.title = "trainrec graph: " + D.title;
  const header = el("header");
  header.append(el("h1", { id: "title" }, D.title));
  const stepSel = el("select", { id: "step" });
  function stepOptions() {
    stepSel.textContent = "";
    D.steps.forEach((s, k) => stepSel.append(el("option", { value: String(k) }, "step " + s)));
  }
  stepOptions();
  stepSel.addEventListener("change", () => { step = Number(stepSel.value); repaint(); if (selected) select(selected.side, selected.i); });
  const searchBox = el("input", { id: "search", type: "search", placeholder: "search node name (Enter)" });
  searchBox.addEventListener("keydown", (ev) => {
    if (ev.key !== "Enter") return;
    if (searchHits.length && searchBox.dataset.q === searchBox.value) { searchAt = (searchAt + 1) % searchHits.length; goTo(...searchHits[searchAt]); }
    else { searchBox.dataset.q = searchBox.value; search(searchBox.value); }
  });
  const unmBox = el("input", { id: "unmatched", type: "checkbox" });
  unmBox.addEventListener("change", () => { onlyUnmatched = unmBox.checked; for (const side of sides) drawTree(side); });
  const unmLabel = el("label", {}, " unmatched only");
  unmLabel.prepend(unmBox);
  header.append(stepSel, searchBox, el("span", { id: "search-count" }), unmLabel);
  if (D.mode === "compare") {
    const legend = el("span", { class: "legend" });
    [["p0", "pass"], ["p1", "warning"], ["p2", "error"], ["unm", "unmatched"]].forEach(([c, t]) => legend.append(el("span", { class: c }, t)));
    header.append(legend);
    header.append(el("div", { id: "verdict" }));
  }
  function showVerdict() {
    const line = document.getElementById("verdict");
    if (!line) return;
    const v = D.verdict, f = v.first_divergence;
    line.textContent = `matched ${v.matched}, unmatched ${v.unmatched_debug} debug / ${v.unmatched_bench} bench. ` +
      (f ? `First divergence: step ${f.step}, node ${f.node}` : "No divergence over the compared steps.");
    if (f) {
      const go = el("button", { id: "goto-first" }, "show");
      go.addEventListener("click", () => { const k = D.steps.indexOf(f.step); if (k >= 0) { stepSel.value = String(k); step = k; } searchBox.value = f.node; searchBox.dataset.q = f.node; search(f.node); });
      line.append(go);
    }
  }
  if (D.rankPages) {
    const rankSel = el("select", { id: "rank" });
    D.rankPages.forEach((p, k) => rankSel.append(el("option", { value: String(k) }, `rank ${p.rank} vs rank ${D.baseRank}`)));
    rankSel.addEventListener("change", () => {
      load(D.rankPages[Number(rankSel.value)]);
      step = 0; selected = null; searchHits = [];
      stepOptions(); showVerdict();
      document.getElementById("title").textContent = D.title;
      for (const side of sides) {
        document.querySelector(`#pane-${side} h2`).textContent = (side === "debug" ? "debug: " : "bench: ") + D[side].source;
        drawTree(side);
      }
    });
    header.insertBefore(rankSel, stepSel);
  }
  document.body.append(header);
  const main = el("main");
  for (const side of sides) {
    const pane = el("div", { class: "pane", id: "pane-" + side });
    pane.append(el("h2", {}, (side === "debug" ? (D.mode === "compare" ? "debug: " : "") : "bench: ") + D[side].source), el("div", { id: "tree-" + side }));
    main.append(pane);
  }
  document.body.append(main);
  const details = el("section", { id: "details" });
  details.append(el("h3", { id: "node-name" }, "click a node"), el("div", { id: "static-error" }), el("table", { id: "node-table" }), el("pre", { id: "stack" }));
  document.body.append(details);
  showVerdict();
  for (const side of sides) drawTree(side);
  document.body.dataset.ready = "1";
})();
