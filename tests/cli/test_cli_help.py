"""Every command and option says what it does and shows its default (issue 15): checked on the
argparse parsers themselves, and on the real ``--help`` output of each installed command."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltasync.cli import build_parser, build_upload_parser, build_watch_parser

TIMEOUT = 120.0


def _subparsers(p: argparse.ArgumentParser) -> dict[str, tuple[str, argparse.ArgumentParser]]:
    """name -> (its line in the parent's help, its parser)."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {a.dest: a.help or "" for a in action._get_subactions()}
            return {name: (summaries.get(name, ""), sp) for name, sp in action.choices.items()}
    return {}


def _all_parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    top = build_parser()
    yield "deltasync", top
    for name, (_, sp) in _subparsers(top).items():
        yield f"deltasync {name}", sp
    yield "delta-upload", build_upload_parser()
    yield "delta-upload watch", build_watch_parser()


PARSERS = dict(_all_parsers())
COMMANDS = ["fetch", "inspect", "gc", "upload", "serve", "follow", "fleet", "replica-token", "demo"]


def test_every_command_is_listed_with_a_summary() -> None:
    subs = _subparsers(PARSERS["deltasync"])
    assert sorted(subs) == sorted(COMMANDS)
    for name, (summary, _) in subs.items():
        assert len(summary) > 15, f"`deltasync {name}` has no one-line description in `deltasync --help`"


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_every_parser_has_a_description(prog: str) -> None:
    description = PARSERS[prog].description or ""
    assert len(description) > 40, f"`{prog} --help` has no description"


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_every_option_has_help_and_shows_its_default(prog: str) -> None:
    parser = PARSERS[prog]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and len(action.help) > 8, f"{prog}: {name} has no help text"
        shown = formatter._expand_help(action) if action.help else ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert "default" in shown, f"{prog}: {name}'s help does not show its default {action.default!r}"
            if "%(default)" in (formatter._get_help_string(action) or ""):
                assert str(action.default) in shown


def _script(name: str) -> list[str]:
    script = Path(sys.executable).with_name(name)
    if script.exists():
        return [str(script)]
    entry = "main" if name == "deltasync" else "upload_main"
    return [sys.executable, "-c", f"import sys; from deltasync.cli import {entry}; sys.exit({entry}())"]


def _help(*argv: str) -> str:
    name, rest = argv[0], argv[1:]
    r = subprocess.run(
        [*_script(name), *rest, "--help"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        stdin=subprocess.DEVNULL,
        env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    return r.stdout


def test_help_of_every_command_from_the_real_entry_points() -> None:
    """One process per command, as a user types it; each prints usage, its description and its
    options' help, with defaults, and exits 0."""
    top = _help("deltasync")
    for name in COMMANDS:
        assert re.search(rf"^    {re.escape(name)}\s", top, re.M), f"`deltasync --help` does not list {name}"
    assert "--version" in top
    cases = {f"deltasync {c}": ("deltasync", c) for c in COMMANDS}
    cases |= {"delta-upload": ("delta-upload",), "delta-upload watch": ("delta-upload", "watch")}
    for prog, argv in cases.items():
        out = _help(*argv)
        assert out.startswith(f"usage: {prog} "), out[:200]
        first_words = " ".join((PARSERS[prog].description or "").split()[:4])
        assert first_words in " ".join(out.split()), f"{prog}: description missing from --help"
        for action in PARSERS[prog]._actions:
            for opt in action.option_strings:
                assert opt in out, f"{prog} --help does not show {opt}"
    assert "(default: 8000)" in _help("deltasync", "serve")
    assert "(default: 50)" in _help("delta-upload")


def test_inspect_and_gc_take_the_store_both_ways() -> None:
    for prog in ("deltasync inspect", "deltasync gc"):
        extra = ["--keep-anchors", "1"] if prog.endswith("gc") else []
        a = PARSERS[prog].parse_args(["runs/r1", *extra])
        b = PARSERS[prog].parse_args(["--store", "runs/r1", *extra])
        assert (a.url or a.store_opt) == (b.url or b.store_opt) == "runs/r1"
