# SPDX-License-Identifier: Apache-2.0
"""vToken's scheduler side: policies, dead-block freeing and compaction planning.

`VTokenScheduler` is what the patched `Scheduler` calls. It owns the Token Tables
and turns them into block-pool operations, using vLLM's own precedent for freeing
a block in the middle of a request (sliding window's `remove_skipped_blocks`):

    req_to_blocks[rid]  = [b7, b3, b9, b4, b12]      positional: token i is in [i // B]
    after compaction    = [b7, null, null, b4, b12]  b3, b9 emptied and freed; their
                                                     live tokens moved into holes
                                                     of b7 and b4

Compaction is in place (planner.py): live tokens move into the request's own
dead slots, so block tables stay positional and append-only for vLLM; only
prefix-cached blocks are evacuated, into fresh blocks the pool can spare.

Per step, for the whole batch at once (docs/DESIGN.md §7.1):
  begin_step   policies evict over budget; blocks left with no live token are
               freed at once (that alone is the paper's Naive-Evict);
  end_step     the step's new tokens get their slots; in vtoken mode the planner
               moves the live tokens of under-used blocks into holes;
  on_output    the worker's scores and acks: `apply_moves` switches each copied
               batch's tokens to their new slots, frees the emptied sources.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from itertools import chain, compress, repeat, starmap
from operator import attrgetter, eq
from typing import TYPE_CHECKING

import numpy as np

from vllm.vtoken import integrity
from vllm.vtoken.arena import (
    attrs,
    block_spans,
    picked,
    span_slots,
    spans_of,
    values,
)
from vllm.vtoken.config import UNBOUNDED_BUDGET
from vllm.vtoken.eviction import EvictionRuntime
from vllm.vtoken.messages import VTokenStep, VTokenWorkerOutput
from vllm.vtoken.policies import create_policy
from vllm.vtoken.reclaimer import BlockReclaimer
from vllm.vtoken.request_args import request_evictions
from vllm.vtoken.request_state import RequestState
from vllm.vtoken.scores import ScoreAccumulator
from vllm.vtoken.seeding import prompt_key
from vllm.vtoken.stats import VTokenCounters, VTokenStats, stats_of, timed
from vllm.vtoken.token_table import TokenTablePool

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request
    from vllm.vtoken.config import VTokenConfig


class VTokenScheduler:
    """Scheduler-side vToken state for one engine (one KV-cache group)."""

    def __init__(
        self,
        cfg: VTokenConfig,
        kv_cache_manager: KVCacheManager,
        block_size: int,
        requests: dict[str, Request],
    ) -> None:
        groups = len(kv_cache_manager.coordinator.single_type_managers)
        if groups != 1:  # e.g. layers of two KV shapes; config.py refuses most
            raise ValueError(
                f"vToken does not support {groups} KV cache groups (layers with "
                "different KV specs): a request's Token Table follows one block "
                "list; start without --kv-eviction-policy"
            )
        self.cfg = cfg
        self._requests = requests  # the scheduler's own map, read only
        self.block_size = block_size
        self.block_pool = kv_cache_manager.block_pool
        self.pool = TokenTablePool(
            self.block_pool.num_gpu_blocks, block_size, positional_lists=True
        )
        # The engine's policy sets the scores the worker computes; its budget
        # (None: evict only requests that ask, request_args.py) is the default.
        policy = create_policy(
            cfg.kv_eviction_policy,
            cfg.kv_budget_tokens or UNBOUNDED_BUDGET,
            cfg.policy_knobs(),
        )
        # The running scores, folded from each step's ScoreStep (on_output).
        self._scores = scores = ScoreAccumulator.of_policy(policy)
        self._persistence = scores is not None and scores.mode == "persistence"
        self.runtime = EvictionRuntime(
            self.pool,
            policy,
            cfg.kv_budget_tokens,
            seed=cfg.seed,
            score_source=scores.scores if scores else None,
            score_batch=scores.scores_rows if scores else None,
            score_arena=scores.arena_of if scores else None,
        )
        self._reqs: dict[str, RequestState] = {}
        # Requests a step must visit, so that it visits those only: with
        # recomputed dead tokens (RequestState.recomputed_dead); whose blocks
        # vLLM may still cache (new or resumed: caching stops at their first
        # dead token); due for planning: a block's worth dead since planned
        # and of holes (`pool.plan_due`; packing frees a block only with a
        # block's worth of holes, so at most about once per B evictions).
        self._recomputing: list[str] = []
        self._caching: set[str] = set()
        self._plan_due: set[str] = set()
        # This step's evictions (request ids, counts, idx), for VTokenStep.
        self._step_dead: list[tuple[list[str], np.ndarray, np.ndarray]] = []
        # Batches scheduled, outputs taken; request -> the last batch whose
        # gains for it are not folded: those in flight when it was preempted
        # (PP's batch queue), and, for persistence scores, a resume's chunks
        # before its last (`_sync_slots`).
        self._num_steps = self._num_outputs = 0
        self._stale: dict[str, int] = {}
        # The last step's scheduled requests, which on_output compares with
        # the worker's tables under integrity checks (check_worker).
        self._step_rids: dict[str, int] | None = None
        # integrity: the step's slots, counts and written counts (check_step)
        self._step_slots = _NO_STEP_SLOTS
        # The last batch each step hook saw (arena.BatchMemo): the running
        # requests (begin_step), the scheduled ones (_sync_slots).
        self._running = self.pool.memo()
        self._scheduled = self.pool.memo()
        # Requests freed so far, and as of the last eviction: end_step checks
        # its dead lists for finished requests only when some finished since.
        self._num_freed = self._freed_at_evict = 0
        self._freed_by_step: deque[int] = deque()  # _num_freed as each step
        # was scheduled, until its output: on_output folds scores of the
        # known requests only when one was freed since
        self.counters = VTokenCounters()
        self._last_counters = VTokenCounters()
        self.reclaimer = BlockReclaimer(
            self.pool, kv_cache_manager, cfg.kv_reclaim_threshold, self.counters
        )

    @property
    def scores(self) -> ScoreAccumulator | None:  # None: no policy reads any
        return self._scores

    # ------------------------------------------------------------ step hooks
    @timed("scheduler_ns")
    def begin_step(self, running: Iterable[Request]) -> None:
        """Enforce budgets on running requests; free blocks left fully dead."""
        pool, recomputing, self._recomputing = self.pool, self._recomputing, []
        for rid in recomputing:
            rec = self._reqs.get(rid)
            if rec is None or rec.recomputed_dead is None:
                continue  # finished since
            if pool.num_slotted(rid) > 0:
                dead = rec.recomputed_dead
                seg = np.zeros(dead.size, np.int64)
                self.reclaimer.free_empty_blocks([rid], seg, dead)
            rec.recomputed_dead = None
        # Never evict during a (chunked) prefill or a resume's recompute, nor
        # before the table knows the tokens (done means every prompt token
        # was attended and every known one slotted again), nor while its last
        # step is in flight (PP's batch queue schedules the next batch first:
        # that step's scores are not in yet).
        running = list(running)
        rids, rows, prompt = self._running.get(running, self._running_rows)
        if integrity.CHECK:
            # A running request's computed tokens are its slotted ones: vLLM
            # added last step's to both (and a preemption reset both).
            known = rows >= 0
            attended = pool.num_slotted_rows(rows)[known]
            assert (attended == attrs(running, _COMPUTED)[known]).all(), (
                "a running request's computed tokens are not its slotted ones"
            )
        limit = _NO_LIMIT
        if self._num_outputs < self._num_steps or integrity.CHECK:
            # A batch in flight (PP's batch queue): a request whose last step's
            # output is not in has as many tokens as computed; skip it (limit).
            # Otherwise every running request past its prefill has one more.
            # (len: without Request.num_tokens's Python property.)
            limit = np.fromiter(map(len, map(_ALL_TOKENS, running)), np.int64)
            assert not integrity.CHECK or limit.tolist() == [
                r.num_tokens for r in running
            ], "Request.num_tokens is no longer len(Request._all_token_ids)"
            assert (
                self._num_outputs < self._num_steps
                or not ((rows >= 0) & (pool.num_slotted_rows(rows) >= limit)).any()
            ), "a request's last output is missing with no batch in flight"
        if not self._step_dead:  # else as of the first (before_preempting_all)
            self._freed_at_evict = self._num_freed
        ok, which, counts, idx = self.runtime.evict_running(rids, rows, prompt, limit)
        if self._caching:
            # `ok` is mostly True: compress over its list (arena.picked is
            # for masks with few set).
            for rid in self._caching.intersection(compress(rids, ok.tolist())):
                if pool.has_dead(rid):
                    self.reclaimer.stop_caching(rid)
                    self._caching.discard(rid)
        if not which.size:
            return
        # `which` ascends: as long as rids, it is every request.
        ids = rids if which.size == len(rids) else [rids[i] for i in which.tolist()]
        self._step_dead.append((ids, counts, idx))
        self.counters.evicted_tokens += int(idx.size)
        rows = rows[which]
        # Blocks whose last live token just died are freed; then the planner
        # is due for the requests left with a block's worth of holes.
        self.reclaimer.free_empty_blocks(ids, pool.evicted_runs(counts), idx, rows)
        if self.cfg.compaction:
            self._plan_due.update(picked(ids, pool.plan_due(rows)))

    @timed("scheduler_ns")
    def end_step(self, so: SchedulerOutput) -> VTokenStep | None:
        """Slot this step's tokens, plan compaction, build the worker's message."""
        self._num_steps += 1
        self._freed_by_step.append(self._num_freed)
        self._step_rids = so.num_scheduled_tokens
        self._step_slots = _NO_STEP_SLOTS
        reslotting = self._sync_slots(so.num_scheduled_tokens)
        moves = None
        # Not a request re-slotting known tokens (resumed): its worker resets
        # its row at the step's start, before the batch's copy lands, and
        # skips the switch (move_rows); planned when slotted on both sides.
        due = self._plan_due - reslotting if reslotting else self._plan_due
        if self.cfg.compaction and due:
            t0 = time.perf_counter_ns()
            moves = self.reclaimer.plan(
                due, self._reqs, self._requests, so.num_scheduled_tokens
            )
            self.counters.planner_ns += time.perf_counter_ns() - t0
            self.counters.plan_calls += 1
            # Still due: a block's worth of holes left (in C: filter).
            left = list(filter(self._reqs.__contains__, self._plan_due))
            due = self.pool.plan_due(self.pool.rows(left))
            self._plan_due = set(picked(left, due))
        if integrity.CHECK:  # the forward against the copies, this plan's too
            self.reclaimer.check_step(self._reqs, *self._step_slots)
        chunks, self._step_dead = self._step_dead, []
        if not chunks and moves is None:
            return None
        if len(chunks) == 1:  # the usual step: one eviction, used as it is
            ((ids, counts, idx),) = chunks
            ids = list(ids)  # c[0] may be memoized: the message's own list
        else:
            ids = list(chain.from_iterable(c[0] for c in chunks))  # c[0]: memoized
            counts = np.concatenate([c[1] for c in chunks] + [np.zeros(0, np.int64)])
            idx = np.concatenate([c[2] for c in chunks] + [np.zeros(0, np.int64)])
        if self._num_freed != self._freed_at_evict and not all(
            map(self._reqs.__contains__, ids)
        ):  # finished since: aborted after a reset's eviction (before_preempting_all)
            gone = [r not in self._reqs for r in ids]
            keep = ~np.asarray(gone)
            idx = idx[np.repeat(keep, counts)]
            ids, counts = (
                [r for r, g in zip(ids, gone, strict=True) if not g],
                counts[keep],
            )
        return VTokenStep(
            dead_req_ids=ids,
            dead_indptr=self.pool.offsets(counts),
            dead_idx=idx,
            moves=moves,
        )

    @timed("scheduler_ns")
    def on_output(self, out: VTokenWorkerOutput | None) -> None:
        """Take the worker's scores and apply its acknowledged move batches."""
        k = self._num_outputs = self._num_outputs + 1  # batch k's output
        stale = _NONE  # usually: no request freed with a step in flight
        if self._stale:
            stale = {r for r, n in self._stale.items() if n >= k}
            self._stale = {r: n for r, n in self._stale.items() if n > k}
        freed = self._freed_by_step.popleft() if self._freed_by_step else -1
        if out is None:
            return
        if out.scores is not None and self._scores is not None:
            # Batch k's requests are all known still, unless one was freed
            # since it was scheduled: then only the known ones fold.
            known = self._reqs.keys() - stale if stale else self._reqs
            if not stale and freed == self._num_freed:
                known = None
            self._scores.fold(out.scores.received(), known=known)
        self.counters.copy_bytes = out.copy_bytes
        self.counters.worker_ns = out.host_ns
        for batch_id in out.acked_batches:
            self.apply_moves(batch_id)
        if integrity.CHECK:
            self.check_integrity()
            worker = integrity.worker_pool(self.cfg)  # in this process: one rank
            if worker is not None and self._step_rids is not None:
                integrity.check_worker(self.pool, worker, self._step_rids)

    def apply_moves(self, batch_id: int) -> None:
        """The paper's `apply_moves`: the worker has copied batch `batch_id`,
        so its tokens switch to their new slots and the emptied sources go
        back to the pool (requests that finished or were preempted meanwhile
        dropped their part already)."""
        moves = self.reclaimer.pop_batch(batch_id)
        batch = moves.batch
        # The loops in C (map): a request gone since has no state (None).
        recs = list(map(self._reqs.get, batch.req_ids))
        waiting = map(getattr, recs, repeat("move_batch"), repeat(None))
        keep = np.fromiter(map(eq, waiting, repeat(batch_id)), bool, len(recs))
        self.pool.apply_moves(
            batch.req_ids, batch.indptr, batch.idx, batch.dst_slots, keep=keep
        )
        moved = batch.indptr[1:] - batch.indptr[:-1]
        self.counters.moved_tokens += int(np.add.reduce(moved[keep]))
        self.reclaimer.release_sources(moves, recs, keep)

    def on_allocated(self, req: Request, num_hit_tokens: int) -> None:
        """After vLLM allocated a waiting request's blocks (caching the full
        ones); `num_hit_tokens`: its prefix-cache hits. A resumed request
        with a dead token recomputes without it: nothing from that token's
        block on may be cached (BlockReclaimer.stop_caching_resumed); called
        before the next waiting request looks for hits."""
        rid = req.request_id
        if rid not in self._caching or rid not in self._reqs:  # new: no dead
            return
        dead = self.pool.dead_idx(rid)
        if dead.size:
            keep = int(dead[0]) // self.block_size
            self.reclaimer.stop_caching_resumed(
                rid, num_hit_tokens // self.block_size, keep
            )
            self._caching.discard(rid)

    def before_preempting_all(self, running: list[Request]) -> None:
        """vLLM's reset_prefix_cache(reset_running_requests=True) preempts
        every running request between steps. A preemption in schedule() finds
        a request evicted to its budget by that step's `begin_step`; here its
        last output has come in since, and nothing evicted it: its resume
        would recompute budget + 2 live tokens. The step-start eviction now
        (its dead list reaches the worker with the next step, as on_preempt
        keeps it); the next `begin_step` finds these requests waiting."""
        self.begin_step(running)

    def on_preempt(self, req: Request) -> None:
        """Before vLLM frees a preempted request's blocks. Goes: the slots
        (its blocks are freed next), the scores (they restart with the slots),
        in-flight moves, the freed-block count. Stays: the logical dead set,
        this step's dead list (the worker must learn it) and the count since
        the last plan."""
        rec = self._reqs.get(req.request_id)
        if rec is None:
            return
        self.pool.reset_slots(req.request_id)
        self._scheduled.clear()  # its resume has a new block list
        self._caching.add(req.request_id)  # its resume caches blocks again
        self.runtime.reset_scores(req.request_id)
        if self._scores is not None:  # they restart with the slots
            self._scores.release(req.request_id)
            self._stale[req.request_id] = self._num_steps
        self.reclaimer.drop_moves(req.request_id, rec)
        self.reclaimer.free_left_behind(req.request_id)
        self.reclaimer.blocks.reset(req.request_id)
        self.pool.clear_nulls(req.request_id)

    def on_free(self, req: Request) -> None:
        """Before vLLM frees a finished or aborted request."""
        rec = self._reqs.pop(req.request_id, None)
        if rec is None:
            return
        self._num_freed += 1
        self._caching.discard(req.request_id)
        self._plan_due.discard(req.request_id)
        # Its moves first: undoing an evacuation finds the fresh block in the
        # list's mirror, which the Token Table row holds (BlockIndex).
        self.reclaimer.drop_moves(req.request_id, rec)
        self.runtime.release(req.request_id)
        self.reclaimer.free_left_behind(req.request_id)
        if self._scores is not None:
            self._scores.release(req.request_id)

    # ------------------------------------------------------------ internals
    def _running_rows(self, running: list[Request]) -> tuple:
        """begin_step's per-request constants: ids, rows (-1: none yet) and
        prompt lengths (`BatchMemo`: read again only when the batch changes)."""
        rids = list(map(_REQ_ID, running))
        return rids, self.pool.rows_or_missing(rids), attrs(running, _PROMPT)

    def _scheduled_rows(self, rids: list[str]) -> tuple:
        """_sync_slots's: the requests, their rows (a new one registered) and
        block lists (vLLM's, appended to in place; a resume makes a new one)."""
        reqs = values(self._requests, rids)
        rows = self.pool.rows_adding(
            rids, lambda new: self._register(values(self._requests, new))
        )
        return reqs, rows, values(self.reclaimer.req_to_blocks, rids)

    def _sync_slots(self, scheduled: dict[str, int]) -> frozenset[str]:
        """Give the scheduled requests' tokens [num_slotted, computed +
        scheduled) their positional slots, the batch at once: compiled
        passes, and vLLM's block objects read only for blocks past each
        request's tail (one request in B at decode). Returns the requests
        that re-slot known tokens (resumed), usually none."""
        if not scheduled:
            return _NONE
        pool = self.pool
        rids = list(scheduled)
        reqs, rows, blocks = self._scheduled.get(rids, self._scheduled_rows)
        take = counts = np.fromiter(scheduled.values(), np.int64, len(rids))
        resumed, fresh, need, first, end = pool.slot_spans(rows, take)
        if resumed:  # re-slots dead tokens too: rare, the general path
            return self._sync_slots_general(rids, reqs, rows, blocks, counts)
        if fresh.size:  # new: their prefix-cache hits are computed, not slotted
            hits = attrs(list(map(reqs.__getitem__, fresh.tolist())), _COMPUTED)
            if hits.any():
                take = counts.copy()
                take[fresh] += hits
                _, _, need, first, end = pool.slot_spans(rows, take)
        assert (
            not integrity.CHECK
            or (
                pool.num_slotted_rows(rows) + take == attrs(reqs, _COMPUTED) + counts
            ).all()
        ), "a scheduled request's computed tokens are not its slotted ones"
        ids = _NO_IDS
        if need.size:
            lists = map(blocks.__getitem__, need.tolist())
            ids = np.fromiter(
                map(_BLOCK_ID, spans_of(lists, first.tolist(), end.tolist())), np.int64
            )
        slots = pool.positional_slots(rows, take, ids)
        if integrity.CHECK:
            self._check_tail_blocks(rows, take, blocks, slots)
            self._step_slots = (slots, take, counts)
        self.runtime.sync_rows(rids, take, slots, rows)
        if need.size:
            self.reclaimer.blocks.record(rows[need], first, end, ids)
        return _NONE

    def _check_tail_blocks(self, rows, take, blocks, slots) -> None:
        # The tail block's id is the last slotted token's: vLLM's lists agree.
        B, start = self.block_size, self.pool.num_slotted_rows(rows)
        want = [
            x.block_id * B + t % B
            for b, s, n in zip(blocks, start.tolist(), take.tolist(), strict=True)
            for t in range(s, s + n)
            for x in (b[t // B],)
        ]
        assert slots.tolist() == want, "a tail block's id is not vLLM's"

    def _sync_slots_general(self, rids, reqs, rows, blocks, scheduled) -> frozenset:
        """`_sync_slots` of a batch with a resumed request (preempted, so
        recomputing known tokens, dead ones included); returns those."""
        B, pool = self.block_size, self.pool
        start, total = pool.num_slotted_rows(rows), pool.num_tokens_rows(rows)
        # Computed tokens are slotted ones, but where none are: a new or
        # resumed request, whose prefix-cache hits are computed and not slotted.
        upto = start.copy()
        fresh = (start == 0).nonzero()[0]
        if fresh.size:
            upto[fresh] = attrs(list(map(reqs.__getitem__, fresh.tolist())), _COMPUTED)
        assert not integrity.CHECK or (upto == attrs(reqs, _COMPUTED)).all(), (
            "a scheduled request's computed tokens are not its slotted ones"
        )
        upto += scheduled
        resumed = ((start < total) & (upto > start)).nonzero()[0].tolist()
        for i in resumed:
            self._recompute_dead(rids[i], int(start[i]), int(upto[i]))
            if upto[i] <= total[i] and self._persistence:
                # A chunk before the recompute's last: persistence scores skip
                # its step, so that the resume scores as one step (its last
                # chunk, which reads every token) and the ages, which count it
                # as one (ArrivalSteps.restart), agree with them.
                self._stale[rids[i]] = self._num_steps
        reslotting = frozenset(rids[i] for i in resumed)
        grow = upto > start
        if not grow.all():
            if not grow.any():
                return reslotting
            rids = [r for r, g in zip(rids, grow.tolist(), strict=True) if g]
            rows, start, upto = rows[grow], start[grow], upto[grow]
        # Each request's blocks [first, end), as one flat list of block ids.
        counts = upto - start
        first, end = block_spans(start, counts, B)
        if not grow.all():
            blocks = list(compress(blocks, grow.tolist()))
        spans = spans_of(blocks, first.tolist(), end.tolist())
        ids = np.fromiter(map(_BLOCK_ID, spans), np.int64)
        assert ids.size == (end - first).sum(), "a block list is too short"
        slots = span_slots(ids, start, counts, B)
        if integrity.CHECK:
            self._step_slots = (slots, counts, scheduled[grow])
        self.runtime.sync_rows(rids, counts, slots, rows)
        self.reclaimer.blocks.record(rows, first, end, ids)
        return reslotting

    def _register(self, reqs: list[Request]) -> None:
        """First sight of the step's new requests, at once: a state, a
        generator's key (the prompt's) and a policy each. Their own keys
        were checked by the front end (check_request_args)."""
        rids = list(map(_REQ_ID, reqs))
        states = starmap(RequestState, repeat((), len(rids)))
        self._reqs.update(zip(rids, states, strict=True))
        self._caching.update(rids)
        evicts = request_evictions(list(map(_SAMPLING, reqs)), self.cfg)
        self.runtime.register_many(rids, list(map(prompt_key, reqs)), evicts)

    def _recompute_dead(self, rid: str, start: int, upto: int) -> None:
        # Resumed after preemption: dead tokens in [start, upto) get
        # recomputed too; their blocks may be freed after that forward.
        rec = self._reqs[rid]
        dead = self.pool.dead_idx(rid)
        dead = dead[(dead >= start) & (dead < upto)]
        if dead.size:
            if rec.recomputed_dead is None:
                self._recomputing.append(rid)
            rec.recomputed_dead = dead
            rows = self.pool.rows([rid])
            self.pool.mark_rows(rows, recounted=np.array([dead.size]))
            if self.cfg.compaction and self.pool.plan_due(rows)[0]:
                self._plan_due.add(rid)

    # ------------------------------------------------------------ metrics
    def make_stats(self, running: Iterable[Request]) -> VTokenStats:
        """Gauges over running requests, counters since the last call."""
        delta, self._last_counters = self.counters.growth_since(self._last_counters)
        blocks = self.reclaimer.req_to_blocks
        return stats_of(self.block_size, running, self._reqs, blocks, self.pool, delta)

    # ------------------------------------------------------------ invariants
    def check_integrity(self) -> None:
        """docs/DESIGN.md §4, across the Token Tables and vLLM's block pool."""
        integrity.check_blocks(
            self.pool,
            self.block_pool,
            self.reclaimer.req_to_blocks,
            self.reclaimer.detached(self._reqs),
        )
        self.reclaimer.check_busy(self._reqs)
        self.reclaimer.check_nulls(list(self._reqs))
        self.reclaimer.blocks.check(list(self._reqs))


_COMPUTED = attrgetter("num_computed_tokens")
_NO_IDS = np.zeros(0, np.int64)
_NO_LIMIT = np.zeros(0, np.int64)  # evict_running: every last output is in
_NO_STEP_SLOTS = (_NO_IDS,) * 3  # integrity's check_step: nothing slotted
_NONE: frozenset[str] = frozenset()  # _sync_slots: none re-slots
_PROMPT = attrgetter("num_prompt_tokens")
_ALL_TOKENS = attrgetter("_all_token_ids")
_REQ_ID = attrgetter("request_id")
_SAMPLING = attrgetter("sampling_params")
_BLOCK_ID = attrgetter("block_id")
