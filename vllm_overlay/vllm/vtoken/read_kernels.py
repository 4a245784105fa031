# SPDX-License-Identifier: Apache-2.0
"""Compiled index build of the CPU read plan, once a step (numba).

Worker side (cpu_attention.build_cpu_read_plan): which requests decode and
which prefill, the padded decode batch's addresses, the order the masses come
back in, and the prefills' keys, in one call. As NumPy this was ~40 Python-
level calls a step, and a call made right after the forward costs ~10x its
warm time (docs/DESIGN.md §10). Imported only with vToken on; compiled at
import, as table_kernels.py is.
"""

from __future__ import annotations

import numba
import numpy as np

_i64, _b1 = numba.int64[::1], numba.boolean[::1]
_i64_2d, _b1_2d = numba.int64[:, ::1], numba.boolean[:, ::1]

# cpu_plan_index's flags: some decode request is read for its scores only,
# or (window scores) has no row that counts, or has fewer keys than the
# widest (padded); every key is read, decodes' only (in order: score_pos
# would be 0..n-1, and is not written).
SCORE_ONLY, UNCOUNTED, PADDED, IN_ORDER = 1, 2, 4, 8


@numba.njit(
    numba.types.Tuple(
        (_i64, _i64, _i64_2d, _i64_2d, _i64, _b1_2d, _i64, _i64, _i64, numba.int64)
    )(_i64, _i64, _i64, _b1, _i64, numba.int64, numba.int64),
    cache=True,
    nogil=True,
)
def cpu_plan_index(q_loc, kv_loc, kv_slots, write, score_rows, shift, num_kv_heads):
    """(decode, others, blk, off, v_rows, valid, score_pos, other_slots,
    other_loc, flags) of a step's read; see CpuReadPlan.

    Request r has queries [q_loc[r], q_loc[r + 1]) and keys kv_slots[kv_loc[r]:
    kv_loc[r + 1]]; one without keys is not read. `decode`: the read requests
    with one query, `others` the rest. Decode request i's keys are padded to the
    widest (`blk`, `off`, `valid` [R, W]; padding repeats kv_slots[0]; `valid`
    is [0, W] when none is padded); v_rows [R * H * W] the same keys as rows
    of the value cache viewed [N * H * B, D].
    A request without queries this call is not read either.
    `score_pos`: every key read, decode requests' first, as positions in
    kv_slots (empty when that is every key in order: flag IN_ORDER; at 1,024
    requests the two unwritten arrays were a fifth of the pass);
    `other_slots` the others' keys, `other_loc` their CSR. `write`
    [R]: whose output the read writes; `score_rows` [R] (or empty): rows that
    count for "window" scores. Blocks of 1 << shift slots (arena.block_shift)."""
    n = q_loc.size - 1
    if n < 0 or kv_loc.size != n + 1 or kv_loc[n] != kv_slots.size or write.size != n:
        raise ValueError("query_start_loc, kv_indptr and kv_slots disagree")
    if kv_loc[0] != 0:
        raise ValueError("kv_indptr does not start at 0")
    if score_rows.size not in (0, n):
        raise ValueError("score_rows is not one per request")
    num_dec = num_oth = width = oth_keys = flags = dec_keys = 0
    narrow = -1  # the fewest keys of a decode request
    for r in range(n):
        nq, nk = q_loc[r + 1] - q_loc[r], kv_loc[r + 1] - kv_loc[r]
        if nq < 0 or nk < 0:
            raise ValueError("query_start_loc or kv_indptr decreases")
        if nk == 0 or nq == 0:  # no keys: vLLM's kernel; no queries: nothing
            continue
        if nk < nq:
            raise ValueError("a request has fewer live slots than queries")
        if nq == 1:
            num_dec += 1
            width = max(width, nk)
            narrow = nk if narrow < 0 else min(narrow, nk)
            dec_keys += nk
            flags |= SCORE_ONLY * (not write[r])
            flags |= UNCOUNTED * (score_rows.size > 0 and score_rows[r] <= 0)
        else:
            num_oth += 1
            oth_keys += nk
    decode, others = np.empty(num_dec, np.int64), np.empty(num_oth, np.int64)
    d = o = 0
    for r in range(n):  # as counted above
        if kv_loc[r + 1] != kv_loc[r] and q_loc[r + 1] != q_loc[r]:
            if q_loc[r + 1] - q_loc[r] == 1:
                decode[d] = r
                d += 1
            else:
                others[o] = r
                o += 1
    H, block_size = num_kv_heads, 1 << shift
    padded = 0 <= narrow < width
    flags |= PADDED * padded
    # Every key read, decodes' in order: score_pos would be 0..n-1 (IN_ORDER).
    in_order = num_oth == 0 and dec_keys == kv_slots.size
    flags |= IN_ORDER * in_order
    blk = np.empty((num_dec, width), np.int64)
    off = np.empty((num_dec, width), np.int64)
    valid = np.empty((num_dec if padded else 0, width), np.bool_)
    v_rows = np.empty(num_dec * H * width, np.int64)
    score_pos = np.empty(0 if in_order else kv_slots.size, np.int64)
    # Row by row through 1-D views, one array a loop: numba vectorizes these
    # loops, not one writing several 2-D arrays with a branch per key (at
    # 1,024 requests of 34 keys, by hand: ~100 -> ~41 us).
    mask, pad = block_size - 1, kv_slots[0] if kv_slots.size else 0
    pad_b, pad_o = pad >> shift, pad & mask
    m = 0
    for i in range(num_dec):
        lo, hi = kv_loc[decode[i]], kv_loc[decode[i] + 1]
        n, b, o, keys = hi - lo, blk[i], off[i], kv_slots[lo:hi]
        for w in range(n):
            b[w] = keys[w] >> shift
            o[w] = keys[w] & mask
        for w in range(n, width):  # padding repeats kv_slots[0]
            b[w] = pad_b
            o[w] = pad_o
        if padded:
            for w in range(n):
                valid[i, w] = True
            for w in range(n, width):
                valid[i, w] = False
        for h in range(H):
            v = v_rows[(i * H + h) * width : (i * H + h + 1) * width]
            for w in range(width):
                v[w] = (b[w] * H + h) * block_size + o[w]
        if not in_order:
            for p in range(lo, hi):
                score_pos[m] = p
                m += 1
    other_slots = np.empty(oth_keys, np.int64)
    other_loc = np.zeros(num_oth + 1, np.int64)
    for i in range(num_oth):
        lo, hi = kv_loc[others[i]], kv_loc[others[i] + 1]
        for p in range(lo, hi):
            other_slots[other_loc[i] + p - lo] = kv_slots[p]
            score_pos[m] = p
            m += 1
        other_loc[i + 1] = other_loc[i] + hi - lo
    score_pos = score_pos[:m]
    return (
        decode, others, blk, off, v_rows, valid, score_pos, other_slots,
        other_loc, flags,
    )  # fmt: skip
