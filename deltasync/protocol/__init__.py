"""The wire format, protocol v1 (see SPEC.md). Pure: no I/O, no threads, no torch."""

from deltasync.protocol.chain import Committed, FetchPlan, plan_fetch, superseded_by
from deltasync.protocol.checkpoint import anchor_arrays
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
from deltasync.protocol.patchfile import (
    DecodedEntry,
    build_patch_files,
    check_patch_file,
    decode_patch,
    decode_patch_entry,
    patch_entry_names,
)

__all__ = [
    "FORMAT_VERSION",
    "HEAD_KEY",
    "AnchorEntry",
    "ByteRange",
    "Committed",
    "DecodedEntry",
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
    "anchor_arrays",
    "build_patch_files",
    "check_patch_file",
    "decode_patch",
    "decode_patch_entry",
    "decode_positions",
    "decode_values",
    "encode_changes",
    "file_key",
    "inventory_digest",
    "manifest_key",
    "parse_manifest_key",
    "parse_writer_key",
    "patch_entry_names",
    "plan_fetch",
    "step_prefix",
    "superseded_by",
    "writer_key",
    "xxh3_128",
]
