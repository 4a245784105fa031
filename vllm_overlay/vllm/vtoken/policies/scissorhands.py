# SPDX-License-Identifier: Apache-2.0
"""Scissorhands eviction policy adapter (scheduler side)."""

from __future__ import annotations

import numpy as np

from vllm.vtoken.policies import base, selection


@base.register_policy
class ScissorhandsPolicy(base.EvictionPolicy):
    """Keep pivotal tokens, by the persistence of importance.

    Liu et al. 2023, arXiv 2305.17118. A token is important at a step when its
    attention probability (mean over layers, heads, queries) is >= 1/t, t =
    keys attended. Outside a recent window, evict the tokens unimportant most
    often in the last w steps: the worker keeps a moving average of importance
    over w steps (`ScoreAccumulator`, window w), which from zero has seen
    1 - (1 - 1/w)^age of its weight (age: steps since the token came, or since
    a preemption restarted the scores), so the count is min(age, w) * (1 -
    score / that). Ties go oldest first.

    Knobs:
        recent_ratio: recent window r as a fraction of the budget, in [0, 1];
            default 0.1 (our choice: the paper leaves r a hyper-parameter).
        history_window: w, in steps, >= 1; default 400 (our choice).
    """

    name = "scissorhands"
    score_mode = "persistence"
    defaults = {"recent_ratio": 0.1, "history_window": 400}

    def _validate(self) -> None:
        self.recent = round(self._ratio("recent_ratio") * self.budget)
        self.window = self.score_window = self._int("history_window", 1)
        self._born = selection.ArrivalSteps()

    def sync_batch(self, req_ids, num_new, view=None) -> None:
        self._born.add(req_ids, num_new)

    def sync_new_tokens(self, req: base.RequestView, num_new: int) -> None:
        self._born.add([req.req_id], [num_new])

    def lowest_rule(self, req_ids):
        ages = self._born.arena_of(req_ids)  # None: one never synced
        rule = base.LowestRule("persistence", self.recent, 0, self.window, ages)
        return None if ages is None else rule

    def evict_batch(self, batch: base.BatchView, num_evict: np.ndarray):
        if batch.scores is None:
            raise ValueError("scissorhands needs persistence scores")
        age = self._born.age(batch)
        seen = 1.0 - (1.0 - 1.0 / self.window) ** age
        rate = np.minimum(batch.scores / seen, 1.0)
        unimportant = np.minimum(age, self.window) * (1.0 - rate)
        protected = selection.recent_batch(batch, self.recent)
        return selection.lowest_batch(batch, num_evict, -unimportant, protected)

    def reset_scores(self, req_id: str) -> None:
        self._born.restart(req_id)  # else old tokens' rates read as ~0

    def release(self, req_id: str) -> None:
        self._born.forget(req_id)
