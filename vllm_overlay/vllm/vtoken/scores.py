# SPDX-License-Identifier: Apache-2.0
"""Per-slot attention-score accumulation for score-based eviction policies.

Worker side (written by the attention path); the scheduler reads it through
`ScoreAccumulator.scores`. `VTokenWorkerOutput.scores` is a handle to it, not a
snapshot (see messages.py). Scores are indexed by physical slot, so compaction
moves them with the tokens (`move`) and a slot's next owner starts from zero
(`reset`).

Per step and request: `add` once per layer with the attention mass each key
received, then `finish_step` once to fold the step into the running score:

    "sum"          acc += mass / (num_layers * num_heads)         (H2O)
    "persistence"  imp = 1 if mass / (norm * num_queries) >= 1 / num_keys
                   (the token was important this step; Scissorhands), then
                   acc += (imp - acc) / window: the moving average of imp
                   over `window` steps (acc += imp without a window)
"""

from __future__ import annotations

import numpy as np
import torch

SCORE_MODES = ("sum", "persistence")


class ScoreAccumulator:
    """Running attention scores, one float32 per physical slot."""

    def __init__(
        self,
        num_slots: int,
        mode: str,
        device: str | torch.device = "cpu",
        window: int | None = None,
    ) -> None:
        """Allocates zeroed buffers.

        Args:
            num_slots: num_blocks * block_size.
            mode: "sum" (accumulated attention mass) or "persistence" (how
                often the token was important).
            device: Where the buffers live (the KV cache's device).
            window: "persistence": average importance over this many steps
                (>= 1); None counts the steps.
        """
        assert mode in SCORE_MODES and num_slots > 0, (mode, num_slots)
        assert window is None or (mode == "persistence" and window >= 1), window
        self.mode = mode
        self.window = window
        self.device = torch.device(device)
        self.acc = torch.zeros(num_slots, dtype=torch.float32, device=self.device)
        self._step = torch.zeros_like(self.acc)  # this step's mass, not yet folded

    def add(self, slots: torch.Tensor, attn_mass: torch.Tensor) -> None:
        """Adds one layer's attention mass to the step buffer.

        Args:
            slots: int [n] key slots.
            attn_mass: float [n] probability mass each key received this layer,
                summed over heads and query rows.
        """
        self._step.index_add_(
            0, self._idx(slots), attn_mass.to(self.device, torch.float32)
        )

    def finish_step(
        self,
        slots: torch.Tensor,
        num_queries: torch.Tensor | int,
        norm: float,
        num_keys: torch.Tensor | int | None = None,
    ) -> None:
        """Folds the step buffer of `slots` into the running score; zeroes it.

        Args:
            slots: int [n] slots of the keys attended this step, distinct (one
                request, or a flat batch of requests).
            num_queries: Query rows of the step: an int, or int [n] per slot.
            norm: num_layers * num_heads (> 0).
            num_keys: Keys each query attended (the 1/t threshold of
                "persistence"): an int or int [n] per slot; default len(slots),
                right for one request.
        """
        assert norm > 0, norm
        idx = self._idx(slots)
        mass = self._step[idx]
        if self.mode == "sum":
            gain = mass / norm
        else:
            keys = idx.numel() if num_keys is None else num_keys
            # mean prob = mass / (norm * q) >= 1 / keys, without dividing.
            important = mass * _on(keys, self.device) >= norm * _on(
                num_queries, self.device
            )
            gain = important.to(torch.float32)
            if self.window is not None:  # a moving average, not a count
                gain = (gain - self.acc[idx]) / self.window
        self.acc.index_add_(0, idx, gain)
        self._step[idx] = 0.0

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Scores follow tokens moved src -> dst; sources are left at zero.

        Args:
            src_slots: int [n]. dst_slots: int [n], distinct.
        """
        src, dst = self._idx(src_slots), self._idx(dst_slots)
        acc, step = self.acc[src], self._step[src]  # gathered before any write
        self.acc[src] = 0.0
        self._step[src] = 0.0
        self.acc[dst] = acc
        self._step[dst] = step

    def reset(self, slots: torch.Tensor) -> None:
        """A new token took these slots: its score starts at zero."""
        idx = self._idx(slots)
        self.acc[idx] = 0.0
        self._step[idx] = 0.0

    def scores(self, slots: np.ndarray) -> np.ndarray:
        """float32 [n] running scores of `slots` (int [n]), on the host."""
        idx = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(self.device)
        return self.acc[idx].cpu().numpy()

    def _idx(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(slots, device=self.device).to(torch.int64)


def _on(value: torch.Tensor | int, device: torch.device) -> torch.Tensor | int:
    return value.to(device) if isinstance(value, torch.Tensor) else value
