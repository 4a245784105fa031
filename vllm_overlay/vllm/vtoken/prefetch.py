# SPDX-License-Identifier: Apache-2.0
"""Software prefetch for the compiled passes over the batch's rows (numba).

The step's passes (table_kernels.append_read, ...) run right after the
forward, whose data has evicted the Token Tables from the caches. A row's
tokens are a few short regions of the arena (its slots, liveness bits and
live list), each a handful of cache lines: too short a stream for the
hardware prefetcher to catch before it ends, so each row waits on memory
one region at a time. Asking for the rows a few ahead while walking this
one overlaps those waits:

    row i       walk listed / live / slot        (lines already in flight)
    row i + 4   prefetch every line of its regions  (no wait: a hint)

A prefetch is a hint and never faults (LLVM's `llvm.prefetch`; a no-op where
the target has none), so an address past an array's end is harmless and the
results cannot change; only the time does (docs/RESULTS.md, "One kernel, old
and new"). Measured by hand on a cold 1,024-row walk (a 64 MiB sweep before
each): 217 -> 139 us, the same for 2 to 8 rows ahead. A long region is
left alone (MAX_LINES): what helps a row of a few lines hurts at hundreds.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# Rows prefetched ahead of the one walked.
AHEAD = 4
_LINE = 64  # bytes: the cache line of every CPU vLLM runs on
# The longest span prefetched, in lines (2 KiB): a region past it (a long
# history's slots) is skipped. Its row's own walk is then long enough to
# cover the next row's first misses, and a burst of a hundred prefetches a
# row took append_read 1.7x as long (2,112-token histories, budget 64).
MAX_LINES = 32


@intrinsic
def prefetch(typingctx, arr, index):
    """Hints the caches to load the line of arr[index] (1-D) for reading,
    kept in every level. The index is not checked (nor wrapped when
    negative): a prefetch of any address never faults."""
    if not isinstance(arr, types.Array) or arr.ndim != 1:
        return None
    if not isinstance(index, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        # The address arithmetic is in the pointer's width, whatever the
        # index's (an int32 index into a strided array would not compile).
        at = context.cast(builder, args[1], sig.args[1], types.intp)
        ptr = cgutils.get_item_pointer(
            context, builder, aryty, ary, [at], wraparound=False
        )
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        # (address, read, locality 3: keep in every level, data cache)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(arr, index), codegen


@numba.njit(inline="always")
def span_step(itemsize, n):
    """The stride, in elements, of prefetching n of them a line at a time,
    or 0: nothing to prefetch, or more than MAX_LINES lines."""
    step = max(_LINE // itemsize, 1)
    return step if 0 < n <= MAX_LINES * step else 0


@numba.njit(inline="always")
def prefetch_span(arr, lo, n):
    """Prefetches every line of arr[lo : lo + n] (span_step: not a long one)."""
    step = span_step(arr.itemsize, n)
    if step == 0:
        return
    for k in range(lo, lo + n, step):
        prefetch(arr, k)
    prefetch(arr, lo + n - 1)  # the last element's line, lo not line-aligned
