"""The wire format, protocol v1 (see SPEC.md). Pure: no I/O, no threads, no torch."""

from deltasync.protocol.audit import AuditPolicy, AuditReport, Divergence
from deltasync.protocol.canonical import FORMAT_VERSION
from deltasync.protocol.chain import (
    ChainWalk,
    Committed,
    FetchPlan,
    PlanStep,
    plan_fetch,
    superseded_by,
    walk_chain,
)
from deltasync.protocol.changes import TensorChange
from deltasync.protocol.checkpoint import anchor_arrays
from deltasync.protocol.digests import xxh3_128
from deltasync.protocol.encoding import EncodedTensor, encode_changes
from deltasync.protocol.entries import AnchorEntry, ByteRange, FileInfo, PatchEntry, Stats, TensorInfo, inventory_digest
from deltasync.protocol.head import Head
from deltasync.protocol.keys import (
    HEAD_KEY,
    WRITERS_PREFIX,
    file_key,
    manifest_key,
    parse_manifest_key,
    parse_writer_key,
    step_prefix,
    writer_file_name,
    writer_folder,
    writer_key,
)
from deltasync.protocol.manifest import Manifest
from deltasync.protocol.patchfile import (
    DecodedEntry,
    build_patch_files,
    check_patch_file,
    decode_patch,
    decode_patch_entry,
    patch_entry_names,
)
from deltasync.protocol.positions import decode_positions
from deltasync.protocol.probes import PROBES_KEY, ProbeSet, Reference, reference_key
from deltasync.protocol.spans import (
    SPAN_OF,
    SPANS_PREFIX,
    parse_span_key,
    span_file_key,
    span_manifest_key,
    span_prefix,
    span_problem,
)
from deltasync.protocol.values import decode_values
from deltasync.protocol.writers import Writer, WriterClaim

__all__ = [
    "FORMAT_VERSION",
    "HEAD_KEY",
    "AnchorEntry",
    "AuditPolicy",
    "AuditReport",
    "ByteRange",
    "ChainWalk",
    "Committed",
    "DecodedEntry",
    "Divergence",
    "EncodedTensor",
    "FetchPlan",
    "FileInfo",
    "Head",
    "Manifest",
    "PatchEntry",
    "PlanStep",
    "PROBES_KEY",
    "ProbeSet",
    "Reference",
    "SPANS_PREFIX",
    "SPAN_OF",
    "Stats",
    "TensorChange",
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
    "parse_span_key",
    "plan_fetch",
    "reference_key",
    "span_file_key",
    "span_manifest_key",
    "span_prefix",
    "span_problem",
    "step_prefix",
    "superseded_by",
    "walk_chain",
    "writer_file_name",
    "writer_folder",
    "writer_key",
    "xxh3_128",
]
