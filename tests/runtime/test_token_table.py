# SPDX-License-Identifier: Apache-2.0
"""TokenTablePool: exact slots, both views in step, validation before mutation."""

import numpy as np
import pytest

from vllm.vtoken import integrity
from vllm.vtoken.context import read_keys
from vllm.vtoken.token_table import TokenTablePool

B = 4


def make_pool(num_blocks: int = 16, **reqs: list[int]) -> TokenTablePool:
    pool = TokenTablePool(num_blocks, B)
    for rid, slots in reqs.items():
        pool.add_request(rid)
        pool.append(rid, np.asarray(slots))
    return pool


def snapshot(pool: TokenTablePool, rid: str):
    return (
        pool.block_live.copy(),
        pool.slots(rid).copy(),
        pool.live_idx(rid),
        pool.num_live(rid),
        pool.total_live(),
    )


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_append_maps_slots_and_counts_blocks():
    pool = make_pool(a=[12, 13, 14, 15, 40, 41], b=[8, 9])
    np.testing.assert_array_equal(pool.slots("a"), [12, 13, 14, 15, 40, 41])
    assert pool.slots("a").dtype == np.int32
    assert pool.block_live[3] == 4 and pool.block_live[10] == 2
    assert pool.block_live[2] == 2 and pool.block_live.sum() == 8
    assert pool.num_tokens("a") == pool.num_slotted("a") == pool.num_live("a") == 6
    assert pool.total_live() == 8
    pool.append("a", np.array([42]))
    np.testing.assert_array_equal(pool.live_slots("a"), [12, 13, 14, 15, 40, 41, 42])
    assert pool.block_live[10] == 3
    assert sorted(pool.request_ids()) == ["a", "b"]
    pool.check_integrity()


def test_evict_flips_bits_and_block_counts():
    pool = make_pool(a=[12, 13, 14, 15, 40, 41, 42, 43, 20])
    out = pool.evict("a", np.array([5, 1, 3, 4, 7]))
    np.testing.assert_array_equal(out, [1, 3, 4, 5, 7])
    assert out.dtype == np.int64
    np.testing.assert_array_equal(pool.live_idx("a"), [0, 2, 6, 8])
    np.testing.assert_array_equal(pool.live_slots("a"), [12, 14, 42, 20])
    np.testing.assert_array_equal(pool.dead_idx("a"), [1, 3, 4, 5, 7])
    assert (pool.block_live[3], pool.block_live[10], pool.block_live[5]) == (2, 1, 1)
    assert pool.num_live("a") == 4 and pool.total_live() == 4
    assert pool.evict("a", np.array([], dtype=np.int64)).size == 0
    pool.check_integrity()


def move(pool, rid, idx, slots):
    """One request's moves as the acknowledgement path applies them."""
    pool.apply_moves([rid], np.array([0, len(idx)]), np.array(idx), np.array(slots))


@pytest.mark.parametrize("idx", [[0, 9], [-1], [2, 2], [1]])
def test_evict_catches_bad_indices_before_mutating(idx):
    pool = make_pool(a=[12, 13, 14, 15, 40, 41, 42, 43, 20])
    pool.evict("a", np.array([1]))
    before = snapshot(pool, "a")
    with pytest.raises(AssertionError):
        pool.evict("a", np.array([0, *idx]))
    assert_same(before, snapshot(pool, "a"))
    with pytest.raises(KeyError):
        pool.evict("nope", np.array([0]))
    with pytest.raises(AssertionError, match="integers"):
        pool.evict("a", np.array([0.0, 1.0]))


def test_append_catches_bad_slots():
    pool = make_pool(a=[0, 1])
    before = snapshot(pool, "a")
    for bad in ([5, 5], [-1], [16 * B], [[1, 2]]):
        with pytest.raises(AssertionError):
            pool.append("a", np.array(bad))
    assert_same(before, snapshot(pool, "a"))
    with pytest.raises(KeyError):
        pool.append("zz", np.array([3]))
    with pytest.raises(AssertionError):
        pool.add_request("a")


def test_apply_moves_moves_live_counts_and_dead_tokens_count_nowhere():
    pool = make_pool(a=[12, 13, 14, 15, 40, 41, 42, 43, 20])
    pool.evict("a", np.array([1, 3, 4, 5, 7]))
    # Plan moved tokens 0, 2, 6 into block 9; token 6 died before the ack.
    pool.evict("a", np.array([6]))
    move(pool, "a", [0, 2, 6], [36, 37, 38])
    np.testing.assert_array_equal(pool.slots("a"), [36, 13, 37, 15, 40, 41, 38, 43, 20])
    np.testing.assert_array_equal(pool.live_slots("a"), [36, 37, 20])
    assert pool.block_live[9] == 2 and pool.block_live[3] == 0
    assert pool.block_live[10] == 0 and pool.block_live[5] == 1
    pool.check_integrity()


def test_apply_moves_skips_gone_unslotted_and_unkept_requests():
    pool = make_pool(a=[0, 1], b=[4, 5], c=[8, 9])
    pool.reset_slots("b")  # preempted while its copy ran
    ids = ["a", "b", "c", "gone"]
    pool.apply_moves(
        ids,
        np.array([0, 1, 2, 3, 4]),
        np.zeros(4, np.int64),
        np.array([12, 13, 14, 15]),
        keep=[True, True, False, True],
    )
    np.testing.assert_array_equal(pool.slots("a"), [12, 1])
    assert pool.num_slotted("b") == 0
    np.testing.assert_array_equal(pool.slots("c"), [8, 9])
    pool.check_integrity()


def test_apply_moves_catches_bad_moves_before_mutating():
    pool = make_pool(a=[0, 1, 2, 3])
    before = snapshot(pool, "a")
    cases = [
        ([0, 0], [8, 9]),  # repeated index
        ([0, 1], [8, 8]),  # repeated slot
        ([0, 4], [8, 9]),  # not slotted
        ([0, 1], [8, 64]),  # slot out of range
    ]
    for idx, slots in cases:
        with pytest.raises(AssertionError):
            move(pool, "a", idx, slots)
    with pytest.raises(AssertionError):  # length mismatch
        pool.apply_moves(["a"], np.array([0, 2]), np.array([0, 1]), np.array([8]))
    assert_same(before, snapshot(pool, "a"))


@pytest.mark.parametrize(
    "idx,slots", [([0, 4], [8, 9]), ([0, -1], [8, 9]), ([0, 1], [8, 64]), ([0], [-2])]
)
def test_a_move_outside_the_table_is_refused_without_deep_checks(
    monkeypatch, idx, slots
):
    # The compiled switch reads and writes without bounds checks: it checks
    # every move first, so a bad one changes nothing and writes nowhere else.
    monkeypatch.setattr(integrity, "CHECK", False)
    pool = make_pool(a=[0, 1, 2, 3], b=[4, 5])
    before = snapshot(pool, "a"), snapshot(pool, "b")
    with pytest.raises(AssertionError, match="not slotted or slot"):
        pool.apply_moves(
            ["b", "a"],
            np.array([0, 1, 1 + len(idx)]),
            np.array([0, *idx]),
            np.array([12, *slots]),
        )
    assert_same(before[0], snapshot(pool, "a"))
    assert_same(before[1], snapshot(pool, "b"))


@pytest.mark.parametrize(
    "indptr,keep,match",
    [
        ([0, 1, 2], None, "does not match"),  # ends short of idx
        ([1, 1, 3], None, "does not match"),
        ([0, 3, 2, 3], None, "decreases"),  # one more request
        ([0, 1, 3], [True], "does not match"),
    ],
)
def test_a_batch_whose_csr_does_not_fit_is_refused_without_deep_checks(
    monkeypatch, indptr, keep, match
):
    monkeypatch.setattr(integrity, "CHECK", False)
    pool = make_pool(a=[0, 1, 2, 3], b=[4, 5], c=[6])
    before = [snapshot(pool, r) for r in "abc"]
    rids = ["b", "a", "c"][: len(indptr) - 1]
    with pytest.raises(AssertionError, match=match):
        pool.apply_moves(
            rids, np.array(indptr), np.array([0, 0, 1]), np.array([12, 13, 14]), keep
        )
    for r, b in zip("abc", before, strict=True):
        assert_same(b, snapshot(pool, r))


def test_reset_slots_keeps_liveness_and_resync_restores_counts():
    pool = make_pool(a=[4, 5, 6, 7, 8, 9])
    pool.evict("a", np.array([1, 4]))
    pool.reset_slots("a")
    assert pool.num_slotted("a") == 0 and pool.num_tokens("a") == 6
    assert pool.block_live.sum() == 0 and pool.num_live("a") == 4
    assert pool.live_idx("a").size == 0
    np.testing.assert_array_equal(pool.dead_idx("a"), [1, 4])
    pool.check_integrity()
    # Recompute after preemption: known tokens keep their bits, 6 and 7 are new.
    pool.append("a", np.array([20, 21, 22, 23, 24]))
    pool.append("a", np.array([25, 26, 27]))
    np.testing.assert_array_equal(pool.live_idx("a"), [0, 2, 3, 5, 6, 7])
    np.testing.assert_array_equal(pool.live_slots("a"), [20, 22, 23, 25, 26, 27])
    assert (pool.block_live[5], pool.block_live[6]) == (3, 3)
    assert pool.num_tokens("a") == 8 and pool.num_live("a") == 6
    pool.check_integrity()


def test_release_many_is_release_one_by_one():
    """The worker's finished requests, released at once: the same block
    counts, live total, rows and cleared regions as one `release` each, with
    a row holding dead tokens and a preempted one (live bits, no slots)
    among them; the regions come back empty to the next requests."""
    rng = np.random.default_rng(0)
    pools = []
    for _ in range(2):
        pool = make_pool(
            64, a=list(range(0, 10)), b=list(range(16, 30)), c=list(range(40, 47)),
            d=list(range(80, 96)),
        )  # fmt: skip
        pool.evict("a", np.array([1, 4, 5]))
        pool.evict("d", np.array([0, 15]))
        pool.reset_slots("c")  # preempted: its live bits stay, slots go
        pools.append(pool)
    pools[0].release_many(["d", "a", "c"])
    for rid in ("d", "a", "c"):
        pools[1].release(rid)
    for pool in pools:
        assert "a" not in pool and "c" not in pool and "d" not in pool
        assert pool.total_live() == pool.num_live("b") == 14
        assert pool.block_live.sum() == 14
        pool.check_integrity()
    np.testing.assert_array_equal(pools[0].block_live, pools[1].block_live)
    for pool in pools:  # new requests take the rows: nothing left of the old
        for k, rid in enumerate("efg"):
            pool.add_request(rid)
            pool.append(rid, rng.permutation(np.arange(100, 105)) + 5 * k)
        assert all(pool.num_live(r) == 5 for r in "efg")
        assert pool.num_tokens("e") == 5
        pool.check_integrity()
    with pytest.raises(KeyError):
        pools[0].release_many(["b", "a"])


def test_release_returns_counts_and_forgets_request():
    pool = make_pool(a=[4, 5, 6], b=[8, 9])
    pool.evict("a", np.array([0]))
    pool.release("a")
    assert "a" not in pool and "b" in pool
    assert pool.block_live.sum() == 2 and pool.total_live() == 2
    with pytest.raises(KeyError):
        pool.release("a")
    pool.check_integrity()


def test_tables_grow_by_doubling_past_the_initial_capacity():
    pool = make_pool(num_blocks=64)
    pool.add_request("a")
    for start in range(0, 200, 7):
        pool.append("a", np.arange(start, min(start + 7, 200)))
    np.testing.assert_array_equal(pool.slots("a"), np.arange(200))
    np.testing.assert_array_equal(pool.block_live[:50], np.full(50, 4))
    assert pool.num_live("a") == 200
    pool.check_integrity()


def test_check_integrity_names_each_violation():
    pool = make_pool(a=[4, 5], b=[8, 9])
    pool.block_live[1] += 1
    with pytest.raises(AssertionError, match="block_live != recount"):
        pool.check_integrity()
    pool.block_live[1] -= 1
    pool.check_integrity()
    # b's token 0 claims a's live slot 4: owned twice (block 1 not shared).
    move(pool, "b", [0], [4])
    with pytest.raises(AssertionError, match="owned by two requests"):
        pool.check_integrity()
    ref = np.zeros(16, dtype=np.int64)
    ref[[1, 2]] = 1
    with pytest.raises(AssertionError, match="unshared blocks"):
        pool.check_integrity(block_ref_cnt=ref)
    ref[1] = 2  # a prefix-cache block shared by both requests
    pool.check_integrity(block_ref_cnt=ref)
    ref[2] = 0  # b's token 1 sits in block 2, which the block pool calls free
    with pytest.raises(AssertionError, match="live tokens in free blocks"):
        pool.check_integrity(block_ref_cnt=ref)


def test_check_integrity_catches_a_slot_used_twice_within_a_request():
    pool = make_pool(a=[4, 5, 6])
    move(pool, "a", [2], [5])  # apply_moves cannot see the clash
    with pytest.raises(AssertionError, match="a slot used twice"):
        pool.check_integrity()


def test_a_batch_append_may_give_two_requests_the_same_shared_slots(monkeypatch):
    """Requests that hit the same prefix-cached block get the same slots in one
    step's append; a slot twice within one request is still an error."""
    from vllm.vtoken import integrity

    monkeypatch.setattr(integrity, "CHECK", True)
    pool = TokenTablePool(16, B)
    for rid in "ab":
        pool.add_request(rid)
    rows = pool.rows(["a", "b"])
    pool.append_rows(rows, np.array([3, 3]), np.array([8, 9, 10, 8, 9, 10]))
    np.testing.assert_array_equal(pool.slots("b"), [8, 9, 10])
    with pytest.raises(AssertionError, match="a slot twice"):
        pool.append_rows(rows, np.array([2, 0]), np.array([12, 12]))


def test_a_row_twice_in_one_batch_is_refused(monkeypatch):
    """(Review) A repeated row would keep one of its counter updates only."""
    from vllm.vtoken import integrity

    monkeypatch.setattr(integrity, "CHECK", True)
    pool = make_pool(a=[12, 13, 14])
    rows = pool.rows(["a", "a"])
    with pytest.raises(AssertionError, match="a row twice"):
        pool.evict_rows(rows, np.array([0, 1, 2]), np.array([0, 1]))
    with pytest.raises(AssertionError, match="a row twice"):
        pool.append_rows(rows, np.array([1, 1]), np.array([15, 16]))
    assert pool.num_live("a") == 3


@pytest.mark.parametrize("check", [False, True])
def test_a_batch_whose_requests_left_applies_to_the_rest(monkeypatch, check):
    """(CI, the hostile mix) Two requests of a move batch finished before its
    ack: both are missing, which the deep checks once read as a row twice."""
    from vllm.vtoken import integrity

    monkeypatch.setattr(integrity, "CHECK", check)
    pool = make_pool(a=[0, 1], b=[4, 5], c=[8, 9])
    pool.release("a")
    pool.release("b")
    pool.apply_moves(
        ["a", "b", "c"],
        np.array([0, 1, 2, 3]),
        np.zeros(3, np.int64),
        np.array([12, 13, 14]),
    )
    np.testing.assert_array_equal(pool.slots("c"), [14, 9])
    pool.check_integrity()


def test_dead_since_mark_counts_evictions_and_recounted_tokens():
    pool = make_pool(a=[12, 13, 14, 15, 40, 41], b=[8, 9, 10])
    rows = pool.rows(["a", "b"])
    np.testing.assert_array_equal(pool.dead_since_mark_rows(rows), [0, 0])
    pool.evict("a", np.array([1, 2]))
    pool.evict("b", np.array([0]))
    np.testing.assert_array_equal(pool.dead_since_mark_rows(rows), [2, 1])
    pool.mark_rows(rows[:1])  # "a" planned: starts over
    np.testing.assert_array_equal(pool.dead_since_mark_rows(rows), [0, 1])
    pool.evict("a", np.array([3]))
    pool.append("a", np.array([42]))  # a new token is live: no change
    np.testing.assert_array_equal(pool.dead_since_mark_rows(rows), [1, 1])
    # A resumed request recomputes its 3 dead tokens: they count again.
    pool.mark_rows(rows[:1], recounted=np.array([3]))
    np.testing.assert_array_equal(pool.dead_since_mark_rows(rows), [4, 1])
    pool.release("a")
    pool.add_request("c")  # takes a's row, from zero
    assert pool.dead_since_mark_rows(pool.rows(["c"]))[0] == 0


@pytest.mark.parametrize("n", [3, 200])  # few ids (np.unique), many (bincount)
def test_add_counts_counts_each_occurrence(n):
    from vllm.vtoken.arena import add_counts

    rng = np.random.default_rng(n)
    ids = rng.integers(0, 20, n)
    counts = np.full(20, 5, np.int32)
    want = counts.copy()
    np.add.at(want, ids, -2)
    add_counts(counts, ids, -2)
    np.testing.assert_array_equal(counts, want)
    assert counts.dtype == np.int32


@pytest.mark.parametrize("share", [0.0, 0.1, 1.0])
def test_picked_keeps_what_compress_keeps(share):
    from itertools import compress

    from vllm.vtoken.arena import picked

    ids = [f"r{i}" for i in range(50)]
    mask = np.random.default_rng(7).random(50) < share
    assert picked(ids, mask) == list(compress(ids, mask.tolist()))
    assert picked([], np.zeros(0, bool)) == []


def test_as_index_takes_integers_only():
    from vllm.vtoken.arena import as_index

    for ints in ([3, 1], np.array([3, 1], np.int32), np.array([3, 1], np.uint8)):
        out = as_index(ints, "ids")
        assert out.dtype == np.int64 and out.tolist() == [3, 1]
    assert as_index([], "ids").size == 0  # an empty list is float64: allowed
    for bad in (np.array([1.0]), np.array([True])):
        with pytest.raises(AssertionError, match="ids must hold integers"):
            as_index(bad, "ids")
    with pytest.raises(AssertionError, match="ids must be 1-D"):
        as_index(np.zeros((1, 1), np.int64), "ids")


def test_the_hooks_offsets_are_indptr_of_whatever_ints_they_get():
    # TokenTablePool.offsets, the hooks' compiled indptr_of: the same CSR
    # offsets for the int64 arrays the hooks pass, and for the int32, strided,
    # empty and read-only ones a plug-in's answer or a transported message
    # may bring (converted or read, not refused).
    from vllm.vtoken.arena import indptr_of
    from vllm.vtoken.table_kernels import offsets_into

    pool = TokenTablePool(16, B)
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 40, size=37).astype(np.int64)
    frozen = counts.copy()
    frozen.flags.writeable = False
    for c in (counts, counts[::3], counts.astype(np.int32), counts[:0], frozen):
        got = pool.offsets(c)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, indptr_of(c))
    with pytest.raises(ValueError, match="one longer"):
        offsets_into(counts, np.zeros(counts.size, np.int64))


def test_live_tokens_walk_the_live_list_in_logical_order():
    pool = make_pool(a=[12, 13, 14, 15, 40, 41], b=[8, 9, 10])
    pool.evict("a", np.array([0, 2, 4]))
    pool.evict("b", np.array([1]))
    pool.append("a", np.array([42]))
    seg, idx, slot = pool.live_tokens(pool.rows(["b", "a"]))
    np.testing.assert_array_equal(seg, [0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(idx, [0, 2, 1, 3, 5, 6])
    np.testing.assert_array_equal(slot, [8, 10, 13, 15, 41, 42])
    pool.reset_slots("a")  # preempted: live, but no slot
    pool.append("a", np.array([20, 21, 22]))  # resumed: three re-slotted
    seg, idx, slot = pool.live_tokens(pool.rows(["a"]))
    np.testing.assert_array_equal(idx, [1])
    np.testing.assert_array_equal(slot, [21])
    pool.check_integrity()


def test_read_keys_are_live_old_tokens_then_every_query():
    pool = make_pool(a=[12, 13, 14, 15], b=[8, 9])
    pool.evict("a", np.array([1]))
    pool.reset_slots("a")
    # "a" resumes: its 4 known tokens (token 1 dead) are recomputed, with one
    # new one; "b" decodes one token after 2 computed.
    pool.append("a", np.array([20, 21, 22, 23, 24]))
    pool.append("b", np.array([10]))
    counts, idx, slot = read_keys(pool, pool.rows(["a", "b"]), np.array([0, 2]))
    np.testing.assert_array_equal(counts, [5, 3])
    np.testing.assert_array_equal(idx, [0, 1, 2, 3, 4, 0, 1, 2])  # dead 1 too
    np.testing.assert_array_equal(slot, [20, 21, 22, 23, 24, 8, 9, 10])
    pool.evict("b", np.array([0]))
    counts, idx, slot = read_keys(pool, pool.rows(["b", "a"]), np.array([2, 5]))
    np.testing.assert_array_equal(counts, [2, 4])
    assert slot.dtype == np.int64
    np.testing.assert_array_equal(idx, [1, 2, 0, 2, 3, 4])  # b's dead 0 out
    np.testing.assert_array_equal(slot, [9, 10, 20, 22, 23, 24])


def test_check_integrity_catches_a_live_list_out_of_step():
    pool = make_pool(a=[12, 13, 14, 15])
    pool.check_integrity()
    pool._listed[pool._a.start[pool.rows(["a"])[0]] + 1] = 3  # [0, 3, 2, 3]
    with pytest.raises(AssertionError, match="live list"):
        pool.check_integrity()


def test_a_block_size_not_a_power_of_two_is_refused_not_asserted():
    # The kernels find a slot's block by a shift: a raise, which `python -O`
    # keeps, should a block size get past the start-up check.
    with pytest.raises(ValueError, match="not a power of two"):
        TokenTablePool(16, 12)


def test_a_list_keeping_its_dead_is_compacted_once_they_are_as_many_as_the_live():
    pool = TokenTablePool(64, B)
    pool.add_request("a", keep_dead=True)
    pool.append("a", np.arange(200))
    row = pool.rows(["a"])[0]
    for t in range(0, 150):  # one eviction a step, the oldest first
        pool.evict("a", np.array([t]))
        live = 200 - (t + 1)
        assert live <= pool._n_listed[row] < live + max(live, 16)
        if t < 16:  # fewer dead than 16: all still listed
            assert pool._n_listed[row] == 200
        if t in (15, 99):
            pool.check_integrity()
    assert pool._n_listed[row] < 2 * 50 + 16  # compacted along the way
    np.testing.assert_array_equal(pool.live_tokens([row])[1], np.arange(150, 200))
    counts, idx, _, _ = pool.read_walk([row], np.array([200]))
    np.testing.assert_array_equal(idx, np.arange(150, 200))
    pool.check_integrity()


def test_walks_of_lists_keeping_scattered_dead_copy_the_live_slotted_only():
    """A list keeping its dead, victims scattered through it (a plug-in's,
    or the lowest-scored): the walks (table_kernels.listed_live) list its
    live slotted tokens only, and a row ending in dead entries or unslotted
    tokens leaves nothing in the next row's keys."""
    rng = np.random.default_rng(7)
    pool = TokenTablePool(256, B)
    want = {}
    for r in range(12):
        rid, n = f"r{r}", int(rng.integers(5, 40))
        pool.add_request(rid, keep_dead=True)
        pool.append(rid, np.arange(n) + 64 * r)
        # Scattered victims, fewer than the live (the list keeps them), the
        # list's last two entries among them in every other row.
        dead = rng.choice(n - 2, int(rng.integers(1, n // 3 + 1)), replace=False)
        dead = np.union1d(dead, [n - 2, n - 1] if r % 2 else [])
        pool.evict(rid, np.sort(dead).astype(np.int64))
        want[rid] = np.setdiff1d(np.arange(n), dead)
    rows = pool.rows(list(want))
    assert (pool._n_listed[rows] > [len(w) for w in want.values()]).all()
    seg, idx, slot = pool.live_tokens(rows)
    np.testing.assert_array_equal(idx, np.concatenate(list(want.values())))
    np.testing.assert_array_equal(
        seg, np.repeat(np.arange(12), [len(w) for w in want.values()])
    )
    np.testing.assert_array_equal(slot, idx + 64 * seg)
    pool.reset_slots("r3")  # preempted: live, but slotted again from 0
    pool.append("r3", np.array([900, 901]))
    want["r3"] = want["r3"][want["r3"] < 2]
    counts, idx, _, _ = pool.read_walk(rows, pool.num_slotted_rows(rows))
    np.testing.assert_array_equal(counts, [len(w) for w in want.values()])
    np.testing.assert_array_equal(idx, np.concatenate(list(want.values())))
    pool.check_integrity()


def test_a_live_list_lists_the_live_tokens_only_after_every_kill():
    """A kill takes its victims out of the list (a scan to the first, then
    a shift or a close-up), whatever their order in the batch, so a walk
    copies the list; after a preemption the walks stop where the slotted
    prefix ends."""
    rng = np.random.default_rng(0)
    pool = make_pool(num_blocks=64, a=list(range(200)))
    row = pool.rows(["a"])[0]
    alive = np.arange(200)
    for step in range(40):  # scattered victims, up to 5 a kill, unsorted
        victims = rng.choice(alive, size=min(1 + step % 5, alive.size), replace=False)
        pool.evict_rows(np.array([row]), np.array([0, victims.size]), victims)
        alive = np.setdiff1d(alive, victims)
        assert pool._n_listed[row] == alive.size == pool.num_live("a")
        start = pool._a.start[row]
        np.testing.assert_array_equal(pool._listed[start : start + alive.size], alive)
        np.testing.assert_array_equal(pool.live_tokens([row])[1], alive)
    pool.evict_rows(np.array([row]), np.array([0, 1]), alive[-1:])  # the last
    alive = alive[:-1]
    np.testing.assert_array_equal(pool.live_tokens([row])[1], alive)
    pool.check_integrity()
    pool.reset_slots("a")  # preempted: nothing slotted, the list kept
    assert pool.live_tokens([row])[1].size == 0
    pool.append("a", np.arange(120))  # the resume recomputes 120 tokens
    np.testing.assert_array_equal(pool.live_tokens([row])[1], alive[alive < 120])
    counts, idx, _, queries = pool.read_walk([row], np.array([100]))
    np.testing.assert_array_equal(idx, alive[alive < 120])
    assert counts.tolist() == [idx.size] and queries == int((idx >= 100).sum())
    # One victim each (slotted, as evict_rows wants them): the list's first
    # entry, the last slotted one (unslotted ones follow it), one between.
    slotted = alive[alive < 120]
    for victim in (slotted[0], slotted[-1], slotted[slotted.size // 2]):
        pool.evict_rows(np.array([row]), np.array([0, 1]), np.array([victim]))
        alive = alive[alive != victim]
        start = pool._a.start[row]
        np.testing.assert_array_equal(pool._listed[start : start + alive.size], alive)
        assert pool._n_listed[row] == alive.size
        np.testing.assert_array_equal(pool.live_tokens([row])[1], alive[alive < 120])
    pool.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_compiled_batch_ops_agree_with_a_dense_recount(seed):
    # The batch ops are compiled loops (table_kernels): after every one of a
    # random run of appends, evictions, preemptions and releases, the live
    # walk equals the dense table's live tokens and check_integrity's
    # NumPy recount of block_live and the live lists passes.
    rng = np.random.default_rng(seed)
    pool = TokenTablePool(4096, B)
    free = list(rng.permutation(4096 * B))
    names = [f"r{i}" for i in range(12)]
    for rid in names:
        pool.add_request(rid)
    for _ in range(60):
        rids = list(rng.choice(names, size=rng.integers(1, 8), replace=False))
        rows = pool.rows(rids)
        op = rng.integers(10)
        if op < 5:  # a step's tokens (a resumed row re-slots its known ones)
            counts = rng.integers(0, 40, size=len(rids))
            pool.append_rows(rows, counts, [free.pop() for _ in range(counts.sum())])
        elif op < 9:  # evictions: some live slotted tokens of each row
            seg, idx, _ = pool.live_tokens(rows)
            pick = rng.random(idx.size) < rng.random()
            counts = np.bincount(seg[pick], minlength=len(rids))
            pool.evict_rows(rows, np.r_[0, np.cumsum(counts)], idx[pick])
            # The full blocks they emptied, against NumPy.
            dseg, dead = seg[pick], idx[pick]
            full = dead < (pool.num_slotted_rows(rows) // B * B)[dseg]
            blk = pool.tokens_at(rows, dseg[full], dead[full]) // B
            key = np.unique((dseg[full] * 4096 + blk)[pool.block_live[blk] == 0])
            got = pool.emptied_blocks(rows, dseg, dead)
            assert [x.tolist() for x in got[:2]] == [
                (key // 4096).tolist(),
                (key % 4096).tolist(),
            ]
            # Each with the positional entry of a token it held.
            for g, b, e in zip(*got, strict=True):
                mine = dead[dseg == g]
                where = pool.tokens_at(rows, np.full(mine.size, g), mine) // B
                assert e in (mine[where == b] // B).tolist()
        else:
            pool.reset_slots(rids[0]) if rng.random() < 0.7 else pool.release(rids[0])
            if rids[0] not in pool:
                pool.add_request(rids[0])
        seg, idx, live, slot = pool.tokens(pool.rows(names))
        got = pool.live_tokens(pool.rows(names))
        for a, b in zip(got, (seg[live], idx[live], slot[live]), strict=True):
            np.testing.assert_array_equal(a, b)
        pool.check_integrity()
    assert pool.total_live() == sum(pool.num_live(r) for r in names)


@pytest.mark.parametrize("seed", range(3))
def test_the_step_filter_and_eviction_runs_are_the_numpy_passes(seed):
    # The scheduler's begin_step chooses the requests to evict from, counts
    # what they lost and finds those due for the planner in compiled passes
    # (over_budget, evicted_runs, plan_due): each equals the NumPy passes it
    # replaced, on tables
    # with evictions and marks, rows without a table (-1), requests still in
    # their prompt, resumed ones re-slotted part of the way (a recompute in
    # chunks), and a limit (a batch in flight) or none.
    rng = np.random.default_rng(seed)
    pool = TokenTablePool(1024, B)
    names = [f"r{i}" for i in range(20)]
    free = list(rng.permutation(1024 * B))
    for rid in names:
        pool.add_request(rid)
    rows = pool.rows(names)
    counts = rng.integers(0, 30, 20)
    pool.append_rows(rows, counts, [free.pop() for _ in range(counts.sum())])
    for rid in names[:4]:  # preempted, resumed: the first chunk back in
        n = pool.num_tokens(rid)
        pool.reset_slots(rid)
        pool.append(rid, np.array([free.pop() for _ in range(n // 2)], np.int64))
    budget = rng.integers(0, 20, rows.max() + 1)
    seen = np.zeros(3, bool)  # the cases met: resuming, ok under budget, over
    seen_due = np.zeros(3, bool)  # not due for want of holes, of deaths; due
    for step in range(6):
        seg, idx, _ = pool.live_tokens(rows)
        pick = rng.random(idx.size) < 0.2
        counts = np.bincount(seg[pick], minlength=rows.size)
        pool.evict_rows(rows, np.r_[0, np.cumsum(counts)], idx[pick])
        # counts as a strided view (a plug-in's evict_batch may answer so)
        got_seg = pool.evicted_runs(np.c_[counts, counts][:, 0])
        np.testing.assert_array_equal(got_seg, np.arange(rows.size).repeat(counts))
        # Due: a block's worth dead since the mark, and of holes (dead less
        # a block per freed one), each alone not enough.
        pool.add_nulls(rows, rng.integers(0, 2, rows.size))
        dead = pool.num_tokens_rows(rows) - pool.num_live_rows(rows)
        since = pool.dead_since_mark_rows(rows) >= B
        holes = dead - pool.num_nulls_rows(rows) * B >= B
        due = pool.plan_due(rows)
        np.testing.assert_array_equal(due, since & holes)
        seen_due |= [(since & ~holes).any(), (holes & ~since).any(), due.any()]
        if step % 2:
            pool.mark_rows(rows[rng.random(rows.size) < 0.5])
        at = np.where(rng.random(rows.size) < 0.2, -1, rows)
        prompt = rng.integers(0, 15, rows.size)
        slotted = np.where(at >= 0, pool.num_slotted_rows(rows), 0)
        for limit in (np.zeros(0, np.int64), slotted + rng.integers(0, 2, rows.size)):
            ok, which, attended, excess = pool.over_budget(at, prompt, limit, budget)
            known = pool.num_tokens_rows(rows)
            want = (at >= 0) & (prompt <= slotted) & (slotted >= known)
            if limit.size:
                want &= slotted < limit
            over = pool.num_live_rows(rows) - budget[rows]
            np.testing.assert_array_equal(ok, want)
            np.testing.assert_array_equal(which, np.flatnonzero(want & (over > 0)))
            np.testing.assert_array_equal(attended, slotted[which])
            np.testing.assert_array_equal(excess, over[which])
            resuming = (at >= 0) & (prompt <= slotted) & (slotted < known)
            seen |= [resuming.any(), (ok & (over <= 0)).any(), which.size > 0]
    assert seen.all() and seen_due.all(), (seen, seen_due)


def test_a_batch_memo_rebuilds_when_the_batch_or_the_rows_change():
    pool = TokenTablePool(8, B)
    for rid in "abc":
        pool.add_request(rid)
    memo, built = pool.memo(), []

    def rows_of(batch):
        built.append(list(batch))
        return (pool.rows(batch),)

    assert memo.get(["a", "b"], rows_of)[0].tolist() == [0, 1]
    assert memo.get(["a", "b"], rows_of)[0].tolist() == [0, 1]  # the same batch
    assert len(built) == 1
    memo.get(["b", "a"], rows_of)  # another order
    pool.release("c")  # a row removed: rows may move
    memo.get(["b", "a"], rows_of)
    pool.add_request("d")  # one added
    memo.get(["b", "a"], rows_of)
    memo.clear()  # what the batch's constants were read from changed
    assert memo.get(["b", "a"], rows_of)[0].tolist() == [1, 0]
    assert built == [["a", "b"]] + [["b", "a"]] * 4


def _separate_passes(pool, rows, computed, counts, slots, scored, hit_slots):
    """append_read's reference: the passes it fuses, one call each."""
    start = pool.num_slotted_rows(rows)
    hits = np.maximum(computed - start, 0)
    if hits.any():
        slots = hit_slots(start, hits)
    pool.append_rows(rows, hits + counts, slots[: int((hits + counts).sum())])
    writes = pool.has_dead_rows(rows)
    read = (writes | scored).nonzero()[0]
    num_keys = np.zeros(rows.size, np.int64)
    num_keys[read], idx, kv = read_keys(pool, rows[read], computed[read])
    return writes, np.r_[0, num_keys.cumsum()], idx, kv, not writes.all()


def _with_hits(slots, counts, fresh):
    """`hit_slots` of a step: row i's hits take the next of `fresh`, then its
    counts[i] slots, as the worker lists them (VTokenWorker._with_hits)."""

    def hit_slots(start, hits):
        k, h = np.r_[0, counts.cumsum()], np.r_[0, hits.cumsum()]
        parts = [
            np.r_[fresh[h[i] : h[i + 1]], slots[k[i] : k[i + 1]]]
            for i in range(counts.size)
        ]
        return np.concatenate(parts).astype(np.int64)

    return hit_slots


def test_append_read_is_the_separate_passes():
    """Random steps on two pools, one fused call against the passes it
    replaced: decodes, chunks, dead tokens, prefix-cache hits (slotted from
    `hit_slots`), regions that grow, a resumed request recomputing dead
    tokens (its dead queries read too), and rows not read at all."""
    rng = np.random.default_rng(7)
    fused, ref = TokenTablePool(4096, B), TokenTablePool(4096, B)
    names = [f"r{i}" for i in range(12)]
    for pool in (fused, ref):
        for rid in names:
            pool.add_request(rid)
    next_slot, stock = iter(range(4096 * B)), set()
    for step in range(60):
        rids = list(rng.choice(names, size=rng.integers(1, 9), replace=False))
        if step % 17 == 16:  # preempt one: it resumes, recomputing its tokens
            for pool in (fused, ref):
                pool.reset_slots(rids[0])
        rows = fused.rows(rids)
        assert (rows == ref.rows(rids)).all()
        start = fused.num_slotted_rows(rows)
        computed = start.copy()
        if step % 5 == 0:  # a prefix-cache hit: computed, not slotted yet
            computed[0] = start[0] + rng.integers(1, 6)
        counts = rng.integers(1, 12, size=rows.size).astype(np.int64)
        slots = np.array([next(next_slot) for _ in range(int(counts.sum()) + 3)])
        hit_slots = _with_hits(slots, counts, [next(next_slot) for _ in range(8)])
        scored = rng.random(rows.size) < 0.3
        got = fused.append_read(rows, computed, counts, slots, scored, hit_slots)
        want = _separate_passes(ref, rows, computed, counts, slots, scored, hit_slots)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
        stock.add(got[-1])
        for pool in (fused, ref):  # evict some live tokens
            pool.check_integrity()
        live = [ref.live_idx(r) for r in rids]
        dead = [rng.choice(x, size=min(x.size, 2), replace=False) for x in live]
        for pool in (fused, ref):
            for r, d in zip(rids, dead, strict=True):
                pool.evict(r, d[d < pool.num_slotted(r)])
    assert fused.total_live() == ref.total_live()
    np.testing.assert_array_equal(fused.block_live, ref.block_live)
    assert stock == {True, False}  # batches with and without a stock row


def test_append_read_refuses_too_few_slots_and_changes_nothing():
    pool = make_pool(a=[12, 13])
    rows, before = pool.rows(["a"]), snapshot(pool, "a")
    with pytest.raises(ValueError, match="fewer slots than tokens"):
        pool._k.append_read(
            rows, np.array([2]), np.array([3]), np.array([14, 15]),
            np.array([True]), False, pool._a.start, pool._a.cap,
            *[pool._a.cols[c] for c in ("n_tokens", "n_slotted", "n_live", "n_listed")],
            pool._slot, pool._a.data["live"], pool._listed, pool.block_live, pool.shift,
        )  # fmt: skip
    assert_same(snapshot(pool, "a"), before)


def test_append_read_refuses_arrays_that_are_not_one_a_row(monkeypatch):
    """Like append_rows', append_read's kernel checks its per-row arrays
    itself: numba reads without bounds."""
    monkeypatch.setattr(integrity, "CHECK", False)
    pool = make_pool(a=[12, 13], b=[20])
    rows, before = pool.rows(["a", "b"]), (snapshot(pool, "a"), snapshot(pool, "b"))
    cols = [pool._a.cols[c] for c in ("n_tokens", "n_slotted", "n_live", "n_listed")]
    for computed, counts, scored, why in (
        ([2, 1], [1], [False, False], "one count"),
        ([2], [1, 1], [False, False], "one count"),
        ([2, 1], [1, 1], [False], "one count"),
        ([2, 1], [2, -1], [False, False], "negative"),
    ):
        with pytest.raises(ValueError, match=why):
            pool._k.append_read(
                rows, np.array(computed), np.array(counts), np.array([14, 21]),
                np.array(scored), False, pool._a.start, pool._a.cap, *cols,
                pool._slot, pool._a.data["live"], pool._listed, pool.block_live,
                pool.shift,
            )  # fmt: skip
    assert_same(snapshot(pool, "a"), before[0])
    assert_same(snapshot(pool, "b"), before[1])


def test_append_rows_kernel_refuses_a_short_region_and_changes_nothing():
    """The kernel checks the regions itself (the pool reserves only when it
    says so, a region doubling): a row past its region's end changes no
    row, not even one before it in the batch."""
    pool = make_pool(a=[12, 13], b=[20])
    rows = pool.rows(["a", "b"])
    before = snapshot(pool, "a"), snapshot(pool, "b")
    short = int(pool._a.cap[rows[1]] - pool._a.cols["n_slotted"][rows[1]]) + 1
    born = pool._k.append_rows(
        rows, np.array([1, short]), np.arange(40, 41 + short), pool._a.start,
        pool._a.cap,
        *[pool._a.cols[c] for c in ("n_tokens", "n_slotted", "n_live", "n_listed")],
        pool._slot, pool._a.data["live"], pool._listed, pool.block_live, pool.shift,
    )  # fmt: skip
    assert born == -1
    assert_same(snapshot(pool, "a"), before[0])
    assert_same(snapshot(pool, "b"), before[1])
    pool.append_rows(rows, np.array([1, short]), np.arange(40, 41 + short))
    assert pool.slots("b").tolist() == [20, *range(41, 41 + short)]
    assert pool.slots("a").tolist() == [12, 13, 40]
    pool.check_integrity()


def test_append_rows_refuses_counts_that_do_not_match_and_changes_nothing(
    monkeypatch,
):
    """The kernel checks the counts itself (one a row, none negative, adding
    up to the slots): numba reads without bounds, and an assert before the
    call vanished under `python -O`."""
    monkeypatch.setattr(integrity, "CHECK", False)  # not the deep checks'
    pool = make_pool(a=[12, 13], b=[20])
    rows = pool.rows(["a", "b"])
    before = snapshot(pool, "a"), snapshot(pool, "b")
    for counts, slots, why in (
        ([1, 2], [40, 41], "add up"),
        ([1, 1], [40, 41, 42], "add up"),
        ([1], [40], "a count per row"),
        ([2, -1], [40], "negative"),
    ):
        with pytest.raises(ValueError, match=why):
            pool.append_rows(rows, np.array(counts), np.array(slots))
    assert_same(snapshot(pool, "a"), before[0])
    assert_same(snapshot(pool, "b"), before[1])


def test_positional_slots_take_the_tail_block_then_the_lists():
    """The scheduler's slotting (slot_spans, positional_slots): a row mid-
    block continues in its tail block, one at a block's end starts the next
    list entry, a chunk spans several, a fresh row takes entries from 0; only
    the entries past the tail are asked for. A short id list is refused."""
    lists = {"mid": [3, 7, 9], "edge": [2, 5, 6], "chunk": [1, 4, 8, 10, 11]}
    pool = make_pool(num_blocks=16, mid=[12, 13], edge=[8, 9, 10, 11], chunk=[4])
    pool.add_request("fresh")
    lists["fresh"] = [14, 15]
    rids = ["mid", "edge", "chunk", "fresh"]
    rows, take = pool.rows(rids), np.array([1, 1, 9, 6])
    resumed, fresh, need, first, end = pool.slot_spans(rows, take)
    assert not resumed and fresh.tolist() == [3]
    assert need.tolist() == [1, 2, 3]  # "mid" stays in its tail block
    assert first.tolist() == [1, 1, 0] and end.tolist() == [2, 3, 2]
    ids = [
        lists[rids[i]][k]
        for i, f, e in zip(need, first, end, strict=True)
        for k in range(f, e)
    ]
    got = pool.positional_slots(rows, take, np.array(ids))
    want = [
        lists[r][t // B] * B + t % B
        for r, n in zip(rids, take, strict=True)
        for t in range(pool.num_slotted(r), pool.num_slotted(r) + n)
    ]
    assert got.tolist() == want
    with pytest.raises(ValueError, match="too short"):
        pool.positional_slots(rows, take, np.array(ids[:-1]))
    pool.reset_slots("edge")  # preempted: re-slotting known tokens
    assert pool.slot_spans(rows, take)[0]
