"""Every ``pip install`` line the project prints works as written from a clone, without a network.

deltasync is installed from a clone, not from PyPI, so ``pip install 'deltasync[s3]'`` cannot work.
Each install line in the docs (README.md, docs/), in the product's messages and docstrings
(deltasync/, spaces_demo/) and in the examples must name only installable targets:

* the clone itself, ``.`` or ``'.[extra,...]'`` (with ``-e`` or not), every extra one that
  pyproject.toml declares; the line is then run from the clone's root;
* or packages that pyproject.toml's dependency lists name, with the version it pins when it pins
  one (``obstore==0.12.1``), or a range it declares (``'fastapi>=0.115,<1'``).

The Dockerfile is left out: it installs the wheel it builds (``"$1[demo,s3,hf]"``), which the Space
image test (scripts/test_space_image.py) builds and runs.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself needs tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("README.md", "docs", "deltasync", "spaces_demo", "examples")
SUFFIXES = frozenset({".md", ".py", ".html", ".js", ".txt", ".yml", ".yaml"})

# where a printed install line ends: a shell operator, a comment, the end of the string or the
# markdown code span holding it, or the prose after it ("... (the version the extra pins)")
_END = re.compile(r"&&|\|\||[#`\";()|]|, | or ")
_NO_VALUE = frozenset({"-q", "--quiet", "-U", "--upgrade", "--user", "--no-cache-dir", "--pre"})
_WITH_VALUE = frozenset({"-i", "--index-url", "--extra-index-url"})
_EDITABLE = frozenset({"-e", "--editable"})


@dataclass(frozen=True)
class InstallLine:
    where: str  # path:line
    text: str  # the line from "pip install" to where it ends


def install_lines() -> list[InstallLine]:
    """Every ``pip install ...`` in the scanned files, cut where the command ends."""
    found = []
    for top in SCANNED:
        base = ROOT / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.suffix in SUFFIXES)
        for path in files:
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                for m in re.finditer(r"\bpip install\b", line):
                    rest = line[m.end() :]
                    end = _END.search(rest)
                    text = "pip install" + (rest[: end.start()] if end else rest)
                    found.append(InstallLine(f"{path.relative_to(ROOT)}:{n}", text.strip()))
    return found


def pyproject() -> tuple[set[str], dict[str, list[Requirement]]]:
    """pyproject.toml's extras, and each package its dependency lists name -> the requirements naming it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    named: dict[str, list[Requirement]] = {}
    for spec in [*project["dependencies"], *(r for deps in project["optional-dependencies"].values() for r in deps)]:
        req = Requirement(spec)
        named.setdefault(canonicalize_name(req.name), []).append(req)
    return extras, named


def problems(line: InstallLine, extras: set[str], named: dict[str, list[Requirement]]) -> list[str]:
    """What in ``line`` cannot be installed as written from the clone's root (empty: all of it can)."""
    try:
        words = shlex.split(line.text)[2:]
    except ValueError as exc:
        return [f"cannot read it as a shell command ({exc})"]
    out: list[str] = []
    targets: list[str] = []
    skip_value = False
    for word in words:
        if skip_value:
            skip_value = False
        elif word in _WITH_VALUE:
            skip_value = True
        elif word in _EDITABLE or word in _NO_VALUE:
            pass
        elif word.startswith("-"):
            out.append(f"unknown pip option {word}")
        else:
            targets.append(word.rstrip(".") if len(word) > 1 and not word.startswith(".[") else word)
    if not targets:
        out.append("no target (keep the whole command on one line)")
    for target in targets:
        out.extend(_target_problems(target, extras, named))
    return out


def _target_problems(target: str, extras: set[str], named: dict[str, list[Requirement]]) -> list[str]:
    if target.startswith(".") or target.startswith("/"):  # the clone
        m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?\.?", target)
        if m is None:
            return [f"{target!r}: a path other than the clone's root '.'"]
        wanted = [e for e in (m.group(1) or "").split(",") if e]
        return [f"{target!r}: pyproject.toml has no extra {e!r}" for e in wanted if e not in extras]
    try:
        req = Requirement(target)
    except InvalidRequirement as exc:
        return [f"{target!r} is not a requirement ({exc})"]
    name = canonicalize_name(req.name)
    if name == "deltasync":
        return [f"{target!r}: deltasync is not on PyPI; install the clone: pip install -e '.[extra]'"]
    if name not in named:
        return [f"{target!r}: pyproject.toml's dependency lists do not name {req.name}"]
    declared = named[name]
    pins = {str(r.specifier) for r in declared if any(s.operator == "==" for s in r.specifier)}
    given = str(req.specifier)
    if not given:
        return [f"{target!r}: pin the version pyproject.toml pins ({', '.join(sorted(pins))})"] if pins else []
    if any(given == str(r.specifier) for r in declared):
        return []
    exact = [s.version for s in req.specifier if s.operator == "=="]
    if len(exact) == 1 and all(r.specifier.contains(exact[0], prereleases=True) for r in declared):
        return []
    return [f"{target!r}: pyproject.toml declares {' / '.join(sorted({str(r) for r in declared}))}"]


def test_the_scan_finds_the_install_lines_users_meet() -> None:
    """The scan is not vacuous: it sees the README's quickstart and the product's own hints."""
    where = {line.where.split(":")[0] for line in install_lines()}
    assert {"README.md", "deltasync/storage/_s3.py", "deltasync/storage/_hf.py", "deltasync/cli/demo.py"} <= where
    assert "deltasync/cli/serve.py" in where


def test_every_install_line_works_from_a_clone() -> None:
    extras, named = pyproject()
    bad = [
        f"{line.where}: `{line.text}`: {'; '.join(p)}"
        for line in install_lines()
        if (p := problems(line, extras, named))
    ]
    assert not bad, "install lines that cannot work as written from a clone:\n" + "\n".join(bad)


def test_the_checker_refuses_what_a_clone_cannot_install() -> None:
    """The lines issue 26 found, and other ways to get it wrong, are each refused with a reason."""
    extras, named = pyproject()

    def check(text: str) -> list[str]:
        return problems(InstallLine("here:1", text), extras, named)

    assert check("pip install 'deltasync[s3]'") == [
        "'deltasync[s3]': deltasync is not on PyPI; install the clone: pip install -e '.[extra]'"
    ]
    assert check("pip install -e '.[nope]'") == ["'.[nope]': pyproject.toml has no extra 'nope'"]
    assert check("pip install obstore") == ["'obstore': pin the version pyproject.toml pins (==0.12.1)"]
    assert check("pip install obstore==0.11") == ["'obstore==0.11': pyproject.toml declares obstore==0.12.1"]
    assert check("pip install left-pad") == ["'left-pad': pyproject.toml's dependency lists do not name left-pad"]
    assert check("pip install --frobnicate .") == ["unknown pip option --frobnicate"]
    assert check("pip install") == ["no target (keep the whole command on one line)"]
    assert check("pip install ../elsewhere") == ["'../elsewhere': a path other than the clone's root '.'"]
    # and what works
    assert check("pip install -q torch==2.13.0 -e '.[demo]'") == []
    assert check("pip install obstore==0.12.1 'fastapi>=0.115,<1' numba") == []
    assert check("pip install -e .") == []


def _lines_in(message: str) -> list[InstallLine]:
    return [InstallLine("message", "pip install" + _END.split(part)[0]) for part in message.split("pip install")[1:]]


def test_a_missing_backend_or_server_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The errors a user meets without an extra installed name lines that pass the check above."""
    from deltasync.cli.main import main
    from deltasync.errors import StorageError
    from deltasync.storage import HFBucketStore, S3Store, _s3

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    monkeypatch.setattr(_s3, "obs", None)
    messages = []
    with pytest.raises(StorageError) as hf:
        HFBucketStore("my-org/rl-weights")
    messages.append(str(hf.value))
    with pytest.raises(StorageError) as s3:
        S3Store("bucket")
    messages.append(str(s3.value))
    assert main(["serve", "--port", "0"]) == 1
    messages.append(capsys.readouterr().err)

    extras, named = pyproject()
    assert [len(_lines_in(m)) for m in messages] == [1, 1, 2]
    assert [problems(line, extras, named) for m in messages for line in _lines_in(m)] == [[], [], [], []]
    assert "hf:// stores need huggingface_hub and hf-xet" in messages[0]
    assert "s3:// stores need obstore" in messages[1]
    assert messages[2].startswith("error: deltasync serve needs fastapi and uvicorn (uvicorn is missing)")
