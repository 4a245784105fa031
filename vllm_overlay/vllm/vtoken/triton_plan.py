# SPDX-License-Identifier: Apache-2.0
"""The TRITON_ATTN token read's per-step plan, built once for every layer.

Worker side. From the step's live slots per request (`TokenRead`): the
one-token-page row table `unified_attention` reads as its block table, the
live lengths, the compacted query rows of the requests the read writes, and
the score kernel's `ScorePlan`. Everything is computed on the host in NumPy
and reaches the device in one non-blocking copy (staging.py); on the device
only a scatter builds the table.

    slot (n, b)  ->  K row n * 2B + b,  V row the same + B
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm.vtoken.arena import indptr_of, ranges
from vllm.vtoken.score_kernel import ScorePlan, score_tiles
from vllm.vtoken.staging import HostToDevice


@dataclass(frozen=True)
class TritonReadPlan:
    """One step's read on TRITON_ATTN, shared by every layer: the requests
    that take their output from it (those with a dead token), compacted."""

    token_table: torch.Tensor | None  # [R', W] int32 row ids; None: no request
    live_lens: torch.Tensor  # [R'] int32
    query_start_loc: torch.Tensor  # [R' + 1] int32, on the device
    rows: torch.Tensor | None  # int64 their query rows in the step; None: all
    max_query_len: int
    max_live_len: int
    block_size: int
    score: ScorePlan | None = None  # every scored request's keys; None: no scores
    kv_slots: torch.Tensor | None = None  # the step's TokenRead.kv_slots, uploaded


def build_triton_read_plan(
    query_start_loc: np.ndarray,
    kv_indptr: np.ndarray,
    kv_slots: np.ndarray | torch.Tensor,
    block_size: int,
    write: np.ndarray | None = None,
    *,
    scored: bool = False,
    score_query_window: int | np.ndarray | None = None,
    score_group: int = 1,
    stage: HostToDevice | None = None,
) -> TritonReadPlan:
    """See `TokenRead` for the arguments. Built on the host, then uploaded in
    one copy through `stage` (staging.py; default: a fresh one on
    `kv_slots`'s device). The worker passes `kv_slots` as NumPy; a tensor is
    read back first (tests).

    `write` (bool [R], default all): the requests whose output the read
    writes; the others (read for their scores only, or not at all) take vLLM's
    kernel output, which the backend computes for the whole batch first.
    `scored`: the step accumulates scores (`TokenRead.scores` set), so the plan
    carries the `ScorePlan` of every request with keys, counting each one's
    last `score_query_window` query rows (SnapKV; a number, or one per
    request), or all of them, in tiles sized for `score_group` query heads
    per KV head (`score_kernel.gpu_block_q`).
    """
    if isinstance(kv_slots, torch.Tensor):
        stage = stage or HostToDevice(kv_slots.device)
        kv_slots = kv_slots.cpu().numpy()
    assert stage is not None, "a NumPy kv_slots needs the stage of its device"
    qsl_all = np.asarray(query_start_loc, dtype=np.int64)
    indptr = np.asarray(kv_indptr, dtype=np.int64)
    lens, qlens = np.diff(indptr), np.diff(qsl_all)
    sel = lens > 0 if write is None else np.asarray(write, bool) & (lens > 0)
    host = {"kv_slots": kv_slots}
    slots = kv_slots
    if not sel.all():  # compact the writing requests: query rows and keys
        idx = np.flatnonzero(sel)
        host["rows"] = ranges(qsl_all[idx], qlens[idx])
        slots = kv_slots[ranges(indptr[idx], lens[idx])]
        lens, qlens = lens[idx], qlens[idx]
    host["qsl"] = indptr_of(qlens)
    host["lens"] = lens
    width = max(64, -(-int(lens.max()) // 64) * 64) if lens.size else 0
    # unified_attention loads table entries up to the live length rounded up
    # to its tile unmasked: row 0 pads them (a valid address, masked out).
    # Key j of row r goes to r * width + (j - start of r): one offset a row,
    # repeated (a third of the passes over the keys of a gather by row).
    row_offset = np.arange(lens.size) * width - (np.cumsum(lens) - lens)
    host["table_at"] = np.arange(slots.size) + np.repeat(row_offset, lens)
    host["table_rows"] = slots_to_rows(slots, block_size)
    if scored:
        host["tiles"], block_q, host["scratch_keys"] = score_tiles(
            qsl_all, indptr, score_query_window, group=score_group
        )
    dev = stage.upload(host)
    device = stage.device
    table = None
    if lens.size:
        table = torch.zeros(lens.size * width, dtype=torch.int32, device=device)
        table[dev["table_at"]] = dev["table_rows"].to(torch.int32)
        table = table.view(lens.size, width)
    score = None
    if scored:
        score = ScorePlan(
            tiles=dev["tiles"].to(torch.int32),
            num_tiles=host["tiles"].shape[1],
            kv_slots=dev["kv_slots"],
            positions=torch.arange(kv_slots.size, device=device),
            block_q=block_q,
            query_window=score_query_window,
            scratch_keys=dev["scratch_keys"],
        )
    return TritonReadPlan(
        token_table=table,
        live_lens=dev["lens"].to(torch.int32),
        query_start_loc=dev["qsl"].to(torch.int32),
        rows=dev.get("rows"),
        max_query_len=int(qlens.max(initial=0)),
        max_live_len=int(lens.max(initial=0)),
        block_size=block_size,
        score=score,
        kv_slots=dev["kv_slots"],
    )


def slots_to_rows(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Maps slots to rows of the one-token-page view of a TRITON_ATTN cache.

    With `[N, 2, B, H, D]` viewed as `[N * 2 * B, 1, H, D]`, K of slot
    `(n, b)` is row `n * 2B + b` and V is the same row of the view shifted by
    B rows.

    Args:
        slots: `[S]` int64.
        block_size: B, a power of two (config.py refuses others).

    Returns:
        `[S]` int64 row ids.
    """
    assert block_size & (block_size - 1) == 0, block_size
    # n * 2B + b = slot + n * B, and n * B is the slot with its low bits
    # cleared: no division (4.5x the old `//` and `%` at 35k slots).
    return slots + (slots & -block_size)
