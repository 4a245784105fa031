# SPDX-License-Identifier: Apache-2.0
"""The software prefetch of the compiled passes (vllm/vtoken/prefetch.py).

A prefetch changes no result, so what the kernels compute with it is held by
their own tests (test_token_table.py, test_eviction_kernels.py,
test_score_fold.py run the prefetching loops); here, that the hint is really
emitted, that it never faults, and that it takes arrays only. What it buys is
a benchmark's (docs/RESULTS.md, "One kernel, old and new").
"""

from __future__ import annotations

import importlib
import re

import numba
import numpy as np
import pytest

from vllm.vtoken.prefetch import MAX_LINES, prefetch, prefetch_span, span_step


@numba.njit
def _sum_prefetching(a, ahead):
    s = 0
    for i in range(a.size):
        prefetch(a, i + ahead)  # far past the end: a hint never faults
        s += a[i]
    return s


@numba.njit
def _first_of_span(a, lo, n):
    prefetch_span(a, lo, n)
    return a[lo]


def _ir(dispatcher) -> str:
    return next(iter(dispatcher.inspect_llvm().values()))


def _prefetches(dispatcher) -> int:
    """The prefetch calls in its code (the declaration is no call)."""
    return len(re.findall(r"call void @llvm\.prefetch", _ir(dispatcher)))


def test_prefetch_is_emitted_and_never_faults():
    a = np.arange(1000, dtype=np.int64)
    assert _sum_prefetching(a, 1 << 40) == a.sum()
    # LLVM's intrinsic, for reading (0), kept in every level (3), data (1).
    assert re.search(
        r"call void @llvm\.prefetch\.p0i8\(i8\* [^,]+, i32 0, i32 3, i32 1\)",
        _ir(_sum_prefetching),
    )


@pytest.mark.parametrize("dtype", [np.bool_, np.int32, np.float32, np.int64])
def test_a_span_of_any_width_changes_nothing(dtype):
    a = np.arange(100).astype(dtype)
    for lo, n in [(0, 0), (3, 1), (5, 17), (1, 99), (90, 500)]:
        assert _first_of_span(a, lo, n) == a[lo]
    # The span is walked, a prefetch a line (not unrolled away).
    assert _prefetches(_first_of_span) > 0


def test_a_span_is_prefetched_a_line_at_a_time_unless_long():
    # A long history's region is skipped: a hundred prefetches a row took
    # append_read 1.7x as long at 2,112-token histories (docs/RESULTS.md).
    assert span_step(4, 1) == span_step(4, 16 * MAX_LINES) == 16
    assert span_step(1, 64 * MAX_LINES) == 64 and span_step(8, 8) == 8
    assert span_step(4, 16 * MAX_LINES + 1) == 0
    assert span_step(1, 64 * MAX_LINES + 1) == 0
    assert span_step(4, 0) == span_step(4, -3) == 0


def test_an_index_of_any_width_into_a_strided_array():
    # The address is computed in the pointer's width: an int32 index into a
    # strided view compiles (it did not, i32 against i64) and never faults.
    @numba.njit
    def strided_sum(a, at):
        prefetch(a, at)
        return a.sum()

    a = np.arange(20, dtype=np.float32)[::2]
    assert strided_sum(a, np.int32(7)) == a.sum()
    assert strided_sum(a, np.int64(-3)) == a.sum()


def test_prefetch_takes_an_array_and_an_integer():
    @numba.njit
    def of_a_scalar(x):
        prefetch(x, 0)

    @numba.njit
    def of_a_matrix(a):
        prefetch(a, 0)

    @numba.njit
    def at_a_float(a):
        prefetch(a, 0.5)

    with pytest.raises(numba.core.errors.TypingError):
        of_a_scalar(3)
    with pytest.raises(numba.core.errors.TypingError):
        at_a_float(np.zeros(4))
    with pytest.raises(numba.core.errors.TypingError):
        of_a_matrix(np.zeros((2, 2)))


@pytest.mark.parametrize(
    "module, name",
    [
        ("table_kernels", "append_read"),
        ("table_kernels", "append_rows"),
        ("table_kernels", "evict_rows"),
        ("table_kernels", "positional_slots"),
        ("eviction_kernels", "evict_lowest"),
        ("fold_kernels", "fold"),
    ],
)
def test_the_step_s_row_walks_prefetch(module, name):
    # The walks the in-engine A/B measured (docs/RESULTS.md) ask for rows
    # ahead. Compiled afresh: numba's cache gives no code to inspect. (Each
    # kernel's, not each site's: LLVM copies loops, so the calls are not
    # the sites, and a kernel inlining kill_rows has its prefetches too.)
    kernel = getattr(importlib.import_module(f"vllm.vtoken.{module}"), name)
    fresh = numba.njit(kernel.nopython_signatures[0], cache=False)(kernel.py_func)
    assert _prefetches(fresh) > 0
