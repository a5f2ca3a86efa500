// deltasync demo page: where the bytes go (anchors vs patches), why anchors come when they do,
// and what the same run would ship at 7B (a projection from the measured figures).
"use strict";

const PROJECT_PARAMS = 7e9; // the projection's model size (bf16 elements)

// Bytes shipped by the committed steps, split into anchors and patches (the terminal's
// end-of-run summary computes the same split, spaces_demo/summary.py).
function costSplit(commits) {
  const c = { anchors: 0, patches: 0, anchorBytes: 0, patchBytes: 0, full: 0, changed: 0, total: 0 };
  for (const x of commits) {
    c.full += x.full_bytes;
    if (x.kind === "anchor") { c.anchors++; c.anchorBytes += x.nbytes; }
    else if (x.kind === "patch") { c.patches++; c.patchBytes += x.nbytes; c.changed += x.changed; c.total += x.total; }
  }
  c.shipped = c.anchorBytes + c.patchBytes;
  return c;
}

// Why each anchor after the first was written, replaying the uploader's two rules
// (deltasync/uploader/_uploader.py, _anchor_due): every `anchor_every` pushes, or once the patch
// bytes since the last anchor exceed `anchor_bytes_fraction` x that anchor's bytes.
function anchorReasons(commits, every) {
  const r = { first: 0, cadence: 0, bytes: 0, steps: [] };
  let last = null;
  for (const c of commits) {
    if (c.kind !== "anchor") continue;
    r.steps.push(c.step);
    if (last == null) r.first++;
    else if (c.step - last >= every) r.cadence++;
    else r.bytes++;
    last = c.step;
  }
  return r;
}

function renderCosts(fmtBytes, pct) {
  const commits = S.commits;
  const c = costSplit(commits);
  const share = c.shipped ? c.anchorBytes / c.shipped : 0;
  $("cost-bar-anchor").style.width = (100 * share).toFixed(2) + "%";
  $("cost-bar-patch").style.width = (c.shipped ? 100 * (1 - share) : 0).toFixed(2) + "%";
  $("cost-split").textContent = commits.length
    ? `anchors ${fmtBytes(c.anchorBytes)} (${c.anchors} × a full checkpoint, ${pct(share, 0)} of the bytes) + ` +
      `patches ${fmtBytes(c.patchBytes)} (${c.patches} steps, ${pct(1 - share, 0)}) = ${fmtBytes(c.shipped)} shipped, ` +
      `vs ${fmtBytes(c.full)} as ${commits.length} full checkpoints`
    : "waiting for the first step…";

  const up = S.uploader;
  const rule = $("anchor-rule");
  if (!commits.length) {
    // nothing to explain before the first commit (no "So far: 0 anchors")
    rule.textContent = "Anchors and patches: waiting for the first step…";
  } else if (!up) {
    rule.textContent = "Anchors: the trainer elsewhere decides when to write a full checkpoint (its uploader's anchor_every and anchor_bytes_fraction).";
  } else {
    const f = up.anchor_bytes_fraction;
    const r = anchorReasons(commits, up.anchor_every);
    const gaps = r.steps.length > 1 ? (r.steps[r.steps.length - 1] - r.steps[0]) / (r.steps.length - 1) : null;
    const patchFrac = c.patches ? c.patchBytes / c.patches / (c.full / Math.max(commits.length, 1)) : null;
    rule.textContent =
      `Why anchors come ${gaps == null ? "when they do" : "every ~" + gaps.toFixed(1) + " steps"} although anchor_every is ${up.anchor_every}: ` +
      `the uploader writes an anchor (a full checkpoint) every anchor_every = ${up.anchor_every} pushes, and also as soon as the patch bytes ` +
      `written since the last anchor exceed anchor_bytes_fraction = ${f} × that anchor's size (this demo's setting; the library's default is 0.5). ` +
      `That caps what a fetcher starting cold downloads: the newest anchor plus at most about ${f}× its size in patches. ` +
      (patchFrac == null ? "" :
        `Here a patch is ${pct(patchFrac, 1)} of a full checkpoint on average (${pct(c.total ? c.changed / c.total : 0)} of the bf16 weights change per step ` +
        `while Adam moves this small model), so the patches add up to an anchor's size after a few steps. `) +
      `So far: ${r.bytes} anchor${r.bytes === 1 ? "" : "s"} by the byte rule, ${r.cadence} by the cadence, plus the initial weights at step ${r.steps.length ? r.steps[0] : 0}.`;
  }

  const proj = $("projection");
  const params = S.model ? S.model.params : (commits.length ? commits[0].total : 0);
  if (!c.patches || !params) { proj.textContent = "Projection at 7B: after the first patch."; return; }
  const scale = PROJECT_PARAMS / params;
  const perChanged = c.patchBytes / Math.max(c.changed, 1);
  const density = c.changed / Math.max(c.total, 1);
  const perPatch = PROJECT_PARAMS * density * perChanged;
  const anchor7 = c.anchorBytes * scale, patch7 = c.patchBytes * scale;
  proj.textContent =
    `Projection, not a measurement: the same ${commits.length} commits at 7B parameters (${fmtBytes(2 * PROJECT_PARAMS)} per bf16 checkpoint), ` +
    `scaled by element count (×${scale.toFixed(0)}) at this run's measured density (${pct(density)} of the weights changed per patch) and ` +
    `bytes per changed element (${perChanged.toFixed(2)} B): a patch ≈ ${fmtBytes(perPatch)}; anchors ≈ ${fmtBytes(anchor7)} + ` +
    `patches ≈ ${fmtBytes(patch7)} = ${fmtBytes(anchor7 + patch7)}, vs ${fmtBytes(c.full * scale)} as full checkpoints. ` +
    `A real RL run at a small learning rate changes far fewer bf16 weights per step than this demo, so its patches are smaller.`;
}

// The heatmap's colour legend: the same colour function, ticks at the sqrt-scaled positions.
function renderHeatScale(heatColor) {
  const bar = $("heat-scale-bar");
  if (bar.dataset.done) return;
  bar.dataset.done = "1";
  const stops = [];
  for (let k = 0; k <= 20; k++) { const t = k / 20; stops.push(`${heatColor(t * t)} ${(100 * t).toFixed(0)}%`); }
  bar.style.background = `linear-gradient(to right, ${stops.join(", ")})`;
  const ticks = $("heat-scale-ticks");
  ticks.replaceChildren(...[0, 0.01, 0.05, 0.1, 0.25, 0.5, 1].map((f) => {
    const s = document.createElement("span");
    s.style.left = (100 * Math.sqrt(f)).toFixed(1) + "%";
    s.textContent = +(100 * f).toFixed(0) + "%";
    return s;
  }));
}
