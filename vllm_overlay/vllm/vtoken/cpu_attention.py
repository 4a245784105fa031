# SPDX-License-Identifier: Apache-2.0
"""CPU_ATTN attention that reads only live tokens, through the slot map.

Dead tokens are excluded by never reading their slots: each request gives its
live slots in logical order, the current query tokens last (they were just
written to their slots), and attention runs over exactly those keys.

    logical   t0  t1  t2  t3  t4  t5  (q0 q1 = this step's queries)
    live       1   0   1   1   0   1    1  1
    kv_slots  [s0,     s2, s3,     s5, q0, q1]  -> Lk = 6, Lq = 2

The causal mask is bottom-right in live-index space: query i of Lq sees keys
`[0, Lk - Lq + i]`. RoPE positions stay logical; only the read changes.

Worker side, ISA vec/vec16 (the GPU read is triton_attention.py). Decode
requests (one query each) run as one padded batch, K/V gathered straight into
the matmul layout; the others (prefills) with SDPA per request or, when scores
are wanted, by query tiles (`score_kernel.tiled_attention`: output and masses
per tile, no [Hq, Lq, Lk] probabilities). The index tensors are built once per
step by the worker (`build_cpu_read_plan`) and shared by every layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from vllm.vtoken.arena import block_shift
from vllm.vtoken.score_kernel import tiled_attention

if TYPE_CHECKING:
    from vllm.vtoken.scores import ScoreAccumulator


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
    masked by `valid`, None when no request is padded); `v_rows`
    `[R * H * W]` are the same keys as rows of the value cache viewed
    `[N * H * B, D]`, one per KV head. Requests with several
    queries (prefills) read `other_slots`: request `others[i]` has query rows
    `other_q[i]` and keys `[other_loc[i], other_loc[i + 1])` of it. `score_pos`
    lists every key read (its position in `kv_slots`), in the order the masses
    are concatenated; empty when that is every key in order
    (`scores_in_order`). A request whose output vLLM's kernel already wrote
    (`decode_write` / `other_write` False) is read for its attention masses
    only.
    """

    num_decode: int
    q_rows: torch.Tensor  # [R] int64: query row of each decode request
    # The same rows as a slice when they follow one another (a step of
    # decodes): the queries are read, and the outputs written, as views.
    q_span: slice | None
    blk: torch.Tensor  # [R, W] int64
    off: torch.Tensor  # [R, W] int64
    v_rows: torch.Tensor  # [R * H * W] int64
    valid: torch.Tensor | None  # [R, W] bool; None: none padded
    # Derived once a step, not once a layer: `valid`'s complement shaped for
    # the logits [R, 1, 1, W], the flat positions of the valid entries of
    # [R, W] (the masses' gather), both None when no request is padded (every
    # request at its budget: no mask, the masses in order), and whether the
    # masses come in for every key in order (a read of decodes only: they
    # add to the step buffer as is, and `score_pos` is left empty).
    pad: torch.Tensor | None
    valid_at: torch.Tensor | None
    scores_in_order: bool
    others: list[int]
    other_q: list[tuple[int, int]]
    other_slots: torch.Tensor  # [S'] int64
    other_loc: list[int]
    score_pos: torch.Tensor  # [S''] int64; empty when scores_in_order
    decode_write: torch.Tensor | None  # [R] bool; None: write every row
    other_write: list[bool]
    # "window" scores (SnapKV): decode requests whose row counts (None: all),
    # and each other request's counted last rows (None: scores' window).
    decode_counted: torch.Tensor | None = None  # [R] bool
    other_rows: list[int] | None = None


def build_cpu_read_plan(
    query_start_loc: np.ndarray,
    kv_indptr: np.ndarray,
    kv_slots: np.ndarray,
    block_size: int,
    num_kv_heads: int,
    write: np.ndarray | None = None,
    score_rows: np.ndarray | None = None,
) -> CpuReadPlan:
    """The index tensors of one step's read, for every layer.

    Args:
        query_start_loc: `[R + 1]` int, query rows of request r.
        kv_indptr: `[R + 1]` int, request r's entries in `kv_slots`.
        kv_slots: `[S]` int64, per request its live slots in logical order,
            its current query tokens last.
        block_size: B.
        num_kv_heads: H of the cache.
        write: `[R]` bool, whose output the read writes (default: all).
        score_rows: `[R]` int, per request its last query rows whose
            attention counts toward "window" scores (0: none); default: the
            scores' own window.
    """
    q_loc = np.ascontiguousarray(query_start_loc, dtype=np.int64)
    if write is None:
        write = np.ones(q_loc.size - 1, dtype=bool)
    return cpu_read_plan(
        q_loc,
        np.ascontiguousarray(kv_indptr, dtype=np.int64),
        np.ascontiguousarray(kv_slots, dtype=np.int64),
        block_shift(block_size),
        num_kv_heads,
        np.ascontiguousarray(write, dtype=bool),
        None if score_rows is None else np.ascontiguousarray(score_rows, np.int64),
    )


_NO_ROWS = np.zeros(0, np.int64)
# A step of decodes' other_slots and score_pos.
_NO_SLOTS = torch.zeros(0, dtype=torch.int64)


@functools.cache
def _read_kernels():
    # numba: imported with vToken on only, and once (an import statement
    # in the step's path costs ~15 µs on the caches the forward left).
    import vllm.vtoken.read_kernels

    return vllm.vtoken.read_kernels


def cpu_read_plan(q_loc, kv_loc, slots, shift, num_kv_heads, write, score_rows):
    """`build_cpu_read_plan` of int64 arrays (bool `write`, [R]): the
    worker's call, one compiled pass (read_kernels.cpu_plan_index) and the
    tensors' wrapping; a step of decodes makes no per-prefill lists."""
    read_kernels = _read_kernels()
    rows = _NO_ROWS if score_rows is None else score_rows
    (
        decode,
        others,
        blk,
        off,
        v_rows,
        valid,
        score_pos,
        other_slots,
        other_loc,
        flags,
    ) = read_kernels.cpu_plan_index(
        q_loc, kv_loc, slots, write, rows, shift, num_kv_heads
    )
    if others.size:
        q0, q1 = q_loc[others].tolist(), q_loc[others + 1].tolist()
        other_q, other_write = list(zip(q0, q1, strict=True)), write[others].tolist()
        other_rows = None if score_rows is None else score_rows[others].tolist()
        others, other_loc = others.tolist(), other_loc.tolist()
    else:  # decodes only
        other_q, other_write, others, other_loc = [], [], [], [0]
        other_rows = None if score_rows is None else []
    r, w = blk.shape
    q_rows = q_loc[decode]  # ascending: each decode has one query row
    padded = flags & read_kernels.PADDED
    in_order = bool(flags & read_kernels.IN_ORDER)
    return CpuReadPlan(
        num_decode=decode.size,
        q_rows=torch.from_numpy(q_rows),
        q_span=slice(int(q_rows[0]), int(q_rows[0]) + r)
        if r and q_rows[-1] - q_rows[0] == r - 1
        else None,
        blk=torch.from_numpy(blk),
        off=torch.from_numpy(off),
        v_rows=torch.from_numpy(v_rows),
        valid=torch.from_numpy(valid) if padded else None,
        others=others,
        other_q=other_q,
        other_slots=torch.from_numpy(other_slots) if others else _NO_SLOTS,
        other_loc=other_loc,
        score_pos=_NO_SLOTS if in_order else torch.from_numpy(score_pos),
        decode_write=torch.from_numpy(write[decode])
        if flags & read_kernels.SCORE_ONLY
        else None,
        other_write=other_write,
        decode_counted=torch.from_numpy(score_rows[decode] > 0)
        if flags & read_kernels.UNCOUNTED
        else None,
        other_rows=other_rows,
        pad=torch.from_numpy(~valid).view(r, 1, 1, w) if padded else None,
        valid_at=torch.from_numpy(valid.reshape(-1).nonzero()[0]) if padded else None,
        scores_in_order=in_order,
    )


def cpu_forward(
    read: Any,  # the step's context.TokenRead (not imported: context imports us)
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    scale: float,
) -> None:
    """CPU_ATTN's forward with vToken on: the step's read over live tokens."""
    cpu_token_attention(
        query, key_cache, value_cache, output, read.plan, scale, read.scores
    )


def cpu_token_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    plan: CpuReadPlan,
    scale: float,
    scores: ScoreAccumulator | None = None,
) -> None:
    """Causal attention of each request's queries over its live slots (CPU).

    Args:
        query: `[T, Hq, D]`.
        key_cache: `[N, H, B, D]`, K pages stored `[D, B]` (vec/vec16).
        value_cache: `[N, H, B, D]`.
        output: `[T, Hq, D]` (or `[T, Hq * D]`), written in place for every
            request with at least one query token.
        plan: The step's `build_cpu_read_plan`.
        scale: softmax scale.
        scores: When given, `attn_mass[j]` (probabilities summed over query
            heads and query rows) is added once for every key read.
    """
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    out = output.view(output.shape[0], num_q_heads, head_dim)
    masses = []
    top = scores is not None and scores.aggregate == "max"
    if plan.num_decode:
        mass = _decode_batched(
            query, key_cache, value_cache, out, plan, scale, scores is not None, top
        )
        if mass is not None:
            if plan.decode_counted is not None:  # a one-row chunk of a prefill
                mass.masked_fill_(~plan.decode_counted[:, None], 0.0)
            mass = mass.view(-1)
            if plan.valid_at is not None:  # padded: its valid entries
                mass = mass.index_select(0, plan.valid_at)
            masses.append(mass)
    if plan.others:
        key, value = gather_live_kv(key_cache, value_cache, plan.other_slots)
        gqa = num_q_heads != key.shape[1]
        for i, (q0, q1) in enumerate(plan.other_q):
            k0, k1 = plan.other_loc[i], plan.other_loc[i + 1]
            q = query[q0:q1].transpose(0, 1)  # [Hq, Lq, D]
            k = key[k0:k1].transpose(0, 1)  # [H, Lk, D]
            v = value[k0:k1].transpose(0, 1)
            w = None if scores is None else min(scores.query_window or q1 - q0, q1 - q0)
            if plan.other_rows is not None:  # SnapKV: this request's own count
                w = plan.other_rows[i]
            if not w:  # no scores, or a chunk before the prompt's last queries
                if scores is None or plan.other_write[i]:
                    mask = _causal_mask(q1 - q0, k1 - k0)
                    # 4-D: torch's CPU flash kernel. 3-D inputs take its math
                    # path: [Hq, Lq, Lk] logits and K/V repeated per query
                    # head (+2.4 GiB and 4-10x the time at 4k tokens).
                    o = F.scaled_dot_product_attention(
                        q[None], k[None], v[None], attn_mask=mask, scale=scale,
                        enable_gqa=gqa,
                    )  # fmt: skip
                    out[q0:q1] = o[0].transpose(0, 1)
                if scores is not None:
                    masses.append(torch.zeros(k1 - k0))
                continue
            # Output and masses by query tiles: no [Hq, Lq, Lk] probabilities.
            # SnapKV ("window" scores): only the last rows' attention counts,
            # and a score-only read computes nothing else: O(window x Lk).
            if plan.other_write[i]:
                o = out[q0:q1].transpose(0, 1)  # written in place, per tile
                per_head = tiled_attention(q, k, v, scale, mass_rows=w, out=o)
            else:  # read for its scores only
                per_head = tiled_attention(q[:, -w:], k, None, scale)
            masses.append(per_head.amax(dim=0) if top else per_head.sum(dim=0))
    if scores is not None and masses:
        mass = masses[0] if len(masses) == 1 else torch.cat(masses)
        scores.add(None if plan.scores_in_order else plan.score_pos, mass)


def _decode_batched(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    plan: CpuReadPlan,
    scale: float,
    scored: bool,
    top: bool = False,
) -> torch.Tensor | None:
    # Requests with one query each, in one padded batch: a handful of ops per
    # layer instead of several per request, which dominate CPU decode steps.
    # K and V are gathered straight from the cache into the [R, H, W, D] layout
    # the matmuls want (one copy each; V rows are contiguous, so index_select,
    # several times faster than advanced indexing). Returns the mass [R, W],
    # summed over query heads, or the largest one head gave (`top`); None
    # unless `scored` (a policy without scores: no reduction a layer).
    num_blocks, heads, block, head_dim = key_cache.shape
    num_reqs, num_q_heads = plan.num_decode, query.shape[1]
    h = _head_index(heads)
    blk, off = plan.blk[:, None, :], plan.off[:, None, :]
    k = key_cache.view(num_blocks, heads, head_dim, block)[blk, h, :, off]
    v = value_cache.view(-1, head_dim).index_select(0, plan.v_rows)
    v = v.view(num_reqs, heads, -1, head_dim)
    # GQA: query head h * G + g reads KV head h (h // G, as SDPA's enable_gqa).
    # Every op here runs once a layer: a step of decodes (q_span, no padding,
    # every row written) makes none it can do without (the scale is the
    # product's alpha; at the benchmark's shapes, bit for bit what
    # multiplying the logits gave).
    span = plan.q_span
    q = query[span] if span is not None else query[plan.q_rows]
    # reshape: a float32 query is a view of vLLM's fused qkv (rows strided),
    # and .float() then copies nothing.
    q = q.float().reshape(num_reqs * heads, -1, head_dim)  # [R * H, G, D]
    k = k.float().view(num_reqs * heads, -1, head_dim)  # [R * H, W, D]
    logits = torch.baddbmm(_NO_INPUT, q, k.transpose(-1, -2), beta=0, alpha=scale)
    logits = logits.view(num_reqs, heads, -1, k.shape[1])  # [R, H, G, W]
    if plan.pad is not None:
        logits.masked_fill_(plan.pad, float("-inf"))
    probs = logits.softmax(dim=-1)
    w = plan.decode_write
    if w is None:  # every row written
        o = torch.matmul(probs, v.float())  # [R, H, G, D]
        o = o.view(num_reqs, num_q_heads, head_dim)
        if span is not None:
            out[span] = o
        else:
            out[plan.q_rows] = o.to(out.dtype)
    else:  # rows read for their scores only get no output
        o = torch.matmul(probs[w], v[w].float())  # [R', H, G, D]
        rows = plan.q_rows[w]
        out[rows] = o.reshape(len(rows), num_q_heads, head_dim).to(out.dtype)
    if not scored:
        return None
    return probs.amax(dim=(1, 2)) if top else probs.sum(dim=(1, 2))


# baddbmm's `input`, ignored with beta=0 (never written: a shared constant).
_NO_INPUT = torch.zeros(1, dtype=torch.float32)


@functools.cache
def _head_index(heads: int) -> torch.Tensor:
    # [1, H, 1]: the KV heads' index for the decode gather, made once (never
    # written: a shared constant).
    return torch.arange(heads)[None, :, None]
