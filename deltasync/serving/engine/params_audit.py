"""Re-hash the parameters an engine worker serves against the step's tensor digests.

The sync proves each tensor bit-exact when it is written. Nothing proves it stays so: a second
writer (another process or library writing into the engine's parameters), or memory corruption,
changes what the engine computes while every manifest is still right. :class:`ParamsAuditor`
reads the engine's parameters back in checkpoint coordinates and hashes them against the manifest:

* where elements go is the model's own loader, traced once (:class:`~deltasync.serving.engine.scatter.ScatterMap`:
  the strided copies each checkpoint name's load does, the fused ``qkv_proj`` and tensor-parallel shards included);
* for each checkpoint name, the node mirror's tensor of the served step is copied, the elements this
  worker's parameters hold are copied over it from the parameters, and the whole is hashed (the
  tensor digest of the manifest's format, a chunk's tensors at once): it equals the manifest's digest
  of the tensor only if the parameters hold the step's bits (and the mirror the rest of the tensor: a
  tensor-parallel rank holds a shard);
* names the loader does not copy plainly (it transforms them) or the manifest has no digest for are
  listed as ``unchecked``.

It runs in chunks (:meth:`ParamsAuditor.chunk`: at most ``max_bytes`` of tensors per call, under the
mirror's lock so no update interleaves), because the engine does not generate during a worker call.
Mismatches are reported (logged, counted in ``deltasync_param_audit_tensors_total{result="mismatch"}``
of the worker's metrics, and in the replica's audit), never repaired here.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from deltasync._util.tensors import digest_tensors
from deltasync.errors import DeltaSyncError
from deltasync.serving.engine.mirror import EngineMirror, Loader
from deltasync.serving.engine.scatter import ScatterMap
from deltasync.serving.worker_api import ParamsChunk

__all__ = ["ParamsAuditor"]

log = logging.getLogger("deltasync.audit")


class ParamsAuditor:
    """One worker's parameter audit: ``model`` (its parameters) and ``load`` (its loader, traced)."""

    def __init__(self, model: torch.nn.Module, load: Loader) -> None:
        self.model = model
        self.load = load
        self._map: ScatterMap | None = None

    def _map_for(self, scatter: Any, view: Any) -> ScatterMap:
        own = getattr(scatter, "map", None)
        if isinstance(own, ScatterMap) and not own.stale(self.model):
            return own
        if self._map is None or self._map.stale(self.model):
            layout = {n: (t.dtype, tuple(t.shape)) for n, t in view.items()}
            self._map = ScatterMap.build(self.model, layout, load=self.load)
        return self._map

    def chunk(self, mirror: EngineMirror, start: int = 0, max_bytes: int = 64 << 20, *, rank: int = 0) -> ParamsChunk:
        """Audit the served tensors from the ``start``-th (by name) until ``max_bytes`` are hashed.

        Returns the worker API's :class:`~deltasync.serving.worker_api.ParamsChunk` of worker ``rank``;
        its ``next`` is the ``start`` of the next chunk (None: done).
        """
        t0 = time.perf_counter()
        with mirror.served_state() as (step, view, scatter):
            if step is None or not view:
                raise DeltaSyncError("this worker serves no step known to deltasync: nothing to audit against")
            manifest = mirror.fetcher.manifest(step)
            digests = manifest.tensor_digests
            smap = self._map_for(scatter, view)
            names = sorted(view)
            nbytes = 0
            unchecked: list[str] = []
            nxt: int | None = None
            bufs: dict[str, torch.Tensor] = {}
            with torch.no_grad():
                for i in range(max(0, start), len(names)):
                    name = names[i]
                    want, segments = digests.get(name), smap.maps.get(name)
                    if want is None or not segments:
                        unchecked.append(name)
                        continue
                    buf = view[name].detach().to("cpu", copy=True).contiguous()
                    for seg in segments:
                        seg.src_view(buf).copy_(seg.dst_view())
                    bufs[name] = buf
                    nbytes += buf.numel() * buf.element_size()
                    if nbytes >= max_bytes and i + 1 < len(names):
                        nxt = i + 1
                        break
            # this chunk's tensors (about max_bytes) hashed at once, in the manifest's format
            got = digest_tensors(bufs, manifest.format_version)
            mismatched = [n for n in bufs if got[n] != digests[n]]
            checked = len(bufs)
        mirror.metrics.observe_param_audit(ok=checked - len(mismatched), mismatched=len(mismatched))
        if mismatched:
            log.error(
                "parameter audit: %d served tensors do not hash to step %s's digests: %s",
                len(mismatched),
                step,
                ", ".join(mismatched[:10]),
            )
        return ParamsChunk(
            rank=rank,
            step=step,
            checked=checked,
            nbytes=nbytes,
            mismatched=tuple(mismatched),
            unchecked=tuple(unchecked),
            next=nxt,
            seconds=time.perf_counter() - t0,
        )
