"""The CLI against the S3 test server: delta-upload twice, inspect, fetch, exactly as with a local dir.

The CLI takes the endpoint and keys from the usual AWS_* environment variables
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import uuid
from pathlib import Path
from typing import Any

import pytest
from qwen3 import make_qwen3
from tensors import assert_state_equal

from deltasync._util.checkpoint_io import load_checkpoint, save_checkpoint
from deltasync.cli import main, upload_main
from deltasync.testing.seaweedfs import SeaweedFS

torch = pytest.importorskip("torch")


@pytest.fixture
def checkpoints(tmp_path: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Two bf16 checkpoints of the tiny Qwen3; the second differs in a few elements."""
    state1 = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in make_qwen3(seed=3).state_dict().items()}
    state2 = {k: v.clone() for k, v in state1.items()}
    g = torch.Generator().manual_seed(0)
    for v in list(state2.values())[::3]:
        flat = v.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        flat[idx] += 0.25
    out = []
    for i, st in enumerate((state1, state2), start=1):
        out.append((save_checkpoint(st, tmp_path / f"ckpt-{i}.safetensors"), st))
    return out


def _session(
    url: str, ckpts: list[tuple[Path, dict[str, Any]]], out: Path, capsys: pytest.CaptureFixture[str]
) -> list[str]:
    """upload step 10, upload step 20, inspect, fetch; returns what each command printed."""
    printed = []
    for (path, _), step in zip(ckpts, (10, 20), strict=True):
        assert upload_main([str(path), "--store", url, "--step", str(step), "--anchor-every", "5"]) == 0
        printed.append(capsys.readouterr().out)
    assert main(["inspect", url]) == 0
    printed.append(capsys.readouterr().out)
    assert main(["fetch", "--store", url, "--out", str(out)]) == 0
    printed.append(capsys.readouterr().out)
    return printed


def test_cli_over_s3_matches_local_dir(
    s3_server: SeaweedFS,
    checkpoints: list[tuple[Path, dict[str, Any]]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    url = f"s3://cli/run-{uuid.uuid4().hex[:8]}"
    s3_out = _session(url, checkpoints, tmp_path / "from-s3", capsys)
    local_out = _session(str(tmp_path / "local-store"), checkpoints, tmp_path / "from-local", capsys)

    assert "step 10: anchor" in s3_out[0] and "step 20: patch" in s3_out[1]
    # the same steps, kinds, sizes and ratios as with a local dir (timings aside)
    for got, want in zip(s3_out[:2], local_out[:2], strict=True):
        assert got.split(" committed in ")[0] == want.split(" committed in ")[0]
    assert s3_out[2] == local_out[2]
    assert [line.split()[:2] for line in s3_out[2].splitlines()] == [
        ["step", "kind"],
        ["10", "anchor"],
        ["20", "patch"],
    ]
    assert "wrote step 20" in s3_out[3]
    fetched = load_checkpoint(tmp_path / "from-s3")
    assert_state_equal(fetched, checkpoints[1][1], "fetched from s3")
    assert_state_equal(load_checkpoint(tmp_path / "from-local"), checkpoints[1][1], "fetched from local")
    # an earlier step too
    assert main(["fetch", "--store", url, "--out", str(tmp_path / "step10"), "--step", "10"]) == 0
    assert_state_equal(load_checkpoint(tmp_path / "step10"), checkpoints[0][1], "step 10 from s3")


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    exe = Path(sysconfig.get_path("scripts")) / "deltasync"
    cmd = [str(exe), *args] if exe.is_file() else [sys.executable, "-m", "deltasync.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_cli_process_reads_aws_environment(
    s3_server: SeaweedFS, checkpoints: list[tuple[Path, dict[str, Any]]], tmp_path: Path
) -> None:
    url = f"s3://cli/proc-{uuid.uuid4().hex[:8]}"
    with s3_server.store("cli", url.split("/", 3)[3]) as store:
        from deltasync import DeltaUploader

        with DeltaUploader(store) as up:
            up.push(checkpoints[0][1], 3).result(60)
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    ok = _cli("inspect", url, env={**base, **s3_server.env})
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[1].split()[:2] == ["3", "anchor"]
    bad = _cli("inspect", url, env={**base, **s3_server.env, "AWS_SECRET_ACCESS_KEY": "wrong"})
    assert bad.returncode == 1
    assert (
        bad.stderr.startswith(f"store: {url}\nerror: ")
        and "access denied" in bad.stderr
        and "AWS_ACCESS_KEY_ID" in bad.stderr
    )
    assert "Traceback" not in bad.stderr
    gone = _cli("inspect", "s3://cli/x", env={**base, **s3_server.env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    assert gone.returncode == 1 and gone.stderr.startswith(
        "store: s3://cli/x\nerror: s3://cli/x: cannot list 'steps/': no answer from endpoint http://127.0.0.1:9 ("
    )
    assert gone.stderr.endswith(
        "after retries); check that the server is up and the endpoint (AWS_ENDPOINT_URL or endpoint=; for AWS "
        "itself, AWS_REGION)\n"
    )
    # a bucket that is not there: what to check, for every reading command
    endpoint = s3_server.env["AWS_ENDPOINT_URL"]
    for args in (
        ["inspect", "s3://nobucket/r1"],
        ["fetch", "--store", "s3://nobucket/r1", "--out", str(tmp_path / "o")],
    ):
        r = _cli(*args, env={**base, **s3_server.env})
        assert (r.returncode, r.stdout) == (1, ""), r
        assert r.stderr == (
            "store: s3://nobucket/r1\n"
            f"error: s3://nobucket/r1: cannot list 'steps/': bucket 'nobucket' does not exist at {endpoint}; check "
            "the bucket name in the URL and the endpoint (AWS_ENDPOINT_URL or endpoint=; for AWS itself, "
            "AWS_REGION), or create the bucket\n"
        )
    assert not (tmp_path / "o").exists()
