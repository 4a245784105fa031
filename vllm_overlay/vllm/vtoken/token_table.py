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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm.vtoken import integrity


@dataclass(slots=True)
class _Table:
    """One request's Token Table; arrays grow by doubling."""

    slot: np.ndarray  # int32 [capacity]: -1 at and past n_slotted
    live: np.ndarray  # bool [capacity]: False past n_tokens
    n_tokens: int = 0  # logical tokens known (ever slotted)
    n_slotted: int = 0  # tokens [0, n_slotted) have a slot
    n_live: int = 0  # live bits set in [0, n_tokens)


def _as_index(values: np.ndarray | list[int], what: str) -> np.ndarray:
    arr = np.asarray(values)
    assert arr.ndim == 1, f"{what} must be 1-D, got shape {arr.shape}"
    assert arr.size == 0 or np.issubdtype(arr.dtype, np.integer), (
        f"{what} must hold integers, got dtype {arr.dtype}"
    )
    return arr.astype(np.int64, copy=False)


class TokenTablePool:
    """Token Tables of all requests plus the global per-block live counts.

    Memory: 5 bytes per token (int32 slot + bool liveness), at most twice that
    while an array has doubling slack; plus 4 bytes per physical block.

    Liveness counters (`num_live`, `total_live`) count live bits of every known
    token, slotted or not (a preempted request keeps its live set), and are O(1).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0, (num_blocks, block_size)
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.num_slots = self.num_blocks * self.block_size
        self.block_live = np.zeros(self.num_blocks, dtype=np.int32)
        self._tables: dict[str, _Table] = {}
        self._total_live = 0

    # ------------------------------------------------------------ lifecycle
    def add_request(self, req_id: str) -> None:
        """Registers an empty table for a request not yet present."""
        assert req_id not in self._tables, f"{req_id!r} already has a token table"
        self._tables[req_id] = _Table(
            slot=np.full(16, -1, dtype=np.int32), live=np.zeros(16, dtype=bool)
        )

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._tables

    def release(self, req_id: str) -> None:
        """Drops a finished or aborted request and its counts."""
        t = self._tables.pop(req_id)
        self._count(self._live_slots(t), -1)
        self._total_live -= t.n_live

    def reset_slots(self, req_id: str) -> None:
        """Preemption: slots become -1, block counts go, liveness bits stay."""
        t = self._tables[req_id]
        self._count(self._live_slots(t), -1)
        t.slot[: t.n_slotted] = -1
        t.n_slotted = 0

    # ------------------------------------------------------------ mutations
    def append(self, req_id: str, slots: np.ndarray) -> None:
        """Gives slots to the next `len(slots)` logical tokens after the slotted ones.

        Tokens past the known length are new and live; tokens already known
        (re-synced after `reset_slots`) keep their liveness bit.

        Args:
            req_id: A registered request.
            slots: Integer [n], distinct, each in [0, num_blocks * block_size).
        """
        t = self._tables[req_id]
        s = self._as_slots(slots, "slots")
        if s.size == 0:
            return
        start, end = t.n_slotted, t.n_slotted + s.size
        self._reserve(t, end)
        t.slot[start:end] = s
        if end > t.n_tokens:
            first_new = max(start, t.n_tokens)
            t.live[first_new:end] = True
            t.n_live += end - first_new
            self._total_live += end - first_new
            t.n_tokens = end
        self._count(s[t.live[start:end]], +1)
        t.n_slotted = end

    def evict(self, req_id: str, idx: np.ndarray) -> np.ndarray:
        """Marks tokens dead: flips their bits and leaves their blocks' counts.

        Evicting no tokens is a no-op.

        Args:
            req_id: A registered request.
            idx: Integer [n] logical indices, distinct, live, in [0, num_slotted).

        Returns:
            int64 [n]: the evicted indices, sorted.
        """
        t = self._tables[req_id]
        i = self._as_idx(t, idx)
        if i.size == 0:
            return i
        assert t.live[i].all(), f"{req_id!r}: tokens {i[~t.live[i]][:8]} already dead"
        t.live[i] = False
        self._count(t.slot[i], -1)
        t.n_live -= i.size
        self._total_live -= i.size
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
        r's moves are entries [indptr[r], indptr[r + 1]): token idx[j] moves to
        dst_slots[j]. A token that died after the move was planned still gets
        its new slot, but is counted in no block. Requests that left the pool
        (finished), have no slots (preempted) or are not in `keep` are skipped.

        Args:
            req_ids: The batch's requests.
            indptr: int [R + 1] CSR into idx and dst_slots.
            idx: int [M] logical indices, distinct per request.
            dst_slots: int [M] slots, distinct.
            keep: Optional bool [R]: False skips that request's moves.
        """
        assert len(indptr) == len(req_ids) + 1 and len(idx) == len(dst_slots)
        for r, req_id in enumerate(req_ids):
            t = self._tables.get(req_id)
            if t is None or t.n_slotted == 0 or (keep is not None and not keep[r]):
                continue
            lo, hi = indptr[r], indptr[r + 1]
            i = self._as_idx(t, idx[lo:hi], sort=False)
            ns = self._as_slots(dst_slots[lo:hi], "dst_slots")
            live = t.live[i]
            self._count(t.slot[i][live], -1)
            self._count(ns[live], +1)
            t.slot[i] = ns

    # ------------------------------------------------------------ queries
    def num_tokens(self, req_id: str) -> int:
        return self._tables[req_id].n_tokens

    def num_slotted(self, req_id: str) -> int:
        return self._tables[req_id].n_slotted

    def num_live(self, req_id: str) -> int:
        """Live tokens of the request, slotted or not (O(1))."""
        return self._tables[req_id].n_live

    def has_dead(self, req_id: str) -> bool:
        """Whether any known token of the request is dead (O(1))."""
        t = self._tables[req_id]
        return t.n_live < t.n_tokens

    def total_live(self) -> int:
        """Live tokens over all requests (O(1))."""
        return self._total_live

    def live_idx(self, req_id: str) -> np.ndarray:
        """int64: logical indices of slotted live tokens, ascending."""
        t = self._tables[req_id]
        return np.flatnonzero(t.live[: t.n_slotted])

    def live_slots(self, req_id: str) -> np.ndarray:
        """int64: slots of `live_idx(req_id)`, same order."""
        t = self._tables[req_id]
        return self._live_slots(t).astype(np.int64)

    def dead_idx(self, req_id: str) -> np.ndarray:
        """int64: logical indices of dead tokens (slotted or not), ascending."""
        t = self._tables[req_id]
        return np.flatnonzero(~t.live[: t.n_tokens])

    def slots(self, req_id: str) -> np.ndarray:
        """int32 view [num_slotted] of the slot map (do not write to it)."""
        t = self._tables[req_id]
        return t.slot[: t.n_slotted]

    def request_ids(self) -> list[str]:
        return list(self._tables)

    # ------------------------------------------------------------ invariants
    def check_integrity(self, block_ref_cnt: np.ndarray | None = None) -> None:
        """Recounts both views from the tables and checks every invariant.

        Args:
            block_ref_cnt: Optional int [num_blocks] reference counts from the
                block pool. With it, a live slot may appear in two requests only
                if its block is shared (ref > 1), and no live token may sit in a
                block with ref 0. Without it, no live slot may appear twice.

        Raises:
            AssertionError: Naming the violated invariant.
        """
        B, total, owned = self.block_size, 0, []
        for rid, t in self._tables.items():
            cap = t.slot.size
            assert 0 <= t.n_slotted <= t.n_tokens <= cap == t.live.size, (
                f"{rid}: lengths slotted={t.n_slotted} tokens={t.n_tokens} cap={cap}"
            )
            s = t.slot[: t.n_slotted]
            assert ((s >= 0) & (s < self.num_slots)).all(), f"{rid}: slot out of range"
            assert (t.slot[t.n_slotted :] == -1).all(), (
                f"{rid}: slot other than -1 past num_slotted"
            )
            assert not t.live[t.n_tokens :].any(), f"{rid}: live bit past num_tokens"
            n_live = int(np.count_nonzero(t.live[: t.n_tokens]))
            assert n_live == t.n_live, f"{rid}: live counter {t.n_live} != {n_live}"
            total += n_live
            ls = self._live_slots(t)
            assert np.unique(ls).size == ls.size, f"{rid}: a slot used twice"
            owned.append(ls.astype(np.int64))
        assert total == self._total_live, (
            f"total live counter {self._total_live} != recount {total}"
        )
        slots = np.concatenate(owned) if owned else np.zeros(0, np.int64)
        recount = np.bincount(slots // B, minlength=self.num_blocks)
        bad = np.flatnonzero(recount != self.block_live)
        assert bad.size == 0, (
            f"block_live != recount from tables at blocks {bad[:8].tolist()}: "
            f"{self.block_live[bad[:8]].tolist()} vs {recount[bad[:8]].tolist()}"
        )
        uniq, counts = np.unique(slots, return_counts=True)
        shared = uniq[counts > 1]
        if block_ref_cnt is None:
            assert shared.size == 0, f"slots owned by two requests: {shared[:8]}"
            return
        ref = np.asarray(block_ref_cnt)
        assert (ref[shared // B] > 1).all(), (
            f"slots owned twice in unshared blocks: {shared[ref[shared // B] <= 1][:8]}"
        )
        orphan = np.flatnonzero((self.block_live > 0) & (ref[: self.num_blocks] <= 0))
        assert orphan.size == 0, f"live tokens in free blocks {orphan[:8].tolist()}"

    # ------------------------------------------------------------ internals
    def _live_slots(self, t: _Table) -> np.ndarray:
        return t.slot[: t.n_slotted][t.live[: t.n_slotted]]

    def _count(self, slots: np.ndarray, delta: int) -> None:
        # The one place block_live changes (C1): every caller passes the slots of
        # live tokens only.
        if slots.size:
            np.add.at(self.block_live, slots // self.block_size, delta)

    def _reserve(self, t: _Table, n: int) -> None:
        if n <= t.slot.size:
            return
        cap = max(n, 2 * t.slot.size)
        slot = np.full(cap, -1, dtype=np.int32)
        live = np.zeros(cap, dtype=bool)
        slot[: t.slot.size] = t.slot
        live[: t.live.size] = t.live
        t.slot, t.live = slot, live

    def _as_slots(self, slots: np.ndarray, what: str) -> np.ndarray:
        s = _as_index(slots, what)
        if integrity.CHECK and s.size:
            assert 0 <= s.min() and s.max() < self.num_slots, (
                f"{what} outside [0, {self.num_slots})"
            )
            assert np.unique(s).size == s.size, f"{what} holds a slot twice"
        return s

    def _as_idx(self, t: _Table, idx: np.ndarray, sort: bool = True) -> np.ndarray:
        i = _as_index(idx, "idx")
        if sort:
            i = np.sort(i)
        if integrity.CHECK and i.size:
            s = i if sort else np.sort(i)
            assert 0 <= s[0] and s[-1] < t.n_slotted, (
                f"token index outside [0, {t.n_slotted})"
            )
            assert (np.diff(s) != 0).all(), "idx holds a token twice"
        return i
