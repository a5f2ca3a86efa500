"""Worker side of ``bench_vllm_pause.py`` (imported by vLLM's workers: ``benchmarks`` is on their path).

:class:`PauseBench` is deltasync's worker extension plus three benchmark methods:

- ``bench_scatter_prepare(prev_dir)``: outside the pause, the changed positions of the step the
  mirror was prepared to (bitwise against the previous step's checkpoint dir) and their values, as a
  decoded patch gives them; builds (once) or refreshes the :class:`ScatterLoader`;
- ``bench_scatter_apply()``: the pause of the scatter path: one ``ScatterLoader`` call;
- ``bench_profile_load()``: where the loader path's pause goes: the same changed tensors through
  ``load_weights`` at once, one by one, and a bare ``copy_`` of the same bytes.
"""

from __future__ import annotations

import glob
import time
from typing import Any

import torch

from deltasync.integrations.vllm.backend import DeltasyncWorkerExtension, _state_of
from deltasync.protocol import TensorChange
from deltasync.serving.engine.scatter import ScatterLoader

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PauseBench(DeltasyncWorkerExtension):
    def _bench_mirror(self) -> dict[str, torch.Tensor]:
        """The tensors of the step the mirror prepared (else of the one it serves), mapped from the node."""
        mirror = _state_of(self).mirror
        assert mirror is not None
        view = mirror.held.prepared_view or mirror.held.served_view
        assert view, "the mirror has no version mapped"
        return view

    def _bench_load(self, pairs: Any) -> Any:
        with torch.no_grad():
            return self.model_runner.model.load_weights(pairs)  # type: ignore[attr-defined]

    def bench_scatter_prepare(self, prev_dir: str) -> dict[str, Any]:
        from safetensors import safe_open

        mirror = self._bench_mirror()
        out: dict[str, Any] = {}
        loader: ScatterLoader | None = getattr(self, "_bench_loader", None)
        t0 = time.perf_counter()
        if loader is None:
            layout = {n: (t.dtype, tuple(t.shape)) for n, t in mirror.items()}
            loader = self._bench_loader = ScatterLoader(self.model_runner.model, layout, self._bench_load)  # type: ignore[attr-defined]
            out["built"] = True
        else:
            out["built"] = loader.refresh()
        out["map_s"] = time.perf_counter() - t0
        out["unmapped"] = dict(loader.map.unmapped)
        items: list[TensorChange] = []
        t0 = time.perf_counter()
        for path in sorted(glob.glob(f"{prev_dir}/*.safetensors")):
            with safe_open(path, "pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if name not in mirror:
                        continue
                    new, old = mirror[name], fh.get_tensor(name)
                    bits = _BITS[new.element_size()]
                    pos = (new.view(bits) != old.view(bits)).view(-1).nonzero().view(-1)
                    if pos.numel():
                        values = new.view(-1)[pos].view(bits).numpy()
                        items.append(TensorChange(name, pos.numpy(), values))
        out["diff_s"] = time.perf_counter() - t0
        self._bench_items = items
        self._bench_view = mirror
        out["tensors"] = len(items)
        out["names"] = [c.tensor for c in items]
        out["elements"] = sum(c.count or 0 for c in items)
        out["total_elements"] = sum(t.numel() for t in mirror.values())
        return out

    def bench_scatter_apply(self, profile: bool = False) -> dict[str, Any]:
        loader: ScatterLoader = self._bench_loader
        prof = None
        if profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        counts = loader(self._bench_items, self._bench_view)
        dt = time.perf_counter() - t0
        out: dict[str, Any] = {"apply_s": dt, "scattered": counts.scattered, "copied": counts.copied}
        out["loaded"] = counts.loaded
        if prof is not None:
            import io
            import pstats

            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(8)
            out["profile"] = text.getvalue()[-3000:]
        self._bench_items = []
        return out

    def bench_profile_load(self, names: list[str]) -> dict[str, Any]:
        """The loader path's pause, taken apart (the engine holds these tensors' bits already: loading
        them again changes nothing)."""
        mirror = self._bench_mirror()
        pairs = [(n, mirror[n]) for n in names]
        t0 = time.perf_counter()
        self._bench_load(iter(pairs))
        whole = time.perf_counter() - t0
        each: dict[str, float] = {}
        for n, t in pairs:
            t0 = time.perf_counter()
            self._bench_load(iter([(n, t)]))
            each[n] = time.perf_counter() - t0
        # a bare copy_ of the same bytes, cache-cold as in the load: every destination first touched,
        # then one timed pass over all of them (the model is far larger than the CPU's caches)
        dsts = [torch.empty_like(t) for _, t in pairs]
        for dst, (_, t) in zip(dsts, pairs, strict=True):
            dst.copy_(t)
        t0 = time.perf_counter()
        for dst, (_, t) in zip(dsts, pairs, strict=True):
            dst.copy_(t)
        copy = time.perf_counter() - t0
        del dsts
        kinds: dict[str, float] = {}
        for n, dt in each.items():
            kind = n.split(".")[-2] if "layers" in n else n
            kinds[kind] = kinds.get(kind, 0.0) + dt
        return {
            "load_weights_s": whole,
            "one_by_one_s": sum(each.values()),
            "bare_copy_s": copy,
            "nbytes": sum(t.numel() * t.element_size() for _, t in pairs),
            "by_kind_s": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        }
