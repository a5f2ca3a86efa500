"""The demo figures printed in README.md and docs/ match what the code produces (within 10%).

One default demo run in lockstep (``spaces_demo.figures.measure``: the demo's trainer, uploader and
verifying fetcher, 400 steps of the 0.4M-parameter toy; under a minute of CPU) is measured once for
the module; every sentence in :data:`spaces_demo.figures.PRINTED` and the generated
``docs/demo-figures.md`` must quote it within :data:`spaces_demo.figures.TOLERANCE`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the demo extra is part of the test extra")

from spaces_demo.figures import (  # noqa: E402
    GENERATED,
    PRINTED,
    DemoFigures,
    Printed,
    check_printed,
    figures_markdown,
    measure,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def default_run() -> DemoFigures:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the demo's trainer (and scripts/figures.py)
    try:
        return measure()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_every_printed_figure_is_within_10_percent_of_a_default_run(default_run: DemoFigures) -> None:
    assert default_run.bit_exact
    assert default_run.steps == 400 and default_run.commits == 401  # lockstep: no step folded
    assert default_run.anchors + default_run.patches == default_run.commits
    problems = check_printed(default_run, ROOT)
    assert not problems, "stale figures (rerun python scripts/figures.py and edit these):\n" + "\n".join(problems)


@pytest.mark.slow
def test_the_generated_table_is_what_the_script_writes(default_run: DemoFigures, tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / GENERATED).write_text(figures_markdown(default_run))
    assert check_printed(default_run, tmp_path, printed=()) == []
    text = (tmp_path / GENERATED).read_text()
    assert "`answer_step` = " in text and "bit-exact" in text


def _figures() -> DemoFigures:
    return DemoFigures(
        steps=400, params=425_376, full_kB=850.8, density_pct=2.27, patch_kB=12.66, patch_x=67.2,
        commits=401, anchors=26, anchor_MB=22.35, patches=375, patch_MB=23.05, shipped_MB=45.4,
        full_MB=341.2, run_x=7.51, B_per_changed=0.92, answer_step=30, bit_exact=True,
    )  # fmt: skip


def test_a_stale_figure_is_named_with_its_file_and_both_values(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    f = _figures()
    (tmp_path / GENERATED).write_text(figures_markdown(f))
    page = Printed("page.md", r"a patch is (?P<patch_kB>[\d.]+) kB and (?P<anchors>\d+) anchors")
    (tmp_path / "page.md").write_text("Here a patch is 20.8 kB\nand 27 anchors.\n")  # a line break inside
    problems = check_printed(f, tmp_path, printed=(page,))
    assert problems == ["page.md: prints patch_kB = 20.8, the code gives 12.66 (more than 10% off)"]
    # within 10% passes; a figure the run does not produce, a reworded sentence and a missing table fail
    (tmp_path / "page.md").write_text("a patch is 13.5 kB and 28 anchors")
    assert check_printed(f, tmp_path, printed=(page,)) == []
    odd = Printed("page.md", r"a patch is (?P<nonsense>[\d.]+) kB")
    assert check_printed(f, tmp_path, printed=(odd,)) == [
        "page.md: prints nonsense = 13.5, which the run did not produce"
    ]
    (tmp_path / "page.md").write_text("the patches got smaller")
    assert "gone or reworded" in check_printed(f, tmp_path, printed=(page,))[0]
    (tmp_path / GENERATED).unlink()
    assert check_printed(f, tmp_path, printed=()) == [f"{GENERATED}: missing or empty: run python scripts/figures.py"]


def test_the_generated_table_quotes_every_figure() -> None:
    f = _figures()
    text = figures_markdown(f)
    for key in f.values():
        assert f"`{key}` = " in text, key
    assert check_printed(dataclasses.replace(f), ROOT, printed=()) == []  # the committed table: these figures


def test_every_printed_sentence_is_found_in_its_file() -> None:
    """A reworded sentence is caught without the slow run: each pattern still matches its file."""
    import re

    for p in PRINTED:
        text = " ".join((ROOT / p.path).read_text().split())
        assert re.search(p.pattern, text), (p.path, p.pattern)
