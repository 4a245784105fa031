# SPDX-License-Identifier: Apache-2.0
"""plan_blocks / plan_around_cache / pack_requests: exact plans and moves, loop
references, an oracle."""

import numpy as np
import pytest

from vllm.vtoken.packing import Moves, pack_requests
from vllm.vtoken.planner import BlockPlan, plan_around_cache, plan_blocks
from vllm.vtoken.token_table import TokenTablePool

B = 4


def plan(per_req: list[list[tuple[int, int]]], **kw) -> BlockPlan:
    """per_req: for each request, its eligible (block_id, live) pairs."""
    indptr = np.cumsum([0] + [len(r) for r in per_req])
    flat = [p for r in per_req for p in r]
    args = dict(threshold=0.9, block_size=B)
    args.update(kw)
    return plan_blocks(
        req_indptr=indptr,
        block_ids=np.array([b for b, _ in flat], dtype=np.int32),
        block_live=np.array([n for _, n in flat], dtype=np.int64),
        **args,
    )


def as_lists(p: BlockPlan) -> list[tuple[int, list[int], list[int]]]:
    """(request, sources, destinations) per planned request."""
    return [
        (
            int(r),
            p.src_block_ids[p.src_indptr[k] : p.src_indptr[k + 1]].tolist(),
            p.dst_block_ids[p.dst_indptr[k] : p.dst_indptr[k + 1]].tolist(),
        )
        for k, r in enumerate(p.req_index)
    ]


def test_in_place_plans_exact_blocks():
    p = plan(
        [
            # holes 3 + 2 + 0 + 1 = 6: one block can empty, the sparsest (7);
            # its one token goes to the densest block with a hole, 9 (3 live).
            [(7, 1), (3, 2), (5, 4), (9, 3)],
            [(1, 0), (2, 3)],  # all-dead block 1: holes 5, empties 1, no moves
            [(4, 3)],  # one hole: nothing to gain, no plan
            # holes 9: two blocks empty, 11 then 6 (3 tokens): 8 and 10 take them
            [(6, 2), (8, 2), (10, 2), (11, 1)],
        ]
    )
    assert as_lists(p) == [
        (0, [7], [9]),
        (1, [1], []),
        (3, [11, 6], [8, 10]),
    ]
    assert p.src_block_ids.dtype == np.int32 and p.dst_block_ids.dtype == np.int32
    assert p.src_indptr.tolist() == [0, 1, 2, 4]
    assert p.dst_indptr.tolist() == [0, 1, 1, 3]
    assert p.blocks_freed == 4


def test_nothing_to_do():
    for per_req in ([], [[]], [[(1, 4), (2, 4)]], [[(1, 3)], [(2, 2)]]):
        p = plan(per_req)
        assert p.req_index.size == 0 and p.src_block_ids.size == 0
        assert p.src_indptr.tolist() == [0] and p.dst_indptr.tolist() == [0]
        assert p.blocks_freed == 0


def test_threshold_is_strict_and_selects_candidates():
    # live/B == threshold is not a candidate: 2/4 == 0.5.
    assert plan([[(1, 2), (2, 2)]], threshold=0.5).req_index.size == 0
    assert as_lists(plan([[(1, 2), (2, 2)]], threshold=0.51)) == [(0, [1], [2])]
    # Only blocks under 0.3 are sources (1 and 6: 1 live each), but block 2's
    # hole still takes a token: holes 3 + 1 + 3 = 7, one block empties.
    assert as_lists(plan([[(1, 1), (2, 3), (6, 1)]], threshold=0.3)) == [(0, [1], [2])]
    # Holes enough for two, but only one candidate under the threshold.
    assert as_lists(plan([[(1, 1), (2, 2), (3, 2), (5, 2)]], threshold=0.3)) == [
        (0, [1], [2])
    ]


def brute_force(per_req, threshold):
    """Loop reference of the documented rule."""
    out = []
    for r, blocks in enumerate(per_req):
        holes = sum(B - n for _, n in blocks)
        cand = sorted((n, i, b) for i, (b, n) in enumerate(blocks) if n / B < threshold)
        k = min(len(cand), holes // B)
        if k == 0:
            continue
        src = [b for _, _, b in cand[:k]]
        dst = sorted(
            (B - n, i, b) for i, (b, n) in enumerate(blocks) if b not in src and n < B
        )
        need, used = sum(n for n, _, _ in cand[:k]), []
        for h, _, b in dst:  # as many destinations as the moved tokens need
            if need <= 0:
                break
            used.append(b)
            need -= h
        out.append((r, src, used))
    return out


def random_requests(seed: int, cached: bool = False):
    """1-11 requests of 0-14 distinct blocks: (block id, live[, cached])."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(400)
    per_req, at = [], 0
    for _ in range(rng.integers(1, 12)):
        n = int(rng.integers(0, 15))
        blocks = [(int(b), int(rng.integers(0, B + 1))) for b in ids[at : at + n]]
        if cached:
            blocks = [(b, n, bool(rng.random() < 0.6)) for b, n in blocks]
        per_req.append(blocks)
        at += n
    return rng, per_req


@pytest.mark.parametrize("seed", range(25))
def test_matches_loop_reference(seed):
    rng, per_req = random_requests(seed)
    threshold = float(rng.choice([0.3, 0.5, 0.75, 1.0]))
    assert as_lists(plan(per_req, threshold=threshold)) == brute_force(
        per_req, threshold
    )


def test_destination_priority_comes_before_density():
    # Block 2 (3 live) is denser than block 3 (2 live), but ranked after it:
    # the one token of block 1 goes to block 3. Without ranks, to block 2.
    blocks = [[(1, 1), (2, 3), (3, 2)]]
    assert as_lists(plan(blocks)) == [(0, [1], [2])]
    prio = np.array([0, 5, 1])
    assert as_lists(plan(blocks, dst_priority=prio)) == [(0, [1], [3])]
    with pytest.raises(AssertionError):
        plan(blocks, dst_priority=np.array([0, 1]))


def around_cache(per_req, threshold=1.0):
    """per_req: (block_id, live, cached) triples. (request, sources,
    destinations, fresh blocks) per planned request."""
    indptr = np.cumsum([0] + [len(r) for r in per_req])
    flat = [p for r in per_req for p in r]
    p = plan_around_cache(
        req_indptr=indptr,
        block_ids=np.array([b for b, _, _ in flat], dtype=np.int32),
        block_live=np.array([n for _, n, _ in flat], dtype=np.int64),
        cached=np.array([c for _, _, c in flat], dtype=bool),
        block_size=B,
        threshold=threshold,
    )
    fresh = p.num_fresh.tolist()
    return [(*t, f) for t, f in zip(as_lists(p), fresh, strict=True)]


def test_plans_around_the_cache_write_no_cached_block():
    C, U = True, False
    assert around_cache(
        [
            # Cached 1 and 2 (2 live each) empty into one fresh block; adding
            # cached 3 (3 live) would take a second: no better, not taken.
            [(3, 3, C), (1, 2, C), (2, 2, C)],
            [(4, 3, C), (5, 3, C), (6, 3, C)],  # 3 into 3 fresh: no gain
            [(7, 3, C), (8, 3, C), (9, 3, C), (10, 3, C)],  # 12 live: 4 into 3
            [],
            [(11, 0, C)],  # all dead: freed, no fresh block
            # StreamingLLM's sinks: cached 12 (1 live) into uncached 13's hole.
            [(12, 1, C), (13, 3, U)],
            # Uncached only: as plan_blocks; cached 17 is never a destination.
            [(14, 1, U), (15, 3, U), (17, 2, C)],
            # Cached 18's token fits in uncached 19's holes: 1 freed. Adding
            # 20 (3 live) would take a fresh block: 2 freed, 1 taken, no better.
            [(18, 1, C), (19, 1, U), (20, 3, C)],
        ]
    ) == [
        (0, [1, 2], [], 1),
        (2, [7, 8, 9, 10], [], 3),
        (4, [11], [], 0),
        (5, [12], [13], 0),
        (6, [14], [15], 0),
        (7, [18], [19], 0),
    ]
    assert around_cache([[(1, 1, C), (2, 1, C)]], threshold=0.25) == []
    assert around_cache([]) == [] and around_cache([[]]) == []


def around_cache_reference(per_req, threshold):
    """Loop reference: every k of cached sources, U's candidates after."""
    out = []
    for r, blocks in enumerate(per_req):
        cand = [(n, i, b, c) for i, (b, n, c) in enumerate(blocks) if n / B < threshold]
        cc, uc = sorted(x for x in cand if x[3]), sorted(x for x in cand if not x[3])
        holes_u = sum(B - n for _, n, c in blocks if not c)
        best = None
        for k in range(len(cc) + 1):
            m = sum(x[0] for x in cc[:k])
            k_u = min(len(uc), max(0, holes_u - m) // B)
            fresh = -(-max(0, m - holes_u) // B)
            if best is None or k + k_u - fresh > best[0]:
                best = (k + k_u - fresh, cc[:k] + uc[:k_u], fresh)
        gain, srcs, fresh = best
        if gain < 1:
            continue
        need = sum(x[0] for x in srcs)
        names = {x[2] for x in srcs}
        dst = sorted(
            (B - n, i, b)
            for i, (b, n, c) in enumerate(blocks)
            if not c and b not in names and n < B
        )
        used = []
        for h, _, b in dst:
            if need <= 0:
                break
            used.append(b)
            need -= h
        out.append((r, [x[2] for x in srcs], used, fresh))
    return out


@pytest.mark.parametrize("seed", range(25))
def test_plan_around_cache_matches_loop_reference(seed):
    rng, per_req = random_requests(seed, cached=True)
    threshold = float(rng.choice([0.3, 0.5, 0.75, 1.0]))
    assert around_cache(per_req, threshold) == around_cache_reference(
        per_req, threshold
    )


def test_plan_blocks_validates_arguments():
    good = dict(
        req_indptr=np.array([0, 2]),
        block_ids=np.array([1, 2], dtype=np.int32),
        block_live=np.array([1, 1]),
        block_size=B,
        threshold=0.9,
    )
    plan_blocks(**good)
    bad = [
        dict(threshold=0.0),
        dict(threshold=1.5),
        dict(block_size=0),
        dict(req_indptr=np.array([0, 1])),  # does not end at N
        dict(req_indptr=np.array([1, 2])),  # does not start at 0
        dict(req_indptr=np.array([0, 2, 1, 2])),  # decreasing
        dict(block_live=np.array([1])),  # misaligned
        dict(block_live=np.array([1, B + 1])),  # more live than slots
        dict(block_ids=np.array([1, 1], dtype=np.int32)),  # repeated block
    ]
    for change in bad:
        with pytest.raises(AssertionError):
            plan_blocks(**{**good, **change})


def block_plan(src: list[list[int]], dst: list[list[int]], fresh=None) -> BlockPlan:
    """A hand-made plan: per planned request (input requests 0..K-1), its
    sources, destinations and fresh block count."""

    def csr(lists):
        return np.cumsum([0] + [len(x) for x in lists]).astype(np.int64)

    return BlockPlan(
        req_index=np.arange(len(src)),
        src_indptr=csr(src),
        src_block_ids=np.array([b for x in src for b in x], dtype=np.int32),
        dst_indptr=csr(dst),
        dst_block_ids=np.array([b for x in dst for b in x], dtype=np.int32),
        num_fresh=np.array(fresh or [0] * len(src), dtype=np.int64),
    )


def pack(p: BlockPlan, tokens, fresh=(), num_blocks=64) -> Moves:
    """tokens: per input request, its live (logical indices, slots)."""

    def flat(j):
        return np.concatenate([np.asarray(t[j], np.int64) for t in tokens] + [[]])

    return pack_requests(
        p,
        live_indptr=np.cumsum([0] + [len(t[0]) for t in tokens]),
        live_idx=flat(0).astype(np.int64),
        live_slots=flat(1).astype(np.int64),
        block_size=B,
        num_blocks=num_blocks,
        fresh_block_ids=np.array(fresh, dtype=np.int64),
    )


def per_request(m: Moves) -> list[tuple[list[int], list[int], list[int]]]:
    cut = m.indptr.tolist()
    return [
        tuple(a[lo:hi].tolist() for a in (m.idx, m.src_slots, m.dst_slots))
        for lo, hi in zip(cut[:-1], cut[1:], strict=True)
    ]


def test_pack_requests_fills_holes_in_order():
    # Request 0: idx 0 in source block 7 (slot 29), idx 5-6 in source block 3
    # (slots 13, 14); block 5 holds idx 9 at offset 0 (slot 20), block 2 idx
    # 10-11 at offsets 1, 3 (slots 9, 11). Holes: block 2 offsets 0, 2, then
    # block 5 offsets 1-3 -- the given destination order, offsets ascending.
    # Request 1: its source 1 (slots 5, 6) into fresh block 11 (all holes).
    # Request 2 is not planned: its token in block 9 stays.
    p = block_plan([[7, 3], [1]], [[2, 5], []], fresh=[0, 1])
    tokens = [
        ([0, 5, 6, 9, 10, 11], [29, 13, 14, 20, 9, 11]),
        ([3, 4], [5, 6]),
        ([0], [36]),
    ]
    m = pack(p, tokens, fresh=[11])
    assert per_request(m) == [
        ([0, 5, 6], [29, 13, 14], [8, 10, 21]),
        ([3, 4], [5, 6], [44, 45]),
    ]
    assert m.indptr.tolist() == [0, 3, 5]
    for arr in (m.indptr, m.idx, m.src_slots, m.dst_slots):
        assert arr.dtype == np.int64
    # A request whose sources hold no live token moves nothing.
    m = pack(block_plan([[4]], [[]]), [([1], [9])])
    assert m.indptr.tolist() == [0, 0] and m.idx.size == 0


def test_pack_requests_rejects_what_cannot_work():
    five = [(np.arange(5), np.arange(5))]  # 5 live tokens in blocks 0-1
    with pytest.raises(AssertionError, match="do not fit"):
        pack(block_plan([[0, 1]], [[5]]), five)  # block 5: 4 free slots
    with pytest.raises(AssertionError, match="is a source"):
        pack(block_plan([[0, 1]], [[1, 2]]), five)
    with pytest.raises(AssertionError):
        pack(block_plan([[0]], [[5]]), [(np.arange(3), np.arange(2))])
    with pytest.raises(AssertionError, match="no plan"):  # request 1's tokens
        pack(block_plan([[0]], [[5]]), [([], []), ([0], [1])])
    # Request 0's token in block 3, request 1's destination: a foreign
    # token (the planner plans a request's own blocks only).
    two = [([0, 1], [0, 3 * B]), ([0], [2 * B])]
    with pytest.raises(AssertionError, match="token 1 is a foreign token"):
        pack(block_plan([[0], [2]], [[5], [3]]), two)
    # Request 0's destination is request 1's source.
    with pytest.raises(AssertionError, match=r"a destination is a source \(block 2"):
        pack(block_plan([[0], [2]], [[2], [3]]), two)
    with pytest.raises(AssertionError):  # fresh blocks the plan did not ask for
        pack(block_plan([[0]], [[5]]), five[:1], fresh=[9])
    empty = pack(block_plan([], []), [])
    assert empty.indptr.tolist() == [0] and empty.idx.size == 0


def pack_reference(p: BlockPlan, tokens, fresh):
    """Loop reference: per planned request, its source tokens in logical
    order into the free slots of its destinations, then its fresh blocks."""
    out, at = [], 0
    for k, r in enumerate(p.req_index.tolist()):
        src = set(p.src_block_ids[p.src_indptr[k] : p.src_indptr[k + 1]].tolist())
        dst = p.dst_block_ids[p.dst_indptr[k] : p.dst_indptr[k + 1]].tolist()
        dst += list(fresh[at : at + p.num_fresh[k]])
        at += p.num_fresh[k]
        idx, slots = (np.asarray(a).tolist() for a in tokens[r])
        held = set(slots)
        free = [d * B + o for d in dst for o in range(B) if d * B + o not in held]
        moved = [
            (i, s) for i, s in sorted(zip(idx, slots, strict=True)) if s // B in src
        ]
        assert len(moved) <= len(free)
        dsts = free[: len(moved)]
        out.append(([i for i, _ in moved], [s for _, s in moved], dsts))
    return out


def random_tokens(seed: int):
    """1-8 requests of 0-11 distinct blocks, a random part of their slots
    live, at logical indices in no relation to the blocks (as after moves)."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(np.arange(1, 200))
    blocks, tokens, at = [], [], 0
    for _ in range(rng.integers(1, 9)):
        n = int(rng.integers(0, 12))
        mine, at = ids[at : at + n], at + n
        slots = rng.permutation((mine[:, None] * B + np.arange(B)).ravel())
        slots = slots[: rng.integers(0, slots.size + 1)]
        idx = np.sort(rng.choice(2 * B * max(n, 1), slots.size, replace=False))
        blocks.append(mine)
        tokens.append((idx, slots))
    return rng, blocks, tokens, ids[at:]


@pytest.mark.parametrize("seed", range(30))
def test_pack_requests_matches_loop_reference(seed):
    rng, blocks, tokens, unused = random_tokens(seed)
    ids = np.concatenate(blocks + [[]]).astype(np.int32)
    live = np.zeros(200, np.int64)
    np.add.at(live, np.concatenate([t[1] for t in tokens]) // B, 1)
    args = dict(
        req_indptr=np.cumsum([0] + [len(b) for b in blocks]),
        block_ids=ids,
        block_live=live[ids],
        block_size=B,
        threshold=float(rng.choice([0.3, 0.5, 0.75, 1.0])),
    )
    if seed % 2:
        p = plan_blocks(**args)
    else:
        p = plan_around_cache(cached=rng.random(ids.size) < 0.9, **args)
    fresh = unused[: p.num_fresh.sum()].tolist()
    m = pack(p, tokens, fresh=fresh, num_blocks=200)
    assert per_request(m) == pack_reference(p, tokens, fresh)


def test_oracle_plan_pack_apply_equals_dense_gather_of_kept_tokens():
    """Evict, plan, copy on a simulated KV array, apply: reads are unchanged."""
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
    )
    # a: live 1 (block 2), 2 (block 5: tokens 4 and 7), 0 (block 7): 9 holes
    # empty 2 blocks, 7 (no moves) and 2 (token 3 -> block 5's first hole,
    # offset 1 = slot 21). b's only eligible block has 3 holes: nothing.
    assert as_lists(p) == [(0, [7, 2], [5])]
    m = pack(p, [(pool.live_idx(r), pool.live_slots(r)) for r in rids], num_blocks=16)
    assert m.idx.tolist() == [3] and m.dst_slots.tolist() == [21]
    kv[m.dst_slots] = kv[m.src_slots]
    pool.apply_moves(["a"], m.indptr, m.idx, m.dst_slots)
    kv[(np.array([7, 2])[:, None] * B + np.arange(B)).ravel()] = np.nan  # freed
    for r in held:
        np.testing.assert_array_equal(kv[pool.live_slots(r)], dense[r])
    assert pool.block_live[[2, 5, 7]].tolist() == [0, 3, 0]
    pool.check_integrity()


def candidates_reference(ids, counts, head_len, code, block_live, null_id, B):
    """BlockReclaimer.plan's selection of candidate blocks as NumPy passes
    (the code the compiled `candidate_blocks` replaced)."""
    starts = np.cumsum(counts) - counts
    head_at = np.concatenate(
        [np.arange(s, s + h) for s, h in zip(starts, head_len, strict=True)]
        + [np.zeros(0, np.int64)]
    )
    shared, cached = np.zeros(ids.size, bool), np.zeros(ids.size, bool)
    shared[head_at], cached[head_at] = code >> 1 != 1, code & 1
    live = block_live[ids]
    keep = np.flatnonzero((ids != null_id) & ~shared & (live < B))
    req = np.repeat(np.arange(counts.size), counts)[keep]
    pos = keep - starts[req]
    is_cached = cached[keep]
    prio = np.where(is_cached, 1 + pos.max(initial=0) - pos, 0)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(req, minlength=counts.size))])
    return indptr, ids[keep], live[keep], is_cached, pos, prio


@pytest.mark.parametrize("seed", range(6))
def test_candidate_blocks_match_the_numpy_selection(seed):
    """One pass picks the blocks a plan may use: not null, full or shared;
    each one's entry, whether it is cached, its destination priority."""
    from vllm.vtoken.planner_kernels import candidate_blocks

    rng = np.random.default_rng(seed)
    num_blocks, null_id, num_req = 64, 0, int(rng.integers(0, 9))
    block_live = rng.integers(0, B + 1, num_blocks).astype(np.int32)
    counts = rng.integers(0, 8, num_req).astype(np.int64)
    head_len = np.minimum(counts, rng.integers(0, 8, num_req))
    # Distinct blocks per list but null ones, which repeat.
    ids = rng.permutation(np.arange(1, num_blocks))[: counts.sum()].astype(np.int64)
    ids[rng.random(ids.size) < 0.2] = null_id
    ref_cnt = rng.choice([1, 1, 1, 2], int(head_len.sum()))
    code = ref_cnt * 2 + rng.integers(0, 2, ref_cnt.size)
    got = candidate_blocks(ids, counts, head_len, code, block_live, null_id, B)
    want = candidates_reference(ids, counts, head_len, code, block_live, null_id, B)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    assert got[1].dtype == np.int32 and got[3].dtype == bool


@pytest.mark.parametrize("seed", range(20))
def test_ack_entries_match_the_numpy_they_replace(seed):
    """planner_kernels.ack_entries against release_sources' former NumPy: a
    batch of parts with sources (the first nf of each displaced), some parts
    acknowledged."""
    from vllm.vtoken.arena import indptr_of, ranges
    from vllm.vtoken.planner_kernels import ack_entries

    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 9))
    num_src = rng.integers(1, 6, k)
    num_fresh = rng.integers(0, num_src + 1)
    s, f = indptr_of(num_src), indptr_of(num_fresh)
    src_at = np.concatenate([rng.permutation(12)[:n] for n in num_src])
    src_ids = rng.permutation(100)[: s[-1]].astype(np.int64)
    kept = np.flatnonzero(rng.random(k) < 0.7)
    src, seg, at, ids, nf = ack_entries(kept, s, f, src_at, src_ids)
    assert src.tolist() == ranges(s[kept], s[kept + 1] - s[kept]).tolist()
    first = s[kept] + f[kept + 1] - f[kept]
    want_at = ranges(first, s[kept + 1] - first)
    want_seg = np.repeat(kept, s[kept + 1] - first)
    order = np.lexsort((src_at[want_at], want_seg))
    assert seg.tolist() == want_seg[order].tolist()
    assert at.tolist() == src_at[want_at[order]].tolist()
    assert ids.tolist() == src_ids[want_at[order]].tolist()
    assert nf == int((f[kept + 1] - f[kept]).sum())
