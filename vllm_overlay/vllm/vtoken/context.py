# SPDX-License-Identifier: Apache-2.0
"""Per-forward token-read state handed from the model runner to attention.

Worker side. The runner sets it after building the step's inputs and clears it
when the step's output is built, so warm-up and dummy runs (no state set) take
vLLM's stock attention path. Attention layers only read it, the same pattern as
vLLM's forward context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    block_size: int
    # Index tensors built by the first layer, reused by the others.
    _cpu: dict = field(default_factory=dict, compare=False, repr=False)
    _gpu: dict = field(default_factory=dict, compare=False, repr=False)

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
            plan_cache=self._cpu,
        )

    def triton_forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        output: torch.Tensor,
        scale: float,
    ) -> None:
        """The same read on a TRITON_ATTN cache `[N, 2, B, H, D]` (GPU)."""
        from vllm.vtoken.token_attention import (
            build_token_table,
            triton_token_attention,
        )

        g = self._gpu
        if not g:
            lens = np.diff(self.kv_indptr)
            qlens = np.diff(self.query_start_loc)
            width = max(64, -(-int(lens.max()) // 64) * 64)
            g["table"], g["live_lens"] = build_token_table(
                self.kv_indptr, self.kv_slots, self.block_size, width
            )
            g["qsl"] = torch.from_numpy(self.query_start_loc.astype(np.int32)).to(
                query.device
            )
            g["max_q"], g["max_live"] = int(qlens.max()), int(lens.max())
        num_tokens, num_heads, head_dim = query.shape
        triton_token_attention(
            query,
            kv_cache,
            output.view(num_tokens, num_heads, head_dim),
            query_start_loc=g["qsl"],
            token_table=g["table"],
            live_lens=g["live_lens"],
            max_query_len=g["max_q"],
            max_live_len=g["max_live"],
            scale=scale,
        )
        if self.scores is not None:
            self._triton_scores(query, kv_cache, scale)

    def _triton_scores(
        self, query: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> None:
        # unified_attention returns no probabilities: recompute them for the
        # score policies (H2O, Scissorhands) over the gathered live keys.
        from vllm.vtoken.scores import attention_mass_reference

        B = self.block_size
        for r in range(len(self.kv_indptr) - 1):
            q0, q1 = self.query_start_loc[r], self.query_start_loc[r + 1]
            if q1 == q0:
                continue
            slots = self.kv_slots[self.kv_indptr[r] : self.kv_indptr[r + 1]]
            keys = kv_cache[slots // B, 0, slots % B]
            mass = attention_mass_reference(query[q0:q1], keys, scale)
            self.scores.add(slots, mass)


_current: TokenRead | None = None


def set_token_read(read: TokenRead | None) -> None:
    global _current
    _current = read


def get_token_read() -> TokenRead | None:
    """The token-read state of the forward pass in progress, if vToken is on."""
    return _current
