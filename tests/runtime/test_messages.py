# SPDX-License-Identifier: Apache-2.0
"""The step messages as a worker in another process receives them."""

import pickle

import numpy as np
import pytest

from vllm.vtoken.messages import MoveBatch, VTokenStep, owned
from vllm.vtoken.token_table import TokenTablePool


def transported(obj):
    """`obj` through pickle 5 with its arrays out of band, as vLLM's
    shared-memory queue carries large ones: they arrive read-only."""
    buffers = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    frames = [memoryview(bytes(b.raw())) for b in buffers]  # the ring's bytes
    return pickle.loads(data, buffers=frames)


def test_received_arrays_are_the_workers_own_and_the_kernels_take_them():
    pool = TokenTablePool(8, 4)
    pool.add_request("a")
    pool.append("a", np.array([0, 1, 2, 3, 4]))
    step = transported(
        VTokenStep(
            dead_req_ids=["a"],
            dead_indptr=np.array([0, 2], np.int64),
            dead_idx=np.array([1, 2], np.int64),
            moves=MoveBatch(
                batch_id=0,
                req_ids=["a"],
                indptr=np.array([0, 2], np.int64),
                idx=np.array([3, 4], np.int64),
                src_slots=np.array([3, 4], np.int64),
                dst_slots=np.array([9, 10], np.int64),
            ),
        )
    )
    assert not step.dead_idx.flags.writeable  # what a worker gets
    rows = pool.rows(["a"])
    with pytest.raises(TypeError):  # numba refuses a read-only array
        pool.evict_rows(rows, step.dead_indptr, step.dead_idx)
    pool.evict_rows(rows, owned(step.dead_indptr), owned(step.dead_idx))
    m = step.moves.received()
    for a in (m.indptr, m.idx, m.src_slots, m.dst_slots):
        assert a.flags.writeable and a.flags.owndata and a.dtype == np.int64
    assert m.batch_id == 0 and m.req_ids == ["a"]
    pool.apply_moves(m.req_ids, m.indptr, m.idx, m.dst_slots)
    np.testing.assert_array_equal(pool.live_slots("a"), [0, 9, 10])
    pool.check_integrity()
