# SPDX-License-Identifier: Apache-2.0
"""Compiled one-pass eviction for the built-in policies' rules (numba).

Scheduler side, once a step (EvictionRuntime.enforce_budgets). A policy's
`evict_batch` sees the batch as a `BatchView` built by a dozen passes over its
live tokens (the live walk, their scores, the evictable mask, the policy's
key and protection, the k lowest, a sort, the eviction): at 1,024 requests
over a millisecond a step, the memory traffic of ~34k tokens read and written
ten times. A built-in states its choice as a `LowestRule` instead
(policies/base.py), and this loop applies it row by row, reading each live
token once:

    per row   (none wanted: skipped, its list not walked; one wanted by a
              "score" rule, the fold's choice still valid: taken, not walked)
              walk its live list      -> entries e = 0..n-1 (logical idx t_e;
                                         a list without dead read in place)
              key_e, evictable_e, protected_e
              the k lowest unprotected evictable (ties: earliest), then the
              protected evictable earliest first  (selection_kernels.lowest;
              k = 1, the steady state: keys computed as the one scan goes;
              Random's one victim at a drawn position, no key computed;
              the logical index on a list keeping dead: its first live
              entries past the sinks, read off the list's head, nothing
              copied)
              sorted ascending
    then      every row's victims killed in one loop (table_kernels.kill_rows,
              as evict_rows does; rows are distinct, so no choice reads a kill)

It chooses exactly what the policies' `evict_batch` choose
(tests/runtime/test_eviction_kernels.py; `VTOKEN_CHECK_INTEGRITY=1` compares
the two every step). Imported only with vToken on; compiled at import, as
table_kernels.py is.
"""

from __future__ import annotations

import numba
import numpy as np

from vllm.vtoken.policies.selection_kernels import _FEW, _before
from vllm.vtoken.prefetch import AHEAD, prefetch_span
from vllm.vtoken.table_kernels import kill_rows, listed_live, slotted_len

_i64, _i32, _u64, _f32, _f64, _b1 = (
    numba.int64[::1],
    numba.int32[::1],
    numba.uint64[::1],
    numba.float32[::1],
    numba.float64[::1],
    numba.boolean[::1],
)
_jit = {"cache": True, "nogil": True}

# LowestRule.key, as the loop reads it.
KEYS = {"score": 0, "index": 1, "hash": 2, "persistence": 3}


@numba.njit(inline="always")
def _hash_bits(seed, idx, nonce):
    """The 53 bits of selection.hash_uniform of one token (splitmix64): the
    uniform is bits / 2 ** 53, so the bits order tokens as it does."""
    x = seed ^ (numba.uint64(idx) * numba.uint64(0x9E3779B97F4A7C15))
    x ^= numba.uint64(nonce) * numba.uint64(0xD1B54A32D192ED03)
    x = (x ^ (x >> numba.uint64(30))) * numba.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> numba.uint64(27))) * numba.uint64(0x94D049BB133111EB)
    x ^= x >> numba.uint64(31)
    return x >> numba.uint64(11)


@numba.njit(numba.float64(numba.uint64, numba.int64, numba.int64), **_jit)
def _hash_uniform(seed, idx, nonce):
    """selection.hash_uniform of one token, to the bit (splitmix64)."""
    return np.float64(_hash_bits(seed, idx, nonce)) / 9007199254740992.0  # 2**53


@numba.njit(numba.float64(numba.int64, numba.int64), **_jit)
def _seen(age, window):
    """The weight a moving average over `window` steps has seen after `age`
    (as ScissorhandsPolicy.evict_batch computes it, to the bit)."""
    return 1.0 - (1.0 - 1.0 / window) ** np.float64(age)


@numba.njit(inline="always")
def _unimportance(score, age, window, seen_at):
    """ScissorhandsPolicy.evict_batch's key of one token, to the bit: minus
    how many of its last min(age, window) steps it was unimportant.
    `seen_at`: _seen by age, for the ages below its size (a pow each is
    most of the pass). Inlined: a compiled call a token passing an array
    costs numba's reference counting of it (table_kernels.kill_rows)."""
    seen = seen_at[age] if age < seen_at.size else _seen(age, window)
    rate = score / seen
    if rate > 1.0:  # np.minimum: NaN stays NaN
        rate = 1.0
    return -(np.float64(min(age, window)) * (1.0 - rate))


@numba.njit(inline="always")
def _oldest_candidates(
    listed, live, base, n, n_live, end, last, sinks, recent, k, out, m
):  # fmt: skip
    """The index rule's k victims of a list keeping dead entries: its k
    oldest candidates, written to out[m:m + k] (ascending); returns m + k,
    or m where it has fewer candidates than k (the caller walks the list).
    What the walk finds from the copy of the live slotted tokens, read off
    the list's two ends instead, each entry's bit tested:

        listed  [ sinks | dead and victims ... | candidates | window | t >= last ]
                  head: a live sinks, then     tail: live t >= end (unslotted)
                  the first k live past them   and last <= t < end (protected)

    The tail is the newest token in a decode step, the head the sinks and
    the dead run that the earlier victims left (kill_rows compacts it once
    as long as the live): reads only, against the copy's read and write of
    every entry."""
    lst, alive = listed[base : base + n], live[base:]
    j, unslotted, protected = n - 1, 0, 0
    while j >= 0 and lst[j] >= min(last, end):
        t = lst[j]
        if alive[t]:
            if t >= end:
                unslotted += 1
            else:
                protected += 1
        j -= 1
    count = n_live - unslotted  # the walk's n: live and slotted
    b = min(count - recent, count - protected)
    e, a = 0, 0
    while e < n and lst[e] < sinks:  # (a sink past `end`: count <= a, none)
        a += alive[lst[e]]
        e += 1
    if b - a < k:
        return m
    got = m
    while got < m + k:
        t = lst[e]
        if alive[t]:
            out[got] = t
            got += 1
        e += 1
    return got


@numba.njit(
    numba.types.UniTuple(_i64, 2)(
        # the batch and the rule
        _i64, _i64, _i64, _u64, numba.int64, numba.int64, numba.int64,
        # the Token Tables (TokenTablePool's arena)
        _i64, _i64, _i64, _i64, _i64, _i32, _b1, _i32, _i32, numba.int64, _i64,
        # the running scores (ScoreAccumulator's arena; rows -1: none) and
        # the fold's next victims (its columns: rule, cand, cand_end, cand_keys)
        _i64, _i64, _i64, _f32, _i64, _i64, _i64, _i64,
        # "persistence": the window and the arrival steps (ArrivalSteps')
        numba.int64, _i64, _i64, _i64, _i64,
    ),
    **_jit,
)  # fmt: skip
def evict_lowest(
    rows, want, attended, seeds, key_kind, recent, sinks,
    start, n_tokens, n_slotted, n_live, n_listed, listed, live, slot, block_live,
    shift, keep_dead,
    score_rows, score_start, score_cap, acc, rule, cand, cand_end, cand_keys,
    window, age_rows, age_start, born, age_step,
):  # fmt: skip
    """(counts, idx): row rows[i] loses up to want[i] live slotted tokens,
    those a `LowestRule` (key_kind, recent, sinks, window) picks, tokens from
    attended[i] - 1 on protected; idx lists them row by row, ascending.
    Bits cleared, blocks uncounted, live lists compacted as evict_rows does."""
    num = rows.size
    longest = total = 0
    for i in range(num):
        longest = max(longest, n_listed[rows[i]])
        total += max(want[i], 0)
    counts, out = np.zeros(num, np.int64), np.empty(total, np.int64)
    oldest = 0  # "persistence": _seen of every age up to the batch's oldest
    if key_kind == 3:
        for i in range(num):
            oldest = max(oldest, age_step[age_rows[i]] + 1)
    seen_at = np.empty(min(oldest, 4096), np.float64)
    for age in range(seen_at.size):
        seen_at[age] = _seen(age, window)
    # The row's live tokens, in order: its list itself when it holds no dead
    # (n_listed == n_live), else a copy.
    buf = np.empty(longest, np.int32)
    key = np.empty(longest, np.float64)
    taken = np.zeros(longest, np.bool_)
    real_at = np.empty(longest, np.int64)  # the sort's entries with a real key
    m = 0
    for i in range(num):
        # What the row AHEAD walks: its list, and "persistence"'s scores and
        # arrivals. Not for a "score" rule, whose steady step takes the
        # fold's choice and walks nothing (prefetching it anyway took H2O's
        # pass 1.45x as long at 1,024 rows, in-engine).
        a = i + AHEAD
        if key_kind != 0 and a < num and want[a] > 0:
            ra = rows[a]
            prefetch_span(listed, start[ra], n_listed[ra])
            if key_kind == 3 and score_rows[a] >= 0:
                prefetch_span(acc, score_start[score_rows[a]], n_slotted[ra])
                prefetch_span(born, age_start[age_rows[a]], n_slotted[ra])
        r = rows[i]
        end, k = n_slotted[r], max(want[i], 0)
        if k == 0:
            continue
        if key_kind == 0 and sinks == 0 and score_rows[i] >= 0:
            # The fold's choice (fold_kernels.fold), if taken for this rule
            # from this row's live tokens as they are: every known token
            # slotted and attended, the keys as many as the live and ending
            # at the newest (a token evicted or slotted since changes one).
            # Then no walk.
            srow, c = score_rows[i], cand[score_rows[i]] - 1
            same = rule[srow] == recent + 1 and cand_keys[srow] == n_live[r]
            rule[srow] = recent + 1  # the next fold finds this row's victim
            if (
                k == 1 and same and c >= 0  # c < 0: the fold found none
                and cand_end[srow] == end and attended[i] == end
                and n_tokens[r] == end
            ):  # fmt: skip
                out[m] = c
                m += 1
                counts[i] = 1
                continue
        base, n = start[r], n_listed[r]
        if key_kind == 1 and n != n_live[r]:
            # StreamingLLM's steady state: its victims stay listed, so the
            # list holds dead; its k oldest candidates are read off the
            # list's head, its counts off the tail, nothing copied.
            got = _oldest_candidates(
                listed, live, base, n, n_live[r], end, attended[i] - 1,
                sinks, recent, k, out, m,
            )  # fmt: skip
            if got > m:
                counts[i] = got - m
                m = got
                continue
        if n == n_live[r]:
            # No dead listed (every Random row: its victims leave the list
            # at once; the others' before their first victim and just after
            # their list is rewritten): read in place, not copied as
            # listed_live does. Random's one victim then reads the list's
            # last entries and the one drawn.
            n = slotted_len(listed, base, n, end)
            view = listed[base : base + n]
        else:
            n = listed_live(r, start, n_live, n_listed, n_slotted, listed, live, buf)
            view = buf[:n]
        if n == 0:
            continue
        # The view ascends, so the candidates (evictable, t < attended - 1;
        # past the sinks; before the recent window) are one run [a, b).
        last, a, b = attended[i] - 1, 0, n - recent
        while a < n and view[a] < sinks:
            a += 1
        evictable = n  # from the end: only the newest are past `last`
        while evictable > 0 and view[evictable - 1] >= last:
            evictable -= 1
        b = min(b, evictable)
        first, lo, nan = min(k, max(b - a, 0)), m, 0
        if key_kind == 1:  # the lowest keys are the first candidates
            for e in range(a, a + first):
                out[m] = view[e]
                m += 1
        elif first == 1 and key_kind == 2:
            # Random's steady state: one victim, drawn by its position among
            # the candidates (RandomPolicy.evict_batch, to the bit): no
            # token hashed.
            c = b - a
            u = _hash_uniform(seeds[i], c, view[n - 1])
            out[m] = view[a + min(np.int64(u * c), c - 1)]
            m += 1
        elif first == 1:  # "score", "persistence"
            # The steady state (a token over budget): one pass, each key
            # computed as it is compared, no key array, no second scan.
            srow = score_rows[i]
            sbase = score_start[srow] if srow >= 0 else 0
            scap = score_cap[srow] if srow >= 0 else 0
            arow = age_rows[i] if key_kind == 3 else -1
            best, low = -1, 0.0
            for e in range(a, b):
                t = view[e]
                if key_kind == 0:
                    x = np.float64(acc[sbase + t]) if t < scap else 0.0
                else:
                    score = np.float64(acc[sbase + t]) if t < scap else 0.0
                    age = age_step[arow] - born[age_start[arow] + t] + 1
                    x = _unimportance(score, age, window, seen_at)
                if best < 0 or _before(x, low):
                    best, low = e, x
            out[m] = view[best]
            m += 1
        else:  # keys, then k scans or a sort (the logical index needs none)
            srow = score_rows[i] if key_kind == 0 or key_kind == 3 else -1
            sbase = score_start[srow] if srow >= 0 else 0
            scap = score_cap[srow] if srow >= 0 else 0
            arow = age_rows[i] if key_kind == 3 else -1
            for e in range(a, b):
                t = view[e]
                if key_kind == 0:
                    key[e] = acc[sbase + t] if t < scap else 0.0
                elif key_kind == 2:
                    key[e] = _hash_uniform(seeds[i], t, view[n - 1])
                else:
                    score = np.float64(acc[sbase + t]) if t < scap else 0.0
                    age = age_step[arow] - born[age_start[arow] + t] + 1
                    key[e] = _unimportance(score, age, window, seen_at)
                nan += np.isnan(key[e])
                taken[e] = False
            if first <= _FEW:  # k scans (_before: NaN after every number)
                for _ in range(first):
                    best = -1
                    for e in range(a, b):
                        if not taken[e] and (best < 0 or _before(key[e], key[best])):
                            best = e
                    taken[best] = True
                    out[m] = view[best]
                    m += 1
            else:  # a stable sort of the real keys, then the NaN ones in order
                real = 0
                for e in range(a, b):
                    if not np.isnan(key[e]):
                        real_at[real] = e
                        real += 1
                order = np.argsort(key[real_at[:real]], kind="mergesort")
                q = 0
                while q < first and q < real:
                    out[m] = view[real_at[order[q]]]
                    m += 1
                    q += 1
                for e in range(a, b if nan else a):
                    if q >= first:
                        break
                    if np.isnan(key[e]):
                        out[m] = view[e]
                        m += 1
                        q += 1
        left = k - first  # then the protected evictable ones, oldest first
        for e in range(evictable):
            if left == 0:
                break
            if e < a or e >= b:
                out[m] = view[e]
                m += 1
                left -= 1
        counts[i] = m - lo
        for q in range(lo + 1, m):  # ascending (insertion: a few victims)
            t, w = out[q], q
            while w > lo and out[w - 1] > t:
                out[w] = out[w - 1]
                w -= 1
            out[w] = t
    indptr = np.zeros(num + 1, np.int64)
    for i in range(num):
        indptr[i + 1] = indptr[i] + counts[i]
    kill_rows(rows, indptr, out, start, n_live, n_listed, slot, live, listed,
              block_live, shift, keep_dead)  # fmt: skip
    return counts, out[:m]
