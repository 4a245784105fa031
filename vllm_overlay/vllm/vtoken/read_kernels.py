# SPDX-License-Identifier: Apache-2.0
"""Compiled loop of the CPU read plan's per-step index build (numba).

Worker side, once a step (cpu_attention.build_cpu_read_plan): the padded
decode batch's addresses, built in one pass over its keys instead of a dozen
torch/NumPy passes over [R, W] and [R, H, W] temporaries. Imported only with
vToken on; compiled at import, as table_kernels.py is.
"""

from __future__ import annotations

import numba
import numpy as np

_i64 = numba.int64[::1]
_i64_2d, _b1_2d = numba.int64[:, ::1], numba.boolean[:, ::1]


@numba.njit(
    numba.types.Tuple((_i64_2d, _i64_2d, _i64, _b1_2d))(
        _i64, _i64, _i64, numba.int64, numba.int64, numba.int64
    ),
    cache=True,
    nogil=True,
)
def decode_index(kv_loc, decode, kv_slots, width, shift, num_kv_heads):
    """(blk, off, v_rows, valid) of the decode requests, padded to `width`
    keys: request i's keys are kv_slots[kv_loc[d]:kv_loc[d + 1]], d =
    decode[i]; padding repeats kv_slots[0] and is False in `valid`. v_rows
    [R * H * W]: the same keys as rows of the value cache viewed [N * H * B, D].
    Blocks of 1 << shift slots (arena.block_shift)."""
    R, H, block_size = decode.size, num_kv_heads, 1 << shift
    blk, off = np.empty((R, width), np.int64), np.empty((R, width), np.int64)
    valid = np.empty((R, width), np.bool_)
    v_rows = np.empty(R * H * width, np.int64)
    for i in range(R):
        lo, hi = kv_loc[decode[i]], kv_loc[decode[i] + 1]
        for w in range(width):
            ok = lo + w < hi
            s = kv_slots[lo + w] if ok else kv_slots[0]
            b = s >> shift
            o = s & (block_size - 1)
            blk[i, w], off[i, w], valid[i, w] = b, o, ok
            for h in range(H):
                v_rows[(i * H + h) * width + w] = (b * H + h) * block_size + o
    return blk, off, v_rows, valid
