# SPDX-License-Identifier: Apache-2.0
"""Compiled loop of the CPU decode read (numba).

Worker side (cpu_attention.py), once a layer: the decode requests' live keys
copied into the scratch pages vLLM's kernel then reads, in one pass, where
two advanced-indexing gathers took several times as long. Imported only with
vToken on; compiled at import, as table_kernels.py is.
"""

from __future__ import annotations

import numba

_i64 = numba.int64[::1]
_pages_sigs = [
    numba.void(
        numba.types.Array(t, 4, "C", readonly=True),
        numba.types.Array(t, 4, "C", readonly=True),
        _i64,
        _i64,
        _i64,
        numba.int64,
        numba.types.Array(t, 4, "C"),
        numba.types.Array(t, 4, "C"),
    )
    for t in (numba.int16, numba.int32)  # the bits of 2- and 4-byte dtypes
]


@numba.njit(_pages_sigs, cache=True, nogil=True)
def gather_pages(key_bits, value_bits, slots, first, num_keys, shift, key_pages, value_pages):
    """Copies each decode request's live keys into pages of its own, in
    logical order: request i's key w (slot slots[first[i] + w], w <
    num_keys[i]) goes to page i * P + w // B, offset w % B, with P pages per
    request and B = 1 << shift slots a page, as a cache block. Both caches in
    the CPU vec/vec16 layout, as raw bits: K `[N, H, D, B]` (each (block,
    head) page stored [D, B]), V `[N, H, B, D]`; the pages likewise, `[R * P,
    H, D, B]` and `[R * P, H, B, D]`. A key's place in the pages is its
    logical one, not its slot, so a compaction move leaves the pages, and the
    kernel's output over them, bit-identical."""
    H, D, B = key_bits.shape[1], key_bits.shape[2], 1 << shift
    P = key_pages.shape[0] // max(first.size, 1)
    for i in range(first.size):
        for w in range(num_keys[i]):  # a key's K column lies in one page
            s = slots[first[i] + w]
            b, o = s >> shift, s & (B - 1)
            p, t = i * P + (w >> shift), w & (B - 1)
            for h in range(H):
                for d in range(D):
                    key_pages[p, h, d, t] = key_bits[b, h, d, o]
                for d in range(D):
                    value_pages[p, h, t, d] = value_bits[b, h, o, d]
