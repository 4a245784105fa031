# SPDX-License-Identifier: Apache-2.0
"""SnapKV eviction policy adapter (scheduler side)."""

from __future__ import annotations

import numpy as np

from vllm.vtoken.policies import base, selection


@base.register_policy
class SnapKVPolicy(base.EvictionPolicy):
    """Keep what the prompt's last queries look at, pooled along the sequence.

    Li et al., "SnapKV: LLM Knows What You Are Looking For Before Generation",
    NeurIPS 2024, arXiv 2404.14469. The prefill's last `window` queries score
    every prompt token by the attention they give it ("window" scores); the
    first eviction (the end of the prefill) pools those scores along the
    sequence, so neighbours of a hit survive too, and keeps the top ones plus
    the window. Decode is H2O's rule: each decode query adds its attention, the
    lowest go first outside the window.

    Knobs: window (observation and recent window, tokens, in [1, budget);
    default 32, the paper's), kernel_size (odd; default 5) and pooling ("avg",
    default, or "max"), both as in the reference code.
    """

    name = "snapkv"
    score_mode = "window"
    defaults = {"window": 32, "kernel_size": 5, "pooling": "avg"}

    def _validate(self) -> None:
        # Room for the prompt's top tokens too (the reference asserts it).
        self.window = self._int_below_budget("window", 1, "it is kept whole")
        self.score_query_window = self.window
        self.kernel = self._int("kernel_size", 1)
        self.pooling = self.knobs["pooling"]
        if self.kernel % 2 == 0 or self.pooling not in ("avg", "max"):
            raise ValueError(f"snapkv: kernel_size odd, pooling avg/max: {self.knobs}")
        self._pooled: set[str] = set()  # requests past their first eviction

    def lowest_rule(self, req_ids):  # decode, every request pooled: H2O's
        pooled = all(map(self._pooled.__contains__, req_ids))
        return base.LowestRule("score", recent=self.window) if pooled else None

    def evict_batch(self, batch: base.BatchView, num_evict: np.ndarray):
        if batch.scores is None:
            raise ValueError("snapkv needs observation-window attention scores")
        key = batch.scores.astype(np.float64)
        first = [r not in self._pooled for r in batch.req_ids]
        protected = selection.recent_batch(batch, self.window)
        if any(first):  # the end of their prefill: pool the window's scores
            self._pooled.update(set(batch.req_ids).difference(self._pooled))
            # The prefix's votes only, as the reference pools attn[..., :-w]
            # (zero-padded): the window's own, kept anyway, would lift the
            # prefix tokens next to it.
            pooled = selection.pool_along(
                batch, key, self.kernel, self.pooling, protected
            )
            key = np.where(np.asarray(first)[batch.seg], pooled, key)
        return selection.lowest_batch(batch, num_evict, key, protected)

    def reset_scores(self, req_id: str) -> None:
        self._pooled.discard(req_id)  # the resume is a prefill again

    def release(self, req_id: str) -> None:
        self._pooled.discard(req_id)
