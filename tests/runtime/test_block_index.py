# SPDX-License-Identifier: Apache-2.0
"""BlockIndex: vLLM's positional lists mirrored as flat arrays, recorded as
their blocks are slotted and changed only through the index."""

from types import SimpleNamespace

import numpy as np
import pytest

from vllm.vtoken import integrity
from vllm.vtoken.block_index import BlockIndex
from vllm.vtoken.token_table import TokenTablePool

NULL = SimpleNamespace(block_id=0, is_null=True, ref_cnt=0)


def block(i: int, ref_cnt: int = 1) -> SimpleNamespace:
    return SimpleNamespace(block_id=i, is_null=False, ref_cnt=ref_cnt)


def arr(*xs) -> np.ndarray:
    return np.array(xs, np.int64)


def ids_of(blocks) -> list[int]:
    return [b.block_id for b in blocks]


class Mirror:
    """A `BlockIndex` on a scheduler's Token Table pool, addressed by request
    id as its callers address it (they look the rows up; each row gets a
    region of 64 entries, as slotting its tokens would give it)."""

    def __init__(self, lists: dict[str, list]) -> None:
        self.pool = TokenTablePool(num_blocks=256, block_size=4, positional_lists=True)
        self.index = BlockIndex(lists, pool=self.pool)

    def rows(self, rids) -> np.ndarray:
        for rid in rids:
            if rid not in self.pool:
                self.pool.add_request(rid)
                self.pool.arena.reserve(self.pool.rows([rid]), np.array([64]))
        return self.pool.rows(rids)

    def record(self, rids, first, end, ids) -> None:
        rows = self.rows(rids)
        self.pool.arena.reserve(rows, end)  # as slotting their tokens would
        self.index.record(rows, first, end, ids)

    def planned(self, rids, counts, caching):
        return self.index.planned(self.pool.rows(rids), counts, caching)

    def null_at_many(self, rids, *args, **kw):
        rows = self.pool.rows_or_missing(rids)
        return self.index.null_at_many(rids, rows, *args, **kw)

    def replace_at_many(self, rids, *args):
        return self.index.replace_at_many(rids, self.pool.rows_or_missing(rids), *args)

    def release(self, rid) -> None:
        self.pool.release(rid)

    def __getattr__(self, name):  # find, null_out, replace, reset, check, ...
        return getattr(self.index, name)


def indexed(lists: dict[str, list]) -> Mirror:
    """A mirror that has recorded every list whole (one step's slotting)."""
    index = Mirror(lists)
    rids = list(lists)
    n = arr(*map(len, lists.values()))
    flat = np.array([b.block_id for r in rids for b in lists[r]], np.int64)
    index.record(rids, np.zeros(len(rids), np.int64), n, flat)
    return index


@pytest.fixture
def checked(monkeypatch):
    monkeypatch.setattr(integrity, "CHECK", True)  # record/planned: mirror == list


def test_records_appends_and_a_new_list_and_reads_them_for_the_planner(checked):
    lists = {"a": [block(7), block(3)], "b": [block(11)]}
    index = indexed(lists)
    lists["a"] += [block(9), block(4)]  # vLLM appends; the step slots into them
    index.record(["a"], arr(2), arr(4), arr(9, 4))
    ids, heads = index.planned(["b", "a"], arr(1, 3), caching=True)
    assert ids.tolist() == [11, 7, 3, 9] and heads.tolist() == [1, 3]  # unknown: all
    index.stop_caching("a", 2)
    index.stop_caching("a", 3)  # the first count stays
    assert index.planned(["a"], arr(4), caching=True)[1].tolist() == [2]
    assert index.planned(["a"], arr(1), caching=True)[1].tolist() == [1]
    assert index.planned(["a"], arr(4), caching=False)[1].tolist() == [0]
    with pytest.raises(RuntimeError, match="not recorded"):
        index.planned(["a"], arr(5), caching=True)
    index.reset("a")  # preempted: vLLM frees the list, the resume makes one
    lists["a"] = [block(5), block(6)]
    index.record(["a"], arr(0), arr(2), arr(5, 6))
    ids, heads = index.planned(["a"], arr(2), caching=True)
    assert ids.tolist() == [5, 6] and heads.tolist() == [2]  # unknown again
    index.release("a")
    with pytest.raises(KeyError):
        index.planned(["a"], arr(1), caching=True)


def test_a_recorded_id_that_is_not_the_lists_is_named(checked):
    lists = {"a": [block(7), block(3)]}
    index = Mirror(lists)
    with pytest.raises(AssertionError, match="mirror"):
        index.record(["a"], arr(0), arr(2), arr(7, 8))


def test_null_out_replaces_the_unshared_blocks_it_is_given(checked):
    shared = block(3, ref_cnt=2)  # a prefix-cache hit another request holds
    lists = {"a": [block(7), shared, block(9), block(4), block(5)]}
    index = indexed(lists)
    out = index.null_out("a", [5, 3, 7, 6], NULL, True)  # 6: not in the list
    assert ids_of(out) == [7, 5]  # in list order, the shared one kept
    assert ids_of(lists["a"]) == [0, 3, 9, 4, 0]
    index.check(["a"])
    assert index.find("a", [7, 5, 3, 9]) == [1, 2]
    assert ids_of(index.null_out("a", [3], NULL, False)) == [3]
    assert ids_of(lists["a"]) == [0, 0, 9, 4, 0]
    for unshared_only in (True, False):  # in no list, no hint: nothing done
        assert index.null_out("a", [6], NULL, unshared_only) == []
        assert ids_of(lists["a"]) == [0, 0, 9, 4, 0]
    index.check(["a"])
    assert index.planned(["a"], arr(5), caching=False)[0].tolist() == [0, 0, 9, 4, 0]


def test_null_at_many_frees_where_given_or_found_and_keeps_shared(checked):
    """A step's freeing in one pass: each block at the entry given (where
    its tokens were written), or found where compaction left it, a shared
    block kept, a block the list does not hold skipped; counts by request."""
    lists = {
        "a": [block(7), block(3), block(9)],
        "b": [block(11), block(12, ref_cnt=2), block(13)],
        "c": [block(21), block(22)],
    }
    index = indexed(lists)
    rids = ["a", "b", "c", "idle"]
    # a: entries 0, 2; b: 1 (shared), 2; c: block 21 said at entry 1 (it is
    # at 0), block 99 in no list.
    out, nulled = index.null_at_many(
        rids, arr(0, 0, 1, 1, 2, 2), arr(0, 2, 1, 2, 1, 1),
        arr(7, 9, 12, 13, 21, 99), NULL,
    )  # fmt: skip
    assert ids_of(out) == [7, 9, 13, 21]
    assert nulled.tolist() == [2, 1, 1, 0]
    assert [ids_of(lists[r]) for r in "abc"] == [[0, 3, 0], [11, 12, 0], [0, 22]]
    index.check(list(lists))
    assert index.find("c", [22, 21]) == [1]


def test_a_found_block_is_freed_in_list_order():
    """Blocks found away from the entries given are freed in list order
    (vLLM's free queue takes them in that order), as the given ones are."""
    lists = {"a": [block(7), block(3), block(9), block(4)]}
    index = indexed(lists)
    out, _ = index.null_at_many(["a"], arr(0, 0, 0), arr(3, 3, 0), arr(9, 4, 7), NULL)
    assert ids_of(out) == [7, 9, 4]


def test_a_list_changed_unseen_is_mirrored_again(monkeypatch):
    """Each block found is checked against vLLM's object, and a block not
    found against vLLM's object at its hint: a list changed behind the
    mirror's back (none is known to) is mirrored again, never trusted."""
    monkeypatch.setattr(integrity, "CHECK", False)  # it would name the change
    lists = {"a": [block(7), block(3), block(9)]}
    index = indexed(lists)
    lists["a"][0], lists["a"][2] = lists["a"][2], lists["a"][0]  # swapped
    assert index.find("a", [7]) == [2]
    out, _ = index.null_at_many(["a"], arr(0), arr(0), arr(7), NULL)
    assert ids_of(out) == [7] and ids_of(lists["a"]) == [9, 3, 0]
    index.check(["a"])
    lists["a"][1] = block(8)  # not in the mirror, vLLM's at the entry given,
    # with a block the mirror finds elsewhere (so the mirror is searched)
    out, nulled = index.null_at_many(["a"], arr(0, 0), arr(1, 1), arr(8, 9), NULL)
    assert ids_of(out) == [9, 8] and nulled.tolist() == [2]  # in list order
    assert ids_of(lists["a"]) == [0, 0, 0]
    index.check(["a"])
    lists["a"][0] = block(5)  # vLLM's at the entry given: taken from there
    out, _ = index.null_at_many(["a"], arr(0), arr(0), arr(5), NULL)
    assert ids_of(out) == [5] and ids_of(lists["a"]) == [0, 0, 0]
    index.check(["a"])
    lists["b"] = [block(1), block(2)]
    index.record(["b"], arr(0), arr(2), arr(1, 2))
    lists["b"].reverse()
    monkeypatch.setattr(integrity, "CHECK", True)  # a change seen is named
    with pytest.raises(AssertionError, match="changed unseen"):
        index.find("b", [1])


def test_an_evacuated_source_gone_unseen_is_refused(monkeypatch):
    """A source the plan found whose list changed since: refused (nothing
    done for its request), so the reclaimer raises, and no fresh block is
    lost in no list."""
    monkeypatch.setattr(integrity, "CHECK", False)
    lists = {"a": [block(7), block(3), block(9)], "b": [block(11)]}
    index = indexed(lists)
    lists["a"][0] = block(8)  # block 7 gone behind the mirror's back
    fresh = [block(40), block(41)]
    missing = index.replace_at_many(["a", "b"], arr(0, 1), arr(0, 0), arr(7, 11), fresh)
    assert missing == [0]
    assert ids_of(lists["a"]) == [8, 3, 9] and ids_of(lists["b"]) == [41]
    index.check(["a", "b"])


def test_blocks_found_elsewhere_get_their_own_new_blocks_in_list_order(checked):
    """Every hint wrong, the requests' groups in reverse order, some blocks
    shared: each block still gets its own new block, and the freed ones come
    back in list order per request."""
    lists = {
        "a": [block(7), block(3, ref_cnt=2), block(9)],
        "b": [block(11), block(12), block(13, ref_cnt=2)],
    }
    index = indexed(lists)
    fresh = [block(40), block(41), block(42), block(43)]
    missing = index.replace_at_many(
        ["a", "b"], arr(1, 1, 0, 0), arr(-1, 0, -1, 2), arr(12, 11, 9, 7), fresh
    )
    assert missing == []
    assert ids_of(lists["a"]) == [43, 3, 42] and ids_of(lists["b"]) == [41, 40, 13]
    index.check(["a", "b"])
    out, nulled = index.null_at_many(
        ["b", "a"], arr(1, 1, 1, 0, 0, 0), arr(-1, -1, -1, -1, -1, -1),
        arr(42, 3, 43, 13, 40, 41), NULL,
    )  # fmt: skip
    assert ids_of(out) == [41, 40, 43, 42]  # b's, then a's, each in list order
    assert nulled.tolist() == [2, 2]
    assert ids_of(lists["a"]) == [0, 3, 0] and ids_of(lists["b"]) == [0, 0, 13]
    index.check(["a", "b"])


def test_a_gap_in_a_recorded_list_is_refused():
    lists = {"a": [block(7), block(3), block(9)]}
    index = Mirror(lists)
    with pytest.raises(ValueError, match="a gap"):
        index.record(["a"], arr(1), arr(3), arr(3, 9))


def test_replace_at_many_swaps_fresh_blocks_in_and_refuses_one_alone(checked):
    """A plan's evacuation in one pass: each fresh block takes its source's
    entry, and a request one of whose sources its list does not hold is
    refused whole, the requests after it still given their own blocks."""
    lists = {
        "a": [block(7), block(3), block(9)],
        "c": [block(21), block(22), block(23)],
        "b": [block(11), block(12), block(13)],
    }
    index = indexed(lists)
    rids = ["a", "c", "b"]
    fresh = [block(40), block(41), block(42), block(43), block(44)]
    # c: block 21 at entry 0, block 29 in no list.
    missing = index.replace_at_many(
        rids, arr(0, 0, 1, 1, 2), arr(2, 0, 0, 2, 1), arr(9, 7, 21, 29, 12), fresh
    )
    assert missing == [1]
    assert [ids_of(lists[r]) for r in rids] == [[41, 3, 40], [21, 22, 23], [11, 44, 13]]
    index.check(rids)
    assert index.find("a", [40, 41, 7, 9]) == [0, 2]
    with pytest.raises(ValueError, match="2 blocks for 1 entries"):
        index.replace_at_many(["a"], arr(0), arr(1), arr(3), fresh[:2])


def test_replace_puts_a_source_back():
    lists = {"a": [block(7), block(3)]}
    index = indexed(lists)
    source = lists["a"][0]
    index.replace_at_many(["a"], arr(0), arr(0), arr(7), [block(40)])
    (i,) = index.find("a", [40])
    index.replace("a", i, source)  # an undone evacuation
    assert ids_of(lists["a"]) == [7, 3]
    index.check(["a"])


def test_finished_requests_rows_are_reused():
    lists = {f"r{i}": [block(i + 1)] for i in range(40)}
    index = indexed(lists)
    for i in range(30):
        index.release(f"r{i}")
        del lists[f"r{i}"]  # vLLM freed them
    lists["new"] = [block(99), block(98)]
    index.record(["new"], arr(0), arr(2), arr(99, 98))
    assert len(index.pool.request_ids()) == 11
    assert index.find("r35", [36]) == [0] and index.find("new", [98]) == [1]
    index.check(list(lists))


def test_many_rows_growing_keep_their_entries(checked):
    """Regions grow and the arena compacts (arena.py) as lists grow a block
    at a time, the decode's pattern; every mirror stays its list's."""
    rng = np.random.default_rng(0)
    lists = {f"r{i}": [] for i in range(50)}
    index = Mirror(lists)
    next_id = 1
    for _ in range(40):
        rids = [r for r in lists if rng.random() < 0.5]
        first = arr(*(len(lists[r]) for r in rids))
        grow = rng.integers(1, 4, len(rids))
        new = []
        for r, g in zip(rids, grow.tolist(), strict=True):
            for _ in range(g):
                lists[r].append(block(next_id))
                new.append(next_id)
                next_id += 1
        index.record(rids, first, first + grow, np.array(new, np.int64))
    index.check(list(lists))
    last = lists["r3"][-1]
    out, nulled = index.null_at_many(
        list(lists), arr(3, 7), arr(-1, -1), arr(last.block_id, 10**6), NULL,
        unshared_only=False,
    )  # fmt: skip
    assert out == [last] and lists["r3"][-1] is NULL and nulled.sum() == 1
    index.check(list(lists))


def test_release_busy_frees_only_the_batchs_own_blocks():
    """BlockReclaimer._unbusy's kernel: a block the batch holds is busy no
    more; one another batch took since (its part was dropped) stays busy;
    a block listed twice, or in both arrays, is fine. As the NumPy it
    replaced, on random cases."""
    from vllm.vtoken.block_kernels import release_busy

    rng = np.random.default_rng(0)
    for _ in range(50):
        busy = rng.integers(-1, 4, 64)
        src, dst = rng.integers(0, 64, rng.integers(0, 12)), rng.integers(0, 64, 9)
        want = busy.copy()
        ids = np.concatenate([src, dst])
        want[ids[want[ids] == 2]] = -1
        release_busy(busy, src, dst, 2)
        assert busy.tolist() == want.tolist()


def test_a_block_past_the_mirror_is_found_in_vllms_list(monkeypatch):
    """A list longer than its mirror (changed unseen; none is known to):
    a block past the mirror's end, at the entry given or with none, is
    found there and replaced, never skipped (the acknowledgement frees every
    source it is given: one skipped would be freed while still listed)."""
    monkeypatch.setattr(integrity, "CHECK", False)
    lists = {"a": [block(7), block(3), block(9), block(5)]}
    index = Mirror(lists)
    index.record(["a"], arr(0), arr(2), arr(7, 3))  # entries 2, 3 unseen
    out, nulled = index.null_at_many(["a"], arr(0), arr(2), arr(9), NULL)
    assert ids_of(out) == [9] and nulled.tolist() == [1]
    assert ids_of(lists["a"]) == [7, 3, 0, 5]
    index.check(["a"])  # mirrored whole again
    lists["a"].append(block(6))  # past the mirror, no entry given
    assert ids_of(index.null_out("a", [6], NULL, unshared_only=True)) == [6]
    assert ids_of(lists["a"]) == [7, 3, 0, 5, 0]
    index.check(["a"])


def test_a_list_past_its_region_is_an_error_not_a_skip(monkeypatch):
    """A block that even the list mirrored again cannot hold (past its
    row's region) raises: skipping it would let the caller free a block
    still listed. (A hint is where its tokens were written or the planner
    found it: inside the region.)"""
    monkeypatch.setattr(integrity, "CHECK", False)
    lists = {"a": [block(7), block(3)]}
    index = Mirror(lists)
    index.record(["a"], arr(0), arr(2), arr(7, 3))
    cap = int(index.pool.arena.cap[index.pool.rows(["a"])[0]])
    lists["a"] += [block(100 + i) for i in range(cap)]  # past the region
    with pytest.raises(RuntimeError, match="past what their rows hold"):
        index.null_out("a", [100 + cap - 1], NULL, unshared_only=True)
    assert ids_of(lists["a"][:2]) == [7, 3]  # nothing done


def test_holders_are_the_lists_holding_a_block_at_an_entry_they_slotted(checked):
    """Every list holding blocks 7 or 3 where its request has slotted the
    entry's every token: b has slotted one token of block 3 (its entry 1),
    so that entry is not b's to give up yet; a released row holds none."""
    lists = {r: [block(7), block(3)] for r in "ab"} | {"c": [block(9)]}
    index = indexed(lists)
    for rid, n in (("a", 8), ("b", 5), ("c", 4)):
        index.pool.append(rid, np.arange(n))
    rows = dict(zip("abc", index.pool.rows(["a", "b", "c"]).tolist(), strict=True))
    got = index.holders(arr(3, 7))
    assert [g.tolist() for g in got] == [
        [rows["a"], rows["a"], rows["b"]],
        [0, 1, 0],
        [7, 3, 7],
    ]
    index.release("a")
    assert [g.tolist() for g in index.holders(arr(3, 7))] == [[rows["b"]], [0], [7]]
