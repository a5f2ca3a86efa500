// deltasync demo page: one snapshot, then live Server-Sent Events; charts are plain SVG.
"use strict";

const WINDOW = 120; // steps shown in the charts
const HISTORY_ROWS = 8; // answers listed under the current one (the first answer stays the last row)
const SVGNS = "http://www.w3.org/2000/svg";
let S = null; // the state, as /api/state returns it, kept current by events
let clockSkew = 0; // server time - local time
let renderTimer = null;

const $ = (id) => document.getElementById(id);

function fmtBytes(n) {
  if (n == null) return "–";
  const u = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(n < 10 ? 2 : 1)) + " " + u[i];
}
const pct = (x, d = 2) => (x == null ? "–" : (100 * x).toFixed(d) + "%");

function el(tag, attrs, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
  if (text != null) e.textContent = text;
  return e;
}

function svg(container, w, h) {
  const s = el("svg", { viewBox: `0 0 ${w} ${h}`, preserveAspectRatio: "none", role: "img" });
  container.replaceChildren(s);
  return s;
}

// An empty chart says what it waits for instead of showing a blank panel.
const WAITING = "waiting for the first step…";
function waiting(s, w, h, text) {
  s.appendChild(el("text", { x: w / 2, y: h / 2 + 4, "text-anchor": "middle", class: "waiting" }, text || WAITING));
}

// ------------------------------------------------------------------ events

function apply(ev) {
  if (ev.type === "snapshot") { S = ev.data; clockSkew = S.now - Date.now() / 1000; return; }
  if (!S) return;
  if (ev.now) clockSkew = ev.now - Date.now() / 1000;
  const d = ev.data;
  switch (ev.type) {
    case "status": S.status = d.status; break;
    case "error": S.error = d.error; break;
    case "info": Object.assign(S, d); break;
    case "trainer": S.trainer = d; break;
    case "head":
      S.head = S.head == null ? d.head : Math.max(S.head, d.head);
      if (d.known) S.known = d.known;
      break;
    case "commit":
      S.commits.push(d);
      if (S.commits.length > 2000) S.commits.shift();
      S.head = S.head == null ? d.step : Math.max(S.head, d.step);
      if (d.held) S.applied_steps.push(d.step);
      break;
    case "applied": {
      const prev = S.applied;
      S.applied = d;
      S.staleness = d.staleness;
      if (d.paths) S.paths = d.paths;
      if (S.applied_steps[S.applied_steps.length - 1] !== d.step) S.applied_steps.push(d.step);
      if (S.applied_steps.length > 2000) S.applied_steps.shift();
      const g = S.generations;
      if (d.text != null && (!g.length || g[g.length - 1].text !== d.text)) {
        g.push({ step: d.step, t: d.t, text: d.text });
        if (g.length > 60) g.shift();
      }
      if (!prev || prev.text !== d.text) flash();
      break;
    }
    case "lag":
      S.lag.push(d);
      if (S.lag.length > 600) S.lag.shift();
      S.staleness = Object.assign({}, S.staleness, { steps: d.steps, seconds: d.seconds });
      break;
  }
}

function flash() {
  const g = $("generation");
  g.classList.add("flash");
  setTimeout(() => g.classList.remove("flash"), 600);
}

function schedule() {
  if (renderTimer == null) renderTimer = setTimeout(() => { renderTimer = null; render(); }, 80);
}

function connect() {
  const es = new EventSource("/api/events");
  es.onopen = () => $("conn").classList.add("live");
  es.onerror = () => $("conn").classList.remove("live"); // EventSource reconnects; a fresh snapshot follows
  es.onmessage = (m) => {
    try { apply(JSON.parse(m.data)); } catch (e) { console.error(e); }
    schedule();
  };
}

// ------------------------------------------------------------------ render

function render() {
  if (!S) return;
  const self = S.mode === "self-contained";
  const mode = $("mode");
  mode.textContent = self ? "self-contained: trainer + store + inference here" : "follower: trainer runs elsewhere";
  mode.className = "badge " + (self ? "self" : "follower");
  const st = $("status");
  st.textContent = S.bit_exact === true ? "done · bit-exact ✓" : S.status;
  st.className = "pill " + (S.bit_exact === true ? "done" : S.status);
  $("store").textContent = "store: " + S.store + (S.episode ? ` · run ${S.episode + 1}` : "");
  const sig = $("signal");
  sig.textContent = signalPath();
  sig.title = S.signal || "";
  const m = S.model;
  $("model").textContent = m ? `· ${m.arch} ${m.layers} layers, hidden ${m.hidden}, ${(m.params / 1e6).toFixed(2)}M\u00a0params, bf16 checkpoint ${fmtBytes(m.full_bytes).replace(" ", "\u00a0")}` : "";
  const err = $("error");
  err.hidden = !S.error;
  err.textContent = S.error || "";
  renderKpis();
  renderGeneration();
  renderCosts(fmtBytes, pct);
  renderHeatScale(heatColor);
  const commits = S.commits.slice(-WINDOW);
  timeline(commits);
  bytesChart(commits);
  densityChart(commits);
  heatmap(commits);
  lagChart();
}

// How new steps really reach the inference copy. With a signal server, the follower counts each
// applied step as "signal" (the server announced it) or "store" (a store poll found it first), so
// a silent or refusing signal server shows up here as polling, never as "via signal server".
function signalPath() {
  if (!S.signal) return "";
  if (!S.signal_server) return "· new steps via " + S.signal;
  const p = S.paths || {};
  const viaSignal = p.signal || 0, viaStore = p.store || 0;
  if (!viaSignal && !viaStore) return "· listening to the signal server (SSE), polling the store meanwhile";
  const last = S.applied && S.applied.via === "signal" ? "signal server" : "store polling";
  return `· new steps via the signal server: ${viaSignal}, via store polling: ${viaStore} (last: ${last})`;
}

// Staleness, the one definition the page shows: committed (store head) − applied, both from S,
// so the tile always agrees with the "committed" and "applied" tiles next to it (the server's
// snapshot computes the same difference for the staleness chart and the terminal).
function staleness() {
  if (S.head == null) return null;
  return Math.max(0, S.head - (S.applied ? S.applied.step : -1));
}

// What the "committed" tile says, as the terminal's summary does: step N holds the weights after N
// training steps (step 0 is the initial weights), so the newest committed step counts the training
// steps; the commits are the steps the follower found in the store (all counted, charted or not),
// fewer when the uploader folded a step into a later commit while the store was busy.
function stepsSeen() {
  const known = S.known || { training: 0, initial: 0 };
  const head = S.head == null ? 0 : S.head;
  const commits = known.training + known.initial;
  const folded = known.initial ? Math.max(0, head - known.training) : 0;
  return `${head} training step${head === 1 ? "" : "s"}` + (known.initial ? " + initial weights" : "") +
    ` · ${commits} commit${commits === 1 ? "" : "s"}` + (folded ? ` (${folded} folded into later ones)` : "");
}

function renderKpis() {
  const t = S.trainer;
  $("trainer-step").textContent = t ? t.step : "–";
  $("trainer-sub").textContent = t
    ? (t.done ? "finished" : `loss ${t.loss == null ? "–" : t.loss.toFixed(3)} · push ${t.push_ms.toFixed(1)} ms`)
    : (S.mode === "follower" ? "elsewhere" : "starting");
  $("head-step").textContent = S.head == null ? "–" : S.head;
  const last = S.commits.length ? S.commits[S.commits.length - 1] : null;
  $("head-sub").textContent = last ? `${stepsSeen()} · last: ${last.kind}` : "no step yet";
  const a = S.applied;
  $("applied-step").textContent = a ? a.step : "–";
  $("applied-sub").textContent = a ? `sync ${a.sync_ms.toFixed(1)} ms · verified ✓` : "waiting";
  const lag = staleness();
  $("lag-steps").textContent = lag == null ? "–" : `${lag} step${lag === 1 ? "" : "s"}`;
  const ahead = t && S.head != null ? t.step - S.head : 0;
  $("lag-sub").textContent = `committed − applied · ${((S.staleness || {}).seconds || 0).toFixed(1)} s behind` +
    (a && a.latency != null ? ` · push→applied ${(1000 * a.latency).toFixed(0)} ms` : "") +
    (ahead > 0 ? ` · trainer ${ahead} ahead of the store` : "");
  const patches = S.commits.filter((c) => c.kind === "patch");
  const lp = patches.length ? patches[patches.length - 1] : null;
  $("patch-bytes").textContent = lp ? fmtBytes(lp.nbytes) : "–";
  $("patch-sub").textContent = lp
    ? `${(lp.full_bytes / Math.max(lp.nbytes, 1)).toFixed(1)}× smaller than full · ${pct(lp.changed / lp.total)} changed`
    : "anchor first";
  const sum = S.commits.reduce((acc, c) => acc + c.nbytes, 0);
  const full = S.commits.reduce((acc, c) => acc + c.full_bytes, 0);
  $("total-bytes").textContent = S.commits.length ? fmtBytes(sum) : "–";
  $("total-sub").textContent = S.commits.length ? `vs ${fmtBytes(full)} as full checkpoints (${(full / Math.max(sum, 1)).toFixed(1)}×)` : " ";
}

function renderGeneration() {
  $("prompt").textContent = S.prompt;
  $("target").textContent = JSON.stringify(S.target);
  const a = S.applied;
  const g = $("generation");
  const key = `${S.episode || 0}:${a ? a.step : ""}`;
  if (a && a.text != null && g.dataset.key !== key) {
    g.dataset.key = key;
    g.dataset.step = String(a.step);
    g.replaceChildren();
    const want = S.target || "";
    let run = null;
    for (let i = 0; i < a.text.length; i++) {
      const cls = a.text[i] === want[i] ? "ok" : "no";
      if (!run || run.className !== cls) { run = document.createElement("span"); run.className = cls; g.appendChild(run); }
      run.textContent += a.text[i];
    }
    if (!a.text.length) g.textContent = "(empty answer)";
    $("gen-step").textContent = `· step ${a.step}`;
  } else if (!a && g.dataset.key !== key) {
    g.dataset.key = key;
    g.dataset.step = "";
    g.textContent = "waiting for the first step…";
    $("gen-step").textContent = "";
  }
  // newest answers first; when there are more than fit, the oldest (first) answer stays as the
  // last row and a marker says how many are left out: the box never scrolls or cuts a row
  const h = $("history");
  const all = S.generations;
  const hkey = `${S.episode || 0}:${all.length}:${all.length ? all[all.length - 1].step : ""}`;
  if (h.dataset.key !== hkey) {
    h.dataset.key = hkey;
    const row = (it) => {
      const li = document.createElement("li");
      const s = document.createElement("span"); s.className = "s"; s.textContent = "step " + it.step;
      const t = document.createElement("span"); t.className = "t"; t.textContent = JSON.stringify(it.text);
      li.append(s, t);
      return li;
    };
    const newest = all.slice(-HISTORY_ROWS).reverse();
    const rows = newest.map(row);
    if (all.length > HISTORY_ROWS) {
      const gap = document.createElement("li");
      gap.className = "gap";
      const left = all.length - HISTORY_ROWS - 1;
      gap.textContent = left > 0 ? `⋯ ${left} more answer${left === 1 ? "" : "s"} ⋯` : "⋯";
      rows.pop();
      rows.push(gap, row(all[0]));
    }
    h.replaceChildren(...rows);
  }
}

function xScale(commits, w, left, right) {
  const n = Math.max(commits.length, 1);
  const bw = (w - left - right) / n;
  return { bw, x: (i) => left + i * bw };
}

function timeline(commits) {
  const W = 1200, H = 56;
  const s = svg($("timeline"), W, H);
  s.setAttribute("data-points", String(commits.length));
  if (!commits.length) { waiting(s, W, H); return; }
  const { bw, x } = xScale(commits, W, 4, 4);
  const applied = new Set(S.applied_steps);
  const cur = S.applied ? S.applied.step : -1;
  commits.forEach((c, i) => {
    const anchor = c.kind === "anchor";
    const r = el("rect", {
      x: x(i) + 0.5, y: anchor ? 6 : 16, width: Math.max(bw - 1, 1), height: anchor ? 34 : 24, rx: 2,
      fill: anchor ? "var(--anchor)" : "var(--patch)", opacity: c.step <= cur ? 1 : 0.45,
    });
    r.appendChild(el("title", {}, `step ${c.step}: ${c.kind}, ${fmtBytes(c.nbytes)}, ${pct(c.changed / c.total)} changed`));
    s.appendChild(r);
    if (c.step === cur || applied.has(c.step)) {
      s.appendChild(el("rect", { x: x(i) + 0.5, y: 44, width: Math.max(bw - 1, 1), height: 4, fill: "var(--applied)" }));
    }
  });
  const first = commits[0].step, last = commits[commits.length - 1].step;
  s.appendChild(el("text", { x: 4, y: H - 1 }, "step " + first));
  s.appendChild(el("text", { x: W - 4, y: H - 1, "text-anchor": "end" }, "step " + last));
}

function bytesChart(commits) {
  const W = 600, H = 220, L = 52, R = 8, T = 8, B = 18;
  const s = svg($("chart-bytes"), W, H);
  s.setAttribute("data-points", String(commits.length));
  if (!commits.length) { waiting(s, W, H); return; }
  const full = commits[commits.length - 1].full_bytes;
  const vals = commits.map((c) => c.nbytes).concat([full, ...commits.map((c) => 6 * c.changed)]);
  const lo = Math.pow(10, Math.floor(Math.log10(Math.max(Math.min(...vals.filter((v) => v > 0)), 1))));
  const hi = Math.pow(10, Math.ceil(Math.log10(Math.max(...vals) * 1.05)));
  const y = (v) => T + (H - T - B) * (1 - (Math.log10(Math.max(v, lo)) - Math.log10(lo)) / (Math.log10(hi) - Math.log10(lo)));
  for (let p = Math.log10(lo); p <= Math.log10(hi) + 1e-9; p++) {
    const yy = y(Math.pow(10, p));
    s.appendChild(el("line", { x1: L, x2: W - R, y1: yy, y2: yy, class: "axis" }));
    s.appendChild(el("text", { x: L - 4, y: yy + 3, "text-anchor": "end" }, fmtBytes(Math.pow(10, p))));
  }
  const { bw, x } = xScale(commits, W, L, R);
  commits.forEach((c, i) => {
    const r = el("rect", {
      x: x(i) + 0.5, y: y(c.nbytes), width: Math.max(bw - 1, 1), height: Math.max(H - B - y(c.nbytes), 1),
      fill: c.kind === "anchor" ? "var(--anchor)" : "var(--patch)",
    });
    r.appendChild(el("title", {}, `step ${c.step}: ${fmtBytes(c.nbytes)} (${(c.full_bytes / Math.max(c.nbytes, 1)).toFixed(1)}× smaller than full)`));
    s.appendChild(r);
  });
  const naive = commits.map((c, i) => c.kind === "patch" ? `${x(i) + bw / 2},${y(6 * c.changed)}` : null).filter(Boolean);
  if (naive.length > 1) s.appendChild(el("polyline", { points: naive.join(" "), fill: "none", stroke: "var(--naive)", "stroke-width": 1.5, "stroke-dasharray": "4 3" }));
  s.appendChild(el("line", { x1: L, x2: W - R, y1: y(full), y2: y(full), stroke: "var(--text)", "stroke-width": 1.5 }));
  s.appendChild(el("text", { x: W - R - 2, y: y(full) - 3, "text-anchor": "end" }, "full " + fmtBytes(full)));
}

function densityChart(commits) {
  const W = 600, H = 220, L = 44, R = 8, T = 8, B = 18;
  const s = svg($("chart-density"), W, H);
  const pts = commits.map((c, i) => [i, c]).filter(([, c]) => c.kind === "patch" && c.total > 0);
  s.setAttribute("data-points", String(pts.length));
  if (!pts.length) { waiting(s, W, H, commits.length ? "waiting for the first patch…" : WAITING); return; }
  const maxD = Math.max(...pts.map(([, c]) => c.changed / c.total), 0.01);
  const top = [0.01, 0.02, 0.04, 0.1, 0.2, 0.4, 0.6, 0.8, 1].find((v) => v >= maxD) || 1;
  const y = (v) => T + (H - T - B) * (1 - v / top);
  for (let k = 0; k <= 4; k++) {
    const v = (top * k) / 4, yy = y(v);
    s.appendChild(el("line", { x1: L, x2: W - R, y1: yy, y2: yy, class: "axis" }));
    s.appendChild(el("text", { x: L - 4, y: yy + 3, "text-anchor": "end" }, +(100 * v).toFixed(2) + "%"));
  }
  const { bw, x } = xScale(commits, W, L, R);
  const line = pts.map(([i, c]) => `${x(i) + bw / 2},${y(c.changed / c.total)}`).join(" ");
  const area = `${x(pts[0][0]) + bw / 2},${y(0)} ${line} ${x(pts[pts.length - 1][0]) + bw / 2},${y(0)}`;
  s.appendChild(el("polygon", { points: area, fill: "var(--patch)", opacity: 0.15 }));
  s.appendChild(el("polyline", { points: line, fill: "none", stroke: "var(--patch)", "stroke-width": 2 }));
  const [, lastC] = pts[pts.length - 1];
  s.appendChild(el("text", { x: W - R - 2, y: T + 10, "text-anchor": "end" }, `step ${lastC.step}: ${pct(lastC.changed / lastC.total)}`));
}

function heatColor(f) {
  // dark blue -> teal -> yellow, perceptually ordered; sqrt to show small fractions
  const t = Math.sqrt(Math.max(0, Math.min(1, f)));
  const stops = [[20, 29, 48], [33, 145, 140], [253, 231, 37]];
  const seg = t < 0.5 ? 0 : 1, u = t < 0.5 ? t * 2 : (t - 0.5) * 2;
  const a = stops[seg], b = stops[seg + 1];
  return `rgb(${a.map((v, k) => Math.round(v + (b[k] - v) * u)).join(",")})`;
}

function heatmap(commits) {
  const groups = S.groups || [];
  const W = 600, L = 58, R = 8, T = 5, B = 16, rowH = 16;
  const H = T + B + rowH * Math.max(groups.length, 1);
  const s = svg($("heatmap"), W, H);
  s.setAttribute("data-points", String(commits.length));
  if (!commits.length || !groups.length) { waiting(s, W, H); return; }
  const { bw, x } = xScale(commits, W, L, R);
  groups.forEach((g, r) => s.appendChild(el("text", { x: L - 4, y: T + r * rowH + rowH / 2 + 3, "text-anchor": "end" }, g)));
  commits.forEach((c, i) => {
    if (!c.layers) {
      s.appendChild(el("rect", { x: x(i), y: T, width: Math.max(bw - 0.5, 0.5), height: rowH * groups.length - 1, fill: "var(--line)" }));
      return;
    }
    c.layers.forEach((f, r) => {
      const cell = el("rect", {
        x: x(i), y: T + r * rowH, width: Math.max(bw - 0.5, 0.5), height: rowH - 1,
        fill: heatColor(f),
      });
      cell.appendChild(el("title", {}, `step ${c.step} (${c.kind}) · ${groups[r]}: ${pct(f)} of its bf16 weights changed`));
      s.appendChild(cell);
    });
    if (c.kind === "anchor") {
      s.appendChild(el("rect", { x: x(i), y: T - 3, width: Math.max(bw - 0.5, 0.5), height: 2, fill: "var(--anchor)" }));
    }
  });
  s.appendChild(el("text", { x: L, y: H - 3 }, "step " + commits[0].step));
  s.appendChild(el("text", { x: W - R, y: H - 3, "text-anchor": "end" }, "step " + commits[commits.length - 1].step));
}

function lagChart() {
  const pts = (S.lag || []).filter((p) => p.steps != null).slice(-300);
  const W = 600, H = 220, L = 36, R = 40, T = 8, B = 18;
  const s = svg($("chart-lag"), W, H);
  s.setAttribute("data-points", String(pts.length));
  if (!pts.length) { waiting(s, W, H, "waiting for the first commit…"); return; }
  const t0 = pts[0].t, t1 = Math.max(pts[pts.length - 1].t, t0 + 1);
  const maxS = Math.max(...pts.map((p) => p.steps), 2);
  const maxT = Math.max(...pts.map((p) => p.seconds), 1);
  const x = (t) => L + (W - L - R) * (t - t0) / (t1 - t0);
  const ys = (v) => T + (H - T - B) * (1 - v / maxS);
  const yt = (v) => T + (H - T - B) * (1 - v / maxT);
  for (let k = 0; k <= 2; k++) {
    const yy = T + (H - T - B) * k / 2;
    s.appendChild(el("line", { x1: L, x2: W - R, y1: yy, y2: yy, class: "axis" }));
    s.appendChild(el("text", { x: L - 4, y: yy + 3, "text-anchor": "end" }, (maxS * (1 - k / 2)).toFixed(0)));
    s.appendChild(el("text", { x: W - R + 4, y: yy + 3 }, (maxT * (1 - k / 2)).toFixed(1) + "s"));
  }
  s.appendChild(el("polyline", { points: pts.map((p) => `${x(p.t)},${ys(p.steps)}`).join(" "), fill: "none", stroke: "var(--applied)", "stroke-width": 2 }));
  s.appendChild(el("polyline", { points: pts.map((p) => `${x(p.t)},${yt(p.seconds)}`).join(" "), fill: "none", stroke: "var(--anchor)", "stroke-width": 1.2, "stroke-dasharray": "3 3" }));
  s.appendChild(el("text", { x: L + 4, y: H - 4 }, "— steps behind (left)   - - seconds behind (right)   last " + Math.round(t1 - t0) + " s"));
}

fetch("/api/state")
  .then((r) => r.json())
  .then((data) => { if (!S) { S = data; clockSkew = S.now - Date.now() / 1000; render(); } })
  .catch(() => {})
  .finally(connect);
