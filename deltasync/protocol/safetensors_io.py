"""A strict, dependency-free safetensors reader and writer.

We write the bytes ourselves so that patch files are reproducible to the byte
(golden tests) and we read them ourselves so that hostile input can only ever
raise :class:`~deltasync.errors.ProtocolError`. The files are ordinary
safetensors: the ``safetensors`` package and transformers open them as they are.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltasync.errors import ProtocolError
from deltasync.protocol.dtypes import dtype_info

__all__ = ["StEntry", "StFile", "TensorBytes", "encode_header", "parse_safetensors", "to_bytes"]

MAX_HEADER = 100 * 1024 * 1024  # the limit the reference implementation uses


@dataclass(frozen=True, slots=True)
class TensorBytes:
    """One tensor to write: its name, safetensors dtype, shape and raw little-endian bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | bytearray | memoryview | np.ndarray[Any, Any]

    @property
    def nbytes(self) -> int:
        """Number of payload bytes."""
        d = self.data
        return int(d.nbytes) if isinstance(d, (np.ndarray, memoryview)) else len(d)


@dataclass(frozen=True, slots=True)
class StEntry:
    """A tensor located in a parsed file: offsets are absolute within the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class StFile:
    """A parsed safetensors file: entries by name and the ``__metadata__`` map."""

    entries: Mapping[str, StEntry]
    metadata: Mapping[str, str]
    data_start: int


def encode_header(tensors: Sequence[TensorBytes], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length prefix plus the JSON header (space-padded to 8 bytes) for ``tensors``.

    Tensors are laid out in the given order, back to back.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for t in tensors:
        info = dtype_info(t.dtype)
        n = 1
        for s in t.shape:
            n *= s
        if n * info.itemsize != t.nbytes:
            raise ProtocolError(f"tensor {t.name!r}: {t.nbytes} bytes do not match dtype {t.dtype} and shape {t.shape}")
        if t.name in header:
            raise ProtocolError(f"duplicate tensor name {t.name!r}")
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def to_bytes(tensors: Sequence[TensorBytes], metadata: Mapping[str, str] | None = None) -> bytes:
    """A whole safetensors file in memory."""
    parts: list[Any] = [encode_header(tensors, metadata)]
    parts.extend(
        memoryview(t.data).cast("B") if not isinstance(t.data, np.ndarray) else t.data.reshape(-1).view(np.uint8)
        for t in tensors
    )
    return b"".join(parts)


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ProtocolError(f"safetensors header: {what} must be a non-negative integer, got {v!r}")
    return v


_MAGIC = (
    (b"PK\x03\x04", "a zip archive, as torch.save writes .pt/.bin files"),
    (b"GGUF", "a GGUF file"),
    (b"\x93NUMPY", "a NumPy .npy file"),
    (b"\x89HDF", "an HDF5 file"),
)


def _sniff(data: bytes | bytearray | memoryview, lead: str, tail: str = "") -> str:
    """``lead + "it looks like ..." + tail`` when a file's first bytes tell what it is, else ``""``."""
    head = bytes(data[:64])
    what = next((name for magic, name in _MAGIC if head.startswith(magic)), None)
    if what is None and head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        what = "a Python pickle, as an old torch.save writes .pt/.bin files"
    elif what is None and head and all(32 <= c < 127 or c in (9, 10, 13) for c in head):
        what = "a text file"
    return "" if what is None else f"{lead}it looks like {what}{tail}"


def parse_safetensors(
    data: bytes | bytearray | memoryview, *, what: str = "file", not_safetensors: str = "", truncated: str = ""
) -> StFile:
    """Parse and validate a safetensors header against the buffer it came with.

    Every inconsistency (short buffer, bad JSON, unknown dtype, overlapping or
    out-of-range offsets, size not matching shape) is a ProtocolError naming ``what``.
    ``not_safetensors`` / ``truncated``: added to the error of a buffer that is not a safetensors
    file at all / of one cut short (what a caller advises there).
    """
    size = len(data)
    if size < 8:
        raise ProtocolError(f"{what}: not a safetensors file (only {size} bytes{_sniff(data, '; ')}){not_safetensors}")
    (hlen,) = struct.unpack_from("<Q", data, 0)
    if hlen > MAX_HEADER or bytes(data[8:9]) != b"{":  # the spec: the header begins with "{"
        raise ProtocolError(
            f"{what}: not a safetensors file ({_sniff(data, '', '; ')}it does not begin with a header length "
            f"and a JSON header: first bytes {bytes(data[:12])!r}, {size} bytes in all){not_safetensors}"
        )
    if 8 + hlen > size:
        raise ProtocolError(
            f"{what}: truncated safetensors file (a {hlen}-byte header, {size} bytes in all){truncated}"
        )
    try:
        header = json.loads(bytes(data[8 : 8 + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"{what}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"{what}: safetensors header must be a JSON object")
    meta = header.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ProtocolError(f"{what}: safetensors __metadata__ must map strings to strings")
    start = 8 + hlen
    entries: dict[str, StEntry] = {}
    spans: list[tuple[int, int]] = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise ProtocolError(f"{what}: entry {name!r} is not an object")
        dt = info.get("dtype")
        shape = info.get("shape")
        offs = info.get("data_offsets")
        if not isinstance(dt, str):
            raise ProtocolError(f"{what}: entry {name!r} has no dtype")
        itemsize = dtype_info(dt).itemsize
        if not isinstance(shape, list) or not isinstance(offs, list) or len(offs) != 2:
            raise ProtocolError(f"{what}: entry {name!r} needs a shape list and two data_offsets")
        dims = tuple(_int(s, f"shape of {name!r}") for s in shape)
        b, e = (_int(o, f"data_offsets of {name!r}") for o in offs)
        n = 1
        for s in dims:
            n *= s
        if b <= e and (e - b) == n * itemsize and start + e > size:
            raise ProtocolError(
                f"{what}: truncated safetensors file: tensor {name!r} ends at byte {start + e}, "
                f"the file has {size} bytes{truncated}"
            )
        if e < b or start + e > size or (e - b) != n * itemsize:
            raise ProtocolError(
                f"{what}: entry {name!r} spans bytes [{b}, {e}) which do not fit the file "
                f"or its dtype {dt} x shape {list(dims)}"
            )
        spans.append((b, e))
        entries[name] = StEntry(name, dt, dims, start + b, start + e)
    spans.sort()
    pos = 0
    for b, e in spans:
        if b != pos:
            raise ProtocolError(f"{what}: tensor data has holes or overlaps at byte {b}")
        pos = e
    if start + pos != size:
        raise ProtocolError(f"{what}: {size - start - pos} trailing bytes after the last tensor")
    return StFile(entries, meta, start)
