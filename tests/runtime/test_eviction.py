# SPDX-License-Identifier: Apache-2.0
"""EvictionRuntime (budget enforcement) and ScoreAccumulator (per-request scores)."""

import numpy as np
import pytest
import torch

from vllm.vtoken.eviction import EvictionRuntime
from vllm.vtoken.policies import EvictionPolicy, create_policy
from vllm.vtoken.request_args import RequestEviction
from vllm.vtoken.scores import ScoreAccumulator
from vllm.vtoken.seeding import request_rng, request_seed
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


def test_the_batch_path_checks_a_plug_ins_answer_too():
    rt = make_runtime(Liar(2), budget=2)
    for rid in "ab":
        rt.sync_new_tokens(rid, np.arange(6) + (0 if rid == "a" else 6))
    with pytest.raises(RuntimeError, match="broke its contract"):
        rt.enforce_budgets(["a", "b"], np.array([6, 6]))
    assert rt.pool.num_live("a") == rt.pool.num_live("b") == 6


def test_a_plug_in_s_negative_index_is_refused_not_another_request_s_token():
    """A negative index of request b keyed request a's token `width + idx`,
    live and evictable, so the check passed and the kill wrote outside b's
    region (a's token died, b's count fell; found by review)."""

    class OffByOne(EvictionPolicy):  # a plug-in: the runtime checks it
        name = "off_by_one"

        def evict_batch(self, batch, num_evict):
            return np.array([12, 2]), np.r_[batch.live_idx[:12], 0, -2]

    rt = make_runtime(OffByOne(4), budget=4)
    rt.sync_new_tokens("a", np.arange(16))  # its row: as wide as the check's key
    rt.sync_new_tokens("b", np.arange(16, 22))
    with pytest.raises(RuntimeError, match="broke its contract"):
        rt.enforce_budgets(["a", "b"], np.array([16, 6]))
    assert rt.pool.num_live("a") == 16 and rt.pool.num_live("b") == 6
    rt.pool.check_integrity()


def test_the_batch_path_evicts_what_the_per_request_path_does():
    one, batch = (make_runtime(Recorder(4), budget=4) for _ in range(2))
    for rt in (one, batch):
        for k, rid in enumerate("abc"):
            rt.sync_new_tokens(rid, np.arange(10) + 10 * k)
    want = {rid: one.enforce_budget(rid, 8).tolist() for rid in "abc"}
    which, counts, idx = batch.enforce_budgets(list("abc"), np.array([8, 8, 8]))
    runs = np.split(idx, np.cumsum(counts)[:-1])
    got = dict(zip(["abc"[i] for i in which], runs, strict=True))
    assert {r: v.tolist() for r, v in got.items()} == want
    batch.pool.check_integrity()


def test_a_batch_of_several_policies_evicts_what_each_request_would_alone():
    # Requests pick their own policy (patch 0090's extra_args): the batch is
    # evicted one group per policy, and the groups' answers are merged back
    # into the batch's order. Interleaved here: a, c, e on the engine's
    # StreamingLLM, b and f on Random, d opted out (never over budget).
    picks = {
        "b": RequestEviction("random", 3),
        "d": RequestEviction("none", None),
        "f": RequestEviction("random", 3),
    }
    one, batch = (make_runtime(create_policy("streamingllm", 6), 6) for _ in range(2))
    for rt in (one, batch):
        for k, rid in enumerate("abcdef"):
            rt.sync_new_tokens(rid, np.arange(9) + 9 * k, evict=picks.get(rid))
    want = {rid: one.enforce_budget(rid, 9).tolist() for rid in "abcdef"}
    which, counts, idx = batch.enforce_budgets(list("abcdef"), np.full(6, 9))
    assert which.tolist() == [0, 1, 2, 4, 5]  # ascending, d left out
    runs = np.split(idx, np.cumsum(counts)[:-1])
    got = {"abcdef"[i]: run.tolist() for i, run in zip(which, runs, strict=True)}
    assert got == {rid: v for rid, v in want.items() if v}
    assert len(want["a"]) == 3 and len(want["b"]) == 6 and want["d"] == []
    # Random's rows take victims out of their live lists at once; the rest
    # keep them listed a while, as the worker's tables for the same requests.
    keep = batch.pool._a.cols["keep_dead"][batch.pool.rows(list("abcdef"))]
    assert keep.tolist() == [1, 0, 1, 1, 1, 0]
    assert [
        (picks.get(r) or RequestEviction("streamingllm", 6)).keeps_dead_listed
        for r in "abcdef"
    ] == keep.astype(bool).tolist()
    batch.pool.check_integrity()


class BatchRecorder(Recorder):
    """Records each sync_batch call as it comes (ids, new tokens each)."""

    def _validate(self) -> None:
        super()._validate()
        self.batches: list[tuple[list[str], list[int]]] = []

    def sync_batch(self, req_ids, num_new, view=None):
        self.batches.append((list(req_ids), np.asarray(num_new).tolist()))


def test_a_repeated_batch_tells_each_policy_of_its_own_new_tokens():
    # sync_rows groups a batch by policy once and reuses the groups while the
    # next steps repeat the batch: each step still tells a policy of exactly
    # its requests that brought tokens (b opted out, c bringing none once).
    rt = make_runtime(BatchRecorder(8), budget=8)
    for k, rid in enumerate("abc"):
        evict = RequestEviction("none", None) if rid == "b" else None
        rt.sync_new_tokens(rid, np.array([40 * k]), evict=evict)
    rt.policy.batches.clear()
    rows, slot = rt.pool.rows(list("abc")), iter(range(1, 99))
    for counts in ([2, 2, 2], [1, 1, 0], [1, 1, 1]):
        slots = [40 * k + next(slot) for k, n in enumerate(counts) for _ in range(n)]
        rt.sync_rows(list("abc"), np.array(counts), np.array(slots), rows)
    want = [(["a", "c"], [2, 2]), (["a"], [1]), (["a", "c"], [1, 1])]
    assert rt.policy.batches == want
    assert rt.pool.num_tokens("c") == 4 and rt.pool.num_tokens("b") == 5
    rt.pool.check_integrity()


def test_score_policies_read_scores_of_live_tokens():
    seen = {}

    def source(rid, idx):
        seen[rid] = idx.tolist()
        return np.where(idx == 1, 0.0, 1.0 + idx / 100).astype(np.float32)

    rt = make_runtime(
        create_policy("h2o", 4, {"recent_ratio": 0.25}), 4, score_source=source
    )
    rt.sync_new_tokens("a", np.array([9, 13, 10, 30, 31, 12]))
    rt.pool.evict("a", np.array([2]))
    out = rt.enforce_budget("a", 6)
    assert seen == {"a": [0, 1, 3, 4, 5]}  # by logical token, not by slot
    assert out.tolist() == [1]  # token 1 scored lowest
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


class Drawer(Recorder):
    """A plug-in drawing its victims from the request's generator."""

    def evict_token(self, req, num_evict):
        ok = req.live_idx[req.evictable]
        return np.sort(req.rng.choice(ok, min(num_evict, ok.size), replace=False))


def test_a_request_s_generator_is_built_only_when_a_policy_reads_it():
    # Built-ins draw from the seed alone: registering builds no generator
    # (NumPy's seeding was ~15 µs of each request's registration).
    rt = make_runtime(create_policy("random", 3), 3, seed=7)
    rt.sync_new_tokens("x", np.arange(8), rng_key=b"prompt")
    rt.enforce_budget("x", 8)
    state = rt._reqs["x"]
    assert state._rng is None
    assert state.seed == request_seed(7, b"prompt") != request_seed(8, b"prompt")
    assert 0 <= state.seed < 1 << 63
    # A plug-in that reads it gets the generator of (seed, key), unused.
    rt = make_runtime(Drawer(3), 3, seed=7)
    rt.sync_new_tokens("x", np.arange(8), rng_key=b"prompt")
    got = rt.enforce_budget("x", 8)
    want = request_rng(7, b"prompt").choice(np.arange(7), 5, replace=False)
    assert got.tolist() == np.sort(want).tolist()


# ---------------------------------------------------------------- scores
def fold(acc, per_req: dict, masses, norm=1.0, num_queries=None):
    """One step through the accumulator: per_req {rid: logical idx of its
    keys}, masses a list of per-layer float lists in that read order."""
    rids = list(per_req)
    indptr = np.r_[0, np.cumsum([len(v) for v in per_req.values()])]
    idx = np.concatenate([np.asarray(v, dtype=np.int64) for v in per_req.values()])
    acc.begin_step(int(indptr[-1]))
    for mass in masses:
        acc.add(torch.arange(int(indptr[-1])), torch.tensor(mass))
    nq = np.ones(len(rids), np.int64) if num_queries is None else num_queries
    acc.finish_step(rids, indptr, idx, np.r_[0, np.cumsum(nq)], norm)


def test_sum_mode_accumulates_normalized_mass_per_request_and_token():
    acc = ScoreAccumulator("sum")
    # Request a reads its tokens 3, 7, 9 over two layers.
    fold(acc, {"a": [3, 7, 9]}, [[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]], norm=4.0)
    out = acc.scores("a", np.array([3, 7, 9, 0, 40]))
    assert out.dtype == np.float32 and out.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert acc.scores("b", np.array([3])).tolist() == [0.0]  # never read


def test_requests_reading_the_same_slots_score_apart():
    """Two requests sharing prefix-cache blocks read the same KV slots; each
    token's score is its own request's (a per-slot score mixed them)."""
    acc = ScoreAccumulator("sum")
    fold(
        acc, {"a": [0, 1, 2], "b": [0, 1, 2, 3]}, [[3.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]]
    )
    assert acc.scores("a", np.arange(3)).tolist() == [3.0, 0.0, 0.0]
    assert acc.scores("b", np.arange(4)).tolist() == [1.0, 1.0, 1.0, 1.0]
    acc.release("a")
    assert acc.scores("a", np.arange(3)).tolist() == [0.0, 0.0, 0.0]
    assert acc.scores("b", np.arange(4)).tolist() == [1.0, 1.0, 1.0, 1.0]


def test_persistence_counts_steps_at_or_above_uniform_attention():
    acc = ScoreAccumulator("persistence")
    keys = {"a": [1, 2, 3, 4]}
    # norm 2, 1 query, 4 keys: important iff mass / 2 >= 1/4, i.e. mass >= 0.5.
    for mass in ([0.5, 0.49, 1.0, 0.01], [0.1, 0.6, 1.2, 0.1]):
        fold(acc, keys, [mass], norm=2.0)
    assert acc.scores("a", np.array([1, 2, 3, 4])).tolist() == [1.0, 1.0, 2.0, 0.0]
    # Per-request query and key counts: a 2-query prefill over 3 keys, then a
    # decode over 3. The prefill's key 2 is seen by its last row only (3
    # keys): uniform gives it 1/3; keys 0 and 1 by both rows: 1/2 + 1/3.
    # Norm 2: 1.6 >= 2 * 5/6 is False, 1.7 is True; 0.7 >= 2/3 is True.
    # The decode: 0.3 * 3 >= 2 * 1 is False.
    fold(
        acc,
        {"p": [0, 1, 2], "d": [0, 1, 2]},
        [[1.6, 1.7, 0.7] + [0.3] * 3],
        2.0,
        [2, 1],
    )
    assert acc.scores("p", np.arange(3)).tolist() == [0.0, 1.0, 1.0]
    assert acc.scores("d", np.arange(3)).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(AssertionError):
        ScoreAccumulator("max")
    with pytest.raises(AssertionError):
        fold(acc, keys, [[0.0] * 4], norm=0.0)


def test_max_aggregate_keeps_the_largest_mass_one_head_of_one_layer_gave():
    acc = ScoreAccumulator("sum", aggregate="max")
    # Two layers; norm (layers * heads) does not apply to a max.
    fold(acc, {"a": [0, 1, 2]}, [[0.9, 0.1, 0.0], [0.2, 0.7, 0.1]], norm=8.0)
    fold(acc, {"a": [0, 1, 2]}, [[0.5, 0.0, 0.0]], norm=8.0)
    np.testing.assert_allclose(acc.scores("a", np.arange(3)), [1.4, 0.7, 0.1])
    with pytest.raises(AssertionError):
        ScoreAccumulator("sum", aggregate="median")


def test_windowed_persistence_is_a_moving_average_of_importance():
    acc = ScoreAccumulator("persistence", window=4)
    # norm 1, 1 query, 2 keys: important iff mass >= 0.5.
    steps = ([1, 0], [1, 0], [1, 1], [0, 1], [0, 1])
    for important in steps:
        fold(acc, {"a": [0, 1]}, [[float(x) for x in important]])
    ema = np.zeros(2)
    for important in steps:
        ema += (np.array(important) - ema) / 4
    np.testing.assert_allclose(acc.scores("a", np.arange(2)), ema, rtol=1e-6)
    with pytest.raises(AssertionError):
        ScoreAccumulator("persistence", window=0)
    with pytest.raises(AssertionError):
        ScoreAccumulator("sum", window=4)


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
    acc = ScoreAccumulator("sum")
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
    fold(acc, {"a": pool.live_idx("a")}, [attention_mass(q, k, 1.0).tolist()])
    assert rt.enforce_budget("a", 5).tolist() == [2]  # key 2 got the least mass


def test_scores_read_before_anything_was_scored_are_zero():
    from vllm.vtoken.scores import ScoreAccumulator

    acc = ScoreAccumulator("sum")
    assert acc.scores_rows(["a"], np.array([0, 1]), np.array([0, 0])).tolist() == [0, 0]


def test_scores_cross_as_one_step_and_fold_on_the_scheduler():
    """The worker sends a step's gains (ScoreStep), the scheduler folds them:
    the same scores as folding in place, a message the size of one step (not
    of the history), and nothing folded back for a request already gone."""
    import pickle

    import torch

    from vllm.vtoken.scores import ScoreAccumulator

    worker, sched, ref = (ScoreAccumulator("sum") for _ in range(3))
    sizes = []
    for t in range(4):
        keys = np.r_[np.arange(3 + t), np.arange(2 + t)]  # a, b grow by one
        indptr = np.array([0, 3 + t, 5 + 2 * t])
        mass = torch.rand(keys.size, generator=torch.Generator().manual_seed(t))
        for acc in (worker, ref):
            acc.begin_step(keys.size)
            acc.add(torch.arange(keys.size), mass)
        step = worker.take_step(["a", "b"], indptr, keys, np.array([0, 1, 2]), 2.0)
        ref.finish_step(["a", "b"], indptr, keys, [0, 1, 2], 2.0)
        sched.fold(step, known={"a": 0, "b": 0})
        sizes.append(len(pickle.dumps(step)))
    for rid in "ab":
        idx = np.arange(7)
        np.testing.assert_array_equal(sched.scores(rid, idx), ref.scores(rid, idx))
    assert sizes[-1] - sizes[0] < 200  # a step's worth: 2 more keys a step
    sched.release("b")
    sched.fold(step, known={"a": 0})  # "b" finished meanwhile
    assert sched.scores("b", np.arange(3)).tolist() == [0, 0, 0]
