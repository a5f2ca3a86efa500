#!/usr/bin/env python
"""Payload size and speed of deltasync on a real AdamW update stream (DESIGN.md, "Goals").

Run by hand, from the repository root::

    .venv/bin/python benchmarks/bench_payload.py                      # default: ~166M params, lr 1e-6 and 1e-5
    .venv/bin/python benchmarks/bench_payload.py --hidden 512 --layers 4 --steps 4 --out results.md

What it does, per learning rate (each lr is a fresh model from the same seed, fed the same batches):

1. builds a Qwen3-architecture ``Qwen3ForCausalLM`` from a ``Qwen3Config`` (random init, nothing
   is downloaded) with fp32 master weights and a real ``torch.optim.AdamW``;
2. pushes the bf16 view of the initial weights as step 0 (an anchor: not measured), then trains
   ``warmup + steps`` optimizer steps on random token batches (LM loss); after every step the bf16
   view ``{k: v.detach().to(torch.bfloat16)}`` -- what an inference engine runs -- is pushed
   through a ``DeltaUploader`` over a ``LocalStore`` in a temp dir (``anchor_every`` huge, so every
   measured step is a patch), and a ``DeltaFetcher(verify=True)`` syncs a separate copy one step
   forward; the copy is then checked to be bit-identical to the pushed state;
3. the first ``warmup`` patch steps are dropped (cold caches, Adam's first steps); every reported
   number is a median over the remaining steps.

Reference passes are timed directly on the same data, right after each step: one bitwise compare
pass over all bf16 bit views (``torch.ne`` and chunked ``np.not_equal``, both into preallocated
masks; the faster one is the reference), a memcpy of all weights (``torch.clone`` and ``np.copyto``
into preallocated buffers; the faster is the reference), ``deltasync.protocol.encode_changes`` on
the same (positions, old bits, new bits) the uploader saw (one thread, and a pool the size of the
uploader's ``encode_threads``), and a memcpy of the changed bytes.

The entropy bound for (positions, new value given old value) is, per step,
``sum_t n_t * H2(changed_t / n_t)`` bits (positions as iid Bernoulli per tensor) plus
``changed * H(XOR(old, new))`` bits (empirical entropy of the uint16 XOR masks pooled over all
changed elements), divided by 8 and by ``changed``.

The timing breakdowns wrap a few deltasync functions with timers for the duration of a run
(benchmark-only instrumentation, restored afterwards; ~1 us per call); a name that no longer
exists is reported as "n/a" instead of failing the run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

import deltasync as ds
from deltasync.protocol import encode_changes, kernels

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _codec_side_by_side as side_by_side  # noqa: E402

Bits = np.ndarray[Any, np.dtype[Any]]

CHUNK = 1 << 21  # elements per chunk of the numpy compare pass (as the uploader's CPU diff)
QWEN3_06B_PARAMS = 0.6e9  # the DESIGN.md end-to-end goal is stated for a 0.6B-parameter state
_ABSENT = object()
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ------------------------------------------------------------------ config


@dataclass(frozen=True)
class BenchConfig:
    """Everything one benchmark run depends on (defaults: ~166M params, a few minutes on 2 cores)."""

    hidden: int = 1024
    layers: int = 8
    intermediate: int = 3072
    vocab: int = 32000
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 64
    tie_embeddings: bool = False
    batch: int = 2
    seq: int = 64
    steps: int = 6
    warmup: int = 2
    lrs: tuple[float, ...] = (1e-6, 1e-5)
    weight_decay: float = 0.01
    adamw: str = "fused"  # "fused" | "foreach" | "for-loop"
    seed: int = 0
    threads: int | None = None
    encode_threads: int = 2
    tmpdir: str | None = None


# ------------------------------------------------------------------ records


@dataclass
class StepRecord:
    """Everything measured for one pushed patch step."""

    lr: float
    step: int
    warmup: bool
    changed: int
    total: int
    nbytes: int  # CommitInfo.nbytes (patch files as written)
    pos_bytes: int  # position blobs of encode_changes on the same data
    val_bytes: int  # value blobs
    pos_bound_bits: float
    val_bound_bits: float  # pooled empirical entropy of the XOR masks, as the bound is defined
    val_bound_tensor_bits: float  # per-tensor empirical entropies (informational, tighter)
    pos_ctx_bits: float  # positions iid per (tensor, exponent of the old value) (informational)
    val_ctx_bits: float  # H(XOR | exponent of the old value), pooled (informational)
    codings: dict[str, int]
    t_train: float
    t_cast: float
    t_push: float
    t_background: float  # push() return -> Future resolved
    t_commit: float  # CommitInfo.seconds
    t_fetch: float
    t_e2e: float  # push() call -> fetcher.sync() returned
    t_cmp_torch: float
    t_cmp_numpy: float
    t_memcpy_clone: float
    t_memcpy_copyto: float
    t_memcpy_changed: float
    t_encode_1: float
    t_encode_pool: float
    t_diff_nz: float  # replica of the uploader's CPU diff: chunked compare + flatnonzero
    t_diff_gather: float  # old = base[idx], new = state[idx]
    t_diff_scatter: float  # base[idx] = new
    t_enc_rice: float
    t_enc_xor_rank: float
    t_enc_dense_trials: float  # dense-fallback trials (tensors with > 1/8 changed), one thread
    n_dense_trials: int
    phases: dict[str, float] = field(default_factory=dict)
    codec: dict[str, float] = field(default_factory=dict)  # _codec_side_by_side.measure

    @property
    def density(self) -> float:
        return self.changed / self.total

    @property
    def ds_bpc(self) -> float:
        return self.nbytes / self.changed

    @property
    def bound_bpc(self) -> float:
        return (self.pos_bound_bits + self.val_bound_bits) / 8 / self.changed

    @property
    def t_cmp(self) -> float:
        return min(self.t_cmp_torch, self.t_cmp_numpy)

    @property
    def t_memcpy(self) -> float:
        return min(self.t_memcpy_clone, self.t_memcpy_copyto)


@dataclass
class BenchResult:
    """All records of a run plus what is needed to render them."""

    config: BenchConfig
    env: dict[str, str]
    params: int
    records: list[StepRecord]
    wall_s: float = 0.0
    command: str = ""

    def measured(self, lr: float) -> list[StepRecord]:
        return [r for r in self.records if r.lr == lr and not r.warmup]


# ------------------------------------------------------------------ helpers


def _bits(t: torch.Tensor) -> torch.Tensor:
    """1-D signed-integer view of a contiguous tensor's bits (shared memory)."""
    return t.detach().reshape(-1).view(_INT_OF_WIDTH[t.element_size()])


def _h2(p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def _entropy_bits(values: Bits) -> float:
    """``len(values) * H`` for the empirical distribution of uint16 values."""
    if values.size == 0:
        return 0.0
    counts = np.bincount(values.view(np.uint16), minlength=1 << 16)
    p = counts[counts > 0] / values.size
    return float(-(p * np.log2(p)).sum() * values.size)


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Phases:
    """Accumulates wall time of calls to wrapped functions (benchmark-only instrumentation).

    ``wrap(owner, attr, label)`` replaces ``owner.attr`` by a timing wrapper until :meth:`restore`.
    Threads add up: a label's total is the sum over all calls, whichever thread made them.
    """

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.missing: list[str] = []
        self._undo: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        try:
            static = inspect.getattr_static(owner, attr)
        except AttributeError:
            self.missing.append(label)
            return
        orig = getattr(owner, attr)
        acc, lock = self.acc, self._lock

        @functools.wraps(orig)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                with lock:
                    acc[label] += dt

        own = vars(owner) if hasattr(owner, "__dict__") else {}
        self._undo.append((owner, attr, own.get(attr, _ABSENT)))
        setattr(owner, attr, staticmethod(timed) if isinstance(static, staticmethod) else timed)

    def take(self) -> dict[str, float]:
        with self._lock:
            out = dict(self.acc)
            self.acc.clear()
        return out

    def restore(self) -> None:
        for owner, attr, orig in reversed(self._undo):
            if orig is _ABSENT:
                delattr(owner, attr)  # an instance attribute that shadowed the class's method
            else:
                setattr(owner, attr, orig)
        self._undo.clear()


def _instrument(phases: Phases, up: Any, fetcher: Any, up_store: Any, fetch_store: Any) -> None:
    """Wrap the functions whose time the breakdown table reports (names as of deltasync 0.1)."""
    import deltasync.fetcher._download as freader
    import deltasync.fetcher._execute as fexecute
    import deltasync.protocol.patchfile as fpatch
    import deltasync.uploader._commit_step as ucommit
    import deltasync.uploader._snapshot as usnap

    snaps = up._snapshots  # the uploader's baseline owner (deltasync/uploader/_snapshot.py)
    # push() (caller thread)
    phases.wrap(snaps, "cast", "push.prepare")
    phases.wrap(snaps, "inventory_of", "push.inventory")
    phases.wrap(snaps, "stage", "push.stage")
    # background (digest thread, commit thread, encode pool)
    phases.wrap(usnap, "diff_tensor", "bg.diff")
    phases.wrap(snaps, "digest", "bg.tensor_digests")
    phases.wrap(ucommit, "build_patch", "bg.build_patch")
    phases.wrap(ucommit, "xxh3_128", "bg.file_xxh3")
    phases.wrap(up_store, "put_many", "bg.store_put_files")
    phases.wrap(up_store, "put", "bg.store_put_manifest_head")
    # fetcher.sync() (caller thread)
    phases.wrap(fetcher.reader, "chain", "fetch.manifests")
    phases.wrap(fetch_store, "get_many", "fetch.store_read")
    phases.wrap(freader, "xxh3_128", "fetch.file_xxh3")
    phases.wrap(fexecute, "decode_patch_groups", "fetch.decode")
    phases.wrap(fpatch, "decode_positions", "fetch.decode_positions")
    phases.wrap(fpatch, "decode_values", "fetch.decode_values")
    phases.wrap(fexecute, "apply_changes", "fetch.apply_patch")
    phases.wrap(fexecute, "check_digests", "fetch.verify_digests")


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def environment(cfg: BenchConfig) -> dict[str, str]:
    """What the numbers ran on."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count() or 0
    import transformers

    return {
        "device": f"CPU ({cpu}); os.cpu_count()={os.cpu_count()}, usable cores={affinity}",
        "threads": f"torch intra-op {torch.get_num_threads()}, inter-op {torch.get_num_interop_threads()}; "
        f"numpy single-threaded; deltasync encode_threads={cfg.encode_threads}",
        "versions": f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
        f"transformers {transformers.__version__}, deltasync {ds.__version__}",
    }


# ------------------------------------------------------------------ model


def build_model(cfg: BenchConfig) -> Any:
    """A randomly initialised Qwen3ForCausalLM in fp32 (nothing downloaded)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    mcfg = Qwen3Config(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=max(512, cfg.seq),
        use_cache=False,
    )
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(mcfg)
    bad = {str(p.dtype) for p in model.parameters() if p.dtype != torch.float32}
    if bad:
        raise RuntimeError(f"expected fp32 master weights, got {bad}")
    model.train()
    return model


def make_optimizer(model: Any, cfg: BenchConfig, lr: float) -> torch.optim.Optimizer:
    kw: dict[str, Any] = {"lr": lr, "weight_decay": cfg.weight_decay}
    if cfg.adamw == "fused":
        kw["fused"] = True
    elif cfg.adamw == "foreach":
        kw["foreach"] = True
    elif cfg.adamw == "for-loop":
        kw["foreach"] = False
    else:
        raise ValueError(f"unknown --adamw {cfg.adamw!r}")
    return torch.optim.AdamW(model.parameters(), **kw)


def bf16_view(model: Any) -> dict[str, torch.Tensor]:
    """The inference weights: bf16 copies of the fp32 master weights."""
    return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ references


class References:
    """Reference passes over the previous and the new bf16 state, with preallocated buffers.

    ``prev`` holds the previous pushed state's bits; :meth:`measure` times the reference passes
    against ``new`` and leaves ``prev`` equal to ``new`` (its scatter is the diff replica's).
    """

    def __init__(self, state: dict[str, torch.Tensor], encode_threads: int) -> None:
        self.names = sorted(state)
        self.prev = {k: _bits(state[k]).clone().numpy() for k in self.names}
        self.numel = {k: int(v.size) for k, v in self.prev.items()}
        biggest = max(self.numel.values())
        self.mask_t = torch.empty(biggest, dtype=torch.bool)
        self.mask_np = np.empty(min(CHUNK, biggest), dtype=bool)
        # one destination of the largest tensor's size, reused (holding a second full copy of a 0.6B
        # state next to everything else does not fit in small machines); faulted in once
        self.dst = np.ones(max(v.nbytes for v in self.prev.values()), dtype=np.uint8)
        self.pool = ThreadPoolExecutor(max(1, encode_threads), thread_name_prefix="bench-encode")
        self.changed_buf = np.empty(0, dtype=np.uint8)

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def compare_torch(self, new: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        for k in self.names:
            a = torch.from_numpy(self.prev[k])
            torch.ne(a, _bits(new[k]), out=self.mask_t[: a.numel()])
        return time.perf_counter() - t0

    def compare_numpy(self, new_np: dict[str, Bits]) -> float:
        t0 = time.perf_counter()
        m = self.mask_np
        for k in self.names:
            a, b = self.prev[k], new_np[k]
            for s in range(0, a.size, CHUNK):
                e = min(s + CHUNK, a.size)
                np.not_equal(a[s:e], b[s:e], out=m[: e - s])
        return time.perf_counter() - t0

    def memcpy_clone(self, new: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        for k in self.names:
            c = new[k].clone()  # allocate + copy, as a snapshot would; dropped right away to bound memory
            del c
        return time.perf_counter() - t0

    def memcpy_copyto(self, new_np: dict[str, Bits]) -> float:
        t0 = time.perf_counter()
        for k in self.names:
            src = new_np[k].view(np.uint8)
            np.copyto(self.dst[: src.size], src)
        return time.perf_counter() - t0

    def memcpy_changed(self, nbytes: int) -> float:
        if self.changed_buf.size < nbytes:
            self.changed_buf = np.ones(nbytes, dtype=np.uint8)
        src = self.changed_buf[:nbytes]
        dst = np.empty_like(src)
        np.copyto(dst, src)  # fault dst in; the timed copy below is a pure memcpy
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - t0)
        return best

    def diff(self, new_np: dict[str, Bits]) -> tuple[dict[str, tuple[Bits, Bits, Bits]], float, float, float]:
        """Replica of the uploader's CPU diff, phase by phase; updates ``prev`` to ``new``."""
        t_nz = t_gather = t_scatter = 0.0
        changes: dict[str, tuple[Bits, Bits, Bits]] = {}
        m = self.mask_np
        for k in self.names:
            b, n = self.prev[k], new_np[k]
            t0 = time.perf_counter()
            parts = []
            for s in range(0, b.size, CHUNK):
                e = min(s + CHUNK, b.size)
                mm = m[: e - s]
                np.not_equal(b[s:e], n[s:e], out=mm)
                hit = np.flatnonzero(mm)
                if hit.size:
                    parts.append(hit + s)
            idx = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
            t1 = time.perf_counter()
            if idx.size:
                old, vals = b[idx], n[idx]
                t2 = time.perf_counter()
                b[idx] = vals
                t3 = time.perf_counter()
                changes[k] = (idx.astype(np.int64, copy=False), old, vals)
                t_gather += t2 - t1
                t_scatter += t3 - t2
            t_nz += t1 - t0
        return changes, t_nz, t_gather, t_scatter

    def encode(self, changes: dict[str, tuple[Bits, Bits, Bits]], pooled: bool) -> tuple[float, list[Any]]:
        names = sorted(changes)

        def enc(k: str) -> Any:
            idx, old, new = changes[k]
            return encode_changes(self.numel[k], idx, old, new)

        t0 = time.perf_counter()
        out = list(self.pool.map(enc, names)) if pooled and len(names) > 1 else [enc(k) for k in names]
        return time.perf_counter() - t0, out


def _encode_parts(
    numel: dict[str, int], changes: dict[str, tuple[Bits, Bits, Bits]]
) -> tuple[float, float, float, int]:
    """One thread: time of Rice positions, of XOR-rank values, and of the dense-fallback trials
    (``encode_changes`` XOR-rank-codes the whole tensor when more than half of it changed), and
    how many tensors got such a trial. Replicates encode_changes' steps (deltasync 0.1)."""
    from deltasync.protocol import encoding as enc

    rice, xrank = getattr(enc, "_encode_positions", None), getattr(enc, "_encode_xor_rank", None)
    values = getattr(enc, "_encode_values", None)  # the kernels' entry point (deltasync >= 0.2)
    if rice is None or xrank is None:
        return float("nan"), float("nan"), float("nan"), 0
    t_rice = t_x = t_dense = 0.0
    n_dense = 0
    for k, (idx, old, new) in changes.items():
        t0 = time.perf_counter()
        rice(idx)
        t1 = time.perf_counter()
        xor = old ^ new
        values(old, new) if values is not None else xrank(xor)
        t2 = time.perf_counter()
        t_rice += t1 - t0
        t_x += t2 - t1
        if idx.size * 2 > numel[k]:
            dense = np.zeros(numel[k], dtype=xor.dtype)
            dense[idx] = xor
            xrank(dense)
            t_dense += time.perf_counter() - t2
            n_dense += 1
    return t_rice, t_x, t_dense, n_dense


def exponent_histograms(prev: dict[str, Bits]) -> dict[str, Bits]:
    """Per tensor, how many elements have each bf16 exponent (the receiver knows these: old weights)."""
    return {k: np.bincount((v.view(np.uint16) >> 7) & 0xFF, minlength=256) for k, v in prev.items()}


def context_bound(hist: dict[str, Bits], changes: dict[str, tuple[Bits, Bits, Bits]]) -> tuple[float, float]:
    """(position bits, value bits) when both are modelled given the old value's exponent.

    Informational: the receiver holds the old weights, so a coder may use them as context; the
    chance that an element changes depends on |update| / ulp(old), and the ulp is the exponent.
    """
    pos_bits = 0.0
    joint = np.zeros(256 << 16, dtype=np.int64)
    for k, (_, old, new) in changes.items():
        e = (old.view(np.uint16) >> 7) & 0xFF
        ch = np.bincount(e, minlength=256)
        n = hist[k]
        nz = n > 0
        p = ch[nz] / n[nz]
        q = p[(p > 0) & (p < 1)]
        nn = n[nz][(p > 0) & (p < 1)]
        pos_bits += float(-(nn * (q * np.log2(q) + (1 - q) * np.log2(1 - q))).sum())
        joint += np.bincount((e.astype(np.int64) << 16) | (old ^ new).view(np.uint16), minlength=256 << 16)
    c = joint[joint > 0].astype(np.float64)
    marg = joint.reshape(256, 1 << 16).sum(axis=1)
    m = marg[marg > 0].astype(np.float64)
    val_bits = float(-(c * np.log2(c)).sum() + (m * np.log2(m)).sum())
    return pos_bits, val_bits


def entropy_bound(numel: dict[str, int], changes: dict[str, tuple[Bits, Bits, Bits]]) -> tuple[float, float, float]:
    """(position bits, pooled value bits, per-tensor value bits) of the bound."""
    pos_bits = sum(numel[k] * _h2(c[0].size / numel[k]) for k, c in changes.items())
    xors = [(old ^ new).view(np.uint16) for _, old, new in changes.values()]
    pooled = _entropy_bits(np.concatenate(xors)) if xors else 0.0
    per_tensor = sum(_entropy_bits(x) for x in xors)
    return pos_bits, pooled, per_tensor


# ------------------------------------------------------------------ the run


def run_lr(cfg: BenchConfig, lr: float, log: Callable[[str], None]) -> tuple[int, list[StepRecord]]:
    """Train, push, fetch and measure one learning rate; returns (params, records)."""
    model = build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, cfg, lr)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    root = tempfile.mkdtemp(prefix="deltasync-bench-", dir=cfg.tmpdir)
    records: list[StepRecord] = []
    phases = Phases()
    refs: References | None = None
    up = None
    try:
        store = ds.open_store(root)
        fetch_store = ds.open_store(root)
        up = ds.DeltaUploader(
            store,
            anchor_every=1 << 30,
            anchor_bytes_fraction=0.0,
            on_backlog="block",
            cast_dtype=torch.bfloat16,
            encode_threads=cfg.encode_threads,
        )
        fetcher = ds.DeltaFetcher(fetch_store, verify=True)
        state = bf16_view(model)
        info = up.push(state, step=0).result()
        if info.kind != "anchor":
            raise RuntimeError(f"step 0 should be an anchor, got {info.kind}")
        replica = {k: v.clone() for k, v in state.items()}  # the inference side's copy
        fetcher.sync(replica, step=0)
        refs = References(state, cfg.encode_threads)
        _instrument(phases, up, fetcher, store, fetch_store)
        for step in range(1, cfg.warmup + cfg.steps + 1):
            warm = step <= cfg.warmup
            x = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
            t0 = time.perf_counter()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t_train = time.perf_counter() - t0
            t0 = time.perf_counter()
            state = bf16_view(model)
            t_cast = time.perf_counter() - t0
            phases.take()

            # ---- the pipeline under test: push -> commit -> fetch+verify+apply
            t0 = time.perf_counter()
            fut = up.push(state, step=step)
            t1 = time.perf_counter()
            info = fut.result()
            t2 = time.perf_counter()
            fetcher.sync(replica, step=step)
            t3 = time.perf_counter()
            ph = phases.take()
            if info.kind != "patch" or info.step != step:
                raise RuntimeError(f"step {step}: expected a committed patch, got {info}")
            bad = [k for k in state if not torch.equal(_bits(replica[k]), _bits(state[k]))]
            if bad:
                raise RuntimeError(f"step {step}: fetched copy is not bit-identical: {bad[:5]}")

            # ---- reference passes on the same data
            new_np = {k: _bits(state[k]).numpy() for k in refs.names}
            t_cmp_torch = refs.compare_torch(state)
            t_cmp_numpy = refs.compare_numpy(new_np)
            t_clone = refs.memcpy_clone(state)
            t_copyto = refs.memcpy_copyto(new_np)
            hist = exponent_histograms(refs.prev)
            changes, t_nz, t_gather, t_scatter = refs.diff(new_np)
            changed = sum(c[0].size for c in changes.values())
            if changed != info.changed:
                raise RuntimeError(f"step {step}: harness sees {changed} changed elements, uploader {info.changed}")
            t_enc1, encoded = refs.encode(changes, pooled=False)
            t_encp, _ = refs.encode(changes, pooled=True)
            t_rice, t_xrank, t_dense, n_dense = _encode_parts(refs.numel, changes)
            codec = {} if warm else side_by_side.measure(refs.numel, changes, refs.prev)
            pos_bits, val_bits, val_bits_t = entropy_bound(refs.numel, changes)
            pos_ctx, val_ctx = context_bound(hist, changes)
            itemsize = state[refs.names[0]].element_size()
            rec = StepRecord(
                lr=lr,
                step=step,
                warmup=warm,
                changed=changed,
                total=info.total,
                nbytes=info.nbytes,
                pos_bytes=sum(len(e.pos_blob) for e in encoded),
                val_bytes=sum(len(e.val_blob) for e in encoded),
                pos_bound_bits=pos_bits,
                val_bound_bits=val_bits,
                val_bound_tensor_bits=val_bits_t,
                pos_ctx_bits=pos_ctx,
                val_ctx_bits=val_ctx,
                codings=dict(Counter(f"{e.positions}/{e.values}" for e in encoded)),
                t_train=t_train,
                t_cast=t_cast,
                t_push=t1 - t0,
                t_background=t2 - t1,
                t_commit=info.seconds,
                t_fetch=t3 - t2,
                t_e2e=t3 - t0,
                t_cmp_torch=t_cmp_torch,
                t_cmp_numpy=t_cmp_numpy,
                t_memcpy_clone=t_clone,
                t_memcpy_copyto=t_copyto,
                t_memcpy_changed=refs.memcpy_changed(changed * itemsize),
                t_encode_1=t_enc1,
                t_encode_pool=t_encp,
                t_diff_nz=t_nz,
                t_diff_gather=t_gather,
                t_diff_scatter=t_scatter,
                t_enc_rice=t_rice,
                t_enc_xor_rank=t_xrank,
                t_enc_dense_trials=t_dense,
                n_dense_trials=n_dense,
                phases=ph,
                codec=codec,
            )
            records.append(rec)
            del changes, encoded, new_np
            log(
                f"lr={lr:g} step {step}{' (warm-up)' if warm else ''}: loss {loss.item():.3f} "
                f"density {rec.density:.4f} {rec.ds_bpc:.3f} B/chg (bound {rec.bound_bpc:.3f}) "
                f"train {t_train:.1f}s push {rec.t_push * 1e3:.0f}ms cmp {rec.t_cmp * 1e3:.0f}ms "
                f"bg {rec.t_background * 1e3:.0f}ms fetch {rec.t_fetch * 1e3:.0f}ms e2e {rec.t_e2e * 1e3:.0f}ms"
            )
        if phases.missing:
            log(f"note: not instrumented (renamed?): {', '.join(phases.missing)}")
    finally:
        phases.restore()
        if up is not None:
            up.close()
        if refs is not None:
            refs.close()
        shutil.rmtree(root, ignore_errors=True)
        del model, opt
        gc.collect()
    return params, records


def run(cfg: BenchConfig, *, quiet: bool = False) -> BenchResult:
    """The benchmark's core: every lr of ``cfg``; returns all per-step records."""
    if cfg.steps < 1 or cfg.warmup < 0:
        raise ValueError("need steps >= 1 and warmup >= 0")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    log = functools.partial(_log, quiet=quiet)
    env = environment(cfg)
    for v in env.values():
        log(v)
    records: list[StepRecord] = []
    params = 0
    for lr in cfg.lrs:
        params, recs = run_lr(cfg, lr, log)
        records.extend(recs)
    return BenchResult(cfg, env, params, records, wall_s=time.perf_counter() - t0)


# ------------------------------------------------------------------ report


def _f(x: float, nd: int = 3) -> str:
    return "n/a" if x != x else f"{x:.{nd}f}"  # noqa: PLR0124 - NaN check


def _ms(x: float) -> str:
    return "n/a" if x != x else (f"{x * 1e3:.1f}" if x < 10 else f"{x * 1e3:.0f}")  # noqa: PLR0124


def _goal(ok: bool) -> str:
    return "ok" if ok else "MISS"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _section(title: str, header: Sequence[str], body: Sequence[Sequence[str]], caption: str) -> list[str]:
    return ["", f"### {title}", "", _table(header, body), "", caption]


def render(res: BenchResult) -> str:
    """The markdown report: setup, per-step payload table, medians, breakdowns."""
    cfg = res.config
    total = res.records[0].total if res.records else 0
    out: list[str] = []
    out.append("## deltasync payload benchmark")
    out.append("")
    if res.command:
        out.append(f"Command: `{res.command}`  ")
    out.append(
        f"Model: Qwen3ForCausalLM (random init) hidden {cfg.hidden}, {cfg.layers} layers, intermediate "
        f"{cfg.intermediate}, "
        f"vocab {cfg.vocab}, heads {cfg.heads}/{cfg.kv_heads} kv, head_dim {cfg.head_dim}, tied embeddings "
        f"{cfg.tie_embeddings}: "
        f"{res.params / 1e6:.1f}M params, {total / 1e6:.1f}M bf16 elements pushed ({total * 2 / 2**20:.0f} MiB).  "
    )
    out.append(
        f"Training: AdamW ({cfg.adamw}), fp32 master weights, weight_decay {cfg.weight_decay}, random tokens batch "
        f"{cfg.batch} x seq "
        f"{cfg.seq}, LM loss; each lr starts from the same init. Step 0 (anchor) and {cfg.warmup} warm-up patch "
        "step(s) excluded; "
        f"{cfg.steps} measured step(s) per lr; medians across them.  "
    )
    for k, v in res.env.items():
        out.append(f"{k.capitalize()}: {v}.  ")
    if res.wall_s:
        out.append(f"Wall time of the whole run: {res.wall_s:.0f} s.")
    out.append("")

    # per-step payload
    out.append("### Payload per step (bytes per changed element)")
    out.append("")
    hdr = [
        "lr",
        "step",
        "density",
        "deltasync",
        "int32+bf16",
        "full bf16",
        "entropy bound",
        "ds / bound (<=1.15)",
        "(int32+bf16) / ds (>=4.5)",
    ]
    rows = []
    for r in res.records:
        if r.warmup:
            continue
        rows.append(
            [
                f"{r.lr:g}",
                str(r.step),
                f"{r.density:.2%}",
                _f(r.ds_bpc),
                "6.000",
                _f(2 * r.total / r.changed, 1),
                _f(r.bound_bpc),
                _f(r.ds_bpc / r.bound_bpc, 3),
                _f(6 / r.ds_bpc, 2),
            ]
        )
    out.append(_table(hdr, rows))
    out.append("")

    # medians
    out.append("### Payload, medians per lr")
    out.append("")
    rows = []
    for lr in cfg.lrs:
        m = res.measured(lr)
        if not m:
            continue
        rb = _median([r.ds_bpc / r.bound_bpc for r in m])
        ri = _median([6 / r.ds_bpc for r in m])
        rows.append(
            [
                f"{lr:g}",
                f"{_median([r.density for r in m]):.2%}",
                _f(_median([r.ds_bpc for r in m])),
                "6.000",
                _f(_median([2 * r.total / r.changed for r in m]), 1),
                _f(_median([r.bound_bpc for r in m])),
                f"{_f(rb)} {_goal(rb <= 1.15)}",
                f"{_f(ri, 2)} {_goal(ri >= 4.5)}",
            ]
        )
    out.append(
        _table(
            [
                "lr",
                "density",
                "deltasync B/chg",
                "int32+bf16 B/chg",
                "full bf16 B/chg",
                "entropy bound B/chg",
                "ds / bound (<=1.15)",
                "(int32+bf16) / ds (>=4.5)",
            ],
            rows,
        )
    )
    out.append("")

    out.append("### Payload breakdown, medians per lr (bytes per changed element)")
    out.append("")
    rows = []
    for lr in cfg.lrs:
        m = res.measured(lr)
        if not m:
            continue
        mix = ", ".join(f"{k}: {v}" for k, v in sorted(m[-1].codings.items()))
        rows.append(
            [
                f"{lr:g}",
                _f(_median([r.pos_bytes / r.changed for r in m])),
                _f(_median([r.pos_bound_bits / 8 / r.changed for r in m])),
                _f(_median([r.val_bytes / r.changed for r in m])),
                _f(_median([r.val_bound_bits / 8 / r.changed for r in m])),
                _f(_median([r.val_bound_tensor_bits / 8 / r.changed for r in m])),
                _f(_median([(r.nbytes - r.pos_bytes - r.val_bytes) / r.changed for r in m]), 4),
                _f(_median([r.pos_ctx_bits / 8 / r.changed for r in m])),
                _f(_median([r.val_ctx_bits / 8 / r.changed for r in m])),
                _f(_median([(r.pos_ctx_bits + r.val_ctx_bits) / 8 / r.changed for r in m])),
                mix,
            ]
        )
    out.append(
        _table(
            [
                "lr",
                "positions: ds",
                "positions: bound",
                "values: ds",
                "values: bound (pooled H)",
                "values: per-tensor H (info)",
                "container (file headers; manifest not counted)",
                "positions given old exponent (info)",
                "values given old exponent (info)",
                "bound given old exponent (info)",
                "codings (last step)",
            ],
            rows,
        )
    )
    out.append("")
    out.append(
        "deltasync bytes = CommitInfo.nbytes (the patch files); positions/values = blob sizes of encode_changes on "
        "the same "
        "data; container = the rest (safetensors headers). The 'given old exponent' columns are an informational, "
        "tighter "
        "bound: positions iid per (tensor, bf16 exponent of the old value) and H(XOR | old exponent); the receiver "
        "holds "
        "the old weights, so a coder may condition on them."
    )
    out.append("")

    # timing
    out.append("### Timing, medians per lr (ms; ratios are medians of per-step ratios)")
    out.append("")
    rows = []
    for lr in cfg.lrs:
        m = res.measured(lr)
        if not m:
            continue
        cmp_name = (
            "torch.ne" if _median([r.t_cmp_torch for r in m]) <= _median([r.t_cmp_numpy for r in m]) else "np.not_equal"
        )
        cpy_name = (
            "torch.clone"
            if _median([r.t_memcpy_clone for r in m]) <= _median([r.t_memcpy_copyto for r in m])
            else "np.copyto"
        )
        p_c = _median([r.t_push / r.t_cmp for r in m])
        e_m = _median([r.t_encode_pool / r.t_memcpy for r in m])
        e2e = _median([r.t_e2e for r in m])
        e2e06 = _median([r.t_e2e * QWEN3_06B_PARAMS / r.total for r in m])
        rows.append(
            [
                f"{lr:g}",
                _ms(_median([r.t_push for r in m])),
                f"{_ms(_median([r.t_cmp for r in m]))} ({cmp_name})",
                f"{_f(p_c, 2)} {_goal(p_c <= 1.5)}",
                _ms(_median([r.t_encode_pool for r in m])),
                _ms(_median([r.t_encode_1 for r in m])),
                f"{_ms(_median([r.t_memcpy for r in m]))} ({cpy_name})",
                f"{_f(e_m, 2)} {_goal(e_m <= 3)}",
                _ms(_median([r.t_fetch for r in m])),
                _f(_median([r.t_fetch / r.t_memcpy for r in m]), 2),
                _f(_median([r.t_fetch / r.t_memcpy_changed for r in m]), 0),
                _ms(e2e),
                f"{e2e06:.2f} s {_goal(e2e06 < 2)}",
            ]
        )
    out.append(
        _table(
            [
                "lr",
                "push()",
                "compare pass",
                "push / compare (<=1.5)",
                f"encode ({cfg.encode_threads} thr)",
                "encode (1 thr)",
                "memcpy weights",
                "encode / memcpy (<=3)",
                "fetch+verify+apply",
                "fetch / memcpy weights",
                "fetch / memcpy changed bytes",
                "push -> applied",
                "push -> applied, scaled to 0.6B params (<2 s)",
            ],
            rows,
        )
    )
    out.append("")
    out.append(
        "compare pass: one `!=` over all bf16 bit views vs the previous state (torch.ne into a preallocated mask, or "
        f"np.not_equal in {CHUNK}-element chunks; the faster, named). memcpy weights: torch.clone of every tensor or "
        "np.copyto "
        "into preallocated buffers; the faster, named. encode: deltasync.protocol.encode_changes on every changed "
        "tensor, "
        "same data as the uploader. fetch+verify+apply: DeltaFetcher(verify=True).sync of a separate copy one step "
        "forward "
        "(list, manifests, read, file xxh3, decode, apply, per-tensor digests). push -> applied: push() called until "
        "sync() "
        "returned (push + background commit over the local store + fetch). The 0.6B column scales it linearly by "
        "element count (an extrapolation, not a measurement). encode / memcpy uses the pooled encode (the "
        "uploader's encode_threads)."
    )
    out.append("")

    out.append("### Timing breakdown, medians per lr (ms)")
    out.append("")
    rows = []
    keys_push = ["push.prepare", "push.inventory", "push.stage"]
    keys_bg = [
        "bg.diff",
        "bg.tensor_digests",
        "bg.build_patch",
        "bg.file_xxh3",
        "bg.store_put_files",
        "bg.store_put_manifest_head",
    ]
    keys_fetch = [
        "fetch.manifests",
        "fetch.store_read",
        "fetch.file_xxh3",
        "fetch.decode",
        "fetch.decode_positions",
        "fetch.decode_values",
        "fetch.apply_patch",
        "fetch.verify_digests",
    ]

    def ph(m: list[StepRecord], key: str) -> str:
        vals = [r.phases[key] for r in m if key in r.phases]
        return _ms(_median(vals)) if vals else "n/a"

    for lr in cfg.lrs:
        m = res.measured(lr)
        if not m:
            continue
        rows.append(
            [
                f"{lr:g}",
                " / ".join(ph(m, k) for k in keys_push),
                " / ".join(
                    _ms(_median([getattr(r, a) for r in m]))
                    for a in ("t_cmp_torch", "t_cmp_numpy", "t_memcpy_clone", "t_memcpy_copyto")
                ),
                " / ".join(
                    _ms(_median([getattr(r, a) for r in m])) for a in ("t_diff_nz", "t_diff_gather", "t_diff_scatter")
                ),
                " / ".join(ph(m, k) for k in keys_bg),
                " / ".join(
                    _ms(_median([getattr(r, a) for r in m]))
                    for a in ("t_encode_1", "t_enc_rice", "t_enc_xor_rank", "t_enc_dense_trials")
                )
                + f" ({_median([r.n_dense_trials for r in m]):g} trials)",
                " / ".join(ph(m, k) for k in keys_fetch[:4])
                + f" ({ph(m, keys_fetch[4])} / {ph(m, keys_fetch[5])}) / "
                + " / ".join(ph(m, k) for k in keys_fetch[6:]),
                " / ".join(
                    _ms(_median([getattr(r, a) for r in m])) for a in ("t_train", "t_cast", "t_background", "t_commit")
                ),
            ]
        )
    out.append(
        _table(
            [
                "lr",
                "push: cast / inventory / stage (copy)",
                "refs: torch.ne / np.not_equal / torch.clone / np.copyto",
                "diff replica: compare+nonzero / gather / scatter",
                "background: diff / tensor digests / build_patch (encode+pack) / file xxh3 / write files / "
                "write manifest+HEAD",
                "encode 1 thr: total / rice positions / xor-rank values / dense-fallback trials (count)",
                "fetch: manifests / read / file xxh3 / decode (positions / values) / apply (incl. verify) / "
                "verify digests",
                "train step / bf16 cast / push->committed / CommitInfo.seconds",
            ],
            rows,
        )
    )
    out.append("")
    out.append(
        "Background and encode-pool times are sums over threads where work runs in parallel. "
        "'apply' includes 'verify digests' (the post-apply xxh3 of every touched tensor)."
    )
    per_lr = {lr: [(r.changed, r.codec) for r in res.measured(lr)] for lr in res.config.lrs}
    header, body = side_by_side.rows(per_lr)
    if body:
        out += _section(
            "Codec per core: compiled kernels vs the numpy fallback, same data, one thread",
            header,
            body,
            "Changed elements per second on one thread (medians over the measured steps): encode = "
            "encode_changes of every changed tensor; decode+apply = decode_positions + decode_values + "
            "HostTensor.apply (the fetcher's write, keeping the undo bits), no verification. Both "
            f"implementations coded every step to identical bytes. Pipeline rows above ran on: {kernels.backend()}.",
        )
        dens = {lr: _median([r.density for r in res.measured(lr)]) for lr in per_lr if res.measured(lr)}
        bpc = {lr: _median([r.ds_bpc for r in res.measured(lr)]) for lr in per_lr if res.measured(lr)}
        out += _section(
            "PROJECTION (not measured): codec time per step at 7B and 70B",
            *side_by_side.projection(per_lr, dens, bpc),
            "Changed elements x the measured per-core kernel rate at the nearest measured density, "
            "divided by the threads (assumes perfect scaling across tensors; big models have hundreds of "
            "tensors to spread). Excludes I/O, the diff and verification.",
        )
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ CLI


PRESETS: dict[str, dict[str, Any]] = {
    # the shapes of Qwen/Qwen3-0.6B (596M params, tied embeddings): the DESIGN.md end-to-end goal
    "qwen3-0.6b": dict(
        hidden=1024, layers=28, intermediate=3072, vocab=151936, heads=16, kv_heads=8, head_dim=128, tie_embeddings=True
    ),
}


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchConfig, argparse.Namespace]:
    d = BenchConfig()
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="model shape preset (explicit size flags still override)")
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--intermediate", type=int, default=d.intermediate)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--tie-embeddings", action="store_true", default=d.tie_embeddings)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--seq", type=int, default=d.seq)
    p.add_argument("--steps", type=int, default=d.steps, help="measured patch steps per lr")
    p.add_argument("--warmup", type=int, default=d.warmup, help="patch steps pushed but not measured")
    p.add_argument("--lrs", type=float, nargs="+", default=list(d.lrs))
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--adamw", choices=["fused", "foreach", "for-loop"], default=d.adamw)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--encode-threads", type=int, default=d.encode_threads)
    p.add_argument("--tmpdir", default=None, help="where the LocalStore's temp dir goes")
    p.add_argument("--out", default=None, help="also write the markdown report here")
    p.add_argument("--json", default=None, help="also write every per-step record here (raw seconds and bytes)")
    p.add_argument("--quiet", action="store_true", help="no per-step progress on stderr")
    p.add_argument(
        "--mmap-threshold", type=int, default=1 << 20, help="glibc M_MMAP_THRESHOLD in bytes (0: glibc's dynamic one)"
    )
    pre, _ = p.parse_known_args(argv)
    if pre.preset:
        p.set_defaults(**PRESETS[pre.preset])
    a = p.parse_args(argv)
    cfg = BenchConfig(
        hidden=a.hidden,
        layers=a.layers,
        intermediate=a.intermediate,
        vocab=a.vocab,
        heads=a.heads,
        kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        tie_embeddings=a.tie_embeddings,
        batch=a.batch,
        seq=a.seq,
        steps=a.steps,
        warmup=a.warmup,
        lrs=tuple(a.lrs),
        weight_decay=a.weight_decay,
        adamw=a.adamw,
        seed=a.seed,
        threads=a.threads,
        encode_threads=a.encode_threads,
        tmpdir=a.tmpdir,
    )
    return cfg, a


def main(argv: Sequence[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    if args.mmap_threshold:
        # freed arrays go back to the OS instead of staying in glibc's heap (4 GB at the 0.6B shape)
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, args.mmap_threshold)  # M_MMAP_THRESHOLD
    res = run(cfg, quiet=args.quiet)
    res = replace(res, command=" ".join(["python", *sys.argv]) if argv is None else "")
    text = render(res)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        payload = {
            "config": asdict(cfg),
            "env": res.env,
            "params": res.params,
            "wall_s": res.wall_s,
            "records": [asdict(r) for r in res.records],
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
