# SPDX-License-Identifier: Apache-2.0
"""TRITON_ATTN attention that reads only live tokens, through the slot map (GPU).

Worker side. vLLM's `unified_attention` runs unchanged over one-token pages:
the cache `[N, 2, B, H, D]` viewed as rows `[N * 2 * B, 1, H, D]`, a row-id
token table as its block table and the live lengths as `seqused_k`, so its
causal mask works in live-index space. The table is built once per step by the
worker (`build_triton_read_plan`) and shared by every layer.

    slot (n, b)  ->  K row n * 2B + b,  V row the same + B

Score policies (H2O, Scissorhands, SnapKV) need each key's attention mass,
which the read kernel does not return: one more launch per layer computes it
for the whole batch (`score_kernel.triton_attention_mass`, tiled, no
probabilities stored) from the step's `ScorePlan`. `attention_mass` is the
dense torch reference.

An fp8 KV cache (`--kv-cache-dtype fp8`) is read as vLLM's stock forward
reads it, in both kernels: its bytes viewed as the platform's fp8 type
(`KVQuant`); against a query of the model's dtype each element times the
layer's per-tensor scale, against the fp8 query CUDA hands the backend
(vLLM's query_quant) as it is. Moves copy bytes, so a moved token keeps its
encoding and its layer's scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.vtoken.score_kernel import triton_attention_mass
from vllm.vtoken.staging import HostToDevice
from vllm.vtoken.triton_plan import (
    TritonReadPlan,
    build_triton_read_plan,
    slots_to_rows,
)

# Requests in the warm-up's batches: Triton's variants of an int argument.
WARM_UP_SEQS = (1, 2, 16)

# TritonAttentionMetadata's split-KV fields, unified_attention's arguments.
SPLIT_KV = (
    "seq_threshold_3D",
    "num_par_softmax_segments",
    "softmax_segm_output",
    "softmax_segm_max",
    "softmax_segm_expsum",
)


@dataclass(frozen=True)
class KVQuant:
    """An fp8 KV cache as TRITON_ATTN reads it: its bytes viewed as `dtype`;
    against a query of the model's dtype each K (V) element times `k_scale`
    (`v_scale`), float32 tensors of one element per layer read on the
    device (no host sync); against an fp8 query, as it is (stock's kernel)."""

    dtype: torch.dtype
    k_scale: torch.Tensor
    v_scale: torch.Tensor


def kv_quant_of(impl: Any, layer: Any) -> KVQuant | None:
    """Patch 0080's glue: TritonAttentionImpl `impl`'s cache as its stock
    forward reads it for `layer` (the platform's fp8 type, the layer's
    scales), or None for a cache of the model's dtype."""
    if not impl.kv_cache_dtype.startswith("fp8"):
        return None
    # Stock's own condition, asserted on its path, which a read may skip.
    assert layer._q_scale_float == 1.0, "A non 1.0 q_scale is not supported."
    return KVQuant(impl.fp8_dtype, layer._k_scale, layer._v_scale)


def triton_forward(
    read: Any,  # the step's context.TokenRead (not imported: context imports us)
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    scale: float,
    split_kv: Any = None,
    kv_quant: KVQuant | None = None,
) -> None:
    """TRITON_ATTN's forward with vToken on: the step's read over live tokens.

    `split_kv`: the step's TritonAttentionMetadata, whose split-KV (3D)
    buffers and threshold the read passes on, so decode at small batches takes
    the same 2D/3D choice as stock. `kv_quant`: an fp8 cache's type and
    scales (`kv_quant_of`), which the read and the scoring apply as stock's
    kernel does; None for a cache of the model's dtype.

    With `read.with_stock` vLLM's kernel has written every row already; the
    read overwrites the rows of the requests with a dead token.
    """
    k_scale = v_scale = None
    if kv_quant is not None:
        if kv_cache.dtype != kv_quant.dtype:  # allocated as bytes (uint8)
            kv_cache = kv_cache.view(kv_quant.dtype)
        k_scale, v_scale = kv_quant.k_scale, kv_quant.v_scale
    plan = read.plan
    num_tokens, num_heads, head_dim = query.shape
    out = output.view(num_tokens, num_heads, head_dim)
    if plan.token_table is not None:
        q, o = query, out
        if plan.rows is not None:
            q = _rows_of(query, plan.rows)
            # The model's dtype: on CUDA an fp8 cache's query is fp8 already
            # (vLLM's query_quant), its output is not.
            o = out.new_empty(q.shape)
        triton_token_attention(
            q,
            kv_cache,
            o,
            query_start_loc=plan.query_start_loc,
            token_table=plan.token_table,
            live_lens=plan.live_lens,
            max_query_len=plan.max_query_len,
            max_live_len=plan.max_live_len,
            scale=scale,
            split_kv=split_kv,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        if plan.rows is not None:
            out[plan.rows] = o
    if read.scores is None:
        return
    score = plan.score
    rows = read.scores.query_window if read.score_rows is None else read.score_rows
    # Built once a step with the read plan, in its one upload: built here it
    # would be a blocking copy from pageable memory in every layer.
    assert score is not None, "a scored read's plan is built with scored=True"
    assert score.query_window is rows or np.array_equal(score.query_window, rows), (
        "the plan counts other query rows than the read"
    )
    if score.num_tiles:
        mass = triton_attention_mass(
            query, kv_cache, score, scale, read.scores.aggregate, k_scale=k_scale
        )
        read.scores.add(score.positions, mass)


def _rows_of(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x[rows], an fp8 tensor's through its bytes (a gather of any 1-byte
    type)."""
    if x.element_size() != 1:
        return x[rows]
    return x.view(torch.uint8)[rows].view(x.dtype)


def warm_up(
    kv_cache: torch.Tensor,
    num_heads: int,
    scores: Any = None,
    split_kv: Any = None,
    kv_dtype: torch.dtype | None = None,
    model_dtype: torch.dtype | None = None,
    fp8_query: bool = False,
) -> None:
    """Compiles the token read's kernels at start-up (decode and prefill
    variants, decode's split-KV (3D) one too when `split_kv` holds vLLM's
    buffers, and the score kernel when `scores` are accumulated), so the first
    requests do not stall on Triton compiles. `kv_dtype`: an fp8 cache's
    type (its kernels are other variants), read with unit scales here;
    `model_dtype`: the query's and the output's (default: the cache's);
    `fp8_query`: the query comes quantized to `kv_dtype` (vLLM's query_quant,
    CUDA with an fp8 cache: `worker.fp8_read_of`). Triton compiles a variant per
    integer argument equal to 1, divisible by 16, or neither (the batch's
    request and key counts): so 1, 2 and 16 requests of two keys, and one
    request of one key (a one-token prompt alone in its step), each with the
    query a view of a fused QKV tensor and contiguous. Reads slots 0
    and 1 into scratch (and the split-KV buffers, scratch as well); writes
    nothing of the engine's."""
    _, _, block, num_kv_heads, head_dim = kv_cache.shape
    stage = HostToDevice(kv_cache.device)
    kv_quant = k_scale = None
    if kv_dtype is not None:
        one = torch.ones(1, dtype=torch.float32, device=kv_cache.device)
        kv_quant, k_scale = KVQuant(kv_dtype, one, one), one
    model_dtype = kv_cache.dtype if model_dtype is None else model_dtype
    query_dtype = kv_dtype if fp8_query else model_dtype
    decode = (None,) if split_kv is None else (None, split_kv)  # None: 2D
    runs = [
        (n, q, 2, s) for n in WARM_UP_SEQS for q, s in ((1, decode), (2, (None,)))
    ] + [(1, 1, 1, (None,))]
    for num_seqs, num_q, num_keys, splits in runs:
        plan = build_triton_read_plan(
            np.arange(0, num_q * num_seqs + 1, num_q),
            np.arange(0, num_keys * num_seqs + 1, num_keys),
            np.tile(np.arange(num_keys), num_seqs),
            block,
            scored=scores is not None,
            score_query_window=getattr(scores, "query_window", None),
            score_group=num_heads // num_kv_heads,
            stage=stage,
        )
        # The query's row stride is an integer Triton specializes: vLLM
        # passes a view of the fused QKV projection ((Hq + 2 Hkv) D a row),
        # or, compiled, possibly a contiguous one (Hq D): both.
        rows = num_q * num_seqs
        fused = kv_cache.new_zeros(
            rows, num_heads + 2 * num_kv_heads, head_dim, dtype=query_dtype
        )
        for q in (fused[:, :num_heads], fused.new_zeros(rows, num_heads, head_dim)):
            for split in splits:
                out = q.new_empty(q.shape, dtype=model_dtype)
                read = _Read(plan, None)
                triton_forward(read, q, kv_cache, out, 1.0, split, kv_quant)
            if scores is not None:
                cache = kv_cache if kv_dtype is None else kv_cache.view(kv_dtype)
                triton_attention_mass(
                    q, cache, plan.score, 1.0, scores.aggregate, k_scale=k_scale
                )


def split_kv_buffers(attn_groups: Any) -> Any:
    """The first TRITON_ATTN metadata builder among the model runner's
    attention groups: it holds the split-KV (3D) buffers and threshold that
    each step's metadata carries (`SPLIT_KV`), or None."""
    for groups in attn_groups:
        for group in groups:
            for builder in group.metadata_builders:
                if all(hasattr(builder, name) for name in SPLIT_KV):
                    return builder
    return None


@dataclass(frozen=True)
class _Read:  # what triton_forward reads of a TokenRead
    plan: TritonReadPlan
    scores: Any


def build_token_table(
    kv_indptr: np.ndarray, kv_slots: torch.Tensor, block_size: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Builds the padded row-id token table that `triton_token_attention` reads.

    `unified_attention` loads table entries without a mask up to the live
    length rounded up to its tile (at most 32), so the width is a multiple of
    64 and unused entries hold row 0 (a valid address, masked out).

    Args:
        kv_indptr: `[R + 1]` int, request r's entries in `kv_slots`.
        kv_slots: `[S]` int64 live slots, logical order, queries last.
        block_size: B.
        width: W, a multiple of 64 that is at least the longest live list.

    Returns:
        `(token_table, live_lens)`: `[R, W]` int32 and `[R]` int32, on
        `kv_slots`'s device.

    """
    indptr = np.asarray(kv_indptr, dtype=np.int64)
    lens = np.diff(indptr)
    assert width % 64 == 0 and (lens.size == 0 or lens.max() <= width), (
        f"width {width} must be a multiple of 64 and >= the longest list"
    )
    assert indptr[-1] == kv_slots.numel(), "kv_indptr[-1] != len(kv_slots)"
    dev = kv_slots.device
    num_reqs = lens.size
    req = torch.from_numpy(np.repeat(np.arange(num_reqs), lens)).to(dev)
    col = torch.from_numpy(np.arange(indptr[-1]) - np.repeat(indptr[:-1], lens))
    table = torch.zeros(num_reqs, width, dtype=torch.int32, device=dev)
    table[req, col.to(dev)] = slots_to_rows(kv_slots, block_size).to(torch.int32)
    live_lens = torch.from_numpy(lens.astype(np.int32)).to(dev)
    return table, live_lens


def triton_token_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    token_table: torch.Tensor,
    live_lens: torch.Tensor,
    max_query_len: int,
    max_live_len: int,
    scale: float,
    split_kv: Any = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Causal attention over live tokens of a TRITON_ATTN cache (GPU).

    Runs vLLM's `unified_attention` on one-token pages: the cache viewed as
    `[N * 2 * B, 1, H, D]`, K pages from row 0 and V pages from row B, with the
    token table as its block table and the live lengths as `seqused_k`. Its
    causal mask works in live-index space, as required. Attention scores are
    not produced on this path.

    Args:
        query: `[T, Hq, D]`.
        kv_cache: `[N, 2, B, H, D]`, contiguous.
        output: `[T, Hq, D]`, written in place.
        query_start_loc: `[R + 1]` int32 on the device.
        token_table: `[R, W]` int32 row ids from `build_token_table`.
        live_lens: `[R]` int32, live keys per request (queries included).
        max_query_len: longest query run.
        max_live_len: longest live list.
        scale: softmax scale.
        split_kv: Optional TritonAttentionMetadata: its split-KV buffers let
            unified_attention take its 3D path (decode, few requests).
        k_scale, v_scale: An fp8 cache's per-tensor scales (`KVQuant`),
            passed as stock passes them; None for a cache of the model's dtype.
    """
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    num_blocks, _, block, heads, head_dim = kv_cache.shape
    assert kv_cache.is_contiguous(), "triton_token_attention needs a contiguous cache"
    assert num_blocks * 2 * block < 2**31, "row ids of this cache overflow int32"
    rows = kv_cache.view(num_blocks * 2 * block, 1, heads, head_dim)
    # As stock: a [requests, KV heads] view of the scale (its kernel reads
    # the first element).
    descale = (query_start_loc.numel() - 1, heads)
    unified_attention(
        q=query,
        k=rows,
        v=rows[block:],
        out=output,
        cu_seqlens_q=query_start_loc,
        max_seqlen_q=max_query_len,
        seqused_k=live_lens,
        max_seqlen_k=max_live_len,
        softmax_scale=scale,
        causal=True,
        window_size=(-1, -1),
        block_table=token_table,
        softcap=0,
        q_descale=None,
        k_descale=None if k_scale is None else k_scale.expand(descale),
        v_descale=None if v_scale is None else v_scale.expand(descale),
        **{name: getattr(split_kv, name, None) for name in SPLIT_KV},
    )


def attention_mass(
    q: torch.Tensor, k: torch.Tensor, scale: float, aggregate: str = "mean"
) -> torch.Tensor:
    """Attention probability mass per key, over already-gathered keys.

    The dense reference of the score kernels (score_kernel.py): it
    materializes [Hq, Lq, Lk] fp32, so no step path calls it.

    softmax(q k^T * scale) with a bottom-right causal mask (query i of Lq sits
    at position Lk - Lq + i), summed over query rows, then over query heads
    ("mean") or their max ("max"). GQA: query head h reads KV head
    h // (Hq // Hkv).

    Args:
        q: [Lq, Hq, D] queries.
        k: [Lk, Hkv, D] keys; Hq must be a multiple of Hkv.
        scale: Softmax scale, usually D ** -0.5.
        aggregate: "mean" or "max" over query heads (scores.py).

    Returns:
        float32 [Lk]; with "mean" it sums to Hq * Lq.

    """
    lq, hq, d = q.shape
    lk, hkv, dk = k.shape
    assert dk == d and hq % hkv == 0 and lq <= lk, (tuple(q.shape), tuple(k.shape))
    kx = k.float().repeat_interleave(hq // hkv, dim=1)  # [Lk, Hq, D]
    logits = torch.einsum("qhd,khd->hqk", q.float(), kx) * scale  # [Hq, Lq, Lk]
    pos_q = torch.arange(lq, device=q.device) + (lk - lq)
    mask = torch.arange(lk, device=q.device)[None, :] > pos_q[:, None]  # [Lq, Lk]
    probs = torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)
    per_head = probs.sum(dim=1)  # [Hq, Lk]
    return per_head.amax(dim=0) if aggregate == "max" else per_head.sum(dim=0)
