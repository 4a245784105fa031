# SPDX-License-Identifier: Apache-2.0
"""Scissorhands eviction policy adapter (scheduler side)."""

from __future__ import annotations

import numpy as np

from vllm.vtoken.policies import base


@base.register_policy
class ScissorhandsPolicy(base.EvictionPolicy):
    """Keep pivotal tokens, by the persistence of importance.

    Liu et al., "Scissorhands: Exploiting the Persistence of Importance
    Hypothesis for LLM KV Cache Compression at Test Time", NeurIPS 2023, arXiv
    2305.17118. A token is important at a step when its attention probability
    (mean over layers, heads and queries) is >= 1/t, t = keys attended: the
    paper's uniform-attention threshold; the score is the number of steps it
    was important ("persistence" mode of `ScoreAccumulator`). The paper evicts,
    outside a recent window, the tokens that were unimportant most often in the
    last w steps. One counter per slot cannot window exactly, so we estimate that
    count as min(age, w) * (1 - important / age), age = steps since the token
    arrived (one `sync_new_tokens` call per step). Ties go oldest first.

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
        self.window = self._int("history_window", 1)
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
        rate = np.minimum(req.scores / age, 1.0)
        unimportant = np.minimum(age, self.window) * (1.0 - rate)
        protected = base.recent_mask(req, self.recent)
        return base.select_lowest(req, num_evict, -unimportant, protected)

    def release(self, req_id: str) -> None:
        self._state.pop(req_id, None)
