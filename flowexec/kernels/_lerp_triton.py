"""Triton kernels for ``flowexec::lerp`` (imported only when Triton is available).

Every kernel works on a *canonical* view of the broadcast: the output is coalesced into at most
four dims ``(n0, n1, n2, n3)`` and each operand is described by a 4-bit mask of the dims it
keeps (bit 3 = d0 ... bit 0 = d3; a cleared bit means the operand is broadcast along that dim).
Operands are contiguous, so their strides follow from the mask and the sizes alone and are
computed in the kernel instead of being passed (fewer launch arguments).

A program owns one output block: ``(i0, i1)``, a split ``s`` of the rows of d2 (walked
``BM`` rows at a time) and a block ``jn`` of ``BN`` columns of d3. The backward kernel reduces
each gradient over the tile axes its operand broadcasts and writes one partial per
``(r, k)``: ``k`` is the operand's own element, ``r`` numbers the program coordinates along
the dims it broadcasts. Every ``(r, k)`` is written exactly once, so no zero-fill and no
atomics on data are needed and the result is deterministic. A small final kernel reduces
over ``r``.
With ``ATOMIC`` the backward instead adds each program's reduced sums into a buffer that the
forward zeroed (``ZERO``, ``_zero_fill``): no partials and no final pass, but the order of the
additions, and so the last bits, vary from run to run.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dims(M: tl.constexpr, n0, n1, n2, n3):
    """Strides (s0, s1, s2) and element count K of a contiguous operand with keep-mask M."""
    e3 = 1
    e2 = 1
    e1 = 1
    e0 = 1
    if M & 1:
        e3 = n3
    if M & 2:
        e2 = n2
    if M & 4:
        e1 = n1
    if M & 8:
        e0 = n0
    s2 = 0
    s1 = 0
    s0 = 0
    if M & 2:
        s2 = e3
    if M & 4:
        s1 = e2 * e3
    if M & 8:
        s0 = e1 * e2 * e3
    return s0, s1, s2, e0 * e1 * e2 * e3


@triton.jit
def _tile_offsets(M: tl.constexpr, base, rows, cols, s2, VEC: tl.constexpr):
    """Offsets of an operand's tile, shaped by what it keeps: [BM,BN], [BM,1], [1,BN] or scalar.

    Loading a broadcast operand at its own shape (not the full tile) keeps the loads few;
    the arithmetic broadcasts afterwards. ``VEC`` divides the row length of operands that keep
    d3: telling Triton lets it issue vector loads even when n3 is not a multiple of 16.
    """
    if (M & 3) == 3:
        if VEC > 1:
            base = tl.multiple_of(base, VEC)
            rowoff = tl.multiple_of(rows * s2, VEC)
        else:
            rowoff = rows * s2
        offs = base + rowoff[:, None] + cols[None, :]
    elif M & 2:
        offs = base + (rows * s2)[:, None]
    elif M & 1:
        if VEC > 1:
            base = tl.multiple_of(base, VEC)
        offs = base + cols[None, :]
    else:
        offs = base
    return offs


@triton.jit
def _tile_mask(M: tl.constexpr, rm, cm):
    if (M & 3) == 3:
        mask = rm[:, None] & cm[None, :]
    elif M & 2:
        mask = rm[:, None]
    elif M & 1:
        mask = cm[None, :]
    else:
        mask = None
    return mask


@triton.jit
def _to_acc(v, ACC_F64: tl.constexpr):
    """Loaded values in the accumulation type: float32, or float64 for float64 tensors."""
    if ACC_F64:
        return v.to(tl.float64)
    else:
        return v.to(tl.float32)


@triton.jit
def _lerp_values(xv, yv, wv, zero):
    """ATen's two-sided formula (exact at both ends: w = 0 gives x, w = 1 gives y), broadcast to
    the shape of ``zero``, a zero tensor in the accumulation type."""
    d = yv - xv
    return tl.where(tl.abs(wv) < 0.5, xv + wv * d, yv - d * (1.0 - wv)) + zero


@triton.jit
def _load(ptr, M: tl.constexpr, base, rows, cols, s2, rm, cm, VEC: tl.constexpr, ACC_F64: tl.constexpr,
          FULL: tl.constexpr, EVICT: tl.constexpr = False):
    """Load an operand's tile as float32 (float64 for ACC_F64), zero outside the masks.

    With ``FULL`` an operand that keeps only one of d2, d3 is loaded as a whole [BM, BN] tile with
    stride 0 along the other: its repeated elements come from L1, and the tile then has the
    same register layout as the full operands, so combining them needs no layout conversion
    through shared memory (on sm_90 the case-3 backward's loop had 6 barriers for that).
    """
    if FULL and (M & 3) == 1:
        if VEC > 1:
            base = tl.multiple_of(base, VEC)
        offs = base + (rows * 0)[:, None] + cols[None, :]
        if EVICT:
            v = tl.load(ptr + offs, mask=rm[:, None] & cm[None, :], other=0.0, eviction_policy="evict_first")
        else:
            v = tl.load(ptr + offs, mask=rm[:, None] & cm[None, :], other=0.0)
    elif FULL and (M & 3) == 2:
        offs = base + (rows * s2)[:, None] + (cols * 0)[None, :]
        v = tl.load(ptr + offs, mask=rm[:, None] & cm[None, :], other=0.0)
    elif (M & 3) == 0:
        v = tl.load(ptr + _tile_offsets(M, base, rows, cols, s2, VEC))
    elif EVICT and (M & 3) == 3:  # streamed once: leave L2 to the operands that are reused
        v = tl.load(ptr + _tile_offsets(M, base, rows, cols, s2, VEC), mask=_tile_mask(M, rm, cm), other=0.0,
                    eviction_policy="evict_first")
    else:
        v = tl.load(ptr + _tile_offsets(M, base, rows, cols, s2, VEC), mask=_tile_mask(M, rm, cm), other=0.0)
    return _to_acc(v, ACC_F64)


@triton.jit
def _divmod(n, d, m, l, FAST: tl.constexpr):
    """``n // d`` and ``n % d`` for a program index ``0 <= n < 2**31`` and a divisor the plan fixes.

    FAST: with the plan's magic multiplier ``m`` (an unsigned 32-bit number's bits, passed as
    int32) and shift ``l`` (``magic_div`` in lerp.py): a multiply-high, an add and a shift, where
    a runtime division is a ~20-instruction chain through the reciprocal unit that sat before
    every program's first load."""
    if FAST:
        nu = tl.cast(n, tl.uint32, bitcast=True)
        t = tl.umulhi(nu, tl.cast(m, tl.uint32, bitcast=True))
        q = tl.cast((t + nu) >> tl.cast(l, tl.uint32), tl.int32, bitcast=True)
        return q, n - q * d
    else:
        return n // d, n % d


@triton.jit
def _program_coords(n1, S, NB3, m_nb3, l_nb3, m_s, l_s, m_n1, l_n1, REV: tl.constexpr = False,
                    FLAT: tl.constexpr = False, FASTDIV: tl.constexpr = 0):
    # Column blocks vary fastest so neighbouring programs touch neighbouring memory. REV walks
    # the programs from the end: a backward that runs in several waves then starts on what the
    # forward read last, still in L2. FLAT (n0 = n1 = n2 = 1, the same-shape and scalar-weight
    # cases): the program is its column block, and no divisions delay the first load. FASTDIV:
    # bits 1, 2, 4 say which of NB3, S, n1 to divide by with magic multipliers (the plan sets a
    # bit only for a divisor above 1; one equal to 1 becomes a constant and its division folds).
    pid = tl.program_id(0)
    if REV:
        pid = tl.num_programs(0) - 1 - pid
    if FLAT:
        return pid * 0, pid * 0, pid * 0, pid
    t, jn = _divmod(pid, NB3, m_nb3, l_nb3, FASTDIV & 1)
    t, s = _divmod(t, S, m_s, l_s, FASTDIV & 2)
    i0, i1 = _divmod(t, n1, m_n1, l_n1, FASTDIV & 4)
    return i0, i1, s, jn


@triton.jit
def _scalar_weight(w_hi, w_lo, ACC_F64: tl.constexpr):
    # Python floats reach Triton as fp32; float64 gets hi + lo so the weight keeps ~48 bits.
    if ACC_F64:
        w = tl.cast(w_hi, tl.float64) + tl.cast(w_lo, tl.float64)
    else:
        w = w_hi
    return w


@triton.jit
def _int64(a, b, c, d):
    """Sizes in 64 bits for a big tensor: their products (strides) pass 2**31 with several planes.
    tl.cast, not .to: Triton turns an integer argument equal to 1 into a constant."""
    return tl.cast(a, tl.int64), tl.cast(b, tl.int64), tl.cast(c, tl.int64), tl.cast(d, tl.int64)


@triton.jit
def _program_setup(MX: tl.constexpr, MY: tl.constexpr, MW: tl.constexpr, n0, n1, n2, n3, S, NB3, rows_per_split,
                   m_nb3, l_nb3, m_s, l_s, m_n1, l_n1,
                   VEC: tl.constexpr, BIG: tl.constexpr, BN: tl.constexpr, REV: tl.constexpr = False,
                   FLAT: tl.constexpr = False, EVEN: tl.constexpr = False, FASTDIV: tl.constexpr = 0):
    """What forward and backward programs both start from: coordinates; each operand's row
    stride, element count and base offset; the columns (and their mask) and rows it owns."""
    i0, i1, s, jn = _program_coords(n1, S, NB3, m_nb3, l_nb3, m_s, l_s, m_n1, l_n1, REV, FLAT, FASTDIV)
    if VEC > 1:
        # n3 % VEC == 0, written so that Triton can see it: row starts and the column mask are
        # then known to be VEC-aligned and masked loads vectorize (a hint on an argument is lost).
        n3 = (n3 // VEC) * VEC
    if BIG:
        i0 = i0.to(tl.int64)
        i1 = i1.to(tl.int64)
        jn = jn.to(tl.int64)  # jn * BN passes 2**31 in a long flat row
        n0, n1, n2, n3 = _int64(n0, n1, n2, n3)
    sx0, sx1, sx2, kx = _dims(MX, n0, n1, n2, n3)
    sy0, sy1, sy2, ky = _dims(MY, n0, n1, n2, n3)
    sw0, sw1, sw2, kw = _dims(MW, n0, n1, n2, n3)
    so0, so1, so2, ko = _dims(15, n0, n1, n2, n3)
    cols = jn * BN + tl.arange(0, BN)
    row_lo = s * rows_per_split
    return (i0, i1, s, jn, sx2, sy2, sw2, so2, kx, ky, kw,
            i0 * sx0 + i1 * sx1, i0 * sy0 + i1 * sy1, i0 * sw0 + i1 * sw1, i0 * so0 + i1 * so1,
            cols, _col_mask(cols, n3, BN, EVEN), row_lo, tl.minimum(row_lo + rows_per_split, n2))


@triton.jit
def _col_mask(cols, n3, BN: tl.constexpr, EVEN: tl.constexpr):
    # EVEN (flat, and BN divides n3): every tile is whole, and a constant mask lets Triton drop
    # the predicates from the loads and stores.
    if EVEN:
        return tl.full([BN], 1, tl.int1)
    else:
        return cols < n3


@triton.jit
def _row_tile(r0, row_hi, BM: tl.constexpr, BIG: tl.constexpr, EVEN: tl.constexpr = False):
    """The BM rows from r0 and their mask (EVEN: the single row of a flat program, always valid)."""
    rows = r0 + tl.arange(0, BM)
    if BIG:
        rows = rows.to(tl.int64)
    if EVEN:
        return rows, tl.full([BM], 1, tl.int1)
    else:
        return rows, rows < row_hi


@triton.jit
def _zero_fill(acc_ptr, n_acc, ZB: tl.constexpr = 1024):
    """Zero ``acc_ptr[:n_acc]``, ``ZB`` elements a program (few programs do any): the buffer the
    backward of this call adds its reduced gradients into with atomics."""
    pid = tl.program_id(0)
    for z0 in range(pid * ZB, n_acc, tl.num_programs(0) * ZB):
        zo = z0 + tl.arange(0, ZB)
        tl.store(acc_ptr + zo, tl.zeros([ZB], acc_ptr.dtype.element_ty), mask=zo < n_acc)


@triton.jit
def _lerp_fwd_kernel(
    x_ptr, y_ptr, w_ptr, out_ptr, w_hi, w_lo,
    n0, n1, n2, n3, S, NB3, rows_per_split, m_nb3, l_nb3, m_s, l_s, m_n1, l_n1,
    MX: tl.constexpr, MY: tl.constexpr, MW: tl.constexpr, W_SCALAR: tl.constexpr,
    ACC_F64: tl.constexpr, BIG: tl.constexpr, VEC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    FULL: tl.constexpr, STREAM: tl.constexpr, FLAT: tl.constexpr, EVEN: tl.constexpr, FASTDIV: tl.constexpr,
    EVICT: tl.constexpr,
    acc_ptr, n_acc, ZERO: tl.constexpr,
):
    # EVICT: bits (x 1, y 2, w 4) of the output-sized operands loaded evict-first.
    i0, i1, s, jn, sx2, sy2, sw2, so2, kx, ky, kw, bx, by, bw, bo, cols, cm, row_lo, row_hi = _program_setup(
        MX, MY, MW, n0, n1, n2, n3, S, NB3, rows_per_split, m_nb3, l_nb3, m_s, l_s, m_n1, l_n1,
        VEC, BIG, BN, False, FLAT, EVEN, FASTDIV)
    if W_SCALAR:
        w_s = _scalar_weight(w_hi, w_lo, ACC_F64)
    for r0 in range(row_lo, row_hi, BM):
        rows, rm = _row_tile(r0, row_hi, BM, BIG, EVEN)
        xv = _load(x_ptr, MX, bx, rows, cols, sx2, rm, cm, VEC, ACC_F64, FULL, (EVICT & 1) != 0)
        yv = _load(y_ptr, MY, by, rows, cols, sy2, rm, cm, VEC, ACC_F64, FULL, (EVICT & 2) != 0)
        if W_SCALAR:
            wv = w_s
        else:
            wv = _load(w_ptr, MW, bw, rows, cols, sw2, rm, cm, VEC, ACC_F64, FULL, (EVICT & 4) != 0)
        res = _lerp_values(xv, yv, wv, _to_acc(tl.zeros([BM, BN], tl.float32), ACC_F64))
        offs = _tile_offsets(15, bo, rows, cols, so2, VEC)
        if STREAM:  # written once, read by nobody soon: do not keep it in the caches
            tl.store(out_ptr + offs, res, mask=rm[:, None] & cm[None, :], cache_modifier=".cs")
        else:
            tl.store(out_ptr + offs, res, mask=rm[:, None] & cm[None, :])
    if ZERO:  # after the tile: a store ahead of the loads would hold them back (they may alias)
        _zero_fill(acc_ptr, n_acc)


@triton.jit
def _plane_load(ptr, M: tl.constexpr, i0, i1, n0, n1, n2, plane, e, row, col, m, N3: tl.constexpr,
                ACC_F64: tl.constexpr):
    """An operand's values at plane positions ``e`` (rows ``row``, columns ``col``) of (i0, i1)."""
    if (M & 3) == 3:
        # Its planes are contiguous and ``plane`` long: written from ``plane`` so that Triton sees
        # the base's alignment and the loads vectorize.
        base = i0 * 0
        if M & 4:
            base = i1 * plane
        if M & 8:
            if M & 4:
                base = base + i0 * (n1 * plane)
            else:
                base = base + i0 * plane
        v = tl.load(ptr + base + e, mask=m, other=0.0)
    else:
        s0, s1, s2, k = _dims(M, n0, n1, n2, N3)
        base = i0 * s0 + i1 * s1
        if M & 2:
            v = tl.load(ptr + base + row * s2, mask=m, other=0.0)
        elif M & 1:
            v = tl.load(ptr + base + col, mask=m, other=0.0)
        else:
            v = tl.load(ptr + base)
    return _to_acc(v, ACC_F64)


@triton.jit
def _lerp_fwd_plane_kernel(
    x_ptr, y_ptr, w_ptr, out_ptr, w_hi, w_lo,
    n0, n1, n2, plane, NBP, m_nbp, l_nbp, m_n1, l_n1,
    MX: tl.constexpr, MY: tl.constexpr, MW: tl.constexpr, W_SCALAR: tl.constexpr,
    ACC_F64: tl.constexpr, BIG: tl.constexpr, VECP: tl.constexpr, N3: tl.constexpr, BLOCK: tl.constexpr,
    STREAM: tl.constexpr, FASTDIV: tl.constexpr, acc_ptr, n_acc, ZERO: tl.constexpr,
):
    """The forward over each (i0, i1) plane of d2 x d3 walked flat, ``BLOCK`` elements a program.

    For row lengths that leave part of a power-of-two tile idle (case 3: 244 of 256): the
    output and full operands are read as one contiguous run; an operand that keeps only rows or
    only columns is gathered through ``e // N3`` and ``e % N3``, cheap with ``N3`` a constant.
    """
    t, c = _divmod(tl.program_id(0), NBP, m_nbp, l_nbp, FASTDIV & 1)
    i0, i1 = _divmod(t, n1, m_n1, l_n1, FASTDIV & 2)
    if BIG:
        i0 = i0.to(tl.int64)
        i1 = i1.to(tl.int64)
        c = c.to(tl.int64)
        n0, n1, n2, plane = _int64(n0, n1, n2, plane)
    if VECP > 1:
        plane = (plane // VECP) * VECP  # plane % VECP == 0, said so that Triton can see it
    e = c * BLOCK + tl.arange(0, BLOCK)
    m = e < plane
    row = e // N3
    col = e - row * N3
    xv = _plane_load(x_ptr, MX, i0, i1, n0, n1, n2, plane, e, row, col, m, N3, ACC_F64)
    yv = _plane_load(y_ptr, MY, i0, i1, n0, n1, n2, plane, e, row, col, m, N3, ACC_F64)
    if W_SCALAR:
        wv = _scalar_weight(w_hi, w_lo, ACC_F64)
    else:
        wv = _plane_load(w_ptr, MW, i0, i1, n0, n1, n2, plane, e, row, col, m, N3, ACC_F64)
    res = _lerp_values(xv, yv, wv, _to_acc(tl.zeros([BLOCK], tl.float32), ACC_F64))
    offs = (i0 * n1 + i1) * plane + e
    if STREAM:
        tl.store(out_ptr + offs, res, mask=m, cache_modifier=".cs")
    else:
        tl.store(out_ptr + offs, res, mask=m)
    if ZERO:
        _zero_fill(acc_ptr, n_acc)


@triton.jit
def _reduce_rows(src, dst, P, K, kb, FBR: tl.constexpr, FBK: tl.constexpr, ACC_F64: tl.constexpr):
    """dst[k] = sum_r src[r, k] for the FBK columns of block kb (src is [P, K], row-major)."""
    ks = kb * FBK + tl.arange(0, FBK)
    km = ks < K
    if ACC_F64:
        acc = tl.zeros([FBK], tl.float64)
    else:
        acc = tl.zeros([FBK], tl.float32)
    for r0 in range(0, P, FBR):
        rs = r0 + tl.arange(0, FBR)
        # .cg: partials were written by other programs; read them from L2, never a stale L1.
        v = tl.load(src + rs[:, None] * K + ks[None, :], mask=(rs < P)[:, None] & km[None, :], other=0.0,
                    cache_modifier=".cg")
        acc += tl.sum(v, axis=0)
    tl.store(dst + ks, acc, mask=km)


@triton.jit
def _put(dst_ptr, part_ptr, off_p, offs, v, mask, RED: tl.constexpr, ATOMIC: tl.constexpr,
         EVICT: tl.constexpr = False):
    """Write gradient values at ``offs``: a reduced one (``RED``) is added into its output, which
    the forward zeroed, with atomics (``ATOMIC``) or stored as a partial sum for the final pass;
    any other is stored into its output, as a streaming store with ``EVICT``."""
    if RED and ATOMIC:
        tl.atomic_add(dst_ptr + offs, v, mask=mask, sem="relaxed")
    elif RED:
        tl.store(part_ptr + off_p + offs, v, mask=mask)
    elif EVICT:
        tl.store(dst_ptr + offs, v, mask=mask, cache_modifier=".cs")
    else:
        tl.store(dst_ptr + offs, v, mask=mask)


@triton.jit
def _grad_out(
    gt, acc, dst_ptr, part_ptr, off_p, M: tl.constexpr, RED: tl.constexpr, base, rows, cols, s2, rm, cm,
    VEC: tl.constexpr, STREAM: tl.constexpr, ATOMIC: tl.constexpr = False,
):
    """Store or accumulate one [BM, BN] gradient tile for an operand with keep-mask M.

    If the operand keeps d2, its rows are distinct elements: reduce over d3 if it broadcasts
    there and store now. Otherwise add the tile into ``acc`` ([BM, BN]) as it is; ``_grad_flush``
    reduces it and writes once after the row loop. Summing across rows here instead would cost a
    cross-warp reduction (shared memory and barriers) per row tile; an elementwise add costs none.
    Rows and columns outside the tile's mask add zero: g is loaded as 0 there.
    """
    if M & 2:
        if M & 1:
            t = gt
        else:
            t = tl.sum(gt, axis=1)[:, None]
        offs = _tile_offsets(M, base, rows, cols, s2, VEC)
        # A full gradient is written once: a streaming store leaves L2 to the inputs.
        _put(dst_ptr, part_ptr, off_p, offs, t, _tile_mask(M, rm, cm), RED, ATOMIC, STREAM and (M & 3) == 3)
    else:
        acc += gt
    return acc


@triton.jit
def _grad_flush(acc, dst_ptr, part_ptr, off_p, M: tl.constexpr, RED: tl.constexpr, base, cols, cm,
                VEC: tl.constexpr, ATOMIC: tl.constexpr = False):
    """Reduce the [BM, BN] accumulator of an operand that broadcasts d2 (over rows, and over
    columns too if it broadcasts d3) and write it: the program's only cross-warp reductions."""
    if (M & 2) == 0:  # masked rows and columns hold zeros
        _flush_cols(tl.sum(acc, axis=0), dst_ptr, part_ptr, off_p, M, RED, base, cols, cm, VEC, ATOMIC)


@triton.jit
def _flush_cols(colsum, dst_ptr, part_ptr, off_p, M: tl.constexpr, RED: tl.constexpr, base, cols, cm,
                VEC: tl.constexpr, ATOMIC: tl.constexpr = False):
    """Write an operand's row-summed [BN] gradient (summed over columns too if it broadcasts d3).

    ``ATOMIC``: add a reduced gradient into its output (zeroed by the forward) with atomics
    instead of writing a partial sum for the final pass."""
    if M & 1:
        _put(dst_ptr, part_ptr, off_p, _tile_offsets(M, base, cols, cols, 0, VEC), colsum[None, :], cm[None, :],
             RED, ATOMIC)
    else:
        _put(dst_ptr, part_ptr, off_p, base, tl.sum(colsum, axis=0), None, RED, ATOMIC)


@triton.jit
def _add_pairs(a0, b0, a1, b1):
    """Combine step of a two-value sum (``tl.reduce`` over a pair of tensors)."""
    return a0 + a1, b0 + b1


@triton.jit
def _partial_row(M: tl.constexpr, i0, i1, s, jn, n0, n1, S, NB3):
    """Index r of this program's partial: its coordinates along the dims the operand broadcasts."""
    r = i0 * 0
    if (M & 8) == 0:
        r = r * n0 + i0
    if (M & 4) == 0:
        r = r * n1 + i1
    if (M & 2) == 0:
        r = r * S + s
    if (M & 1) == 0:
        r = r * NB3 + jn
    return r


@triton.jit
def _lerp_bwd_kernel(
    g_ptr, x_ptr, y_ptr, w_ptr, dx_ptr, dy_ptr, dw_ptr, part_ptr, w_hi, w_lo,
    n0, n1, n2, n3, S, NB3, rows_per_split, m_nb3, l_nb3, m_s, l_s, m_n1, l_n1,
    off_px, off_py, off_pw,
    MX: tl.constexpr, MY: tl.constexpr, MW: tl.constexpr, W_SCALAR: tl.constexpr,
    NEED_X: tl.constexpr, NEED_Y: tl.constexpr, NEED_W: tl.constexpr,
    RED_X: tl.constexpr, RED_Y: tl.constexpr, RED_W: tl.constexpr,
    ACC_F64: tl.constexpr, BIG: tl.constexpr, VEC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    FULL: tl.constexpr, REV: tl.constexpr, FLAT: tl.constexpr,
    EVEN: tl.constexpr, LOADS_FIRST: tl.constexpr, STREAM: tl.constexpr, JOINT: tl.constexpr,
    ATOMIC: tl.constexpr = False, FASTDIV: tl.constexpr = 0,
):
    i0, i1, s, jn, sx2, sy2, sw2, so2, kx, ky, kw, bx, by, bw, bo, cols, cm, row_lo, row_hi = _program_setup(
        MX, MY, MW, n0, n1, n2, n3, S, NB3, rows_per_split, m_nb3, l_nb3, m_s, l_s, m_n1, l_n1,
        VEC, BIG, BN, REV, FLAT, EVEN, FASTDIV)
    # Where this program's partial row starts inside each operand's [P, K] partial block.
    rx = _partial_row(MX, i0, i1, s, jn, n0, n1, S, NB3) * kx
    ry = _partial_row(MY, i0, i1, s, jn, n0, n1, S, NB3) * ky
    rw = _partial_row(MW, i0, i1, s, jn, n0, n1, S, NB3) * kw
    # Row-summed gradients accumulate whole tiles (reduced once, in _grad_flush); an operand
    # that keeps d2 leaves its accumulator untouched and the compiler drops it.
    zero = _to_acc(tl.zeros([BM, BN], tl.float32), ACC_F64)
    acc_x = zero
    acc_y = zero
    acc_w = zero
    if W_SCALAR:
        w_s = _scalar_weight(w_hi, w_lo, ACC_F64)
    for r0 in range(row_lo, row_hi, BM):
        rows, rm = _row_tile(r0, row_hi, BM, BIG, EVEN)
        g = _load(g_ptr, 15, bo, rows, cols, so2, rm, cm, VEC, ACC_F64, FULL, STREAM)
        if NEED_W and LOADS_FIRST:
            # Issue every load before the first store: the compiler cannot move a load above a
            # store to memory that may alias it, so loading x and y after dx/dy were stored costs
            # a second DRAM round trip per row tile.
            xv = _load(x_ptr, MX, bx, rows, cols, sx2, rm, cm, VEC, ACC_F64, FULL)
            yv = _load(y_ptr, MY, by, rows, cols, sy2, rm, cm, VEC, ACC_F64, FULL)
        if NEED_X or NEED_Y:
            if W_SCALAR:
                wv = w_s
            else:
                wv = _load(w_ptr, MW, bw, rows, cols, sw2, rm, cm, VEC, ACC_F64, FULL)
            if NEED_X:
                acc_x = _grad_out(g * (1.0 - wv), acc_x, dx_ptr, part_ptr, off_px + rx, MX, RED_X,
                                  bx, rows, cols, sx2, rm, cm, VEC, STREAM, ATOMIC)
            if NEED_Y:
                acc_y = _grad_out(g * wv, acc_y, dy_ptr, part_ptr, off_py + ry, MY, RED_Y,
                                  by, rows, cols, sy2, rm, cm, VEC, STREAM, ATOMIC)
        if NEED_W:
            if not LOADS_FIRST:
                xv = _load(x_ptr, MX, bx, rows, cols, sx2, rm, cm, VEC, ACC_F64, FULL)
                yv = _load(y_ptr, MY, by, rows, cols, sy2, rm, cm, VEC, ACC_F64, FULL)
            acc_w = _grad_out(g * (yv - xv), acc_w, dw_ptr, part_ptr, off_pw + rw, MW, RED_W,
                              bw, rows, cols, sw2, rm, cm, VEC, STREAM, ATOMIC)
    if JOINT and NEED_X and NEED_W and (MX & 2) == 0 and (MW & 2) == 0:
        # dx and dw both sum over rows (case 3): one two-value reduction, one set of barriers.
        cx, cw = tl.reduce((acc_x, acc_w), 0, _add_pairs)
        _flush_cols(cx, dx_ptr, part_ptr, off_px + rx, MX, RED_X, bx, cols, cm, VEC, ATOMIC)
        _flush_cols(cw, dw_ptr, part_ptr, off_pw + rw, MW, RED_W, bw, cols, cm, VEC, ATOMIC)
    else:
        if NEED_X:
            _grad_flush(acc_x, dx_ptr, part_ptr, off_px + rx, MX, RED_X, bx, cols, cm, VEC, ATOMIC)
        if NEED_W:
            _grad_flush(acc_w, dw_ptr, part_ptr, off_pw + rw, MW, RED_W, bw, cols, cm, VEC, ATOMIC)
    if NEED_Y:
        _grad_flush(acc_y, dy_ptr, part_ptr, off_py + ry, MY, RED_Y, by, cols, cm, VEC, ATOMIC)


@triton.jit
def _lerp_final_kernel(
    part_ptr, dx_ptr, dy_ptr, dw_ptr, off_px, off_py, off_pw, p_x, p_y, p_w, k_x, k_y, k_w,
    RED_X: tl.constexpr, RED_Y: tl.constexpr, RED_W: tl.constexpr, ACC_F64: tl.constexpr,
    FBR: tl.constexpr, FBK: tl.constexpr,
):
    """Separate final pass: programs are split between the operands that have partials."""
    pid = tl.program_id(0)
    nb_x = 0
    nb_y = 0
    if RED_X:
        nb_x = tl.cdiv(k_x, FBK)
    if RED_Y:
        nb_y = tl.cdiv(k_y, FBK)
    if RED_X:
        if pid < nb_x:
            _reduce_rows(part_ptr + off_px, dx_ptr, p_x, k_x, pid, FBR, FBK, ACC_F64)
    if RED_Y:
        if (pid >= nb_x) & (pid < nb_x + nb_y):
            _reduce_rows(part_ptr + off_py, dy_ptr, p_y, k_y, pid - nb_x, FBR, FBK, ACC_F64)
    if RED_W:
        if pid >= nb_x + nb_y:
            _reduce_rows(part_ptr + off_pw, dw_ptr, p_w, k_w, pid - nb_x - nb_y, FBR, FBK, ACC_F64)
