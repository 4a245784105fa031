# SPDX-License-Identifier: Apache-2.0
"""Compiled loops of the Token Table's per-step passes (numba).

Host side, both the scheduler's and the worker's tables. A step's walk over
the batch's tokens (slotting, eviction, the live lists) was a dozen NumPy
passes, each a temporary array of every token touched, plus a fixed cost per
call: at 1,024 requests most of a step's host time (docs/RESULTS.md, scale).
Here each is one loop over the rows and their tokens, in place. numba is a
vLLM dependency on every platform vToken runs on (vLLM's n-gram proposer
compiles with it); config.py refuses to start without it.

Signatures are explicit, so the kernels are compiled when this module is
imported (or loaded from numba's cache beside it) and never in a step; an
argument of another dtype or layout is a TypeError, not a recompile. The
callers (token_table.py) own the checks: these assume valid, distinct rows.
Blocks are of 1 << `shift` slots (arena.block_shift, the pool's): the loops
find a slot's block by a shift, since a division a row or token (the block
size is no constant to the compiler) cost slot_spans most of its pass
(1,024 rows, by hand: ~13 -> ~3 us).
"""

from __future__ import annotations

import numba
import numpy as np

from vllm.vtoken.prefetch import AHEAD, prefetch, prefetch_span

_i64, _i32, _b1 = numba.int64[::1], numba.int32[::1], numba.boolean[::1]
_jit = {"cache": True, "nogil": True}


@numba.njit(inline="always")
def slotted_len(listed, base, n, end):
    """How many of a list's first n entries (from `base`; ascending, no
    dead) are slotted: all but those at or past `end` (a resumed request's
    end is not slotted yet). Shared by listed_live and
    eviction_kernels.evict_lowest (whose numba cache does not see edits here:
    DEVELOPING.md)."""
    while n > 0 and listed[base + n - 1] >= end:
        n -= 1
    return n


@numba.njit(inline="always")
def listed_live(r, start, n_live, n_listed, n_slotted, listed, live, out):
    """Writes row r's live slotted tokens, ascending, to `out`; returns how
    many (eviction_kernels.evict_lowest; walk_row writes their slots too).
    A list without dead (every row's but those keeping their victims
    listed: kill_rows) is copied, its slotted prefix (a resumed request's
    end is not slotted yet), no entry tested: the test a token, a branch
    taken at random where the dead lie scattered, was most of a walk (by
    hand, 1,024 rows of 32 live and 40 listed: ~65 -> ~29 us)."""
    base, end, n = start[r], n_slotted[r], n_listed[r]
    lst = listed[base : base + n]
    if n == n_live[r]:
        k = slotted_len(listed, base, n, end)
        for j in range(k):
            out[j] = lst[j]
        return k
    alive, k = live[base:], 0
    for j in range(n):
        t = lst[j]
        if t < end and alive[t]:
            out[k] = t
            k += 1
    return k


@numba.njit(
    [
        numba.void(_i64, _i64),
        # A message's counts may be read-only (a transport's buffer).
        numba.void(numba.types.Array(numba.int64, 1, "C", readonly=True), _i64),
    ],
    **_jit,
)
def offsets_into(counts, out):
    """out[0] = 0, out[i + 1] = counts[0] + ... + counts[i]: a CSR's offsets
    (TokenTablePool.offsets)."""
    if out.size != counts.size + 1:
        raise ValueError("offsets_into: out is not one longer than counts")
    total = out[0] = 0
    for i in range(counts.size):
        total += counts[i]
        out[i + 1] = total


@numba.njit(inline="always")
def prefetch_row(r, start, n_listed, n_slotted, listed, live, slot):
    """Prefetches what walk_row reads of row r: its live list, its slotted
    tokens' bits and slots (prefetch.py: the walks ask for the row AHEAD of
    the one they read)."""
    base = start[r]
    prefetch_span(listed, base, n_listed[r])
    prefetch_span(live, base, n_slotted[r])
    prefetch_span(slot, base, n_slotted[r])


@numba.njit(inline="always")
def prefetch_tail(r, start, n_listed, n_slotted, listed, live, slot):
    """Prefetches the lines slot_row writes first for row r: its next
    token's slot and bit, and its live list's next entry."""
    prefetch(slot, start[r] + n_slotted[r])
    prefetch(live, start[r] + n_slotted[r])
    prefetch(listed, start[r] + n_listed[r])


# walk_row's `computed` when the caller wants no query count.
_NO_QUERIES = 1 << 62


@numba.njit
def walk_row(
    r, computed, m, idx, out, start, n_live, n_listed, n_slotted, listed, live, slot
):  # fmt: skip
    """Row r's live slotted tokens, in logical order, written to idx (logical)
    and out (their slots) from entry m on. Returns (m past them, how many are
    at or past `computed`: the step's queries, the last ones). Shared by
    read_walk, live_tokens and append_read.

    Each list in one loop writing both arrays, indexed flat (`idx[m]`): a
    list with dead (every policy's but Random's: kill_rows) tests each
    entry's bit, one without is copied. A function of its own: inlined
    (numba's `inline="always"`, as it was), listed_live into views and then
    a second loop gathering the slots, the token read's walk took ~1.6x as
    long (by hand on an Intel Xeon VM, in-engine states of 1,024 rows of 33
    live tokens at budget 32, warm: read_walk 145-162 -> 87-104 us with the
    dead listed, 125 -> 66 without (Random); append_read 190-206 -> 126-141
    and 165 -> 105)."""
    base, end, n = start[r], n_slotted[r], n_listed[r]
    lo = m
    if n == n_live[r]:
        for j in range(base, base + slotted_len(listed, base, n, end)):
            t = listed[j]
            idx[m] = t
            out[m] = slot[base + t]
            m += 1
    else:
        for j in range(base, base + n):
            t = listed[j]
            if t < end and live[base + t]:
                idx[m] = t
                out[m] = slot[base + t]
                m += 1
    queries = 0
    while queries < m - lo and idx[m - 1 - queries] >= computed:
        queries += 1
    return m, queries


@numba.njit(
    numba.types.Tuple((_i64, _i64, _i32))(
        _i64, _i64, _i64, _i64, _i64, _i32, _b1, _i32
    ),
    **_jit,
)
def live_tokens(rows, start, n_live, n_listed, n_slotted, listed, live, slot):
    """(seg, idx, slot) of the live slotted tokens of `rows`, in logical order
    per row: each row's live list, without the dead and the unslotted."""
    n = 0
    for r in rows:
        n += n_listed[r]
    seg, idx, out = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int32)
    m = 0
    for i in range(rows.size):
        lo = m
        m, _ = walk_row(rows[i], _NO_QUERIES, m, idx, out, start, n_live,
                        n_listed, n_slotted, listed, live, slot)  # fmt: skip
        for j in range(lo, m):
            seg[j] = i
    return seg[:m], idx[:m], out[:m]


@numba.njit(
    numba.types.Tuple((_i64, _i64, _i64, numba.int64))(
        _i64, _i64, _i64, _i64, _i64, _i64, _i32, _b1, _i32
    ),
    **_jit,
)
def read_walk(rows, computed, start, n_live, n_listed, n_slotted, listed, live, slot):
    """`live_tokens` for the token read (context.read_keys): (counts, idx,
    slot, queries), per row i its number of live slotted tokens, their
    logical indices and slots (int64, the read's index type), and how many
    of them, over all rows, are at or past computed[i] (the step's queries)."""
    n = 0
    for r in rows:
        n += n_listed[r]
    counts, idx, out = (
        np.zeros(rows.size, np.int64),
        np.empty(n, np.int64),
        np.empty(n, np.int64),
    )
    m = queries = 0
    for i in range(rows.size):
        lo = m
        m, q = walk_row(rows[i], computed[i], m, idx, out, start, n_live,
                        n_listed, n_slotted, listed, live, slot)  # fmt: skip
        queries += q
        counts[i] = m - lo
    return counts, idx[:m], out[:m], queries


@numba.njit(inline="always")
def slot_row(
    r, end, slots, start, n_tokens, n_slotted, n_live, n_listed, slot, live,
    listed, block_live, shift,
):  # fmt: skip
    """Row r's tokens [n_slotted, end) take `slots`: tokens never slotted
    before are born live and listed last, re-slotted ones keep their bit;
    every live token's block counts it. Returns the number born. Shared by
    append_rows and append_read."""
    base, first, known = start[r], n_slotted[r], n_tokens[r]
    born = 0
    for t in range(first, end):
        s = slots[t - first]
        slot[base + t] = s
        if t >= known:  # the newest tokens: appended to the live list
            live[base + t] = True
            listed[base + n_listed[r] + born] = t
            born += 1
        if live[base + t]:
            block_live[s >> shift] += 1
    n_live[r] += born
    n_listed[r] += born
    n_tokens[r] = max(known, end)
    n_slotted[r] = end
    return born


@numba.njit(numba.int64(*[_i64] * 9, _i32, _b1, _i32, _i32, numba.int64), **_jit)
def append_rows(
    rows, counts, slots, start, cap, n_tokens, n_slotted, n_live, n_listed,
    slot, live, listed, block_live, shift,
):  # fmt: skip
    """Row i takes the next counts[i] of `slots` (TokenTablePool.append_rows).
    Tokens never slotted before are born live and listed last; re-slotted
    ones keep their bit. Every live token's block counts it. Returns the
    number of new tokens, or -1, nothing changed, if a row's region is too
    small (arena.reserve, then again: rarely, a region doubles). Counts that
    are not one a row, negative, or not adding up to the slots raise (a
    NumPy sum before the call cost ~17 µs at 1,024 rows, cold)."""
    if counts.size != rows.size:
        raise ValueError("append_rows: not a count per row")
    short, need = False, 0
    for i in range(rows.size):
        if counts[i] < 0:
            raise ValueError("append_rows: a negative count")
        need += counts[i]
        short |= n_slotted[rows[i]] + counts[i] > cap[rows[i]]
    if need != slots.size:
        raise ValueError("append_rows: counts do not add up to the slots")
    if short:
        return -1
    k = total = 0
    ahead = 0  # where row i + AHEAD's slots start
    for i in range(min(AHEAD, rows.size)):
        ahead += counts[i]
    for i in range(rows.size):
        if i + AHEAD < rows.size:  # the lines its tokens go to
            prefetch_tail(
                rows[i + AHEAD], start, n_listed, n_slotted, listed, live, slot
            )
            if counts[i + AHEAD] > 0:  # its first slot's block count
                prefetch(block_live, slots[ahead] >> shift)
            ahead += counts[i + AHEAD]
        r = rows[i]
        total += slot_row(
            r, n_slotted[r] + counts[i], slots[k : k + counts[i]], start,
            n_tokens, n_slotted, n_live, n_listed, slot, live, listed,
            block_live, shift,
        )  # fmt: skip
        k += counts[i]
    return total


@numba.njit(inline="always")
def kill_rows(
    rows, indptr, idx, start, n_live, n_listed, slot, live, listed, block_live,
    shift, keep_dead,
):  # fmt: skip
    """Row rows[i] loses its live tokens idx[indptr[i]:indptr[i + 1]]: bits
    cleared, blocks uncounted, and taken out of its live list, so that the
    list holds the live tokens only and a walk copies it (`listed_live`).
    A row with keep_dead[row] (a column: TokenTablePool.add_request) leaves
    its victims listed until the dead are as many as the live (and 16),
    then compacts: the kill then reads no list, and the walks test each
    entry's bit (which rows: EvictionPolicy.scatters_victims). Victims are
    live and distinct per row (the callers check: a dead one would take a
    live token's entry out of a list without dead). Shared by
    evict_rows and eviction_kernels.evict_lowest (whose numba cache does
    not see edits here: DEVELOPING.md). The batch in one loop: a helper
    called a row at a time (inlined, with the row's victims a slice) cost
    ~55 ns a row more, most of a step's kill at a victim a row (evict_rows:
    73 against 15 µs, 1,024 rows)."""
    for i in range(rows.size):
        a = i + AHEAD
        if a < rows.size and indptr[a + 1] > indptr[a]:  # its list, its victim
            b = start[rows[a]]
            prefetch_span(listed, b, n_listed[rows[a]])
            prefetch(live, b + idx[indptr[a]])
            prefetch(slot, b + idx[indptr[a]])
        r, lo, hi = rows[i], indptr[i], indptr[i + 1]
        if hi == lo:
            continue
        base, first, packed = start[r], idx[lo], n_listed[r] == n_live[r]
        for q in range(lo, hi):
            p = base + idx[q]
            live[p] = False
            block_live[slot[p] >> shift] -= 1
            first = min(first, idx[q])
        n_live[r] -= hi - lo
        n, a = n_listed[r], 0
        lst = listed[base : base + n]
        if keep_dead[r]:
            if n - n_live[r] < max(n_live[r], 16):
                continue
            packed = False  # as many dead as live: compacted, from the start
        # The list ascends: entries before the first victim stay (in a list
        # without dead), the rest close up over the dead. One victim in a
        # list without dead (a decode step's usual kill): found by a scan
        # (a bisection's branches cost more at ~40 entries), then the list
        # after it shifts down by one. By hand, 1,024 rows of 32 live, a
        # victim each: ~20 us, against ~2 leaving the dead listed, and the
        # walk ~65 -> ~29 us.
        while packed and a < n and lst[a] < first:
            a += 1
        if packed and hi - lo == 1:
            after, into = listed[base + a + 1 : base + n], lst[a : n - 1]
            for j in range(after.size):
                into[j] = after[j]
            w = n - 1
        else:
            w = a
            for j in range(a, n):
                t = lst[j]
                if live[base + t]:
                    lst[w] = t
                    w += 1
        for j in range(w, n):
            lst[j] = -1
        n_listed[r] = w


@numba.njit(
    numba.int64(
        _i64, _i64, _i64, _i64, _i64, _i64, _i32, _b1, _i32, _i32, numba.int64, _i64
    ),
    **_jit,
)
def evict_rows(
    rows, indptr, idx, start, n_live, n_listed, slot, live, listed, block_live,
    shift, keep_dead,
):  # fmt: skip
    """Row i's tokens idx[indptr[i]:indptr[i + 1]] die (TokenTablePool.
    evict_rows): bits cleared, blocks uncounted, live lists as kill_rows
    keeps them. Returns -1, or the position in `idx` of a token already
    dead (then nothing changed)."""
    for i in range(rows.size):  # the first reads of the victims' lines
        a = i + AHEAD
        if a < rows.size and indptr[a + 1] > indptr[a]:
            prefetch(live, start[rows[a]] + idx[indptr[a]])
            prefetch(slot, start[rows[a]] + idx[indptr[a]])
        base = start[rows[i]]
        for j in range(indptr[i], indptr[i + 1]):
            if not live[base + idx[j]]:
                return j
    kill_rows(rows, indptr, idx, start, n_live, n_listed, slot, live, listed,
              block_live, shift, keep_dead)  # fmt: skip
    return -1


@numba.njit(
    numba.int64(
        _i64, _b1, _i64, _i64, _i64, _i64, _i64, _i32, _b1, _i32, numba.int64,
        numba.int64,
    ),
    **_jit,
)  # fmt: skip
def move_rows(
    rows, keep, indptr, idx, dst, start, n_slotted, slot, live, block_live,
    shift, num_slots,
):  # fmt: skip
    """A move batch lands (TokenTablePool.apply_moves): for each i kept
    (rows[i] >= 0, keep[i], row slotted), token idx[j] of row rows[i] takes
    slot dst[j], j in [indptr[i], indptr[i + 1]); a live one's count moves
    from its old block to its new one. Returns -1, or the first j whose
    token is not slotted or whose slot is outside [0, num_slots), or
    idx.size if indptr decreases (then nothing changed: numba reads without
    bounds; the caller checked indptr's ends)."""
    for i in range(rows.size):
        if indptr[i] > indptr[i + 1]:
            return idx.size
    for i in range(rows.size):
        r = rows[i]
        if r >= 0 and keep[i] and n_slotted[r] > 0:
            for j in range(indptr[i], indptr[i + 1]):
                if not (0 <= idx[j] < n_slotted[r] and 0 <= dst[j] < num_slots):
                    return j
    for i in range(rows.size):
        r = rows[i]
        if r < 0 or not keep[i] or n_slotted[r] == 0:
            continue  # finished, preempted, or not to be switched
        base = start[r]
        for j in range(indptr[i], indptr[i + 1]):
            p = base + idx[j]
            if live[p]:
                block_live[slot[p] >> shift] -= 1
                block_live[dst[j] >> shift] += 1
            slot[p] = dst[j]
    return -1


@numba.njit(
    numba.types.UniTuple(_i64, 3)(
        _i64, _i64, _i64, _i64, _i64, _i32, _i32, numba.int64, numba.int64
    ),
    **_jit,
)
def emptied_blocks(
    rows, seg, idx, start, n_slotted, slot, block_live, shift, num_blocks
):  # fmt: skip
    """(seg, blk, entry): the full blocks left without a live token holding
    tokens idx[j] of rows[seg[j]] (just evicted), each (seg, block) once,
    sorted by seg then block (BlockReclaimer.free_empty_blocks); `entry`:
    where one of those tokens was written in the positional list (idx >> shift),
    the block's entry unless compaction moved the token there."""
    keys, at = np.empty(idx.size, np.int64), np.empty(idx.size, np.int64)
    n = 0
    for j in range(idx.size):
        r = rows[seg[j]]
        if idx[j] >> shift < n_slotted[r] >> shift:  # a full block: written
            b = slot[start[r] + idx[j]] >> shift
            if block_live[b] == 0:
                keys[n], at[n] = seg[j] * num_blocks + b, idx[j] >> shift
                n += 1
    order = np.argsort(keys[:n], kind="mergesort")
    out, entry = np.empty(n, np.int64), np.empty(n, np.int64)
    m = 0
    for q in range(n):  # unique keys, each with its first token's entry
        j = order[q]
        if m == 0 or keys[j] != out[m - 1]:
            out[m], entry[m] = keys[j], at[j]
            m += 1
    return out[:m] // num_blocks, out[:m] % num_blocks, entry[:m]


@numba.njit(
    numba.types.Tuple((_b1, _i64, _i64, _i64))(*[_i64] * 7),
    **_jit,
)
def over_budget(rows, prompt, limit, n_tokens, n_slotted, n_live, budget):
    """The scheduler's step, before evicting (VTokenScheduler.begin_step):
    (ok, which, attended, excess). ok[i]: rows[i] exists (>= 0), has its
    prompt[i] tokens attended (n_slotted) and every token it knows slotted
    again (n_tokens: a resumed request recomputing in chunks is not, though
    a chunk may pass its prompt), and, where `limit` is given (not
    empty), fewer than limit[i] (its last step's output is in). Of those,
    `which` (ascending) hold more live tokens than budget[row], by `excess`,
    with `attended` slotted."""
    R = rows.size
    ok = np.zeros(R, np.bool_)
    which, attended, excess = (
        np.empty(R, np.int64),
        np.empty(R, np.int64),
        np.empty(R, np.int64),
    )
    m = 0
    for i in range(R):
        r = rows[i]
        if r < 0 or prompt[i] > n_slotted[r] or n_slotted[r] < n_tokens[r]:
            continue
        if limit.size and n_slotted[r] >= limit[i]:
            continue
        ok[i] = True
        e = n_live[r] - budget[r]
        if e > 0:
            which[m], attended[m], excess[m] = i, n_slotted[r], e
            m += 1
    return ok, which[:m], attended[:m], excess[:m]


@numba.njit(_i64(_i64), **_jit)
def evicted_runs(counts):
    """After a step's eviction (run i lost counts[i] tokens): the run of
    each evicted token, i repeated counts[i] times."""
    seg = np.empty(counts.sum(), np.int64)
    m = 0
    for i in range(counts.size):
        seg[m : m + counts[i]] = i
        m += counts[i]
    return seg


@numba.njit(_b1(_i64, _i64, _i64, _i64, _i64, numba.int64), **_jit)
def plan_due(rows, n_tokens, n_live, n_dead_marked, n_nulls, block_size):
    """Whether rows[i] is due for the planner: a block's worth of tokens
    died since its mark (TokenTablePool.dead_since_mark_rows), and its dead
    tokens less a block per freed one (an upper bound on its holes, the
    planner's own test) still fill a block."""
    B = block_size
    due = np.empty(rows.size, np.bool_)
    for i in range(rows.size):
        r = rows[i]
        dead = n_tokens[r] - n_live[r]
        due[i] = dead - n_dead_marked[r] >= B and dead - n_nulls[r] * B >= B
    return due


# append_read's status bits: nothing changed (HITS, ROOM), or keys not
# listed (DEAD_QUERY), or a row without a dead token (STOCK).
HITS, ROOM, DEAD_QUERY, STOCK = 1, 2, 4, 8


@numba.njit(
    numba.types.Tuple((numba.int64, numba.int64, _b1, _i64, _i64, _i64))(
        _i64, _i64, _i64, _i64, _b1, numba.boolean,
        _i64, _i64, _i64, _i64, _i64, _i64, _i32, _b1, _i32, _i32, numba.int64,
    ),
    **_jit,
)  # fmt: skip
def append_read(
    rows, computed, counts, slots, scored, with_hits,
    start, cap, n_tokens, n_slotted, n_live, n_listed, slot, live, listed,
    block_live, shift,
):  # fmt: skip
    """The worker's step on its tables, one pass (VTokenWorker.prepare_attention):
    row i takes its prefix-cache hits (tokens [n_slotted, computed[i]), listed
    first in `slots` when `with_hits`) and counts[i] new tokens (`append_rows`);
    rows with a dead token after that, or `scored`, are read: their keys are
    their live slotted tokens before computed[i], then the step's queries.

    Returns (status, new, writes, kv_indptr, idx, kv): `new` tokens were born,
    writes[i] says row i has a dead token, and row i's keys are entries
    [kv_indptr[i], kv_indptr[i + 1]) of idx (logical) and kv (slots); an
    unread row has none. status HITS (a row has hits and not `with_hits`) or
    ROOM (a region is too small: arena.reserve) changed nothing; DEAD_QUERY:
    a query token is dead (a resumed request recomputes it), so the keys,
    which list live tokens only, are not the read's (context.read_keys);
    STOCK: a row has no dead token (vLLM's kernel writes its output)."""
    R = rows.size
    if computed.size != R or counts.size != R or scored.size != R:
        raise ValueError("append_read: not one count, computed and flag a row")
    status = total = 0
    for i in range(R):
        r = rows[i]
        if counts[i] < 0:
            raise ValueError("append_read: a negative count")
        hits = max(computed[i] - n_slotted[r], 0)
        if hits and not with_hits:
            status |= HITS
        if n_slotted[r] + hits + counts[i] > cap[r]:
            status |= ROOM
        total += counts[i] + (hits if with_hits else 0)
    if total > slots.size:
        raise ValueError("append_read: fewer slots than tokens")
    empty = np.zeros(0, np.int64)
    if status:
        return status, 0, np.zeros(R, np.bool_), empty, empty, empty
    k = new = 0
    for i in range(R):  # append_rows, the hits first
        if i + AHEAD < R:  # the lines its tail's tokens go to
            prefetch_tail(
                rows[i + AHEAD], start, n_listed, n_slotted, listed, live, slot
            )
        r = rows[i]
        n = max(computed[i] - n_slotted[r], 0) + counts[i]
        new += slot_row(
            r, n_slotted[r] + n, slots[k : k + n], start, n_tokens, n_slotted,
            n_live, n_listed, slot, live, listed, block_live, shift,
        )  # fmt: skip
        k += n
    writes = np.empty(R, np.bool_)
    kv_indptr = np.zeros(R + 1, np.int64)
    n = 0
    for i in range(R):
        r = rows[i]
        writes[i] = n_live[r] < n_tokens[r]
        status |= STOCK * (not writes[i])
        if writes[i] or scored[i]:
            n += n_listed[r]
    idx, kv = np.empty(n, np.int64), np.empty(n, np.int64)
    m = 0
    for i in range(R):  # read_walk of the rows read
        if i + AHEAD < R and (writes[i + AHEAD] or scored[i + AHEAD]):
            prefetch_row(
                rows[i + AHEAD], start, n_listed, n_slotted, listed, live, slot
            )
        r = rows[i]
        if writes[i] or scored[i]:
            m, queries = walk_row(r, computed[i], m, idx, kv, start, n_live,
                                  n_listed, n_slotted, listed, live, slot)  # fmt: skip
            if queries != n_slotted[r] - computed[i]:
                status |= DEAD_QUERY
        kv_indptr[i + 1] = m
    return status, new, writes, kv_indptr, idx[:m], kv[:m]


@numba.njit(
    numba.types.Tuple((numba.boolean, _i64, _i64, _i64, _i64))(
        _i64, _i64, _i64, _i64, numba.int64
    ),
    **_jit,
)
def slot_spans(rows, take, n_slotted, n_tokens, shift):
    """The scheduler's step, before slotting (VTokenScheduler._sync_slots):
    row i slots tokens [n_slotted, n_slotted + take[i]). Returns (resumed,
    fresh, need, first, end): `resumed` if a row re-slots known tokens (the
    general path's case); `fresh` the rows with no token yet (their
    prefix-cache hits are the caller's to add to `take`); and for the rows
    `need` whose new tokens reach past their tail block (the block of their
    last slotted token), the entries [first, end) of their block lists that
    hold those tokens' blocks."""
    R, B = rows.size, 1 << shift
    resumed = False
    n_fresh = n_need = 0
    for i in range(R):
        r = rows[i]
        resumed |= n_slotted[r] < n_tokens[r] and take[i] > 0
        n_fresh += n_tokens[r] == 0
        n_need += (n_slotted[r] + take[i] - 1) >> shift >= (
            n_slotted[r] + B - 1
        ) >> shift
    fresh, need = np.empty(n_fresh, np.int64), np.empty(n_need, np.int64)
    first, end = np.empty(n_need, np.int64), np.empty(n_need, np.int64)
    f = m = 0
    for i in range(R):
        r = rows[i]
        if n_tokens[r] == 0:
            fresh[f] = i
            f += 1
        lo, hi = (n_slotted[r] + B - 1) >> shift, (n_slotted[r] + take[i] - 1) >> shift
        if hi >= lo:
            need[m], first[m], end[m] = i, lo, hi + 1
            m += 1
    return resumed, fresh, need, first, end


@numba.njit(_i64(_i64, _i64, _i64, _i64, _i64, _i32, numba.int64), **_jit)
def positional_slots(rows, take, ids, start, n_slotted, slot, shift):
    """The slots of row i's tokens [n_slotted, n_slotted + take[i]), flat:
    in its tail block (the block of its last slotted token, which nothing
    frees or moves) while they fit, then in blocks `ids` (slot_spans' entries
    of each row's block list, row by row)."""
    B, total = 1 << shift, 0
    for i in range(rows.size):
        total += take[i]
    out = np.empty(total, np.int64)
    k = h = 0
    for i in range(rows.size):
        if i + AHEAD < rows.size:  # its last token's slot
            a = rows[i + AHEAD]
            prefetch(slot, start[a] + n_slotted[a] - 1)
        r = rows[i]
        s0 = n_slotted[r]
        lo = (s0 + B - 1) >> shift  # the first block past the tail
        tail = slot[start[r] + s0 - 1] >> shift if s0 & (B - 1) else -1
        for t in range(s0, s0 + take[i]):
            b = t >> shift
            if b < lo:
                out[k] = tail * B + (t & (B - 1))
            else:
                if h + b - lo >= ids.size:
                    raise ValueError("positional_slots: a block list is too short")
                out[k] = ids[h + b - lo] * B + (t & (B - 1))
            k += 1
        if take[i] > 0 and (s0 + take[i] - 1) >> shift >= lo:
            h += ((s0 + take[i] - 1) >> shift) - lo + 1
    if h != ids.size:
        raise ValueError("positional_slots: more block ids than blocks")
    return out
