# SPDX-License-Identifier: Apache-2.0
"""StreamingLLM eviction policy adapter (scheduler side)."""

from __future__ import annotations

import numpy as np

from vllm.vtoken.policies import base, selection


@base.register_policy
class StreamingLLMPolicy(base.EvictionPolicy):
    """Attention sinks plus a sliding window of the most recent tokens.

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
    ICLR 2024, arXiv 2309.17453. The first `num_sinks` logical tokens are kept;
    every other evictable token goes oldest first, so the live set is the sinks
    plus the most recent (budget - num_sinks) tokens. Needs no scores.

    Knobs:
        num_sinks: attention-sink tokens (logical positions 0..num_sinks-1),
            an int in [0, budget); default 4, as in the paper.
    """

    name = "streamingllm"
    defaults = {"num_sinks": 4}

    def _validate(self) -> None:
        self.num_sinks = self._int_below_budget("num_sinks", 0, "the sinks are kept")

    def lowest_rule(self, req_ids):
        return base.LowestRule("index", sinks=self.num_sinks)

    def evict_batch(self, batch: base.BatchView, num_evict: np.ndarray):
        sinks = batch.live_idx < self.num_sinks
        return selection.lowest_batch(batch, num_evict, batch.live_idx, sinks)
