# SPDX-License-Identifier: Apache-2.0
"""vToken's scheduler side: policies, dead-block freeing and compaction planning.

`VTokenScheduler` is what the patched `Scheduler` calls. It owns the Token Tables
and turns them into block-pool operations, using vLLM's own precedent for freeing
a block in the middle of a request (sliding window's `remove_skipped_blocks`):

    req_to_blocks[rid]  = [b7, b3, b9, b4, b12]      positional: token i is in [i // B]
    after compaction    = [b7, null, null, b4, b12]  b3, b9 emptied and freed; their
                                                     live tokens moved into holes
                                                     of b7 and b4

Compaction is in place (see planner.py): live tokens move into the request's own
dead slots, so block tables stay positional and append-only for vLLM, and a
plan never takes a block from the pool.

Per step (all in the scheduler process, before the worker runs):
  begin_step   policies evict over budget; blocks left with no live token are
               freed at once (that alone is the paper's Naive-Evict);
  end_step     the step's new tokens get their slots; in vtoken mode the planner
               moves the live tokens of under-used blocks into holes;
  on_output    the worker acknowledged a move batch: tokens switch to their new
               slots and the emptied source blocks go back to the pool.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from vllm.vtoken.eviction import EvictionRuntime
from vllm.vtoken.messages import MoveBatch, VTokenStep, VTokenWorkerOutput
from vllm.vtoken.planner import BlockPlan, pack_request, plan_blocks
from vllm.vtoken.policies import create_policy
from vllm.vtoken.stats import VTokenCounters, VTokenStats
from vllm.vtoken.token_table import TokenTablePool

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request
    from vllm.vtoken.config import VTokenConfig

CHECK_INTEGRITY = os.environ.get("VTOKEN_CHECK_INTEGRITY", "0") == "1"


class VTokenScheduler:
    """Scheduler-side vToken state for one engine (one KV-cache group)."""

    def __init__(
        self,
        cfg: VTokenConfig,
        kv_cache_manager: KVCacheManager,
        block_size: int,
        requests: dict[str, Request],
    ) -> None:
        self.cfg = cfg
        self._requests = requests  # the scheduler's own map, read only
        self.block_size = block_size
        self.block_pool = kv_cache_manager.block_pool
        # Dense models have exactly one group (checked in VTokenConfig).
        self._type_mgr = kv_cache_manager.coordinator.single_type_managers[0]
        num_blocks = self.block_pool.num_gpu_blocks
        self.pool = TokenTablePool(num_blocks, block_size)
        policy = create_policy(
            cfg.kv_eviction_policy, cfg.kv_budget_tokens, cfg.policy_knobs()
        )
        self._scores = None
        self.runtime = EvictionRuntime(
            self.pool,
            policy,
            cfg.kv_budget_tokens,
            seed=cfg.seed,
            score_source=self._read_scores if policy.score_mode else None,
        )
        # batch_id -> (move batch, {req_id: source blocks}); a request with a
        # batch in flight is not planned again, and the blocks of in-flight
        # batches (sources and destinations) are not freed, until it is acked.
        self._inflight: dict[int, tuple[MoveBatch, dict[str, list[KVCacheBlock]]]] = {}
        self._busy: dict[int, int] = {}  # block_id -> batch_id
        self._next_batch_id = 0
        self._dead: dict[str, list[np.ndarray]] = {}
        # Tokens evicted since a request was last considered for compaction.
        # Packing frees a block only once a block's worth of slots is dead, so
        # a request is planned when this reaches block_size: the planner runs
        # about once per block_size evictions, not every step.
        self._dead_since_plan: dict[str, int] = {}
        # Dead tokens a resumed request recomputes this step, by request: their
        # blocks may be freed once the forward that rewrites them has run.
        self._recomputed_dead: dict[str, np.ndarray] = {}
        self.counters = VTokenCounters()
        self._last_counters = VTokenCounters()
        # For the gauges, kept as blocks change hands (not scanned per step):
        self._nulls: dict[str, int] = {}  # positional blocks freed, by request

    # ------------------------------------------------------------ step hooks
    def begin_step(self, running: Iterable[Request]) -> None:
        """Enforce budgets on running requests; free blocks left fully dead."""
        for rid, dead in self._recomputed_dead.items():
            if rid in self.pool and self.pool.num_slotted(rid) > 0:
                self._free_empty_blocks(rid, dead)
        self._recomputed_dead = {}
        for req in running:
            rid = req.request_id
            # Never evict during a (chunked) prefill, nor before the table knows
            # the tokens (prefill done means every prompt token was attended).
            if rid not in self.pool or req.num_computed_tokens < req.num_prompt_tokens:
                continue
            dead = self.runtime.enforce_budget(rid, req.num_computed_tokens)
            if dead.size == 0:
                continue
            self._dead.setdefault(rid, []).append(dead)
            n = self._dead_since_plan.get(rid, 0)
            self._dead_since_plan[rid] = n + dead.size
            self.counters.evicted_tokens += int(dead.size)
            self._free_empty_blocks(rid, dead)

    def end_step(self, so: SchedulerOutput) -> VTokenStep | None:
        """Slot this step's tokens, plan compaction, build the worker's message."""
        for rid, n in so.num_scheduled_tokens.items():
            self._sync_slots(rid, self._requests[rid].num_computed_tokens + n)
        moves = None
        if self.cfg.compaction and any(
            n >= self.block_size for n in self._dead_since_plan.values()
        ):
            t0 = time.perf_counter_ns()
            moves = self._plan(so)
            self.counters.planner_ns += time.perf_counter_ns() - t0
            self.counters.plan_calls += 1
        dead = {rid: np.concatenate(d) for rid, d in self._dead.items()}
        self._dead = {}
        if not dead and moves is None:
            return None
        return VTokenStep(dead=dead, moves=moves)

    def on_output(self, out: VTokenWorkerOutput | None) -> None:
        """Switch acknowledged moves to their new slots; free the sources."""
        if out is None:
            return
        if out.scores is not None:
            self._scores = out.scores
        self.counters.copy_bytes = out.copy_bytes
        for batch_id in out.acked_batches:
            batch, sources = self._inflight.pop(batch_id)
            self._unbusy(batch_id, np.unique(batch.dst_slots // self.block_size))
            for rid, idx, _, dst in batch.per_request():
                blocks = sources.get(rid)
                if blocks is None:  # finished or preempted while in flight
                    continue
                self.pool.remap(rid, idx, dst)
                self._unbusy(batch_id, [b.block_id for b in blocks])
                self._release_blocks(rid, blocks)
                self.counters.moved_tokens += int(idx.size)
        if CHECK_INTEGRITY:
            self.check_integrity()

    def on_preempt(self, req: Request) -> None:
        """Before vLLM frees a preempted request: keep its logical dead set."""
        rid = req.request_id
        if rid in self.pool:
            self.pool.reset_slots(rid)
        self._drop_blocks(rid)
        self._dead.pop(rid, None)

    def on_free(self, req: Request) -> None:
        """Before vLLM frees a finished or aborted request."""
        rid = req.request_id
        if rid in self.pool:
            self.runtime.release(rid)
        self._drop_blocks(rid)
        self._dead.pop(rid, None)
        self._dead_since_plan.pop(rid, None)
        self._recomputed_dead.pop(rid, None)

    # ------------------------------------------------------------ internals
    def _read_scores(self, slots: np.ndarray) -> np.ndarray:
        if self._scores is None:  # no forward has run yet
            return np.zeros(len(slots), dtype=np.float32)
        return self._scores.scores(slots)

    def _positional(self, rid: str) -> list[KVCacheBlock]:
        return self._type_mgr.req_to_blocks[rid]

    def _sync_slots(self, rid: str, upto: int) -> None:
        """Give tokens [num_slotted, upto) their positional slots."""
        start = self.pool.num_slotted(rid) if rid in self.pool else 0
        if upto <= start:
            return
        if rid in self.pool and start < self.pool.num_tokens(rid):
            # Resumed after preemption: dead tokens get recomputed too.
            dead = self.pool.dead_idx(rid)
            dead = dead[(dead >= start) & (dead < upto)]
            if dead.size:
                self._recomputed_dead[rid] = dead
                n = self._dead_since_plan.get(rid, 0)
                self._dead_since_plan[rid] = n + dead.size
        B = self.block_size
        first, last = start // B, (upto - 1) // B
        ids = np.fromiter(
            (b.block_id for b in self._positional(rid)[first : last + 1]),
            dtype=np.int64,
            count=last - first + 1,
        )
        pos = np.arange(start, upto, dtype=np.int64)
        slots = ids[pos // B - first] * B + pos % B
        key = None
        if rid not in self.pool:
            # Same prompt and seed, same random draws, whatever the request id.
            prompt = np.asarray(self._requests[rid].prompt_token_ids, np.int64)
            key = hashlib.sha256(prompt.tobytes()).hexdigest()
        self.runtime.sync_new_tokens(rid, slots, rng_key=key)

    def _free_empty_blocks(self, rid: str, dead: np.ndarray) -> None:
        """Free blocks of `rid` whose last live token just died (Naive-Evict)."""
        B = self.block_size
        # Only blocks every token of which has been written: a block still
        # being filled (e.g. by a chunked recompute) may get live tokens yet.
        dead = dead[dead < self.pool.num_slotted(rid) // B * B]
        slots = self.pool.slots(rid)[dead]
        empty = {int(b) for b in np.unique(slots // B) if self.pool.block_live[b] == 0}
        empty -= self._busy.keys()
        if not empty:
            return
        blocks = self._held_blocks(rid, empty)
        self._release_blocks(rid, blocks)

    def _held_blocks(self, rid: str, ids: set[int]) -> list[KVCacheBlock]:
        """The request's own (unshared) blocks among `ids`."""
        return [
            b
            for b in self._positional(rid)
            if b.block_id in ids and not b.is_null and b.ref_cnt == 1
        ]

    def _release_blocks(self, rid: str, blocks: list[KVCacheBlock]) -> None:
        """Null-replace `blocks` of `rid` in its block table, then free them."""
        if not blocks:
            return
        ids = {b.block_id for b in blocks}
        positional = self._positional(rid)
        null = self.block_pool.null_block
        for i, b in enumerate(positional):
            if b.block_id in ids and not b.is_null:
                positional[i] = null
                self._nulls[rid] = self._nulls.get(rid, 0) + 1
        self.block_pool.free_blocks(blocks)
        self.counters.reclaimed_blocks += len(blocks)

    def _drop_blocks(self, rid: str) -> None:
        """Forget the in-flight moves of `rid`; vLLM frees its blocks next.

        The worker waits for a finished or preempted request's copies before
        the step runs (VTokenWorker.begin_step), so the blocks may be reused.
        """
        for batch_id, (batch, sources) in self._inflight.items():
            blocks = sources.pop(rid, None)
            if blocks is None:
                continue
            self._unbusy(batch_id, [b.block_id for b in blocks])
            for r, _, _, dst in batch.per_request():
                if r == rid:
                    self._unbusy(batch_id, np.unique(dst // self.block_size))
        self._nulls.pop(rid, None)

    def _unbusy(self, batch_id: int, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            if self._busy.get(int(b)) == batch_id:
                del self._busy[int(b)]

    def _plan(self, so: SchedulerOutput) -> MoveBatch | None:
        """In-place compaction of under-used blocks (planner.py)."""
        B = self.block_size
        busy_reqs = {rid for _, sources in self._inflight.values() for rid in sources}
        rids, indptr, cand = [], [0], []
        for rid, n in list(self._dead_since_plan.items()):
            req = self._requests.get(rid)
            if n < B or req is None or rid not in so.num_scheduled_tokens:
                continue  # considered once it runs with a block's worth dead
            if rid in busy_reqs:
                # Its last batch is still copying (GPU side stream): its slots
                # switch when that completes, so plan on the settled state.
                self.counters.deferred_plans += 1
                continue
            self._dead_since_plan[rid] = 0
            # Full blocks written before this step; the tail is being filled.
            nfull = req.num_computed_tokens // B
            cand.extend(
                b.block_id
                for b in self._positional(rid)[:nfull]
                if not b.is_null and b.ref_cnt == 1
            )
            rids.append(rid)
            indptr.append(len(cand))
        if not cand:
            return None
        block_ids = np.asarray(cand, dtype=np.int32)
        plan = plan_blocks(
            req_indptr=np.asarray(indptr, dtype=np.int64),
            block_ids=block_ids,
            block_live=self.pool.block_live[block_ids],
            block_size=B,
            threshold=self.cfg.kv_reclaim_threshold,
        )
        if len(plan.req_index) == 0:
            return None
        return self._bind(plan, rids)

    def _bind(self, plan: BlockPlan, rids: list[str]) -> MoveBatch | None:
        """Turn a block plan into slot moves; free blocks that need none."""
        B = self.block_size
        by_id = self.block_pool.blocks
        batch_id = self._next_batch_id
        out_rids, indptr, idx, src, dst = [], [0], [], [], []
        sources: dict[str, list[KVCacheBlock]] = {}
        for k, r in enumerate(plan.req_index):
            rid = rids[r]
            src_ids = plan.src_block_ids[plan.src_indptr[k] : plan.src_indptr[k + 1]]
            m = pack_request(
                live_idx=self.pool.live_idx(rid),
                live_slots=self.pool.live_slots(rid),
                src_block_ids=src_ids,
                dst_block_ids=plan.dst_block_ids[
                    plan.dst_indptr[k] : plan.dst_indptr[k + 1]
                ],
                block_size=B,
            )
            src_blocks = [by_id[int(b)] for b in src_ids]
            if m.idx.size == 0:  # every token already dead: free right away
                self._release_blocks(rid, src_blocks)
                continue
            sources[rid] = src_blocks
            dst_ids = np.unique(m.dst_slots // B).tolist()
            # A destination's content changes: it must leave the prefix cache
            # (sources keep theirs intact, so a later hit on them stays valid).
            self.block_pool.evict_blocks(set(dst_ids))
            self._busy.update((int(b), batch_id) for b in src_ids)
            self._busy.update((b, batch_id) for b in dst_ids)
            out_rids.append(rid)
            idx.append(m.idx)
            src.append(m.src_slots)
            dst.append(m.dst_slots)
            indptr.append(indptr[-1] + m.idx.size)
        if not out_rids:
            return None
        batch = MoveBatch(
            batch_id=batch_id,
            req_ids=out_rids,
            indptr=np.asarray(indptr, dtype=np.int64),
            idx=np.concatenate(idx),
            src_slots=np.concatenate(src),
            dst_slots=np.concatenate(dst),
        )
        self._inflight[batch_id] = (batch, sources)
        self._next_batch_id += 1
        return batch

    # ------------------------------------------------------------ metrics
    def make_stats(self, running: Iterable[Request]) -> VTokenStats:
        """Gauges over running requests, counters since the last call."""
        B = self.block_size
        held = written = live = 0
        for req in running:
            rid = req.request_id
            positional = self._type_mgr.req_to_blocks.get(rid)
            if not positional or rid not in self.pool:
                continue
            nulls = self._nulls.get(rid, 0)
            held += len(positional) - nulls
            # Compaction moves tokens into written slots only (holes), so the
            # written slots are the positional ones minus the freed blocks.
            written += min(req.num_computed_tokens, len(positional) * B) - nulls * B
            live += self.pool.num_live(rid)
        delta = self.counters.minus(self._last_counters)
        self._last_counters = self.counters.copy()
        slots = held * B
        return VTokenStats(
            token_utilization=live / slots if slots else 0.0,
            intra_block_waste=(written - live) / slots if slots else 0.0,
            retained_blocks=held,
            live_tokens=live,
            evicted_tokens=delta.evicted_tokens,
            reclaimed_blocks=delta.reclaimed_blocks,
            moved_tokens=delta.moved_tokens,
            deferred_plans=delta.deferred_plans,
            copy_bytes=delta.copy_bytes,
        )

    # ------------------------------------------------------------ invariants
    def check_integrity(self) -> None:
        """DESIGN.md §4, across the Token Tables and vLLM's block pool."""
        ref = np.fromiter((b.ref_cnt for b in self.block_pool.blocks), dtype=np.int64)
        self.pool.check_integrity(block_ref_cnt=ref)
        B = self.block_size
        holders = np.zeros_like(ref)
        for rid, blocks in self._type_mgr.req_to_blocks.items():
            ids = [b.block_id for b in blocks if not b.is_null]
            np.add.at(holders, np.asarray(ids, dtype=np.int64), 1)
            if rid in self.pool:
                held = np.zeros(len(ref), dtype=bool)
                held[ids] = True
                live_blocks = self.pool.live_slots(rid) // B
                assert held[live_blocks].all(), (
                    f"request {rid}: a live token sits in a block it does not hold"
                )
        holders[0] = ref[0]  # the null block's ref_cnt is not maintained
        assert (holders == ref).all(), (
            "block ref counts differ from the holders: "
            f"{np.flatnonzero(holders != ref)[:8].tolist()}"
        )
        free = self.block_pool.get_num_free_blocks()
        assert free + int((ref[1:] > 0).sum()) == len(ref) - 1, (
            f"free ({free}) + held != total ({len(ref) - 1})"
        )
