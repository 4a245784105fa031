# SPDX-License-Identifier: Apache-2.0
"""Batch choices over a `BatchView`, for policies' `evict_batch`.

Each works on every request of the batch at once: per-request windows by rank
within the request's run in a few NumPy calls, the per-request k lowest in
one compiled loop (selection_kernels.py).
"""

from __future__ import annotations

import numpy as np

from vllm.vtoken.arena import BatchMemo, RowArena
from vllm.vtoken.policies.base import BatchView


def recent_batch(batch: BatchView, window: int) -> np.ndarray:
    """bool [N]: True for each request's `window` most recent live tokens."""
    from_end = batch.indptr[batch.seg + 1] - 1 - np.arange(batch.seg.size)
    return from_end < window


def lowest_batch(
    batch: BatchView, num_evict: np.ndarray, key: np.ndarray, protected: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`select_lowest` for every request at once: per request, the evictable
    unprotected tokens with the lowest `key` (ties: oldest first; NaN keys
    last), then the protected evictable ones oldest first. Returns (counts,
    idx), idx request by request. One compiled pass over the batch
    (selection_kernels.lowest)."""
    from vllm.vtoken.policies.selection_kernels import lowest  # numba: vToken on

    counts, pos = lowest(
        np.asarray(batch.indptr, np.int64),
        np.ascontiguousarray(batch.evictable, bool),
        np.ascontiguousarray(protected, bool),
        np.asarray(key, np.float64),
        np.asarray(num_evict, np.int64).reshape(-1),
    )
    return counts, batch.live_idx[pos]


def hash_uniform(seeds: np.ndarray, idx: np.ndarray, nonce: np.ndarray) -> np.ndarray:
    """float64 in [0, 1): a fixed pseudo-random draw per (seed, idx, nonce)
    (splitmix64), so a request's draws do not depend on the batch it is in."""
    with np.errstate(over="ignore"):
        x = seeds ^ (idx.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        x ^= nonce.astype(np.uint64) * np.uint64(0xD1B54A32D192ED03)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class ArrivalSteps:
    """Per request, the step each logical token arrived at, counting a
    request's steps by its `sync_batch` calls (for age-based policies)."""

    def __init__(self) -> None:
        from vllm.vtoken.policies.selection_kernels import add_arrivals  # numba

        self._a = RowArena({"born": (np.int64, 0)}, ("step", "n"))
        self._add = add_arrivals
        # The last batch `add` and `arena_of` saw.
        self._added, self._read = BatchMemo(self._a), BatchMemo(self._a)

    def add(self, req_ids: list[str], num_new: np.ndarray) -> None:
        """Request req_ids[k] starts a step with num_new[k] new tokens."""
        num_new = np.ascontiguousarray(num_new, np.int64)
        ids = req_ids
        # count_nonzero, one C loop (~2 us where the hooks run, profiled),
        # not .all(): a ufunc reduction behind a Python wrapper (~5 us).
        if np.count_nonzero(num_new) != num_new.size:
            ids = [r for r, n in zip(req_ids, num_new.tolist(), strict=True) if n > 0]
            num_new = num_new[num_new > 0]
        a = self._a
        (rows,) = self._added.get(  # first sight: a row
            ids, lambda ids: (a.rows_adding(ids),)
        )

        def run():  # one compiled pass (a region too small: nothing changed)
            c = a.cols
            return self._add(
                rows, num_new, a.start, a.cap, c["n"], c["step"], a.data["born"]
            )

        if not run():
            a.reserve(rows, a.cols["n"][rows] + num_new)
            ok = run()
            assert ok, "add_arrivals: regions reserved, yet short"

    def age(self, batch: BatchView) -> np.ndarray:
        """int64 [N]: steps since each token of `batch` arrived, plus one."""
        a, rows = self._a, self._a.rows(batch.req_ids)[batch.seg]
        return a.cols["step"][rows] - a.data["born"][a.start[rows] + batch.live_idx] + 1

    def arena_of(self, req_ids: list[str]) -> tuple | None:
        """(rows, start, born, step) of `req_ids`, for a compiled pass to
        read their tokens' arrival steps in place; None if one has none."""
        a = self._a
        # Whether one has none, with the rows: a NumPy min where the hooks
        # run took ~20 us (cold; its Python wrapper and a ufunc reduction).
        rows, missing = self._read.get(req_ids, lambda ids: _rows_missing(a, ids))
        if missing:
            return None
        return rows, a.start, a.data["born"], a.cols["step"]

    def restart(self, req_id: str) -> None:
        """Every token of the request counts as arrived at its next step, the
        first its restarted scores see (as a token added then is): the
        resume's last chunk. A chunked recompute's earlier chunks bring no new
        token, so they count no step here, and the scheduler folds no
        persistence scores from them (VTokenScheduler._sync_slots)."""
        if req_id in self._a.index:
            row = self._a.index[req_id]
            span = self._a.span(row, self._a.cols["n"][row])
            self._a.data["born"][span] = self._a.cols["step"][row] + 1

    def forget(self, req_id: str) -> None:
        if req_id in self._a.index:
            self._a.remove(req_id)


# Above this half-width pool_along takes prefix sums (avg) or a doubling
# table (max), O(N log kernel), not one pass per shift, O(N kernel).
_SHIFTS = 16


def pool_along(
    batch: BatchView, key: np.ndarray, kernel: int, how: str, skip=None
) -> np.ndarray:
    """float64 [N]: `key` pooled over windows of `kernel` (odd) neighbours
    within each request: their max, or their mean with the ends padded by
    zeros ("avg", as avg_pool1d counts padding); `skip` (bool [N]): tokens
    that count as padding."""
    if skip is not None:
        key = np.where(skip, 0.0, key)
    n = key.size
    if n == 0:
        return np.zeros(0)
    # Each token's request: [lo, hi) of the batch (requests are contiguous).
    edges = np.flatnonzero(np.r_[True, batch.seg[1:] != batch.seg[:-1], True])
    width = np.diff(edges)
    lo = np.repeat(edges[:-1], width)
    hi = lo + np.repeat(width, width)
    half = min(kernel // 2, int(width.max()) - 1)  # past a request: no token
    at = np.arange(n)
    if half > _SHIFTS:
        return _pool_wide(key, at, np.maximum(at - half, lo),
                          np.minimum(at + half, hi - 1), kernel, how)  # fmt: skip
    out = np.full(n, -np.inf) if how == "max" else np.zeros(n)
    for d in range(-half, half + 1):
        j = np.clip(at + d, 0, n - 1)
        same = (at + d >= lo) & (at + d < hi)
        if how == "max":
            out = np.maximum(out, np.where(same, key[j], -np.inf))
        else:
            out += np.where(same, key[j], 0.0)
    return out if how == "max" else out / kernel


def _pool_wide(key, at, a, b, kernel, how) -> np.ndarray:
    """`pool_along` over windows [a[i], b[i]] (inclusive, inside a request):
    avg from prefix sums; max from a doubling table (level k: the max of
    2**k tokens from each), two lookups a token."""
    if how != "max":
        csum = np.r_[0.0, np.cumsum(key)]
        return (csum[b + 1] - csum[a]) / kernel
    length = b - a + 1
    level = np.floor(np.log2(length)).astype(np.int64)
    table = [key.astype(np.float64)]
    for k in range(1, int(level.max()) + 1):
        prev, step = table[-1], 1 << (k - 1)
        nxt = prev.copy()  # a run past the array's end is never looked up
        nxt[:-step] = np.maximum(prev[:-step], prev[step:])
        table.append(nxt)
    table = np.stack(table)
    return np.maximum(table[level, a], table[level, b - (1 << level) + 1])


def _rows_missing(arena: RowArena, req_ids: list[str]) -> tuple[np.ndarray, bool]:
    """(rows, whether a request has none) for ArrivalSteps' BatchMemo."""
    rows = arena.rows_or_missing(req_ids)
    return rows, bool(rows.size) and bool(rows.min() < 0)
