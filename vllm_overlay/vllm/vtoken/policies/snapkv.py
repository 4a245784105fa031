# SPDX-License-Identifier: Apache-2.0
"""SnapKV eviction policy adapter (scheduler side)."""

from __future__ import annotations

import numpy as np

from vllm.vtoken.policies import base


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

    Knobs: window (observation and recent window, tokens, >= 1; default 32, the
    paper's), kernel_size (odd; default 5) and pooling ("avg", default, or
    "max"), both as in the reference code.
    """

    name = "snapkv"
    score_mode = "window"
    defaults = {"window": 32, "kernel_size": 5, "pooling": "avg"}

    def _validate(self) -> None:
        self.window = self.score_query_window = self._int("window", 1)
        self.kernel = self._int("kernel_size", 1)
        self.pooling = self.knobs["pooling"]
        if self.kernel % 2 == 0 or self.pooling not in ("avg", "max"):
            raise ValueError(
                "snapkv: kernel_size must be odd and pooling 'avg' or 'max', "
                f"got {self.kernel} and {self.pooling!r}"
            )
        self._pooled: set[str] = set()  # requests past their first eviction

    def evict_token(self, req: base.RequestView, num_evict: int) -> np.ndarray:
        if req.scores is None:
            raise ValueError("snapkv needs observation-window attention scores")
        key = req.scores.astype(np.float64)
        if req.req_id not in self._pooled:  # the end of the prefill
            self._pooled.add(req.req_id)
            pad = np.pad(key, self.kernel // 2, constant_values=-np.inf)
            windows = np.lib.stride_tricks.sliding_window_view(pad, self.kernel)
            if self.pooling == "max":
                key = windows.max(axis=1)
            else:  # zero padding at the ends, as avg_pool1d counts it
                key = np.where(np.isinf(windows), 0.0, windows).mean(axis=1)
        protected = base.recent_mask(req, self.window)
        return base.select_lowest(req, num_evict, key, protected)

    def reset_scores(self, req_id: str) -> None:
        self._pooled.discard(req_id)  # the resume is a prefill again

    def release(self, req_id: str) -> None:
        self._pooled.discard(req_id)
