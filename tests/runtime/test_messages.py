# SPDX-License-Identifier: Apache-2.0
"""The step messages as a worker in another process receives them."""

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm.vtoken.messages import MoveBatch, VTokenStep, owned
from vllm.vtoken.token_table import TokenTablePool


def transported(obj):
    """`obj` through pickle 5 with its arrays out of band, as vLLM's
    shared-memory queue carries large ones: they arrive read-only."""
    buffers = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    frames = [memoryview(bytes(b.raw())) for b in buffers]  # the ring's bytes
    return pickle.loads(data, buffers=frames)


def transported_step(dst_slots: list[int]) -> VTokenStep:
    """Request "a"'s tokens 1 and 2 die, 3 and 4 move from slots 3 and 4 to
    `dst_slots`: a step as a worker in another process gets it."""
    return transported(
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
                dst_slots=np.array(dst_slots, np.int64),
            ),
        )
    )


def test_received_arrays_are_the_workers_own_and_the_kernels_take_them():
    pool = TokenTablePool(8, 4)
    pool.add_request("a")
    pool.append("a", np.array([0, 1, 2, 3, 4]))
    step = transported_step(dst_slots=[9, 10])
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


def cpu_worker(num_blocks: int, block_size: int, vtoken_config=None):
    """A CPU `VTokenWorker` on a two-layer cache, built without an engine:
    only the config fields its constructor reads (`vtoken_config`: its
    scheduler's, as one process's engine shares it)."""
    import vllm.config  # noqa: F401  (before vtoken.config, which it imports)
    from vllm.vtoken.config import VTokenConfig
    from vllm.vtoken.worker import VTokenWorker

    config = SimpleNamespace(
        vtoken_config=vtoken_config
        or VTokenConfig(
            kv_eviction_policy="streamingllm",
            kv_budget_tokens=4,
            kv_eviction_config={"num_sinks": 1},
        ),
        cache_config=SimpleNamespace(block_size=block_size),
        compilation_config=SimpleNamespace(static_forward_context={}),
        model_config=SimpleNamespace(
            max_model_len=64, get_num_attention_heads=lambda parallel: 2
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, pipeline_parallel_size=1
        ),
    )
    caches = [torch.randn(2, num_blocks, 1, block_size, 8) for _ in range(2)]
    return VTokenWorker(config, caches), caches


def test_a_worker_takes_a_transported_step_as_its_own():
    """`VTokenWorker.begin_step` on a step that came out of band: the dead
    lists evict, the move batch copies K/V and switches the tokens; with the
    transport's read-only arrays handed on, the compiled passes refuse them."""
    worker, caches = cpu_worker(num_blocks=4, block_size=16)
    worker.pool.add_request("a")
    worker.pool.append("a", np.arange(5))  # tokens 0-4 in block 0
    before = [c.clone() for c in caches]
    step = transported_step(dst_slots=[20, 21])  # into block 1
    assert not step.moves.src_slots.flags.writeable
    worker.begin_step(
        SimpleNamespace(
            finished_req_ids=set(),
            preempted_req_ids=set(),
            scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=[]),
            vtoken=step,
        )
    )
    np.testing.assert_array_equal(worker.pool.live_slots("a"), [0, 20, 21])
    worker.pool.check_integrity()
    for old, new in zip(before, caches, strict=True):
        # CPU_ATTN's layout: K [N, H, D, B], V [N, H, B, D] (kv_copy_cpu.py)
        k_old, k_new = (c[0].view(4, 1, 8, 16) for c in (old, new))
        for src, dst in ((3, 20), (4, 21)):
            assert torch.equal(k_new[dst // 16, :, :, dst % 16], k_old[0, :, :, src])
            assert torch.equal(new[1, dst // 16, :, dst % 16], old[1, 0, :, src])
    assert worker.end_step().acked_batches == [0]


def test_a_workers_output_counts_its_own_end_step_time():
    """The output's running total of the worker's hook time includes the
    end_step that makes it: it was read inside the timed call, so each
    step's figure held the step before's end_step (found by review)."""
    worker, _ = cpu_worker(num_blocks=4, block_size=16)
    for _ in range(2):
        out = worker.end_step()
        assert out.host_ns == worker.counters.worker_ns > 0


def test_the_workers_tables_keep_dead_listed_by_the_requests_own_policy():
    """`VTokenWorker._add` makes each table as the scheduler makes its own
    (EvictionRuntime.register_many, tests/runtime/test_eviction.py), the
    step's new requests at once: a Random row takes its victims out of its
    live list at once, the engine's policy's and an opted-out request's keep
    them listed a while."""
    worker, _ = cpu_worker(num_blocks=4, block_size=16)
    args = {
        "engine": None,
        "random": {"kv_eviction_policy": "random", "kv_budget_tokens": 32},
        "none": {"kv_eviction_policy": "none"},
    }
    requests = {
        rid: SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra))
        for rid, extra in args.items()
    }
    worker._add(list(args), requests)
    keep = worker.pool._a.cols["keep_dead"][worker.pool.rows(list(args))]
    assert keep.tolist() == [1, 0, 1]


@pytest.mark.parametrize(
    "how", ["finished", "preempted", "unscheduled", "resumed", "running"]
)
def test_copies_in_flight_are_waited_for_once_their_request_may_lose_its_blocks(
    how, monkeypatch
):
    """A request with a copy in flight (a GPU side stream) that finished, was
    preempted, or is not scheduled this step (preempted outside a step, by
    the scheduler's reset_prefix_cache, which reports it nowhere), or was
    preempted so and resumed in this very step (scheduled, but its old
    blocks freed, and its row reset: found by review): the worker orders
    the step after its copies, whose blocks may be handed out again; a
    request still running needs no wait."""
    worker, _ = cpu_worker(num_blocks=4, block_size=16)
    waits = []
    monkeypatch.setattr(worker.executor, "wait_all", lambda: waits.append(1))
    none = np.zeros(0, np.int64)
    worker._pending[7] = MoveBatch(
        batch_id=7, req_ids=["a"], indptr=np.zeros(2, np.int64), idx=none,
        src_slots=none, dst_slots=none,
    )  # fmt: skip
    worker.begin_step(
        SimpleNamespace(
            finished_req_ids={"a"} if how == "finished" else set(),
            preempted_req_ids={"a"} if how == "preempted" else set(),
            num_scheduled_tokens={"a": 1} if how in ("running", "resumed") else {},
            scheduled_cached_reqs=SimpleNamespace(
                resumed_req_ids=["a"] if how == "resumed" else []
            ),
            vtoken=None,
        )
    )
    assert waits == ([] if how == "running" else [1])


def test_a_copy_in_flight_never_switches_a_request_resumed_since(monkeypatch):
    """A GPU side stream's batch still copying when its request is preempted
    outside a step and resumed in the next: the worker waits for it before
    the step (the request's old blocks are free), and its switch skips the
    reset row. It waited for none, and the copy, landing after the resume
    slotted the row again, moved token 20 into a block the request no
    longer held (found by review). Simulated on CPU: a submitted batch
    completes at a later poll, or at wait_all."""
    from vllm.vtoken.messages import VTokenStep

    worker, _ = cpu_worker(num_blocks=8, block_size=16)
    ex, held = worker.executor, []
    submit = ex.submit

    def late(batch_id, src, dst):
        submit(batch_id, src, dst)
        held.extend(ex._done)
        ex._done.clear()

    monkeypatch.setattr(ex, "submit", late)
    monkeypatch.setattr(ex, "wait_all", lambda: (ex._done.extend(held), held.clear()))
    worker.pool.add_request("a")
    worker._scored["a"] = False
    worker.pool.append("a", np.arange(32))  # blocks 0 and 1

    def step(vtoken=None, count=1, resumed=()):
        worker.begin_step(
            SimpleNamespace(
                finished_req_ids=set(), preempted_req_ids=set(),
                num_scheduled_tokens={"a": count}, vtoken=vtoken,
                scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=resumed),
            )
        )  # fmt: skip

    moves = MoveBatch(
        batch_id=0, req_ids=["a"], indptr=np.array([0, 1]), idx=np.array([20]),
        src_slots=np.array([20]), dst_slots=np.array([1]),
    )  # fmt: skip
    dead = {"dead_indptr": np.array([0, 8]), "dead_idx": np.arange(1, 9)}
    step(VTokenStep(dead_req_ids=["a"], **dead, moves=moves))
    assert worker.end_step().acked_batches == []  # still copying
    step(count=33, resumed=["a"])  # all its blocks freed, then resumed
    assert held == []  # waited for
    worker.pool.append("a", 5 * 16 + np.arange(33))  # the resume: blocks 5-7
    assert worker.end_step().acked_batches == [0]
    assert worker.pool.slots("a")[20] == 5 * 16 + 20  # where the resume wrote it


def test_a_scheduler_finds_only_the_worker_built_on_its_own_config(monkeypatch):
    """integrity.worker_pool pairs a scheduler with the worker built on the
    same config object (one process: vLLM's UniProcExecutor); another
    config, or one gone, finds none; the worker shares its pool only under
    VTOKEN_CHECK_INTEGRITY."""
    import gc

    import vllm.config  # noqa: F401
    from vllm.vtoken import integrity
    from vllm.vtoken.config import VTokenConfig

    def cfg():
        return VTokenConfig(kv_eviction_policy="streamingllm", kv_budget_tokens=8)

    monkeypatch.setattr(integrity, "CHECK", False)
    mine = cfg()
    cpu_worker(num_blocks=4, block_size=16, vtoken_config=mine)
    assert integrity.worker_pool(mine) is None
    monkeypatch.setattr(integrity, "CHECK", True)
    worker, _ = cpu_worker(num_blocks=4, block_size=16, vtoken_config=mine)
    assert integrity.worker_pool(mine) is worker.pool
    assert integrity.worker_pool(cfg()) is None
    del worker
    gc.collect()
    assert integrity.worker_pool(mine) is None


def test_the_two_sides_tables_are_compared_token_by_token():
    from vllm.vtoken import integrity

    sched, worker = (TokenTablePool(num_blocks=4, block_size=4) for _ in range(2))
    for pool in (sched, worker):
        pool.add_request("a")
        pool.append("a", np.arange(6))
    worker.add_request("gone")  # only on one side: not compared
    integrity.check_worker(sched, worker, ["a", "gone", "unknown"])
    worker.evict("a", np.array([2]))
    with pytest.raises(AssertionError, match="live tokens differ"):
        integrity.check_worker(sched, worker, ["a"])
    sched.evict("a", np.array([2]))
    integrity.check_worker(sched, worker, ["a"])
    worker.apply_moves(["a"], np.array([0, 1]), np.array([3]), np.array([9]))
    with pytest.raises(AssertionError, match="reads live tokens from slots"):
        integrity.check_worker(sched, worker, ["a"])


def test_a_step_with_a_batch_in_flight_makes_as_many_worker_calls_at_16_as_at_4(
    monkeypatch,
):
    """begin_step gathers the requests of the move batches still copying (on
    a GPU, the side stream's) in C loops: no call, nor line of the overlay,
    per request (a set comprehension was a line a request). White-box: the
    batch in flight is the worker's own record of it, as submitted."""
    from tests.test_reclaimer_batches import counted
    from vllm.vtoken import integrity

    monkeypatch.setattr(integrity, "CHECK", False)

    def calls(n):
        worker, _ = cpu_worker(num_blocks=4, block_size=16)
        rids = [f"r{i}" for i in range(n)]
        worker._pending[7] = SimpleNamespace(req_ids=rids)
        so = SimpleNamespace(
            finished_req_ids=set(),
            preempted_req_ids=set(),
            num_scheduled_tokens=dict.fromkeys(rids, 1),
            scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=[]),
            vtoken=None,
        )
        out, _ = counted(lambda: worker.begin_step(so))
        assert list(worker._pending) == [7]  # still copying: not waited for
        return out

    calls(4)
    assert calls(4) == calls(16)


def test_the_step_s_prefix_cache_hits_are_slotted_from_each_block_table():
    """VTokenWorker._with_hits lists each request's hit tokens [start,
    start + hits) at its block table's slots, before its new ones, the
    step's requests with hits at once: as a request at a time would (hits
    starting mid-block and spanning blocks, requests without, a last one)."""
    import vllm.config  # noqa: F401  (before vtoken.config, which it imports)
    from vllm.vtoken.worker import VTokenWorker

    B = 4
    rng = np.random.default_rng(5)
    rids = ["a", "b", "c", "d", "e"]
    tables = {r: rng.permutation(64)[:8].tolist() for r in rids}
    requests = {r: SimpleNamespace(block_ids=(tables[r], [])) for r in rids}
    start = np.array([0, 3, 0, 5, 8])
    hits = np.array([9, 0, 4, 6, 1])
    counts = np.array([2, 1, 3, 1, 1])
    new = np.arange(1000, 1000 + counts.sum())
    got = VTokenWorker._with_hits(
        SimpleNamespace(block_size=B), rids, requests, counts, new, start, hits
    )
    want, k = [], 0
    for r, s, h, c in zip(rids, start, hits, counts, strict=True):
        want += [tables[r][p // B] * B + p % B for p in range(s, s + h)]
        want += new[k : k + c].tolist()
        k += c
    assert got.tolist() == want


def test_prefix_cache_hits_of_16_requests_make_as_many_worker_calls_as_4():
    """_with_hits reads the hit requests' block tables in C loops: no call,
    nor line of the overlay, per request (a request with hits, on its first
    step, cost half a dozen NumPy calls)."""
    import vllm.config  # noqa: F401  (before vtoken.config, which it imports)
    from tests.test_reclaimer_batches import counted
    from vllm.vtoken.worker import VTokenWorker

    def calls(n):
        rids = [f"r{i}" for i in range(n)]
        requests = {r: SimpleNamespace(block_ids=(list(range(8)), [])) for r in rids}
        start, hits, counts = (np.full(n, v) for v in (2, 9, 1))
        new = np.arange(n)
        out, _ = counted(
            lambda: VTokenWorker._with_hits(
                SimpleNamespace(block_size=4), rids, requests, counts, new, start, hits
            )
        )
        return out

    calls(4)
    assert calls(4) == calls(16)


def test_a_worker_admits_16_requests_with_as_many_calls_as_4(monkeypatch):
    """The worker's first sight of a step's new requests (their tables,
    whether they read scores) is one pass: no call, nor line of the
    overlay, per request (their settings are read once a distinct one: a
    request's own keys, test_the_workers_tables_keep_dead_listed_by_...)."""
    from tests.test_reclaimer_batches import counted
    from vllm.sampling_params import SamplingParams
    from vllm.vtoken import integrity

    monkeypatch.setattr(integrity, "CHECK", False)

    def admitted(n):
        worker, _ = cpu_worker(num_blocks=4, block_size=16)
        rids = [f"r{i}" for i in range(n)]
        requests = {r: SimpleNamespace(sampling_params=SamplingParams()) for r in rids}
        out, (rows, scored) = counted(lambda: worker._rows_of(rids, requests))
        assert sorted(rows.tolist()) == list(range(n)) and not scored.any()
        return out

    admitted(4)
    assert admitted(4) == admitted(16)
