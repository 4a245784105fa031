# SPDX-License-Identifier: Apache-2.0
"""Compiled loops of the planner and of packing (numba).

Scheduler side, for planner.plan_blocks, planner.plan_around_cache and
packing.pack_requests: each one pass over the planned requests' blocks, and
one over their tokens, where the NumPy versions made a dozen passes and sorts
over every block and token (the paper names planner CPU time as vToken's
dominant cost; in a step, each NumPy call also starts cold). Same rules, same
output, the docstrings of those functions being the spec; the loop
references in tests/runtime/test_planner.py check all three. Imported only with
vToken on; compiled at import, as table_kernels.py is.
"""

from __future__ import annotations

import numba
import numpy as np

_i64, _i32 = numba.int64[::1], numba.int32[::1]
_jit = {"cache": True, "nogil": True}

# pack's error codes (>= 0: none): the wrapper raises with the message.
NO_ROOM, DST_IS_SRC, NO_PLAN, FOREIGN = -1, -2, -3, -4


@numba.njit(nogil=True, inline="always")
def _sort_small(cand, key, c, width, count, out):
    """out[:c] = cand[:c] by key (each in [0, width)), ties in input order: a
    counting sort; `count` is scratch of >= width + 1 entries."""
    count[: width + 1] = 0
    for t in range(c):
        count[key[t] + 1] += 1
    for v in range(width):
        count[v + 1] += count[v]
    for t in range(c):
        out[count[key[t]]] = cand[t]
        count[key[t]] += 1


@numba.njit(
    numba.types.Tuple((_i64, _i32, _i64, numba.boolean[::1], _i64, _i64))(
        _i64, _i64, _i64, _i64, _i32, numba.int64, numba.int64
    ),
    **_jit,
)
def candidate_blocks(ids, counts, head_len, code, block_live, null_id, block_size):
    """(req_indptr, block_ids, live, cached, entry, prio): the blocks a plan
    may take tokens out of or put them into (BlockReclaimer.plan).

    Request r's full blocks are entries [0, counts[r]) of its list, `ids`
    holding them request after request; its first head_len[r] entries are
    the ones vLLM may have cached, `code` = ref_cnt * 2 + (hash set) of each
    (read off vLLM's objects, request after request). Kept: not null, not
    full (live < block_size), not shared (a head entry's ref_cnt is 1). Per
    kept block: its `entry` in the list, `cached` (a head entry with a hash)
    and the destination priority `prio`: 0 uncached, else 1 + (the largest
    kept entry) - entry, so the end of a hash chain is written first."""
    num_req, n = counts.size, ids.size
    req_indptr = np.zeros(num_req + 1, np.int64)
    out_ids, live = np.empty(n, np.int32), np.empty(n, np.int64)
    cached, entry = np.zeros(n, np.bool_), np.empty(n, np.int64)
    j = h = k = last = 0
    for r in range(num_req):
        for e in range(counts[r]):
            b = ids[j]
            j += 1
            c = code[h + e] if e < head_len[r] else 2  # past the head: unshared
            n_live = block_live[b]
            if b != null_id and c >> 1 == 1 and n_live < block_size:
                out_ids[k], live[k], entry[k] = b, n_live, e
                cached[k] = c & 1
                last = max(last, e)
                k += 1
        h += head_len[r]
        req_indptr[r + 1] = k
    prio = np.zeros(k, np.int64)
    for q in range(k):
        if cached[q]:
            prio[q] = 1 + last - entry[q]
    return req_indptr, out_ids[:k], live[:k], cached[:k], entry[:k], prio


@numba.njit(nogil=True, inline="always")
def _take_destinations(order, c, need, ids, live, B, dst_ids, d_out):
    """Appends to dst_ids (from d_out) the blocks order[:c] in turn, as many
    as `need` moved tokens take (their holes: B - live); returns d_out."""
    t = 0
    while need > 0 and t < c:
        j = order[t]
        dst_ids[d_out] = ids[j]
        d_out += 1
        need -= B - live[j]
        t += 1
    return d_out


@numba.njit(
    numba.types.Tuple((_i64, _i64, _i32, _i64, _i32))(
        _i64, _i32, _i64, _i64, numba.boolean, numba.int64, numba.int64
    ),
    **_jit,
)
def plan_in_place(indptr, ids, live, prio, has_prio, block_size, lim):
    """plan_blocks' rule per request: sources its `k` sparsest candidates
    (live < lim; ties: input order), k = min(candidates, holes // B);
    destinations its other blocks with a hole by (prio, B - live, input
    order), as many as the sources' live tokens need (prio read only when
    `has_prio`). Returns (req_index, src_indptr, src_block_ids, dst_indptr,
    dst_block_ids)."""
    B, num_req, n = block_size, indptr.size - 1, ids.size
    req_index = np.zeros(num_req, np.int64)
    src_ptr, dst_ptr = np.zeros(num_req + 1, np.int64), np.zeros(num_req + 1, np.int64)
    src_ids, dst_ids = np.empty(n, np.int32), np.empty(n, np.int32)
    is_src = np.zeros(n, np.bool_)
    cand, key, order = (
        np.empty(n, np.int64),
        np.empty(n, np.int64),
        np.empty(n, np.int64),
    )
    count = np.empty(B + 2, np.int64)
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
        _sort_small(cand, key, c, B + 1, count, order)  # sparsest first
        need = 0
        for t in range(num_src):
            j = order[t]
            is_src[j] = True
            src_ids[s_out] = ids[j]
            s_out += 1
            need += live[j]
        c = 0
        for j in range(lo, hi):
            if live[j] < B and not is_src[j]:
                cand[c], key[c] = j, B - live[j]
                if has_prio:
                    key[c] += prio[j] * (B + 1)
                c += 1
        if has_prio:
            perm = np.argsort(key[:c], kind="mergesort")  # stable
            for t in range(c):
                order[t] = cand[perm[t]]
        else:
            _sort_small(cand, key, c, B + 1, count, order)  # densest first
        d_out = _take_destinations(order, c, need, ids, live, B, dst_ids, d_out)
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
    numba.types.Tuple((_i64, _i64, _i32, _i64, _i32, _i64))(
        _i64, _i32, _i64, numba.boolean[::1], numba.int64, numba.int64
    ),
    **_jit,
)
def plan_cached(indptr, ids, live, cached, block_size, lim):
    """plan_around_cache's rule per request, blocks [indptr[r], indptr[r+1]):
    with U its uncached blocks (H_U holes, c_U candidates: live < lim) and
    its cached candidates sparsest first (ties: input order), the first k of
    them (m live tokens) emptied frees gain(k) = k + min(c_U, max(0, H_U -
    m) // B) - ceil(max(0, m - H_U) / B) blocks; the largest gain, the
    shortest k for it, k > 0 only where it beats k = 0, planned if at least
    one. Sources: those k, then U's min(c_U, max(0, H_U - m) // B) sparsest
    candidates; destinations: U's other blocks with a hole, densest first,
    as many as the sources' live tokens need; then ceil(max(0, m - H_U) / B)
    fresh blocks. Returns (req_index, src_indptr, src_block_ids, dst_indptr,
    dst_block_ids, num_fresh)."""
    B, num_req, n = block_size, indptr.size - 1, ids.size
    req_index, num_fresh = np.zeros(num_req, np.int64), np.zeros(num_req, np.int64)
    src_ptr, dst_ptr = np.zeros(num_req + 1, np.int64), np.zeros(num_req + 1, np.int64)
    src_ids, dst_ids = np.empty(n, np.int32), np.empty(n, np.int32)
    is_src = np.zeros(n, np.bool_)
    cand, key = np.empty(n, np.int64), np.empty(n, np.int64)
    c_order, u_order = np.empty(n, np.int64), np.empty(n, np.int64)
    count = np.empty(B + 2, np.int64)
    k_out = s_out = d_out = 0
    for r in range(num_req):
        lo, hi = indptr[r], indptr[r + 1]
        holes = cand_u = 0
        for j in range(lo, hi):
            if not cached[j]:
                holes += B - live[j]
                cand_u += live[j] < lim
        # The cached candidates, sparsest first; the gain of emptying each
        # prefix of them (k_c = 0: the plan over U alone).
        c = 0
        for j in range(lo, hi):
            if cached[j] and live[j] < lim:
                cand[c], key[c] = j, live[j]
                c += 1
        _sort_small(cand, key, c, B + 1, count, c_order)
        best = min(cand_u, holes // B)
        k_c = m_c = m = 0
        for k in range(1, c + 1):
            m += live[c_order[k - 1]]
            slack = holes - m
            g = k + min(cand_u, max(slack, 0) // B) - (max(-slack, 0) + B - 1) // B
            if g > best:
                best, k_c, m_c = g, k, m
        if best < 1:
            continue
        k_u = min(cand_u, max(holes - m_c, 0) // B)
        c = 0
        for j in range(lo, hi):
            if not cached[j] and live[j] < lim:
                cand[c], key[c] = j, live[j]
                c += 1
        _sort_small(cand, key, c, B + 1, count, u_order)
        need = 0
        for t in range(k_c + k_u):  # the cached sources first
            j = c_order[t] if t < k_c else u_order[t - k_c]
            is_src[j] = True
            src_ids[s_out] = ids[j]
            s_out += 1
            need += live[j]
        c = 0
        for j in range(lo, hi):
            if not cached[j] and not is_src[j] and live[j] < B:
                cand[c], key[c] = j, B - live[j]
                c += 1
        _sort_small(cand, key, c, B + 1, count, u_order)  # densest first
        d_out = _take_destinations(u_order, c, need, ids, live, B, dst_ids, d_out)
        req_index[k_out] = r
        num_fresh[k_out] = (max(m_c - holes, 0) + B - 1) // B
        k_out += 1
        src_ptr[k_out], dst_ptr[k_out] = s_out, d_out
    return (
        req_index[:k_out],
        src_ptr[: k_out + 1],
        src_ids[:s_out],
        dst_ptr[: k_out + 1],
        dst_ids[:d_out],
        num_fresh[:k_out],
    )


@numba.njit(
    numba.types.Tuple((_i64, _i64, _i64, _i64, numba.int64))(*[_i64] * 5), **_jit
)
def ack_entries(kept, src_ptr, fresh_ptr, src_at, src_ids):
    """What freeing the sources of a batch's acknowledged parts `kept`
    (ascending) takes (BlockReclaimer.release_sources): (src, seg, at, ids,
    num_fresh): the positions in the batch of those parts' sources, in batch
    order; the sources still in their lists (a part's sources past its first
    fresh_ptr[k + 1] - fresh_ptr[k], which fresh blocks displaced) by part
    `seg`, their entries `at` ascending within a part (list order) and ids;
    and the parts' fresh blocks. One call where the NumPy took ~25."""
    n = 0
    for k in kept:
        n += src_ptr[k + 1] - src_ptr[k]
    src = np.empty(n, np.int64)
    seg, at, ids = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
    i = m = num_fresh = 0
    for k in kept:
        lo, hi = src_ptr[k], src_ptr[k + 1]
        for j in range(lo, hi):
            src[i] = j
            i += 1
        nf = fresh_ptr[k + 1] - fresh_ptr[k]
        num_fresh += nf
        base = m
        for j in range(lo + nf, hi):  # insertion by entry: a few a part
            e, w = src_at[j], m
            while w > base and at[w - 1] > e:
                at[w], ids[w] = at[w - 1], ids[w - 1]
                w -= 1
            at[w], ids[w], seg[m] = e, src_ids[j], k
            m += 1
    return src, seg[:m], at[:m], ids[:m], num_fresh


@numba.njit(
    numba.types.Tuple((numba.int64, *[_i64] * 4))(*[_i64] * 8, *[numba.int64] * 2),
    **_jit,
)
def pack(
    indptr, idx, slots, req_index, src_ptr, src, dst, dst_ptr, shift, num_blocks,
):  # fmt: skip
    """pack_requests' moves: planned request k's tokens in its sources (its
    plan's src[src_ptr[k]:src_ptr[k + 1]]) go, in logical order, to the free
    slots (no live token of `slots` holds them) of its destinations
    dst[dst_ptr[k]:dst_ptr[k + 1]], first destination first, offsets
    ascending. A request's sources and destinations hold its own tokens only
    (the planner plans a request's unshared blocks), which is checked.

    One pass over the planned requests' tokens marks the held slots and
    writes the tokens in sources out in logical order; then, request by
    request, its destinations' free slots are zipped with them. Blocks of
    1 << shift slots (arena.block_shift). Returns (status, indptr, idx,
    src_slots, dst_slots): status >= 0, or an error code (NO_ROOM ...
    FOREIGN) with the planned request or the token it concerns in indptr[0].

    The token pass is bound by its random reads (a block's tag, a slot's
    held flag), hence one tag per block for owner and role, and no scratch
    list of moving positions or free slots to write and read back."""
    B, num_req, K = 1 << shift, indptr.size - 1, req_index.size
    none = np.zeros(1, np.int64)
    # Planned block -> 2k + 1 (a source of planned request k) or 2k (one of
    # its destinations); -1: in no plan.
    tag = np.full(num_blocks, -1, np.int32)
    for k in range(K):
        for b in src[src_ptr[k] : src_ptr[k + 1]]:
            tag[b] = 2 * k + 1
    for k in range(K):
        for b in dst[dst_ptr[k] : dst_ptr[k + 1]]:
            if tag[b] > 0 and tag[b] & 1:
                none[0] = b
                return DST_IS_SRC, none, none, none, none
            tag[b] = 2 * k
    planned = np.full(num_req, -1, np.int64)
    n_planned = 0
    for k in range(K):
        planned[req_index[k]] = k
        n_planned += indptr[req_index[k] + 1] - indptr[req_index[k]]
    for r in range(num_req):  # no other request's token in a planned block
        if planned[r] < 0:
            for t in range(indptr[r], indptr[r + 1]):
                if tag[slots[t] >> shift] >= 0:
                    none[0] = t
                    return NO_PLAN, none, none, none, none
    held = np.zeros(num_blocks * B, np.bool_)  # read at destinations only
    out_idx, out_src = np.empty(n_planned, np.int64), np.empty(n_planned, np.int64)
    out_ptr = np.zeros(K + 1, np.int64)
    m = 0
    for k in range(K):  # held slots and moving tokens, request by request
        r = req_index[k]
        for t in range(indptr[r], indptr[r + 1]):
            s = slots[t]
            g = tag[s >> shift]
            if g >= 0:
                if g >> 1 != k:
                    none[0] = t
                    return FOREIGN, none, none, none, none
                held[s] = True
                out_idx[m], out_src[m] = idx[t], s  # kept when in a source
                m += g & 1
        out_ptr[k + 1] = m
    out_dst = np.empty(m, np.int64)
    for k in range(K):  # moves in logical order, into the first free slots
        j, hi = out_ptr[k], out_ptr[k + 1]
        for d in range(dst_ptr[k], dst_ptr[k + 1]):
            if j == hi:
                break
            first = dst[d] << shift
            for slot in range(first, first + B):
                out_dst[j] = slot  # kept when free (branch-free)
                j += not held[slot]
                if j == hi:
                    break
        if j < hi:
            none[0] = k
            return NO_ROOM, none, none, none, none
    # Views of buffers sized for every planned token: a copy would cost a
    # pass, and a batch lives until its ack only.
    return 0, out_ptr, out_idx[:m], out_src[:m], out_dst
