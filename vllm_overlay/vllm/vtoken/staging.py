# SPDX-License-Identifier: Apache-2.0
"""The step's index arrays to the device: one non-blocking copy per step.

Worker side. The read plan (live slots, token-table entries, lengths, score
tiles) is built on the host in NumPy; `HostToDevice.upload` packs it into a
persistent pinned buffer and copies it in one `cudaMemcpyAsync` to a
persistent device buffer, returning views. A copy per array, or an unpinned
one, would stall the host on every step (a blocking copy waits for the GPU to
finish the previous work first).

    host (pinned)  [ kv_slots ........ | table_at ..... | lens | tiles ]
                          │ one non-blocking copy, in stream order
    device         [ kv_slots ........ | table_at ..... | lens | tiles ]  -> views

The device buffer is reused next step: the copy is queued on the current
stream after this step's kernels, so it cannot overwrite what they still read.
The host buffer is rewritten only once the last copy has read it (an event,
long completed by then: each step ends reading the sampled tokens back).
On CPU, `upload` returns the arrays themselves as tensors (no copy), or,
with `pack=True`, packs them as on a GPU (the views' offsets, hence their
alignment, which Triton's kernel variants depend on: the compile checks).
"""

from __future__ import annotations

import numpy as np
import torch


class HostToDevice:
    """Persistent pinned and device int64 buffers, grown by doubling."""

    def __init__(self, device: torch.device | str, pack: bool | None = None) -> None:
        self.device = torch.device(device)
        self._pack = self.device.type != "cpu" if pack is None else pack
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self.uploads = 0  # calls to `upload` (tests count them)

    def upload(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """int64 device tensors with the arrays' shapes, from one copy."""
        flat = {k: np.asarray(a, dtype=np.int64) for k, a in arrays.items()}
        self.uploads += 1
        if not self._pack:
            return {
                k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in flat.items()
            }
        total = sum(a.size for a in flat.values())
        if self._host is None or self._host.numel() < total:
            cap = max(total, 2 * (0 if self._host is None else self._host.numel()))
            cap = max(cap, 1 << 16)
            pin = self.device.type == "cuda"
            self._host = torch.empty(cap, dtype=torch.int64, pin_memory=pin)
            self._dev = torch.empty(cap, dtype=torch.int64, device=self.device)
        elif self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # not expected: the step's end waited
        host, views, at = self._host.numpy(), {}, 0
        for name, a in flat.items():
            host[at : at + a.size] = a.reshape(-1)
            views[name] = (at, a.shape)
            at += a.size
        self._dev[:total].copy_(self._host[:total], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return {
            name: self._dev[lo : lo + int(np.prod(shape))].view(shape)
            for name, (lo, shape) in views.items()
        }
