# SPDX-License-Identifier: Apache-2.0
"""Reclamation planner: which blocks to empty, and where their live tokens go.

Scheduler side; pure functions, no state, no Python loop over blocks or tokens
(the paper names planner CPU time as vToken's dominant cost). Three calls:

1. `plan_blocks` (all requests at once): per request, the sparsest blocks whose
   live tokens fit into the holes of the request's other blocks (in place).
2. `plan_around_cache` (all requests at once): the same, but no block the
   prefix cache can serve is written; fresh blocks take what holes cannot.
3. `pack_request` (per planned request): move those live tokens, in logical
   order, into the holes, first destination block first.

In place, a request's dead slots are its destinations, so such a plan never
takes a block from the pool and can never push another request into
preemption. Holes are where evicted tokens were (or the never-written end of a
block an earlier plan filled); the tail block being written, blocks shared with
the prefix cache and blocks with a copy in flight are never sources or
destinations. Example, block_size 4, one request, one block's worth of holes::

    before  block 7: [ a  x  b  c ]   block 3: [ x  d  x  x ]   (x = dead)
    after   block 7: [ a  d  b  c ]   block 3 freed once the copy is acked

Emptying k blocks needs k * block_size holes among the request's blocks, so the
plan frees floor(holes / block_size) blocks (capped by the candidates below the
threshold): as many as any packing can, without a destination from the pool.

A block the prefix cache can serve (it has a hash) stops being servable once a
move writes into it, and so does every later block of the chain (a block's hash
chains on its predecessor's). Evacuation keeps them servable: their live tokens
go to fresh blocks, and the emptied blocks return to vLLM's free queue with
their hash and KV intact, hittable until the pool reuses them (docs/DESIGN.md
§3.3)::

    cached  block 7: [ a  x  b  x ]   block 3: [ x  d  x  c ]
    after   fresh 12: [ a  b  d  c ]  blocks 7, 3 freed, still in the cache
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm.vtoken import integrity


@dataclass(frozen=True, kw_only=True)
class BlockPlan:
    """Per planned request (CSR over `req_index`): blocks to empty, and the
    blocks whose holes receive their live tokens, in order of preference."""

    req_index: np.ndarray  # int64 [K]: indices into the input requests, ascending
    src_indptr: np.ndarray  # int64 [K + 1]: CSR into src_block_ids
    src_block_ids: np.ndarray  # int32 [S]: blocks to empty, freed once acked
    dst_indptr: np.ndarray  # int64 [K + 1]: CSR into dst_block_ids
    dst_block_ids: np.ndarray  # int32 [D]: blocks with holes, densest first
    num_fresh: np.ndarray  # int64 [K]: fresh blocks after the destinations

    @property
    def blocks_freed(self) -> int:
        """Blocks returned to the pool, net, once every plan is acknowledged."""
        return int(self.src_block_ids.size - self.num_fresh.sum())


@dataclass(frozen=True, kw_only=True)
class Moves:
    """KV moves of one request: token idx[i] goes from src_slots[i] to dst_slots[i]."""

    idx: np.ndarray  # int64 [M]: logical token indices, ascending
    src_slots: np.ndarray  # int64 [M]
    dst_slots: np.ndarray  # int64 [M]


def _cumsum_before_in_group(
    rows: np.ndarray, values: np.ndarray, num_groups: int
) -> np.ndarray:
    """For entries grouped by `rows` (non-decreasing): the sum of `values` of
    the earlier entries of the same group (an exclusive cumsum per group)."""
    before = np.cumsum(values) - values
    if rows.size:
        first = np.minimum(np.searchsorted(rows, np.arange(num_groups)), rows.size - 1)
        before -= before[first][rows]
    return before


def _position(values: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """int64: the index in `keys` (distinct) of each value, or -1 if absent."""
    if keys.size == 0:
        return np.full(values.shape, -1, dtype=np.int64)
    order = np.argsort(keys)
    at = order[np.minimum(np.searchsorted(keys[order], values), keys.size - 1)]
    return np.where(keys[at] == values, at, -1)


def _check_csr(indptr: np.ndarray, n: int) -> None:
    assert indptr.ndim == 1 and indptr.size and indptr[0] == 0 and indptr[-1] == n, (
        f"req_indptr must be 1-D, start at 0 and end at {n}"
    )
    assert (np.diff(indptr) >= 0).all(), "req_indptr must be non-decreasing"


def plan_blocks(
    *,
    req_indptr: np.ndarray,
    block_ids: np.ndarray,
    block_live: np.ndarray,
    block_size: int,
    threshold: float,
    dst_priority: np.ndarray | None = None,
) -> BlockPlan:
    """Greedy in-place choice of blocks to compact.

    Per request, with H the holes (block_size - live) over its eligible blocks:
    the sources are its k sparsest candidates (live / block_size < threshold;
    ties keep input order), k = min(candidates, H // block_size); the k blocks'
    live tokens then fit into the holes of the others. Requests with k = 0 get
    no plan. The destinations are the request's other eligible blocks with a
    hole, lowest `dst_priority` first, then densest (ties keep input order),
    as many as the moved tokens need: holes gather in fewer blocks, so the next
    plan moves less.

    Args:
        req_indptr: int [R + 1] CSR over requests of their eligible blocks (the
            caller removed tail blocks, shared blocks and blocks with a copy in
            flight).
        block_ids: int [N] eligible block ids, distinct.
        block_live: int [N] live tokens of each entry of block_ids.
        block_size: Tokens per block (> 0).
        threshold: Utilization below which a block is a candidate, in (0, 1].
        dst_priority: int [N] optional: destinations with a lower value are
            filled first (the caller ranks prefix-cached blocks last).

    Returns:
        The plan; requests without a plan are absent.
    """
    assert 0.0 < threshold <= 1.0 and block_size > 0, (threshold, block_size)
    indptr = np.asarray(req_indptr, dtype=np.int64)
    ids = np.asarray(block_ids)
    live = np.asarray(block_live, dtype=np.int64)
    assert ids.ndim == 1 and live.shape == ids.shape, (ids.shape, live.shape)
    if integrity.CHECK:
        _check_csr(indptr, ids.size)
        assert live.size == 0 or (0 <= live.min() and live.max() <= block_size)
        assert np.unique(ids).size == ids.size, "block_ids repeat a block"

    num_req = indptr.size - 1
    req = np.repeat(np.arange(num_req, dtype=np.int64), np.diff(indptr))
    holes = np.bincount(req, weights=block_size - live, minlength=num_req)
    k = (holes // block_size).astype(np.int64)
    # Rank of each candidate inside its request, sparsest first.
    cand = np.flatnonzero(live / block_size < threshold)
    order = cand[np.lexsort((live[cand], req[cand]))]  # stable
    o_req = req[order]
    rank = _cumsum_before_in_group(o_req, np.ones_like(o_req), num_req)
    is_src = np.zeros(ids.size, dtype=bool)
    is_src[order[rank < k[o_req]]] = True
    planned = np.bincount(req[is_src], minlength=num_req) > 0
    if not planned.any():
        return _empty_plan()
    src = np.flatnonzero(is_src)
    src = src[np.lexsort((live[src], req[src]))]
    dst = np.flatnonzero(~is_src & planned[req] & (live < block_size))
    prio = np.zeros_like(live) if dst_priority is None else np.asarray(dst_priority)
    assert prio.shape == live.shape, (prio.shape, live.shape)
    dst = dst[np.lexsort((block_size - live[dst], prio[dst], req[dst]))]
    fresh = np.zeros(num_req, dtype=np.int64)
    return _plan(ids, live, req, planned, src, dst, fresh, block_size)


def _plan(ids, live, req, planned, src, dst, fresh, block_size) -> BlockPlan:
    """The BlockPlan of entries `src` (sources, grouped by request) and `dst`
    (destinations in order of preference): only as many destinations as the
    moved tokens need; `fresh` [R] fresh blocks after them."""
    num_req = planned.size
    need = np.bincount(req[src], weights=live[src], minlength=num_req)
    before = _cumsum_before_in_group(req[dst], block_size - live[dst], num_req)
    dst = dst[before < need[req[dst]]]
    req_index = np.flatnonzero(planned)
    return BlockPlan(
        req_index=req_index,
        src_indptr=_csr(req[src], req_index),
        src_block_ids=ids[src].astype(np.int32),
        dst_indptr=_csr(req[dst], req_index),
        dst_block_ids=ids[dst].astype(np.int32),
        num_fresh=fresh[req_index],
    )


def _csr(rows: np.ndarray, req_index: np.ndarray) -> np.ndarray:
    """indptr over req_index of `rows` (request of each entry, sorted)."""
    counts = np.bincount(rows, minlength=int(req_index[-1]) + 1)[req_index]
    return np.r_[0, np.cumsum(counts)].astype(np.int64)


def _empty_plan() -> BlockPlan:
    none = np.zeros(0, np.int32)
    return BlockPlan(
        req_index=np.zeros(0, np.int64),
        src_indptr=np.zeros(1, np.int64),
        src_block_ids=none,
        dst_indptr=np.zeros(1, np.int64),
        dst_block_ids=none,
        num_fresh=np.zeros(0, np.int64),
    )


def plan_around_cache(
    *,
    req_indptr: np.ndarray,
    block_ids: np.ndarray,
    block_live: np.ndarray,
    cached: np.ndarray,
    block_size: int,
    threshold: float,
) -> BlockPlan:
    """Like `plan_blocks`, but no cached block is a destination.

    Per request, with U its uncached blocks (H_U holes, c_U candidates) and its
    cached candidates sorted sparsest first: emptying the first k cached ones
    (m live tokens) into U's holes, and fresh blocks past them, frees

        gain(k) = k + min(c_U, floor(max(0, H_U - m) / B)) - ceil(max(0, m - H_U) / B)

    blocks: the k, plus U's sparsest candidates that the holes left over can
    take, minus the fresh blocks. The plan takes the shortest k with the
    largest gain, if that gain is at least one block; k = 0 is `plan_blocks`
    over U alone.

    Args:
        req_indptr, block_ids, block_live, block_size, threshold: as plan_blocks.
        cached: bool [N]: blocks the prefix cache can serve.

    Returns:
        The plan; `num_fresh` fresh blocks follow each request's destinations.
    """
    assert 0.0 < threshold <= 1.0 and block_size > 0, (threshold, block_size)
    B, indptr = block_size, np.asarray(req_indptr, dtype=np.int64)
    ids, cached = np.asarray(block_ids), np.asarray(cached, dtype=bool)
    live = np.asarray(block_live, dtype=np.int64)
    assert live.shape == ids.shape == cached.shape, (ids.shape, cached.shape)
    if integrity.CHECK:
        _check_csr(indptr, ids.size)
    num_req = indptr.size - 1
    req = np.repeat(np.arange(num_req, dtype=np.int64), np.diff(indptr))
    cand = live / B < threshold
    holes_u = np.bincount(req[~cached], weights=B - live[~cached], minlength=num_req)
    holes_u = holes_u.astype(np.int64)
    cand_u = np.bincount(req[cand & ~cached], minlength=num_req)

    def gain(k, m, r):
        slack = holes_u[r] - m
        return (
            k
            + np.minimum(cand_u[r], np.maximum(slack, 0) // B)
            - -(-np.maximum(-slack, 0) // B)
        )

    # Cached candidates, sparsest first per request; k = rank + 1 of each.
    cc = np.flatnonzero(cand & cached)
    order = cc[np.lexsort((live[cc], req[cc]))]  # stable
    o_req, o_live = req[order], live[order]
    rank = _cumsum_before_in_group(o_req, np.ones_like(o_req), num_req)
    m = _cumsum_before_in_group(o_req, o_live, num_req) + o_live
    g = gain(rank + 1, m, o_req)
    top = np.lexsort((rank, -g, o_req))  # per request: best gain, then shortest
    if top.size:
        top = top[np.r_[True, np.diff(o_req[top]) != 0]]
    k_c, m_c = np.zeros(num_req, np.int64), np.zeros(num_req, np.int64)
    better = top[g[top] > gain(0, 0, o_req[top])]
    k_c[o_req[better]], m_c[o_req[better]] = rank[better] + 1, m[better]
    total = gain(k_c, m_c, np.arange(num_req))
    planned = total >= 1
    k_u = np.where(planned, np.minimum(cand_u, np.maximum(holes_u - m_c, 0) // B), 0)
    k_c = np.where(planned, k_c, 0)
    # Sources: the k_c sparsest cached and the k_u sparsest uncached candidates.
    uc = np.flatnonzero(cand & ~cached)
    u_order = uc[np.lexsort((live[uc], req[uc]))]
    u_rank = _cumsum_before_in_group(req[u_order], np.ones_like(u_order), num_req)
    is_src = np.zeros(ids.size, dtype=bool)
    is_src[order[rank < k_c[o_req]]] = True
    is_src[u_order[u_rank < k_u[req[u_order]]]] = True
    if not planned.any():
        return _empty_plan()
    src = np.flatnonzero(is_src)
    src = src[np.lexsort((live[src], ~cached[src], req[src]))]  # cached first
    # Destinations: uncached non-sources with a hole, densest first, as many as
    # the moved tokens need; fresh blocks take what they cannot.
    dst = np.flatnonzero(~is_src & ~cached & planned[req] & (live < B))
    dst = dst[np.lexsort((B - live[dst], req[dst]))]
    fresh = -(-np.maximum(m_c - holes_u, 0) // B)
    return _plan(ids, live, req, planned, src, dst, fresh, B)


def pack_request(
    *,
    live_idx: np.ndarray,
    live_slots: np.ndarray,
    src_block_ids: np.ndarray,
    dst_block_ids: np.ndarray,
    block_size: int,
) -> Moves:
    """Moves a request's live tokens out of its source blocks into holes.

    The free slots of the destination blocks (those no live token of the
    request holds: the blocks are the request's own) are taken block by block
    in the given order, offsets ascending; tokens keep their logical order.

    Args:
        live_idx: int [n] logical indices of live tokens, ascending.
        live_slots: int [n] their slots.
        src_block_ids: int [S] blocks to empty.
        dst_block_ids: int [D] blocks whose holes receive the tokens (fresh
            blocks too), none of them a source.
        block_size: Tokens per block.

    Returns:
        The moves, in logical order.

    """
    B = block_size
    idx = np.asarray(live_idx, dtype=np.int64)
    slots = np.asarray(live_slots, dtype=np.int64)
    src_b = np.asarray(src_block_ids, dtype=np.int64)
    dst_b = np.asarray(dst_block_ids, dtype=np.int64)
    assert idx.ndim == 1 and idx.shape == slots.shape, (idx.shape, slots.shape)
    assert not (_position(dst_b, src_b) >= 0).any(), "a destination is a source"
    block, offset = slots // B, slots % B
    sel = _position(block, src_b) >= 0
    m = int(np.count_nonzero(sel))
    # Occupancy of the destination blocks, one row per block in the given order.
    row = _position(block, dst_b)
    in_dst = row >= 0
    occupied = np.zeros((dst_b.size, B), dtype=bool)
    occupied[row[in_dst], offset[in_dst]] = True
    free = np.flatnonzero(~occupied.ravel())
    assert m <= free.size, f"{m} live tokens do not fit in {free.size} free slots"
    free = free[:m]
    return Moves(
        idx=idx[sel],
        src_slots=slots[sel],
        dst_slots=dst_b[free // B] * B + free % B,
    )
