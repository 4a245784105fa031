# SPDX-License-Identifier: Apache-2.0
"""Per-forward token-read state handed from the model runner to attention.

Worker side. The runner sets it after building the step's inputs and clears it
when the step's output is built, so warm-up and dummy runs (no state set) take
vLLM's stock attention path. Attention layers only read it, the same pattern as
vLLM's forward context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm.vtoken.scores import ScoreAccumulator


@dataclass(frozen=True, kw_only=True)
class TokenRead:
    """The live KV slots every request of the batch attends to.

    Request r's query rows are [query_start_loc[r], query_start_loc[r + 1]) and its
    keys are kv_slots[kv_indptr[r]:kv_indptr[r + 1]], in logical order with the
    step's query tokens last (they are live and newest).
    """

    query_start_loc: np.ndarray  # int64 [num_reqs + 1]
    kv_indptr: np.ndarray  # int64 [num_reqs + 1]
    kv_slots: torch.Tensor  # int64 [total live], on the KV cache's device
    scores: ScoreAccumulator | None  # accumulate attention mass (H2O, ...)

    def cpu_forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        output: torch.Tensor,
        scale: float,
    ) -> None:
        """Attention of `query` over the live tokens, written into `output`."""
        from vllm.vtoken.token_attention import cpu_token_attention

        num_tokens, num_heads, head_dim = query.shape
        cpu_token_attention(
            query,
            key_cache,
            value_cache,
            output.view(num_tokens, num_heads, head_dim),
            query_start_loc=self.query_start_loc,
            kv_indptr=self.kv_indptr,
            kv_slots=self.kv_slots,
            scale=scale,
            scores=self.scores,
        )


_current: TokenRead | None = None


def set_token_read(read: TokenRead | None) -> None:
    global _current
    _current = read


def get_token_read() -> TokenRead | None:
    """The token-read state of the forward pass in progress, if vToken is on."""
    return _current
