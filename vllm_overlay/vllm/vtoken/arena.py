# SPDX-License-Identifier: Apache-2.0
"""Per-request flat storage: a row per request, a region of one arena each.

Both sides keep per-token arrays for every running request (the Token Tables'
slots and liveness bits, the worker's attention scores). Kept as one array per
request, every step pays a handful of NumPy calls per request; kept here, a
step's work over the whole batch is a fixed number of calls on flat arrays
(`rows`, then fancy indexing at `start[rows] + idx`, see `segments`)::

    arena    [ a0 a1 a2 a3 | b0 b1 .  .  | a0 ... a7 .  .  .  .  .  .  .  . ]
               (a's old region, cleared)   a's region after it grew
    start    a -> 8, b -> 4          cap  a -> 16, b -> 4

A region that must grow moves to the arena's end, doubled; a full arena is
compacted (regions copied back to back) and doubled when over half full.
Entries outside what a row uses hold the array's fill value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain, repeat
from operator import getitem, itemgetter

import numpy as np


def as_index(values: np.ndarray | list[int], what: str) -> np.ndarray:
    """`values` as a 1-D int64 array; asserts it holds integers."""
    arr = np.asarray(values)
    assert arr.ndim == 1, f"{what} must be 1-D, got shape {arr.shape}"
    # dtype.kind, not np.issubdtype (three Python calls; hooks call this).
    assert arr.size == 0 or arr.dtype.kind in "iu", (
        f"{what} must hold integers, got dtype {arr.dtype}"
    )
    return arr.astype(np.int64, copy=False)


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """int64: the concatenation of [starts[i], starts[i] + counts[i])."""
    counts = np.asarray(counts, np.int64)
    before = counts.cumsum() - counts
    offset = (np.asarray(starts, np.int64) - before).repeat(counts)
    return offset + np.arange(int(counts.sum()), dtype=np.int64)


def indptr_of(counts: np.ndarray) -> np.ndarray:
    """int64 [n + 1]: the CSR offsets of n segments of `counts` entries, 0
    first (np.r_[0, np.cumsum(counts)] costs a dozen Python calls; a step's
    hooks build several)."""
    out = np.zeros(len(counts) + 1, np.int64)
    np.asarray(counts).cumsum(out=out[1:])
    return out


def block_shift(block_size: int) -> int:
    """log2(block_size): the compiled loops find a slot's block by a shift
    (a division per token costs more than the rest of their pass). vLLM's
    block sizes are powers of two; the flags' check refuses others at
    start-up, and this raises (not an assert: `python -O` would strip it)
    should a backend change the block size after that check."""
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"vToken: block size {block_size} is not a power of two")
    return block_size.bit_length() - 1


def segments(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(seg, k) of the flat concatenation of segments of `counts` entries:
    each entry's segment and its offset within it, both int64."""
    counts = np.asarray(counts, np.int64)
    seg = np.arange(counts.size).repeat(counts)
    k = np.arange(seg.size, dtype=np.int64) - (counts.cumsum() - counts)[seg]
    return seg, k


def add_counts(counts: np.ndarray, ids: np.ndarray, delta: int) -> None:
    """counts[ids] += delta, once per occurrence (np.add.at, which is slow:
    a bincount over `counts` for many ids, np.unique over the ids for few)."""
    if not ids.size:
        return
    if 8 * ids.size >= counts.size:
        n = np.bincount(ids, minlength=counts.size)
        counts += (n * delta).astype(counts.dtype)
    else:
        u, n = np.unique(ids, return_counts=True)
        counts[u] += (n * delta).astype(counts.dtype)


def attrs(objs: Sequence, getter) -> np.ndarray:
    """int64 [n]: getter(obj) of each of `objs` (an attrgetter: the loop in C)."""
    return np.fromiter(map(getter, objs), np.int64, len(objs))


def picked(items: Sequence, mask: np.ndarray) -> list:
    """[x for x, m in zip(items, mask) if m] for a NumPy bool `mask` as long
    as `items`, by its set entries: `compress(items, mask)` makes a NumPy
    bool of each entry (at 1,024 requests ~15 us warm, ~80 in a step's cold
    cache), and a step picks few (the rows due for the planner: a sixteenth
    at budget 32)."""
    return list(map(items.__getitem__, mask.nonzero()[0].tolist()))


def spans_of(lists: Sequence[list], first: Sequence[int], end: Sequence[int]):
    """An iterator over lists[k][first[k]:end[k]], one span after another:
    the loops in C (a comprehension is a Python iteration per item)."""
    return chain.from_iterable(map(getitem, lists, map(slice, first, end)))


def block_spans(start: np.ndarray, counts: np.ndarray, block_size: int):
    """(first, end): the blocks [first[k], end[k]) holding tokens
    [start[k], start[k] + counts[k]) of request k (counts > 0)."""
    return start // block_size, (start + counts - 1) // block_size + 1


def span_slots(ids, start, counts, block_size: int) -> np.ndarray:
    """int64: the positional slots of tokens [start[k], start[k] + counts[k])
    of each request k (counts > 0), one request after another, from `ids`:
    the block ids of each one's `block_spans`, concatenated (spans_of)."""
    first, end = block_spans(start, counts, block_size)
    nblocks = end - first
    seg, k = segments(counts)
    pos = start[seg] + k
    at = (nblocks.cumsum() - nblocks - first)[seg] + pos // block_size
    return ids[at] * block_size + pos % block_size


def each_distinct(objs: Sequence, fn: Callable) -> list:
    """[fn(x) for x in objs], fn called once per distinct object (by
    identity: a plug-in's may define __eq__): a step's requests share a few
    settings and policies, so a call a request becomes a few a step."""
    ids = list(map(id, objs))
    of = {i: fn(x) for i, x in dict(zip(ids, objs, strict=True)).items()}
    return list(map(of.__getitem__, ids))


def values(table: dict, keys: Sequence) -> list:
    """[table[k] for k in keys], the loop in C (KeyError if absent)."""
    if len(keys) <= 1:
        return [table[k] for k in keys]
    return list(itemgetter(*keys)(table))


def lookup(table: dict, keys: Sequence, dtype=np.int64) -> np.ndarray:
    """`values(table, keys)` as an array."""
    return np.array(values(table, keys), dtype=dtype)


class RowArena:
    """Rows keyed by request id, each with int64 columns and arena regions.

    `data[name]` are the arena arrays (re-read them after `reserve`: it may
    replace them); `start` and `cap` the rows' regions; `cols[name]` the
    per-row int64 columns (0 for a new row).
    """

    def __init__(
        self, arrays: dict[str, tuple[type, object]], columns: Sequence[str] = ()
    ) -> None:
        self._fill = {name: fill for name, (_, fill) in arrays.items()}
        self.data = {n: np.full(1024, f, dtype=d) for n, (d, f) in arrays.items()}
        self.start = np.zeros(0, np.int64)
        self.cap = np.zeros(0, np.int64)
        self.cols = {name: np.zeros(0, np.int64) for name in columns}
        self.index: dict[str, int] = {}  # request id -> row
        self.generation = 0  # bumped whenever a row is added or removed
        self._free: list[int] = []
        self._top = 0  # first arena entry no region has used

    def add(self, key: str) -> int:
        """A row for `key` (zeroed columns, no region yet)."""
        return int(self.add_many([key])[0])

    def add_many(self, keys: Sequence[str]) -> np.ndarray:
        """int64: rows for distinct `keys` without one, at once (a step's
        admissions: an assignment a column for all of them)."""
        n = len(keys)
        if not n:
            return np.zeros(0, np.int64)
        assert len(set(keys)) == n, "a key twice"
        assert self.index.keys().isdisjoint(keys), "a key already has a row"
        while len(self._free) < n:  # doubled, as often as it takes
            size = self.start.size
            grow = max(16, size)
            self.start, self.cap = (
                np.r_[self.start, np.zeros(grow, np.int64)],
                np.r_[self.cap, np.zeros(grow, np.int64)],
            )
            for name, col in self.cols.items():
                self.cols[name] = np.r_[col, np.zeros(grow, np.int64)]
            # Popped from the end: the new rows are taken lowest first.
            self._free[:0] = range(size + grow - 1, size - 1, -1)
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        rows = np.array(taken[::-1], np.int64)
        self.index.update(zip(keys, rows.tolist(), strict=True))
        self.generation += 1
        self.start[rows] = self.cap[rows] = 0
        for col in self.cols.values():
            col[rows] = 0
        return rows

    def remove(self, key: str) -> None:
        """Drops a row; its region is cleared to the fill values."""
        row = self.index.pop(key)
        self.generation += 1
        lo, hi = self.start[row], self.start[row] + self.cap[row]
        for name, arr in self.data.items():
            arr[lo:hi] = self._fill[name]
        self.cap[row] = 0
        self._free.append(row)

    def remove_many(self, keys: Sequence[str]) -> None:
        """`remove` of distinct keys at once: their regions cleared by one
        assignment an array (for one key `remove`'s slices cost a quarter)."""
        rows = np.fromiter(map(self.index.pop, keys), np.int64, len(keys))
        self.generation += 1
        at = ranges(self.start[rows], self.cap[rows])
        for name, arr in self.data.items():
            arr[at] = self._fill[name]
        self.cap[rows] = 0
        self._free.extend(rows.tolist())

    def rows(self, keys: Sequence[str]) -> np.ndarray:
        """int64 [R]: the rows of `keys` (KeyError for one without)."""
        return lookup(self.index, keys)

    def rows_or_missing(self, keys: Sequence[str]) -> np.ndarray:
        """int64 [R]: the rows of `keys`, -1 for a key without one."""
        get = self.index.get
        return np.fromiter(map(get, keys, repeat(-1)), np.int64, len(keys))

    def rows_adding(
        self,
        keys: Sequence[str],
        add_many: Callable[[list[str]], object] | None = None,
    ) -> np.ndarray:
        """int64 [R]: the rows of `keys`, after `add_many(new)` for the keys
        without one (it must give each a row; default: `self.add_many`). The
        hooks' first sight of requests, the step's at once: found from the
        lookup they make anyway, not a set difference over the batch."""
        get = self.index.get  # rows_or_missing's, one call less a step
        rows = np.fromiter(map(get, keys, repeat(-1)), np.int64, len(keys))
        if rows.size and rows.min() < 0:
            new = list(map(keys.__getitem__, (rows < 0).nonzero()[0].tolist()))
            (add_many or self.add_many)(new)
            rows = self.rows(keys)
        return rows

    def span(self, row: int, n: int) -> slice:
        """The arena entries of a row's first `n`."""
        lo = int(self.start[row])
        return slice(lo, lo + int(n))

    def reserve(self, rows: np.ndarray, need: np.ndarray) -> None:
        """Regions of at least `need` entries for `rows` (distinct)."""
        rows, need = np.asarray(rows, np.int64), np.asarray(need, np.int64)
        small = need > self.cap[rows]
        if not small.any():
            return
        rows = rows[small]
        cap = self.cap[rows]
        new_cap = np.maximum(np.maximum(need[small], 2 * cap), 16)
        total = int(new_cap.sum())
        if self._top + total > self._size:
            self._compact(total)
        start = self._top + np.cumsum(new_cap) - new_cap
        src, dst = ranges(self.start[rows], cap), ranges(start, cap)
        for name, arr in self.data.items():
            arr[dst] = arr[src]
            arr[src] = self._fill[name]
        self.start[rows], self.cap[rows] = start, new_cap
        self._top += total

    def regions_disjoint(self) -> bool:
        """No two rows' regions overlap, and all lie below the arena's top."""
        rows = np.fromiter(self.index.values(), np.int64, len(self.index))
        rows = rows[self.cap[rows] > 0]  # an empty region overlaps nothing
        lo, hi = self.start[rows], self.start[rows] + self.cap[rows]
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
        return bool((hi <= self._top).all() and (lo[1:] >= hi[:-1]).all())

    @property
    def _size(self) -> int:
        return next(iter(self.data.values())).size

    def _compact(self, extra: int) -> None:
        # Regions back to back, with room for `extra` more entries; doubled
        # until at most half full, so compactions stay amortised O(1).
        rows = np.fromiter(self.index.values(), np.int64, len(self.index))
        cap = self.cap[rows]
        used, size = int(cap.sum()), self._size
        while used + extra > size // 2:
            size *= 2
        start = np.cumsum(cap) - cap
        src, dst = ranges(self.start[rows], cap), ranges(start, cap)
        for name, arr in self.data.items():
            new = np.full(size, self._fill[name], dtype=arr.dtype)
            new[dst] = arr[src]
            self.data[name] = new
        self.start[rows] = start
        self._top = used


class BatchMemo:
    """What one hook derived from its last batch, kept for the next step.

    A step's batch is mostly the last one: the same requests in the same
    order. Their rows (a dict lookup each) and constants (an attribute read
    each, from objects the forward evicted from the caches) then come back
    from one list comparison, which checks identity first, in C. Valid while
    the batch compares equal and `arena` has added or removed no row::

        memo = BatchMemo(arena)
        rows, prompt = memo.get(running, lambda reqs: (rows_of(reqs), ...))

    What `build` returns is shared by the steps that reuse it: callers read
    it, never write to it (numba's explicit signatures refuse read-only
    arrays, so this is not enforced).
    """

    __slots__ = ("_arena", "_batch", "_generation", "_value")

    def __init__(self, arena: RowArena) -> None:
        self._arena = arena
        self._batch: list | None = None
        self._generation = -1
        self._value: tuple = ()

    def clear(self) -> None:
        """Forget the batch (what `build` read changed: e.g. a preempted
        request's block list, which its resume replaces)."""
        self._batch, self._value = None, ()

    def get(self, batch: list, build: Callable[[list], tuple]) -> tuple:
        """`build(batch)`, or what it returned for an equal batch with the
        arena's rows unchanged since."""
        arena = self._arena
        if self._generation == arena.generation and self._batch == batch:
            return self._value
        value = build(batch)
        # The generation after `build`, which may have added rows.
        self._batch, self._value = list(batch), value
        self._generation = arena.generation
        return value
