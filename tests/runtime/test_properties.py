# SPDX-License-Identifier: Apache-2.0
"""Property test: Token Tables + planner under long random operation sequences.

A simulated block allocator (free list), a simulated KV cache (one payload per
slot, `kv[slot] = uid(request, logical index)`) and a model of each request's live
set run beside the real `TokenTablePool`. Rules append, evict, plan + copy + ack
compactions (with tokens dying between plan and ack), free fully dead blocks
(naive reclamation), preempt and release. After every step: `check_integrity()`,
no live token lost (live sets equal, every live payload read through the slot map
intact), no slot owned twice, no block leaked (free + held == total).
"""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm.vtoken.packing import pack_requests
from vllm.vtoken.planner import plan_blocks
from vllm.vtoken.token_table import TokenTablePool

NUM_BLOCKS, B = 32, 4
FREED = -7  # written into a block's slots when it returns to the free list


def uid(rid: str, idx: np.ndarray) -> np.ndarray:
    return int(rid[1:]) * 100_000 + np.asarray(idx, dtype=np.int64)


class Sim:
    """The pool under test beside a simulated allocator, KV cache and live sets."""

    def __init__(self) -> None:
        self.pool = TokenTablePool(NUM_BLOCKS, B)
        self.free = list(range(NUM_BLOCKS))
        self.held: dict[str, set[int]] = {}
        self.tail: dict[str, list[int] | None] = {}  # [block, next offset]
        self.live: dict[str, set[int]] = {}
        self.known: dict[str, int] = {}
        self.kv = np.full(NUM_BLOCKS * B, FREED, dtype=np.int64)
        self.next_id = 0
        self.stats = {"moves": 0, "planned": 0}

    def _free_blocks(self, rid: str, blocks) -> None:
        for b in list(blocks):
            self.held[rid].remove(b)
            self.free.append(b)
            self.kv[b * B : (b + 1) * B] = FREED

    def pick(self, r: int) -> str | None:
        rids = sorted(self.held)
        return rids[r % len(rids)] if rids else None

    # ------------------------------------------------------------ operations
    def new(self) -> None:
        if len(self.held) >= 4:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        # Both kinds of live list: victims out at once, or listed a while.
        self.pool.add_request(rid, keep_dead=self.next_id % 2 == 0)
        self.held[rid], self.tail[rid] = set(), None
        self.live[rid], self.known[rid] = set(), 0

    def append(self, rid: str, n: int) -> None:
        slots = []
        for _ in range(n):
            t = self.tail[rid]
            if t is None or t[1] == B:
                if not self.free:
                    break
                t = self.tail[rid] = [self.free.pop(), 0]
                self.held[rid].add(t[0])
            slots.append(t[0] * B + t[1])
            t[1] += 1
        start = self.pool.num_slotted(rid)
        self.pool.append(rid, np.array(slots, dtype=np.int64))
        idx = np.arange(start, start + len(slots))
        self.kv[slots] = uid(rid, idx)  # the forward pass writes K/V
        self.live[rid].update(idx[idx >= self.known[rid]].tolist())
        self.known[rid] = max(self.known[rid], start + len(slots))

    def evict(self, rid: str, frac: float, seed: int) -> None:
        cand = self.pool.live_idx(rid)
        idx = np.random.default_rng(seed).permutation(cand)[: round(frac * cand.size)]
        out = self.pool.evict(rid, idx)
        assert out.tolist() == sorted(idx.tolist())
        self.live[rid].difference_update(idx.tolist())

    def compact(self, threshold: float, die: float) -> None:
        """Plan, copy into holes, let some moved tokens die, then ack."""
        rids = sorted(self.held)
        tails = {r: self.tail[r][0] if self.tail[r] else -1 for r in rids}
        elig = [sorted(self.held[r] - {tails[r]}) for r in rids]
        ids = np.array([b for e in elig for b in e], dtype=np.int32)
        free_before = len(self.free)
        plan = plan_blocks(
            req_indptr=np.cumsum([0] + [len(e) for e in elig]),
            block_ids=ids,
            block_live=self.pool.block_live[ids],
            block_size=B,
            threshold=threshold,
        )
        self.stats["planned"] += plan.req_index.size
        owned = np.concatenate([self.pool.live_slots(r) for r in rids] + [[]])
        moves = pack_requests(
            plan,
            live_indptr=np.cumsum([0] + [self.pool.live_idx(r).size for r in rids]),
            live_idx=np.concatenate([self.pool.live_idx(r) for r in rids] + [[]]),
            live_slots=owned,
            block_size=B,
            num_blocks=NUM_BLOCKS,
        )
        assert not np.isin(moves.dst_slots, owned).any(), "move onto a live slot"
        assert np.unique(moves.dst_slots).size == moves.dst_slots.size
        batch = []
        for k, r in enumerate(plan.req_index):
            rid = rids[r]
            src = plan.src_block_ids[plan.src_indptr[k] : plan.src_indptr[k + 1]]
            dst = plan.dst_block_ids[plan.dst_indptr[k] : plan.dst_indptr[k + 1]]
            assert set(dst.tolist()) <= self.held[rid] - {tails[rid]} - set(src)
            lo, hi = moves.indptr[k], moves.indptr[k + 1]
            m = (moves.idx[lo:hi], moves.src_slots[lo:hi], moves.dst_slots[lo:hi])
            assert set((m[2] // B).tolist()) <= set(dst.tolist())
            batch.append((rid, src, m))
        assert len(self.free) == free_before, "a plan took a block from the pool"
        for rid, _, (idx, _, _) in batch:  # some moved tokens die before the ack
            dead = idx[: int(die * idx.size)]
            self.pool.evict(rid, dead)
            self.live[rid].difference_update(dead.tolist())
        for rid, src, (idx, src_slots, dst_slots) in batch:  # copy, then ack
            self.kv[dst_slots] = self.kv[src_slots]
            self.pool.apply_moves([rid], np.array([0, idx.size]), idx, dst_slots)
            assert (self.pool.block_live[src] == 0).all(), "live token left behind"
            self._free_blocks(rid, src.tolist())
            self.stats["moves"] += idx.size
        assert len(self.free) == free_before + plan.blocks_freed

    def free_dead(self, rid: str) -> None:
        """Naive reclamation: a held block with no live token goes back."""
        tail = self.tail[rid][0] if self.tail[rid] else -1
        dead = [b for b in self.held[rid] if b != tail and self.pool.block_live[b] == 0]
        self._free_blocks(rid, dead)

    def preempt(self, rid: str) -> None:
        self.pool.reset_slots(rid)
        self._free_blocks(rid, self.held[rid])
        self.tail[rid] = None

    def release(self, rid: str) -> None:
        self.pool.release(rid)
        self._free_blocks(rid, self.held[rid])
        for d in (self.held, self.tail, self.live, self.known):
            del d[rid]

    # ------------------------------------------------------------ invariants
    def check(self) -> None:
        ref = np.zeros(NUM_BLOCKS, dtype=np.int64)
        for blocks in self.held.values():
            ref[list(blocks)] += 1
        assert (ref <= 1).all(), "a block held twice"
        assert len(set(self.free)) == len(self.free), "a block freed twice"
        assert len(self.free) + int(ref.sum()) == NUM_BLOCKS, "a block leaked"
        self.pool.check_integrity(block_ref_cnt=ref)
        assert sorted(self.pool.request_ids()) == sorted(self.held)
        total = 0
        for rid in self.held:
            idx, slots = self.pool.live_idx(rid), self.pool.live_slots(rid)
            n_slotted = self.pool.num_slotted(rid)
            want = sorted(i for i in self.live[rid] if i < n_slotted)
            assert idx.tolist() == want, f"{rid}: live set differs"
            assert self.pool.num_live(rid) == len(self.live[rid])
            assert self.pool.num_tokens(rid) == self.known[rid]
            np.testing.assert_array_equal(self.kv[slots], uid(rid, idx))
            assert set((slots // B).tolist()) <= self.held[rid], "unheld live block"
            total += len(self.live[rid])
        assert self.pool.total_live() == total

    def finish(self) -> None:
        for rid in sorted(self.held):
            self.release(rid)
        assert sorted(self.free) == list(range(NUM_BLOCKS)), "blocks leaked"
        assert self.pool.block_live.sum() == 0 and self.pool.total_live() == 0


REQ = st.integers(0, 3)
APPEND = st.tuples(st.just("append"), REQ, st.integers(1, 32))
EVICT = st.tuples(
    st.just("evict"), REQ, st.sampled_from([0.2, 0.5, 0.8, 1.0]), st.integers(0, 999)
)
COMPACT = st.tuples(
    st.just("compact"),
    st.sampled_from([0.5, 0.75, 1.0]),
    st.sampled_from([0.0, 0.0, 0.3, 1.0]),
)
RARE = st.tuples(st.sampled_from(["new", "free_dead", "preempt", "release"]), REQ)
# Repeated branches weigh the draw towards the operations that build work.
OPS = st.one_of(APPEND, APPEND, EVICT, EVICT, COMPACT, COMPACT, RARE)


def run(ops) -> Sim:
    sim = Sim()
    sim.new()
    sim.new()
    for kind, *args in ops:
        if kind == "new":
            sim.new()
        elif kind == "compact":
            sim.compact(*args)
        elif sim.held:
            getattr(sim, kind)(sim.pick(args[0]), *args[1:])
        sim.check()
    return sim


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, min_size=30, max_size=80))
def test_token_tables_survive_random_operations(ops):
    run(ops).finish()


def test_the_random_sequences_exercise_compaction():
    """Guards the generator: a fixed seed plans and moves tokens."""
    rng = np.random.default_rng(0)
    stats = {"moves": 0, "planned": 0}
    for _ in range(20):
        ops = []
        for _ in range(60):
            kind = rng.choice(
                ["append", "evict", "compact", "rare"], p=[0.35, 0.3, 0.25, 0.1]
            )
            r = int(rng.integers(4))
            if kind == "append":
                ops.append(("append", r, int(rng.integers(1, 33))))
            elif kind == "evict":
                ops.append(
                    (
                        "evict",
                        r,
                        float(rng.choice([0.2, 0.5, 0.8])),
                        int(rng.integers(999)),
                    )
                )
            elif kind == "compact":
                ops.append(("compact", 0.75, 0.3))
            else:
                ops.append(
                    (str(rng.choice(["new", "free_dead", "preempt", "release"])), r)
                )
        sim = run(ops)
        sim.finish()
        for key in stats:
            stats[key] += sim.stats[key]
    assert stats["moves"] > 100 and stats["planned"] > 20
