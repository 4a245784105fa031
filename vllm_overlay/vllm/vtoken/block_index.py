# SPDX-License-Identifier: Apache-2.0
"""vLLM's positional block lists, mirrored as flat arrays.

Scheduler side, for reclaimer.py. vLLM keeps a request's blocks as a Python
list of block objects (`req_to_blocks[rid]`, token i in entry i // B):
reading every entry's id, or finding a block, is a pass over the list in
Python, per request. `BlockIndex` keeps each list's ids by entry in the
request's Token Table row (the scheduler's `TokenTablePool` arena, array
`block`: a list has fewer entries than its request has tokens), so the
planner reads the ids of every planned request at once, by the rows the
step already has, and the freeing finds a block that is not at the entry it
is given in one compiled pass (block_kernels.py)::

    req_to_blocks[rid]  [b7, b3, null, b4]      (vLLM's objects)
    row's `block`       [ 7,  3,    0,  4, -1 ...]  n_entries = 4; null is 0

The mirror is written where vLLM's new blocks are read anyway: the
scheduler's `_sync_slots` reads the ids of the blocks past each request's
tail to slot its tokens, and `record`s them (one call a step). vLLM only
appends to a running request's list, and makes a new list when a preempted
request resumes (`reset` at the preemption; the resume's tokens are slotted
from entry 0, so its whole list is recorded again). Every other change to a
list goes through here (`null_at_many`, `replace_at_many`, `null_out`,
`replace`), which changes vLLM's list and the mirror together. Each block
changed is checked against vLLM's object first: at the entry given (the
usual case, which reads no mirror), or where the mirror says it is; a
block the mirror lacks is looked for at the entry given and past the
mirror's end. A list found changed behind the mirror's back (none is known
to change) is mirrored again from vLLM's list, whole; one still changed
after that (longer than its row's region) is an error, never a block freed
while listed. Other entries of such a list are not checked outside
integrity mode, where `check` compares every mirror with its list (after
each `record`, before each plan, and each step).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import compress, repeat
from operator import attrgetter, getitem, setitem
from typing import TYPE_CHECKING

import numpy as np

from vllm.vtoken import integrity
from vllm.vtoken.arena import ranges

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.vtoken.token_table import TokenTablePool

_ID = attrgetter("block_id")
_REF_CNT = attrgetter("ref_cnt")


class BlockIndex:
    """The mirror, in the scheduler's Token Table rows: `block` entries
    [0, n_entries) mirror the list's first n_entries; `cache_end` - 1:
    vLLM caches no entry at or past it (and so shares none: sharing goes
    through the cache); 0 while unknown (a new row's columns are 0)."""

    def __init__(self, req_to_blocks: dict[str, list], pool: TokenTablePool) -> None:
        from vllm.vtoken import block_kernels  # numba: vToken on only

        self._k = block_kernels
        self._lists = req_to_blocks  # vLLM's: changed only through here
        self._pool = pool
        self._a = pool.arena
        assert "block" in self._a.data, "a pool without positional_lists"

    # ------------------------------------------------------------ lifecycle
    def record(self, rows: np.ndarray, first: np.ndarray, end: np.ndarray, ids):
        """The lists of Token Table rows `rows` (distinct) hold blocks `ids`
        (int64, flat, row by row) at entries [first[i], end[i]): the blocks
        a step's tokens were slotted into (their regions hold them: a row
        has at least as many entries as slotted tokens)."""
        a = self._a
        assert not integrity.CHECK or (end <= a.cap[rows]).all(), (
            "a list past its row's region"
        )
        self._k.write_entries(
            rows, first, end, ids, a.start, a.cols["n_entries"], a.data["block"]
        )
        if integrity.CHECK:
            self._check_rows(rows)

    def reset(self, rid: str) -> None:
        """Preempted: vLLM frees the list; the resume's is recorded anew."""
        row = self._pool.rows([rid])[0]
        a = self._a
        a.data["block"][a.span(row, a.cols["n_entries"][row])] = -1  # fill
        a.cols["n_entries"][row] = 0
        a.cols["cache_end"][row] = 0

    def stop_caching(self, rid: str, num_cached: int) -> None:
        """vLLM will cache no more of `rid`'s current list: `num_cached`
        entries (its `num_cached_block`) are all it may have cached. The
        first count stays until the list is new."""
        end = self._a.cols["cache_end"]
        row = self._pool.rows([rid])[0]
        if end[row] == 0:
            end[row] = num_cached + 1

    # ------------------------------------------------------------ reads
    def planned(
        self, rows: np.ndarray, counts: np.ndarray, caching: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """(ids, heads) for the planner: the ids of entries [0, counts[i])
        of the lists of Token Table rows `rows`, flat (int64), and how many
        of them vLLM may have cached (and so shared): entries below its
        `cached_upto`, all while that is unknown, none without `caching`."""
        a = self._a
        if (counts > a.cols["n_entries"][rows]).any():  # ids of an old list
            raise RuntimeError("vToken: the planner reads a block not recorded")
        if integrity.CHECK:
            self._check_rows(rows)
        ids = a.data["block"][ranges(a.start[rows], counts)].astype(np.int64)
        if not caching:
            return ids, np.zeros(rows.size, np.int64)
        upto = a.cols["cache_end"][rows] - 1
        return ids, np.where(upto < 0, counts, np.minimum(upto, counts))

    def holders(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, entries, blocks): where every list holds one of blocks
        `ids` (int64, distinct) at an entry whose tokens its row has all
        slotted, by row then entry (block_kernels.holders)."""
        a = self._a
        return self._k.holders(
            ids, a.start, a.cap, a.cols["n_entries"], a.cols["n_slotted"],
            a.data["block"], self._pool.shift,
        )  # fmt: skip

    def find(self, rid: str, ids: Iterable[int]) -> list[int]:
        """Ascending entries of `rid`'s list holding blocks among `ids` (a
        block it does not hold, such as a displaced source, has none)."""
        ids = np.fromiter(ids, np.int64)
        seg, no_hint = np.zeros(ids.size, np.int64), np.full(ids.size, -1, np.int64)
        at = self._settled([rid], self._pool.rows([rid]), seg, no_hint, ids)[1]
        return sorted(at[at >= 0].tolist())

    # ------------------------------------------------------------ changes
    def null_at_many(
        self,
        rids: Sequence[str],
        rows: np.ndarray,
        seg: np.ndarray,
        entries: np.ndarray,
        ids: np.ndarray,
        null: KVCacheBlock,
        unshared_only: bool = True,
    ) -> tuple[list[KVCacheBlock], np.ndarray]:
        """The entries of the lists holding blocks `ids` become `null`, for
        many requests in one pass (the freeing of a step's emptied blocks,
        or of a batch's sources): block ids[j] of rids[seg[j]]'s list (its
        Token Table row rows[seg[j]]), at entries[j] where it is there
        (where its tokens were written, or where the planner found it),
        else wherever it is; a block the list does not hold is skipped, and
        with `unshared_only` a block another request holds (ref_cnt > 1).
        Int64 arrays, `seg` grouped and the entries ascending within a group
        (list order; blocks found elsewhere are sorted in).

        Returns:
            (out, nulled): the blocks null-replaced, in list order per
            request; how many each of `rids` null-replaced (int64).
        """
        return self._replace_at(rids, rows, seg, entries, ids, null, unshared_only)[:2]

    def replace_at_many(
        self,
        rids: Sequence[str],
        rows: np.ndarray,
        seg: np.ndarray,
        entries: np.ndarray,
        ids: np.ndarray,
        blocks: list[KVCacheBlock],
    ) -> list[int]:
        """The entry of rids[seg[j]]'s list (row rows[seg[j]]) holding block
        ids[j] (entries[j], where the planner found it) becomes blocks[j],
        for many requests in one pass: the fresh blocks of a plan taking the
        places of its evacuated sources. Returns the requests (positions in
        `rids`) one of whose blocks their lists do not hold, nothing done
        for them."""
        if len(blocks) != len(ids):
            raise ValueError(f"{len(blocks)} blocks for {len(ids)} entries")
        return self._replace_at(rids, rows, seg, entries, ids, blocks, False, True)[2]

    def null_out(
        self, rid: str, ids: list[int], null: KVCacheBlock, unshared_only: bool
    ) -> list[KVCacheBlock]:
        """`null_at_many` of one request's blocks `ids`, wherever they are."""
        ids = np.asarray(ids, np.int64)
        seg, no_hint = np.zeros(ids.size, np.int64), np.full(ids.size, -1, np.int64)
        rows = self._pool.rows([rid])
        return self.null_at_many([rid], rows, seg, no_hint, ids, null, unshared_only)[0]

    def replace(self, rid: str, entry: int, block: KVCacheBlock) -> None:
        """Entry `entry` of `rid`'s list becomes `block` (the evacuated
        source an undone evacuation puts back)."""
        a = self._a
        row = self._pool.rows([rid])[0]
        assert entry < a.cols["n_entries"][row], f"{rid}: entry {entry} not recorded"
        at = a.start[row] + entry
        assert a.data["block"][at] == self._lists[rid][entry].block_id
        self._lists[rid][entry] = block
        a.data["block"][at] = block.block_id

    # ------------------------------------------------------------ invariants
    def check(self, rids: Sequence[str]) -> None:
        """Each mirror holds its list's ids (the first n_entries)."""
        a = self._a
        rows = self._pool.rows_or_missing(rids)
        for rid, row in zip(rids, rows.tolist(), strict=True):
            if row < 0 or a.cols["n_entries"][row] == 0:
                continue
            blocks = self._lists.get(rid, [])
            got = a.data["block"][a.span(row, a.cols["n_entries"][row])].tolist()
            want = [b.block_id for b in blocks[: len(got)]]
            assert got == want, f"{rid}: block ids {got} mirror {want}"

    def _check_rows(self, rows: np.ndarray) -> None:
        """`check` of the requests of Token Table rows `rows`."""
        rid_of = {row: rid for rid, row in self._a.index.items()}
        self.check([rid_of[row] for row in rows.tolist()])

    # ------------------------------------------------------------ internals
    def _locate(self, rows, hint, ids) -> np.ndarray:
        """block_kernels.locate: the entries of blocks ids[j] in rows[j]."""
        a = self._a
        return self._k.locate(
            rows, hint, ids, a.start, a.cols["n_entries"], a.data["block"]
        )

    def _resync(self, rid: str, row: int) -> None:
        """Mirror `rid`'s list again from vLLM's objects, all of it that its
        region holds (a block past the old mirror is then found)."""
        a = self._a
        blocks = self._lists[rid]
        n = min(len(blocks), int(a.cap[row]))
        a.data["block"][a.span(row, n)] = list(map(_ID, blocks[:n]))
        a.cols["n_entries"][row] = n

    def _settled(self, rids, rows, seg, hint, ids) -> tuple:
        """(rows, at, lists, blocks): each block's Token Table row, its
        entry (-1: not in the list), its list and vLLM's block there (None
        where not found). The usual case is read from vLLM's objects at the
        hints alone: every block there (the mirror, cold in a step, is then
        only written). Otherwise from the mirror (`_locate`), checked against
        vLLM's objects first: where a block found is not vLLM's there, or a
        block not found is vLLM's at its hint or past the mirror's end, the
        list changed behind the mirror's back (none is known to), and is
        mirrored again (RuntimeError if that does not settle it)."""
        seg_l = seg.tolist()
        lists = list(map(self._lists.__getitem__, map(rids.__getitem__, seg_l)))
        rows = rows[seg]
        if hint.size and hint.min() >= 0:
            try:
                blocks = list(map(getitem, lists, hint.tolist()))
                held = np.fromiter(map(_ID, blocks), np.int64, len(blocks))
            except IndexError:  # a hint past its list
                held = None
            if held is not None and (held == ids).all():
                return rows, hint, lists, blocks
        for attempt in range(2):
            at = self._locate(rows, hint, ids)
            at_l, hint_l = at.tolist(), hint.tolist()
            mirrored = self._a.cols["n_entries"][rows].tolist()
            blocks = [
                x[e] if 0 <= e < len(x) else None
                for x, e in zip(lists, at_l, strict=True)
            ]
            stale = {}
            for j, (x, b) in enumerate(zip(lists, ids.tolist(), strict=True)):
                e, h = at_l[j], hint_l[j]
                if e >= 0:  # not vLLM's there (or past vLLM's list)
                    changed = blocks[j] is None or blocks[j].block_id != b
                else:  # vLLM's at its hint, or past the mirror: not mirrored
                    changed = (0 <= h < len(x) and x[h].block_id == b) or any(
                        y.block_id == b for y in x[mirrored[j] :]
                    )
                if changed:
                    stale[rids[seg_l[j]]] = int(rows[j])
            if not stale:
                break
            assert not integrity.CHECK, f"lists changed unseen: {sorted(stale)}"
            if attempt:  # mirrored again, and still not: past the regions
                raise RuntimeError(
                    f"vToken: the block lists of {sorted(stale)} changed behind "
                    "the mirror past what their rows hold"
                )
            for rid, row in stale.items():
                self._resync(rid, row)
        return rows, at, lists, blocks

    def _replace_at(self, rids, rows, seg, hint, ids, new, unshared_only, whole=False):
        """null_at_many's and replace_at_many's pass: `new`, the blocks they
        get, in order (a list), or one block for all (null); with `whole`,
        nothing is done for a request one of whose blocks is in no list.
        Returns (blocks replaced, how many a request, the requests whose
        block was missing). The loops over blocks are in C (map): vLLM's
        objects are read and written a block at a time."""
        rows, at, lists, blocks = self._settled(rids, rows, seg, hint, ids)
        one = not isinstance(new, list)
        found = at >= 0  # else not in the list (a displaced source)
        everywhere = bool(np.logical_and.reduce(found))  # (.all(): 3 calls)
        missing = [] if everywhere else sorted(set(seg[~found].tolist()))
        if whole and missing:
            found = ~np.isin(seg, missing)
        if not (everywhere and (at == hint).all()):  # some elsewhere or in none
            keep = found.tolist()
            seg, at, rows = seg[found], at[found], rows[found]
            lists, blocks = list(compress(lists, keep)), list(compress(blocks, keep))
            new = new if one else list(compress(new, keep))
            order = np.lexsort((at, seg)).tolist()  # into list order
            seg, at, rows = seg[order], at[order], rows[order]
            lists = list(map(lists.__getitem__, order))
            blocks = list(map(blocks.__getitem__, order))
            new = new if one else list(map(new.__getitem__, order))
        if unshared_only:  # a block another request holds stays
            done = np.fromiter(map(_REF_CNT, blocks), np.int64, len(blocks)) == 1
            if not done.all():
                keep = done.tolist()
                seg, at, rows = seg[done], at[done], rows[done]
                lists = list(compress(lists, keep))
                blocks = list(compress(blocks, keep))
                new = new if one else list(compress(new, keep))
        # vLLM's lists (setitem gives None: `any` runs the map to its end),
        # then the mirror.
        any(map(setitem, lists, at.tolist(), repeat(new) if one else new))
        put = new.block_id if one else np.fromiter(map(_ID, new), np.int64, len(new))
        self._a.data["block"][self._a.start[rows] + at] = put
        return blocks, np.bincount(seg, minlength=len(rids)), missing
