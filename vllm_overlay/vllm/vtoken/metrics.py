# SPDX-License-Identifier: Apache-2.0
"""Prometheus metrics of vToken, next to vllm:kv_cache_usage_perc.

Front-end side (where vLLM's PrometheusStatLogger runs). Built like vLLM's
SpecDecodingProm: the logger hands over its metric classes and labels, and
`observe` is called with each SchedulerStats.vtoken_stats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.vtoken.stats import VTokenStats

GAUGES = {
    "token_utilization": (
        "vllm:kv_token_utilization",
        "Live tokens / token slots of the KV blocks running requests hold.",
    ),
    "intra_block_waste": (
        "vllm:kv_intra_block_waste",
        "Intra-block waste F: evicted (dead) slots / slots of the blocks held.",
    ),
    "retained_blocks": (
        "vllm:kv_retained_blocks",
        "KV blocks held by running requests, summed over them (a block "
        "prefix caching shares counts once per request holding it).",
    ),
}
COUNTERS = {
    "evicted_tokens": ("vllm:kv_evicted_tokens", "Tokens evicted by the policy."),
    "reclaimed_blocks": (
        "vllm:kv_reclaimed_blocks",
        "KV blocks returned to the pool by eviction or compaction.",
    ),
    "moved_tokens": ("vllm:kv_moved_tokens", "Tokens moved by compaction."),
    "deferred_plans": (
        "vllm:kv_reclaim_deferred",
        "Compactions of requests with a block's worth of holes, held back "
        "while the request's last move batch was copying.",
    ),
    "copy_bytes": ("vllm:kv_copy_bytes", "KV bytes written by compaction moves."),
}


class VTokenProm:
    """The vToken gauges and counters, one child per engine."""

    def __init__(
        self,
        gauge_cls,
        counter_cls,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        self.gauges = {}
        for field, (name, doc) in GAUGES.items():
            g = gauge_cls(
                name=name,
                documentation=doc,
                multiprocess_mode="mostrecent",
                labelnames=labelnames,
            )
            self.gauges[field] = {
                idx: g.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        self.counters = {}
        for field, (name, doc) in COUNTERS.items():
            c = counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self.counters[field] = {
                idx: c.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, stats: VTokenStats, engine_idx: int = 0) -> None:
        for field, children in self.gauges.items():
            children[engine_idx].set(getattr(stats, field))
        for field, children in self.counters.items():
            children[engine_idx].inc(getattr(stats, field))
