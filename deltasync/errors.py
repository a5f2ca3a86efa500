"""The one exception tree of deltasync.

Everything deltasync raises on purpose is a :class:`DeltaSyncError`. Where a
builtin exception means the same thing, the class also subclasses it, so
``except FileNotFoundError`` keeps working::

    DeltaSyncError
    ├── StorageError                      a store could not do what was asked
    │   ├── ObjectNotFound                (also FileNotFoundError) no object under that key
    │   │   └── RunNotFound               the store holds no run there (nothing committed, no writer claim)
    │   ├── AlreadyExists                 (also FileExistsError) create-only write hit an existing key
    │   ├── PreconditionFailed            a conditional write lost its race
    │   ├── TransientStorageError         throttling, 5xx, timeout, lost connection, partial batch: retry may succeed
    │   └── InvalidKey                    (also ValueError) key escapes the store or is malformed
    ├── ProtocolError                     (also ValueError) bytes that are not valid protocol v1
    │   ├── UnsupportedVersion            written by a newer (or unknown) format version
    │   └── ObjectTooLarge                an object over its format's size limit, refused before it is read
    ├── ChecksumMismatch                  a file or tensor digest does not match its manifest
    │   └── SignatureMismatch             the manifest's HMAC signature is missing or wrong
    ├── InventoryMismatch                 (also ValueError) target tensors differ from the manifest
    │   └── AdapterMismatch               an adapter's config differs from the run's (or adapters meet full weights)
    ├── UnsupportedAdapter                (also ValueError) a PEFT adapter vLLM cannot serve: refused before any write
    ├── AllocationFailed                  (also MemoryError) the host could not allocate a run's tensor
    ├── ChainBroken                       no path of committed steps leads to the requested step
    ├── CommitFailed                      the uploader's background commit gave up
    │   └── WriterFenced                  another uploader took over the run prefix
    ├── SignalError                       the signal server could not be used (never fatal: the store is the truth)
    │   ├── SignalUnavailable             unreachable, timed out, or a 5xx: retry later or poll the store
    │   ├── SignalRejected                the server refused the request (4xx: bad token, bad input)
    │   │   └── SignalConflict            a commit contradicts the run's recorded history (409)
    │   └── WebhookVerificationError      (also ValueError) a webhook delivery's signature or timestamp is bad
    ├── UpdateRolledBack                  a live engine refused a step; it still serves its previous step, bit-exact
    ├── WorkerNeedsReplacement            a live engine's weights could not be restored: replace the worker
    ├── EngineIncompatible                a live engine's parameters are not the checkpoint's tensors: refused before any load
    ├── UnsafePath                        a local folder or file is not this user's own (owner, mode, symlink): refused
    ├── ServerError                       an engine server (vLLM's HTTP API) answered with an error
    │   ├── ServerUnreachable             no whole answer within the call's deadline: refused, dropped, hung or too slow
    │   ├── MalformedAnswer               (also ValueError) not the API's answer (a ProtocolError too): not JSON, wrong shape, too large
    │   └── PrefixCacheNotReset           the prefix cache could not be reset after an update: the server stays paused
    ├── StalenessTimeout                  (also TimeoutError) the fleet's replicas did not reach a step in time
    └── DemoError                         (also ValueError) `deltasync demo` cannot start as asked

Every class pickles (it carries only its message), so errors cross process
and thread-pool boundaries intact. Where an error crosses a wire (the node leader's socket, an
engine server's HTTP answer), it travels as its class's stable ``code`` (``"update_rolled_back"``)
and its message, and :func:`from_code` makes the same class again on the other side: never a class
name or a substring of the message.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "AdapterMismatch",
    "AllocationFailed",
    "AlreadyExists",
    "ChainBroken",
    "ChecksumMismatch",
    "CommitFailed",
    "DeltaSyncError",
    "DemoError",
    "EngineIncompatible",
    "InvalidKey",
    "InventoryMismatch",
    "MalformedAnswer",
    "ObjectNotFound",
    "ObjectTooLarge",
    "PreconditionFailed",
    "PrefixCacheNotReset",
    "ProtocolError",
    "RunNotFound",
    "ServerError",
    "ServerUnreachable",
    "SignalConflict",
    "SignalError",
    "SignalRejected",
    "SignalUnavailable",
    "SignatureMismatch",
    "StalenessTimeout",
    "StorageError",
    "TransientStorageError",
    "UnsafePath",
    "UnsupportedAdapter",
    "UnsupportedVersion",
    "UpdateRolledBack",
    "WebhookVerificationError",
    "WorkerNeedsReplacement",
    "WriterFenced",
]


class DeltaSyncError(Exception):
    """Base class of every error deltasync raises on purpose."""

    #: the stable name of the class on a wire (each class sets its own; see :func:`from_code`)
    code: ClassVar[str] = "deltasync_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[type[DeltaSyncError], tuple[str]]:
        return (type(self), (self.message,))


class StorageError(DeltaSyncError):
    """A store could not complete an operation (I/O, permissions, network)."""

    code = "storage_error"


class ObjectNotFound(StorageError, FileNotFoundError):
    """No object exists under the requested key."""

    code = "object_not_found"


class RunNotFound(ObjectNotFound):
    """The store holds no run under that URL: no committed step and no writer claim (a typo?)."""

    code = "run_not_found"


class AlreadyExists(StorageError, FileExistsError):
    """A create-only write found an object already under the key."""

    code = "already_exists"


class PreconditionFailed(StorageError):
    """A conditional write's precondition (ETag, generation) did not hold."""

    code = "precondition_failed"


class TransientStorageError(StorageError):
    """The store may succeed later: throttled (429), a 5xx, a timeout, a lost connection or a partial batch
    (after the client's own retries)."""

    code = "transient_storage_error"


class InvalidKey(StorageError, ValueError):
    """A key is empty, absolute, contains ``..`` or otherwise escapes the store."""

    code = "invalid_key"


class ProtocolError(DeltaSyncError, ValueError):
    """Bytes that do not form a valid protocol v1 object (manifest, patch, anchor)."""

    code = "protocol_error"


class UnsupportedVersion(ProtocolError):
    """An object declares a format version this reader does not understand."""

    code = "unsupported_version"


class ObjectTooLarge(ProtocolError):
    """An object is larger than the limit of what it holds (a manifest, ``probes.json``, ...): the store
    refused it from its size (a stat, a HEAD, a ranged read) before reading more than the limit."""

    code = "object_too_large"


class ChecksumMismatch(DeltaSyncError):
    """A file's or tensor's digest differs from the one its manifest records."""

    code = "checksum_mismatch"


class SignatureMismatch(ChecksumMismatch):
    """A manifest's HMAC signature is missing, malformed or made with another key."""

    code = "signature_mismatch"


class InventoryMismatch(DeltaSyncError, ValueError):
    """The target's tensors (names, dtypes, shapes) differ from the manifest's inventory."""

    code = "inventory_mismatch"


class AdapterMismatch(InventoryMismatch):
    """An adapter's config differs from the run's ``adapter_config.json`` (rank, alpha, target modules,
    base model...), or an adapter meets a full-weights run (or the reverse)."""

    code = "adapter_mismatch"


class UnsupportedAdapter(DeltaSyncError, ValueError):
    """A PEFT adapter vLLM cannot serve from an adapter dir (``modules_to_save``, DoRA, trained biases,
    several active adapters, LoRA on ``lm_head``, a non-LoRA method): refused before anything is written."""

    code = "unsupported_adapter"


class AllocationFailed(DeltaSyncError, MemoryError):
    """The host could not allocate a tensor of the run (its size proven by the run's files): the message
    names the tensor, its bytes and the option that bounds what is allocated. Nothing was changed."""

    code = "allocation_failed"


class ChainBroken(DeltaSyncError):
    """No chain of committed steps leads from what we have to the requested step."""

    code = "chain_broken"


class CommitFailed(DeltaSyncError):
    """The uploader's background commit of a step failed; the next push is an anchor."""

    code = "commit_failed"


class WriterFenced(CommitFailed):
    """A newer uploader claimed this run prefix (a higher writer epoch); this one may not commit."""

    code = "writer_fenced"


class StalenessTimeout(DeltaSyncError, TimeoutError):
    """Not enough live replicas of a run served the step asked for within the timeout; the message
    lists who is behind (step, lag, state, last error, last report) and what to do."""

    code = "staleness_timeout"


class SignalError(DeltaSyncError):
    """The signal server could not be used. A hint only: the store stays the source of truth."""

    code = "signal_error"


class SignalUnavailable(SignalError):
    """The signal server is unreachable, timed out or answered 5xx; retry later or poll the store."""

    code = "signal_unavailable"


class SignalRejected(SignalError):
    """The signal server refused a request (4xx: missing or wrong token, malformed input)."""

    code = "signal_rejected"


class SignalConflict(SignalRejected):
    """A published commit contradicts the run's history: an older step, or another digest for a step (409)."""

    code = "signal_conflict"


class WebhookVerificationError(SignalError, ValueError):
    """A webhook delivery's signature is missing or wrong, or its timestamp is outside the replay window."""

    code = "webhook_verification_error"


class UpdateRolledBack(DeltaSyncError):
    """A live engine could not take a step (download, proof or load failed); its weights were put back
    and it still serves its previous step, bit for bit. Retry, or skip to a later step."""

    code = "update_rolled_back"


class WorkerNeedsReplacement(DeltaSyncError):
    """A live engine failed mid-update and its previous weights could not be restored either: it holds
    an unknown mix and must be restarted or replaced (every further update is refused)."""

    code = "worker_needs_replacement"


class EngineIncompatible(DeltaSyncError):
    """A live engine cannot be updated in place: the parameters the run's tensors load into are not
    what it computes with (a quantized engine, linear weights repacked by vLLM's CPU backend). Found
    before anything is loaded; the engine keeps serving what it loaded at start."""

    code = "engine_incompatible"


class UnsafePath(DeltaSyncError):
    """A local folder or file deltasync would use is not this user's own: another owner, group or other
    access, a symbolic link, or a name that leaves its folder (a node mirror's folder, its index's file
    names). Refused before anything is read or written there; the message names the path, what was
    found and the fix."""

    code = "unsafe_path"


class ServerError(DeltaSyncError):
    """An engine server (vLLM's HTTP API, driven by ``deltasync.serving``) answered with an error."""

    code = "server_error"


class ServerUnreachable(ServerError):
    """An engine server gave no whole answer within the call's deadline: the connection was refused or
    dropped, or the server hung or answered too slowly. The server keeps whatever it had."""

    code = "server_unreachable"


class MalformedAnswer(ServerError, ProtocolError):
    """An engine server answered something that is not its API's answer: not JSON, the wrong shape or
    types, or over the size the call allows. Nothing of it is used."""

    code = "malformed_answer"


class PrefixCacheNotReset(ServerError):
    """The prefix cache could not be reset after an update: the server stays paused rather than answer
    from KV computed with the previous weights."""

    code = "prefix_cache_not_reset"


class DemoError(DeltaSyncError, ValueError):
    """``deltasync demo`` cannot start as asked (port taken, web stack missing...)."""

    code = "demo_error"


def _classes() -> dict[str, type[DeltaSyncError]]:
    found: dict[str, type[DeltaSyncError]] = {}
    todo: list[type[DeltaSyncError]] = [DeltaSyncError]
    while todo:
        cls = todo.pop()
        if "code" in cls.__dict__:  # the tree's own classes (a subclass elsewhere travels as its parent)
            found.setdefault(cls.__dict__["code"], cls)
        todo.extend(cls.__subclasses__())
    return found


def error_code(exc: BaseException) -> str:
    """The code ``exc`` crosses a wire with: its class's ``code`` (inherited by subclasses defined
    outside this module), ``"deltasync_error"`` for anything else. (Functions of this module, not in
    ``__all__``, which lists the tree.)"""
    return exc.code if isinstance(exc, DeltaSyncError) else DeltaSyncError.code


def from_code(code: object, message: str) -> DeltaSyncError:
    """The error of ``code`` with ``message``, as raised on the other side of a wire; a code this
    version does not know (a newer peer) gives a :class:`DeltaSyncError`."""
    cls = _classes().get(str(code), DeltaSyncError)
    return cls(message)
