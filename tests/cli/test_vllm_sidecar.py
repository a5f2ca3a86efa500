"""``deltasync follow --vllm GOOD BAD`` as a user runs it (a real process) beside a fake vLLM server that
answers garbage (tests/hostile_vllm.py) and a good one: it starts, follows the good server to
``--until`` and exits 0 with the bad one reported failed, no traceback; an audit that could not run is
one line, once per server, step and reason; a server's text is printed escaped."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_process import run
from hostile_vllm import HostileVLLM
from tiny_run import push_tiny_run

torch = pytest.importorskip("torch")

import deltasync as ds  # noqa: E402

N = 2


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local run with steps 0..N (a 2-D embedding: the audit's default probes come from it)."""
    root = tmp_path_factory.mktemp("run")
    push_tiny_run(ds.open_store(str(root)), N, seed=7)
    return str(root)


@pytest.fixture
def fakes() -> Iterator[tuple[HostileVLLM, HostileVLLM]]:
    with HostileVLLM() as good, HostileVLLM() as bad:
        yield good, bad


def follow(store: str, good: HostileVLLM, bad: HostileVLLM, cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run(
        "deltasync",
        "follow",
        "--store",
        store,
        "--vllm",
        good.url,
        bad.url,
        "--until",
        str(N),
        "--poll-interval",
        "0.1",
        "--probe-timeout",
        "1",
        "--vllm-timeout",
        "5",
        *extra,
        cwd=cwd,
    )


@pytest.mark.parametrize("junk", ["json_list", "non_json"])
def test_the_sidecar_follows_the_good_server_when_the_other_answers_garbage(
    store: str, fakes: tuple[HostileVLLM, HostileVLLM], tmp_path: Path, junk: str
) -> None:
    good, bad = fakes
    bad.hostile["/weight_info"] = junk  # type: ignore[assignment]
    p = follow(store, good, bad, tmp_path, "--no-audit")
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    assert f"step {N} -> {good.url}: serving" in p.stdout
    assert re.search(rf"{re.escape(bad.url)}: failed \(serving step \(none yet\)\): init: .*/weight_info", p.stderr)
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("stopped; serving: ") and f"{good.url} step {N}" in last
    assert f"{bad.url} failed (last step None): init: " in last
    assert good.version == str(N) and bad.version == "0"
    said_twice = [line for line in p.stderr.splitlines() if line.count(bad.url) > 1]
    assert not said_twice  # a line names its server once (the errors carry its URL too)


def test_an_audit_that_could_not_run_is_one_line_per_step_and_reason_and_escaped(
    store: str, fakes: tuple[HostileVLLM, HostileVLLM], tmp_path: Path
) -> None:
    good, bad = fakes
    bad.hostile["/v1/completions"] = "non_json"
    bad.junk = b"\x1b[2J\x1b[31mgotcha\xe2\x80\xae"  # a terminal escape and a bidi override in the body
    p = follow(store, good, bad, tmp_path)
    assert p.returncode == 0, (p.stdout, p.stderr)
    lines = [line for line in p.stderr.splitlines() if "could not run" in line]
    mine = [line for line in lines if line.startswith(f"{bad.url}: audit of step {N} could not run: ")]
    assert len(mine) == 1, lines
    assert "/v1/completions: the answer is not JSON" in mine[0]
    assert "\\x1b[2J" in mine[0] and "\\u202e" in mine[0]
    assert "\x1b" not in p.stderr + p.stdout and "\u202e" not in p.stderr + p.stdout
    assert len(lines) == len(set(lines))  # every line once
    assert not any(line.startswith(good.url) for line in lines)
    assert f"{good.url}: audit of step {N}: " in p.stdout  # the good one's audit ran
