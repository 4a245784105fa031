# SPDX-License-Identifier: Apache-2.0
"""Per-forward token-read state handed from the model runner to attention.

Worker side. `VTokenWorker.prepare_attention` builds the step's `TokenRead`
once, device read plan included, and sets it; `end_step` clears it, so warm-up
and dummy runs (no state set) take vLLM's stock attention path. Attention
layers only read it (cpu_attention.py, triton_attention.py), the same pattern as
vLLM's forward context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm.vtoken.arena import segments

if TYPE_CHECKING:
    from vllm.vtoken.cpu_attention import CpuReadPlan
    from vllm.vtoken.scores import ScoreAccumulator
    from vllm.vtoken.triton_plan import TritonReadPlan


@dataclass(frozen=True, kw_only=True)
class TokenRead:
    """The live KV slots every request of the batch attends to.

    Request r's query rows are [query_start_loc[r], query_start_loc[r + 1]) and its
    keys are kv_slots[kv_indptr[r]:kv_indptr[r + 1]], in logical order with the
    step's query tokens last (they are live and newest). `plan` holds the same
    read as the index tensors of the device's attention path.

    A request with no keys (kv_indptr[r] == kv_indptr[r + 1]) is not on the
    token read: it has no dead token and needs no scores, so vLLM's own kernel
    reads it; one with keys but no dead token is read for its scores only.
    `with_stock` says some request takes its output from vLLM's kernel: the
    backend then runs that kernel for the batch first, and the token read
    overwrites the rows of the requests with a dead token.
    """

    query_start_loc: np.ndarray  # int64 [num_reqs + 1]
    kv_indptr: np.ndarray  # int64 [num_reqs + 1]
    kv_slots: torch.Tensor  # int64 [total live], on the KV cache's device
    plan: CpuReadPlan | TritonReadPlan
    scores: ScoreAccumulator | None  # accumulate attention mass (H2O, ...)
    with_stock: bool = False
    # "window" scores (SnapKV): per request, its last query rows that count.
    score_rows: np.ndarray | None = None  # int64 [num_reqs]


_current: TokenRead | None = None


def set_token_read(read: TokenRead | None) -> None:
    global _current
    _current = read


def get_token_read() -> TokenRead | None:
    """The token-read state of the forward pass in progress, if vToken is on."""
    return _current


def read_keys(pool, rows: np.ndarray, computed: np.ndarray):
    """The keys a step's token read attends to, for Token Table rows `rows`
    (distinct) of `pool` (a TokenTablePool): each row's live tokens before
    computed[i], then every token from there to its slotted end (the step's
    queries, dead ones too: a resumed request recomputes them). Returns
    (counts, idx, slot): per row its number of keys, then their logical
    indices and slots, int64, in logical order per row."""
    rows, computed = np.asarray(rows, np.int64), np.asarray(computed, np.int64)
    counts, idx, slot, queries = pool.read_walk(rows, computed)
    num_q = pool.num_slotted_rows(rows) - computed
    if queries == num_q.sum():
        return counts, idx, slot  # every query is live: listed
    # A resumed request recomputes dead tokens (rare): its old live tokens,
    # then every query, each row in logical order.
    seg = np.arange(rows.size).repeat(counts)
    old = idx < computed[seg]
    q_seg, q_k = segments(num_q)
    q_idx = computed[q_seg] + q_k
    seg = np.concatenate([seg[old], q_seg])
    idx = np.concatenate([idx[old], q_idx])
    slot = np.concatenate([slot[old], pool.tokens_at(rows, q_seg, q_idx)])
    order = np.lexsort((idx, seg))
    counts = np.bincount(seg, minlength=rows.size)
    return counts, idx[order], slot[order].astype(np.int64)
