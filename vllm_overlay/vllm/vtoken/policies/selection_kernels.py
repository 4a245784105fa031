# SPDX-License-Identifier: Apache-2.0
"""Compiled loops of selection.py (numba): `lowest_batch`'s k lowest per
request, and `ArrivalSteps.add`'s step.

Scheduler side, once a step per policy in use. Per request, one pass finds
its candidates; a few victims (the steady state: a token or two over budget)
are taken by repeated minimum scans, more by a stable sort of the candidates.
Imported only with vToken on; compiled at import, as table_kernels.py is.
"""

from __future__ import annotations

import numba
import numpy as np

_i64, _f64, _b1 = numba.int64[::1], numba.float64[::1], numba.boolean[::1]
_FEW = 4  # up to this many victims a request: scans, not a sort


@numba.njit(inline="always")
def _before(a, b):
    # The lexsort order: ascending, NaN after everything.
    return not np.isnan(a) and (np.isnan(b) or a < b)


@numba.njit(
    numba.types.UniTuple(_i64, 2)(_i64, _b1, _b1, _f64, _i64),
    cache=True,
    nogil=True,
)
def lowest(indptr, evictable, protected, key, want):
    """(counts, pos): per request r (entries [indptr[r], indptr[r + 1])),
    up to want[r] evictable entries: the unprotected ones with the lowest
    key first (ties: the earliest entry), then the protected ones earliest
    first. `pos` are entry positions, request by request."""
    num = indptr.size - 1
    total = 0
    for r in range(num):
        total += max(min(want[r], indptr[r + 1] - indptr[r]), 0)
    counts, pos = np.zeros(num, np.int64), np.empty(total, np.int64)
    cand = np.empty(indptr[-1], np.int64)
    taken = np.zeros(indptr[-1], np.bool_)
    m = 0
    for r in range(num):
        lo, hi, k = indptr[r], indptr[r + 1], max(want[r], 0)
        # Candidates in entry order, those with a NaN key last.
        real = 0
        for j in range(lo, hi):
            if evictable[j] and not protected[j] and not np.isnan(key[j]):
                cand[real] = j
                real += 1
        c = real
        for j in range(lo, hi):
            if evictable[j] and not protected[j] and np.isnan(key[j]):
                cand[c] = j
                c += 1
        first = min(k, c)
        if first <= _FEW:
            for _ in range(first):
                best = -1
                for t in range(c):
                    j = cand[t]
                    if not taken[j] and (best < 0 or _before(key[j], key[best])):
                        best = j
                taken[best] = True
                pos[m] = best
                m += 1
        else:  # a stable sort: ties stay in entry order
            order = np.argsort(key[cand[:real]], kind="mergesort")
            for t in range(first):
                pos[m] = cand[order[t]] if t < real else cand[t]
                m += 1
        left = k - first
        for j in range(lo, hi):
            if left == 0:
                break
            if evictable[j] and protected[j]:
                pos[m] = j
                m += 1
                left -= 1
        counts[r] = k - left
    return counts, pos[:m]


@numba.njit(
    numba.boolean(_i64, _i64, _i64, _i64, _i64, _i64, _i64), cache=True, nogil=True
)
def add_arrivals(rows, num_new, start, cap, n, step, born):
    """`ArrivalSteps.add`'s step: row rows[i] (distinct) counts a step and its
    next num_new[i] tokens arrive at it. False, nothing changed, if a region
    is too small (RowArena.reserve, then again)."""
    for i in range(rows.size):
        if n[rows[i]] + num_new[i] > cap[rows[i]]:
            return False
    for i in range(rows.size):
        r = rows[i]
        step[r] += 1
        base = start[r] + n[r]
        for k in range(num_new[i]):
            born[base + k] = step[r]
        n[r] += num_new[i]
    return True
