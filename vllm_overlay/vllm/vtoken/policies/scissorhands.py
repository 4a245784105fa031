# SPDX-License-Identifier: Apache-2.0
"""Scissorhands eviction policy adapter (scheduler side)."""

from __future__ import annotations

import numpy as np

from vllm.vtoken.policies import base


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
        self._state: dict[str, tuple[int, np.ndarray, int]] = {}  # step, born, n

    def sync_new_tokens(self, req: base.RequestView, num_new: int) -> None:
        step, born, n = self._state.get(req.req_id, (0, np.zeros(0, np.int64), 0))
        if n + num_new > born.size:  # grow by doubling; only [0, n) is read
            born = np.resize(born, max(2 * born.size, n + num_new))
        born[n : n + num_new] = step + 1
        self._state[req.req_id] = (step + 1, born, n + num_new)

    def evict_token(self, req: base.RequestView, num_evict: int) -> np.ndarray:
        if req.scores is None:
            raise ValueError("scissorhands needs persistence scores")
        step, born, _ = self._state[req.req_id]
        age = step - born[req.live_idx] + 1
        seen = 1.0 - (1.0 - 1.0 / self.window) ** age
        rate = np.minimum(req.scores / seen, 1.0)
        unimportant = np.minimum(age, self.window) * (1.0 - rate)
        protected = base.recent_mask(req, self.recent)
        return base.select_lowest(req, num_evict, -unimportant, protected)

    def reset_scores(self, req_id: str) -> None:
        if req_id in self._state:  # else old tokens' rates read as ~0
            step, born, n = self._state[req_id]
            born[:n] = step

    def release(self, req_id: str) -> None:
        self._state.pop(req_id, None)
