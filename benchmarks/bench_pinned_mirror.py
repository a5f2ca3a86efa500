"""GPU engines: copying from the node mirror's pages as they are (pageable) vs registered with CUDA.

The node mirror keeps each tensor of a version in its own file in shared memory, and workers map
those files (:func:`deltasync.serving.node.datafiles.map_file`). A copy from such pages to the
GPU goes through the driver's staging buffer; the same pages registered with ``cudaHostRegister``
(read-only: no copy-on-write of a private mapping) are copied by DMA. Plain torch, the Qwen3-0.6B
tensor shapes (bf16, TP=1), one file per tensor in ``--dir`` (default /dev/shm). Prints, medians of
``--repeat`` runs:

- ``pageable``: ``param.copy_(mapped)`` of every tensor, what ``load_weights`` does with the mirror's
  tensors today (and about what vLLM's own reload of a page-cached checkpoint costs in copies);
- ``register``: ``cudaHostRegister`` of every file's mapping (done once per file, in the background
  prepare, never in the pause), and what it costs the process in private memory;
- ``registered``: the same copies from the registered pages;
- ``scatter d``: writing only the changed elements at density ``d`` (positions and values in
  registered host memory, one ``index_copy_`` per tensor).

With ``--mirror`` it times deltasync's own pause instead: a run of ``--steps`` steps (each changing
17% of every tensor's elements) in a local store, and two engines (parameters on the GPU, a loader
that copies each tensor it is handed) on one node mirror, one with :class:`HostPins` and one
without, each preparing every step and then committing it; prints the median pause of each and
checks every step bit-exact.

    python benchmarks/bench_pinned_mirror.py            # needs a CUDA device
    python benchmarks/bench_pinned_mirror.py --mirror
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv heads, head dim, vocab)
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936),
    "small": (512, 1536, 8, 8, 4, 64, 32000),
}
READ_ONLY = 0x08  # cudaHostRegisterReadOnly


def shapes(name: str) -> list[tuple[int, ...]]:
    h, inter, layers, heads, kv, hd, vocab = SHAPES[name]
    per_layer = [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd), (inter, h), (inter, h), (h, inter)]
    return [(vocab, h)] + per_layer * layers + [(h,)] * (2 * layers + 1) + [(hd,)] * (2 * layers)


def private_kib() -> int:
    """This process's private memory (Private_Clean + Private_Dirty), KiB."""
    total = 0
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith(("Private_Dirty:", "Private_Clean:")):
            total += int(line.split()[1])
    return total


def map_file(path: Path, numel: int, how: str) -> torch.Tensor:
    if how != "readonly":
        return torch.from_file(str(path), shared=how == "shared", size=numel, dtype=torch.bfloat16)
    import mmap
    import warnings

    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the given buffer is not writable": writes would fault, by design
        return torch.frombuffer(mm, dtype=torch.bfloat16, count=numel)


def timed(fn: Callable[[], object], repeat: int) -> float:
    runs = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs[1:])  # the first warms up


def register(t: torch.Tensor, flags: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), flags)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")


def unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def mirror_pauses(args: argparse.Namespace, root: Path) -> None:
    import deltasync as ds
    from deltasync.serving.engine.mirror import EngineMirror, MirrorOptions
    from deltasync.serving.engine.pinning import HostPins

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    states = [
        {f"t{i}": torch.randn(shape, generator=g).to(torch.bfloat16) for i, shape in enumerate(shapes(args.shape))}
    ]
    for _ in range(args.steps):
        nxt = {}
        for n, t in states[-1].items():
            mask = torch.rand(t.shape, generator=g) < 0.17
            nxt[n] = torch.where(mask, (t.float() * 1.01 + 1e-3).to(torch.bfloat16), t)
        states.append(nxt)
    t0 = time.perf_counter()
    with ds.DeltaUploader(str(root / "run"), anchor_every=1000, anchor_bytes_fraction=0) as up:
        for step, state in enumerate(states):
            up.push(state, step).result()
    print(f"run of {args.steps} steps written in {time.perf_counter() - t0:.1f} s")
    pauses: dict[str, list[float]] = {}
    for label, pins in (("pageable", None), ("registered", HostPins() if dev.type == "cuda" else None)):
        params = {n: t.to(dev) for n, t in states[0].items()}

        def load(pairs: object, params: dict[str, torch.Tensor] = params) -> None:
            for name, t in pairs:  # type: ignore[attr-defined]
                params[name].copy_(t, non_blocking=True)
            if dev.type == "cuda":
                torch.cuda.synchronize()

        worker = EngineMirror(
            ds.DeltaFetcher(str(root / "run")),
            load,
            MirrorOptions(seed=states[0], seed_step=0, node_dir=root / f"node-{label}", pin=pins),
        )
        try:
            for step in range(1, args.steps + 1):
                worker.prepare(step).result()
                report = worker.commit(step)
                pauses.setdefault(label, []).append(report.pause_s)
                for n, t in states[step].items():
                    assert torch.equal(params[n].cpu().view(torch.int16), t.view(torch.int16)), (
                        f"{label} step {step}: {n}"
                    )
            if pins is not None:
                print(
                    f"{label}: registered {pins.nbytes / 2**30:.2f} GiB in {pins.seconds:.2f} s in all (while preparing)"
                )
        finally:
            worker.close()
    base = statistics.median(pauses["pageable"])
    for label, runs in pauses.items():
        med = statistics.median(runs)
        print(f"pause, {label:10s}  median {med * 1e3:7.1f} ms over {len(runs)} steps  {med / base:.2f}x pageable")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.05, 0.17])
    ap.add_argument(
        "--map",
        choices=["private", "shared", "readonly"],
        default="private",
        help="MAP_PRIVATE (torch.from_file), MAP_SHARED read-write, or MAP_SHARED with PROT_READ only",
    )
    ap.add_argument("--mirror", action="store_true", help="time deltasync's pause, pinned vs not")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    dev = torch.device("cuda")
    root = Path(tempfile.mkdtemp(prefix="deltasync-pin-", dir=args.dir))
    if args.mirror:
        try:
            mirror_pauses(args, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    try:
        g = torch.Generator().manual_seed(0)
        params, maps = [], []
        for i, shape in enumerate(shapes(args.shape)):
            host = torch.randn(shape, generator=g).to(torch.bfloat16)
            path = root / f"{i}.bin"
            path.write_bytes(host.view(-1).view(torch.uint8).numpy().tobytes())
            maps.append(map_file(path, host.numel(), args.map).view(shape))
            params.append(torch.empty(shape, dtype=torch.bfloat16, device=dev))
        nbytes = sum(m.numel() * 2 for m in maps)
        print(f"{args.shape}: {len(maps)} tensors, {nbytes / 2**30:.2f} GiB, map {args.map}")
        for m in maps:  # fault the pages in, as a worker that mapped a version has
            m.sum()

        def copy_all() -> None:
            for p, m in zip(params, maps, strict=True):
                p.copy_(m, non_blocking=True)

        pageable = timed(copy_all, args.repeat)
        before = private_kib()
        t0 = time.perf_counter()
        for m in maps:
            register(m, READ_ONLY)
        reg_s = time.perf_counter() - t0
        grew = private_kib() - before
        registered = timed(copy_all, args.repeat)
        for p, m in zip(params, maps, strict=True):
            assert torch.equal(p.cpu().view(torch.int16), m.view(torch.int16)), "copy not bit-exact"
        print(f"pageable copy of every tensor  {pageable * 1e3:8.1f} ms  ({nbytes / pageable / 1e9:.1f} GB/s)")
        print(
            f"register every file            {reg_s * 1e3:8.1f} ms  (once per file, off the pause; private memory +{grew} KiB)"
        )
        print(
            f"registered copy                {registered * 1e3:8.1f} ms  ({nbytes / registered / 1e9:.1f} GB/s)  {registered / pageable:.2f}x pageable"
        )
        for d in args.densities:
            changes = []
            for m in maps:
                n = m.numel()
                k = max(1, int(d * n))
                pos = torch.randperm(n, generator=g)[:k].sort().values.to(torch.int32)
                vals = m.view(-1)[pos.long()].clone()
                pos, vals = pos.pin_memory(), vals.pin_memory()  # the version's positions file, registered
                changes.append((pos, vals))

            def scatter_all(changes: list[tuple[torch.Tensor, torch.Tensor]] = changes) -> None:
                for p, (pos, vals) in zip(params, changes, strict=True):
                    idx = pos.to(dev, non_blocking=True).long()
                    p.view(-1).index_copy_(0, idx, vals.to(dev, non_blocking=True))

            s = timed(scatter_all, args.repeat)
            print(
                f"scatter {d:5.0%} (registered)      {s * 1e3:8.1f} ms  {s / pageable:.2f}x pageable, {s / registered:.2f}x registered"
            )
        for m in maps:
            unregister(m)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
