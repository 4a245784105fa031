# SPDX-License-Identifier: Apache-2.0
"""Property tests: each policy's choice against a loop oracle of its paper's rule,
over random live sets, evictable masks, scores and budgets; and a multi-step
simulation of the eviction runtime for every policy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.vtoken.eviction import EvictionRuntime
from vllm.vtoken.policies import POLICIES, RequestView, create_policy
from vllm.vtoken.scores import ScoreAccumulator
from vllm.vtoken.seeding import request_rng
from vllm.vtoken.token_table import TokenTablePool


@st.composite
def requests(draw, scored=True):
    """A live set (sorted logical indices), which of them are evictable (all
    but the newest few), scores (ties likely), a budget below the live count."""
    n = draw(st.integers(2, 48))
    live = sorted(draw(st.sets(st.integers(0, 150), min_size=n, max_size=n)))
    protected_tail = draw(st.integers(1, n))
    evictable = np.arange(n) < n - protected_tail
    scores = None
    if scored:
        scores = np.array(
            draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)), np.float32
        )
    budget = draw(st.integers(1, n - 1))
    return np.array(live, dtype=np.int64), evictable, scores, budget


def view(live, evictable, scores=None, rid="r") -> RequestView:
    return RequestView(
        req_id=rid,
        live_idx=live,
        evictable=evictable,
        scores=scores,
        rng=request_rng(0, rid.encode()),
    )


def lowest_first(live, evictable, key, protected, num_evict):
    """Loop oracle of base.select_lowest: unprotected evictable tokens by key,
    then by age; protected evictable ones, oldest first, only if too few."""
    first = sorted(
        (key[i], live[i]) for i in range(live.size) if evictable[i] and not protected[i]
    )
    chosen = [t for _, t in first][:num_evict]
    rest = [live[i] for i in range(live.size) if evictable[i] and protected[i]]
    return sorted(chosen + rest[: num_evict - len(chosen)])


@settings(max_examples=300, deadline=None)
@given(requests(), st.sampled_from([0.0, 0.25, 0.5, 1.0]))
def test_h2o_evicts_the_lightest_outside_the_recent_window(req, recent_ratio):
    live, evictable, scores, budget = req
    policy = create_policy("h2o", budget, {"recent_ratio": recent_ratio})
    want = live.size - budget
    recent = np.arange(live.size) >= live.size - round(recent_ratio * budget)
    got = policy.evict_token(view(live, evictable, scores), want)
    assert sorted(got.tolist()) == lowest_first(live, evictable, scores, recent, want)
    # What H2O keeps outside the window weighs at least what it dropped there.
    dropped = np.isin(live, got)
    free = evictable & ~recent
    if (dropped & free).any() and (~dropped & free).any():
        assert scores[~dropped & free].min() >= scores[dropped & free].max()


@settings(max_examples=300, deadline=None)
@given(requests(scored=False), st.integers(0, 6))
def test_streamingllm_keeps_exactly_sinks_and_recent(req, num_sinks):
    live, evictable, _, budget = req
    if num_sinks >= budget:
        num_sinks = budget - 1
    policy = create_policy("streamingllm", budget, {"num_sinks": num_sinks})
    want = live.size - budget
    got = policy.evict_token(view(live, evictable), want)
    sinks = live < num_sinks
    assert sorted(got.tolist()) == lowest_first(live, evictable, live, sinks, want)
    if (evictable & ~sinks).sum() >= want:  # enough room: sinks + the newest
        kept = live[~np.isin(live, got)]
        newest = live[~sinks][-(budget - sinks.sum()) :] if budget > sinks.sum() else []
        assert set(kept.tolist()) == set(live[sinks].tolist()) | set(list(newest))


@pytest.mark.parametrize(("k", "draws"), [(6, 4000), (1, 6000)])
def test_random_is_uniform_over_the_evictable_tokens(k, draws):
    """k victims: the lowest of a draw per token; one (a decode step's): a
    draw of its position (RandomPolicy.evict_batch). Both uniform."""
    policy = create_policy("random", 8)
    live = np.arange(40)
    evictable = live < 30
    counts = np.zeros(40)
    for i in range(draws):
        got = policy.evict_token(view(live, evictable, rid=f"r{i}"), k)
        assert np.isin(got, live[evictable]).all() and np.unique(got).size == k
        counts[got] += 1
    assert counts[30:].sum() == 0
    # Each evictable token is drawn with probability p = k/30: at k = 6, 800
    # of 4,000 (sd ~25); at k = 1, 200 of 6,000 (sd ~14).
    p = k / 30
    assert np.abs(counts[:30] - draws * p).max() < 6 * np.sqrt(draws * p * (1 - p))
    assert (counts[:30] > 0).all()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(st.booleans(), min_size=1, max_size=3), min_size=1, max_size=30),
    st.integers(1, 40),
    st.integers(1, 40),
)
def test_scissorhands_matches_an_exact_windowed_count(steps, window, num_evict):
    """Steps adding 1-3 tokens each, every token always or never important:
    the exact count of unimportant steps in the last `window` is
    min(age, window) or 0, and the moving-average estimate must pick the same
    tokens (most unimportant first, ties oldest first)."""
    policy = create_policy(
        "scissorhands", 1, {"history_window": window, "recent_ratio": 0}
    )
    acc = ScoreAccumulator("persistence", window=window)
    rv = view(np.zeros(0, np.int64), np.zeros(0, bool), rid="s")
    important, birth = [], []
    for s, new in enumerate(steps):
        policy.sync_new_tokens(rv, len(new))  # one call per step, as the engine
        important += new
        birth += [s] * len(new)
        k = len(important)  # the step's read: every token so far, one query
        acc.begin_step(k)
        acc.add(torch.arange(k), torch.tensor(important, dtype=torch.float32))
        acc.finish_step(["s"], np.array([0, k]), np.arange(k), [0, 1], 1.0)
    n = len(important)
    age = len(steps) - np.array(birth)  # folds seen, its birth step's included
    exact = np.where(important, 0, np.minimum(age, window))
    never = int(np.count_nonzero(~np.array(important)))
    num_evict = min(num_evict, n, max(never, 1))
    live = np.arange(n)
    scores = acc.scores("s", live)
    got = policy.evict_token(view(live, np.ones(n, bool), scores, "s"), num_evict)
    order = sorted(range(n), key=lambda i: (-exact[i], i))
    if never >= num_evict:  # (among always-important ones, ~0 is float noise)
        assert sorted(got.tolist()) == sorted(order[:num_evict])


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(sorted(POLICIES)),
    st.integers(8, 40),
    st.lists(st.integers(1, 12), min_size=1, max_size=25),
    st.integers(0, 2**31),
)
def test_the_runtime_holds_every_policy_to_its_budget(name, budget, growth, seed):
    """Many steps of one request: tokens arrive, the runtime enforces the
    budget (every attended token but the newest is evictable). After each
    step: live == min(tokens, budget), the newest token lives, the dead stay
    dead, and the Token Table's dead set is the union of what died."""
    rng = np.random.default_rng(seed)
    pool = TokenTablePool(4096, 16)

    def source(rid, idx):
        return rng.random(idx.size).astype(np.float32)

    knobs = {"window": budget // 2} if name == "snapkv" else {}  # < budget
    policy = create_policy(name, budget, knobs)
    rt = EvictionRuntime(pool, policy, budget, score_source=source)
    total, dead = 0, set()
    for n in growth:
        rt.sync_new_tokens("a", np.arange(total, total + n) + 1000)
        total += n
        died = set(rt.enforce_budget("a", total).tolist())
        assert not dead & died
        dead |= died
        live = pool.live_idx("a")
        assert live.size == min(total, budget)
        assert live[-1] == total - 1
        assert set(pool.dead_idx("a").tolist()) == dead
    pool.check_integrity()
