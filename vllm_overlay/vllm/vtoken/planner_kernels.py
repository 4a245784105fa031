# SPDX-License-Identifier: Apache-2.0
"""Compiled loops of the in-place planner and of packing (numba).

Scheduler side, for planner.plan_blocks and packing.pack_requests: each one
pass over the planned requests' blocks, and one over their tokens, where the
NumPy versions made a dozen passes and sorts over every block and token (the
paper names planner CPU time as vToken's dominant cost). Same rules, same
output, the docstrings of those two functions being the spec; the loop
references in tests/runtime/test_planner.py check both. Imported only with
vToken on; compiled at import, as table_kernels.py is.
"""

from __future__ import annotations

import numba
import numpy as np

_i64, _i32 = numba.int64[::1], numba.int32[::1]
_jit = {"cache": True, "nogil": True}

# pack's error codes (>= 0: none): the wrapper raises with the message.
NO_ROOM, DST_IS_SRC, NO_PLAN, FOREIGN = -1, -2, -3, -4


@numba.njit(
    numba.types.Tuple((_i64, _i64, _i32, _i64, _i32))(
        _i64, _i32, _i64, _i64, numba.int64, numba.int64
    ),
    **_jit,
)
def plan_in_place(indptr, ids, live, prio, block_size, lim):
    """plan_blocks' rule per request: sources its `k` sparsest candidates
    (live < lim; ties: input order), k = min(candidates, holes // B);
    destinations its other blocks with a hole by (prio, B - live, input
    order), as many as the sources' live tokens need. Returns (req_index,
    src_indptr, src_block_ids, dst_indptr, dst_block_ids)."""
    B, num_req, n = block_size, indptr.size - 1, ids.size
    req_index = np.zeros(num_req, np.int64)
    src_ptr, dst_ptr = np.zeros(num_req + 1, np.int64), np.zeros(num_req + 1, np.int64)
    src_ids, dst_ids = np.empty(n, np.int32), np.empty(n, np.int32)
    is_src = np.zeros(n, np.bool_)
    cand, key = np.empty(n, np.int64), np.empty(n, np.int64)
    k_out = s_out = d_out = 0
    for r in range(num_req):
        lo, hi = indptr[r], indptr[r + 1]
        holes, c = 0, 0
        for j in range(lo, hi):
            holes += B - live[j]
            if live[j] < lim:
                cand[c], key[c] = j, live[j]
                c += 1
        num_src = min(c, holes // B)
        if num_src == 0:
            continue
        order = np.argsort(key[:c], kind="mergesort")  # stable: input order
        need = 0
        for t in range(num_src):
            j = cand[order[t]]
            is_src[j] = True
            src_ids[s_out] = ids[j]
            s_out += 1
            need += live[j]
        c = 0
        for j in range(lo, hi):
            if live[j] < B and not is_src[j]:
                cand[c], key[c] = j, prio[j] * (B + 1) + (B - live[j])
                c += 1
        order = np.argsort(key[:c], kind="mergesort")
        t = 0
        while need > 0 and t < c:  # as many as the moved tokens need
            j = cand[order[t]]
            dst_ids[d_out] = ids[j]
            d_out += 1
            need -= B - live[j]
            t += 1
        req_index[k_out] = r
        k_out += 1
        src_ptr[k_out], dst_ptr[k_out] = s_out, d_out
    return (
        req_index[:k_out],
        src_ptr[: k_out + 1],
        src_ids[:s_out],
        dst_ptr[: k_out + 1],
        dst_ids[:d_out],
    )


@numba.njit(
    numba.types.Tuple((numba.int64, _i64, _i64, _i64, _i64))(
        _i64, _i64, _i64, _i64, _i64, _i64, _i64, _i64, numba.int64, numba.int64
    ),
    **_jit,
)
def pack(
    indptr, idx, slots, req_index, src_ptr, src, dst, dst_ptr, block_size,
    num_blocks,
):  # fmt: skip
    """pack_requests' moves: planned request k's tokens in its sources (its
    plan's src[src_ptr[k]:src_ptr[k + 1]]) go, in logical order, to the free
    slots (no live token of `slots` holds them) of its destinations
    dst[dst_ptr[k]:dst_ptr[k + 1]], first destination first, offsets
    ascending. Returns (status, indptr, idx, src_slots, dst_slots): status
    >= 0, or an error code (NO_ROOM ... FOREIGN) with the planned request or
    the token it concerns in indptr[0]."""
    B, num_req, K = block_size, indptr.size - 1, req_index.size
    none = np.zeros(1, np.int64)
    owner = np.full(num_blocks, -1, np.int64)  # source block -> planned k
    for k in range(K):
        for b in src[src_ptr[k] : src_ptr[k + 1]]:
            owner[b] = k
    is_dst = np.zeros(num_blocks, np.bool_)
    for b in dst:
        if owner[b] >= 0:
            none[0] = b
            return DST_IS_SRC, none, none, none, none
        is_dst[b] = True
    # One pass over every token: the destinations' held slots, and each
    # planned request's tokens in its sources.
    planned = np.full(num_req, -1, np.int64)
    for k in range(K):
        planned[req_index[k]] = k
    held = np.zeros(num_blocks * B, np.bool_)
    num_moves = np.zeros(K + 1, np.int64)
    for r in range(num_req):
        for t in range(indptr[r], indptr[r + 1]):
            b = slots[t] // B
            if is_dst[b]:
                held[slots[t]] = True
            elif owner[b] >= 0:
                if owner[b] != planned[r]:
                    none[0] = t
                    return (
                        (NO_PLAN if planned[r] < 0 else FOREIGN),
                        none,
                        none,
                        none,
                        none,
                    )
                num_moves[owner[b] + 1] += 1
    out_ptr = np.cumsum(num_moves)
    total = out_ptr[K]
    out_idx, out_src = np.empty(total, np.int64), np.empty(total, np.int64)
    out_dst = np.empty(total, np.int64)
    for k in range(K):
        r, m = req_index[k], out_ptr[k]
        d, end, off = dst_ptr[k], dst_ptr[k + 1], 0
        for t in range(indptr[r], indptr[r + 1]):
            if owner[slots[t] // B] != k:
                continue
            while d < end and held[dst[d] * B + off]:  # the next free slot
                off += 1
                if off == B:
                    d, off = d + 1, 0
            if d == end:
                none[0] = k
                return NO_ROOM, none, none, none, none
            out_idx[m], out_src[m], out_dst[m] = idx[t], slots[t], dst[d] * B + off
            m += 1
            off += 1
            if off == B:
                d, off = d + 1, 0
    return 0, out_ptr, out_idx, out_src, out_dst
