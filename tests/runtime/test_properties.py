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
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from vllm.vtoken.planner import pack_request, plan_blocks
from vllm.vtoken.token_table import TokenTablePool

NUM_BLOCKS, B = 32, 4
FREED = -7  # written into a block's slots when it returns to the free list


def uid(rid: str, idx: np.ndarray) -> np.ndarray:
    return int(rid[1:]) * 100_000 + np.asarray(idx, dtype=np.int64)


class TokenTableMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.pool = TokenTablePool(NUM_BLOCKS, B)
        self.free = list(range(NUM_BLOCKS))
        self.held: dict[str, set[int]] = {}
        self.tail: dict[str, list[int] | None] = {}  # [block, next offset]
        self.live: dict[str, set[int]] = {}
        self.known: dict[str, int] = {}
        self.kv = np.full(NUM_BLOCKS * B, FREED, dtype=np.int64)
        self.next_id = 0
        self.new_request()
        self.new_request()

    # ------------------------------------------------------------ helpers
    def _free_blocks(self, rid: str, blocks) -> None:
        for b in blocks:
            self.held[rid].remove(b)
            self.free.append(b)
            self.kv[b * B : (b + 1) * B] = FREED

    def _pick(self, data) -> str:
        return data.draw(st.sampled_from(sorted(self.held)), label="req")

    # ------------------------------------------------------------ rules
    @precondition(lambda self: len(self.held) < 4)
    @rule()
    def new_request(self) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.pool.add_request(rid)
        self.held[rid], self.tail[rid] = set(), None
        self.live[rid], self.known[rid] = set(), 0

    @precondition(lambda self: self.held)
    @rule(data=st.data(), n=st.integers(1, 32))
    def append(self, data, n: int) -> None:
        rid = self._pick(data)
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
        new = idx[idx >= self.known[rid]]
        self.live[rid].update(new.tolist())
        self.known[rid] = max(self.known[rid], start + len(slots))

    @precondition(lambda self: self.held)
    @rule(
        data=st.data(),
        frac=st.sampled_from([0.2, 0.4, 0.6, 0.8, 1.0]),
        seed=st.integers(0, 2**16),
    )
    def evict(self, data, frac: float, seed: int) -> None:
        rid = self._pick(data)
        cand = self.pool.live_idx(rid)
        rng = np.random.default_rng(seed)
        idx = rng.permutation(cand)[: round(frac * cand.size)]
        out = self.pool.evict(rid, idx)
        assert out.tolist() == sorted(idx.tolist())
        self.live[rid].difference_update(idx.tolist())

    @precondition(lambda self: self.held)
    @rule(
        data=st.data(),
        threshold=st.sampled_from([0.5, 0.75, 1.0]),
        margin=st.integers(0, 6),
        die=st.floats(0.0, 0.5),
    )
    def compact(self, data, threshold: float, margin: int, die: float) -> None:
        rids = sorted(self.held)
        elig = [
            sorted(self.held[r] - {self.tail[r][0] if self.tail[r] else -1})
            for r in rids
        ]
        ids = np.array([b for e in elig for b in e], dtype=np.int32)
        free_before = len(self.free)
        plan = plan_blocks(
            req_indptr=np.cumsum([0] + [len(e) for e in elig]),
            block_ids=ids,
            block_live=self.pool.block_live[ids],
            block_size=B,
            threshold=threshold,
            free_blocks=free_before,
            margin=margin,
        )
        assert int(plan.num_dst.sum()) <= max(free_before - margin, 0)
        owned = np.concatenate([self.pool.live_slots(r) for r in rids])
        batch = []
        for k, r in enumerate(plan.req_index):
            rid = rids[r]
            src = plan.src_block_ids[plan.src_indptr[k] : plan.src_indptr[k + 1]]
            dst = [self.free.pop() for _ in range(int(plan.num_dst[k]))]
            self.held[rid].update(dst)
            m = pack_request(
                live_idx=self.pool.live_idx(rid),
                live_slots=self.pool.live_slots(rid),
                src_block_ids=src,
                dst_block_ids=np.array(dst, dtype=np.int64),
                block_size=B,
            )
            assert not np.isin(m.dst_slots, owned).any(), "move onto a live slot"
            batch.append((rid, src, m))
        for rid, src, m in batch:  # some moved tokens die before the ack
            if m.idx.size and data.draw(st.booleans(), label="die"):
                k = int(die * m.idx.size)
                self.pool.evict(rid, m.idx[:k])
                self.live[rid].difference_update(m.idx[:k].tolist())
        for rid, src, m in batch:  # worker copies, then the scheduler acks
            self.kv[m.dst_slots] = self.kv[m.src_slots]
            self.pool.remap(rid, m.idx, m.dst_slots)
            assert (self.pool.block_live[src] == 0).all(), "live token left behind"
            self._free_blocks(rid, src.tolist())
        assert len(self.free) == free_before + plan.blocks_freed

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_dead_blocks(self, data) -> None:
        """Naive reclamation: a held block with no live token goes back."""
        rid = self._pick(data)
        tail = self.tail[rid][0] if self.tail[rid] else -1
        dead = [b for b in self.held[rid] if b != tail and self.pool.block_live[b] == 0]
        self._free_blocks(rid, dead)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), go=st.integers(0, 3))
    def preempt(self, data, go: int) -> None:
        if go:  # rarer than the other rules, so requests live long enough
            return
        rid = self._pick(data)
        self.pool.reset_slots(rid)
        self._free_blocks(rid, list(self.held[rid]))
        self.tail[rid] = None

    @precondition(lambda self: self.held)
    @rule(data=st.data(), go=st.integers(0, 3))
    def release(self, data, go: int) -> None:
        if go:  # rarer than the other rules, so requests live long enough
            return
        rid = self._pick(data)
        self.pool.release(rid)
        self._free_blocks(rid, list(self.held[rid]))
        for d in (self.held, self.tail, self.live, self.known):
            del d[rid]

    # ------------------------------------------------------------ invariants
    @invariant()
    def consistent(self) -> None:
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

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for rid in list(self.held):
            self.pool.release(rid)
            self._free_blocks(rid, list(self.held[rid]))
        assert sorted(self.free) == list(range(NUM_BLOCKS)), "blocks leaked"
        assert self.pool.block_live.sum() == 0 and self.pool.total_live() == 0


TokenTableMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_token_tables_survive_random_operations = TokenTableMachine.TestCase
