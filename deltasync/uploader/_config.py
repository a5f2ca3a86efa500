"""Uploader options and per-step results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from deltasync._util.retry import RetryPolicy

__all__ = ["CommitInfo", "UploaderConfig", "check_levels"]


@dataclass(frozen=True, slots=True)
class UploaderConfig:
    """Uploader options (all keyword arguments of :class:`DeltaUploader`).

    anchor_every: a full anchor every N pushes (and on the first push, after a
        failed commit, and whenever the tensor inventory changes).
    anchor_bytes_fraction: also an anchor once the patch bytes written since the
        last anchor exceed this fraction of that anchor's size (0 disables).
    cast_dtype: cast floating-point tensors to this torch dtype before diffing
        (fp32 master weights -> bf16 inference weights).
    max_pending: steps waiting for the store before ``on_backlog`` applies.
    on_backlog: "coalesce" folds a new step into the newest waiting one (push
        never blocks on the store; folded steps resolve with kind "skipped", are
        counted in ``DeltaUploader.folded``, and the first is logged as a warning);
        "block" makes push wait until a slot frees.
    shard_bytes: maximum size of one anchor shard / patch file.
    tensor_digests: record the digest of every post-step tensor (xxh3-128; in format 2 a tensor
        over 16 MiB by 16 MiB chunks, SPEC.md "Digests"), which lets fetchers prove bit-exactness;
        costs one hashing pass over changed tensors per step, on the encode threads.
    signing_key: sign manifests with HMAC-SHA256.
    signal_url / signal_token / signal_run: after each commit, tell this signal
        server (publish token; run name, default the run id) from a background
        thread; a down server is logged and counted, never raised.
    encode_threads: threads encoding and diffing the tensors (format 2: groups) of one step in
        parallel; None (default): one per CPU this process may use (``os.sched_getaffinity``).
    defer_diff: push() only copies the state into staging buffers (one memcpy)
        and the bit-wise diff runs in the background. Costs one more copy of the
        weights in memory, on their device; False diffs inside push() instead
        (push takes about 3-4 compare passes, no extra memory).
    retries: extra attempts of each store write of a commit after a transient
        storage error (throttling, 5xx, timeout, partial batch); then the step's
        Future raises CommitFailed and the next push is an anchor.
    retry_backoff: seconds before the first retry, doubling each time (max 30 s).
    distributed: None (default) pushes sharded when torch.distributed is initialized
        with world size > 1: every rank calls push() with its own state dict
        (DTensor shards or replicated tensors; docs/sharded.md). One step
        is in flight at a time (push waits for the previous step's outcome; no
        coalescing; defer_diff applies to each rank's own shards). False forces single-process
        behaviour (e.g. only rank 0 pushes a gathered state); True requires a group.
        Creating the uploader is then a collective call on every rank.
    distributed_timeout: seconds a rank waits for the others in each exchange of a
        sharded push. A step during which the ranks lose contact (a straggler, a dead
        rank) is settled from the store on every rank (committed iff rank 0 wrote its
        manifest); the next push reassembles the group, waiting up to 4x this for late
        ranks, and is an anchor. Keep pushing on every rank.
    span_levels: after every ``n``-th patch since an anchor, for each ``n`` here, also
        write a span squashing those ``n`` patches (SPEC.md "Spans"), so that a replica
        far behind downloads a few spans instead of every patch; written on a background
        thread after the commit, never failing a step. ``()`` disables spans.
    format_version: the manifest format written (SPEC.md "Versioning"): 2 (default) writes the
        inventory compressed, digests by index and the changes of small tensors as groups (a step's
        cost then follows its changed bytes, not its tensor count); 1 for readers older than it.
    keep_anchors: after each committed anchor, garbage-collect the run in the background,
        keeping the last N anchors and what live fetcher leases need (``deltasync gc``); a
        failed gc is logged and counted (``uploader.retention.failures``), never raised. None: off.
    """

    anchor_every: int = 50
    anchor_bytes_fraction: float = 0.5
    cast_dtype: Any = None
    max_pending: int = 4
    on_backlog: Literal["coalesce", "block"] = "coalesce"
    shard_bytes: int = 2 << 30
    tensor_digests: bool = True
    signing_key: bytes | None = None
    encode_threads: int | None = None
    run_id: str | None = None
    defer_diff: bool = True
    signal_url: str | None = None
    signal_token: str | None = None
    signal_run: str | None = None
    retries: int = 4
    retry_backoff: float = 0.5
    distributed: bool | None = None
    distributed_timeout: float = 600.0
    span_levels: tuple[int, ...] = (8, 64)
    keep_anchors: int | None = None
    format_version: int = 2

    def __post_init__(self) -> None:
        if self.format_version not in (1, 2) or isinstance(self.format_version, bool):
            raise ValueError(f"format_version must be 1 or 2, got {self.format_version!r}")
        if self.anchor_every < 1:
            raise ValueError("anchor_every must be >= 1")
        if self.max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        if self.on_backlog not in ("coalesce", "block"):
            raise ValueError("on_backlog must be 'coalesce' or 'block'")
        RetryPolicy(self.retries, self.retry_backoff)  # validates
        if not self.distributed_timeout > 0:
            raise ValueError("distributed_timeout must be > 0")
        object.__setattr__(self, "span_levels", check_levels(self.span_levels))
        if self.keep_anchors is not None and (
            isinstance(self.keep_anchors, bool) or not isinstance(self.keep_anchors, int) or self.keep_anchors < 1
        ):
            raise ValueError(f"keep_anchors must be None or an integer >= 1, got {self.keep_anchors!r}")


@dataclass(frozen=True, slots=True)
class CommitInfo:
    """What happened to one pushed step.

    kind is "anchor" or "patch" when the step was committed as its own step
    (``committed_step == step``), "skipped" when it was not:

    - folded (:attr:`folded`, ``committed_step > step``): the store was behind
      (``on_backlog="coalesce"``) and the step's changes were folded into a later
      step, committed as ``committed_step``. The step itself has no manifest: no
      reader can be brought to exactly it. ``nbytes``, ``changed``, ``total``,
      ``anchor_step``, ``manifest_digest`` and ``seconds`` are those of
      ``committed_step``'s commit (which holds this step's changes), not this step's own.
    - ``committed_step == step`` with ``nbytes == 0``: the step was committed already
      (a restarted uploader re-pushed the store's head); nothing was written.

    ``nbytes`` is the payload written for the committed step.
    """

    step: int
    kind: Literal["anchor", "patch", "skipped"]
    nbytes: int
    changed: int
    total: int
    anchor_step: int
    manifest_digest: str
    committed_step: int
    seconds: float

    @property
    def folded(self) -> bool:
        """True when this step was folded into the later step ``committed_step`` (never committed on its own)."""
        return self.kind == "skipped" and self.committed_step != self.step


def check_levels(levels: Sequence[int]) -> tuple[int, ...]:
    """Validate span levels: increasing, the first >= 2, each a multiple of the one before."""
    out = tuple(levels)
    prev = 1
    for n in out:
        if isinstance(n, bool) or not isinstance(n, int) or n < 2 or n <= prev or n % prev:
            raise ValueError(
                f"span_levels must be increasing integers >= 2, each a multiple of the one before "
                f"(e.g. (4, 16, 64)); got {levels!r}"
            )
        prev = n
    return out
