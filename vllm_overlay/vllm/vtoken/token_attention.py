# SPDX-License-Identifier: Apache-2.0
"""Attention that reads only live tokens, through the slot map (worker side).

Dead tokens are excluded by never reading their slots: each request gives its
live slots in logical order, the current query tokens last (they were just
written to their slots), and attention runs over exactly those keys.

    logical   t0  t1  t2  t3  t4  t5  (q0 q1 = this step's queries)
    live       1   0   1   1   0   1    1  1
    kv_slots  [s0,     s2, s3,     s5, q0, q1]  -> Lk = 6, Lq = 2

The causal mask is bottom-right in live-index space: query i of Lq sees keys
`[0, Lk - Lq + i]`. RoPE positions stay logical; only the read changes.

- CPU (CPU_ATTN, ISA vec/vec16): decode requests (one query each) run as one
  padded batch, K/V gathered straight into the matmul layout; the others
  (prefills) with SDPA per request, or explicit softmax when scores are
  wanted. The index tensors are built once per step (`CpuReadPlan`).
- GPU (TRITON_ATTN): vLLM's `unified_attention` over one-token pages with a
  row-id token table; no kernel change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


def gather_live_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reads K and V of the given slots from the CPU vec/vec16 layout.

    Args:
        key_cache: `[N, H, B, D]` nominal; each (block, head) page is `[D, B]`.
        value_cache: `[N, H, B, D]`.
        slots: `[S]` int64, `block * B + offset`.

    Returns:
        `(k, v)`, each `[S, H, D]` (fresh tensors).
    """
    num_blocks, heads, block, head_dim = key_cache.shape
    blk, off = slots // block, slots % block
    key = key_cache.view(num_blocks, heads, head_dim, block)[blk, :, :, off]
    return key, value_cache[blk, :, off]


def _causal_mask(num_q: int, num_k: int) -> torch.Tensor | None:
    # Bottom-right aligned: query i sees keys [0, num_k - num_q + i].
    if num_q == 1:
        return None
    return torch.ones(num_q, num_k, dtype=torch.bool).tril(num_k - num_q)


@dataclass(frozen=True)
class CpuReadPlan:
    """Index tensors of one step's CPU read, built once and shared by every layer.

    Decode requests (one query each) form a padded batch: `blk`/`off` `[R, W]`
    address each request's live keys (padding repeats a valid slot and is
    masked by `valid`); `v_rows` `[R * H * W]` are the same keys as rows of the
    value cache viewed `[N * H * B, D]`, one per KV head. Requests with several
    queries (prefills) read `other_slots`, request `others[i]`'s keys being
    entries `[other_loc[i], other_loc[i + 1])`. `score_slots` lists every key
    read, in the order the attention masses are concatenated.
    """

    q_loc: list[int]
    kv_loc: list[int]
    decode: list[int]
    q_rows: torch.Tensor  # [R] int64: query row of each decode request
    blk: torch.Tensor  # [R, W] int64
    off: torch.Tensor  # [R, W] int64
    v_rows: torch.Tensor  # [R * H * W] int64
    valid: torch.Tensor  # [R, W] bool
    others: list[int]
    other_slots: torch.Tensor  # [S'] int64
    other_loc: list[int]
    score_slots: torch.Tensor  # [S''] int64


def build_cpu_read_plan(
    query_start_loc: np.ndarray,
    kv_indptr: np.ndarray,
    kv_slots: torch.Tensor,
    block_size: int,
    num_kv_heads: int,
) -> CpuReadPlan:
    """The per-step part of `cpu_token_attention` (see its arguments).

    Raises:
        ValueError: the index arrays disagree, or a request has fewer live
            slots than query tokens.
    """
    q_loc = np.asarray(query_start_loc, dtype=np.int64)
    kv_loc = np.asarray(kv_indptr, dtype=np.int64)
    if q_loc.shape != kv_loc.shape or kv_loc[-1] != kv_slots.numel():
        raise ValueError("query_start_loc, kv_indptr and kv_slots disagree")
    num_q, num_k = np.diff(q_loc), np.diff(kv_loc)
    short = np.flatnonzero(num_k < num_q)
    if short.size:
        r = int(short[0])
        raise ValueError(f"request {r}: {num_k[r]} live slots < {num_q[r]} queries")
    decode, others = np.flatnonzero(num_q == 1), np.flatnonzero(num_q > 1)
    lens = num_k[decode]
    pos = np.arange(int(lens.max()) if lens.size else 0)
    valid = pos[None, :] < lens[:, None]
    idx = torch.from_numpy(np.where(valid, kv_loc[decode][:, None] + pos, 0))
    padded = kv_slots[idx]
    blk, off = padded // block_size, padded % block_size
    heads = torch.arange(num_kv_heads)[None, :, None]
    v_rows = (blk[:, None, :] * num_kv_heads + heads) * block_size + off[:, None, :]
    valid_t = torch.from_numpy(valid)
    sel = np.concatenate(
        [np.arange(kv_loc[r], kv_loc[r + 1]) for r in others] + [np.zeros(0, np.int64)]
    )
    other_slots = kv_slots[torch.from_numpy(sel)]
    return CpuReadPlan(
        q_loc=q_loc.tolist(),
        kv_loc=kv_loc.tolist(),
        decode=decode.tolist(),
        q_rows=torch.from_numpy(q_loc[decode]),
        blk=blk,
        off=off,
        v_rows=v_rows.reshape(-1),
        valid=valid_t,
        others=others.tolist(),
        other_slots=other_slots,
        other_loc=np.r_[0, np.cumsum(num_k[others])].tolist(),
        score_slots=torch.cat([padded[valid_t], other_slots]),
    )


def cpu_token_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    query_start_loc: np.ndarray,
    kv_indptr: np.ndarray,
    kv_slots: torch.Tensor,
    scale: float,
    scores: Any = None,
    plan_cache: dict | None = None,
) -> None:
    """Causal attention of each request's queries over its live slots (CPU).

    Args:
        query: `[T, Hq, D]`.
        key_cache: `[N, H, B, D]`, K pages stored `[D, B]` (vec/vec16).
        value_cache: `[N, H, B, D]`.
        output: `[T, Hq, D]` (or `[T, Hq * D]`), written in place for every
            request with at least one query token.
        query_start_loc: `[R + 1]` int, query rows of request r.
        kv_indptr: `[R + 1]` int, request r's entries in `kv_slots`.
        kv_slots: `[S]` int64, per request its live slots in logical order,
            its current query tokens last.
        scale: softmax scale.
        scores: object with `.add(slots, attn_mass)`, or None. When given,
            `attn_mass[j]` (probabilities summed over query heads and query
            rows) is added once for every slot read.
        plan_cache: a dict kept for the step: the index tensors are built by
            the first layer and reused by the others.

    Raises:
        ValueError: the index arrays disagree, or a request has fewer live
            slots than query tokens.
    """
    plan = plan_cache.get("plan") if plan_cache is not None else None
    if plan is None:
        plan = build_cpu_read_plan(
            query_start_loc, kv_indptr, kv_slots, key_cache.shape[2], key_cache.shape[1]
        )
        if plan_cache is not None:
            plan_cache["plan"] = plan
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    out = output.view(output.shape[0], num_q_heads, head_dim)
    masses = []
    if plan.decode:
        mass = _decode_batched(query, key_cache, value_cache, out, plan, scale)
        masses.append(mass[plan.valid])
    if plan.others:
        key, value = gather_live_kv(key_cache, value_cache, plan.other_slots)
        gqa = num_q_heads != key.shape[1]
        for i, r in enumerate(plan.others):
            q0, q1 = plan.q_loc[r], plan.q_loc[r + 1]
            k0, k1 = plan.other_loc[i], plan.other_loc[i + 1]
            q = query[q0:q1].transpose(0, 1)  # [Hq, Lq, D]
            k = key[k0:k1].transpose(0, 1)  # [H, Lk, D]
            v = value[k0:k1].transpose(0, 1)
            mask = _causal_mask(q1 - q0, k1 - k0)
            if scores is None:
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa
                )
            else:
                probs = _probs(q, k, mask, scale)  # [Hq, Lq, Lk] fp32
                o = probs @ _repeat_kv(v, num_q_heads).float()
                masses.append(probs.sum(dim=(0, 1)))
            out[q0:q1] = o.transpose(0, 1)
    if scores is not None and masses:
        scores.add(plan.score_slots, torch.cat(masses))


def _decode_batched(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    plan: CpuReadPlan,
    scale: float,
) -> torch.Tensor:
    # Requests with one query each, in one padded batch: a handful of ops per
    # layer instead of several per request, which dominate CPU decode steps.
    # K and V are gathered straight from the cache into the [R, H, W, D] layout
    # the matmuls want (one copy each; V rows are contiguous, so index_select,
    # several times faster than advanced indexing). Returns the mass [R, W].
    num_blocks, heads, block, head_dim = key_cache.shape
    num_reqs, num_q_heads = len(plan.decode), query.shape[1]
    h = torch.arange(heads)[None, :, None]
    blk, off = plan.blk[:, None, :], plan.off[:, None, :]
    k = key_cache.view(num_blocks, heads, head_dim, block)[blk, h, :, off]
    v = value_cache.view(-1, head_dim).index_select(0, plan.v_rows)
    v = v.view(num_reqs, heads, -1, head_dim)
    # GQA: query head h * G + g reads KV head h, as _repeat_kv does.
    q = query[plan.q_rows].float().view(num_reqs, heads, -1, head_dim)
    logits = torch.matmul(q, k.float().transpose(-1, -2)) * scale  # [R, H, G, W]
    logits.masked_fill_(~plan.valid[:, None, None, :], float("-inf"))
    probs = logits.softmax(dim=-1)
    o = torch.matmul(probs, v.float())  # [R, H, G, D]
    out[plan.q_rows] = o.reshape(num_reqs, num_q_heads, head_dim).to(out.dtype)
    return probs.sum(dim=(1, 2))


def _repeat_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    # GQA: query head h uses KV head h // (Hq // H), as SDPA's enable_gqa does.
    return x.repeat_interleave(num_q_heads // x.shape[0], dim=0)


def _probs(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    logits = (q.float() @ _repeat_kv(k, q.shape[0]).float().transpose(1, 2)) * scale
    if mask is not None:
        logits.masked_fill_(~mask, float("-inf"))
    return logits.softmax(dim=-1)


def token_attention_reference(
    q: torch.Tensor, k_live: torch.Tensor, v_live: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense causal attention over already-gathered live tokens (test oracle).

    Computed explicitly in float64, independent of SDPA and of any cache layout.

    Args:
        q: `[Lq, Hq, D]`, the request's query tokens.
        k_live: `[Lk, H, D]`, live keys in logical order, queries last.
        v_live: `[Lk, H, D]`.
        scale: softmax scale.

    Returns:
        `[Lq, Hq, D]` in `q`'s dtype.
    """
    qh = q.transpose(0, 1).double()
    kh = _repeat_kv(k_live.transpose(0, 1), q.shape[1]).double()
    vh = _repeat_kv(v_live.transpose(0, 1), q.shape[1]).double()
    logits = qh @ kh.transpose(1, 2) * scale
    mask = _causal_mask(q.shape[0], k_live.shape[0])
    if mask is not None:
        logits.masked_fill_(~mask, float("-inf"))
    return (logits.softmax(dim=-1) @ vh).transpose(0, 1).to(q.dtype)


def slots_to_rows(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Maps slots to rows of the one-token-page view of a TRITON_ATTN cache.

    With `[N, 2, B, H, D]` viewed as `[N * 2 * B, 1, H, D]`, K of slot
    `(n, b)` is row `n * 2B + b` and V is the same row of the view shifted by
    B rows.

    Args:
        slots: `[S]` int64.
        block_size: B.

    Returns:
        `[S]` int64 row ids.
    """
    return (slots // block_size) * (2 * block_size) + slots % block_size


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

    Raises:
        ValueError: bad width, or `kv_indptr` disagrees with `kv_slots`.
    """
    indptr = np.asarray(kv_indptr, dtype=np.int64)
    lens = np.diff(indptr)
    if width % 64 or (lens.size and lens.max() > width):
        raise ValueError(f"width {width} must be a multiple of 64 and >= {lens.max()}")
    if indptr[-1] != kv_slots.numel():
        raise ValueError("kv_indptr[-1] != len(kv_slots)")
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

    Raises:
        ValueError: a non-contiguous cache or row ids that overflow int32.
    """
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    num_blocks, _, block, heads, head_dim = kv_cache.shape
    if not kv_cache.is_contiguous():
        raise ValueError("triton_token_attention needs a contiguous cache")
    if num_blocks * 2 * block >= 2**31:
        raise ValueError("row ids of this cache do not fit in int32")
    rows = kv_cache.view(num_blocks * 2 * block, 1, heads, head_dim)
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
        k_descale=None,
        v_descale=None,
    )
