# SPDX-License-Identifier: Apache-2.0
"""A plug-in eviction policy, as a separate package would ship one.

Its `vtoken_oldest-0.1.dist-info/entry_points.txt` (the layout pip installs)
declares it in the `vtoken.policies` group; tests/conftest.py puts this folder
on sys.path, and the end-to-end test on the engine's PYTHONPATH. Nothing in
vLLM or the overlay names it.
"""

import numpy as np

from vllm.vtoken.policies.base import EvictionPolicy, RequestView


class OldestFirstPolicy(EvictionPolicy):
    """Evicts the oldest evictable tokens (a recency window, no sinks)."""

    name = "oldest"

    def evict_token(self, req: RequestView, num_evict: int) -> np.ndarray:
        return req.live_idx[req.evictable][:num_evict]
