# SPDX-License-Identifier: Apache-2.0
"""Reclamation planner: which blocks to empty, and where their live tokens go.

Scheduler side; pure functions, no state, no Python loop over blocks or tokens
(the paper names planner CPU time as vToken's dominant cost). Two stages:

1. `plan_blocks` (all requests at once): pick low-utilization source blocks per
   request by greedy packing, then admit plans within the free-block margin.
2. `pack_request` (per planned request): move the request's live tokens out of its
   source blocks, in logical order, densely into fresh destination blocks.

Example, block_size 4, one request, sources [7, 3] (live 1 and 2 tokens)::

    before  block 7: [ a  x  x  x ]   block 3: [ x  b  c  x ]
    after   block 9: [ a  b  c  . ]   blocks 7 and 3 freed once the copy is acked
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class BlockPlan:
    """Blocks to empty, per planned request (CSR over `req_index`)."""

    req_index: np.ndarray  # int64 [K]: indices into the input requests, ascending
    src_indptr: np.ndarray  # int64 [K + 1]: CSR into src_block_ids
    src_block_ids: np.ndarray  # int32 [S]: blocks to empty, freed once acked
    num_dst: np.ndarray  # int64 [K]: destination blocks each request needs
    num_deferred: int  # requests with a positive gain held back by the margin

    @property
    def blocks_freed(self) -> int:
        """Net blocks returned to the pool once every plan is acknowledged."""
        return int(self.src_block_ids.size - self.num_dst.sum())


@dataclass(frozen=True, kw_only=True)
class Moves:
    """KV moves of one request: token idx[i] goes from src_slots[i] to dst_slots[i]."""

    idx: np.ndarray  # int64 [M]: logical token indices, ascending
    src_slots: np.ndarray  # int64 [M]
    dst_slots: np.ndarray  # int64 [M]


def _ceil_div(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


def _member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """bool: which non-negative values are in sorted_set (np.isin is ~10 µs slower
    per call on small arrays)."""
    if sorted_set.size == 0:
        return np.zeros(values.shape, dtype=bool)
    top = int(sorted_set[-1])
    if top < 4 * values.size:  # a lookup table is cheaper than binary search
        table = np.zeros(top + 2, dtype=bool)
        table[sorted_set] = True
        return table[np.minimum(values, top + 1)]
    at = np.minimum(np.searchsorted(sorted_set, values), sorted_set.size - 1)
    return sorted_set[at] == values


def _sort_by_req_then_live(
    req: np.ndarray, live: np.ndarray, block_size: int
) -> np.ndarray:
    """Stable argsort by (req, live); req is non-decreasing (CSR order)."""
    if block_size < 256 and (req.size == 0 or req[-1] < 65536):
        # Two stable passes on <= 16-bit keys: numpy radix-sorts those, twice as
        # fast as one 64-bit key sort.
        by_live = np.argsort(live.astype(np.uint8), kind="stable")
        return by_live[np.argsort(req[by_live].astype(np.uint16), kind="stable")]
    return np.argsort(req * (block_size + 1) + live, kind="stable")


def _check_csr(indptr: np.ndarray, n: int) -> None:
    if indptr.ndim != 1 or indptr.size == 0 or indptr[0] != 0 or indptr[-1] != n:
        raise ValueError(f"req_indptr must be 1-D, start at 0 and end at {n}")
    if (np.diff(indptr) < 0).any():
        raise ValueError("req_indptr must be non-decreasing")


def plan_blocks(
    *,
    req_indptr: np.ndarray,
    block_ids: np.ndarray,
    block_live: np.ndarray,
    block_size: int,
    threshold: float,
    free_blocks: int,
    margin: int,
) -> BlockPlan:
    """Greedy, margin-aware choice of blocks to compact.

    Candidates are blocks with live / block_size < threshold. Per request, the
    candidates sorted by live count (ascending; ties keep input order) are taken
    as the prefix k maximizing gain = k - ceil(live in the prefix / block_size);
    ties go to the smaller k and only gain > 0 plans. All-dead blocks need no
    destination. If the plans need more destinations than free_blocks - margin,
    requests are admitted by gain per destination block (then request order)
    while the total fits; plans needing no destination are always admitted.

    Args:
        req_indptr: int [R + 1] CSR over requests of their eligible blocks (the
            caller removed tail blocks, shared blocks and blocks with a copy in
            flight).
        block_ids: int [N] eligible block ids, distinct.
        block_live: int [N] live tokens of each entry of block_ids.
        block_size: Tokens per block (> 0).
        threshold: Utilization below which a block is a candidate, in (0, 1].
        free_blocks: Free blocks in the pool (>= 0).
        margin: Free blocks that must stay free (>= 0).

    Returns:
        The plan; requests without a plan are absent.

    Raises:
        ValueError: Bad threshold, margin, free_blocks, block_size, CSR or
            lengths; a live count outside [0, block_size]; a repeated source.
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    if margin < 0 or free_blocks < 0 or block_size <= 0:
        raise ValueError(
            f"need margin >= 0 ({margin}), free_blocks >= 0 ({free_blocks}), "
            f"block_size > 0 ({block_size})"
        )
    indptr = np.asarray(req_indptr, dtype=np.int64)
    ids = np.asarray(block_ids)
    live = np.asarray(block_live, dtype=np.int64)
    if ids.ndim != 1 or live.shape != ids.shape:
        raise ValueError(f"block_ids {ids.shape} and block_live {live.shape} differ")
    _check_csr(indptr, ids.size)
    if live.size and (live.min() < 0 or live.max() > block_size):
        raise ValueError(f"block_live outside [0, {block_size}]")

    # Candidates, grouped by request and sorted by live count inside a group.
    req = np.repeat(np.arange(indptr.size - 1, dtype=np.int64), np.diff(indptr))
    cand = np.flatnonzero(live / block_size < threshold)
    order = cand[_sort_by_req_then_live(req[cand], live[cand], block_size)]
    if order.size == 0:
        return _empty_plan()
    c_req, c_live = req[order], live[order]
    starts = np.flatnonzero(np.r_[True, c_req[1:] != c_req[:-1]])
    sizes = np.diff(np.r_[starts, order.size])
    pos = np.arange(order.size)
    cum = np.cumsum(c_live)
    cum_in = cum - np.repeat(cum[starts] - c_live[starts], sizes)  # within group
    k = pos - np.repeat(starts, sizes) + 1
    gain = k - _ceil_div(cum_in, block_size)
    best_gain = np.maximum.reduceat(gain, starts)
    is_best = gain == np.repeat(best_gain, sizes)
    best_pos = np.minimum.reduceat(np.where(is_best, pos, order.size), starts)
    best_k = k[best_pos]
    need = _ceil_div(cum_in[best_pos], block_size)

    # Margin-aware admission over the requests with something to gain.
    planned = best_gain > 0
    budget = max(free_blocks - margin, 0)
    admit = planned.copy()
    if need[planned].sum() > budget:
        cand_g = np.flatnonzero(planned)
        with np.errstate(divide="ignore"):
            ratio = best_gain[cand_g] / need[cand_g]  # inf when no destination
        rank = cand_g[np.lexsort((cand_g, -ratio))]
        admit[:] = False
        admit[rank[np.cumsum(need[rank]) <= budget]] = True
    take_k = np.where(admit, best_k, 0)
    src = ids[order][k <= np.repeat(take_k, sizes)].astype(np.int32)
    if src.size and (np.bincount(src) > 1).any():
        raise ValueError("block_ids repeat a block chosen as a source")
    return BlockPlan(
        req_index=c_req[starts][admit],
        src_indptr=np.r_[0, np.cumsum(take_k[admit])].astype(np.int64),
        src_block_ids=src,
        num_dst=need[admit].astype(np.int64),
        num_deferred=int(planned.sum() - admit.sum()),
    )


def _empty_plan() -> BlockPlan:
    return BlockPlan(
        req_index=np.zeros(0, np.int64),
        src_indptr=np.zeros(1, np.int64),
        src_block_ids=np.zeros(0, np.int32),
        num_dst=np.zeros(0, np.int64),
        num_deferred=0,
    )


def pack_request(
    *,
    live_idx: np.ndarray,
    live_slots: np.ndarray,
    src_block_ids: np.ndarray,
    dst_block_ids: np.ndarray,
    block_size: int,
) -> Moves:
    """Packs a request's live tokens in source blocks densely into destinations.

    Tokens keep their logical order: the first goes to offset 0 of
    dst_block_ids[0], the block_size-th to offset 0 of dst_block_ids[1], ...

    Args:
        live_idx: int [n] logical indices of live tokens, ascending.
        live_slots: int [n] their slots.
        src_block_ids: int [S] blocks to empty.
        dst_block_ids: int [D] fresh blocks, none of them a source.
        block_size: Tokens per block.

    Returns:
        The moves, in logical order.

    Raises:
        ValueError: If the tokens do not fit, inputs are misaligned or a
            destination is also a source.
    """
    idx = np.asarray(live_idx, dtype=np.int64)
    slots = np.asarray(live_slots, dtype=np.int64)
    src_b = np.sort(np.asarray(src_block_ids, dtype=np.int64))
    dst_b = np.asarray(dst_block_ids, dtype=np.int64)
    if idx.shape != slots.shape or idx.ndim != 1:
        raise ValueError(f"live_idx {idx.shape} and live_slots {slots.shape} differ")
    if _member(dst_b, src_b).any():
        raise ValueError("a destination block is also a source block")
    sel = _member(slots // block_size, src_b)
    m = int(np.count_nonzero(sel))
    if m > dst_b.size * block_size:
        raise ValueError(
            f"{m} live tokens do not fit in {dst_b.size} destination blocks"
        )
    off = np.arange(m, dtype=np.int64)
    return Moves(
        idx=idx[sel],
        src_slots=slots[sel],
        dst_slots=dst_b[off // block_size] * block_size + off % block_size,
    )
