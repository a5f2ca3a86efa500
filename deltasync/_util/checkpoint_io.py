"""Reading safetensors checkpoints (a file, or an HF checkpoint dir) into torch tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from deltasync._util.tensors import require_torch, torch_dtype
from deltasync.errors import ObjectNotFound, ProtocolError
from deltasync.protocol.checkpoint import INDEX_NAME
from deltasync.protocol.dtypes import dtype_info
from deltasync.protocol.safetensors_io import parse_safetensors

if TYPE_CHECKING:
    import torch

__all__ = ["CONVERT_HINT", "checkpoint_files", "load_checkpoint", "save_checkpoint"]

CONVERT_HINT = (
    "deltasync reads safetensors only: save a transformers model with model.save_pretrained(dir, safe_serialization=True) (a .bin "
    "checkpoint: load it with from_pretrained, then save_pretrained), any other torch module with "
    "safetensors.torch.save_model(model, 'model.safetensors'); both keep tied weights, such as Qwen3-0.6B's "
    "embeddings, which safetensors.torch.save_file(torch.load(path), ...) refuses ('Some tensors share memory')"
)
_OTHER_FORMATS = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files making up a checkpoint at ``path`` (file, indexed dir, or dir)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ObjectNotFound(f"{path}: no such checkpoint file or directory")
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"{index}: not a valid safetensors index ({exc})") from None
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ObjectNotFound(f"{index} names missing shards: {missing[:3]}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for ext in _OTHER_FORMATS for p in path.glob(f"*{ext}"))
        found = f"; it holds {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}, not safetensors" if other else ""
        raise ObjectNotFound(
            f"{path}: no *.safetensors files (expected a checkpoint dir or a .safetensors file){found}. {CONVERT_HINT}"
        )
    return files


def load_checkpoint(path: str | Path, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint as CPU torch tensors (writable).

    ``mmap``: map the files copy-on-write instead of reading them into owned memory:
    pages are read when touched and stay in the page cache (no anonymous copy), and
    writes to the tensors never reach the file. The file must not be truncated while
    the tensors are alive.
    """
    torch = require_torch()
    out: dict[str, Any] = {}
    for f in checkpoint_files(Path(path)):
        raw: np.ndarray[Any, Any]
        if mmap and f.stat().st_size > 0:
            raw = np.memmap(f, dtype=np.uint8, mode="c")
        else:
            raw = np.fromfile(f, dtype=np.uint8)
        st = parse_safetensors(
            raw.data,
            what=str(f),
            not_safetensors=f". {CONVERT_HINT}",
            truncated="; an interrupted save or copy? Save or copy it again",
        )
        for e in st.entries.values():
            if e.name in out:
                raise ProtocolError(f"{f}: tensor {e.name!r} appears in more than one shard")
            info = dtype_info(e.dtype)
            bits = raw[e.start : e.end].view(info.bits)
            out[e.name] = torch.from_numpy(bits).view(torch_dtype(e.dtype)).reshape(e.shape)
    return out


def save_checkpoint(state: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write tensors as one safetensors file (atomically: temp file, then rename)."""
    import os

    from deltasync._util.tensors import numpy_bits, st_dtype
    from deltasync.protocol.safetensors_io import TensorBytes, encode_header

    path = Path(path)
    items = [
        TensorBytes(k, st_dtype(v.dtype), tuple(v.shape), numpy_bits(v.detach().cpu().contiguous()))
        for k, v in sorted(state.items())
    ]
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as fh:  # header, then each tensor's bytes as they are: no whole-file copy in memory
        fh.write(encode_header(items, metadata or {"format": "pt"}))
        for t in items:
            data = t.data
            fh.write(data.reshape(-1).view(np.uint8).data if isinstance(data, np.ndarray) else memoryview(data))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path
