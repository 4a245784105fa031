# SPDX-License-Identifier: Apache-2.0
"""vToken's numbers: running counters (scheduler side) and the per-interval
`VTokenStats` that rides on vLLM's SchedulerStats to the metric loggers.

Counters are plain integers bumped where the event happens; gauges come from
per-request figures the scheduler already keeps (O(requests) per stats call,
never a scan of Token Tables or block lists).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, fields

import numpy as np


@dataclass(slots=True)
class VTokenCounters:
    evicted_tokens: int = 0  # tokens marked dead by the policy
    reclaimed_blocks: int = 0  # blocks returned to the pool (dead or compacted)
    moved_tokens: int = 0  # tokens whose KV moved to a new slot (acknowledged)
    deferred_plans: int = 0  # compactions held back by a copy still in flight
    copy_bytes: int = 0  # KV bytes written by acknowledged moves
    planner_ns: int = 0  # CPU time spent planning compaction
    plan_calls: int = 0  # steps that ran the planner
    evacuated_blocks: int = 0  # prefix-cached blocks emptied, freed with their hash
    tight_plans: int = 0  # plans that wrote cached blocks: no fresh ones to spare
    scheduler_ns: int = 0  # wall time inside the scheduler's per-step hooks
    worker_ns: int = 0  # the same inside the worker's (its running total)

    def growth_since(
        self, last: VTokenCounters
    ) -> tuple[VTokenCounters, VTokenCounters]:
        """(delta, reported): what each counter grew by since `last` (what was
        reported so far), never below 0, and the new `last`. A metric counter
        only grows, and prometheus_client raises on a negative increment;
        reclaimed_blocks is a net count that may dip: an evacuation's fresh
        blocks are taken off when acknowledged, and a source it displaced that
        a prefix-cache hit took meanwhile does not come back then. The dip is
        reported as 0 and caught up by later growth."""
        now = [getattr(self, f.name) for f in fields(self)]
        was = [getattr(last, f.name) for f in fields(self)]
        return (
            VTokenCounters(*(max(0, n - w) for n, w in zip(now, was, strict=True))),
            VTokenCounters(*map(max, now, was)),
        )


@dataclass
class VTokenStats:
    """One stats interval. Gauges are instantaneous; counters are deltas."""

    # live tokens / token slots of the blocks running requests hold
    token_utilization: float = 0.0
    # the paper's F: dead (evicted) slots / slots of the blocks held
    intra_block_waste: float = 0.0
    # blocks held by running requests
    retained_blocks: int = 0
    live_tokens: int = 0
    evicted_tokens: int = 0
    reclaimed_blocks: int = 0
    moved_tokens: int = 0
    deferred_plans: int = 0
    copy_bytes: int = 0


def timed(counter: str):
    """Method decorator: adds the call's wall time to `self.counters.<counter>`
    (the per-step hooks' host time, which scripts/bench_vtoken.py scale reads)."""

    def wrap(fn):
        @functools.wraps(fn)
        def hook(self, *args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn(self, *args, **kwargs)
            finally:
                c = self.counters
                setattr(c, counter, getattr(c, counter) + time.perf_counter_ns() - t0)

        return hook

    return wrap


def stats_of(block_size, running, reqs, req_to_blocks, pool, delta) -> VTokenStats:
    """A stats interval over the running requests vToken tracks that hold
    blocks, from per-request arrays: positional blocks, null-replaced ones,
    computed and live tokens; `delta`: the counters since the last one."""
    running = [
        r for r in running if r.request_id in reqs and req_to_blocks.get(r.request_id)
    ]
    rids = [r.request_id for r in running]
    n = len(rids)
    blocks = np.fromiter((len(req_to_blocks[r]) for r in rids), np.int64, n)
    rows = pool.rows(rids)
    nulls = pool.num_nulls_rows(rows)
    computed = np.fromiter((r.num_computed_tokens for r in running), np.int64, n)
    live = pool.num_live_rows(rows)
    # A resume recomputing in chunks: its live tokens not slotted again hold
    # no slot yet (the liveness bits outlive the preemption).
    resuming = (pool.num_slotted_rows(rows) < pool.num_tokens_rows(rows)).nonzero()[0]
    if resuming.size:
        seg, _, _ = pool.live_tokens(rows[resuming])
        live[resuming] = np.bincount(seg, minlength=resuming.size)
    B = block_size
    held = blocks - nulls
    # Compaction moves tokens into written slots only (holes), so the written
    # slots are the positional ones minus the freed blocks.
    written = np.minimum(computed, blocks * B) - nulls * B
    slots, live_sum = int(held.sum()) * B, int(live.sum())
    return VTokenStats(
        token_utilization=live_sum / slots if slots else 0.0,
        intra_block_waste=int(written.sum() - live_sum) / slots if slots else 0.0,
        retained_blocks=int(held.sum()),
        live_tokens=live_sum,
        evicted_tokens=delta.evicted_tokens,
        reclaimed_blocks=delta.reclaimed_blocks,
        moved_tokens=delta.moved_tokens,
        deferred_plans=delta.deferred_plans,
        copy_bytes=delta.copy_bytes,
    )
