# SPDX-License-Identifier: Apache-2.0
"""Attention mass per key without materializing [heads, Lq, Lk] probabilities.

Worker side. Score policies (H2O, Scissorhands, SnapKV) need, per key, the
softmax probability it received, summed over the step's query rows, then over
query heads ("mean") or their max ("max"). Materializing the probabilities
costs Hq * Lq * Lk fp32: 8 GiB for one 8k-token prefill of 32 heads. Both
paths here bound the extra memory by a fixed query tile instead:

    CPU (any device)  `tiled_attention`: per tile of query rows the full rows'
                      softmax [Hq, tile, Lk] (a row's softmax needs only its
                      own keys), its column sums, and optionally `probs @ v`;
                      the tile shrinks so that one buffer stays <= 16 MiB
    GPU (TRITON_ATTN) `triton_attention_mass`: one launch per layer for the
                      whole batch (score_triton.py): per (query tile, KV head)
                      program, pass 1 the rows' log-sum-exp over the keys, pass
                      2 exp(s - lse) summed into the keys' masses (atomics)

The GPU launch reads a `ScorePlan`, built once per step with the read plan
(`triton_plan.build_triton_read_plan`, in its one upload) and shared by every
layer; `build_score_plan` builds one on its own (tests, the kernel check).
Causal mask bottom-right: query i of Lq sits at key position Lk - Lq + i.
GQA: query head h reads KV head h // (Hq // Hkv).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm.vtoken.arena import ranges

# fp32 logits per query tile on the torch path (16 MiB): bounds the extra memory.
TILE_ELEMS = 1 << 22
# Query rows per GPU program when some request counts more than one row: at
# most GPU_BLOCK_Q, fewer as the query heads of a KV head grow, so that a
# program's rows (query rows x the group, padded to a power of two) stay
# within GPU_TILE_ROWS (a group past it: one query row, the group's rows), as
# vLLM's unified_attention shrinks its BLOCK_Q: 16 rows of a 48-head group
# took 272 KiB of shared memory, past an H100's 227.
GPU_BLOCK_Q = 16
GPU_TILE_ROWS = 64


def gpu_block_q(group: int) -> int:
    """Query rows per GPU program for `group` query heads per KV head."""
    g_pad = 1 << max(group - 1, 0).bit_length()
    return max(1, min(GPU_BLOCK_Q, GPU_TILE_ROWS // g_pad))


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    scale: float,
    *,
    mass_rows: int | None = None,
    out: torch.Tensor | None = None,
    tile_elems: int = TILE_ELEMS,
) -> torch.Tensor:
    """Causal attention of one request, by query tiles, and each key's mass.

    Args:
        q: [Hq, Lq, D] queries (any strides).
        k: [Hkv, Lk, D] keys; Hq must be a multiple of Hkv, Lq <= Lk.
        v: [Hkv, Lk, D] values, or None for the masses only.
        scale: Softmax scale.
        mass_rows: Only the last `mass_rows` query rows count in the mass
            (SnapKV's window); None: all. Without `v` earlier rows are skipped.
        out: [Hq, Lq, D] (any dtype, any strides) written with the output
            when `v` is given.
        tile_elems: Upper bound of the per-tile logits buffer, in elements.

    Returns:
        float32 [Hq, Lk]: per query head the probability mass of each key,
        summed over the counted query rows.
    """
    hq, lq, d = q.shape
    hkv, lk, dk = k.shape
    assert dk == d and hq % hkv == 0 and lq <= lk, (tuple(q.shape), tuple(k.shape))
    assert (v is None) == (out is None), "the output needs v and out"
    g = hq // hkv
    first = lq - min(lq if mass_rows is None else mass_rows, lq)  # first counted
    kt = k.float().transpose(1, 2)  # [Hkv, D, Lk]; no copy for fp32 keys
    vf = None if v is None else v.float()
    qg = q.reshape(hkv, g, lq, d)  # head h = kv * G + g (SDPA's enable_gqa)
    rows = max(1, min(lq, tile_elems // (hq * lk)))
    head = torch.zeros(hq, lk, dtype=torch.float32, device=q.device)
    # Tiles from the last row back, so that a window's tiles fall on the same
    # boundaries whether or not earlier rows are computed (same sums).
    for t1 in range(lq, 0, -rows):
        t0 = max(0, t1 - rows)
        if v is None and t1 <= first:
            break
        n, kmax = t1 - t0, lk - lq + t1  # causal: later keys get no mass
        qt = qg[:, :, t0:t1].reshape(hkv, g * n, d).float()
        s = torch.matmul(qt, kt[:, :, :kmax]).view(hq, n, kmax)
        s.mul_(scale)
        limit = torch.arange(t0, t1, device=q.device) + (lk - lq)
        hidden = torch.arange(kmax, device=q.device)[None, :] > limit[:, None]
        s.masked_fill_(hidden, float("-inf"))
        # Softmax in place: one [Hq, n, kmax] buffer per tile.
        s.sub_(s.amax(dim=-1, keepdim=True)).exp_()
        s.div_(s.sum(dim=-1, keepdim=True))
        if t1 > first:
            head[:, :kmax] += s[:, max(first - t0, 0) :].sum(dim=1)
        if vf is not None:
            o = torch.matmul(s.view(hkv, g * n, kmax), vf[:, :kmax])
            out[:, t0:t1] = o.view(hq, n, d)
    return head


def attention_mass_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    aggregate: str = "mean",
    *,
    tile_elems: int = TILE_ELEMS,
) -> torch.Tensor:
    """`triton_attention.attention_mass` with bounded memory (same layout).

    Args:
        q: [Lq, Hq, D] queries.
        k: [Lk, Hkv, D] keys.
        scale: Softmax scale.
        aggregate: "mean" (sum over query heads) or "max".
        tile_elems: See `tiled_attention`.

    Returns:
        float32 [Lk].
    """
    head = tiled_attention(
        q.transpose(0, 1), k.transpose(0, 1), None, scale, tile_elems=tile_elems
    )
    return head.amax(dim=0) if aggregate == "max" else head.sum(dim=0)


@dataclass(frozen=True)
class ScorePlan:
    """One step's scoring on TRITON_ATTN, shared by every layer.

    The counted query rows of each request (its last `query_window` rows, a
    number or one per request, or all) cut into tiles of `block_q` rows; a
    tile belongs to one request.
    `tiles` [5, num_tiles] int32 holds per tile its first query row, the end
    of its request's query rows, the start and number of the request's keys
    in `kv_slots`, and, for a request whose rows span tiles, the start of its
    keys in the "max" aggregate's scratch (-1: its rows fit one tile).
    `scratch_keys` lists those requests' keys (their indices in `kv_slots`):
    the scratch is [Hq, len(scratch_keys)], a prefill's keys, not the step's.
    `positions` is arange(num_keys), the masses' index for
    `ScoreAccumulator.add`.
    """

    tiles: torch.Tensor  # [5, num_tiles] int32, on the device
    num_tiles: int
    kv_slots: torch.Tensor  # [K] int64, the step's TokenRead.kv_slots
    positions: torch.Tensor  # [K] int64
    block_q: int
    query_window: int | np.ndarray | None
    scratch_keys: torch.Tensor  # int64, on the device


def build_score_plan(
    query_start_loc: np.ndarray,
    kv_indptr: np.ndarray,
    kv_slots: torch.Tensor,
    query_window: int | np.ndarray | None,
    block_q: int | None = None,
    group: int = 1,
) -> ScorePlan:
    """The tile map of one step's scoring (a fixed number of NumPy calls).

    Args:
        query_start_loc: [R + 1] int, query rows of request r.
        kv_indptr: [R + 1] int, request r's keys in `kv_slots` (logical order,
            the step's queries last).
        kv_slots: [K] int64 on the KV cache's device.
        query_window: Only the last rows of each request count (SnapKV): as
            many as this, or int [R] as many as its entry (0: none).
        block_q: Query rows per tile; default 1 when no request counts more
            than one row (decode), else `gpu_block_q(group)`.
        group: Query heads per KV head of the layers it serves.

    Returns:
        The plan; tensors on `kv_slots`'s device, uploaded in one copy.
    """
    assert kv_indptr[-1] == kv_slots.numel(), "plan mismatch"
    tiles, block_q, scratch_keys = score_tiles(
        query_start_loc, kv_indptr, query_window, block_q, group
    )
    dev = kv_slots.device
    return ScorePlan(
        tiles=torch.from_numpy(tiles).to(dev),
        num_tiles=tiles.shape[1],
        kv_slots=kv_slots,
        positions=torch.arange(kv_slots.numel(), device=dev),
        block_q=block_q,
        query_window=query_window,
        scratch_keys=torch.from_numpy(scratch_keys).to(dev),
    )


def score_tiles(
    query_start_loc: np.ndarray,
    kv_indptr: np.ndarray,
    query_window: int | np.ndarray | None,
    block_q: int | None = None,
    group: int = 1,
) -> tuple[np.ndarray, int, np.ndarray]:
    """`build_score_plan`'s host part: (tiles int32 [5, num_tiles], block_q,
    scratch_keys int64)."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    kv = np.asarray(kv_indptr, dtype=np.int64)
    assert qsl.shape == kv.shape, "plan mismatch"
    qlen, klen = np.diff(qsl), np.diff(kv)
    rows = np.where(klen > 0, qlen, 0)  # no keys: not on the read
    if query_window is not None:
        rows = np.minimum(rows, query_window)
    if block_q is None:
        block_q = 1 if rows.max(initial=0) <= 1 else gpu_block_q(group)
    per_req = -(-rows // block_q)
    req = np.repeat(np.arange(rows.size), per_req)
    nth = np.arange(req.size) - np.repeat(np.cumsum(per_req) - per_req, per_req)
    first = qsl[1:] - rows  # each request's first counted row
    # "max": a request whose rows span tiles sums each head over programs
    # before the max: its keys get a place in the scratch, in request order.
    spans = per_req > 1
    scratch_len = np.where(spans, klen, 0)
    scratch_at = np.where(spans, np.cumsum(scratch_len) - scratch_len, -1)
    tiles = np.stack(
        [
            first[req] + nth * block_q,
            qsl[1:][req],
            kv[:-1][req],
            klen[req],
            scratch_at[req],
        ]
    ).astype(np.int32)
    return tiles, int(block_q), ranges(kv[:-1][spans], klen[spans])


def triton_attention_mass(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: ScorePlan,
    scale: float,
    aggregate: str = "mean",
    block_n: int = 64,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every key's attention mass for one layer, one kernel launch (Triton).

    Args:
        query: [T, Hq, D] the step's queries.
        kv_cache: [N, 2, B, Hkv, D] TRITON_ATTN cache (K at [:, 0], V at [:, 1]).
        plan: The step's `build_score_plan`.
        scale: Softmax scale.
        aggregate: "mean" (summed over query heads) or "max" (the max over
            heads in the kernel; for requests whose rows span tiles, a
            [Hq, their keys] scratch, then its max: one reduce more).
        block_n: Keys per inner tile.
        k_scale: An fp8 cache's K scale (float32, one element, on the
            device): its keys are read as vLLM's kernel reads them (as they
            are against an fp8 query, else dequantized). None for a cache
            of the model's dtype.

    Returns:
        float32 [K]: mass of key kv_slots[j], summed over counted query rows.
    """
    import triton

    from vllm.vtoken.score_triton import score_mass_kernel

    _, _, block, hkv, d = kv_cache.shape
    _, hq, dq = query.shape
    assert dq == d and hq % hkv == 0, (tuple(query.shape), tuple(kv_cache.shape))
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1, "head rows not dense"
    assert (k_scale is not None) == (kv_cache.element_size() == 1), (
        "an fp8 cache's keys need its scale, and only they"
    )
    num_keys = plan.kv_slots.numel()
    top = aggregate == "max"
    mass = torch.zeros(num_keys, dtype=torch.float32, device=query.device)
    if plan.num_tiles == 0:
        return mass
    spans = plan.scratch_keys
    num_scratch = spans.numel() if top else 0
    scratch = mass  # not read: no tile has a place in a scratch
    if num_scratch:
        scratch = torch.zeros(hq, num_scratch, dtype=torch.float32, device=mass.device)
    g_pad = triton.next_power_of_2(hq // hkv)
    assert plan.block_q <= gpu_block_q(hq // hkv), (
        f"a plan of {plan.block_q}-row tiles for {hq // hkv} query heads per "
        "KV head (build it with group=)"
    )
    score_mass_kernel[(plan.num_tiles, hkv)](
        query,
        kv_cache,
        plan.kv_slots,
        plan.tiles,
        mass,
        scratch,
        scale,
        mass if k_scale is None else k_scale,  # not read without FP8
        plan.num_tiles,
        num_scratch,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        BLOCK=block,
        G=hq // hkv,
        G_PAD=g_pad,
        BLOCK_Q=plan.block_q,
        BLOCK_M=max(16, plan.block_q * g_pad),
        BLOCK_N=block_n,
        HEAD_DIM=d,
        D_PAD=triton.next_power_of_2(d),
        TOP=top,
        IEEE=query.dtype == torch.float32,
        FP8=k_scale is not None,
    )
    if num_scratch:
        mass[spans] = scratch.amax(dim=0)
    return mass
