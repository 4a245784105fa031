# SPDX-License-Identifier: Apache-2.0
"""H2O eviction policy adapter (scheduler side)."""

from __future__ import annotations

import numpy as np

from vllm.vtoken.policies import base, selection


@base.register_policy
class H2OPolicy(base.EvictionPolicy):
    """Heavy-Hitter Oracle: keep heavy hitters plus a recent window.

    Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference
    of Large Language Models", NeurIPS 2023, arXiv 2306.14048. A token's score
    is its attention probability accumulated over every query that has attended
    it, averaged over layers and heads ("sum" mode of `ScoreAccumulator`;
    unitless, one query contributes at most 1). Outside the recent window, the
    lowest-scoring evictable tokens go first (ties: the oldest).

    Knobs:
        recent_ratio: fraction of the budget kept as the recent window, in
            [0, 1]; default 0.5 (the paper's equal heavy/recent split).
    """

    name = "h2o"
    score_mode = "sum"
    defaults = {"recent_ratio": 0.5}

    def _validate(self) -> None:
        self.recent = round(self._ratio("recent_ratio") * self.budget)

    def lowest_rule(self, req_ids):
        return base.LowestRule("score", recent=self.recent)

    def evict_batch(self, batch: base.BatchView, num_evict: np.ndarray):
        if batch.scores is None:
            raise ValueError("h2o needs accumulated attention scores")
        protected = selection.recent_batch(batch, self.recent)
        return selection.lowest_batch(batch, num_evict, batch.scores, protected)
