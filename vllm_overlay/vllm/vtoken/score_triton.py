# SPDX-License-Identifier: Apache-2.0
"""The Triton kernel behind `score_kernel.triton_attention_mass` (GPU).

Kept apart so that the CPU path (score_kernel's torch code) imports without
Triton. Grid (num_tiles, Hkv): program (t, h) takes tile t's query rows (one
request) times the G query heads of KV head h as the rows of its [BLOCK_M, D]
query block, like vLLM's unified attention, and reads the request's keys
through `kv_slots` from the [N, 2, B, H, D] cache (K half; fp8 keys as
vLLM's kernel reads them, FP8):

    pass 1   online max and sum of exp over the visible keys -> lse per row
    pass 2   p = exp(s - lse), summed over the block's rows -> atomic add into
             mass[key] ("mean"); "max": a request whose counted rows fit one
             tile has each head's sum whole in the program, whose max over its
             heads goes to mass[key] by atomic max (masses are >= 0); one whose
             rows span tiles adds per query head into scratch[h, its keys]
             (only such requests' keys: a prefill's), maxed after the launch

Nothing [rows, Lk] is stored: registers hold one [BLOCK_M, BLOCK_N] tile.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _logits(
    q,
    cache_ptr,
    slots_ptr,
    kstart,
    n0,
    kmax,
    limit,
    kvh,
    scale,
    k_scale_ptr,
    stride_cn,
    stride_cb,
    stride_ch,
    BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
):
    # Scaled, causally masked logits of the block's rows against keys
    # [n0, n0 + BLOCK_N) of the request; hidden entries are -inf.
    key = n0 + tl.arange(0, BLOCK_N)
    kmask = key < kmax
    offs_d = tl.arange(0, D_PAD)
    slot = tl.load(slots_ptr + kstart + key, mask=kmask, other=0).to(tl.int64)
    row = (slot // BLOCK) * stride_cn + (slot % BLOCK) * stride_cb + kvh * stride_ch
    kt = tl.load(
        cache_ptr + row[None, :] + offs_d[:, None],
        mask=kmask[None, :] & (offs_d[:, None] < HEAD_DIM),
        other=0.0,
    )  # [D_PAD, BLOCK_N]
    # As vLLM's unified attention: fp8 keys meet an fp8 query as they are
    # (CUDA quantizes the query for an fp8 cache), another query dequantized.
    if FP8:
        if not q.dtype.is_fp8():
            kt = (kt.to(tl.float32) * tl.load(k_scale_ptr)).to(q.dtype)
    else:
        kt = kt.to(q.dtype)
    if IEEE:  # fp32 inputs: no TF32, the scores must match fp64 to 1e-5
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    visible = (key[None, :] <= limit[:, None]) & kmask[None, :]
    return tl.where(visible, s * scale, float("-inf")), key, kmask


# Sizes that change every step: no Triton variant per value (1, multiple of 16).
@triton.jit(do_not_specialize=["num_tiles", "num_scratch"])
def score_mass_kernel(
    query_ptr,  # [T, Hq, D]
    cache_ptr,  # [N, 2, B, Hkv, D]
    slots_ptr,  # [K] int64
    tiles_ptr,  # [5, num_tiles] int32: first row, query end, key start, key
    # count, the request's keys' start in the scratch ("max"; -1: one tile)
    mass_ptr,  # float32 [K], zeroed
    scratch_ptr,  # float32 [Hq, num_scratch], zeroed ("max")
    scale,
    k_scale_ptr,  # float32 [1]: an fp8 cache's K scale (FP8)
    num_tiles,
    num_scratch,
    stride_qt,
    stride_qh,
    stride_cn,
    stride_cb,
    stride_ch,
    BLOCK: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    TOP: tl.constexpr,
    IEEE: tl.constexpr,
    FP8: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    row0 = tl.load(tiles_ptr + tile)
    qend = tl.load(tiles_ptr + num_tiles + tile)
    kstart = tl.load(tiles_ptr + 2 * num_tiles + tile)
    klen = tl.load(tiles_ptr + 3 * num_tiles + tile)
    soff = tl.load(tiles_ptr + 4 * num_tiles + tile)
    # Block row m: query row row0 + m // G_PAD, query head kvh * G + m % G_PAD.
    offs_m = tl.arange(0, BLOCK_M)
    qi, g = offs_m // G_PAD, offs_m % G_PAD
    row = row0 + qi
    valid = (qi < BLOCK_Q) & (g < G) & (row < qend)
    offs_d = tl.arange(0, D_PAD)
    q = tl.load(
        query_ptr
        + row.to(tl.int64)[:, None] * stride_qt
        + (kvh * G + g)[:, None] * stride_qh
        + offs_d[None, :],
        mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    limit = row - qend + klen  # bottom-right causal: the last key a row sees
    kmax = tl.minimum(row0 + BLOCK_Q, qend) - qend + klen  # keys any row sees
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: no inf - inf
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(0, kmax, BLOCK_N):
        s, _, _ = _logits(
            q, cache_ptr, slots_ptr, kstart, n0, kmax, limit, kvh, scale,
            k_scale_ptr, stride_cn, stride_cb, stride_ch,
            BLOCK, BLOCK_N, HEAD_DIM, D_PAD, IEEE, FP8,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
        m_i = m_new
    # Rows outside the block get lse = +inf, hence probability 0.
    lse = tl.where(valid, m_i + tl.log(l_i), float("inf"))
    for n0 in range(0, kmax, BLOCK_N):
        s, key, kmask = _logits(
            q, cache_ptr, slots_ptr, kstart, n0, kmax, limit, kvh, scale,
            k_scale_ptr, stride_cn, stride_cb, stride_ch,
            BLOCK, BLOCK_N, HEAD_DIM, D_PAD, IEEE, FP8,
        )  # fmt: skip
        p = tl.exp(s - lse[:, None])
        if TOP:  # per query head: the max over heads needs each head's sum
            top = tl.zeros([BLOCK_N], tl.float32)
            for gi in tl.static_range(G):
                col = tl.sum(tl.where((g == gi)[:, None], p, 0.0), 0)
                if soff < 0:  # every counted row here: the head's sum is whole
                    top = tl.maximum(top, col)
                else:  # rows in other tiles too: summed across programs first
                    head = (kvh * G + gi).to(tl.int64) * num_scratch
                    tl.atomic_add(scratch_ptr + head + soff + key, col, mask=kmask)
            if soff < 0:
                tl.atomic_max(mass_ptr + kstart + key, top, mask=kmask)
        else:
            tl.atomic_add(mass_ptr + kstart + key, tl.sum(p, 0), mask=kmask)
