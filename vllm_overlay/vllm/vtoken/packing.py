# SPDX-License-Identifier: Apache-2.0
"""Where a plan's moved tokens go: every planned request packed at once.

Scheduler side, after planner.py chose each request's sources and
destinations; pure, no state, no Python loop over requests, blocks or tokens.
A request's live tokens in its sources move, in logical order, into the free
slots of its destinations, first destination first, offsets ascending.
Example, block_size 4, destinations [5, 2] (x = dead)::

    source 7: [ a  x  x  b ]   source 3: [ x  c  x  x ]   logical order a, b, c
    dest   5: [ p  x  x  q ]   dest   2: [ x  r  x  s ]
    after  5: [ p  a  b  q ]          2: [ c  r  x  s ]   7, 3 freed once acked

All requests at once, on one flag per slot of the pool: the destinations'
rows are set and every live token's slot cleared, so what stays set is a hole;
then the sources' rows are set and every token reads its flag (set: it moves).
Two passes over the tokens plus the sources' and destinations' rows, however
many requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vllm.vtoken import integrity

if TYPE_CHECKING:
    from vllm.vtoken.planner import BlockPlan


@dataclass(frozen=True, kw_only=True)
class Moves:
    """KV moves of the planned requests (CSR over `BlockPlan.req_index`): token
    idx[i] of its request goes from src_slots[i] to dst_slots[i]."""

    indptr: np.ndarray  # int64 [K + 1]: CSR into the arrays below
    idx: np.ndarray  # int64 [M]: logical token indices, ascending per request
    src_slots: np.ndarray  # int64 [M]
    dst_slots: np.ndarray  # int64 [M]


def pack_requests(
    plan: BlockPlan,
    *,
    live_indptr: np.ndarray,
    live_idx: np.ndarray,
    live_slots: np.ndarray,
    block_size: int,
    num_blocks: int,
    fresh_block_ids: np.ndarray | None = None,
) -> Moves:
    """Moves every planned request's live tokens out of its sources into holes.

    A request's destinations are its plan's, then its `num_fresh` fresh
    blocks; their free slots (no live token holds them) are taken in that
    order, offsets ascending, by its source tokens in logical order.

    Args:
        plan: From planner.plan_blocks or planner.plan_around_cache.
        live_indptr: int [R + 1] CSR over the plan's input requests (all of
            them, planned or not) into live_idx and live_slots.
        live_idx: int [n] logical indices of each request's live tokens,
            ascending.
        live_slots: int [n] their slots, each < num_blocks * block_size.
        block_size: Tokens per block.
        num_blocks: Blocks in the KV pool.
        fresh_block_ids: int [sum(plan.num_fresh)] blocks just taken from the
            pool (no live token in them), request by request.

    Returns:
        The moves.
    """
    B = block_size
    indptr = np.asarray(live_indptr, dtype=np.int64)
    idx = np.asarray(live_idx, dtype=np.int64)
    slots = np.asarray(live_slots, dtype=np.int64)
    assert idx.ndim == 1 and idx.shape == slots.shape, (idx.shape, slots.shape)
    assert indptr[-1] == idx.size, (indptr[-1], idx.size)
    dst, dst_indptr = _destinations(plan, fresh_block_ids)
    if plan.src_block_ids.size == 0:  # nothing to move: no pass over the tokens
        none, zeros = np.zeros(0, np.int64), np.zeros(len(dst_indptr), np.int64)
        return Moves(indptr=zeros, idx=none, src_slots=none, dst_slots=none)
    src = plan.src_block_ids.astype(np.int64)  # intp: int32 indices cost a cast
    # One flag per slot of the pool (np.zeros: pages the OS zeroes when first
    # touched), written at the rows (one B-byte item each) of sources and
    # destinations and at the tokens' slots only: the cost follows the plan
    # and the tokens, not the pool. Bool: NumPy finds the nonzero entries of
    # a bool array several times faster than of uint8.
    flag = np.zeros(num_blocks * B, dtype=bool)
    rows = flag.view(np.dtype((np.void, B)))
    rows[dst] = _row(B)
    if integrity.CHECK:
        assert not flag[src * B].any(), "a destination is a source"
    flag[slots] = False  # every live token's slot: what stays set is a hole
    free = np.flatnonzero(rows[dst].view(bool))  # in destination order
    rows[src] = _row(B)
    moved = np.flatnonzero(np.take(flag, slots))  # logical order, by request
    # A request's sources hold its tokens only, and its free slots lie in its
    # destinations' rows: the two CSR boundaries split both lists.
    num_moves = np.diff(np.searchsorted(moved, indptr))[plan.req_index]
    assert num_moves.sum() == moved.size, "tokens in sources of no plan"
    at = np.searchsorted(free, dst_indptr * B)
    num_free = np.diff(at)
    assert (num_moves <= num_free).all(), (
        f"live tokens do not fit in the free slots: {num_moves} > {num_free}"
    )
    # Request k's tokens take its first num_moves[k] free slots: drop the rest
    # (what its last destination holds beyond the need, a few per request).
    spare = num_free - num_moves
    rest = np.repeat(at[1:] - spare - (np.cumsum(spare) - spare), spare)
    row, offset = np.divmod(np.delete(free, rest + np.arange(spare.sum())), B)
    if integrity.CHECK:
        owner = np.full(num_blocks, -1, dtype=np.int64)
        owner[src] = np.repeat(plan.req_index, np.diff(plan.src_indptr))
        req = np.repeat(np.arange(indptr.size - 1), np.diff(indptr))
        assert (owner[slots[moved] // B] == req[moved]).all(), "a foreign token"
    return Moves(
        indptr=np.r_[0, np.cumsum(num_moves)],
        idx=idx[moved],
        src_slots=slots[moved],
        dst_slots=dst[row] * B + offset,
    )


def _row(block_size: int) -> np.void:
    """A block's row of set flags, as one item."""
    return np.ones(block_size, dtype=bool).view(np.dtype((np.void, block_size)))[0]


def _destinations(
    plan: BlockPlan, fresh_block_ids: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """int64 destination blocks, request by request (the plan's, then the
    request's fresh ones), and their CSR over the planned requests."""
    K = plan.req_index.size
    n_dst, n_fresh = np.diff(plan.dst_indptr), plan.num_fresh
    fresh = np.asarray([] if fresh_block_ids is None else fresh_block_ids, np.int64)
    assert fresh.size == n_fresh.sum(), (fresh.size, n_fresh.sum())
    ids = plan.dst_block_ids.astype(np.int64)
    if fresh.size == 0:
        return ids, plan.dst_indptr
    start = np.r_[0, np.cumsum(n_dst + n_fresh)]
    d_req = np.repeat(np.arange(K), n_dst)
    f_req = np.repeat(np.arange(K), n_fresh)
    f_at = np.arange(fresh.size) - (np.cumsum(n_fresh) - n_fresh)[f_req]
    out = np.empty(ids.size + fresh.size, dtype=np.int64)
    out[start[d_req] + np.arange(ids.size) - plan.dst_indptr[d_req]] = ids
    out[start[f_req] + n_dst[f_req] + f_at] = fresh
    return out, start
