"""The README's two commands, each a CPU line and a GPU line, resolve as printed.

Each line is run the way a new user runs it, up to the install: a fresh venv, then its ``pip
install`` with ``--dry-run`` (pip resolves every requirement and reports what it would download,
without installing). The CPU line names PyTorch's CPU index; where this machine cannot reach it, the
machine's own wheel source stands in (pip's configured find-links, which hold the same CPU build of
torch 2.13.0), and the line must still pick a ``+cpu`` torch and no CUDA wheel. docs/demo.md prints
the same lines, and ``.ci/run`` runs the README's GPU test line exactly.
"""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_PACKAGES = re.compile(r"^(nvidia-|triton$|cuda-)")


def readme_lines() -> dict[str, str]:
    """The four lines of the README's "Two commands", by name: demo-cpu, demo-gpu, tests-cpu, tests-gpu."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Two commands") : readme.index("\n## ", readme.index("## Two commands") + 1)]
    blocks = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    out: dict[str, str] = {}
    for b in blocks:
        job = "demo" if b.endswith("&& deltasync demo") else "tests" if b.endswith("&& python -m pytest") else None
        assert job is not None, f"a code block of the README's Two commands that runs neither: {b}"
        out[f"{job}-{'cpu' if CPU_INDEX in b else 'gpu'}"] = b
    assert sorted(out) == ["demo-cpu", "demo-gpu", "tests-cpu", "tests-gpu"], blocks
    return out


def pip_args(line: str) -> list[str]:
    """The arguments of the line's ``pip install`` (after checking the line's other steps)."""
    steps = [s.strip() for s in line.split("&&")]
    assert steps[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"], steps
    args = shlex.split(steps[2])
    assert args[:2] == ["pip", "install"], steps[2]
    assert "-q" not in args and "--quiet" not in args, "a quiet install of several GB looks hung"
    return args[2:]


def test_each_command_has_a_cpu_and_a_gpu_line_that_differ_only_in_the_index() -> None:
    lines = readme_lines()
    for job in ("demo", "tests"):
        cpu, gpu = pip_args(lines[f"{job}-cpu"]), pip_args(lines[f"{job}-gpu"])
        assert cpu == [*gpu, "--extra-index-url", CPU_INDEX], (cpu, gpu)
        assert "torch==2.13.0" in gpu


def test_docs_demo_prints_the_same_lines_and_ci_runs_the_gpu_test_line() -> None:
    lines = readme_lines()
    demo_page = (ROOT / "docs" / "demo.md").read_text()
    for name, line in lines.items():
        assert line in demo_page, name
    assert lines["tests-gpu"] in (ROOT / ".ci" / "run").read_text().splitlines()


def _reachable(url: str) -> bool:
    host = urlparse(url).hostname or ""
    try:
        with socket.create_connection((host, 443), timeout=5):
            return True
    except OSError:
        return False


def _machine_has_cpu_torch() -> bool:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
    for m in re.finditer(r"find-links='([^']*)'", out.stdout):
        for d in m.group(1).split():
            if list(Path(d).glob("torch-2.13.0+cpu-*.whl")):
                return True
    return False


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("fresh") / ".venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    return venv


def _resolve(venv: Path, args: list[str], report: Path) -> list[dict[str, Any]]:
    cmd = [str(venv / "bin" / "pip"), "install", "--dry-run", "--ignore-installed", "--report", str(report), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"{shlex.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    installs: list[dict[str, Any]] = json.loads(report.read_text())["install"]
    return installs


@pytest.mark.slow
@pytest.mark.parametrize("job", ["demo", "tests"])
def test_the_cpu_and_gpu_lines_resolve_in_a_fresh_venv(job: str, fresh_venv: Path, tmp_path: Path) -> None:
    lines = readme_lines()
    cpu = pip_args(lines[f"{job}-cpu"])
    gpu = pip_args(lines[f"{job}-gpu"])
    if not _reachable(CPU_INDEX):
        # this machine's stand-in for PyTorch's CPU index: its configured find-links hold that build
        assert _machine_has_cpu_torch(), f"{CPU_INDEX} is unreachable and pip's find-links hold no CPU torch 2.13.0"
        cpu = [a for a in cpu if a not in ("--extra-index-url", CPU_INDEX)]
    resolved = {"cpu": _resolve(fresh_venv, cpu, tmp_path / "cpu.json")}
    # the GPU line downloads several GB from PyPI on Linux: resolved here with the machine's pip
    # configuration, where it is the same resolution as the CPU line (resolved once)
    resolved["gpu"] = resolved["cpu"] if cpu == gpu else _resolve(fresh_venv, gpu, tmp_path / "gpu.json")
    extra_pkg = "fastapi" if job == "demo" else "pytest"
    for kind, installs in resolved.items():
        names = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}
        assert names.get("deltasync") and extra_pkg in names, (kind, sorted(names))
        assert names["torch"].startswith("2.13.0"), (kind, names["torch"])
    cpu_names = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in resolved["cpu"]}
    assert cpu_names["torch"] == "2.13.0+cpu", cpu_names["torch"]
    assert not [n for n in cpu_names if CUDA_PACKAGES.match(n)], sorted(cpu_names)
