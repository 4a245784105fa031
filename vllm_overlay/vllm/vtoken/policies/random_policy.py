# SPDX-License-Identifier: Apache-2.0
"""Random eviction policy adapter (scheduler side)."""

from __future__ import annotations

import numpy as np

from vllm.vtoken.arena import indptr_of
from vllm.vtoken.policies import base, selection


@base.register_policy
class RandomPolicy(base.EvictionPolicy):
    """Uniform random eviction among evictable tokens: the baseline.

    The random-eviction baseline of the H2O paper (Zhang et al. 2023, arXiv
    2306.14048). Draws are a hash of the request's seed (seeding.request_seed:
    runtime seed, stable hash of its key), the token and the step,
    so a run is reproducible whatever the batch order: the lowest draws go,
    except where one victim goes (a decode step's), drawn by its position
    among the evictable tokens, so that the one-pass eviction
    (eviction_kernels.evict_lowest) hashes no token. Needs no scores and has
    no knobs (the seed belongs to the runtime).
    """

    name = "random"
    scatters_victims = True

    def lowest_rule(self, req_ids):
        return base.LowestRule("hash")

    def evict_batch(self, batch: base.BatchView, num_evict: np.ndarray):
        # A draw per token, keyed by the request's seed and its newest token
        # (so each step draws afresh): the lowest draws go, a uniform choice.
        newest = np.r_[batch.live_idx, 0][batch.indptr[1:] - 1]  # (0: none)
        key = selection.hash_uniform(
            batch.seeds[batch.seg], batch.live_idx, newest[batch.seg]
        )
        nothing = np.zeros(batch.seg.size, dtype=bool)
        counts, idx = selection.lowest_batch(batch, num_evict, key, nothing)
        # One victim (a decode step's): as uniform a choice, one draw of its
        # position among the request's evictable tokens, keyed by their
        # number. The one-pass eviction then hashes no token (a hash each
        # was O(budget) a request a step: at 1,024 requests of 512 live,
        # 1.65 -> 0.52 ms by hand, caches flushed).
        num_ev = np.bincount(batch.seg[batch.evictable], minlength=counts.size)
        one = (np.minimum(np.asarray(num_evict).reshape(-1), num_ev) == 1).nonzero()[0]
        if one.size:
            m = num_ev[one]
            u = selection.hash_uniform(batch.seeds[one], m, newest[one])
            pos = np.minimum((u * m).astype(np.int64), m - 1)
            ev_idx = batch.live_idx[batch.evictable]
            idx[indptr_of(counts)[one]] = ev_idx[indptr_of(num_ev)[one] + pos]
        return counts, idx
