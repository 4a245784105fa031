# SPDX-License-Identifier: Apache-2.0
"""Scheduler side: evicted tokens become free blocks in vLLM's block pool.

Two ways, both ending in `_null_out` (null-replace in the request's
positional block list) and `BlockPool.free_blocks`:

  naive-evict   a block whose last live token died is freed at once
                (`free_empty_blocks`);
  compaction    the planner (planner.py) picks blocks to empty into the
                request's own holes, or prefix-cached blocks to evacuate into
                fresh ones; `plan` turns that into one `MoveBatch` for the
                worker, and the sources are freed once the worker has copied
                them (`release_sources`, from `VTokenScheduler.apply_moves`).

A fresh block takes an evacuated source's place in the positional list at
once (vLLM frees it with the request); the source it displaced is held by the
batch alone until then (`InFlightMoves`)::

    req_to_blocks[rid]  [b7, b3, b9, b4]   b7, b3 cached, evacuated into fresh b12
    planned             [b12, b3, b9, b4]  b7 detached, held by the batch
    acknowledged        [b12, null, b9, b4]  b7, b3 freed with their hashes
    or dropped first    [b7, b3, b9, b4]   undone: b12 freed, vLLM frees the rest

A block with a copy in flight (source or destination) is never freed or planned
again until its batch is acknowledged (`_busy`). Blocks are found in their
request's list, and its ids read, through `BlockIndex` (block_index.py): no
pass over a request's list in Python.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import TYPE_CHECKING

import numpy as np

from vllm.vtoken import integrity
from vllm.vtoken.arena import attrs, indptr_of, ranges, segments, values
from vllm.vtoken.block_index import BlockIndex
from vllm.vtoken.messages import MoveBatch
from vllm.vtoken.packing import pack_requests
from vllm.vtoken.planner import BlockPlan, plan_around_cache, plan_blocks
from vllm.vtoken.request_state import RequestState

_NEVER = 1 << 62  # a block count no request reaches
_REF_CNT = attrgetter("ref_cnt")
# KVCacheBlock.block_hash's field: the property is a Python frame per block.
_HASH = attrgetter("_block_hash")
_IS_ZERO = (0).__eq__
_ID = attrgetter("block_id")
_COMPUTED = attrgetter("num_computed_tokens")
_MOVE_BATCH = attrgetter("move_batch")
_NO_IDS = np.zeros(0, np.int64)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request
    from vllm.vtoken.stats import VTokenCounters
    from vllm.vtoken.token_table import TokenTablePool


@dataclass(slots=True)
class InFlightMoves:
    """The scheduler side of a move batch until it is acknowledged: per
    request of `batch` (CSR, in its order) the blocks it empties, where the
    planner found each in the request's list, the fresh blocks that took the
    first ones' places (an evacuation), and the blocks it fills."""

    batch: MoveBatch
    src_indptr: np.ndarray  # int64 [K + 1]
    src: list[KVCacheBlock]  # [S]
    src_ids: np.ndarray  # int64 [S]
    src_at: np.ndarray  # int64 [S]: list entries (a displaced source's: former)
    fresh_indptr: np.ndarray  # int64 [K + 1]: fresh[i] displaced src[i] (CSR)
    fresh: list[KVCacheBlock]
    dst_indptr: np.ndarray  # int64 [K + 1]
    dst_ids: np.ndarray  # int64 [D]
    index: dict[str, int]  # request id -> its position K

    def sources(self, k: int) -> tuple[list[KVCacheBlock], list[KVCacheBlock]]:
        """Request k's (sources, fresh blocks): src[: len(fresh)] displaced."""
        s, f = self.src_indptr, self.fresh_indptr
        return self.src[s[k] : s[k + 1]], self.fresh[f[k] : f[k + 1]]

    def block_ids(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ids of request k's (sources, destinations): what its part
        keeps busy while it is in flight."""
        s, d = self.src_indptr, self.dst_indptr
        return self.src_ids[s[k] : s[k + 1]], self.dst_ids[d[k] : d[k + 1]]


def _set_batch(recs: Iterable[RequestState], batch_id: int | None) -> None:
    """Each state's `move_batch` becomes batch_id, in a C loop (setattr
    returns None: `any` runs the map to its end)."""
    any(map(setattr, recs, repeat("move_batch"), repeat(batch_id)))


class BlockReclaimer:
    """Block-pool side of eviction and compaction for one KV-cache group."""

    def __init__(
        self,
        pool: TokenTablePool,
        kv_cache_manager: KVCacheManager,
        threshold: float,
        counters: VTokenCounters,
    ) -> None:
        # numba: vToken on only, load them now
        from vllm.vtoken import block_kernels, planner_kernels

        self._candidate_blocks = planner_kernels.candidate_blocks
        self._ack_entries = planner_kernels.ack_entries
        self._release_busy = block_kernels.release_busy
        self.pool = pool
        self.block_size = pool.block_size
        self.block_pool = kv_cache_manager.block_pool
        # vLLM's positional block lists, by request (token i in block [i // B]).
        # Dense models have exactly one group (checked in VTokenConfig).
        type_mgr = kv_cache_manager.coordinator.single_type_managers[0]
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = type_mgr.req_to_blocks
        self._num_cached_block: dict[str, int] = type_mgr.num_cached_block
        self.threshold = threshold
        self.counters = counters
        self._inflight: dict[int, InFlightMoves] = {}  # batch_id -> its moves
        # By block id: the batch copying into or out of it, -1 if none.
        self._busy = np.full(pool.num_blocks, -1, np.int64)
        self._next_batch_id = 0
        self._null_id = self.block_pool.null_block.block_id
        self.blocks = BlockIndex(self.req_to_blocks, pool)
        # Without prefix caching no block is ever cached, nor shared.
        self._caching = kv_cache_manager.enable_caching

    def positional(self, rid: str) -> list[KVCacheBlock]:
        return self.req_to_blocks[rid]

    def stop_caching(self, rid: str) -> None:
        """No more prefix-cache entries from `rid`: once it has a dead token, the
        KV it writes was computed without those tokens, so a request that hits
        it would read attention no model computed for it. vLLM caches a request's
        blocks from `num_cached_block[rid]` on, so moving that past any block
        count ends it; the blocks cached before its first eviction stay valid.
        vLLM keeps no count until it caches a request's first full block (nor
        makes one for a request with no hit): a budget below the block size
        evicts before that, and the count is made here, as 0 then _NEVER. A
        count marks a running request to vLLM (no new hits), which it is.
        """
        if not self._caching:  # vLLM caches nothing, and keeps no count
            return
        cached = self._num_cached_block.get(rid, 0)
        if cached != _NEVER:
            self.blocks.stop_caching(rid, cached)
        self._num_cached_block[rid] = _NEVER

    def stop_caching_resumed(self, rid: str, num_hits: int, keep: int) -> None:
        """`stop_caching` of a resumed request with a dead token, right after
        vLLM allocated (and cached) its resume: the recompute attends live
        tokens only, so the blocks vLLM just cached from entry `keep` on (the
        first dead token's block) hold KV no model computed for their prefix,
        and leave the cache before any other request can hit them. Its
        `num_hits` prefix-cache hits were cached before (native KV) and stay.
        """
        if not self._caching:  # vLLM caches nothing, and keeps no count
            return
        if rid not in self._num_cached_block:  # nothing full cached yet
            self._num_cached_block[rid] = num_hits
        cached = self._num_cached_block[rid]
        if cached == _NEVER:
            return
        wrong = [
            b.block_id
            for b in self.req_to_blocks[rid][max(keep, num_hits) : cached]
            if b.block_hash is not None
        ]
        if wrong:
            self.block_pool.evict_blocks(set(wrong))
        self._num_cached_block[rid] = max(min(cached, keep), num_hits)
        self.stop_caching(rid)

    def free_empty_blocks(self, rids, seg, dead, rows=None) -> None:
        """Free the blocks whose last live token just died (Naive-Evict), for
        the batch at once: tokens dead[j] of request rids[seg[j]] died (int
        arrays); `rows`: their Token Table rows, when the caller has them.
        A block left without a live token has none in any table (block_live
        counts every holder's), so it leaves every list that holds it: those
        of other requests sharing it (a prefix-cache hit) that evicted their
        tokens in it at earlier steps too, or it would stay held by each."""
        pool = self.pool
        rows = pool.rows(rids) if rows is None else rows
        # Only blocks every token of which has been written: a block still
        # being filled (e.g. by a chunked recompute) may get live tokens yet.
        # Each (request, block) once, by request then block id.
        seg, blk, entry = pool.emptied_blocks(rows, seg, dead)
        if not seg.size:
            return
        if self._inflight:  # a copy in flight may fill it yet (or frees it)
            idle = self._busy[blk] < 0
            if not idle.any():
                return
            seg, blk, entry = seg[idle], blk[idle], entry[idle]
        shared = None
        if self._caching:  # (requests share blocks through the cache only)
            refs = map(_REF_CNT, map(self.block_pool.blocks.__getitem__, blk.tolist()))
            shared = np.fromiter(refs, np.int64, blk.size) > 1
            shared = np.unique(blk[shared]) if np.logical_or.reduce(shared) else None
        self._null_and_free(rids, rows, seg, blk, entry, shared)

    def _null_and_free(self, rids, rows, seg, blk, entry, shared=None) -> None:
        """Blocks blk[j] of rids[seg[j]] (row rows[seg[j]]) written at
        entry[j] leave their lists and go back to the pool; `shared` (block
        ids, or None) those of them other lists may hold too, which they
        leave as well (their holders' tokens there are dead too)."""
        if shared is not None:
            rids, rows, seg, blk, entry = self._with_holders(
                rids, rows, seg, blk, entry, shared
            )
            if not seg.size:
                return
        # Where their tokens were written, mostly (else found in the list),
        # in list order per request, as _null_out frees them.
        order = np.lexsort((entry, seg))
        freed, nulled = self.blocks.null_at_many(
            rids, rows, seg[order], entry[order], blk[order],
            self.block_pool.null_block, unshared_only=False,
        )  # fmt: skip
        held = nulled.nonzero()[0]
        if held.size:  # distinct requests: one add
            self.pool.add_nulls(rows[held], nulled[held])
        freed.reverse()  # tail first (see _free)
        if shared is not None:  # one block from several lists
            freed = self._release_repeats(freed)
        self._free(freed)

    def free_left_behind(self, rid: str) -> None:
        """Before vLLM frees `rid`'s blocks (it finished or was preempted, and
        its tokens have left the Token Table): `free_unheld` of those it
        shares with other lists (a prefix-cache hit)."""
        blocks = self.req_to_blocks.get(rid) if self._caching else None
        if not blocks:
            return
        refs = np.fromiter(map(_REF_CNT, blocks), np.int64, len(blocks))
        shared = refs > 1
        if np.logical_or.reduce(shared):  # (.any(): 3 calls)
            ids = np.fromiter(map(_ID, blocks), np.int64, len(blocks))[shared]
            self.free_unheld(ids[ids != self.block_pool.null_block.block_id])
            # Those now held by `rid` alone reach the pool as vLLM frees it.
            refs = np.fromiter(map(_REF_CNT, blocks), np.int64, len(blocks))
            self.counters.reclaimed_blocks += int(np.add.reduce(shared & (refs == 1)))

    def free_unheld(self, ids: np.ndarray) -> None:
        """Blocks `ids` (int64) that a request has just left while other lists
        still hold them: it finished or was preempted (free_left_behind), or
        an acknowledged batch moved its tokens out (release_sources). Those
        left without a live token held their last live tokens in the leaver's
        table: their other holders' tokens there died before (each evicted
        its own), and no death will come to free them now. They leave those
        lists too, back to the pool with their hash (free_empty_blocks)."""
        if not ids.size:
            return
        ids = ids[(self.pool.block_live[ids] == 0) & (self._busy[ids] < 0)]
        if ids.size:
            none = np.zeros(0, np.int64)
            self._null_and_free([], none, none, none, none, np.unique(ids))

    def _with_holders(self, rids, rows, seg, blk, entry, shared):
        """The batch (rids, rows, seg, blk, entry) with every list holding
        blocks `shared` (block ids) at an entry its request has slotted: a
        holder already in the batch (it evicted this step too) keeps its
        segment, so each request is one segment (add_nulls adds per row)."""
        h_rows, h_entry, h_blk = self.blocks.holders(shared)
        num_blocks = self.pool.num_blocks
        known = rows[seg] * num_blocks + blk
        new = ~np.isin(h_rows * num_blocks + h_blk, known)
        if not new.any():
            return rids, rows, seg, blk, entry
        h_rows, h_entry, h_blk = h_rows[new], h_entry[new], h_blk[new]
        holders, h_seg = np.unique(h_rows, return_inverse=True)
        # The batch's rows are distinct requests: each holder's segment.
        seg_of = np.full(holders.size, -1, np.int64)
        if rows.size:
            by_row = np.argsort(rows)
            at = np.minimum(
                np.searchsorted(rows, holders, sorter=by_row), rows.size - 1
            )
            hit = rows[by_row[at]] == holders
            seg_of[hit] = by_row[at[hit]]
        others = holders[seg_of < 0]
        seg_of[seg_of < 0] = len(rows) + np.arange(others.size)
        if others.size:
            rid_of = {row: rid for rid, row in self.pool.arena.index.items()}
            rids = list(rids) + [rid_of[r] for r in others.tolist()]
        return (
            rids,
            np.concatenate([rows, others]),
            np.concatenate([seg, seg_of[h_seg]]),
            np.concatenate([blk, h_blk]),
            np.concatenate([entry, h_entry]),
        )

    def _release_repeats(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """`blocks` with a block from several lists once (its last place):
        its other places' references are dropped here. vLLM's free_blocks
        queues a block once per place it is given at ref_cnt 0."""
        last = {b.block_id: i for i, b in enumerate(blocks)}
        if len(last) == len(blocks):
            return blocks
        keep = set(last.values())
        repeats = [b for i, b in enumerate(blocks) if i not in keep]
        self.block_pool.free_blocks(repeats)  # each still held by its last place
        return [b for i, b in enumerate(blocks) if i in keep]

    def release_blocks(self, rid: str, blocks: list[KVCacheBlock]) -> None:
        """Null-replace `blocks` of `rid` in its block table (those still in
        it: not a displaced source), then free them, tail first."""
        held = self._null_out(rid, [b.block_id for b in blocks])
        ids = {b.block_id for b in held}
        self._free([b for b in blocks if b.block_id not in ids] + held[::-1])

    def _null_out(
        self, rid: str, ids: list[int], unshared_only=False
    ) -> list[KVCacheBlock]:
        """The entries of `rid`'s list holding blocks among `ids` (with
        `unshared_only`, its own ones) become the null block; returns the
        blocks they held, in list order."""
        null = self.block_pool.null_block
        out = self.blocks.null_out(rid, ids, null, unshared_only)
        self.pool.add_nulls(self.pool.rows([rid]), len(out))
        return out

    def _free(self, blocks: list[KVCacheBlock]) -> None:
        """Free `blocks` in the order given. Callers give a list's tail
        first, as vLLM frees a request's list: its free queue hands out the
        first freed first, so a cached chain's head, which every request
        with that prefix needs, is reused last (a chain is hit from its head
        only)."""
        if blocks:
            self.block_pool.free_blocks(blocks)
            # Those back in the pool: a block another request holds is not.
            self.counters.reclaimed_blocks += sum(map(_IS_ZERO, map(_REF_CNT, blocks)))

    def pop_batch(self, batch_id: int) -> InFlightMoves:
        """An acknowledged batch: none of its blocks is busy any more."""
        moves = self._inflight.pop(batch_id)
        self._unbusy(batch_id, moves.src_ids, moves.dst_ids)
        return moves

    def release_sources(
        self, moves: InFlightMoves, recs: list[RequestState | None], keep: np.ndarray
    ) -> None:
        """The parts of an acknowledged batch of the requests `keep` marks
        (recs: the batch's requests' states, in its order): free the sources,
        and the destinations left without a live token (every token in them
        died while the copy was in flight: busy, free_empty_blocks kept
        them), in one `free_blocks`."""
        kept = keep.nonzero()[0]
        if not kept.size:
            return
        null, rids = self.block_pool.null_block, moves.batch.req_ids
        d = moves.dst_indptr
        # Every source is freed; the displaced ones (each request's first nf)
        # are not in the list, the others are null-replaced where the planner
        # found them, in list order per request (as null_at does).
        src, seg, at, ids, num_fresh = self._ack_entries(
            kept, moves.src_indptr, moves.fresh_indptr, moves.src_at, moves.src_ids
        )
        # Tail first (see _free): by entry, last first (stable: one call).
        src = src[np.argsort(-moves.src_at[src], kind="stable")]
        freed = list(map(moves.src.__getitem__, src.tolist()))
        rows = self.pool.rows_or_missing(rids)  # the kept ones have rows
        _, nulled = self.blocks.null_at_many(
            rids, rows, seg, at, ids, null, unshared_only=False
        )
        held = nulled.nonzero()[0]
        if held.size:  # distinct requests: one add
            self.pool.add_nulls(rows[held], nulled[held])
        # Destinations with no live token: rare, so looked for at once.
        empty = self.pool.block_live[moves.dst_ids] == 0
        if np.logical_or.reduce(empty):  # (.any(): 3 calls)
            owner = np.repeat(np.arange(len(rids)), np.diff(d))
            hit = np.zeros(len(rids), bool)
            hit[owner[empty]] = True
            written = []  # no hash (a destination left the cache): reused first
            for k in kept[hit[kept]].tolist():
                dead = moves.dst_ids[d[k] : d[k + 1]][empty[d[k] : d[k + 1]]]
                written += self._null_out(rids[k], dead.tolist(), unshared_only=True)
            freed = written + freed
        _set_batch(map(recs.__getitem__, kept.tolist()), None)
        # The fresh blocks that replaced displaced sources came from the pool.
        self.counters.reclaimed_blocks -= num_fresh
        self._free(freed)
        if self._caching:  # a source a prefix-cache hit took meanwhile
            held = list(map(_ID, compress(freed, map(_REF_CNT, freed))))  # in C
            if held:
                self.free_unheld(np.array(held, np.int64))

    def drop_moves(self, rid: str, rec: RequestState) -> None:
        """Forget a request's in-flight moves; vLLM frees its blocks next.

        The worker waits for a finished or preempted request's copies before
        the step runs (VTokenWorker.begin_step), so the blocks may be reused.
        An evacuation is undone: each displaced source (intact, still cached)
        goes back where its fresh block took its place, so vLLM frees it with
        the list, in its order (the chain's head last, reused last); the fresh
        blocks, whose copies never counted, are freed first.
        """
        if rec.move_batch is None:
            return
        moves = self._inflight[rec.move_batch]
        k = moves.index[rid]
        src, fresh = moves.sources(k)
        self._unbusy(rec.move_batch, *moves.block_ids(k))
        for new, source in zip(fresh, src, strict=False):
            (i,) = self.blocks.find(rid, [new.block_id])
            self.blocks.replace(rid, i, source)
        self.block_pool.free_blocks(fresh)
        # Counted when bound: nothing was emptied (hashes hold in flight).
        self.counters.evacuated_blocks -= sum(b.block_hash is not None for b in src)
        rec.move_batch = None

    def detached(self, reqs: Mapping[str, RequestState]) -> dict[str, list[int]]:
        """The evacuated sources each request's batch holds (check_blocks)."""
        out: dict[str, list[int]] = {}
        for _, moves, k in self._waited_parts(reqs):
            src, fresh = moves.sources(k)
            out[moves.batch.req_ids[k]] = [b.block_id for b in src[: len(fresh)]]
        return out

    def busy_blocks(self) -> np.ndarray:
        """The ids of the blocks a copy in flight reads or writes."""
        return np.flatnonzero(self._busy >= 0)

    def check_busy(self, reqs: Mapping[str, RequestState]) -> None:
        """A block is busy, with its batch's id, exactly while the part of a
        batch in flight that a request still waits for reads or writes it;
        and no destination of such a part is a live slot (check_step)."""
        want = {}
        for batch_id, moves, k in self._waited_parts(reqs):
            ids = np.concatenate(moves.block_ids(k)).tolist()
            want.update(dict.fromkeys(ids, batch_id))
        busy = self.busy_blocks()
        got = dict(zip(busy.tolist(), self._busy[busy].tolist(), strict=True))
        assert got == want, f"busy blocks {got} are not the batches' {want}"
        self.check_step(reqs, *(_NO_IDS,) * 3)

    def check_step(
        self,
        reqs: Mapping[str, RequestState],
        slots: np.ndarray,
        counts: np.ndarray,
        num_written: np.ndarray,
    ) -> None:
        """The step's forward and the copies in flight beside it (on GPU a
        side stream; the step's own plan's batch included, which the worker
        submits before the forward) touch no slot both:

        - the step's tokens are written (vLLM's own KV write, positional) in
          no block a copy reads or writes: a plan takes only blocks full
          before its step (`plan`: computed // B) and later tokens go past
          them; a preempted or finished request's moves are forgotten and
          its blocks reused after the copy (the worker's wait_all);
        - a new request's prefix-cache hits (read, not written) lie in no
          destination block: a destination leaves the cache when planned;
        - no destination slot is a live one, the slots the token read uses.

        `slots`: request i's counts[i] slotted this step, of which the last
        num_written[i] are computed by the forward (the others are hits)."""
        B, dst_blocks, dst = self.block_size, [], []
        for _, moves, k in self._waited_parts(reqs):
            b, d = moves.batch, moves.dst_indptr
            dst_blocks.append(moves.dst_ids[d[k] : d[k + 1]])
            dst.append(b.dst_slots[b.indptr[k] : b.indptr[k + 1]])
        if not dst:  # no copy in flight (most steps)
            return
        seg, pos = segments(counts)
        written = pos >= (counts - num_written)[seg]
        mine, hits = slots[written], slots[~written]
        busy_at = mine[self._busy[mine // B] >= 0]
        assert not busy_at.size, (
            f"slots {busy_at.tolist()} are written this step in blocks a copy "
            "in flight reads or writes"
        )
        read = hits[np.isin(hits // B, np.concatenate(dst_blocks))]
        assert not read.size, (
            f"prefix-cache hits {read.tolist()} lie in blocks a copy in flight writes"
        )
        rows = self.pool.rows_or_missing(list(reqs))
        live = self.pool.live_tokens(rows[rows >= 0])[2]
        both = np.intersect1d(np.concatenate(dst), live)
        assert not both.size, (
            f"slots {both.tolist()} are live and written by a copy in flight"
        )

    def _waited_parts(self, reqs: Mapping[str, RequestState]):
        """(batch id, moves, k) of each in-flight part a request waits for."""
        for batch_id, moves in self._inflight.items():
            for rid, k in moves.index.items():
                rec = reqs.get(rid)
                if rec is not None and rec.move_batch == batch_id:
                    yield batch_id, moves, k

    def check_nulls(self, rids: list[str]) -> None:
        """Each request's freed blocks (pool.num_nulls_rows) are the null
        entries of its positional list: vLLM makes none in a full-attention
        list, and a resume's list is new (on_preempt cleared the count)."""
        rids = [r for r in rids if r in self.req_to_blocks]
        got = self.pool.num_nulls_rows(self.pool.rows(rids)).tolist()
        want = [sum(b.is_null for b in self.req_to_blocks[r]) for r in rids]
        assert got == want, f"freed blocks {got} are not the null entries {want}"

    def _unbusy(self, batch_id: int, src: np.ndarray, dst: np.ndarray) -> None:
        """Blocks `src` and `dst` that batch_id keeps busy are busy no more."""
        self._release_busy(self._busy, src, dst, batch_id)

    def plan(
        self,
        due: Collection[str],
        reqs: dict[str, RequestState],
        requests: dict[str, Request],
        scheduled: Collection[str],
    ) -> MoveBatch | None:
        """Compaction of the requests `due` that are scheduled and have a
        block's worth of evictions since they were last planned and of holes
        (TokenTablePool.plan_due; planner.py).

        Blocks the prefix cache can serve are evacuated into fresh blocks
        rather than written, while the pool has the fresh blocks to spare;
        otherwise memory comes first and they are destinations too, the end of
        their hash chain first, unless the evacuation takes no fresh block and
        frees as many (docs/DESIGN.md §3.3).
        """
        B, pool = self.block_size, self.pool
        # (The loops over requests in C: filter, map.)
        known = filter(requests.__contains__, filter(reqs.__contains__, due))
        due = list(filter(scheduled.__contains__, known))
        rows = pool.rows(due)
        order = rows.argsort()  # in row order: reproducible
        due, rows = list(map(due.__getitem__, order.tolist())), rows[order]
        recs = values(reqs, due)
        assert not integrity.CHECK or all(
            n == sum(b.is_null for b in self.positional(rid))
            for rid, n in zip(due, pool.num_nulls_rows(rows).tolist(), strict=True)
        ), "null blocks miscounted"
        # Considered once it runs with a block's worth dead and of holes
        # (pool.plan_due: dead tokens less a block per freed one, an upper
        # bound; freeing a block takes a block's worth, planner.py); not
        # while its last batch is still copying (GPU side stream): its slots
        # switch when that completes, so it is planned on the settled state.
        ripe = pool.plan_due(rows)
        busy = np.fromiter(map(is_not, map(_MOVE_BATCH, recs), repeat(None)), bool)
        self.counters.deferred_plans += int(np.add.reduce(ripe & busy))
        chosen = (ripe & ~busy).nonzero()[0]
        pool.mark_rows(rows[chosen])
        chosen = chosen.tolist()
        rids = list(map(due.__getitem__, chosen))
        if not rids:
            return None
        # Full blocks written before this step; the tail is being filled. The
        # blocks vLLM may have cached (and so shared) are read one by one: a
        # block's reference count and hash live on its object, cold in a
        # step. Only those a plan may take: a null or full block is never a
        # candidate (its code is not read; 2, unshared and uncached, stands).
        counts = attrs(values(requests, rids), _COMPUTED) // B
        ids, num_heads = self.blocks.planned(rows[chosen], counts, self._caching)
        head = ids[ranges(indptr_of(counts)[:-1], num_heads)]
        code = np.empty(head.size, np.int64)  # (np.full: a Python call)
        code.fill(2)
        read = (head != self._null_id) & (self.pool.block_live[head] < B)
        # Two C loops over the block objects (a comprehension is a Python
        # iteration per block, and `block_hash` a property: a frame each).
        objs = list(map(self.block_pool.blocks.__getitem__, head[read].tolist()))
        hashed = map(is_not, map(_HASH, objs), repeat(None))
        code[read] = attrs(objs, _REF_CNT) * 2 + np.fromiter(hashed, bool, len(objs))
        if integrity.CHECK:  # past cached_upto: neither shared nor cached
            for rid, h, n in zip(
                rids, num_heads.tolist(), counts.tolist(), strict=True
            ):
                rest = self.positional(rid)[h:n]
                assert all(
                    b.is_null or (b.ref_cnt == 1 and b.block_hash is None) for b in rest
                ), f"{rid}: a block past cached_upto is shared or cached"
        # Full blocks are neither sources nor destinations and add no holes;
        # shared ones are never moved. Uncached holes are filled first, then
        # cached ones from the chain's end (prio). One compiled pass.
        req_indptr, block_ids, live, is_cached, pos, prio = self._candidate_blocks(
            ids, counts, num_heads, code, self.pool.block_live, self._null_id, B,
        )  # fmt: skip
        common = dict(
            req_indptr=req_indptr,
            block_ids=block_ids,
            block_live=live,
            block_size=B,
            threshold=self.threshold,
        )
        plan = None
        if np.logical_or.reduce(is_cached):
            plan = plan_around_cache(cached=is_cached, **common)
            # Fresh blocks come back as sources within a step or two; keep one
            # block per scheduled request for the next step's tokens. With
            # none to spare, memory comes first: the plan in place, unless the
            # one around the cache takes no fresh block and frees as many.
            spare = self.block_pool.get_num_free_blocks() - len(scheduled)
            need = int(plan.num_fresh.sum())
            if spare < 0 or need > spare:
                in_place = plan_blocks(dst_priority=prio, **common)
                if need > max(spare, 0) or in_place.blocks_freed > plan.blocks_freed:
                    plan = in_place
                    self.counters.tight_plans += 1
        if plan is None:
            plan = plan_blocks(dst_priority=prio, **common)
        if len(plan.req_index) == 0:
            return None
        entry_of = dict(zip(block_ids.tolist(), pos.tolist(), strict=True))
        cached_ids = block_ids[is_cached]
        return self._bind(
            plan,
            list(map(recs.__getitem__, chosen)),
            rids,
            rows[chosen],
            entry_of,
            cached_ids,
        )

    def _bind(
        self,
        plan: BlockPlan,
        recs: list[RequestState],
        rids: list[str],
        rows: np.ndarray,
        entry_of: dict[int, int],
        cached_ids: np.ndarray,
    ) -> MoveBatch | None:
        """Turn a block plan into slot moves; free blocks that need none.
        `rows`: the planned requests' Token Table rows; `entry_of`: each
        planned block's entry in its request's list; `cached_ids`: the planned
        blocks the prefix cache holds (their hashes read by the plan)."""
        B = self.block_size
        batch_id = self._next_batch_id
        fresh = self.block_pool.get_new_blocks(int(plan.num_fresh.sum()))
        # The live tokens of every planned request at once (Token Table rows).
        seg, idx, slot = self.pool.live_tokens(rows)
        m = pack_requests(
            plan,
            live_indptr=indptr_of(np.bincount(seg, minlength=len(rids))),
            live_idx=idx,
            live_slots=slot,
            block_size=B,
            num_blocks=self.pool.num_blocks,
            fresh_block_ids=np.fromiter(map(_ID, fresh), np.int64, len(fresh)),
        )
        # Blocks written, per request (its moves fill them one after another).
        blk = m.dst_slots // B
        first = np.concatenate([blk[:1] >= 0, blk[1:] != blk[:-1]]).nonzero()[0]
        dst_ids, dst_at = blk[first], first.searchsorted(m.indptr)
        # A destination's content changes: it must leave the prefix cache
        # (sources keep theirs intact, so a later hit on them stays valid).
        # Only the cached ones: the plan read each planned block's hash, a
        # fresh block left the cache when allocated, and evict_blocks costs
        # vLLM's Python per block (~1/3 of a 64-request plan otherwise).
        # The plan's cached blocks by block id (np.isin, needed twice here,
        # makes ~20 calls each).
        is_cached = np.zeros(self.pool.num_blocks, bool)
        is_cached[cached_ids] = True
        cached = dst_ids[is_cached[dst_ids]]
        assert not integrity.CHECK or all(
            self.block_pool.blocks[b].block_hash is None
            for b in set(dst_ids.tolist()) - set(cached.tolist())
        ), "a destination the plan found uncached has a hash"
        if cached.size:
            self.block_pool.evict_blocks(set(cached.tolist()))
        by_id = self.block_pool.blocks
        src_ids = plan.src_block_ids.astype(np.int64)
        src = list(map(by_id.__getitem__, src_ids.tolist()))
        num_src = plan.src_indptr[1:] - plan.src_indptr[:-1]
        fresh_at = indptr_of(plan.num_fresh)
        assert (plan.num_fresh <= num_src).all(), "a fresh block displaces no source"
        num_moves = m.indptr[1:] - m.indptr[:-1]
        moving = num_moves > 0
        for k in (~moving).nonzero()[0].tolist():
            # Every token already dead: free right away, nothing to evacuate into.
            r = plan.req_index[k]
            lo, hi = plan.src_indptr[k], plan.src_indptr[k + 1]
            # The fresh blocks (no hash) first: reused before the sources.
            self.block_pool.free_blocks(fresh[fresh_at[k] : fresh_at[k + 1]])
            self.release_blocks(rids[r], src[lo:hi])
        if not np.logical_or.reduce(moving):  # (.any(), .all(): 3 calls)
            return None
        if not np.logical_and.reduce(moving):  # the moving requests' parts only
            sel = moving.repeat(num_src)
            src_ids, src = src_ids[sel], list(compress(src, sel.tolist()))
            fresh = list(compress(fresh, moving.repeat(plan.num_fresh).tolist()))
        num_dst = (dst_at[1:] - dst_at[:-1])[moving]
        assert (num_dst > 0).all(), "a request moves tokens into no block"
        req_index = plan.req_index[moving].tolist()
        out_rids = list(map(rids.__getitem__, req_index))
        moves = InFlightMoves(
            batch=MoveBatch(
                batch_id=batch_id,
                req_ids=out_rids,
                indptr=indptr_of(num_moves[moving]),
                idx=m.idx,
                src_slots=m.src_slots,
                dst_slots=m.dst_slots,
            ),
            src_indptr=indptr_of(num_src[moving]),
            src=src,
            src_ids=src_ids,
            src_at=np.fromiter(map(entry_of.__getitem__, src_ids.tolist()), np.int64),
            fresh_indptr=indptr_of(plan.num_fresh[moving]),
            fresh=fresh,
            dst_indptr=indptr_of(num_dst),
            dst_ids=dst_ids,
            index=dict(zip(out_rids, range(len(out_rids)), strict=True)),
        )
        _set_batch(map(recs.__getitem__, req_index), batch_id)
        if fresh:  # cached sources come first in a plan around the cache
            self._swap_in(moves, rows[req_index])
        # Sources are never destinations: their hashes are still the plan's.
        evacuated = int(np.add.reduce(is_cached[src_ids]))
        assert not integrity.CHECK or evacuated == sum(
            b.block_hash is not None for b in src
        ), "a source's hash changed since the plan read it"
        self.counters.evacuated_blocks += evacuated
        self._busy[src_ids] = batch_id
        self._busy[dst_ids] = batch_id
        self._inflight[batch_id] = moves
        self._next_batch_id += 1
        return moves.batch

    def _swap_in(self, moves: InFlightMoves, rows: np.ndarray) -> None:
        """Put each fresh block where the evacuated source it displaces (its
        request's first sources) was in the positional list, so that vLLM
        frees it with the request; the displaced sources are then held by the
        batch alone. One pass for the batch, at the entries where the plan
        found the sources (src_at) a moment ago; `rows`: the batch's
        requests' Token Table rows, in its order."""
        nf = moves.fresh_indptr[1:] - moves.fresh_indptr[:-1]
        at = ranges(moves.src_indptr[:-1], nf)
        rids = moves.batch.req_ids
        missing = self.blocks.replace_at_many(
            rids, rows, np.arange(nf.size).repeat(nf),
            moves.src_at[at], moves.src_ids[at], moves.fresh,
        )  # fmt: skip
        if missing:  # the plan read the lists a moment ago: a broken mirror
            raise RuntimeError(
                f"{[moves.batch.req_ids[k] for k in missing]}: an evacuated "
                "source is not in its list"
            )
