# SPDX-License-Identifier: Apache-2.0
"""KV copy executor: moves token slots' K and V in every layer (worker side).

The only vToken code that writes KV memory. The scheduler's planner sends move
batches `(batch_id, src_slots, dst_slots)`; this module copies K and V of each
source slot to its destination slot in every layer and reports when a batch
has landed, so the worker can switch its slot map and acknowledge.

    before (B = 4)                        after the copy
    blk 7: [a  .  b  .]  src 28, 30       blk 7: [a  .  b  .]  (freed on ack)
    blk 9: [.  .  .  .]  dst 36, 37       blk 9: [a  b  .  .]

Sources are never overwritten, so attention may keep reading them until the
switch. On CPU the copy is synchronous (the "cpu" layout by a compiled loop a
layer, kv_copy_cpu.py). On CUDA it runs on a side stream that
first waits for the current stream (earlier forwards wrote the sources); an
event marks completion and `poll()` reports the batch once the event is done.
Slot `s` is `(block s // B, offset s % B)`. Layouts: "cpu" is vLLM's CPU_ATTN
`[2, N, H, B, D]` with each (block, head) K page stored transposed `[D, B]`
(ISA vec/vec16); "triton" is TRITON_ATTN's `[N, 2, B, H, D]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.vtoken import integrity
from vllm.vtoken.arena import block_shift

LAYOUTS = ("cpu", "triton")


@dataclass(slots=True)
class _PendingCopy:
    batch_id: int
    event: Any  # torch.cuda.Event recorded on the side stream
    src: torch.Tensor  # [M] int64 on the KV device (allocated on the side stream)
    dst: torch.Tensor  # [M] int64
    host: torch.Tensor  # [2, M] pinned staging buffer, kept alive until done


def slot_pairs(src: np.ndarray, dst: np.ndarray) -> torch.Tensor:
    """int64 [2, M'] (M' = M rounded up to 16) with `src` and `dst` in its
    rows' first M entries. The second row then starts 128-byte aligned
    whatever M, so Triton compiles the copy kernel once: it specializes a
    pointer on its 16-byte alignment, and an even M compiled a second
    variant mid-run, past the one-move warm-up's."""
    m = -(-src.size // 16) * 16
    out = torch.zeros(2, m, dtype=torch.int64)
    out[0, : src.size] = torch.from_numpy(np.asarray(src, np.int64))
    out[1, : dst.size] = torch.from_numpy(np.asarray(dst, np.int64))
    return out


class KVCopyExecutor:
    """Copies K and V of token slots for all layers; reports finished batches.

    Attention scores are per logical token (scores.py), so nothing else moves.
    """

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layout: str,
        block_size: int,
        *,
        use_triton: bool = True,
    ) -> None:
        """Checks the caches and prepares the copy path.

        Args:
            kv_caches: one tensor per layer, all of one shape, dtype and device:
                `[2, N, H, B, D]` contiguous for "cpu", `[N, 2, B, H, D]` with
                each token's `[H, D]` row contiguous for "triton".
            layout: "cpu" or "triton".
            block_size: B, tokens per block.
            use_triton: on CUDA with the "triton" layout, copy with the
                one-launch Triton kernel; False uses torch index ops per layer.

        Raises:
            ValueError: unknown layout, no caches, or caches of the wrong shape.
        """
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if not kv_caches:
            raise ValueError("no KV caches given")
        first = kv_caches[0]
        for cache in kv_caches:
            if (
                cache.shape != first.shape
                or cache.dtype != first.dtype
                or cache.device != first.device
            ):
                raise ValueError("all layer caches must share shape, dtype, device")
        if first.dim() != 5:
            raise ValueError(f"expected 5-D caches, got {tuple(first.shape)}")
        if layout == "cpu":
            two, num_blocks, heads, blk, head_dim = first.shape
            if first.device.type != "cpu":
                raise ValueError("the 'cpu' layout needs CPU tensors")
            if not all(c.is_contiguous() for c in kv_caches):
                raise ValueError("'cpu' layout caches must be contiguous")
        else:
            num_blocks, two, blk, heads, head_dim = first.shape
            if first.stride(4) != 1 or first.stride(3) != head_dim:
                raise ValueError("each token's [H, D] row must be contiguous")
        if two != 2 or blk != block_size:
            raise ValueError(
                f"cache shape {tuple(first.shape)} does not match layout "
                f"{layout!r} with block size {block_size}"
            )
        self.layout = layout
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self._caches = list(kv_caches)
        self._device = first.device
        self._is_cuda = first.device.type == "cuda"
        # K and V rows of one slot, all layers.
        self._slot_bytes = 2 * heads * head_dim * first.element_size() * len(kv_caches)
        self._bytes_copied = 0
        self._done: list[int] = []
        self._pending: list[_PendingCopy] = []
        self._stream: Any = None
        # Built here, not at the first submit: its pointer table's upload would
        # then wait for the forward in flight.
        self._triton: Any = None
        if use_triton and self._is_cuda and layout == "triton":
            self._triton = _make_triton_copier(self._caches, block_size)
        # CPU layout: each layer's K and V as NumPy views of their bits, for
        # the compiled copy (kv_copy_cpu.py; numba, imported here only).
        if layout == "cpu":
            from vllm.vtoken import kv_copy_cpu

            self._copy_cpu = kv_copy_cpu.copy_slots
            self._shift = block_shift(blk)
            self._cpu_views = [kv_copy_cpu.layer_views(c) for c in kv_caches]

    def warm_up(self) -> None:
        """Compiles the copy kernel at start-up, not in the first compacting
        step (a multi-second stall): one move, slot 0 to slot 1, while the
        caches hold no token yet. Blocks until it ran; counts no bytes."""
        if not self._is_cuda or self.num_slots < 2:
            return
        self.submit(-1, np.array([0]), np.array([1]))
        torch.cuda.synchronize(self._device)
        assert self.poll() == [-1], "the warm-up copy did not complete"
        self._bytes_copied = 0

    @property
    def bytes_copied(self) -> int:
        """Running total of KV bytes written (K and V, all layers)."""
        return self._bytes_copied

    @property
    def slot_bytes(self) -> int:
        """KV bytes of one slot in these caches (K and V, all layers)."""
        return self._slot_bytes

    def submit(
        self, batch_id: int, src_slots: np.ndarray, dst_slots: np.ndarray
    ) -> None:
        """Copies every `src_slots[i]` to `dst_slots[i]` in all layers.

        Mutates KV memory at the destination slots only. An empty batch is
        valid and completes like any other.

        Args:
            batch_id: the planner's id; reported once by `poll()`.
            src_slots: `[M]` integer slots holding live tokens.
            dst_slots: `[M]` integer slots to write; unique, none a source.

        """
        src, dst = self._check_plan(src_slots, dst_slots)
        assert batch_id not in self._done and all(
            p.batch_id != batch_id for p in self._pending
        ), f"batch {batch_id} was submitted and not yet reported"
        if self._is_cuda:
            self._submit_cuda(batch_id, src, dst)
        else:
            if src.size:
                self._copy_host(src, dst)
            self._done.append(batch_id)
        self._bytes_copied += int(src.size) * self._slot_bytes

    def poll(self) -> list[int]:
        """Returns the ids of batches whose copy has completed, each once.

        Never blocks. Ids come in submission order.
        """
        if self._pending:
            # One stream: events complete in order, so stop at the first busy one.
            num_done = 0
            for pending in self._pending:
                if not pending.event.query():
                    break
                self._finish(pending)
                num_done += 1
            del self._pending[:num_done]
        done, self._done = self._done, []
        return done

    def wait_all(self) -> None:
        """Orders the current stream after every pending copy.

        For a request finished or preempted with a copy in flight: work queued
        after this call (reusing its blocks) runs after the copies. The host does
        not block. The batches are then reported by the next `poll()`.
        """
        if not self._pending:
            return
        current = torch.cuda.current_stream(self._device)
        for pending in self._pending:
            current.wait_event(pending.event)
            self._finish(pending)
        self._pending.clear()

    def synchronize(self) -> None:
        """Blocks the host until every copy submitted has landed.

        For vLLM's sleep: the allocator unmaps the KV cache with driver calls
        that no stream orders, so a stream wait (`wait_all`) is not enough,
        and a batch `wait_all` already reported (a finished request's, in
        the empty step that follows sleep's aborts) may still be copying:
        the side stream itself is waited for. Pending batches stay pending:
        the next `poll()` reports them.
        """
        if self._stream is not None:
            self._stream.synchronize()

    def after_wake_up(self) -> None:
        """vLLM's wake-up maps the KV cache's memory pool afresh, at the same
        addresses but with its contents lost: the copy kernel's table of
        layer addresses, allocated with the cache, is written again."""
        if self._triton is not None:
            self._triton.write_layer_ptrs()

    def _check_plan(
        self, src_slots: np.ndarray, dst_slots: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        src, dst = np.asarray(src_slots), np.asarray(dst_slots)
        assert src.ndim == 1 and dst.ndim == 1 and src.shape == dst.shape, (
            f"src and dst must be 1-D of equal length, got {src.shape}, {dst.shape}"
        )
        if src.size == 0:
            return src.astype(np.int64), dst.astype(np.int64)
        assert np.issubdtype(src.dtype, np.integer) and np.issubdtype(
            dst.dtype, np.integer
        ), f"slots must be integers, got {src.dtype}, {dst.dtype}"
        src, dst = src.astype(np.int64), dst.astype(np.int64)
        if integrity.CHECK:
            lo, hi = min(src.min(), dst.min()), max(src.max(), dst.max())
            assert 0 <= lo and hi < self.num_slots, (
                f"slot out of range [0, {self.num_slots}): {lo}..{hi}"
            )
            assert np.unique(dst).size == dst.size, "duplicate destination slots"
            assert not np.isin(src, dst).any(), "a destination is also a source"
        return src, dst

    def _copy_host(self, src: np.ndarray, dst: np.ndarray) -> None:
        if self.layout == "cpu":  # one compiled call a layer
            for key, value in self._cpu_views:
                self._copy_cpu(key, value, src, dst, self._shift)
        else:  # "triton" layout on CPU tensors (tests)
            self._copy_torch(torch.from_numpy(src), torch.from_numpy(dst))

    def _copy_torch(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        # "triton" layout, [N, 2, B, H, D]: the K and V rows of each slot in
        # one gather a layer (CUDA without Triton, or CPU tensors in tests).
        block = self.block_size
        src_blk, src_off = src // block, src % block
        dst_blk, dst_off = dst // block, dst % block
        for cache in self._caches:
            cache[dst_blk, :, dst_off] = cache[src_blk, :, src_off]

    def _submit_cuda(self, batch_id: int, src: np.ndarray, dst: np.ndarray) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self._device)
        stream = self._stream
        # The sources were written by forwards queued on the current stream.
        stream.wait_stream(torch.cuda.current_stream(self._device))
        # Pinned + non_blocking: a pageable H2D copy would block the host until
        # the side stream (and so the running forward) drains.
        host = slot_pairs(src, dst).pin_memory()
        with torch.cuda.stream(stream):
            slots = host.to(self._device, non_blocking=True)
            src_t, dst_t = slots[0, : src.size], slots[1, : src.size]
            if src.size:
                if self._triton is not None:
                    self._triton.copy(src_t, dst_t)
                else:
                    self._copy_torch(src_t, dst_t)
            event = torch.cuda.Event()
            event.record(stream)
        self._pending.append(_PendingCopy(batch_id, event, src_t, dst_t, host))

    def _finish(self, pending: _PendingCopy) -> None:
        self._done.append(pending.batch_id)


def _make_triton_copier(kv_caches: list[torch.Tensor], block_size: int) -> Any:
    try:
        from vllm.vtoken.kv_copy_triton import TritonKVSlotCopier
    except ImportError:  # no Triton: torch index ops per layer
        return None
    return TritonKVSlotCopier(kv_caches, block_size)
