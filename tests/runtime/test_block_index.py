# SPDX-License-Identifier: Apache-2.0
"""BlockIndex: block id -> entry of vLLM's positional lists, and the ids by
entry, kept without a pass over a list."""

from types import SimpleNamespace

import pytest

from vllm.vtoken import integrity
from vllm.vtoken.block_index import BlockIndex

NULL = SimpleNamespace(block_id=0, is_null=True)


def block(i: int, ref_cnt: int = 1) -> SimpleNamespace:
    return SimpleNamespace(block_id=i, is_null=False, ref_cnt=ref_cnt)


def test_follows_appends_replacements_and_a_new_list():
    lists = {"a": [block(7), block(3)]}
    index = BlockIndex(lists, null_id=0)
    assert index.get("a").ids.tolist() == [7, 3]
    lists["a"] += [block(9), block(4)]  # vLLM appends
    assert index.find("a", [4, 7, 5]) == [0, 3]
    index.replace("a", 1, NULL)  # freed
    index.replace("a", 0, block(12))  # a fresh block takes an evacuated one's place
    assert [b.block_id for b in lists["a"]] == [12, 0, 9, 4]
    assert index.get("a").ids.tolist() == [12, 0, 9, 4]
    assert index.find("a", [3, 7, 12]) == [0]
    index.stop_caching("a", 2)
    index.stop_caching("a", 3)  # the first count stays
    assert index.get("a").cached_upto == 2
    lists["a"] = [block(5)]  # preempted and resumed: vLLM's new list
    assert index.get("a").ids.tolist() == [5] and index.get("a").cached_upto is None
    with pytest.raises(AssertionError, match="shrank"):
        lists["a"].pop()
        index.get("a")


def test_null_out_replaces_the_unshared_blocks_it_is_given(monkeypatch):
    monkeypatch.setattr(integrity, "CHECK", True)  # every get: index == list
    shared = block(3, ref_cnt=2)  # a prefix-cache hit another request holds
    lists = {"a": [block(7), shared, block(9), block(4)]}
    index = BlockIndex(lists, null_id=0)
    index.get("a")
    lists["a"].append(block(5))  # vLLM appends: caught up on the way
    out = index.null_out("a", [5, 3, 7, 6], NULL, True)  # 6: not in the list
    assert [b.block_id for b in out] == [7, 5]  # in list order, shared kept
    assert [b.block_id for b in lists["a"]] == [0, 3, 9, 4, 0]
    assert index.get("a").ids.tolist() == [0, 3, 9, 4, 0]
    assert index.find("a", [7, 5, 3, 9]) == [1, 2]
    monkeypatch.setattr(integrity, "CHECK", False)
    lists["a"][2], lists["a"][3] = lists["a"][3], lists["a"][2]  # changed unseen
    assert [b.block_id for b in index.null_out("a", [9], NULL, True)] == [9]
    assert [b.block_id for b in lists["a"]] == [0, 3, 4, 0, 0]
    assert [b.block_id for b in index.null_out("a", [3], NULL, False)] == [3]
    assert [b.block_id for b in lists["a"]] == [0, 0, 4, 0, 0]


def test_a_list_changed_unseen_is_indexed_afresh(monkeypatch):
    monkeypatch.setattr(integrity, "CHECK", False)  # it would name the change
    lists = {"a": [block(7), block(3), block(9)]}
    index = BlockIndex(lists, null_id=0)
    index.stop_caching("a", 1)
    lists["a"][0], lists["a"][2] = lists["a"][2], lists["a"][0]
    assert index.find("a", [7]) == [2]
    assert index.get("a").ids.tolist() == [9, 3, 7]
    assert index.get("a").cached_upto == 1  # same list: still known
    monkeypatch.setattr(integrity, "CHECK", True)
    lists["a"][1] = block(8)
    with pytest.raises(AssertionError, match="out of date"):
        index.get("a")


def test_finished_requests_indexes_are_dropped():
    lists = {f"r{i}": [block(i + 1)] for i in range(40)}
    index = BlockIndex(lists, null_id=0)
    for rid in list(lists):
        index.get(rid)
    for i in range(30):
        del lists[f"r{i}"]  # vLLM freed them
    lists["new"] = [block(99)]
    index.get("new")
    assert len(index._index) <= 2 * len(lists) + 16
    assert index.find("r35", [36]) == [0]


def test_null_at_frees_positional_blocks_and_keeps_the_index_true(monkeypatch):
    shared = block(3, ref_cnt=2)
    lists = {"a": [block(7), shared, block(9), block(4)]}
    index = BlockIndex(lists, null_id=0)
    index.get("a")  # indexed up to entry 3
    lists["a"].append(block(5))  # appended since: not seen yet
    # Blocks 5, 3, 7 at their tokens' entries 4, 1, 0: the shared one stays.
    out = index.null_at("a", [4, 1, 0], [5, 3, 7], NULL)
    assert [b.block_id for b in out] == [7, 5]  # in list order, as null_out
    assert [b.block_id for b in lists["a"]] == [0, 3, 9, 4, 0]
    monkeypatch.setattr(integrity, "CHECK", True)  # get: index == list
    assert index.get("a").ids.tolist() == [0, 3, 9, 4, 0]
    assert index.find("a", [7, 5, 9]) == [2]
    # A block not at the entry given (compaction moved the token there):
    # refused, nothing changed.
    assert index.null_at("a", [3, 1], [4, 9], NULL) is None
    assert [b.block_id for b in lists["a"]] == [0, 3, 9, 4, 0]
    assert index.null_at("a", [9], [4], NULL) is None  # past the list


def test_null_at_many_is_null_at_per_request_and_refuses_one_alone(monkeypatch):
    """A step's freeing in one pass: each request's blocks as null_at would
    free them, a shared block kept, and a request one of whose blocks is
    elsewhere refused whole while the others are done."""
    lists = {
        "a": [block(7), block(3), block(9)],
        "b": [block(11), block(12, ref_cnt=2), block(13)],
        "c": [block(21), block(22)],
    }
    index = BlockIndex(lists, null_id=0)
    index.get("a"), index.get("c")  # "b" never indexed
    rids = ["a", "b", "c"]
    # a: entries 0, 2; b: 1 (shared), 2; c: block 21 claimed at entry 1.
    out, nulled, refused = index.null_at_many(
        rids, [0, 0, 1, 1, 2], [0, 2, 1, 2, 1], [7, 9, 12, 13, 21], NULL
    )
    assert [b.block_id for b in out] == [7, 9, 13]
    assert nulled == {0: 2, 1: 1} and refused == [2]
    assert [[b.block_id for b in lists[r]] for r in rids] == [
        [0, 3, 0], [11, 12, 0], [21, 22],
    ]  # fmt: skip
    monkeypatch.setattr(integrity, "CHECK", True)  # get: index == list
    assert [index.get(r).ids.tolist() for r in rids] == [
        [0, 3, 0],
        [11, 12, 0],
        [21, 22],
    ]


def test_entries_catch_up_only_when_looked_up(monkeypatch):
    """`get` (the planner's, per planned request) mirrors the ids alone; the
    id -> entry map catches up at the first lookup, and a block freed or
    changed in between is seen there, not in a stale map."""
    monkeypatch.setattr(integrity, "CHECK", False)  # its check builds the map
    lists = {"a": [block(7), block(3), block(9)]}
    index = BlockIndex(lists, null_id=0)
    for extra in (block(4), block(5)):  # decode appends, one at a time
        lists["a"].append(extra)
        assert index.get("a").ids.tolist() == [b.block_id for b in lists["a"]]
    assert index.get("a").at_upto == 0 and index.get("a").at == {}
    # Freed at entry 1 before any lookup: the mirror says null there.
    out, _, refused = index.null_at_many(["a"], [0], [1], [3], NULL)
    assert [b.block_id for b in out] == [3] and refused == []
    assert index.find("a", [3, 9, 5]) == [2, 4]
    assert index.get("a").at == {7: 0, 9: 2, 4: 3, 5: 4}
    # Appended, then changed behind the index's back past what `at` holds:
    # the freeing notices the mirror disagrees and indexes afresh.
    lists["a"] += [block(6), block(8)]
    index.get("a")
    lists["a"][5], lists["a"][6] = lists["a"][6], lists["a"][5]
    out, _, refused = index.null_at_many(["a"], [0], [5], [8], NULL)
    assert [b.block_id for b in out] == [8] and refused == []
    monkeypatch.setattr(integrity, "CHECK", True)  # get: index == list
    assert index.get("a").ids.tolist() == [7, 0, 9, 4, 5, 0, 6]
    assert index.find("a", [6, 8]) == [6]


def test_replace_at_many_swaps_fresh_blocks_in_and_refuses_one_alone(monkeypatch):
    """A plan's evacuation in one pass: each fresh block takes its source's
    entry, the index follows (whether or not its map had reached the entry),
    and a request one of whose sources is elsewhere is refused whole, the
    requests after it still given their own blocks."""
    monkeypatch.setattr(integrity, "CHECK", True)  # every get: index == list
    lists = {
        "a": [block(7), block(3), block(9)],
        "c": [block(21), block(22), block(23)],
        "b": [block(11), block(12), block(13)],
    }
    index = BlockIndex(lists, null_id=0)
    index.find("a", [7])  # "a": its map caught up; "c": ids only; "b": none
    monkeypatch.setattr(integrity, "CHECK", False)  # its check builds the maps
    index.get("c")
    rids = ["a", "c", "b"]
    fresh = [block(40), block(41), block(42), block(43), block(44)]
    # c: block 21 rightly at entry 0, block 22 claimed at entry 2.
    refused = index.replace_at_many(
        rids, [0, 0, 1, 1, 2], [2, 0, 0, 2, 1], [9, 7, 21, 22, 12], fresh
    )
    assert refused == [1]
    assert [[b.block_id for b in lists[r]] for r in rids] == [
        [41, 3, 40], [21, 22, 23], [11, 44, 13],
    ]  # fmt: skip
    monkeypatch.setattr(integrity, "CHECK", True)  # and no stale entry in a map
    assert [index.get(r).ids.tolist() for r in rids] == [
        [41, 3, 40], [21, 22, 23], [11, 44, 13],
    ]  # fmt: skip
    assert index.find("a", [40, 41, 7, 9]) == [0, 2]
    assert index.find("b", [44, 12]) == [1]
    with pytest.raises(ValueError, match="2 blocks for 1 entries"):
        index.replace_at_many(["a"], [0], [1], [3], fresh[:2])
