"""Errors a user meets at the command line say what is wrong, name the file or step, and what to
do; the store and the local baseline cache stay at their last good state (real processes)."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import pytest
from test_cli import checkpoints, run

from deltasync.errors import ProtocolError
from deltasync.protocol.safetensors_io import parse_safetensors

torch = pytest.importorskip("torch")


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (to prove nothing changed)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------ not a safetensors file


@pytest.mark.parametrize(
    ("data", "looks_like"),
    [
        (b"PK\x03\x04" + b"\x00" * 60, "zip archive"),
        (pickle.dumps({"w": 1}, protocol=4), "Python pickle"),
        (b"GGUF\x03\x00\x00\x00" + b"\x00" * 32, "GGUF file"),
        (b"this is a text file, not weights\n" * 4, "text file"),
        (b"hello\n", "text file"),
    ],
)
def test_a_file_of_another_format_is_named_as_such(data: bytes, looks_like: str) -> None:
    with pytest.raises(ProtocolError, match="not a safetensors file") as err:
        parse_safetensors(data, what="x/model.bin")
    assert str(err.value).startswith("x/model.bin: not a safetensors file")
    assert looks_like in str(err.value) and "header length" not in str(err.value).split("(")[0]


def test_a_cut_safetensors_file_reads_as_truncated(tmp_path: Path) -> None:
    (ckpt,) = checkpoints(tmp_path, 1)
    whole = ckpt.read_bytes()
    for cut, where in ((40, "-byte header"), (len(whole) - 10, "tensor 'w' ends at byte")):
        with pytest.raises(ProtocolError, match=f"truncated safetensors file.*{where}"):
            parse_safetensors(whole[:cut], what="f")


def test_delta_upload_of_a_non_safetensors_checkpoint_says_how_to_convert(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(4)}, tmp_path / "model.pt")  # a zip archive
    assert zipfile.is_zipfile(tmp_path / "model.pt")
    hf = tmp_path / "hf-dir"
    hf.mkdir()
    (hf / "pytorch_model.bin").write_bytes((tmp_path / "model.pt").read_bytes())
    (hf / "config.json").write_text("{}")
    (tmp_path / "notes.safetensors").write_text("not weights at all\n")
    cases = {
        "model.pt": ("model.pt: not a safetensors file (it looks like a zip archive", "safe_serialization=True"),
        "hf-dir": ("hf-dir: no *.safetensors files", "it holds pytorch_model.bin, not safetensors"),
        "notes.safetensors": ("notes.safetensors: not a safetensors file (it looks like a text file", "save_file"),
    }
    for path, needles in cases.items():
        r = run("delta-upload", path, "--store", "run", "--step", "0", "--cache", "cache", cwd=tmp_path)
        assert r.returncode == 1, r
        assert r.stderr.startswith("error: "), r.stderr
        assert "Traceback" not in r.stderr and "7142837043854339433" not in r.stderr
        for needle in (*needles, "deltasync reads safetensors only"):
            assert needle in r.stderr, (needle, r.stderr)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()  # nothing written
