# SPDX-License-Identifier: Apache-2.0
"""EvictionRuntime (budget enforcement) and ScoreAccumulator (per-slot scores)."""

import numpy as np
import pytest
import torch

from vllm.vtoken.eviction import EvictionRuntime
from vllm.vtoken.policies import EvictionPolicy, create_policy
from vllm.vtoken.scores import ScoreAccumulator
from vllm.vtoken.token_table import TokenTablePool
from vllm.vtoken.triton_attention import attention_mass

B = 4


class Recorder(EvictionPolicy):
    """Evicts the oldest evictable tokens and records what it was told."""

    name = "recorder"

    def _validate(self) -> None:
        self.synced: list[tuple[str, int, list[int]]] = []
        self.released: list[str] = []

    def sync_new_tokens(self, req, num_new):
        self.synced.append((req.req_id, num_new, req.live_idx.tolist()))

    def evict_token(self, req, num_evict):
        return req.live_idx[req.evictable][:num_evict]

    def release(self, req_id):
        self.released.append(req_id)


class Liar(Recorder):
    """Breaks the contract: returns the newest (protected) tokens."""

    def evict_token(self, req, num_evict):
        return req.live_idx[-num_evict:]


def make_runtime(policy, budget=4, **kw) -> EvictionRuntime:
    return EvictionRuntime(TokenTablePool(32, B), policy, budget, **kw)


def test_sync_registers_and_tells_policy_only_of_new_tokens():
    rt = make_runtime(Recorder(4))
    rt.sync_new_tokens("a", np.array([8, 9, 10]))
    rt.sync_new_tokens("a", np.array([11]))
    assert rt.pool.slots("a").tolist() == [8, 9, 10, 11]
    assert rt.policy.synced == [("a", 3, [0, 1, 2]), ("a", 1, [0, 1, 2, 3])]
    rt.pool.reset_slots("a")  # preempted: recomputed tokens are not new
    rt.sync_new_tokens("a", np.array([20, 21, 22, 23, 24]))
    assert rt.policy.synced[-1] == ("a", 1, [0, 1, 2, 3, 4])
    assert len(rt.policy.synced) == 3


def test_enforce_budget_evicts_excess_among_attended_tokens():
    rt = make_runtime(Recorder(4), budget=4)
    rt.sync_new_tokens("a", np.arange(8, 11))
    assert rt.enforce_budget("a", 3).size == 0  # 3 live <= 4
    rt.sync_new_tokens("a", np.arange(11, 18))  # 10 live
    # Attended 0..4; token 4 (most recent attended) and 5.. are protected.
    out = rt.enforce_budget("a", 5)
    assert out.tolist() == [0, 1, 2, 3] and out.dtype == np.int64
    assert rt.pool.num_live("a") == 6
    out = rt.enforce_budget("a", 10)
    assert out.tolist() == [4, 5] and rt.pool.num_live("a") == 4
    assert rt.pool.live_idx("a").tolist() == [6, 7, 8, 9]
    rt.pool.check_integrity()


def test_contract_violations_raise_and_leave_state_unchanged():
    rt = make_runtime(Liar(2), budget=2)
    rt.sync_new_tokens("a", np.arange(6))
    with pytest.raises(RuntimeError, match="broke its contract"):
        rt.enforce_budget("a", 6)
    assert rt.pool.num_live("a") == 6 and rt.pool.block_live.sum() == 6


def test_score_policies_read_scores_of_live_slots():
    seen = {}

    def source(slots):
        seen["slots"] = slots.tolist()
        return np.where(slots == 13, 0.0, 1.0 + slots / 100).astype(np.float32)

    rt = make_runtime(
        create_policy("h2o", 4, {"recent_ratio": 0.25}), 4, score_source=source
    )
    rt.sync_new_tokens("a", np.array([9, 13, 10, 30, 31, 12]))
    rt.pool.evict("a", np.array([2]))
    out = rt.enforce_budget("a", 6)
    assert seen["slots"] == [9, 13, 30, 31, 12]
    assert out.tolist() == [1]  # slot 13 scored lowest
    no_source = make_runtime(create_policy("h2o", 2))
    no_source.sync_new_tokens("a", np.arange(5))
    with pytest.raises(RuntimeError, match="no score source"):
        no_source.enforce_budget("a", 5)


def test_release_drops_request_everywhere():
    rt = make_runtime(Recorder(4))
    rt.sync_new_tokens("a", np.arange(4))
    rt.release("a")
    assert "a" not in rt.pool and rt.policy.released == ["a"]
    assert rt.pool.block_live.sum() == 0
    with pytest.raises(KeyError):
        rt.release("a")


def test_random_runtime_is_reproducible_whatever_the_request_order():
    def run(order, seed):
        rt = make_runtime(create_policy("random", 3), 3, seed=seed)
        for i, rid in enumerate(order):
            rt.sync_new_tokens(rid, np.arange(8) + 8 * i)
        return {rid: rt.enforce_budget(rid, 8).tolist() for rid in order}

    a = run(["x", "y"], 7)
    assert a == run(["y", "x"], 7)
    assert a != run(["x", "y"], 8)
    assert all(len(v) == 5 and 7 not in v for v in a.values())


# ---------------------------------------------------------------- scores
def test_sum_mode_accumulates_normalized_mass_per_slot():
    acc = ScoreAccumulator(16, "sum")
    slots = torch.tensor([3, 7, 9])
    acc.add(slots, torch.tensor([1.0, 2.0, 3.0]))  # layer 0
    acc.add(slots, torch.tensor([3.0, 2.0, 1.0]))  # layer 1
    acc.finish_step(slots, 1, norm=4.0)
    acc.finish_step(slots, 1, norm=4.0)  # buffer was zeroed: adds nothing
    out = acc.scores(np.array([3, 7, 9, 0]))
    assert out.dtype == np.float32 and out.tolist() == [1.0, 1.0, 1.0, 0.0]


def test_persistence_counts_steps_at_or_above_uniform_attention():
    acc = ScoreAccumulator(16, "persistence")
    slots = torch.tensor([1, 2, 3, 4])
    # norm 2, 1 query, 4 keys: important iff mass / 2 >= 1/4, i.e. mass >= 0.5.
    for mass in ([0.5, 0.49, 1.0, 0.01], [0.1, 0.6, 1.2, 0.1]):
        acc.add(slots, torch.tensor(mass))
        acc.finish_step(slots, 1, norm=2.0)
    assert acc.scores(np.array([1, 2, 3, 4])).tolist() == [1.0, 1.0, 2.0, 0.0]
    # Per-slot query and key counts for a flat batch of two requests.
    acc.add(slots, torch.tensor([2.0, 2.0, 0.3, 0.3]))
    acc.finish_step(slots, torch.tensor([3, 3, 1, 1]), 2.0, torch.tensor([2, 2, 3, 3]))
    # 2*2 >= 2*3 is False; 0.3*3 >= 2*1 is False.
    assert acc.scores(np.array([1, 2, 3, 4])).tolist() == [1.0, 1.0, 2.0, 0.0]
    with pytest.raises(AssertionError):
        ScoreAccumulator(16, "max")
    with pytest.raises(AssertionError):
        acc.finish_step(slots, 1, norm=0.0)


def test_windowed_persistence_is_a_moving_average_of_importance():
    acc = ScoreAccumulator(8, "persistence", window=4)
    slots = torch.tensor([1, 2])
    # norm 1, 1 query, 2 keys: important iff mass >= 0.5.
    for important in ([1, 0], [1, 0], [1, 1], [0, 1], [0, 1]):
        acc.add(slots, torch.tensor(important, dtype=torch.float32))
        acc.finish_step(slots, 1, norm=1.0)
    ema = np.zeros(2)
    for important in ([1, 0], [1, 0], [1, 1], [0, 1], [0, 1]):
        ema += (np.array(important) - ema) / 4
    np.testing.assert_allclose(acc.scores(np.array([1, 2])), ema, rtol=1e-6)
    with pytest.raises(AssertionError):
        ScoreAccumulator(8, "persistence", window=0)
    with pytest.raises(AssertionError):
        ScoreAccumulator(8, "sum", window=4)


def test_move_and_reset_follow_tokens():
    acc = ScoreAccumulator(8, "sum")
    acc.add(torch.arange(8), torch.arange(8, dtype=torch.float32))
    acc.finish_step(torch.arange(8), 1, norm=1.0)
    acc.move(torch.tensor([1, 2, 5]), torch.tensor([2, 6, 1]))  # overlapping
    assert acc.scores(np.arange(8)).tolist() == [0, 5, 1, 3, 4, 0, 2, 7]
    acc.reset(torch.tensor([3, 7]))
    assert acc.scores(np.arange(8)).tolist() == [0, 5, 1, 0, 4, 0, 2, 0]


def dense_loop_mass(q, k, scale):
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    out = torch.zeros(lk, dtype=torch.float64)
    for h in range(hq):
        kh = k[:, h // (hq // hkv)].double()
        for i in range(lq):
            visible = lk - lq + i + 1
            p = torch.softmax(kh[:visible] @ q[i, h].double() * scale, dim=0)
            out[:visible] += p
    return out


@pytest.mark.parametrize("lq, lk, hq, hkv", [(1, 9, 4, 2), (5, 5, 3, 3), (3, 11, 6, 1)])
def test_attention_mass_matches_loop(lq, lk, hq, hkv):
    g = torch.Generator().manual_seed(lq * 100 + lk)
    q = torch.randn(lq, hq, 8, generator=g)
    k = torch.randn(lk, hkv, 8, generator=g)
    got = attention_mass(q, k, 8**-0.5)
    torch.testing.assert_close(got.double(), dense_loop_mass(q, k, 8**-0.5))
    assert got.dtype == torch.float32
    assert abs(got.sum().item() - hq * lq) < 1e-4
    with pytest.raises(AssertionError):
        attention_mass(q, k[:, :, :4], 1.0)


def test_h2o_through_accumulator_evicts_least_attended_token():
    pool = TokenTablePool(8, B)
    acc = ScoreAccumulator(32, "sum")
    rt = EvictionRuntime(
        pool,
        create_policy("h2o", 4, {"recent_ratio": 0.25}),
        4,
        score_source=acc.scores,
    )
    rt.sync_new_tokens("a", np.array([20, 21, 22, 23, 4]))
    k = torch.zeros(5, 1, 2)
    k[:, 0, 0] = torch.tensor([3.0, 1.0, -4.0, 2.0, 0.0])
    q = torch.tensor([[[1.0, 0.0]]])  # one decode query, one head
    slots = torch.from_numpy(pool.live_slots("a"))
    acc.add(slots, attention_mass(q, k, 1.0))
    acc.finish_step(slots, 1, norm=1.0)
    assert rt.enforce_budget("a", 5).tolist() == [2]  # key 2 got the least mass
