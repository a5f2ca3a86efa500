"""Codec throughput per core, compiled kernels and numpy fallback side by side on the same data.

Used by ``bench_payload.py``: each measured step's changes are encoded, decoded and
applied on one thread by both implementations (:mod:`deltasync.protocol.kernels`);
the coded bytes must be identical, or the run stops.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from deltasync.fetcher._target import HostTensor
from deltasync.protocol import EncodedTensor, decode_positions, decode_values, encode_changes, kernels

Bits = np.ndarray[Any, np.dtype[Any]]
BACKENDS = ("numpy", "numba")
PARTS = {"encode": ("encode",), "decode+apply": ("decode", "apply")}
GOALS = {"encode": 200e6, "decode+apply": 250e6}  # changed elements per second per core (issue 14)


class _Entry:
    """What :meth:`HostTensor.apply` reads from a decoded entry."""

    def __init__(self, tensor: str, idx: Bits, values: Bits, coding: str) -> None:
        self.tensor, self.idx, self.values, self.coding = tensor, idx, values, coding


def measure(
    numel: Mapping[str, int], changes: Mapping[str, tuple[Bits, Bits, Bits]], state: Mapping[str, Bits]
) -> dict[str, float]:
    """Seconds per backend for encode / decode / apply of every changed tensor, one thread.

    ``state`` holds the new bits (the harness' baseline after its diff); apply XORs them back
    to the old bits and then forward again, so ``state`` ends as it started.
    """
    out: dict[str, float] = {}
    names = sorted(changes)
    backends = [be for be in BACKENDS if be != "numba" or kernels.available()]
    for k in names:  # one tensor at a time: only its own decoded arrays are alive
        coded = {}
        for be in backends:
            with kernels.using(be):  # type: ignore[arg-type]
                t0 = time.perf_counter()
                e = encode_changes(numel[k], *changes[k])
                t1 = time.perf_counter()
                pos = decode_positions(e.pos_blob, e.positions, e.rice_k, e.count, numel[k], k)
                d = _Entry(k, pos, decode_values(e.val_blob, e.values, e.count, changes[k][1].dtype, k), e.values)
                t2 = time.perf_counter()
                slot = HostTensor(state[k].reshape(-1))
                slot.apply(d)  # type: ignore[arg-type]
                t3 = time.perf_counter()
                if d.coding == "xor-rank":  # back to the new bits (raw wrote what the state already held)
                    slot.apply(d)  # type: ignore[arg-type]
            coded[be] = e
            for part, t in (("encode", t1 - t0), ("decode", t2 - t1), ("apply", t3 - t2)):
                out[f"{be}.{part}"] = out.get(f"{be}.{part}", 0.0) + t
        if len(coded) == 2 and coded["numpy"] != coded["numba"]:
            raise RuntimeError(f"the kernels and the numpy fallback coded {k!r} differently")
    if "numba" in backends:
        out.update(_two_threads(numel, changes, state, names))
    return out


def _two_threads(
    numel: Mapping[str, int],
    changes: Mapping[str, tuple[Bits, Bits, Bits]],
    state: Mapping[str, Bits],
    names: list[str],
) -> dict[str, float]:
    """The kernels' encode and decode+apply with tensors spread over 2 threads (as the uploader's
    encode pool and the fetcher's ``threads`` do)."""
    from concurrent.futures import ThreadPoolExecutor

    def enc(k: str) -> EncodedTensor:
        return encode_changes(numel[k], *changes[k])

    def dec_apply(ke: tuple[str, EncodedTensor]) -> None:
        k, e = ke
        pos = decode_positions(e.pos_blob, e.positions, e.rice_k, e.count, numel[k], k)
        d = _Entry(k, pos, decode_values(e.val_blob, e.values, e.count, changes[k][1].dtype, k), e.values)
        HostTensor(state[k].reshape(-1)).apply(d)  # type: ignore[arg-type]

    with kernels.using("numba"), ThreadPoolExecutor(2) as pool:
        t0 = time.perf_counter()
        enc_out = list(pool.map(enc, names))
        t1 = time.perf_counter()
        list(pool.map(dec_apply, zip(names, enc_out, strict=True)))
        t2 = time.perf_counter()
    for k in names:  # back to the new bits
        idx, _, new = changes[k]
        state[k].reshape(-1)[idx] = new
    return {"numba2.encode": t1 - t0, "numba2.decode+apply": t2 - t1}


def rows(per_lr: Mapping[float, Sequence[tuple[int, Mapping[str, float]]]]) -> tuple[list[str], list[list[str]]]:
    """Table rows: per lr, median changed elements/s per core for each backend, the speed-up, the goal."""
    header = [
        "lr",
        "changed / step",
        "encode: numpy",
        "encode: kernels",
        "speed-up",
        "encode goal (>=200M/s)",
        "decode+apply: numpy",
        "decode+apply: kernels",
        "speed-up",
        "decode+apply goal (>=250M/s)",
        "decode / apply (kernels, ms)",
        "2 threads vs 1 (kernels): encode; decode+apply",
    ]
    body = []
    for lr, recs in sorted(per_lr.items()):
        if not recs or "numba.encode" not in recs[0][1]:
            continue
        row = [f"{lr:g}", f"{np.median([n for n, _ in recs]) / 1e6:.2f}M"]
        scaling: list[str] = []
        for kind in ("encode", "decode+apply"):
            per = {}
            for be in BACKENDS:
                per[be] = float(np.median([n / sum(c[f"{be}.{p}"] for p in PARTS[kind]) for n, c in recs]))
            ok = per["numba"] >= GOALS[kind]
            row += [
                f"{per['numpy'] / 1e6:.0f}M/s",
                f"{per['numba'] / 1e6:.0f}M/s",
                f"{per['numba'] / per['numpy']:.2f}x",
                f"{per['numba'] / GOALS[kind]:.2f} of goal {'ok' if ok else 'MISS'}",
            ]
        if "numba2.encode" in recs[0][1]:
            for kind, one in (("encode", ("encode",)), ("decode+apply", ("decode", "apply"))):
                t1 = [sum(c[f"numba.{p}"] for p in one) for _, c in recs]
                t2 = [c[f"numba2.{kind}"] for _, c in recs]
                scaling.append(f"{lr:g} {kind}: {np.median(np.array(t1) / np.array(t2)):.2f}x")
        dec = np.median([c["numba.decode"] for _, c in recs]) * 1e3
        app = np.median([c["numba.apply"] for _, c in recs]) * 1e3
        row.append(f"{dec:.1f} / {app:.1f}")
        row.append("; ".join(s.split(": ", 1)[1] for s in scaling) if scaling else "n/a")
        body.append(row)
    return header, body


def projection(
    per_lr: Mapping[float, Sequence[tuple[int, Mapping[str, float]]]],
    density: Mapping[float, float],
    bytes_per_changed: Mapping[float, float],
    threads: Sequence[int] = (1, 2),
) -> tuple[list[str], list[list[str]]]:
    """A PROJECTION, not a measurement: codec seconds per step for 7B and 70B bf16 models at 1% and
    10% density, from the measured per-core kernel rates at the nearest measured density, divided
    by the thread count (perfect scaling assumed; the thread-scaling table shows how close it is)."""
    measured = {
        lr: {kind: float(np.median([n / sum(c[f"numba.{p}"] for p in PARTS[kind]) for n, c in recs])) for kind in PARTS}
        for lr, recs in per_lr.items()
        if recs and "numba.encode" in recs[0][1]
    }
    header = ["model", "density", "changed / step", "payload / step", "rates from lr"]
    header += [f"{kind}, {t} thr" for t in threads for kind in PARTS]
    body = []
    for params in (7e9, 70e9):
        for d in (0.01, 0.10):
            if not measured:
                continue
            lr = min(measured, key=lambda x: abs(density[x] - d))
            n = params * d
            row = [f"{params / 1e9:.0f}B", f"{d:.0%}", f"{n / 1e6:.0f}M", f"{n * bytes_per_changed[lr] / 1e9:.2f} GB"]
            row.append(f"{lr:g} ({density[lr]:.1%})")
            row += [f"{n / measured[lr][kind] / t:.1f} s" for t in threads for kind in PARTS]
            body.append(row)
    return header, body
