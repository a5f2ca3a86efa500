"""numba kernels for the codec's hot loops (imported only through :mod:`deltasync.protocol.kernels`).

Each kernel is one pass over a tensor's changed elements (or, for the diff, over
the tensor) doing what the numpy code in :mod:`deltasync.protocol.positions` and
:mod:`deltasync.protocol.values` does with several whole-array passes and int64 temporaries. The outputs are the same
arrays, so the coded bytes are identical. Arrays come in as unsigned views; the
decoders return an error code (0: fine) instead of raising, and never write
outside their own output arrays. All release the GIL, so a thread pool encodes
or decodes several tensors at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, njit, types  # type: ignore[attr-defined]
from numba.extending import intrinsic

Arr = Any

ESCAPE = 255
PAIR_BASE = 15
PAIR_ESCAPE = 255
BIG_Q = 255
_jit: Any = njit(nogil=True, cache=True, boundscheck=False)  # compiled on first call, cached on disk


LSBS = np.uint64(0x0101010101010101)
GATHER = np.uint64(0x0102040810204080)  # bit 8t of a word -> bit 56 + t: no two terms collide or carry
# SPREAD[b]: bit t of the byte b moved to bit 8t of a word (a plane byte back to eight remainders)
SPREAD = np.array([sum(((b >> t) & 1) << (8 * t) for t in range(8)) for b in range(256)], dtype=np.uint64)
DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)  # (lowest set bit * DEBRUIJN) >> 58 is unique per bit: its index
DEBRUIJN_POS = np.zeros(64, dtype=np.int64)
for _b in range(64):
    DEBRUIJN_POS[(((1 << _b) * 0x03F79D71B4CB0A89) & (2**64 - 1)) >> 58] = _b
CHUNK = 1 << 15  # elements (or pairs) per inner call: outputs grow between chunks, never inside a hot loop


@_jit
def _reserve(a: Arr, used: int, more: int) -> Arr:
    """``a`` itself when ``used + more`` elements fit, else a copy with room (doubling)."""
    if used + more <= a.size:
        return a
    b = np.empty(max(2 * a.size, used + more), a.dtype)
    b[:used] = a[:used]
    return b


# ---------------------------------------------------------------- diff


@_jit
def diff_words(base: Arr, new: Arr, idx: Arr, old: Arr, nw: Arr, tab: Arr) -> int:
    """Positions where ``new`` differs from ``base`` into ``idx`` (sized by :func:`count_changed`),
    the old and new bits there into ``old`` / ``nw``; ``base`` takes the new bits. Returns the count.

    64 compares into one word (vectorised), then only its set bits are visited (``tab``: the
    de Bruijn bit-index table), so no per-element branch mispredicts at RL densities; the last
    ``size % 64`` elements one by one."""
    n = base.size
    c = 0
    full = n - (n & 63)
    for w in range(0, full, 64):
        m = np.uint64(0)
        for j in range(64):
            m |= np.uint64(base[w + j] != new[w + j]) << np.uint64(j)
        while m:
            low = m & (~m + np.uint64(1))
            j = tab[(low * np.uint64(0x03F79D71B4CB0A89)) >> np.uint64(58)]
            i = w + j
            idx[c] = i
            old[c] = base[i]
            nw[c] = new[i]
            base[i] = new[i]
            c += 1
            m ^= low
    for i in range(full, n):
        if base[i] != new[i]:
            idx[c] = i
            old[c] = base[i]
            nw[c] = new[i]
            base[i] = new[i]
            c += 1
    return c


@_jit
def count_changed(base: Arr, new: Arr) -> int:
    c = 0  # vectorised by LLVM
    for i in range(base.size):
        c += base[i] != new[i]
    return c


# ---------------------------------------------------------------- positions (rice-z)


@_jit
def rice_k(idx: Arr, k0: int) -> int:
    """The Rice parameter :func:`deltasync.protocol.positions._rice_k` picks around ``k0`` (the
    estimate from the mean gap): the cheapest of k0-1, k0, k0+1 on a sample of the gaps (the
    first of them on a tie), all three costed in one pass."""
    n = idx.size
    step = max(1, n >> 16)
    lo = max(k0 - 1, 0)  # k0 >= 0, so the candidates are lo, lo+1 and (when k0 > 0) lo+2
    s1 = min(lo + 1, 62)  # shifts stay defined; candidates above 62 are never taken
    s2 = min(lo + 2, 62)
    g = idx[0]
    c0 = g >> lo
    c1 = g >> s1
    c2 = g >> s2
    m = 1
    for j in range(step, n, step):
        g = idx[j] - idx[j - 1] - 1
        c0 += g >> lo
        c1 += g >> s1
        c2 += g >> s2
        m += 1
    best_k = lo
    best = c0 + m * (lo + 1)
    if lo + 1 <= 62 and c1 + m * (lo + 2) < best:
        best_k = lo + 1
        best = c1 + m * (lo + 2)
    if k0 > 0 and lo + 2 <= 62 and c2 + m * (lo + 3) < best:
        best_k = lo + 2
    return best_k


@_jit
def _rice_chunk(
    idx: Arr, k: int, plo: int, phi: int, prev: int, pairs: Arr, esc: Arr, ne: int, bigs: Arr, nb: int, planes: Arr
) -> tuple[int, int, int]:
    n = idx.size
    plane = (n + 7) // 8
    mask = (np.int64(1) << k) - 1
    x = np.uint64(0)
    for p in range(plo, phi):
        s0 = 0
        s1 = 0
        for t in range(2):
            i = 2 * p + t
            if i >= n:
                break
            g = idx[i] - prev - 1
            prev = idx[i]
            q = g >> k
            s = q
            if q >= BIG_Q:
                bigs[nb] = q
                nb += 1
                s = BIG_Q
            if k > 8:
                r = g & mask
                byte = i >> 3
                sh = i & 7
                for j in range(k):
                    planes[j * plane + byte] |= np.uint8(((r >> j) & 1) << sh)
            elif k:
                # eight remainders as the bytes of one word, transposed into k plane bytes at once
                x |= np.uint64(g & mask) << np.uint64(8 * (i & 7))
                if i & 7 == 7 or i == n - 1:
                    byte = i >> 3
                    for j in range(k):
                        planes[j * plane + byte] = np.uint8(((x >> np.uint64(j)) & LSBS) * GATHER >> np.uint64(56))
                    x = np.uint64(0)
            if t == 0:
                s0 = s
            else:
                s1 = s
        if s0 < PAIR_BASE and s1 < PAIR_BASE:
            pairs[p] = s0 * PAIR_BASE + s1
        else:
            pairs[p] = PAIR_ESCAPE
            esc[ne] = s0 | (s1 << 8)
            ne += 1
    return prev, ne, nb


@_jit
def rice_z_parts(idx: Arr, k: int) -> tuple[Arr, Arr, int, Arr, int, Arr]:
    """Quotient pairs, escaped pairs (u16), big quotients (u64) and remainder bit planes of the gaps."""
    n = idx.size
    npairs = (n + 1) // 2
    pairs = np.empty(npairs, np.uint8)
    esc = np.empty(CHUNK, np.uint16)
    bigs = np.empty(2 * CHUNK, np.uint64)
    planes = np.zeros(k * ((n + 7) // 8), np.uint8)
    ne = 0
    nb = 0
    prev = np.int64(-1)
    for plo in range(0, npairs, CHUNK):
        phi = min(npairs, plo + CHUNK)
        esc = _reserve(esc, ne, phi - plo)
        bigs = _reserve(bigs, nb, 2 * (phi - plo))
        prev, ne, nb = _rice_chunk(idx, k, plo, phi, prev, pairs, esc, ne, bigs, nb, planes)
    return pairs, esc, ne, bigs, nb, planes


@_jit
def _unpair(b: int, esc: Arr, ei: int) -> tuple[int, int, int, int]:
    """The two symbols of pair byte ``b`` (an escape byte takes ``esc[ei]``): (s0, s1, next ei,
    error: 1 escaped pairs run out, 2 invalid pair byte)."""
    if b == PAIR_ESCAPE:
        if ei >= esc.size:
            return np.int64(0), np.int64(0), ei, 1
        e = np.int64(esc[ei])
        return e & 0xFF, e >> 8, ei + 1, 0
    if b >= PAIR_BASE * PAIR_BASE:
        return np.int64(0), np.int64(0), ei, 2
    return np.int64(b) // PAIR_BASE, np.int64(b) % PAIR_BASE, ei, 0


@_jit
def rice_z_positions(pairs: Arr, esc: Arr, bigs: Arr, planes: Arr, k: int, count: int, numel: int) -> tuple[Arr, int]:
    """Sorted positions from a rice-z stream, and an error code:
    1 escaped pairs do not match, 2 invalid pair byte, 3 nonzero padding, 4 big quotients do not
    match, 5 big quotient out of range, 6 a gap exceeds the tensor, 7 a position outside it."""
    out = np.empty(count, np.int64)
    plane = (count + 7) // 8
    limit = (min(numel, np.int64(1) << 62) - 1) >> k
    ei = 0
    bi = 0
    prev = np.int64(-1)
    x = np.uint64(0)
    for p in range(pairs.size):
        s0, s1, ei, err = _unpair(pairs[p], esc, ei)
        if err:
            return out, err
        for t in range(2):
            i = 2 * p + t
            s = s0 if t == 0 else s1
            if i >= count:
                if s != 0:
                    return out, 3
                continue
            q = s
            if s == BIG_Q:
                if bi >= bigs.size:
                    return out, 4
                v = bigs[bi]
                bi += 1
                if v < BIG_Q or v >= np.uint64(1) << np.uint64(62):
                    return out, 5
                q = np.int64(v)
            if q > limit:
                return out, 6
            g = q << k
            if k > 8:
                byte = i >> 3
                sh = i & 7
                for j in range(k):
                    g |= np.int64((planes[j * plane + byte] >> sh) & 1) << j
            elif k:
                if i & 7 == 0:  # the next eight remainders, one per byte of a word
                    byte = i >> 3
                    x = np.uint64(0)
                    for j in range(k):
                        x |= SPREAD[planes[j * plane + byte]] << np.uint64(j)
                g |= np.int64((x >> np.uint64(8 * (i & 7))) & np.uint64(0xFF))
            pos = prev + g + 1
            if pos >= numel:
                return out, 7
            out[i] = pos
            prev = pos
    if ei != esc.size:
        return out, 1
    if bi != bigs.size:
        return out, 4
    return out, 0


# ---------------------------------------------------------------- values (xor-rank)


@_jit
def xor_rank_table(old: Arr, new: Arr, nvals: int) -> tuple[Arr, Arr]:
    """(the up to 255 commonest values of ``old ^ new``, most frequent first, ties by value; rank
    lookup table of ``nvals`` entries, ESCAPE where a value is not in the table): the histogram and
    the ranking in one call (u8/u16 bits, ``nvals`` = 256 / 65536), the same table as
    ``values._table_of_counts`` of the histogram."""
    counts = np.zeros(nvals, np.int64)
    for i in range(old.size):
        counts[old[i] ^ new[i]] += 1
    m = 0
    for v in range(nvals):
        if counts[v]:
            m += 1
    # one sort of unique keys: fewer occurrences sort later, equal counts by value
    keys = np.empty(m, np.int64)
    j = 0
    for v in range(nvals):
        c = counts[v]
        if c:
            keys[j] = (old.size - c) * nvals + v
            j += 1
    keys.sort()
    t = min(m, ESCAPE)
    order = np.empty(t, np.int64)
    lut = np.full(nvals, ESCAPE, np.uint8)
    for r in range(t):
        v = keys[r] % nvals
        order[r] = v
        lut[v] = r
    return order, lut


@_jit
def _rank_chunk(
    old: Arr, new: Arr, lut: Arr, plo: int, phi: int, pairs: Arr, pesc: Arr, ne: int, vesc: Arr, nv: int
) -> tuple[int, int]:
    n = old.size
    for p in range(plo, phi):
        i = 2 * p
        x0 = old[i] ^ new[i]
        r0 = np.int64(lut[x0])
        if r0 == ESCAPE:
            vesc[nv] = x0
            nv += 1
        r1 = np.int64(0)
        if i + 1 < n:
            x1 = old[i + 1] ^ new[i + 1]
            r1 = np.int64(lut[x1])
            if r1 == ESCAPE:
                vesc[nv] = x1
                nv += 1
        if r0 < PAIR_BASE and r1 < PAIR_BASE:
            pairs[p] = r0 * PAIR_BASE + r1
        else:
            pairs[p] = PAIR_ESCAPE
            pesc[ne] = r0 | (r1 << 8)
            ne += 1
    return ne, nv


@_jit
def xor_rank_parts(old: Arr, new: Arr, lut: Arr) -> tuple[Arr, Arr, int, Arr, int]:
    """Rank pairs, escaped rank pairs (u16) and escaped XOR values (in element order)."""
    npairs = (old.size + 1) // 2
    pairs = np.empty(npairs, np.uint8)
    pesc = np.empty(CHUNK, np.uint16)
    vesc = np.empty(2 * CHUNK, old.dtype)
    ne = 0
    nv = 0
    for plo in range(0, npairs, CHUNK):
        phi = min(npairs, plo + CHUNK)
        pesc = _reserve(pesc, ne, phi - plo)
        vesc = _reserve(vesc, nv, 2 * (phi - plo))
        ne, nv = _rank_chunk(old, new, lut, plo, phi, pairs, pesc, ne, vesc, nv)
    return pairs, pesc, ne, vesc, nv


@_jit
def xor_rank_values(pairs: Arr, pesc: Arr, table: Arr, vesc: Arr, count: int) -> tuple[Arr, int]:
    """XOR masks from rank pairs, and an error code: 1 escaped pairs do not match, 2 invalid pair
    byte, 3 nonzero padding, 4 escaped values do not match, 5 escape with a short table, 6 a rank
    outside the table."""
    out = np.empty(count, table.dtype)
    tlen = table.size
    ei = 0
    vi = 0
    for p in range(pairs.size):
        r0, r1, ei, err = _unpair(pairs[p], pesc, ei)
        if err:
            return out, err
        for t in range(2):
            i = 2 * p + t
            r = r0 if t == 0 else r1
            if i >= count:
                if r != 0:
                    return out, 3
                continue
            if r == ESCAPE:
                if tlen < ESCAPE:
                    return out, 5
                if vi >= vesc.size:
                    return out, 4
                out[i] = vesc[vi]
                vi += 1
            elif r >= tlen:
                return out, 6
            else:
                out[i] = table[r]
    if ei != pesc.size:
        return out, 1
    if vi != vesc.size:
        return out, 4
    return out, 0


# ---------------------------------------------------------------- apply


@_jit
def xor_apply(arr: Arr, idx: Arr, vals: Arr, old: Arr) -> None:
    """old[i] = arr[idx[i]]; arr[idx[i]] ^= vals[i] (positions validated by the decoder)."""
    for i in range(idx.size):
        j = idx[i]
        a = arr[j]
        old[i] = a
        arr[j] = a ^ vals[i]


@_jit
def set_apply(arr: Arr, idx: Arr, vals: Arr, old: Arr) -> None:
    """old[i] = arr[idx[i]]; arr[idx[i]] = vals[i]."""
    for i in range(idx.size):
        j = idx[i]
        old[i] = arr[j]
        arr[j] = vals[i]


# ---------------------------------------------------------------- group apply (format 2 groups, in place)


def _pointer_typer(typingctx: Any, addr: Any, like: Any) -> Any:
    """A typed pointer to ``like``'s element type at the integer address ``addr`` (an intrinsic)."""
    ptr: Any = types.CPointer(like.dtype)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(addr, like), codegen


_pointer_like: Any = intrinsic(_pointer_typer)


@_jit
def _run_ok(idx: Arr, lo: int, size: int, prev: int) -> bool:
    """Whether the run ``idx`` (positions of one member starting at ``lo``, ``size`` elements) ascends
    strictly from above ``prev`` and stays inside the member (a reduction without an exit: vectorised)."""
    n = idx.size
    bad = (idx[0] <= prev) | (idx[0] < lo) | (idx[n - 1] - lo >= size)
    for k in range(1, n):
        bad |= idx[k] <= idx[k - 1]
    return not bad


# the writes of one run, each its own compiled function: inlined into group_apply's loop they ran
# 1.3-1.6x slower than xor_apply over the same positions; as calls, as fast


@_jit
def _run_xor(a: Arr, idx: Arr, vals: Arr, old: Arr, lo: int) -> None:
    for k in range(idx.size):
        j = idx[k] - lo
        x = a[j]
        old[k] = x
        a[j] = x ^ vals[k]


@_jit
def _run_set(a: Arr, idx: Arr, vals: Arr, old: Arr, lo: int) -> None:
    for k in range(idx.size):
        j = idx[k] - lo
        old[k] = a[j]
        a[j] = vals[k]


@_jit
def _run_put(a: Arr, idx: Arr, vals: Arr, lo: int) -> None:
    for k in range(idx.size):
        a[idx[k] - lo] = vals[k]


@_jit
def _run_write(a: Arr, idx: Arr, vals: Arr, old: Arr, lo: int, mode: int) -> None:
    """One member's run written by ``mode`` (0: XOR, 1: set, both keeping the old bits; 2: put)."""
    if mode == 0:
        _run_xor(a, idx, vals, old, lo)
    elif mode == 1:
        _run_set(a, idx, vals, old, lo)
    else:
        _run_put(a, idx, vals, lo)


@_jit
def group_apply(addrs: Arr, bounds: Arr, idx: Arr, vals: Arr, old: Arr, mode: int) -> int:
    """Apply a group's change to its members in place: member ``m`` is the C-contiguous array of
    ``bounds[m+1] - bounds[m]`` elements (each as wide as ``vals``'s) at address ``addrs[m]``, and
    ``idx`` holds strictly ascending positions into the members' concatenation.

    ``mode`` 0: XOR ``vals`` in; 1: set ``vals``; both keep the bits overwritten in ``old``.
    ``mode`` 2: set ``vals`` and keep nothing (restoring ``old`` bits after a failure).
    Returns how many leading positions were applied: ``idx.size`` when all were; fewer when a
    position is outside the members or not ascending (nothing of that member's run or after it is
    written, so the caller restores the ones before). ``bounds`` must be a cumulative count from 0
    (-1 otherwise, nothing written). Each member's run of positions is checked, then written; never
    writes outside the members."""
    n: int = idx.size
    nm = addrs.size
    if bounds.size != nm + 1 or bounds[0] != 0:
        return -1
    for m in range(nm):
        if bounds[m + 1] < bounds[m]:
            return -1
    m = 0
    i = 0
    prev = np.int64(-1)
    while i < n:
        while m < nm and idx[i] >= bounds[m + 1]:
            m += 1
        if m == nm:
            return i
        lo = bounds[m]
        size = bounds[m + 1] - lo
        e = i + np.searchsorted(idx[i:], lo + size)  # the run's end when ascending (checked next)
        if e == i or not _run_ok(idx[i:e], lo, size, prev):
            return i
        _run_write(carray(_pointer_like(addrs[m], vals), size), idx[i:e], vals[i:e], old[i:e], lo, mode)
        prev = idx[e - 1]
        i = e
        m += 1
    return n


@_jit
def group_apply_ordered(addrs: Arr, bounds: Arr, idx: Arr, vals: Arr, old: Arr, mode: int, order: Arr) -> int:
    """:func:`group_apply` visiting the members in ``order`` (a permutation of their indices: by
    address, so that the writes walk memory forwards however the members are named). Only for
    positions that are all valid: it first checks that ``idx`` ascends strictly inside the members'
    concatenation and returns -2 having written nothing when it does not (the caller runs
    :func:`group_apply` then, which says how far a bad run goes); otherwise writes all and returns
    ``idx.size`` (-1: ``bounds`` or ``order`` malformed, nothing written)."""
    n: int = idx.size
    nm = addrs.size
    if bounds.size != nm + 1 or bounds[0] != 0 or order.size != nm:
        return -1
    for m in range(nm):
        if bounds[m + 1] < bounds[m] or order[m] < 0 or order[m] >= nm:
            return -1
    if n == 0:
        return 0
    bad = (idx[0] < 0) | (idx[n - 1] >= bounds[nm])
    for k in range(1, n):
        bad |= idx[k] <= idx[k - 1]
    if bad:
        return -2
    starts: Arr = np.searchsorted(idx, bounds)  # member m's run is idx[starts[m]:starts[m + 1]]
    for j in range(nm):
        m = order[j]
        i = starts[m]
        e = starts[m + 1]
        if e == i:
            continue
        lo = bounds[m]
        _run_write(carray(_pointer_like(addrs[m], vals), bounds[m + 1] - lo), idx[i:e], vals[i:e], old[i:e], lo, mode)
    return n


@_jit
def group_cuts(codes: Arr, numels: Arr, limit: int, cuts: Arr) -> int:
    """Where a run of tensors (``codes[i]``: a dtype's code, ``numels[i]``: elements) is cut into
    format-2 groups: consecutive tensors of one dtype until adding one would pass ``limit`` elements
    (a tensor that large stands alone). Writes the indices that start a group after the first into
    ``cuts`` and returns how many."""
    c = 0
    size = 0
    for i in range(codes.size):
        if i > 0 and (codes[i] != codes[i - 1] or size + numels[i] > limit):
            cuts[c] = i
            c += 1
            size = 0
        size += numels[i]
    return c


# ---------------------------------------------------------------- gather (the uploader's packed staging)


def _copy_typer(typingctx: Any, dst: Any, src: Any, n: Any) -> Any:
    """Copy ``n`` bytes from address ``src`` to address ``dst`` (ranges that do not overlap) as
    LLVM's memcpy (an intrinsic: the C library's copy, wide loads and stores whatever the alignment)."""
    from llvmlite import ir
    from numba.core import cgutils

    sig = types.void(types.intp, types.intp, types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(args[0], i8p), builder.inttoptr(args[1], i8p), args[2], 1)  # type: ignore[no-untyped-call]
        return context.get_dummy_value()

    return sig, codegen


_copy_bytes: Any = intrinsic(_copy_typer)


@_jit
def gather_bytes(dst: Arr, addrs: Arr, starts: Arr, order: Arr) -> bool:
    """Copy ``starts[i+1] - starts[i]`` bytes from host address ``addrs[i]`` to ``dst[starts[i]:]``
    for every ``i``, visiting ``i`` in ``order`` (a permutation: the sources by address, so the reads
    walk memory forwards). The caller keeps the sources alive and vouches for their sizes and the
    order: this reads raw memory. Nothing is written outside ``dst``'s ``starts[0]:starts[-1]``
    (``starts`` must ascend within ``dst``; False otherwise, nothing copied)."""
    n = addrs.size
    if starts.size != n + 1 or order.size != n or starts[0] < 0 or starts[n] > dst.size:
        return False
    for i in range(n):
        if starts[i + 1] < starts[i] or order[i] < 0 or order[i] >= n:
            return False
    base = dst.ctypes.data
    for k in range(n):
        i = order[k]
        size = starts[i + 1] - starts[i]
        if size > 0:
            _copy_bytes(base + starts[i], addrs[i], size)
    return True


# ---------------------------------------------------------------- xxh3-128 of many ranges (digests)

#: the name compiled code calls python-xxhash's own ``XXH3_128bits`` by (registered below): one C call
#: per tensor from a compiled loop, the GIL released, instead of one Python call per tensor
_XXH3_SYMBOL = "deltasync_xxh3_128bits"


def _register_xxh3() -> bool:
    """Make ``XXH3_128bits`` of the xxhash extension already imported callable from compiled code.
    False where that extension does not export it (the caller then hashes through python-xxhash)."""
    import ctypes
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return False  # the struct return below is {i64, i64} in registers on these two only
    try:
        import llvmlite.binding as llvm
        import xxhash._xxhash as ext

        fn = ctypes.CDLL(ext.__file__).XXH3_128bits
    except (ImportError, OSError, AttributeError):
        return False
    llvm.add_symbol(_XXH3_SYMBOL, ctypes.cast(fn, ctypes.c_void_p).value)
    return True


HAVE_XXH3 = _register_xxh3()


def _xxh3_typer(typingctx: Any, addr: Any, n: Any) -> Any:
    """``XXH3_128bits(addr, n)`` as (low64, high64) (an intrinsic: XXH128_hash_t is two uint64
    returned in registers)."""
    from llvmlite import ir

    sig = types.UniTuple(types.uint64, 2)(types.intp, types.intp)  # type: ignore[no-untyped-call]

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(ir.LiteralStructType([i64, i64]), [ir.IntType(8).as_pointer(), i64])
        fn = builder.module.globals.get(_XXH3_SYMBOL) or ir.Function(builder.module, fnty, _XXH3_SYMBOL)
        res = builder.call(fn, [builder.inttoptr(args[0], ir.IntType(8).as_pointer()), args[1]])
        lo, hi = builder.extract_value(res, 0), builder.extract_value(res, 1)
        return context.make_tuple(builder, signature.return_type, [lo, hi])

    return sig, codegen


_xxh3: Any = intrinsic(_xxh3_typer)


@_jit
def xxh3_ranges(addrs: Arr, lens: Arr, lo: int, hi: int, out: Arr) -> None:
    """The xxh3-128 of the ``lens[i]`` bytes at host address ``addrs[i]``, for ``lo <= i < hi``, into
    ``out[i]`` as (high64, low64): the canonical (big-endian) digest's two halves. The caller keeps
    the memory alive and vouches for the sizes: this reads raw memory."""
    for i in range(lo, hi):
        d = _xxh3(addrs[i], lens[i])
        out[i, 0] = d[1]
        out[i, 1] = d[0]
