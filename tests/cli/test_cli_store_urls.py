"""A mistyped store URL is refused by every command, nothing is written, and every command says
which store it resolved (issue 23, point 8).

``delta-upload ckpt --store s3:/mybucket/r1 --step 1`` used to exit 0 with "committed", having
written a local folder ``./s3:/mybucket/r1``. Each command that takes a store is run here in an
empty working directory with such URLs: it exits 1 with one ``error:`` line that names the
supported forms, and the directory stays empty.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cli_process import checkpoints, run  # noqa: E402
from server_harness import free_port  # noqa: E402

from deltasync.cli import main, upload_main  # noqa: E402

TYPOS = [
    "s3:/mybucket/r1",
    "hf:/buckets/ns/bucket/r1",
    "s3:mybucket/r1",
    "hf:buckets/ns/bucket",
    "memory:run",
    "file:/abs/run",
    "gs://bucket/r1",
    "https://host/r1",
    "ftp://host/r1",
    "runs:r1",
    "x:y",
    "runs/r1://x",
]


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    """An empty working dir, and inputs (a checkpoint, a watched dir, a cache) outside it."""
    out = {name: tmp_path / name for name in ("cwd", "inputs", "cache")}
    for d in out.values():
        d.mkdir()
    out["ckpt"] = checkpoints(out["inputs"], 1)[0]
    out["watched"] = out["inputs"] / "watched"
    out["watched"].mkdir()
    return out


def _commands(d: dict[str, Path]) -> dict[str, Callable[[str], int]]:
    """Every command that takes a store, as a function of the store URL; relative outputs land in the cwd."""
    port = str(free_port())
    return {
        "fetch": lambda u: main(["fetch", "--store", u, "--out", "out"]),
        "inspect": lambda u: main(["inspect", u]),
        "inspect --store": lambda u: main(["inspect", "--store", u, "--verify"]),
        "gc": lambda u: main(["gc", "--store", u, "--keep-anchors", "1"]),
        "upload": lambda u: main(["upload", str(d["ckpt"]), "--store", u, "--step", "1", "--cache", str(d["cache"])]),
        "delta-upload": lambda u: upload_main([str(d["ckpt"]), "--store", u, "--step", "1"]),
        "delta-upload watch": lambda u: upload_main(["watch", str(d["watched"]), "--store", u, "--once"]),
        "serve": lambda u: main(["serve", "--store", u, "--port", port, "--db", "signal.db"]),
        "follow": lambda u: main(["follow", "--store", u, "--out", "out", "--until", "1"]),
    }


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("url", TYPOS)
def test_every_command_refuses_a_mistyped_store_url_and_writes_nothing(
    url: str, dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(dirs["cwd"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(dirs["cache"]))  # delta-upload's default cache, outside the cwd
    inputs = _listing(dirs["inputs"])
    for name, command in _commands(dirs).items():
        assert command(url) == 1, name
        err = capsys.readouterr().err
        assert err.startswith(f"error: {url}: "), (name, err)
        assert "this build supports" in err.lower() and "s3://<bucket>" in err and "hf://buckets/" in err, (name, err)
        assert "Traceback" not in err and "store: " not in err, (name, err)
        assert os.listdir(dirs["cwd"]) == [], (name, os.listdir(dirs["cwd"]))
        assert _listing(dirs["cache"]) == [] and _listing(dirs["inputs"]) == inputs, name


@pytest.mark.parametrize(
    ("url", "meant"),
    [("s3:/mybucket/r1", "s3://mybucket/r1"), ("hf:/buckets/ns/bucket/r1", "hf://buckets/ns/bucket/r1")],
)
def test_delta_upload_of_the_issue_says_what_was_meant(url: str, meant: str, tmp_path: Path) -> None:
    # the exact command of the report, as a user runs it (a real process)
    (tmp_path / "cwd").mkdir()
    ckpt = checkpoints(tmp_path, 1)[0]
    r = run("delta-upload", str(ckpt), "--store", url, "--step", "1", cwd=tmp_path / "cwd")
    assert r.returncode == 1, r
    assert r.stderr.startswith(f"error: {url}: malformed store URL"), r.stderr
    assert f"did you mean {meant}?" in r.stderr and "committed" not in r.stdout + r.stderr
    assert os.listdir(tmp_path / "cwd") == []


def _store_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("store: ")]


def test_every_command_prints_the_store_it_resolved(
    dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(dirs["cwd"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(dirs["cache"]))
    here = (dirs["cwd"] / "runs" / "r1").as_uri()
    # a relative path, and a local path with a colon in its first part written as ./x:y
    assert main(["inspect", "runs/r1"]) == 1  # nothing there yet: the store is named, then the error
    err = capsys.readouterr().err
    assert _store_lines(err) == [f"store: {here}"] and "no deltasync run here" in err
    assert upload_main([str(dirs["ckpt"]), "--store", "runs/r1", "--step", "1", "--cache", str(dirs["cache"])]) == 0
    out, err = capsys.readouterr()
    assert _store_lines(err) == [f"store: {here}"] and "store: " not in out
    assert main(["inspect", "--store", "./runs/r1"]) == 0
    out, err = capsys.readouterr()
    assert _store_lines(err) == [f"store: {here}"]
    assert "store: " not in out and out.splitlines()[-1].split()[0] == "1"  # stdout is the table only
    for argv in (
        ["fetch", "--store", "runs/r1", "--out", "out"],
        ["gc", "runs/r1", "--keep-anchors", "1", "--dry-run"],
        ["follow", "--store", f"FILE://{dirs['cwd']}/runs/r1", "--out", "live", "--until", "1"],
    ):
        assert main(argv) == 0, argv
        out, err = capsys.readouterr()
        assert _store_lines(err) == [f"store: {here}"] and "store: " not in out, argv
    assert upload_main(["watch", str(dirs["watched"]), "--store", "runs/r1", "--once"]) == 0  # nothing new to push
    assert _store_lines(capsys.readouterr().err) == [f"store: {here}"]
    colon = (dirs["cwd"] / "x:y").as_uri()
    assert main(["inspect", "./x:y"]) == 1
    assert _store_lines(capsys.readouterr().err) == [f"store: {colon}"]
    # serve: the {run} placeholder is kept; it stops here on a non-loopback host without a token
    monkeypatch.delenv("DELTASYNC_PUBLISH_TOKEN", raising=False)
    assert main(["serve", "--store", "runs/{run}", "--host", "0.0.0.0", "--port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert _store_lines(err) == [f"store: {(dirs['cwd'] / 'runs').as_uri()}/{{run}}"], err
    assert sorted(os.listdir(dirs["cwd"])) == ["live", "out", "runs"]


def test_an_upper_case_scheme_is_the_same_store(
    dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(dirs["cwd"])
    url = "MEMORY://r1"
    assert main(["inspect", url]) == 1  # a fresh memory store holds no run: named as memory://
    err = capsys.readouterr().err
    assert _store_lines(err) == ["store: memory://r1"] and "unsupported" not in err
