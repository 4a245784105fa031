# SPDX-License-Identifier: Apache-2.0
"""Reclamation planner: which blocks to empty, and where their live tokens go.

Scheduler side; pure functions, no state, no Python loop over requests, blocks
or tokens (the paper names planner CPU time as vToken's dominant cost): each
call is one compiled pass over every request planned in the step
(planner_kernels.py):

1. `plan_blocks`: per request, the sparsest blocks whose live tokens fit into
   the holes of the request's other blocks (in place).
2. `plan_around_cache`: the same, but no block the prefix cache can serve is
   written; fresh blocks take what holes cannot.
3. `packing.pack_requests`: move those live tokens, in logical order, into
   the holes, first destination block first.

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
from functools import cache

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

    prio = np.zeros(ids.size, np.int64)
    if dst_priority is not None:
        prio = np.asarray(dst_priority, np.int64)
        assert prio.shape == live.shape, (prio.shape, live.shape)
    from vllm.vtoken.planner_kernels import plan_in_place  # numba: vToken on only

    req_index, src_indptr, src, dst_indptr, dst = plan_in_place(
        indptr, ids.astype(np.int32, copy=False), live, prio,
        bool(prio.any()), block_size, _live_limit(block_size, threshold),
    )  # fmt: skip
    fresh = np.zeros(req_index.size, np.int64)
    return _plan_of(req_index, src_indptr, src, dst_indptr, dst, fresh)


def _plan_of(req_index, src_indptr, src, dst_indptr, dst, num_fresh) -> BlockPlan:
    """The BlockPlan of a planner kernel's arrays (none planned: empty)."""
    if req_index.size == 0:
        return _empty_plan()
    return BlockPlan(
        req_index=req_index,
        src_indptr=src_indptr,
        src_block_ids=src,
        dst_indptr=dst_indptr,
        dst_block_ids=dst,
        num_fresh=num_fresh,
    )


@cache  # a generator's 18 frames a plan otherwise
def _live_limit(block_size: int, threshold: float) -> int:
    """The threshold as a live count: l / B < threshold exactly when l < it."""
    return sum(n / block_size < threshold for n in range(block_size + 1))


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
    indptr = np.asarray(req_indptr, dtype=np.int64)
    ids, cached = np.asarray(block_ids), np.asarray(cached, dtype=bool)
    live = np.asarray(block_live, dtype=np.int64)
    assert live.shape == ids.shape == cached.shape, (ids.shape, cached.shape)
    if integrity.CHECK:  # (the kernel reads without bounds)
        _check_csr(indptr, ids.size)
        assert ids.ndim == 1, ids.shape
        assert live.size == 0 or (0 <= live.min() and live.max() <= block_size)
    from vllm.vtoken.planner_kernels import plan_cached  # numba: vToken on only

    return _plan_of(
        *plan_cached(
            indptr, ids.astype(np.int32, copy=False), live, cached, block_size,
            _live_limit(block_size, threshold),
        )
    )  # fmt: skip
