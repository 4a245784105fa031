# SPDX-License-Identifier: Apache-2.0
"""Compiled loops of the scores' per-step gains, fold and read (numba).

Worker side, the step's masses become each key's gain (`step_gains`);
scheduler side (scores.ScoreAccumulator), once a step those gains are folded
into acc[request][logical token], and the policies read the scores of the
batch's live tokens, each in one pass instead of a dozen NumPy passes over
the step's keys. Imported only with vToken on; compiled at import, as
table_kernels.py is.
"""

from __future__ import annotations

import numba
import numpy as np

from vllm.vtoken.prefetch import AHEAD, prefetch_span

_i64, _f32 = numba.int64[::1], numba.float32[::1]
_jit = {"cache": True, "nogil": True}


@numba.njit(
    numba.boolean(
        _i64, _i64, _i64, _f32, _i64, _i64, _f32, numba.int64, _i64, _i64, _i64, _i64
    ),
    **_jit,
)  # fmt: skip
def fold(
    rows, indptr, idx, gain, start, cap, acc, window, rule, cand, cand_end, cand_keys
):
    """Request i (row rows[i]) gains gain[j] on token idx[j], j in
    [indptr[i], indptr[i + 1]): added, or with `window` > 0 averaged in
    (acc += (gain - acc) / window). Returns False, changing nothing, when a
    token lies past its row's region (`cap`: arena.reserve first).

    A row evicted by a "score" rule (rule[row] = its `recent` + 1, set by
    eviction_kernels.evict_lowest) also gets its next victim, as the fold
    meets the scores: the step's keys are the row's live slotted tokens,
    ascending (the worker's read; keys out of order get none), so a rule
    wanting one victim would take the lowest of them but the newest and the
    `recent` before it (ties: the earliest; NaN last). cand[row] = that
    token + 1 (0: none), valid for the key set it was taken from:
    cand_end[row] = its last key + 1, cand_keys[row] = how many (-1: keys
    out of order, never valid). evict_lowest takes it only for one victim
    under the same rule, the row with as many live tokens as keys and every
    known token slotted and attended up to cand_end: no token evicted or
    slotted since (DESIGN.md §3.2). The next eviction then walks no live
    list (at 1,024 requests, in-engine: evict_lowest ~180-280 -> 37 µs; the
    choice costs the fold ~20-35 µs)."""
    # Each row's largest key against its region: a reduction numba
    # vectorizes (a test a key: ~10 us more at 1,024 rows, by hand).
    for i in range(rows.size):
        top, k = -1, idx[indptr[i] : indptr[i + 1]]
        for j in range(k.size):
            top = max(top, k[j])
        if top >= cap[rows[i]]:
            return False
    w = np.float32(window)
    for i in range(rows.size):
        a = i + AHEAD
        if a < rows.size and indptr[a + 1] > indptr[a]:  # its keys' scores
            k0, k1 = idx[indptr[a]], idx[indptr[a + 1] - 1]
            prefetch_span(acc, start[rows[a]] + k0, k1 - k0 + 1)
        r = rows[i]
        base, lo, hi = start[r], indptr[i], indptr[i + 1]
        # Not evicted by a "score" rule: the fold only, in a loop of its own
        # (one loop with the choice's bookkeeping skipped took 1.1x as long
        # by hand for such rows, 1,024 of them).
        if rule[r] <= 0:
            for j in range(lo, hi):
                p = base + idx[j]
                if window > 0:
                    acc[p] += (gain[j] - acc[p]) / w
                else:
                    acc[p] += gain[j]
            continue
        # The candidates: keys [lo, b), past neither the newest nor `recent`.
        b, low = min(hi - (rule[r] - 1), hi - 1), np.float32(np.inf)
        ascending, last = True, -1
        for j in range(lo, hi):
            p = base + idx[j]
            if window > 0:
                v = acc[p] + (gain[j] - acc[p]) / w
            else:
                v = acc[p] + gain[j]
            acc[p] = v
            ascending &= idx[j] > last
            last = idx[j]
            # Branch-free: min(low, v) is `v if v < low else low`, so a NaN
            # v never enters (the argument order matters).
            if j < b:
                low = min(low, v)
        if not ascending:  # not the worker's read order: no choice
            b = lo
        best = lo if b > lo else -1  # none below inf: all NaN or inf
        for j in range(lo, b):
            if acc[base + idx[j]] == low:  # the earliest of the lowest
                best = j
                break
        cand[r] = idx[best] + 1 if best >= 0 else 0
        cand_end[r] = idx[hi - 1] + 1 if hi > lo else 0
        cand_keys[r] = hi - lo if ascending else -1  # -1: never valid
    return True


@numba.njit(_f32(_i64, _i64, _i64, _i64, _i64, _f32), **_jit)
def gather(rows, seg, idx, start, cap, acc):
    """float32: the score of token idx[j] of row rows[seg[j]]; 0 for a row
    of -1 (never scored) or a token past its row's region (never scored)."""
    out = np.zeros(idx.size, np.float32)
    for j in range(idx.size):
        r = rows[seg[j]]
        if r >= 0 and idx[j] < cap[r]:
            out[j] = acc[start[r] + idx[j]]
    return out


@numba.njit(_f32(_f32, _i64, _i64, numba.float64), **_jit)
def persistence_gain(mass, indptr, num_queries, norm):
    """float32 per key: 1 where request r's key p (its keys [indptr[r],
    indptr[r + 1]), K of them, the step's Q queries last) was important this
    step: its probability mass / norm, summed over the query rows that see it,
    at least what uniform attention gives it over those rows.

    A decode row sees every key: mass / norm >= 1 / K (compared as
    mass * K >= norm, no division). A prefill row i sees the K - Q + i + 1
    keys up to its own (causal), so key p is seen by rows max(0, p - K + Q)
    on and uniform attention gives it sum_{m = max(K - Q, p) + 1}^{K} 1 / m.
    Averaged over all Q rows instead, the prompt's later keys, seen by fewer
    rows, read as unimportant whatever they got (63 of 100 under uniform
    attention)."""
    out = np.empty(mass.size, np.float32)
    for r in range(indptr.size - 1):
        lo, k = indptr[r], indptr[r + 1] - indptr[r]
        q = min(num_queries[r], k)
        if q <= 1:
            keys = np.float64(k)
            bar = norm * np.float64(num_queries[r])
            for j in range(lo, lo + k):
                out[j] = 1.0 if np.float64(mass[j]) * keys >= bar else 0.0
            continue
        off = k - q  # keys every row sees: [0, off]
        uniform = 0.0  # sum_{m = p + 1}^{K} 1 / m, for p from K - 1 down
        for p in range(k - 1, off - 1, -1):
            uniform += 1.0 / np.float64(p + 1)
            out[lo + p] = 1.0 if np.float64(mass[lo + p]) >= norm * uniform else 0.0
        for p in range(off):
            out[lo + p] = 1.0 if np.float64(mass[lo + p]) >= norm * uniform else 0.0
    return out


@numba.njit(_f32(_f32, numba.float32), **_jit)
def divided(mass, norm):
    """mass / norm in float32, as NumPy divides it. A loop of its own: inline
    in step_gains, where `gain` is one of two branches' arrays, numba did not
    vectorize it (at 1,024 requests' keys, by hand: ~24 -> ~4 us)."""
    gain = np.empty(mass.size, np.float32)
    for j in range(mass.size):
        gain[j] = mass[j] / norm
    return gain


@numba.njit(
    numba.types.Tuple((_f32, _i64, _i64))(
        _f32, _i64, _i64, numba.float64, numba.boolean
    ),
    **_jit,
)
def step_gains(mass, indptr, q_loc, norm, persistence):
    """(gain, read, read_indptr) of a step (ScoreAccumulator.take_step):
    request r's keys are [indptr[r], indptr[r + 1]) of `mass`, its queries
    [q_loc[r], q_loc[r + 1]); gain is mass / norm, in float32 as NumPy
    divides it, or `persistence_gain`; `read` lists the requests with keys,
    `read_indptr` their keys' CSR."""
    n = indptr.size - 1
    if n < 0 or q_loc.size != n + 1 or indptr[n] != mass.size:
        raise ValueError("take_step: key_indptr, the masses and the queries disagree")
    if persistence:
        nq = np.empty(n, np.int64)
        for r in range(n):
            nq[r] = q_loc[r + 1] - q_loc[r]
        gain = persistence_gain(mass, indptr, nq, norm)
    else:
        gain = divided(mass, np.float32(norm))
    read = np.empty(n, np.int64)
    read_indptr = np.zeros(n + 1, np.int64)
    m = 0
    for r in range(n):
        if indptr[r + 1] > indptr[r]:
            read[m] = r
            read_indptr[m + 1] = read_indptr[m] + indptr[r + 1] - indptr[r]
            m += 1
    return gain, read[:m], read_indptr[: m + 1]
