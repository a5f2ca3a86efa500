"""The figures the README and the docs print about a default demo run, measured from the code.

:func:`measure` runs what ``deltasync demo`` runs with its defaults (the toy Qwen3, its optimizer,
its uploader, in lockstep with the store: :func:`spaces_demo.trainer.wait_for_commit`), applies every
step to a bf16 inference copy with a verifying fetcher as the demo's follower does, and reads the
committed manifests back. ``scripts/figures.py`` writes them to ``docs/demo-figures.md`` and
``--check`` compares every figure printed in :data:`PRINTED` with them; ``tests/docs`` fails when one
is more than 10% off. The page and the end-of-run summary compute the same numbers from the same
manifest rows (:func:`spaces_demo.summary.cost_split`).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltasync.fetcher import DeltaFetcher
from deltasync.storage import open_store
from spaces_demo.rows import manifest_row
from spaces_demo.summary import cost_split
from spaces_demo.toy import TARGET, build_model, greedy
from spaces_demo.trainer import ToyTrainer, demo_uploader, wait_for_commit

__all__ = [
    "GENERATED",
    "PRINTED",
    "TOLERANCE",
    "DemoFigures",
    "Printed",
    "check_printed",
    "figures_markdown",
    "measure",
]

GENERATED = "docs/demo-figures.md"
"""Where ``scripts/figures.py`` writes :func:`figures_markdown` (relative to the repository root)."""

TOLERANCE = 0.10
"""How far a printed figure may be from the measured one (relative)."""


@dataclass(frozen=True, slots=True)
class DemoFigures:
    """What one demo run shipped, in the units the docs print (kB and MB are 1000 and 10^6 bytes)."""

    steps: int
    params: int
    full_kB: float  # one full bf16 checkpoint
    density_pct: float  # changed elements of the last step's patch, % of all
    patch_kB: float  # the last step's patch
    patch_x: float  # full checkpoint / last patch
    commits: int
    anchors: int
    anchor_MB: float
    patches: int
    patch_MB: float
    shipped_MB: float
    full_MB: float  # every commit as a full checkpoint
    run_x: float  # full_MB / shipped_MB
    B_per_changed: float  # patch bytes / changed elements, over the run's patches
    answer_step: int | None  # first step whose inference copy answers the target
    bit_exact: bool

    def values(self) -> dict[str, float]:
        """The figures by name (the names :data:`PRINTED`'s patterns capture)."""
        out = {k: float(getattr(self, k)) for k in self.__slots__ if k not in ("answer_step", "bit_exact")}
        if self.answer_step is not None:
            out["answer_step"] = float(self.answer_step)
        return out


def measure(
    steps: int = 400, model: str = "small", lr: float = 1e-3, anchor_every: int = 50, seed: int = 0
) -> DemoFigures:
    """Run the demo's training and following with these options (its defaults) in a scratch store."""
    import torch

    tmp = tempfile.mkdtemp(prefix="deltasync-figures-")
    try:
        store = open_store(tmp)
        trainer = ToyTrainer(model, seed=seed, lr=lr)
        toy, infer = build_model(model, seed=seed + 1, dtype=torch.bfloat16)  # as the demo's follower
        fetcher = DeltaFetcher(store, verify=True)
        answer: int | None = None
        with demo_uploader(store, anchor_every) as up:
            for step in range(steps + 1):
                if step:
                    trainer.step()
                wait_for_commit(up.push(trainer.model, step))
                fetcher.sync(infer, step=step)
                if answer is None and greedy(infer, toy.tokenizer) == TARGET:
                    answer = step
        want = {k: v.detach().to(torch.bfloat16) for k, v in trainer.model.state_dict().items()}
        got = infer.state_dict()
        exact = sorted(got) == sorted(want) and all(
            torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want
        )
        rows = [manifest_row(fetcher.reader.committed(s).manifest) for s in fetcher.steps()]
        store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _figures(rows, steps, answer, exact)


def _figures(rows: list[dict[str, Any]], steps: int, answer: int | None, exact: bool) -> DemoFigures:
    c = cost_split(rows)
    last = rows[-1]
    patches = [r for r in rows if r["kind"] == "patch"]
    changed = sum(int(r["changed"]) for r in patches)
    return DemoFigures(
        steps=steps,
        params=int(last["total"]),
        full_kB=last["full_bytes"] / 1e3,
        density_pct=100 * last["changed"] / last["total"],
        patch_kB=last["nbytes"] / 1e3,
        patch_x=last["full_bytes"] / last["nbytes"],
        commits=c.commits,
        anchors=c.anchors,
        anchor_MB=c.anchor_bytes / 1e6,
        patches=c.patches,
        patch_MB=c.patch_bytes / 1e6,
        shipped_MB=c.shipped / 1e6,
        full_MB=c.full_bytes / 1e6,
        run_x=c.full_bytes / max(c.shipped, 1),
        B_per_changed=c.patch_bytes / max(changed, 1),
        answer_step=answer,
        bit_exact=exact,
    )


ROWS = (
    ("steps", "training steps (+ the initial weights at step 0)", "{:.0f}"),
    ("params", "parameters of the toy Qwen3", "{:,.0f}"),
    ("full_kB", "one full bf16 checkpoint, kB", "{:.0f}"),
    ("density_pct", "density of the last step's patch, % of the weights", "{:.1f}"),
    ("patch_kB", "the last step's patch, kB", "{:.1f}"),
    ("patch_x", "full checkpoint / last patch", "{:.0f}x"),
    ("commits", "commits", "{:.0f}"),
    ("anchors", "anchors (full checkpoints)", "{:.0f}"),
    ("anchor_MB", "anchor bytes, MB", "{:.1f}"),
    ("patches", "patches", "{:.0f}"),
    ("patch_MB", "patch bytes, MB", "{:.1f}"),
    ("shipped_MB", "shipped in all, MB", "{:.1f}"),
    ("full_MB", "the same commits as full checkpoints, MB", "{:.1f}"),
    ("run_x", "full checkpoints / shipped", "{:.1f}x"),
    ("B_per_changed", "bytes per changed element, over the patches", "{:.2f}"),
    ("answer_step", "first step whose copy answers the target", "{:.0f}"),
)


def figures_markdown(f: DemoFigures) -> str:
    """``docs/demo-figures.md``: the figures as a table, and how they were made."""
    values = f.values()
    lines = [
        "# Demo figures",
        "",
        "<!-- written by scripts/figures.py: edit that, not this file -->",
        "",
        "What a default `deltasync demo` run ships (`--model small --steps 400 --anchor-every 50 --lr 1e-3`),",
        "measured by `python scripts/figures.py` from the code: the demo's trainer and uploader, each",
        "step committed before the next one (as the demo does), and every step applied to a bf16 copy",
        "by a verifying fetcher. The README and [the demo's page](demo.md) quote these figures; a test",
        "(`tests/docs/test_figures.py`) reruns the measurement and fails when a printed figure is more",
        f"than {TOLERANCE:.0%} off. The end state is {'bit-exact' if f.bit_exact else 'NOT bit-exact'} with the trainer's.",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    for key, label, fmt in ROWS:
        if key in values:
            lines.append(f"| {label} | `{key}` = {fmt.format(values[key])} |")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True)
class Printed:
    """A sentence of a doc that quotes figures: each named group of ``pattern`` is one figure (the
    doc's line breaks and runs of spaces are read as one space)."""

    path: str
    pattern: str


_NUM = r"[\d,.]+"
PRINTED: tuple[Printed, ...] = (
    Printed(
        "README.md",
        rf"the density falls to (?P<density_pct>{_NUM})% by step (?P<steps>\d+), where a patch is "
        rf"(?P<patch_kB>{_NUM}) kB against an? (?P<full_kB>{_NUM}) kB full checkpoint \((?P<patch_x>{_NUM})x smaller\), "
        rf"and the whole \d+-step run ships (?P<run_x>{_NUM})x less",
    ),
    Printed("docs/demo.md", r"answers \*\"sparse bit-exact patches\"\* from step (?P<answer_step>\d+) on"),
    Printed(
        "docs/demo.md",
        rf"falls to (?P<density_pct>{_NUM})% by step (?P<steps>\d+), where a patch is (?P<patch_kB>{_NUM}) kB against an? "
        rf"(?P<full_kB>{_NUM}) kB full checkpoint \((?P<patch_x>{_NUM})x smaller\); the whole run ships "
        rf"(?P<shipped_MB>{_NUM}) MB, (?P<anchors>\d+) anchors (?P<anchor_MB>{_NUM}) MB \+ (?P<patches>\d+) patches "
        rf"(?P<patch_MB>{_NUM}) MB, against (?P<full_MB>{_NUM}) MB as full checkpoints \((?P<run_x>{_NUM})x less\)",
    ),
    Printed("docs/demo.md", rf"(?P<B_per_changed>{_NUM}) B per changed element"),
)
"""Every sentence in the README and the docs that prints a demo figure."""


def check_printed(f: DemoFigures, root: Path, printed: tuple[Printed, ...] = PRINTED) -> list[str]:
    """Each printed figure more than :data:`TOLERANCE` off ``f`` (or a sentence no longer found), as
    one line naming the file, the figure, what it prints and what the code gives; empty when all hold."""
    values = f.values()
    problems: list[str] = []
    found: list[tuple[str, list[tuple[str, str]]]] = []
    for p in printed:
        m = re.search(p.pattern, " ".join((root / p.path).read_text().split()))  # line breaks as spaces
        if m is None:
            problems.append(f"{p.path}: the sentence quoting figures is gone or reworded (pattern {p.pattern!r})")
        else:
            found.append((p.path, list(m.groupdict().items())))
    table = (root / GENERATED).read_text() if (root / GENERATED).exists() else ""
    rows = re.findall(rf"`(\w+)` = ({_NUM})", table)
    if not rows:
        problems.append(f"{GENERATED}: missing or empty: run python scripts/figures.py")
    found.append((GENERATED, rows))
    for path, pairs in found:
        for key, raw in pairs:
            shown = float(raw.replace(",", ""))
            want = values.get(key)
            if want is None:
                problems.append(f"{path}: prints {key} = {raw}, which the run did not produce")
            elif abs(shown - want) > TOLERANCE * abs(want):
                problems.append(
                    f"{path}: prints {key} = {raw}, the code gives {want:.4g} (more than {TOLERANCE:.0%} off)"
                )
    return problems
