# SPDX-License-Identifier: Apache-2.0
"""Compiled loops over block ids (numba): BlockIndex's mirror of vLLM's
positional lists, and BlockReclaimer's busy marks.

Scheduler side, for block_index.py: recording a step's new blocks and finding
blocks in their lists, each one loop over the batch, where a Python pass over
each request's list (or a dict per list) cost the planner and the freeing
per request; for reclaimer.py: an acknowledged batch's blocks made idle.
Imported only with vToken on; compiled at import, as table_kernels.py is.
The callers own the checks: rows distinct and their regions large enough.
"""

from __future__ import annotations

import numba
import numpy as np

_i64, _i32 = numba.int64[::1], numba.int32[::1]
_jit = {"cache": True, "nogil": True}


@numba.njit(numba.void(_i64, _i64, _i64, _i64, _i64, _i64, _i32), **_jit)
def write_entries(rows, first, end, ids, start, n, mirror):
    """Entries [first[i], end[i]) of row rows[i] hold the next of `ids`
    (flat, row by row); each row's count `n` grows to cover them."""
    k = 0
    for i in range(rows.size):
        r = rows[i]
        m = mirror[start[r] :]
        if k + end[i] - first[i] > ids.size:
            raise ValueError("write_entries: fewer ids than entries")
        if first[i] > n[r]:  # entries [n, first) would hold no id
            raise ValueError("write_entries: a gap in a list")
        for e in range(first[i], end[i]):
            m[e] = ids[k]
            k += 1
        if end[i] > n[r]:
            n[r] = end[i]
    if k != ids.size:
        raise ValueError("write_entries: more ids than entries")


@numba.njit(_i64(_i64, _i64, _i64, _i64, _i64, _i32), **_jit)
def locate(rows, hint, ids, start, n, mirror):
    """The entry of block ids[j] in row rows[j]'s list: hint[j] where it is
    there (where its tokens were written, or where the planner found it),
    else the first entry holding it (a scan of the row), -1 if none does."""
    out = np.empty(ids.size, np.int64)
    for j in range(ids.size):
        r, h, b = rows[j], hint[j], ids[j]
        m = mirror[start[r] : start[r] + n[r]]
        if 0 <= h < m.size and m[h] == b:
            out[j] = h
            continue
        out[j] = -1
        for e in range(m.size):
            if m[e] == b:
                out[j] = e
                break
    return out


@numba.njit(numba.void(_i64, _i64, _i64, numba.int64), **_jit)
def release_busy(busy, src, dst, batch_id):
    """Blocks `src` and `dst` (ids) are busy no more where `batch_id` holds
    them (BlockReclaimer._busy; a dropped part's may be another batch's
    since). One loop: as NumPy, five calls on a cold array after the
    forward (~100 us an acknowledgement at 1,024 requests)."""
    for ids in (src, dst):
        for j in range(ids.size):
            if busy[ids[j]] == batch_id:
                busy[ids[j]] = -1


@numba.njit(
    numba.types.UniTuple(_i64, 3)(_i64, _i64, _i64, _i64, _i64, _i32, numba.int64),
    **_jit,
)
def holders(ids, start, cap, n, n_slotted, mirror, shift):
    """(rows, entries, blocks): every mirrored entry of any row holding one
    of blocks `ids`, where the row has slotted every token of that entry
    (the entry's tokens are all known to it), by row then entry. A block
    every holder of which evicted its tokens is freed from each list
    (BlockReclaimer.free_empty_blocks): one pass over every list."""
    want = np.zeros(ids.max() + 1 if ids.size else 0, np.bool_)
    for b in ids:
        want[b] = True
    most = 0
    for r in range(start.size):
        most += min(n[r], cap[r])
    out = np.empty((3, most), np.int64)
    k = 0
    for r in range(start.size):
        m = mirror[start[r] : start[r] + min(n[r], cap[r])]
        for e in range(min(m.size, n_slotted[r] >> shift)):
            b = m[e]
            if 0 <= b < want.size and want[b]:
                out[0, k], out[1, k], out[2, k] = r, e, b
                k += 1
    return out[0, :k].copy(), out[1, :k].copy(), out[2, :k].copy()
