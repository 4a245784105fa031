# SPDX-License-Identifier: Apache-2.0
"""Running counters of vToken, read into vLLM's SchedulerStats (scheduler side).

Kept as plain integers the runtime bumps where the event happens, so reading
them costs nothing per step; gauges come from the Token Table's O(1) totals.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class VTokenCounters:
    evicted_tokens: int = 0  # tokens marked dead by the policy
    reclaimed_blocks: int = 0  # blocks returned to the pool (dead or compacted)
    moved_tokens: int = 0  # tokens whose KV moved to a new slot (acknowledged)
    deferred_plans: int = 0  # requests whose compaction the margin held back
    copy_bytes: int = 0  # KV bytes written by acknowledged moves
