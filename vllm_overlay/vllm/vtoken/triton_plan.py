# SPDX-License-Identifier: Apache-2.0
"""The TRITON_ATTN token read's per-step plan, built once for every layer.

Worker side. From the step's live slots per request (`TokenRead`): the
one-token-page row table `unified_attention` reads as its block table, the
live lengths, the compacted query rows of the requests the read writes, and
the score kernel's `ScorePlan`. Everything is computed on the host in NumPy
and reaches the device in one non-blocking copy (staging.py); on the device
only a scatter builds the table, in a buffer the model runner reserved in
vLLM's profile run (`reserve_token_table`), so that vLLM sizes the KV cache
around it.

    slot (n, b)  ->  K row n * 2B + b,  V row the same + B

    the buffer, flat:  | request 0: W row ids | request 1: W | ... | stale ...
                       a step's table: its first R' * W entries, [R', W]
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
    table_buffer: torch.Tensor | None = None,
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
    per KV head (`score_kernel.gpu_block_q`). `table_buffer`: the
    `reserve_token_table` buffer the token table is laid in (default: a
    fresh one, zeros).
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
    width = table_width(int(lens.max())) if lens.size else 0
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
        size = lens.size * width
        if table_buffer is None:
            table_buffer = torch.zeros(size, dtype=torch.int32, device=device)
        assert size <= table_buffer.numel(), (
            f"a token table of {lens.size} x {width} past its reserve "
            f"({table_buffer.numel()}: max_num_seqs x max_model_len)"
        )
        # Entries past a live length keep what an earlier step wrote there:
        # row ids, valid addresses the kernel masks out (table_width).
        table = table_buffer[:size]
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


def table_width(longest: int) -> int:
    """The token table's width for a longest live list of `longest`: a
    multiple of 64, as unified_attention loads table entries up to the live
    length rounded up to its tile (at most 32) without a mask. Those entries
    hold row ids, valid addresses whose keys it masks out."""
    return max(64, -(-longest // 64) * 64)


def token_table_size(max_rows: int, max_live: int) -> int:
    """Entries of the largest step's token table: `max_rows` rows of
    `table_width(max_live)` (what reserve_token_table allocates, and what
    VTokenConfig keeps under vLLM's int32 table offsets)."""
    return max_rows * table_width(max_live)


def reserve_token_table(
    max_rows: int, max_live: int, device: torch.device | str
) -> torch.Tensor:
    """The device buffer every step's token table is laid in: room for
    `max_rows` rows of `table_width(max_live)` entries, int32, flat, zeros
    (row 0: a valid address).

    A step's table is rows read x the longest live list read, rounded up:
    at most max_num_seqs x max_model_len (e.g. 256 x 8k: 8 MiB; 1,024 x
    128k: 512 MiB). The model runner allocates it inside vLLM's profile run
    (`VTokenWorker.reserve_token_table`), which sizes the KV cache around
    what that run holds at its peak. (Allocated and zeroed in each step, as
    it was, it came out of the headroom --gpu-memory-utilization leaves.)"""
    size = token_table_size(max_rows, max_live)
    return torch.zeros(size, dtype=torch.int32, device=device)


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
