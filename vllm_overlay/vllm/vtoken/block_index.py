# SPDX-License-Identifier: Apache-2.0
"""Where each request's blocks are in vLLM's positional list, without scans.

Scheduler side, for reclaimer.py. vLLM keeps a request's blocks as a Python
list of block objects (`req_to_blocks[rid]`, token i in entry i // B); finding
a block in it, or reading every entry's id, is a pass over the list in Python.
`BlockIndex` keeps, per list, the ids by entry (a NumPy mirror) and the entry
of each non-null block id (a dict), so freeing costs per freed block and the
planner reads ids with NumPy::

    req_to_blocks[rid]  [b7, b3, null, b4]      (vLLM's objects)
    ids                 [ 7,  3,    0,  4]      null is block 0
    at                  {7: 0, 3: 1, 4: 3}

The planner reads `ids` of every request it plans, each plan; `at` is only
for lookups (freeing a source, swapping in a fresh block), so it catches up
with `ids` at the first lookup rather than on every append.

vLLM only appends to a running request's list (the index catches up with the
new tail when next asked) and makes a new list when a preempted request
resumes (a new index); every other change goes through `replace`
(`null_out`, and for a batch at known entries `null_at_many` and
`replace_at_many`). A lookup that finds another block where the index says is
answered from a new index.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from vllm.vtoken import integrity

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

_ID = attrgetter("block_id")


class Positions:
    """One list's index: `ids` [n] by entry (a view of `buf`, which grows by
    doubling), `at` block id -> entry (non-null) for the entries [0, at_upto),
    both for the entries [0, n) seen. `at` catches up only when a lookup
    needs it (`BlockIndex.entries`): the planner reads `ids` of every planned
    request each plan, and a dict update per appended block cost it most of
    its per-request time. `cached_upto`: vLLM caches no entry at or past it
    (and so shares none, sharing goes through the cache), or None while
    unknown."""

    __slots__ = ("at", "at_upto", "blocks", "buf", "cached_upto", "ids")

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.blocks, self.at, self.at_upto = blocks, {}, 0
        self.buf = np.zeros(max(len(blocks), 4), dtype=np.int64)
        self.ids = self.buf[:0]
        self.cached_upto: int | None = None


class BlockIndex:
    def __init__(self, req_to_blocks: dict[str, list], null_id: int) -> None:
        self._lists = req_to_blocks  # vLLM's, read only
        self._null_id = null_id
        self._index: dict[str, Positions] = {}

    def get(self, rid: str, fresh: bool = False) -> Positions:
        """The index of `rid`'s current list, caught up with vLLM's appends."""
        blocks = self._lists[rid]
        index = self._index.get(rid)
        if fresh or index is None or index.blocks is not blocks:
            if len(self._index) > 2 * len(self._lists) + 16:
                self._index = {  # drop finished requests' indexes
                    r: x
                    for r, x in self._index.items()
                    if self._lists.get(r) is x.blocks
                }
            old, index = index, Positions(blocks)
            if old is not None and old.blocks is blocks:
                index.cached_upto = old.cached_upto
            self._index[rid] = index
        done, n = index.ids.size, len(blocks)
        if done != n:
            assert done < n, f"{rid}: a positional list shrank"
            if n > index.buf.size:
                buf = np.zeros(2 * n, dtype=np.int64)
                buf[:done] = index.ids
                index.buf = buf
            if n - done == 1:  # one block (decode): a fifth of the list path
                index.buf[done] = blocks[done].block_id
            else:
                index.buf[done:n] = list(map(_ID, blocks[done:]))
            index.ids = index.buf[:n]
        if integrity.CHECK:
            ids = [b.block_id for b in blocks]
            assert index.ids.tolist() == ids, f"{rid}: block ids out of date"
            held = {b: i for i, b in enumerate(ids) if b != self._null_id}
            assert self.entries(index) == held, f"{rid}: block entries out of date"
        return index

    def entries(self, index: Positions) -> dict[int, int]:
        """`index.at`, caught up with its `ids`: block id -> entry."""
        k, n = index.at_upto, index.ids.size
        if k != n:
            index.at.update(zip(index.ids[k:n].tolist(), range(k, n), strict=True))
            index.at.pop(self._null_id, None)
            index.at_upto = n
        return index.at

    def find(self, rid: str, ids: Iterable[int]) -> list[int]:
        """Ascending entries of `rid`'s list holding blocks among `ids` (a
        block it does not hold, such as a displaced source, has none)."""
        return self._locate(rid, list(ids))[1]

    def null_out(
        self, rid: str, ids: list[int], null: KVCacheBlock, unshared_only: bool
    ) -> list[KVCacheBlock]:
        """`replace` with `null` every entry of `rid`'s list holding a block
        among `ids` (with `unshared_only`, one no other request holds:
        ref_cnt 1); returns those blocks, in list order. One lookup of the
        index per request, not one per block."""
        index, entries = self._locate(rid, ids)
        blocks, out = self._lists[rid], []
        for i in entries:
            block = blocks[i]
            if not unshared_only or block.ref_cnt == 1:
                del index.at[block.block_id]
                blocks[i] = null
                index.ids[i] = null.block_id
                out.append(block)
        return out

    def null_at(
        self,
        rid: str,
        entries: list[int],
        ids: list[int],
        null: KVCacheBlock,
        unshared_only: bool = True,
    ) -> list[KVCacheBlock] | None:
        """`null_out(rid, ids, null, unshared_only)` where block ids[i] is at
        entries[i] of the list (where its tokens were written, or where the
        planner found it): checked, then done without the index's catch-up.
        None, and nothing done, if one is elsewhere."""
        at = sorted(zip(entries, ids, strict=True))  # in list order, as null_out
        out, _, refused = self.null_at_many(
            [rid], [0] * len(at), [e for e, _ in at], [b for _, b in at], null,
            unshared_only,
        )  # fmt: skip
        return None if refused else out

    def null_at_many(
        self,
        rids: list[str],
        seg: list[int],
        entries: list[int],
        ids: list[int],
        null: KVCacheBlock,
        unshared_only: bool = True,
    ) -> tuple[list[KVCacheBlock], dict[int, int], list[int]]:
        """`null_at` for many requests in one pass over their blocks (the
        freeing of a step's emptied blocks): block ids[j] at entries[j] of
        rids[seg[j]]'s list; `seg` grouped, entries ascending within a group.

        Returns:
            (out, nulled, refused): the blocks null-replaced, in that order;
            how many group k null-replaced (groups with none left out); the
            groups one of whose blocks is elsewhere, nothing done for them.
        """
        return self._replace_at(rids, seg, entries, ids, repeat(null), unshared_only)

    def replace_at_many(
        self,
        rids: list[str],
        seg: list[int],
        entries: list[int],
        ids: list[int],
        blocks: list[KVCacheBlock],
    ) -> list[int]:
        """Entry entries[j] of rids[seg[j]]'s list, holding block ids[j],
        becomes blocks[j], for many requests in one pass (`seg` grouped):
        the fresh blocks of a plan taking its evacuated sources' places,
        where the planner found them. Returns the groups one of whose blocks
        is elsewhere, nothing done for them."""
        if len(blocks) != len(ids):
            raise ValueError(f"{len(blocks)} blocks for {len(ids)} entries")
        return self._replace_at(rids, seg, entries, ids, blocks, False)[2]

    def _replace_at(self, rids, seg, entries, ids, new, unshared_only):
        """null_at_many's and replace_at_many's pass: `new` yields the
        block each entry gets, in order."""
        lists, refused, k0 = self._lists, set(), -1
        for k, e, b in zip(seg, entries, ids, strict=True):
            if k != k0:
                k0, blocks = k, lists[rids[k]]
                n = len(blocks)
            if e >= n or blocks[e].block_id != b:
                refused.add(k)
        out, nulled, k0, index = [], {}, -1, None
        # `new` may be endless (repeat): the lengths were checked above.
        for (k, e), put in zip(zip(seg, entries, strict=True), new, strict=False):
            if k in refused:
                continue
            if k != k0:
                k0, rid = k, rids[k]
                blocks, index = lists[rid], self._index.get(rid)
                if index is not None and index.blocks is not blocks:
                    index = None
            block = blocks[e]
            if unshared_only and block.ref_cnt != 1:
                continue
            if index is not None and e < index.ids.size:  # seen: keep it so
                if e < index.at_upto:
                    seen = index.at.pop(block.block_id, None) == e
                else:  # past the entries `at` holds yet
                    seen = index.ids[e] == block.block_id
                if not seen:  # changed unseen
                    del self._index[rid]  # indexed afresh when next asked
                    index = None
                else:
                    index.ids[e] = put.block_id
                    if e < index.at_upto and put.block_id != self._null_id:
                        index.at[put.block_id] = e
            blocks[e] = put
            out.append(block)
            nulled[k] = nulled.get(k, 0) + 1
        return out, nulled, sorted(refused)

    def _locate(self, rid: str, ids: list[int]) -> tuple[Positions, list[int]]:
        """(`rid`'s index, caught up; `find`'s entries)."""
        blocks = self._lists[rid]
        for fresh in (False, True):
            index = self.get(rid, fresh)
            at = self.entries(index)
            found = [(i, b) for b in ids if (i := at.get(b)) is not None]
            if all(blocks[i].block_id == b for i, b in found):
                break  # else the list changed unseen: index it afresh
        return index, sorted(i for i, _ in found)

    def replace(self, rid: str, entry: int, block: KVCacheBlock) -> None:
        """Entry `entry` of `rid`'s list becomes `block` (null, fresh, or the
        evacuated source an undone evacuation puts back)."""
        index, blocks = self.get(rid), self._lists[rid]
        at = self.entries(index)
        del at[blocks[entry].block_id]
        blocks[entry] = block
        index.ids[entry] = block.block_id
        if block.block_id != self._null_id:
            at[block.block_id] = entry

    def stop_caching(self, rid: str, num_cached: int) -> None:
        """vLLM will cache no more of `rid`'s current list: `num_cached`
        entries (its `num_cached_block`) are all it may have cached."""
        index = self.get(rid)
        if index.cached_upto is None:
            index.cached_upto = num_cached
