# SPDX-License-Identifier: Apache-2.0
"""Token Tables: per-request slot maps and liveness, plus per-block live counts.

Scheduler side. One `TokenTablePool` holds the Token Table of every running request
(logical token index -> physical slot, and a liveness bit) and the block view
(`block_live`: live tokens per physical block). Every mutation goes through one
method that updates both views together (docs/DESIGN.md §3.1, C1), so they cannot
disagree; `check_integrity()` recounts one from the other.

Slot layout of one request (block_size B = 4, `x` = dead, `.` = unused)::

    logical idx   0  1  2  3  4  5  6  7  8
    slot         12 13 14 15 40 41 42 43 20   <- slot = block_id * B + offset
    live          1  x  1  x  x  x  1  x  1
    block_live   [3]: 2   [10]: 1   [5]: 1 (tail block, offsets 1..3 unused)

A slot is *owned* by the live token mapped to it. Dead tokens keep their last slot
(for `dead_idx` and late remaps) but own nothing: once their block is reclaimed and
reused, a stale slot may coincide with a live token's.

Storage is flat (arena.py), so a step's work over the batch is a fixed number
of calls (`rows`, `append_rows`, `live_tokens`, `evict_rows`, `apply_moves`);
the passes over tokens are compiled loops (table_kernels.py), which trust
what they are given: the checks are here. The per-request methods are those
on one row.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from vllm.vtoken import integrity
from vllm.vtoken.arena import (
    BatchMemo,
    RowArena,
    add_counts,
    as_index,
    block_shift,
    indptr_of,
    segments,
)

# evict_lowest's absent arguments (kernels never write an empty array): a
# NumPy call a step less, ~3 us where the hooks run.
_NONE, _NONE_F32 = np.zeros(0, np.int64), np.zeros(0, np.float32)


@functools.cache
def _eviction_kernels():
    # The scheduler's one-pass eviction (numba), loaded on first use (the
    # worker's tables never evict by rule), once: an import statement in the
    # step's path costs ~15 µs on the caches the forward left.
    from vllm.vtoken import eviction_kernels

    return eviction_kernels


class TokenTablePool:
    """Token Tables of all requests plus the global per-block live counts.

    Memory: 9 bytes per token (int32 slot, bool liveness, int32 live-list
    entry; at most 4x that in slack), 4 per physical block and 72 per request
    row (its region and seven counters, int64); the scheduler's
    (`positional_lists`) 4 more per token and 16 more per row.

    Liveness counters (`num_live`, `total_live`) count live bits of every known
    token, slotted or not (a preempted request keeps its live set), and are O(1).
    """

    def __init__(
        self, num_blocks: int, block_size: int, positional_lists: bool = False
    ) -> None:
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        # Compiled batch passes; imported here, so that numba loads (and its
        # kernels compile, or come from its cache) only with vToken on.
        from vllm.vtoken import table_kernels

        self._k = table_kernels
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        # A power of two (raises otherwise): the kernels find a slot's block
        # by this shift (table_kernels.py).
        self.shift = block_shift(self.block_size)
        self.num_slots = self.num_blocks * self.block_size
        self.block_live = np.zeros(self.num_blocks, dtype=np.int32)
        # Per row: tokens known (ever slotted), slotted ([0, n_slotted) have
        # a slot), live bits set; slot -1 and live False outside those. The
        # live list, so that a step walks a request's live tokens and not a
        # long generation's dead history: entries [0, n_listed) of `listed`
        # are logical indices, ascending, of the live tokens and, in a row
        # with `keep_dead`, of tokens that died since the list was last
        # compacted (once they are as many as the live); -1 past them.
        # Otherwise a kill takes its victims out, and a walk copies the list
        # (table_kernels.kill_rows, listed_live; DESIGN.md §3.1).
        # With `positional_lists` (the scheduler's), each row also holds the
        # mirror of its request's positional block list (block_index.py):
        # `block` (entry e's id at the region's e-th entry: a list has fewer
        # entries than its request has tokens), `n_entries` mirrored,
        # `cache_end` (1 + the entries vLLM may have cached; 0: unknown).
        arrays = {
            "slot": (np.int32, -1),
            "live": (bool, False),
            "listed": (np.int32, -1),
        }
        columns = [
            "n_tokens",
            "n_slotted",
            "n_live",
            "n_listed",
            "n_dead_marked",
            "n_nulls",
            "keep_dead",
        ]
        if positional_lists:
            arrays["block"] = (np.int32, -1)
            columns += ["n_entries", "cache_end"]
        self._a = RowArena(arrays, columns)
        self._row = self._a.index
        self._total_live = 0

    # ------------------------------------------------------------ lifecycle
    def add_request(self, req_id: str, keep_dead: bool = False) -> None:
        """Registers an empty table for a request not yet present. With
        `keep_dead` its kills leave their victims listed until the dead are
        as many as the live (table_kernels.kill_rows; which rows:
        EvictionPolicy.scatters_victims)."""
        assert req_id not in self._row, f"{req_id!r} already has a token table"
        self.add_requests([req_id], np.array([keep_dead]))

    def add_requests(self, req_ids: Sequence[str], keep_dead: np.ndarray) -> None:
        """`add_request` of distinct requests at once (a step's admissions),
        keep_dead[i] req_ids[i]'s."""
        rows = self._a.add_many(req_ids)
        self._a.cols["keep_dead"][rows] = keep_dead

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._row

    def release(self, req_id: str) -> None:
        """Drops a finished or aborted request and its counts (one request:
        vLLM frees them one at a time on the scheduler side; ~12 µs, where
        release_many's pass costs ~6 a request for 4, ~2 for 16)."""
        self.reset_slots(req_id)
        self._total_live -= self.num_live(req_id)
        self._a.remove(req_id)

    def release_many(self, req_ids: Sequence[str]) -> None:
        """`release` of distinct requests at once (the worker's finished
        ones, each step): their live slotted tokens leave their blocks'
        counts in one pass over the live lists, not a dozen calls a
        request."""
        if len(req_ids) <= 1:  # the per-request path is the cheaper for one
            for req_id in req_ids:
                self.release(req_id)
            return
        rows = self.rows(req_ids)
        assert not integrity.CHECK or np.unique(rows).size == rows.size, (
            "a request twice"
        )
        _, _, slots = self.live_tokens(rows)
        self._count(slots, -1)
        self._total_live -= int(self._n_live[rows].sum())
        self._a.remove_many(req_ids)

    def reset_slots(self, req_id: str) -> None:
        """Preemption: slots become -1, block counts go, liveness bits stay."""
        row = self._row[req_id]
        self._count(self._live_slots(row), -1)
        self._slot[self._a.span(row, self._n_slotted[row])] = -1
        self._n_slotted[row] = 0

    # ------------------------------------------------------------ batch ops
    def rows(self, req_ids: Sequence[str]) -> np.ndarray:
        """int64 [R]: the rows of registered requests (KeyError otherwise)."""
        return self._a.rows(req_ids)

    def offsets(self, counts: np.ndarray) -> np.ndarray:
        """arena.indptr_of of int `counts`, compiled (table_kernels.
        offsets_into), for the hooks: NumPy's cumsum, cold where they run
        (after the forward), took 3-4x as long (in-engine, 64 requests,
        alternating step by step: 18 -> 4 us in the scheduler's end_step,
        7 -> 3 in the worker's prepare_attention)."""
        counts = np.ascontiguousarray(counts, np.int64)  # itself, in the hooks
        out = np.empty(counts.size + 1, np.int64)
        self._k.offsets_into(counts, out)
        return out

    def rows_or_missing(self, req_ids: Sequence[str]) -> np.ndarray:
        """int64 [R]: the rows of `req_ids`, -1 for a request without one."""
        return self._a.rows_or_missing(req_ids)

    @property
    def arena(self) -> RowArena:
        """The rows' storage, for BlockIndex: the positional lists' mirror
        lives in the scheduler's rows (`positional_lists`)."""
        return self._a

    def memo(self) -> BatchMemo:
        """A `BatchMemo` valid while no table is added or released."""
        return BatchMemo(self._a)

    def rows_adding(self, req_ids: Sequence[str], add_many) -> np.ndarray:
        """`RowArena.rows_adding`: `add_many(new)` registers the requests of
        `req_ids` without a table first (`add_requests`), the step's at once."""
        return self._a.rows_adding(req_ids, add_many)

    def append_rows(self, rows: np.ndarray, counts: np.ndarray, slots) -> None:
        """`append` for distinct rows at once: row i gets the next counts[i]
        entries of `slots` (flat, int, each in [0, num_slots), distinct per
        row: requests sharing prefix-cached blocks share those slots)."""
        s = self._as_slots(slots, "slots", unique=False)  # checked per row
        if s.size == 0:
            return
        rows, counts = np.asarray(rows, np.int64), np.asarray(counts, np.int64)
        if integrity.CHECK:  # (the counts' sum: the kernel's check)
            self._check_append(rows, counts, s)
        a, c = self._a.data, self._a.cols

        def run():
            return self._k.append_rows(
                rows, counts, s, self._a.start, self._a.cap, c["n_tokens"],
                c["n_slotted"], c["n_live"], c["n_listed"], a["slot"], a["live"],
                a["listed"], self.block_live, self.shift,
            )  # fmt: skip

        born = run()
        if born < 0:  # a region must grow first (the kernel changed nothing)
            self._a.reserve(rows, self._n_slotted[rows] + counts)
            born = run()
            assert born >= 0, "append_rows: regions reserved, yet short"
        self._total_live += born

    def append_read(self, rows, computed, counts, slots, scored, hit_slots=None):
        """The worker's step in one compiled pass (table_kernels.append_read):
        `append_rows` of each row's prefix-cache hits (tokens [num_slotted,
        computed[i]): `hit_slots(num_slotted, hits)` lists them before the
        new slots, called only when a row has some) and of counts[i] new tokens
        from `slots` (int64, flat; extra entries ignored), then the keys of
        the rows to read: those with a dead token, or `scored` (bool [R]).
        `rows` distinct, every array int64 but `scored`. Returns (writes,
        kv_indptr, idx, kv, stock): writes[i] says row i has a dead token,
        its keys are [kv_indptr[i], kv_indptr[i + 1]) of idx (logical) and
        kv (slots), `context.read_keys` order; an unread row has none;
        `stock`: some row has no dead token (not writes.all(), which as a
        NumPy reduction cost the worker ~7 us a step, cold)."""
        k, a, c = self._k, self._a.data, self._a.cols
        if integrity.CHECK:
            self._check_append(rows, counts, slots)

        def run(with_hits, s):
            return k.append_read(
                rows, computed, counts, s, scored, with_hits, self._a.start,
                self._a.cap, c["n_tokens"], c["n_slotted"], c["n_live"],
                c["n_listed"], a["slot"], a["live"], a["listed"],
                self.block_live, self.shift,
            )  # fmt: skip

        status, new, writes, kv_indptr, idx, kv = run(False, slots)
        if status & (k.HITS | k.ROOM):  # rare: nothing changed, so again
            start = c["n_slotted"][rows]
            hits = np.maximum(computed - start, 0)
            if status & k.HITS:
                slots = hit_slots(start, hits)
                if integrity.CHECK:
                    self._check_append(rows, hits + counts, slots)
            self._a.reserve(rows, start + hits + counts)
            status, new, writes, kv_indptr, idx, kv = run(True, slots)
            assert not status & k.ROOM, "append_read: regions reserved, yet short"
        self._total_live += new
        if status & k.DEAD_QUERY:  # a resumed request recomputes dead tokens
            from vllm.vtoken.context import read_keys

            read = (writes | scored).nonzero()[0]
            num_keys = np.zeros(rows.size, np.int64)
            num_keys[read], idx, kv = read_keys(self, rows[read], computed[read])
            kv_indptr = indptr_of(num_keys)
        return writes, kv_indptr, idx, kv, bool(status & k.STOCK)

    def slot_spans(self, rows: np.ndarray, take: np.ndarray):
        """Before `positional_slots`: (resumed, fresh, need, first, end) of
        rows[i] slotting take[i] more tokens (int64 [R] each;
        table_kernels.slot_spans)."""
        c = self._a.cols
        return self._k.slot_spans(rows, take, c["n_slotted"], c["n_tokens"], self.shift)

    def positional_slots(self, rows, take, ids) -> np.ndarray:
        """int64: the positional slots of rows[i]'s next take[i] tokens, in
        its tail block, then in blocks `ids` (table_kernels.positional_slots)."""
        return self._k.positional_slots(
            rows, take, ids, self._a.start, self._a.cols["n_slotted"],
            self._a.data["slot"], self.shift,
        )  # fmt: skip

    def _check_append(self, rows, counts, slots) -> None:
        # VTOKEN_CHECK_INTEGRITY=1: rows distinct; row i's next counts[i]
        # slots in range and distinct (rows may share prefix-cached slots).
        n = int(counts.sum())
        assert slots.size >= n, "fewer slots than tokens"
        s = self._as_slots(slots[:n], "slots", unique=False)
        assert np.unique(rows).size == rows.size, "a row twice in one batch"
        key = np.repeat(np.arange(rows.size), counts) * self.num_slots + s
        assert np.unique(key).size == key.size, "slots holds a slot twice"

    def tokens(self, rows: np.ndarray):
        """Every slotted token of `rows`, flat: (seg, idx, live, slot), the
        row's position in `rows`, logical index, liveness bit, slot (int32)."""
        rows = np.asarray(rows, np.int64)
        seg, idx = segments(self._n_slotted[rows])
        pos = self._a.start[rows][seg] + idx
        return seg, idx, self._live[pos], self._slot[pos]

    def live_tokens(self, rows: np.ndarray):
        """The live slotted tokens of `rows`, flat, in logical order: (seg,
        idx, slot), int64 (slot int32). O(live tokens): the live lists."""
        a, c = self._a.data, self._a.cols
        return self._k.live_tokens(
            np.asarray(rows, np.int64), self._a.start, c["n_live"],
            c["n_listed"], c["n_slotted"], a["listed"], a["live"], a["slot"],
        )  # fmt: skip

    def emptied_blocks(self, rows: np.ndarray, seg: np.ndarray, idx: np.ndarray):
        """(seg, blk, entry): for tokens idx[j] of rows[seg[j]] (just
        evicted), the full blocks they leave without a live token, each
        (seg, blk) once, by seg then block id, with the positional entry
        (idx // B) of one of the tokens (table_kernels.emptied_blocks)."""
        return self._k.emptied_blocks(
            np.asarray(rows, np.int64), np.asarray(seg, np.int64),
            np.asarray(idx, np.int64), self._a.start, self._a.cols["n_slotted"],
            self._a.data["slot"], self.block_live, self.shift, self.num_blocks,
        )  # fmt: skip

    def read_walk(self, rows: np.ndarray, computed: np.ndarray):
        """`live_tokens` of `rows` for the token read: (counts, idx, slot,
        queries), per row its number of live tokens, their logical indices
        and slots (int64), and how many are at or past computed[i], over
        all rows (table_kernels.read_walk)."""
        a, c = self._a.data, self._a.cols
        return self._k.read_walk(
            np.asarray(rows, np.int64), np.asarray(computed, np.int64),
            self._a.start, c["n_live"], c["n_listed"], c["n_slotted"],
            a["listed"], a["live"], a["slot"],
        )  # fmt: skip

    def tokens_at(self, rows: np.ndarray, seg: np.ndarray, idx) -> np.ndarray:
        """int32: the slots of tokens idx[j] of rows[seg[j]]."""
        return self._a.data["slot"][self._a.start[np.asarray(rows)[seg]] + idx]

    def evict_rows(self, rows: np.ndarray, indptr: np.ndarray, idx) -> None:
        """`evict` for distinct rows at once: row i loses tokens
        idx[indptr[i]:indptr[i + 1]] (live, slotted, distinct per row)."""
        i = as_index(idx, "idx")
        if i.size == 0:
            return
        rows, indptr = np.asarray(rows, np.int64), np.asarray(indptr, np.int64)
        if integrity.CHECK:
            self._check_idx(rows, np.repeat(np.arange(rows.size), np.diff(indptr)), i)
        a, c = self._a.data, self._a.cols
        bad = self._k.evict_rows(
            rows, indptr, i, self._a.start, c["n_live"], c["n_listed"],
            a["slot"], a["live"], a["listed"], self.block_live, self.shift,
            c["keep_dead"],
        )  # fmt: skip
        assert bad < 0, f"token {i[bad]} (entry {bad} of idx) is already dead"
        self._total_live -= i.size

    def evict_lowest(self, rows, want, attended, rule, seeds, scores=None):
        """`evict_rows` of the tokens a built-in's `LowestRule` picks, in
        one pass (eviction_kernels.evict_lowest): row rows[i] (distinct)
        loses up to want[i] of its live slotted tokens, those from
        attended[i] - 1 on protected. `seeds` (uint64 [R]): the rows' batch
        seeds; `scores`: the running scores' arena and the fold's next
        victims (ScoreAccumulator.arena_of), for a "score" key. Returns
        (counts, idx), idx row by row, ascending."""
        ek, none = _eviction_kernels(), _NONE
        s_rows, s_start, s_cap, acc, *cand = scores or (
            *[none] * 3,
            _NONE_F32,
            *[none] * 4,
        )
        a_rows, a_start, born, a_step = rule.ages or (none,) * 4
        score_key = rule.key in ("score", "persistence")
        assert not score_key or scores is not None, "a score key needs scores"
        assert rule.key != "persistence" or rule.ages is not None, "and ages"
        a, c = self._a.data, self._a.cols
        counts, idx = ek.evict_lowest(
            np.asarray(rows, np.int64), np.asarray(want, np.int64),
            np.asarray(attended, np.int64), np.asarray(seeds, np.uint64),
            ek.KEYS[rule.key], int(rule.recent), int(rule.sinks),
            self._a.start, c["n_tokens"], c["n_slotted"], c["n_live"],
            c["n_listed"], a["listed"], a["live"], a["slot"], self.block_live,
            self.shift, c["keep_dead"], s_rows, s_start, s_cap, acc, *cand,
            int(rule.window), a_rows, a_start, born, a_step,
        )  # fmt: skip
        self._total_live -= idx.size
        return counts, idx

    # ------------------------------------------------------------ mutations
    def append(self, req_id: str, slots: np.ndarray) -> None:
        """Slots (int [n], distinct) for the next n logical tokens after the
        slotted ones: new tokens are live, known ones (re-synced after
        `reset_slots`) keep their liveness bit."""
        s = as_index(slots, "slots")
        self.append_rows(self.rows([req_id]), np.array([s.size]), s)

    def evict(self, req_id: str, idx: np.ndarray) -> np.ndarray:
        """Marks tokens dead (int [n] logical indices, distinct, live, in
        [0, num_slotted)): flips their bits and leaves their blocks' counts.
        Returns them sorted (int64); evicting none is a no-op."""
        rows = self.rows([req_id])
        i = np.sort(as_index(idx, "idx"))
        self.evict_rows(rows, np.array([0, i.size]), i)
        return i

    def apply_moves(
        self,
        req_ids: Sequence[str],
        indptr: np.ndarray,
        idx: np.ndarray,
        dst_slots: np.ndarray,
        keep: Sequence[bool] | None = None,
    ) -> None:
        """Switches a completed move batch: its tokens now live at `dst_slots`.

        The paper's `apply_moves`, on the Token Table (both views, C1). Request
        r's moves are entries [indptr[r], indptr[r + 1]) (CSR): token idx[j]
        (distinct per request) moves to dst_slots[j] (distinct). A token that
        died after the move was planned still gets its new slot, but is
        counted in no block. Requests that left the pool (finished), have no
        slots (preempted) or are False in `keep` are skipped.
        """
        assert len(indptr) == len(req_ids) + 1 and len(idx) == len(dst_slots)
        row = self._a.rows_or_missing(req_ids)
        keep = np.ones(row.size, bool) if keep is None else np.asarray(keep, bool)
        indptr = np.asarray(indptr, np.int64)
        i, ns = as_index(idx, "idx"), as_index(dst_slots, "dst_slots")
        # The CSR's ends (its steps are checked in the pass): numba reads
        # without bounds.
        assert keep.size == row.size and indptr[0] == 0 and indptr[-1] == i.size, (
            "apply_moves: keep or indptr does not match the batch"
        )
        if integrity.CHECK:  # over the kept requests (every missing one is -1)
            ok = (row >= 0) & keep
            ok[ok] = self._n_slotted[row[ok]] > 0
            seg = np.repeat(np.arange(row.size), np.diff(indptr))
            sel = ok[seg]
            self._as_slots(ns[sel], "dst_slots")
            self._check_idx(row[ok], (np.cumsum(ok) - 1)[seg[sel]], i[sel])
        a, c = self._a.data, self._a.cols
        bad = self._k.move_rows(
            row, keep, indptr, i, ns, self._a.start, c["n_slotted"], a["slot"],
            a["live"], self.block_live, self.shift, self.num_slots,
        )  # fmt: skip
        assert bad < 0, (
            "apply_moves: indptr decreases"
            if bad >= i.size
            else f"move {bad}: token {i[bad]} is not slotted or slot {ns[bad]} "
            f"is outside [0, {self.num_slots})"
        )

    # ------------------------------------------------------------ queries
    def num_tokens(self, req_id: str) -> int:  # known: ever slotted
        return int(self._n_tokens[self._row[req_id]])

    def num_slotted(self, req_id: str) -> int:
        return int(self._n_slotted[self._row[req_id]])

    def num_live(self, req_id: str) -> int:
        """Live tokens of the request, slotted or not (O(1))."""
        return int(self._n_live[self._row[req_id]])

    def num_live_rows(self, rows: np.ndarray) -> np.ndarray:  # int64 [R]
        return self._a.cols["n_live"][rows]

    def has_dead(self, req_id: str) -> bool:
        """Whether any known token of the request is dead (O(1))."""
        row = self._row[req_id]
        return bool(self._n_live[row] < self._n_tokens[row])

    def num_tokens_rows(self, rows: np.ndarray) -> np.ndarray:  # int64 [R]
        return self._a.cols["n_tokens"][rows]

    def num_slotted_rows(self, rows: np.ndarray) -> np.ndarray:  # int64 [R]
        return self._a.cols["n_slotted"][rows]

    def has_dead_rows(self, rows: np.ndarray) -> np.ndarray:
        """bool [R]: `has_dead` of each row."""
        c = self._a.cols
        return c["n_live"][rows] < c["n_tokens"][rows]

    def dead_since_mark_rows(self, rows: np.ndarray) -> np.ndarray:
        """int64 [R]: tokens dead since `mark_rows` last ran on each row."""
        c = self._a.cols
        return c["n_tokens"][rows] - c["n_live"][rows] - c["n_dead_marked"][rows]

    def over_budget(self, rows, prompt, limit, budget):
        """(ok, which, attended, excess) of the running requests at `rows`
        (-1: no table yet), in one pass (table_kernels.over_budget): ok, those
        past their `prompt` tokens with every token they know slotted again
        (not a resume recomputing in chunks) and, `limit` not empty, short of
        limit (their last step's output is in); which, the ok ones holding more live
        tokens than budget[row] (int64, by pool row), by excess, with
        `attended` tokens slotted."""
        # numba reads without bounds: the per-request arrays match here.
        assert prompt.size == rows.size and limit.size in (0, rows.size)
        c = self._a.cols
        return self._k.over_budget(
            rows, prompt, limit, c["n_tokens"], c["n_slotted"], c["n_live"], budget
        )

    def evicted_runs(self, counts):
        """int64: the run i of each token of an eviction where run i lost
        counts[i] tokens (table_kernels.evicted_runs)."""
        # A plug-in's counts may stride.
        return self._k.evicted_runs(np.ascontiguousarray(counts, np.int64))

    def plan_due(self, rows: np.ndarray) -> np.ndarray:
        """bool [R]: whether each row is due for the planner: a block's worth
        of tokens dead since `mark_rows`, and its dead tokens less a block per
        freed one (`add_nulls`; an upper bound on its holes) fill a block.
        One compiled pass (table_kernels.plan_due)."""
        c = self._a.cols
        return self._k.plan_due(
            rows, c["n_tokens"], c["n_live"], c["n_dead_marked"], c["n_nulls"],
            self.block_size,
        )  # fmt: skip

    def num_nulls_rows(self, rows: np.ndarray) -> np.ndarray:
        """int64 [R]: the positional blocks each row's request has freed
        (null-replaced) since its list was made: `add_nulls`. Scheduler side."""
        return self._a.cols["n_nulls"][rows]

    def add_nulls(self, rows: np.ndarray, n) -> None:
        """Rows (distinct) freed n (int or int [R]) more positional blocks;
        `clear_nulls` when vLLM makes the request a new list (a resume)."""
        # Fancy-index `+=` adds once per distinct row: a repeated row would
        # lose counts silently.
        assert not integrity.CHECK or np.unique(rows).size == rows.size, rows
        self._a.cols["n_nulls"][rows] += n

    def clear_nulls(self, req_id: str) -> None:
        """No freed blocks: a preempted request's positional list is gone,
        and the resume allocates it anew."""
        self._a.cols["n_nulls"][self._row[req_id]] = 0

    def mark_rows(self, rows: np.ndarray, recounted=None) -> None:
        """Starts `dead_since_mark_rows` over; with `recounted` (int [R]),
        counts that many dead tokens of each row again instead (a resumed
        request recomputes them: they hold slots again)."""
        dead, marked = self._n_tokens[rows] - self._n_live[rows], self._a.cols
        marked["n_dead_marked"][rows] = (
            dead if recounted is None else marked["n_dead_marked"][rows] - recounted
        )

    def total_live(self) -> int:
        """Live tokens over all requests (O(1))."""
        return self._total_live

    def live_idx(self, req_id: str) -> np.ndarray:
        """int64: logical indices of slotted live tokens, ascending."""
        row = self._row[req_id]
        return np.flatnonzero(self._live[self._a.span(row, self._n_slotted[row])])

    def live_slots(self, req_id: str) -> np.ndarray:
        """int64: slots of `live_idx(req_id)`, same order."""
        return self._live_slots(self._row[req_id]).astype(np.int64)

    def dead_idx(self, req_id: str) -> np.ndarray:
        """int64: logical indices of dead tokens (slotted or not), ascending."""
        row = self._row[req_id]
        return np.flatnonzero(~self._live[self._a.span(row, self._n_tokens[row])])

    def slots(self, req_id: str) -> np.ndarray:
        """int32 view [num_slotted] of the slot map (do not write to it)."""
        row = self._row[req_id]
        return self._slot[self._a.span(row, self._n_slotted[row])]

    def request_ids(self) -> list[str]:
        return list(self._row)

    # ------------------------------------------------------------ invariants
    def check_integrity(self, block_ref_cnt: np.ndarray | None = None) -> None:
        """Recounts both views from the tables and asserts every invariant.
        With `block_ref_cnt` (int [num_blocks], the block pool's), a live slot
        may be in two requests only if its block is shared (ref > 1), and no
        live token in a block with ref 0; without it, in one request only.
        (integrity.check_tables: kept beside the other checks.)"""
        integrity.check_tables(self, block_ref_cnt)

    # ------------------------------------------------------------ internals
    # The arena's arrays and columns (re-read: growing may replace them).
    # A Python call each: the per-step batch methods index `self._a` instead.
    _slot = property(lambda self: self._a.data["slot"])
    _live = property(lambda self: self._a.data["live"])
    _listed = property(lambda self: self._a.data["listed"])
    _n_listed = property(lambda self: self._a.cols["n_listed"])
    _n_tokens = property(lambda self: self._a.cols["n_tokens"])
    _n_slotted = property(lambda self: self._a.cols["n_slotted"])
    _n_live = property(lambda self: self._a.cols["n_live"])

    def _live_slots(self, row: int) -> np.ndarray:
        span = self._a.span(row, self._n_slotted[row])
        return self._slot[span][self._live[span]]

    def _count(self, slots: np.ndarray, delta: int) -> None:
        # The one place block_live changes (C1): every caller passes the slots of
        # live tokens only.
        add_counts(self.block_live, slots // self.block_size, delta)

    def _check_idx(self, rows: np.ndarray, seg: np.ndarray, idx: np.ndarray) -> None:
        assert np.unique(rows).size == rows.size, "a row twice in one batch"
        if idx.size == 0:
            return
        assert (idx >= 0).all() and (idx < self._n_slotted[rows][seg]).all(), (
            "token index outside [0, num_slotted)"
        )
        key = seg * (int(idx.max()) + 1) + idx
        assert np.unique(key).size == key.size, "idx holds a token twice"

    def _as_slots(self, slots: np.ndarray, what: str, unique=True) -> np.ndarray:
        s = as_index(slots, what)
        if integrity.CHECK and s.size:
            assert 0 <= s.min() and s.max() < self.num_slots, (
                f"{what} outside [0, {self.num_slots})"
            )
            twice = unique and np.unique(s).size != s.size
            assert not twice, f"{what} holds a slot twice"
        return s
