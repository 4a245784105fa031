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

All requests at once, in one compiled loop (planner_kernels.pack): one pass
over the planned requests' tokens marks the held slots and lists the tokens
in sources; then each request's free destination slots, in order, are zipped
with its moving tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vllm.vtoken.arena import block_shift, indptr_of

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
    indptr = np.asarray(live_indptr, dtype=np.int64)
    idx = np.asarray(live_idx, dtype=np.int64)
    slots = np.asarray(live_slots, dtype=np.int64)
    assert idx.ndim == 1 and idx.shape == slots.shape, (idx.shape, slots.shape)
    assert indptr[-1] == idx.size, (indptr[-1], idx.size)
    dst, dst_indptr = _destinations(plan, fresh_block_ids)
    if plan.src_block_ids.size == 0:  # nothing to move: no pass over the tokens
        none, zeros = np.zeros(0, np.int64), np.zeros(len(dst_indptr), np.int64)
        return Moves(indptr=zeros, idx=none, src_slots=none, dst_slots=none)
    from vllm.vtoken import planner_kernels as k  # numba: vToken on only

    status, indptr, idx, src_slots, dst_slots = k.pack(
        indptr, idx, slots, plan.req_index.astype(np.int64, copy=False),
        plan.src_indptr.astype(np.int64, copy=False),
        plan.src_block_ids.astype(np.int64), dst, dst_indptr.astype(np.int64),
        block_shift(block_size), num_blocks,
    )  # fmt: skip
    if status < 0:
        what = {
            k.NO_ROOM: f"planned request {indptr[0]}'s live tokens do not fit in "
            "the free slots of its destinations",
            k.DST_IS_SRC: f"a destination is a source (block {indptr[0]})",
            k.NO_PLAN: f"token {indptr[0]} is in a source of no plan's request",
            k.FOREIGN: f"token {indptr[0]} is a foreign token in a source",
        }
        raise AssertionError(what[status])
    return Moves(indptr=indptr, idx=idx, src_slots=src_slots, dst_slots=dst_slots)


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
    start = indptr_of(n_dst + n_fresh)
    d_req = np.repeat(np.arange(K), n_dst)
    f_req = np.repeat(np.arange(K), n_fresh)
    f_at = np.arange(fresh.size) - (np.cumsum(n_fresh) - n_fresh)[f_req]
    out = np.empty(ids.size + fresh.size, dtype=np.int64)
    out[start[d_req] + np.arange(ids.size) - plan.dst_indptr[d_req]] = ids
    out[start[f_req] + n_dst[f_req] + f_at] = fresh
    return out, start
