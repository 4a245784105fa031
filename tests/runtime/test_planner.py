# SPDX-License-Identifier: Apache-2.0
"""plan_blocks / pack_request: exact plans, admission edge cases, oracle."""

import math

import numpy as np
import pytest

from vllm.vtoken.planner import BlockPlan, pack_request, plan_blocks
from vllm.vtoken.token_table import TokenTablePool

B = 4


def plan(per_req: list[list[tuple[int, int]]], **kw) -> BlockPlan:
    """per_req: for each request, its eligible (block_id, live) pairs."""
    indptr = np.cumsum([0] + [len(r) for r in per_req])
    flat = [p for r in per_req for p in r]
    args = dict(threshold=0.9, free_blocks=100, margin=0, block_size=B)
    args.update(kw)
    return plan_blocks(
        req_indptr=indptr,
        block_ids=np.array([b for b, _ in flat], dtype=np.int32),
        block_live=np.array([n for _, n in flat], dtype=np.int64),
        **args,
    )


def as_lists(p: BlockPlan) -> list[tuple[int, list[int], int]]:
    return [
        (
            int(r),
            p.src_block_ids[p.src_indptr[k] : p.src_indptr[k + 1]].tolist(),
            int(p.num_dst[k]),
        )
        for k, r in enumerate(p.req_index)
    ]


def test_greedy_packing_exact_blocks():
    p = plan(
        [
            [(7, 1), (3, 2), (5, 4), (9, 3)],  # 7+3 -> 1 block; adding 9 gains 0
            [(1, 0), (2, 3)],  # all-dead block 1 alone: gain 1, ties -> k=1
            [(4, 3)],  # one block: gain 0, no plan
        ]
    )
    assert as_lists(p) == [(0, [7, 3], 1), (1, [1], 0)]
    assert p.src_block_ids.dtype == np.int32 and p.num_dst.dtype == np.int64
    assert p.src_indptr.tolist() == [0, 2, 3]
    assert p.blocks_freed == 2 and p.num_deferred == 0


def test_nothing_to_do():
    for per_req in ([], [[]], [[(1, 4), (2, 4)]], [[(1, 3)], [(2, 2)]]):
        p = plan(per_req)
        assert p.req_index.size == 0 and p.src_block_ids.size == 0
        assert p.src_indptr.tolist() == [0] and p.blocks_freed == 0
        assert p.num_deferred == 0


def test_threshold_is_strict_and_selects_candidates():
    # live/B == threshold is not a candidate: 2/4 == 0.5.
    assert plan([[(1, 2), (2, 2)]], threshold=0.5).req_index.size == 0
    assert as_lists(plan([[(1, 2), (2, 2)]], threshold=0.51)) == [(0, [1, 2], 1)]
    # Only blocks under 0.3 qualify: 1 and 6 (1 live each), not 2 (3 live).
    assert as_lists(plan([[(1, 1), (2, 3), (6, 1)]], threshold=0.3)) == [(0, [1, 6], 1)]


def test_all_dead_blocks_need_no_destination_even_under_margin():
    p = plan([[(3, 0), (8, 0), (9, 1)], [(4, 1), (5, 1)]], free_blocks=2, margin=2)
    # Request 0: best prefix takes the two dead blocks and block 9 (3 - 1 = 2,
    # ties with k=2 -> smaller k = 2 dead blocks). Request 1 needs 1: deferred.
    assert as_lists(p) == [(0, [3, 8], 0)]
    assert p.num_deferred == 1 and p.blocks_freed == 2


def test_margin_blocks_everything():
    p = plan([[(1, 1), (2, 1)], [(3, 2), (4, 1)]], free_blocks=3, margin=5)
    assert p.req_index.size == 0 and p.num_deferred == 2


def test_partial_admission_by_gain_per_destination():
    per_req = [
        [(10, 3), (11, 3), (12, 3), (13, 3)],  # 4 blocks -> 3: gain 1, need 3
        [(20, 1), (21, 1), (22, 1), (23, 1)],  # 4 -> 1: gain 3, need 1
        [(30, 2), (31, 2), (32, 2), (33, 1)],  # 4 -> 2: gain 2, need 2
    ]
    assert plan(per_req, free_blocks=6, margin=0).num_deferred == 0
    p = plan(per_req, free_blocks=5, margin=1)  # 4 destinations allowed
    assert as_lists(p) == [
        (1, [20, 21, 22, 23], 1),
        (2, [33, 30, 31, 32], 2),
    ]
    assert p.num_deferred == 1 and p.blocks_freed == 5
    p = plan(per_req, free_blocks=2, margin=0)  # after 1, request 2 does not fit
    assert as_lists(p) == [(1, [20, 21, 22, 23], 1)] and p.num_deferred == 2


def brute_force(per_req, threshold, free_blocks, margin):
    """Loop reference of the documented rule."""
    best = []
    for r, blocks in enumerate(per_req):
        cand = [(n, i, b) for i, (b, n) in enumerate(blocks) if n / B < threshold]
        cand.sort()
        top, top_k = 0, 0
        for k in range(1, len(cand) + 1):
            g = k - math.ceil(sum(n for n, _, _ in cand[:k]) / B)
            if g > top:
                top, top_k = g, k
        if top > 0:
            need = math.ceil(sum(n for n, _, _ in cand[:top_k]) / B)
            best.append((r, [b for _, _, b in cand[:top_k]], need, top))
    budget = max(free_blocks - margin, 0)
    if sum(x[2] for x in best) <= budget:
        return [x[:3] for x in best], 0
    ranked = sorted(best, key=lambda x: (-(x[3] / x[2] if x[2] else math.inf), x[0]))
    admitted, used = [], 0
    for x in ranked:
        if used + x[2] > budget:
            break
        used += x[2]
        admitted.append(x)
    admitted.sort()
    return [x[:3] for x in admitted], len(best) - len(admitted)


@pytest.mark.parametrize("seed", range(25))
def test_matches_loop_reference(seed):
    rng = np.random.default_rng(seed)
    ids = rng.permutation(400)
    per_req, at = [], 0
    for _ in range(rng.integers(1, 12)):
        n = int(rng.integers(0, 15))
        per_req.append(
            [(int(b), int(rng.integers(0, B + 1))) for b in ids[at : at + n]]
        )
        at += n
    threshold = float(rng.choice([0.3, 0.5, 0.75, 1.0]))
    free, margin = int(rng.integers(0, 12)), int(rng.integers(0, 4))
    p = plan(per_req, threshold=threshold, free_blocks=free, margin=margin)
    want, deferred = brute_force(per_req, threshold, free, margin)
    assert as_lists(p) == want and p.num_deferred == deferred


def test_plan_blocks_validates_arguments():
    good = dict(
        req_indptr=np.array([0, 2]),
        block_ids=np.array([1, 2], dtype=np.int32),
        block_live=np.array([1, 1]),
        block_size=B,
        threshold=0.9,
        free_blocks=4,
        margin=0,
    )
    plan_blocks(**good)
    bad = [
        dict(threshold=0.0),
        dict(threshold=1.5),
        dict(margin=-1),
        dict(free_blocks=-1),
        dict(req_indptr=np.array([0, 1])),  # does not end at N
        dict(req_indptr=np.array([1, 2])),  # does not start at 0
        dict(req_indptr=np.array([0, 2, 1, 2])),  # decreasing
        dict(block_live=np.array([1])),  # misaligned
        dict(block_live=np.array([1, B + 1])),  # more live than slots
        dict(block_ids=np.array([1, 1], dtype=np.int32)),  # repeated source
    ]
    for change in bad:
        with pytest.raises(ValueError):
            plan_blocks(**{**good, **change})


def test_pack_request_exact_slots_in_logical_order():
    # Live tokens: idx 0 in block 7, idx 5-6 in block 3, idx 9 in block 5 (kept).
    m = pack_request(
        live_idx=np.array([0, 5, 6, 9]),
        live_slots=np.array([29, 13, 14, 20]),
        src_block_ids=np.array([7, 3], dtype=np.int32),
        dst_block_ids=np.array([9]),
        block_size=B,
    )
    assert m.idx.tolist() == [0, 5, 6]
    assert m.src_slots.tolist() == [29, 13, 14]
    assert m.dst_slots.tolist() == [36, 37, 38]
    m = pack_request(
        live_idx=np.arange(6),
        live_slots=np.array([4, 5, 6, 8, 9, 10]),
        src_block_ids=np.array([1, 2]),
        dst_block_ids=np.array([11, 6]),
        block_size=B,
    )
    assert m.dst_slots.tolist() == [44, 45, 46, 47, 24, 25]
    for arr in (m.idx, m.src_slots, m.dst_slots):
        assert arr.dtype == np.int64


def test_pack_request_rejects_what_cannot_work():
    kw = dict(live_idx=np.arange(5), live_slots=np.arange(5), block_size=B)
    with pytest.raises(ValueError, match="do not fit"):
        pack_request(src_block_ids=np.array([0, 1]), dst_block_ids=np.array([5]), **kw)
    with pytest.raises(ValueError, match="also a source"):
        pack_request(
            src_block_ids=np.array([0, 1]), dst_block_ids=np.array([1, 2]), **kw
        )
    with pytest.raises(ValueError):
        pack_request(
            live_idx=np.arange(3),
            live_slots=np.arange(2),
            src_block_ids=np.array([0]),
            dst_block_ids=np.array([5]),
            block_size=B,
        )
    empty = pack_request(
        src_block_ids=np.array([], dtype=np.int64), dst_block_ids=np.array([]), **kw
    )
    assert empty.idx.size == 0 and empty.dst_slots.size == 0


def test_oracle_plan_pack_apply_equals_dense_gather_of_kept_tokens():
    """Evict, plan, copy on a simulated KV array, remap: reads are unchanged."""
    pool = TokenTablePool(16, B)
    kv = np.full(16 * B, -1.0)
    held = {"a": [2, 5, 7, 1], "b": [3, 4]}
    for rid, blocks in held.items():
        pool.add_request(rid)
        slots = (np.array(blocks)[:, None] * B + np.arange(B)).ravel()
        pool.append(rid, slots)
        kv[slots] = np.arange(slots.size) + (100 if rid == "b" else 0)
    pool.evict("a", np.array([0, 1, 2, 5, 6, 8, 9, 10, 11]))  # a's block 7 all dead
    pool.evict("b", np.array([1, 2, 3]))
    dense = {r: kv[pool.live_slots(r)].copy() for r in held}
    rids = ["a", "b"]
    elig = [held["a"][:-1], held["b"][:-1]]  # tail blocks are never sources
    p = plan_blocks(
        req_indptr=np.cumsum([0, *map(len, elig)]),
        block_ids=np.concatenate(elig).astype(np.int32),
        block_live=pool.block_live[np.concatenate(elig)],
        block_size=B,
        threshold=0.9,
        free_blocks=8,
        margin=0,
    )
    assert as_lists(p) == [(0, [7, 2, 5], 1)]  # b's only eligible block alone
    k, rid = 0, rids[p.req_index[0]]
    m = pack_request(
        live_idx=pool.live_idx(rid),
        live_slots=pool.live_slots(rid),
        src_block_ids=p.src_block_ids[p.src_indptr[k] : p.src_indptr[k + 1]],
        dst_block_ids=np.array([12]),
        block_size=B,
    )
    assert m.idx.tolist() == [3, 4, 7] and m.dst_slots.tolist() == [48, 49, 50]
    kv[m.dst_slots] = kv[m.src_slots]
    pool.remap(rid, m.idx, m.dst_slots)
    kv[(np.array([7, 2, 5])[:, None] * B + np.arange(B)).ravel()] = np.nan  # freed
    for r in held:
        np.testing.assert_array_equal(kv[pool.live_slots(r)], dense[r])
    assert pool.block_live[[2, 5, 7, 12]].tolist() == [0, 0, 0, 3]
    pool.check_integrity()
