# SPDX-License-Identifier: Apache-2.0
"""Random eviction policy adapter (scheduler side)."""

from __future__ import annotations

import numpy as np

from vllm.vtoken.policies import base


@base.register_policy
class RandomPolicy(base.EvictionPolicy):
    """Uniform random eviction among evictable tokens: the baseline.

    The random-eviction baseline of the H2O paper (Zhang et al. 2023, arXiv
    2306.14048). Draws come from the view's per-request generator, seeded from
    (runtime seed, stable hash of req_id), so a run is reproducible whatever
    the batch order. Needs no scores and has no knobs (the seed belongs to the
    runtime).
    """

    name = "random"

    def evict_token(self, req: base.RequestView, num_evict: int) -> np.ndarray:
        candidates = req.live_idx[req.evictable]
        n = min(num_evict, candidates.size)
        pick = req.rng.choice(candidates.size, size=n, replace=False)
        return np.sort(candidates[pick]).astype(np.int64)
