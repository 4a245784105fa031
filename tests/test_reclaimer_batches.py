"""A move batch of several requests (reclaimer.InFlightMoves): a plan that
mixes a request with nothing left to move, an evacuation and moves in place,
bound, then acknowledged, or with one request dropped before the ack, or with
a destination whose tokens all die in flight. White-box: the plan is built by
hand, so that each request's part sits at a different offset of the batch's
flat arrays (the single-request tests elsewhere cannot tell offsets apart)."""

from types import SimpleNamespace

import numpy as np
import pytest

from tests.e2e.conftest import engine_driver
from tests.test_scheduler_side import B, setup


@pytest.fixture(autouse=True)
def deep_checks(monkeypatch):
    """The overlay's deep checks, as in tests/runtime (VTOKEN_CHECK_INTEGRITY)."""
    from vllm.vtoken import integrity

    monkeypatch.setattr(integrity, "CHECK", True)


def three(caching=True):
    """Requests A, B and C, 12-token prompts (three blocks each), prefilled
    in one step; the budget leaves every token live."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, a = setup("vtoken", caching=caching, blocks=32, budget=64)
    hasher = get_request_block_hasher(B, sha256) if caching else None
    reqs = [a]
    for n, base in (("B", 200), ("C", 300)):
        r = Request(
            n,
            list(range(base, base + 12)),
            SamplingParams(max_tokens=8),
            None,
            block_hasher=hasher,
        )
        vt._requests[n] = r
        reqs.append(r)
    vt.begin_step([])
    for r in reqs:
        assert kv.allocate_slots(r, 12) is not None
    vt.end_step(SimpleNamespace(num_scheduled_tokens={r.request_id: 12 for r in reqs}))
    for r in reqs:
        r.num_computed_tokens += 12
    vt.on_output(VTokenWorkerOutput())
    for r in reqs:
        r.append_output_token_ids(7)
    vt.check_integrity()
    return kv, vt, reqs


def bind(kv, vt, caching, evacuate_c=False):
    """A: b1 all dead (no move; 1 fresh it does not use). B: tokens 1..6 dead,
    b0, b1 evacuated into one fresh block (caching) / b0 into b1 (in place).
    C: tokens 1..4 dead, token 0 moves into C.b1's hole (in place), or with
    `evacuate_c` b1 (tokens 5..7 live) evacuated into a fresh block of its
    own, which takes b1's place, the second entry of C's list."""
    from vllm.vtoken.planner import BlockPlan

    ids = {r: [b.block_id for b in vt.reclaimer.positional(r)] for r in "ABC"}
    vt.pool.evict("A", np.arange(4, 8))
    vt.pool.evict("B", np.arange(1, 7))
    vt.pool.evict("C", np.arange(1, 5))
    if caching:
        src = [ids["A"][1], ids["B"][0], ids["B"][1], ids["C"][0]]
        src_indptr, dst, dst_indptr = [0, 1, 3, 4], [ids["C"][1]], [0, 0, 0, 1]
        fresh = [1, 1, 0]
        if evacuate_c:
            src[3] = ids["C"][1]
            dst, dst_indptr, fresh = [], [0, 0, 0, 0], [1, 1, 1]
    else:
        src = [ids["A"][1], ids["B"][0], ids["C"][0]]
        src_indptr, dst, dst_indptr = (
            [0, 1, 2, 3],
            [ids["B"][1], ids["C"][1]],
            [0, 0, 1, 2],
        )
        fresh = [0, 0, 0]
    plan = BlockPlan(
        req_index=np.array([0, 1, 2]),
        src_indptr=np.array(src_indptr),
        src_block_ids=np.array(src, np.int32),
        dst_indptr=np.array(dst_indptr),
        dst_block_ids=np.array(dst, np.int32),
        num_fresh=np.array(fresh),
    )
    entry_of = {b: i for r in "ABC" for i, b in enumerate(ids[r][:3])}
    recs = [vt._reqs[r] for r in "ABC"]
    hashed = [b for b in entry_of if kv.block_pool.blocks[b].block_hash is not None]
    cached_ids = np.array(hashed, np.int64)  # what the plan reads
    rows = vt.pool.rows(list("ABC"))
    batch = vt.reclaimer._bind(plan, recs, list("ABC"), rows, entry_of, cached_ids)
    return ids, batch


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("drop", [None, "B", "C", "B-preempted", "C-preempted"])
def test_a_batch_of_three_requests_binds_and_releases_each_ones_part(caching, drop):
    """Bound: A's block freed at once (nothing to move) and its fresh block
    returned; B's and C's parts at their own offsets. Acknowledged (with B or
    C dropped first: finished, or preempted and still known, its part
    undone): the kept requests' sources leave their lists, no block stays
    busy, and every block comes back."""
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, reqs = three(caching)
    free0 = kv.block_pool.get_num_free_blocks()
    ids, batch = bind(kv, vt, caching)
    assert batch.req_ids == ["B", "C"]
    m = vt.reclaimer._inflight[batch.batch_id]
    assert vt.reclaimer.positional("A")[1].is_null  # freed at once
    assert kv.block_pool.get_num_free_blocks() == free0 + 1 - (1 if caching else 0)
    # A's fresh block went back; B's is in B's list
    if caching:
        assert len(m.fresh) == 1 and m.fresh_indptr.tolist() == [0, 1, 1]
        assert vt.reclaimer.positional("B")[0].block_id == m.fresh[0].block_id
        assert m.src_ids.tolist() == [ids["B"][0], ids["B"][1], ids["C"][0]]
        assert m.src_at.tolist() == [0, 1, 0]
        assert m.dst_ids.tolist() == [m.fresh[0].block_id, ids["C"][1]]
    else:
        assert m.src_ids.tolist() == [ids["B"][0], ids["C"][0]]
        assert m.dst_ids.tolist() == [ids["B"][1], ids["C"][1]]
    assert m.dst_indptr.tolist() == [0, 1, 2]
    vt.check_integrity()
    if drop:
        drop, _, how = drop.partition("-")
        r = {x.request_id: x for x in reqs}[drop]
        vt.on_preempt(r) if how == "preempted" else vt.on_free(r)
        kv.free(r)
        k, d = m.index[drop], m.dst_indptr
        src = m.src_ids[m.src_indptr[k] : m.src_indptr[k + 1]].tolist()
        dst = m.dst_ids[d[k] : d[k + 1]].tolist()
        assert not set(vt.reclaimer.busy_blocks().tolist()) & set(src + dst)
        vt.check_integrity()
    vt.on_output(VTokenWorkerOutput(acked_batches=[batch.batch_id]))
    vt.check_integrity()
    assert not vt.reclaimer.busy_blocks().size and not vt.reclaimer._inflight
    for r in "BC":
        if r != drop:
            now = [b.block_id for b in vt.reclaimer.positional(r)]
            gone = [b for b in m.src_ids.tolist() if b in ids[r]]
            assert gone and not set(gone) & set(now), (r, now, gone)
    for r in list(vt._reqs):
        x = vt._requests[r]
        vt.on_free(x)
        kv.free(x)
    assert kv.block_pool.get_num_free_blocks() == 32 - 1  # all but the null block


@pytest.mark.parametrize("caching", [True, False])
def test_a_destination_emptied_in_flight_is_freed_with_its_own_request(caching):
    """C's destination (C.b1) loses every live token in flight: freed at the
    ack, B's untouched (reduceat over two requests)."""
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, reqs = three(caching)
    ids, batch = bind(kv, vt, caching)
    vt.pool.evict("C", np.array([5, 6, 7]))  # C.b1's own live tokens die
    vt.pool.evict("C", np.array([0]))  # and the one moving in
    free = kv.block_pool.get_num_free_blocks()
    vt.on_output(VTokenWorkerOutput(acked_batches=[batch.batch_id]))
    vt.check_integrity()
    assert vt.reclaimer.positional("C")[1].is_null
    # sources of B and C, and C's dead destination
    assert kv.block_pool.get_num_free_blocks() == free + (4 if caching else 3)


def test_an_evacuation_puts_each_fresh_block_where_its_own_source_was():
    """B and C both evacuate cached blocks (B two sources into one fresh
    block, C its second block): the batch swaps every fresh block in at once
    (BlockIndex.replace_at_many), each into its own request's list at its
    source's entry; acknowledged, the sources are freed and the lists keep
    the fresh blocks."""
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, reqs = three(caching=True)
    ids, batch = bind(kv, vt, caching=True, evacuate_c=True)
    m = vt.reclaimer._inflight[batch.batch_id]
    assert batch.req_ids == ["B", "C"] and m.fresh_indptr.tolist() == [0, 1, 2]
    fresh_b, fresh_c = (b.block_id for b in m.fresh)
    lists = {r: [b.block_id for b in vt.reclaimer.positional(r)] for r in "BC"}
    assert lists == {
        "B": [fresh_b, ids["B"][1], ids["B"][2], *ids["B"][3:]],
        "C": [ids["C"][0], fresh_c, ids["C"][2], *ids["C"][3:]],
    }
    assert m.src_at.tolist() == [0, 1, 1]
    assert m.dst_ids.tolist() == [fresh_b, fresh_c]
    vt.check_integrity()
    vt.on_output(VTokenWorkerOutput(acked_batches=[batch.batch_id]))
    vt.check_integrity()
    assert [b.block_id for b in vt.reclaimer.positional("B")][:2] == [fresh_b, 0]
    assert vt.reclaimer.positional("C")[1].block_id == fresh_c
    assert vt.reclaimer.blocks.find("C", [fresh_c, ids["C"][1]]) == [1]


def new_requests(n: int, caching: bool = False):
    """n requests of 12-token prompts (three blocks each), allocated by vLLM
    and not yet seen by vToken (budget 64: nothing evicted), with blocks to
    spare: (kv, vt, the requests, the step that first schedules them)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    kv, vt, _ = setup("vtoken", caching=caching, blocks=5 * n + 8, budget=64)
    hasher = get_request_block_hasher(B, sha256) if caching else None
    vt._requests.clear()
    reqs = [
        Request(f"r{i}", list(range(100 * i, 100 * i + 3 * B)), SamplingParams(),
                None, block_hasher=hasher)
        for i in range(n)
    ]  # fmt: skip
    vt.begin_step([])
    for r in reqs:
        vt._requests[r.request_id] = r
        assert kv.allocate_slots(r, 3 * B) is not None
    first = SimpleNamespace(num_scheduled_tokens={r.request_id: 3 * B for r in reqs})
    return kv, vt, reqs, first


def planned_and_acked_calls(n: int, caching: bool) -> tuple[tuple, tuple]:
    """The (Python and C calls, overlay lines) of one plan of n requests
    (each with a block's worth of holes in two blocks) and of its
    acknowledgement (`counted`). With caching, only the calls the overlay
    makes, and blocks to spare for every request's evacuation (else some
    plans evacuate and others do not): vLLM's evict_blocks and free_blocks
    take a Python call per block of their own."""
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, reqs, first = new_requests(n, caching)
    vt.end_step(first)
    for r in reqs:
        r.num_computed_tokens += 3 * B
        r.append_output_token_ids(7)
        vt.pool.evict(r.request_id, np.arange(1, 7))  # holes in b0 and b1
    vt.on_output(VTokenWorkerOutput())
    rids = [r.request_id for r in reqs]
    planned, batch = counted(
        lambda: vt.reclaimer.plan(rids, vt._reqs, vt._requests, rids), caching
    )
    fresh = vt.reclaimer._inflight[batch.batch_id].fresh_indptr[-1]
    assert fresh == (n if caching else 0)  # each one evacuated, or none
    acked, _ = counted(
        lambda: vt.on_output(VTokenWorkerOutput(acked_batches=[batch.batch_id])),
        caching,
    )
    assert batch.req_ids == rids  # each request planned, its part acked
    vt.check_integrity()
    assert not vt.reclaimer._inflight
    return planned, acked


def counted(run, overlay_only=False) -> tuple[tuple[int, int], object]:
    """((the Python and C calls `run()` makes, or with `overlay_only` the
    overlay's code makes, the lines of the overlay's code it runs), what it
    returns): engine_driver.call_counter, which the engine-level count
    (tests/e2e/test_step_cost.py) uses too."""
    import gc

    counts = {"call": 0, "c_call": 0, "line": 0}
    # No collection inside: a finalizer it runs is a call the run did not
    # make (one full unit run counted 16 requests' plan unlike 4's; the
    # test alone, and two more full runs, did not).
    gc.collect()
    gc.disable()
    try:
        out = engine_driver.call_counter(counts, overlay_only)(run)
    finally:
        gc.enable()
    return (counts["call"] + counts["c_call"], counts["line"]), out


@pytest.mark.parametrize("caching", [False, True])
def test_a_plan_and_its_ack_make_as_many_calls_for_16_requests_as_for_4(
    monkeypatch, caching
):
    """Requests planned in one step are planned, bound and acknowledged in
    one batch pass: no call, nor line of the overlay, per request (DESIGN.md
    §7.1). With prefix caching too: the reference count and hash of each
    cached block a plan may take are read off vLLM's objects in C loops
    (`block_hash` is a property, a Python frame a block through it)."""
    from vllm.vtoken import integrity

    monkeypatch.setattr(integrity, "CHECK", False)  # the deep checks loop
    planned_and_acked_calls(4, caching=caching)  # first calls: numba's loads
    few, many = (planned_and_acked_calls(n, caching=caching) for n in (4, 16))
    assert few == many


def test_a_plan_reads_no_null_or_full_cached_block(monkeypatch):
    """A plan reads the reference count and hash of a request's blocks vLLM
    may have cached off vLLM's objects (cold in a step), but only of those
    it may take: not of a full block, nor of a null entry."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher
    from vllm.v1.request import Request
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, _ = setup("vtoken", caching=True, blocks=16, budget=64)
    r = Request("R", list(range(500, 516)), SamplingParams(), None,
                block_hasher=get_request_block_hasher(B, sha256))  # fmt: skip
    vt._requests.clear()
    vt._requests["R"] = r
    vt.begin_step([])
    assert kv.allocate_slots(r, 16) is not None
    vt.end_step(SimpleNamespace(num_scheduled_tokens={"R": 16}))
    r.num_computed_tokens += 16
    r.append_output_token_ids(7)
    vt.on_output(VTokenWorkerOutput())
    ids = [b.block_id for b in vt.reclaimer.positional("R")]
    assert all(kv.block_pool.blocks[b].block_hash is not None for b in ids)
    # b0 full; b1 emptied, so freed (null); holes in b2 and b3.
    dead = np.array([4, 5, 6, 7, 9, 10, 13, 14])
    vt.pool.evict("R", dead)
    vt.reclaimer.free_empty_blocks(["R"], np.zeros(dead.size, np.int64), dead)
    vt.reclaimer.stop_caching("R")
    null = kv.block_pool.null_block.block_id
    assert [b.block_id for b in vt.reclaimer.positional("R")] == [
        ids[0], null, ids[2], ids[3]
    ]  # fmt: skip
    read = []
    from vllm.vtoken import reclaimer

    def counted_hash(block):  # the plan's getter (the property's field)
        assert isinstance(block, KVCacheBlock)
        read.append(block.block_id)
        return block.block_hash

    monkeypatch.setattr(reclaimer, "_HASH", counted_hash)
    batch = vt.reclaimer.plan(["R"], vt._reqs, vt._requests, ["R"])
    assert batch is not None and batch.req_ids == ["R"]
    assert ids[2] in read and ids[3] in read  # the candidates are read
    assert ids[0] not in read and null not in read


def slotted_calls(n: int) -> tuple[int, int]:
    """The (calls, overlay lines) of the scheduler's end_step when each of
    n requests' one new token opens a block: its block id is read off
    vLLM's list (the scheduler's _sync_slots), the batch's at once."""
    from vllm.vtoken.messages import VTokenWorkerOutput

    kv, vt, reqs, first = new_requests(n)
    vt.end_step(first)
    for r in reqs:
        r.num_computed_tokens += 3 * B
        r.append_output_token_ids(7)
    vt.on_output(VTokenWorkerOutput())
    vt.begin_step([])
    for r in reqs:  # the fourth block: allocated by vLLM, read by vToken
        assert kv.allocate_slots(r, 1) is not None
    step = SimpleNamespace(num_scheduled_tokens={r.request_id: 1 for r in reqs})
    out, _ = counted(lambda: vt.end_step(step))
    vt.check_integrity()
    assert (
        vt.pool.num_slotted_rows(vt.pool.rows([r.request_id for r in reqs])).tolist()
        == [3 * B + 1] * n
    )
    return out


def test_a_step_opening_a_block_for_16_requests_makes_as_many_calls_as_for_4(
    monkeypatch,
):
    """The new blocks' ids are read off vLLM's block lists in C loops: no
    call, nor line of the overlay, per request (a comprehension was a line a
    block, which the engine-level count's median step does not see: with
    requests in step, one step in B opens blocks)."""
    from vllm.vtoken import integrity

    monkeypatch.setattr(integrity, "CHECK", False)  # the deep checks loop
    slotted_calls(4)  # first calls: numba's loads
    assert slotted_calls(4) == slotted_calls(16)


def admitted_calls(n: int):
    """Per function, the calls and overlay lines of the scheduler's end_step
    that first sees n new requests (12-token prompts): a Counter of
    (kind, function) -> count, kind "call" (a Python function called: the
    callee), "c_call" (a C function: keyed by its caller) or "line"."""
    import collections
    import gc
    import sys

    _, vt, _, step = new_requests(n)
    seen = collections.Counter()

    def name(code):
        return f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_qualname}"

    def hook(frame, event, arg):
        if event == "call":
            fn = name(frame.f_code)
            if frame.f_code.co_name == "__init__":  # a dataclass's: by its class
                fn = f"{type(frame.f_locals['self']).__qualname__}.__init__"
            seen["call", fn] += 1
        elif event == "c_call":
            seen["c_call", name(frame.f_code)] += 1

    def line(frame, event, arg):
        if event == "line":
            seen["line", name(frame.f_code)] += 1
        return line

    def trace(frame, event, arg):
        return line if "/vllm/vtoken/" in frame.f_code.co_filename else None

    gc.collect()
    gc.disable()
    sys.settrace(trace)
    sys.setprofile(hook)
    try:
        vt.end_step(step)
    finally:
        sys.setprofile(None)
        sys.settrace(None)
        gc.enable()
    vt.check_integrity()
    return seen


# What a new request costs in Python whatever the batch: its state, the key
# its generator is seeded from (the prompt's bytes), and its seed (a hash).
PER_REQUEST = {
    "RequestState.__init__",
    "seeding.py:prompt_key",
    "seeding.py:request_seed",
    "_Evicting.__init__",  # its call
    "eviction.py:_Evicting.__init__",  # its lines
}


def test_a_step_admitting_16_requests_makes_no_more_calls_a_request_than_their_own(
    monkeypatch,
):
    """The scheduler registers a step's new requests at once (their rows,
    columns, policies and settings), so the only calls and overlay lines
    that grow with the batch are each request's own identity (PER_REQUEST:
    ~80 calls a request before, on the two sides, most per-request
    settings and rows)."""
    from vllm.vtoken import integrity

    monkeypatch.setattr(integrity, "CHECK", False)  # the deep checks loop
    admitted_calls(4)  # first calls: numba's loads
    few, many = admitted_calls(4), admitted_calls(16)
    grown = {key for key in few.keys() | many.keys() if many[key] != few[key]}
    assert grown and {fn for _, fn in grown} <= PER_REQUEST, sorted(grown)
