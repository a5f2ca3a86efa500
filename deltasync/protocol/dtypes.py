"""Fixed-width dtypes by their safetensors names, and the integer view used for bit ops."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deltasync.errors import ProtocolError

__all__ = ["DTYPES", "DType", "dtype_info"]


@dataclass(frozen=True, slots=True)
class DType:
    """A safetensors dtype name, its width in bytes and the signed integer view of its bits."""

    name: str
    itemsize: int

    @property
    def bits(self) -> np.dtype[np.signedinteger]:
        """numpy integer dtype with the same width: elements are compared and XORed as these."""
        return np.dtype({1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[self.itemsize])


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("BOOL", 1),
        DType("U8", 1),
        DType("I8", 1),
        DType("F8_E4M3", 1),
        DType("F8_E5M2", 1),
        DType("I16", 2),
        DType("U16", 2),
        DType("F16", 2),
        DType("BF16", 2),
        DType("I32", 4),
        DType("U32", 4),
        DType("F32", 4),
        DType("I64", 8),
        DType("U64", 8),
        DType("F64", 8),
    )
}


def dtype_info(name: str) -> DType:
    """Look up a safetensors dtype name; unknown names are a ProtocolError."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ProtocolError(f"unsupported dtype {name!r}; protocol v1 supports {', '.join(sorted(DTYPES))}") from None
