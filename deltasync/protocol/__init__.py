"""The wire format, protocol v1 (see SPEC.md). Pure: no I/O, no threads, no torch."""

from deltasync.protocol.chain import Committed, FetchPlan, plan_fetch, superseded_by
from deltasync.protocol.digests import xxh3_128
from deltasync.protocol.encoding import EncodedTensor, decode_positions, decode_values, encode_changes
from deltasync.protocol.keys import (
    HEAD_KEY,
    WRITERS_PREFIX,
    file_key,
    manifest_key,
    parse_manifest_key,
    parse_writer_key,
    step_prefix,
    writer_key,
)
from deltasync.protocol.manifest import (
    FORMAT_VERSION,
    AnchorEntry,
    ByteRange,
    FileInfo,
    Head,
    Manifest,
    PatchEntry,
    Stats,
    TensorInfo,
    Writer,
    WriterClaim,
    inventory_digest,
)

__all__ = [
    "FORMAT_VERSION",
    "HEAD_KEY",
    "AnchorEntry",
    "ByteRange",
    "Committed",
    "EncodedTensor",
    "FetchPlan",
    "FileInfo",
    "Head",
    "Manifest",
    "PatchEntry",
    "Stats",
    "TensorInfo",
    "WRITERS_PREFIX",
    "Writer",
    "WriterClaim",
    "decode_positions",
    "decode_values",
    "encode_changes",
    "file_key",
    "inventory_digest",
    "manifest_key",
    "parse_manifest_key",
    "parse_writer_key",
    "plan_fetch",
    "step_prefix",
    "superseded_by",
    "writer_key",
    "xxh3_128",
]
