# SPDX-License-Identifier: Apache-2.0
"""One-launch Triton copy of token slots across every layer (worker side, GPU).

The GPU fast path of `KVCopyExecutor` for the TRITON_ATTN layout. Each layer's
cache is `[N, 2, B, H, D]` with the `[H, D]` token row contiguous, so one token
slot `s = n * B + b` is two contiguous rows of `H * D` elements: K at
`(n, 0, b)` and V at `(n, 1, b)`. The kernel gets the layers' base addresses
as an int64 table (the pointer-array idiom of vLLM's `mamba_utils.batch_memcpy`)
and copies raw machine words, so the copy is byte-exact for every KV dtype.

Grid: `(num_moves, num_layers)`; program `(m, l)` copies slot `src[m]` to slot
`dst[m]` in layer `l`, K row then V row. Verified on CPU tensors under
`TRITON_INTERPRET=1` against the torch index path (tests/runtime).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# Words per program per loop trip; a Llama row (8 heads x 128 x bf16) is 512.
_MAX_CHUNK_WORDS = 1024


@triton.jit
def _copy_kv_slots_kernel(
    layer_ptrs,  # [L] int64: base address of each layer's cache
    src_slots,  # [M] int64
    dst_slots,  # [M] int64
    stride_block,  # words between blocks (dim 0)
    stride_kv,  # words between the K and V halves (dim 1)
    stride_tok,  # words between token rows (dim 2)
    BLOCK_SIZE: tl.constexpr,
    ROW_WORDS: tl.constexpr,
    CHUNK: tl.constexpr,
    WORD_BYTES: tl.constexpr,
):
    move = tl.program_id(0)
    layer = tl.program_id(1)
    addr = tl.load(layer_ptrs + layer)
    if WORD_BYTES == 4:
        base = addr.to(tl.pointer_type(tl.int32))
    elif WORD_BYTES == 2:
        base = addr.to(tl.pointer_type(tl.int16))
    else:
        base = addr.to(tl.pointer_type(tl.int8))
    src = tl.load(src_slots + move).to(tl.int64)
    dst = tl.load(dst_slots + move).to(tl.int64)
    src_row = (src // BLOCK_SIZE) * stride_block + (src % BLOCK_SIZE) * stride_tok
    dst_row = (dst // BLOCK_SIZE) * stride_block + (dst % BLOCK_SIZE) * stride_tok
    offs = tl.arange(0, CHUNK)
    for kv in tl.static_range(2):
        for start in tl.static_range(0, ROW_WORDS, CHUNK):
            idx = start + offs
            mask = idx < ROW_WORDS
            words = tl.load(base + src_row + kv * stride_kv + idx, mask=mask)
            tl.store(base + dst_row + kv * stride_kv + idx, words, mask=mask)


class TritonKVSlotCopier:
    """Copies K and V of token slots for all layers with one kernel launch.

    Holds references to the caches so the base addresses in its pointer table
    stay valid. Launches on the current CUDA stream; the caller picks the
    stream (`KVCopyExecutor` uses its side stream).
    """

    def __init__(self, kv_caches: Sequence[torch.Tensor], block_size: int) -> None:
        """Builds the per-layer pointer table.

        Args:
            kv_caches: per layer, `[N, 2, B, H, D]` (TRITON_ATTN layout), all of
                one shape, dtype, strides and device; `[H, D]` contiguous.
            block_size: B, tokens per block.

        Raises:
            ValueError: if the caches do not share one layout as described.
        """
        if not kv_caches:
            raise ValueError("no KV caches given")
        first = kv_caches[0]
        if first.dim() != 5 or first.shape[1] != 2 or first.shape[2] != block_size:
            raise ValueError(
                f"expected [N, 2, {block_size}, H, D] caches, got {tuple(first.shape)}"
            )
        for cache in kv_caches:
            if (
                cache.shape != first.shape
                or cache.stride() != first.stride()
                or cache.dtype != first.dtype
                or cache.device != first.device
            ):
                raise ValueError("all layer caches must share shape, strides, dtype")
        _, _, _, heads, head_dim = first.shape
        if first.stride(4) != 1 or first.stride(3) != head_dim:
            raise ValueError("each token's [H, D] row must be contiguous")
        elt = first.element_size()
        row_bytes = heads * head_dim * elt
        # The widest word that divides the row, the strides and every base
        # address: whole aligned words keep the copy byte-exact for any dtype.
        sizes = [row_bytes, *(s * elt for s in first.stride()[:3])]
        sizes += [c.data_ptr() for c in kv_caches]
        self.word_bytes = next(w for w in (4, 2, 1) if all(x % w == 0 for x in sizes))
        self.row_words = row_bytes // self.word_bytes
        self.strides = tuple(first.stride(i) * elt // self.word_bytes for i in range(3))
        self.block_size = block_size
        self._caches = list(kv_caches)
        self.layer_ptrs = torch.empty(
            len(self._caches), dtype=torch.int64, device=first.device
        )
        self.write_layer_ptrs()

    def write_layer_ptrs(self) -> None:
        """(Re)writes the device table of layer base addresses (at start-up,
        and after vLLM's wake-up: allocated in the KV cache's memory pool,
        it comes back with the cache's addresses but not its contents)."""
        ptrs = [c.data_ptr() for c in self._caches]
        self.layer_ptrs.copy_(torch.tensor(ptrs, dtype=torch.int64))

    def copy(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copies slot `src_slots[i]` to `dst_slots[i]` in every layer.

        Args:
            src_slots: `[M]` int64 on the caches' device; validated by the caller.
            dst_slots: `[M]` int64; unique and disjoint from `src_slots`.
        """
        num_moves = src_slots.numel()
        if num_moves == 0:
            return
        chunk = min(triton.next_power_of_2(self.row_words), _MAX_CHUNK_WORDS)
        grid = (num_moves, len(self._caches))
        _copy_kv_slots_kernel[grid](
            self.layer_ptrs,
            src_slots,
            dst_slots,
            self.strides[0],
            self.strides[1],
            self.strides[2],
            BLOCK_SIZE=self.block_size,
            ROW_WORDS=self.row_words,
            CHUNK=chunk,
            WORD_BYTES=self.word_bytes,
        )
