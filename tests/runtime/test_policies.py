# SPDX-License-Identifier: Apache-2.0
"""Eviction policies: protected tokens, budgets, determinism, knobs, size."""

import pathlib

import numpy as np
import pytest
import torch

from vllm.vtoken.policies import POLICIES, EvictionPolicy, RequestView, create_policy
from vllm.vtoken.scores import ScoreAccumulator
from vllm.vtoken.seeding import request_rng

POLICY_DIR = (
    pathlib.Path(__file__).resolve().parents[2] / "vllm_overlay/vllm/vtoken/policies"
)


def view(live_idx, evictable=None, scores=None, rid="r", seed=0) -> RequestView:
    live_idx = np.asarray(live_idx, dtype=np.int64)
    if evictable is None:
        evictable = np.ones(live_idx.size, dtype=bool)
    if scores is not None:
        scores = np.asarray(scores, dtype=np.float32)
    return RequestView(
        req_id=rid,
        live_idx=live_idx,
        evictable=np.asarray(evictable),
        scores=scores,
        rng=request_rng(seed, rid.encode()),
    )


def test_registry_and_factory():
    # The five built-ins, and the test plug-in from its entry point.
    assert sorted(POLICIES) == [
        "h2o",
        "oldest",
        "random",
        "scissorhands",
        "snapkv",
        "streamingllm",
    ]
    assert POLICIES["oldest"].__module__ == "vtoken_oldest"
    assert create_policy("streamingllm", 64, {"num_sinks": 2}).num_sinks == 2
    assert create_policy("h2o", 10).recent == 5
    assert POLICIES["h2o"].score_mode == "sum"
    assert POLICIES["scissorhands"].score_mode == "persistence"
    assert POLICIES["random"].score_mode is None
    with pytest.raises(ValueError, match="h2o, oldest, random, scissorhands"):
        create_policy("lru", 10)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("budget", [0, -3, 1.5, True, "8"])
def test_bad_budget_raises(name, budget):
    with pytest.raises(ValueError, match="budget"):
        create_policy(name, budget)


@pytest.mark.parametrize(
    "name, knobs, match",
    [
        ("h2o", {"recent_ratio": 1.5}, "recent_ratio"),
        ("h2o", {"recent_ratio": "half"}, "recent_ratio"),
        ("h2o", {"heavy_ratio": 0.5}, r"unknown knob.*\['heavy_ratio'\].*recent_ratio"),
        ("streamingllm", {"num_sinks": -1}, "num_sinks"),
        ("streamingllm", {"num_sinks": 16}, "must be < budget"),
        ("streamingllm", {"num_sinks": 2.0}, "num_sinks"),
        ("scissorhands", {"history_window": 0}, "history_window"),
        ("scissorhands", {"recent_ratio": -0.1}, "recent_ratio"),
        ("random", {"p": 1}, "valid knobs: none"),
        # Past int32 they overflowed the step's arrays mid-step, ending the
        # engine core (found by review).
        ("scissorhands", {"history_window": 2**70}, r"in \[1, 2147483647\]"),
        ("snapkv", {"window": 2**31}, r"window must be in \[1, 2147483647\]"),
        ("snapkv", {"window": 8, "kernel_size": 2**31 + 1}, "kernel_size must be"),
        ("streamingllm", {"num_sinks": 2**63}, "num_sinks must be in"),
        # The window is kept whole, so it must leave room for the prompt's
        # top tokens (the reference asserts so); it was a sliding window.
        ("snapkv", {}, r"window \(32\) must be < budget \(16\)"),
        ("snapkv", {"window": 16}, r"window \(16\) must be < budget \(16\)"),
    ],
)
def test_bad_knobs_raise(name, knobs, match):
    with pytest.raises(ValueError, match=match):
        create_policy(name, 16, knobs)


def test_h2o_evicts_lowest_scores_outside_the_recent_window():
    policy = create_policy("h2o", 8, {"recent_ratio": 0.5})  # 4 recent tokens
    idx = np.array([0, 2, 3, 5, 6, 7, 8, 9, 10, 11])
    scores = [5.0, 0.1, 3.0, 0.2, 9.0, 0.3, 0.0, 0.0, 0.0, 0.0]
    out = policy.evict_token(view(idx, scores=scores), 2)
    assert sorted(out.tolist()) == [2, 5]
    # Ties go to the oldest; protected (not evictable) tokens are skipped.
    evictable = np.ones(10, bool)
    evictable[1] = False
    out = policy.evict_token(view(idx, evictable, [1.0] * 10), 3)
    assert sorted(out.tolist()) == [0, 3, 5]


def test_h2o_needs_scores():
    with pytest.raises(ValueError, match="scores"):
        create_policy("h2o", 4).evict_token(view(np.arange(6)), 2)


def test_streamingllm_keeps_sinks_and_most_recent():
    policy = create_policy("streamingllm", 10, {"num_sinks": 4})
    idx = np.arange(20)
    out = policy.evict_token(view(idx), 10)
    kept = np.setdiff1d(idx, out)
    assert kept.tolist() == [0, 1, 2, 3, 14, 15, 16, 17, 18, 19]
    # Sinks are by logical position: a live set without token 1 keeps 0, 2, 3.
    idx = np.array([0, 2, 3, 5, 6, 7, 8])
    assert sorted(policy.evict_token(view(idx), 2).tolist()) == [5, 6]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_honours_the_evictable_mask_and_count(name):
    policy = create_policy(name, 8, {"window": 4} if name == "snapkv" else {})
    idx = np.arange(0, 40, 2)
    evictable = idx < 30  # 15 evictable tokens, the newest 5 protected
    rid = "req-1"
    if policy.score_mode == "persistence":
        policy.sync_new_tokens(view(np.zeros(0), rid=rid), 40)
    scores = np.linspace(1, 0, idx.size)
    out = policy.evict_token(view(idx, evictable, scores, rid=rid), 7)
    assert out.size == 7 and np.unique(out).size == 7
    assert np.isin(out, idx[evictable]).all()
    # Fewer evictable tokens than asked: all of them.
    out = policy.evict_token(view(idx, evictable, scores, rid=rid), 18)
    assert sorted(out.tolist()) == idx[evictable].tolist()


def test_random_is_deterministic_per_seed_and_request():
    policy = create_policy("random", 4)
    idx = np.arange(100)

    def draw(rid: str, seed: int) -> np.ndarray:
        return policy.evict_token(view(idx, rid=rid, seed=seed), 30)

    a = draw("x", 0)
    assert a.tolist() == draw("x", 0).tolist()
    assert a.tolist() != draw("x", 1).tolist()
    assert a.tolist() != draw("y", 0).tolist()
    assert np.unique(a).size == 30 and a.tolist() == sorted(a.tolist())


def ema_of_rates(important, age, window):
    """The worker's windowed score of a token important `important` times in
    `age` steps at a steady rate: rate * (1 - (1 - 1/w)^age)."""
    age = np.asarray(age, dtype=np.float64)
    return np.asarray(important) / age * (1 - (1 - 1 / window) ** age)


def test_scissorhands_evicts_the_persistently_unimportant():
    policy = create_policy("scissorhands", 8, {"recent_ratio": 0.25})  # 2 recent
    v = view(np.zeros(0), rid="s")
    policy.sync_new_tokens(v, 6)  # step 1: prompt 0..5
    for _ in range(4):  # steps 2..5: tokens 6..9, one per step
        policy.sync_new_tokens(v, 1)
    idx = np.arange(10)
    # Ages (steps attended): 0-5 -> 5, 6 -> 4, 7 -> 3, 8 -> 2, 9 -> 1.
    age = [5] * 6 + [4, 3, 2, 1]
    important = [5, 0, 4, 1, 5, 2, 0, 3, 0, 0]
    scores = ema_of_rates(important, age, 400)
    out = policy.evict_token(view(idx, scores=scores, rid="s"), 3)
    # Unimportant counts: 1 -> 5, 6 -> 4, 3 -> 4, 5 -> 3 ...; 8, 9 are recent.
    assert sorted(out.tolist()) == [1, 3, 6]
    # A 2-step window caps the counts at 2: 1, 6 and the young 8 (never
    # important) reach it; 3 (2 * 4/5 = 1.6) is spared this time.
    short = create_policy("scissorhands", 8, {"history_window": 2, "recent_ratio": 0})
    short.sync_new_tokens(v, 6)
    for _ in range(4):
        short.sync_new_tokens(v, 1)
    scores = ema_of_rates(important, age, 2)
    out = short.evict_token(view(idx, scores=scores, rid="s"), 3)
    assert sorted(out.tolist()) == [1, 6, 8]
    policy.release("s")
    with pytest.raises(KeyError):
        policy.evict_token(view(idx, scores=scores, rid="s"), 1)


def scissorhands_run(policy, rid, steps, importance, acc=None):
    """`steps` decode steps of one request through the worker's real score
    fold: importance(step) -> bool [n] for the tokens [0, n) of that step."""
    acc = acc or ScoreAccumulator("persistence", window=policy.score_window)
    v = view(np.zeros(0), rid=rid)
    for step in range(steps):
        policy.sync_new_tokens(v, 1)
        imp = np.asarray(importance(step), dtype=np.float32)
        acc.begin_step(imp.size)
        acc.add(torch.arange(imp.size), torch.from_numpy(imp))  # 1 query, norm 1
        acc.finish_step(
            [rid], np.array([0, imp.size]), np.arange(imp.size), [0, 1], 1.0
        )
    return acc


def test_scissorhands_forgets_importance_older_than_its_window():
    """Token 0 was important for its first 1,500 steps, never after; token 1
    on 60% of the steps, lately too. Over the last 400 steps token 0 is the
    unimportant one (a lifetime rate, 0.75 against 0.6, kept it)."""
    policy = create_policy("scissorhands", 8, {"recent_ratio": 0})
    acc = scissorhands_run(
        policy, "w", 2000, lambda s: [s < 1500, s % 5 < 3] + [True] * (s - 1)
    )
    scores = acc.scores("w", np.arange(2))
    out = policy.evict_token(view([0, 1], scores=scores, rid="w"), 1)
    assert out.tolist() == [0]


def test_scissorhands_restarts_ages_with_the_scores_after_a_preemption():
    """Preempted at step 100: its slots, and with them its scores, start over.
    Since the resume token 0 was important at every step, token 103 (3 steps
    old) never: 103 goes. Counting token 0's age from its birth would read its
    rate as 6 / 106 and evict it first (oldest first until counts rebuild)."""
    policy = create_policy("scissorhands", 8, {"recent_ratio": 0})
    acc = scissorhands_run(policy, "p", 100, lambda s: [True] * (s + 1))
    policy.reset_scores("p")  # VTokenScheduler.on_preempt
    acc.release("p")  # the worker, as the request resumes
    scissorhands_run(policy, "p", 6, lambda s: [True] + [False] * (100 + s), acc)
    idx = np.array([0, 103])
    out = policy.evict_token(view(idx, scores=acc.scores("p", idx), rid="p"), 1)
    assert out.tolist() == [103]


def test_scissorhands_counts_a_resumed_request_from_its_first_step_back():
    """After the restart, a token's age counts the steps its scores have seen
    since the resume, not one more. Token 0 was unimportant at the first step
    back, token 100 (new that step) at the fourth: 100's miss weighs more (the
    average forgets older steps), so 100 goes. Counting one step too many
    read a further miss into token 0's rate and evicted it."""
    policy = create_policy("scissorhands", 8, {"recent_ratio": 0})
    acc = scissorhands_run(policy, "p", 100, lambda s: [True] * (s + 1))
    policy.reset_scores("p")  # VTokenScheduler.on_preempt
    acc.release("p")  # the worker, as the request resumes
    scissorhands_run(
        policy, "p", 6, lambda s: [s != 0] + [True] * 99 + [s != 3] + [True] * s, acc
    )
    idx = np.array([0, 100])
    out = policy.evict_token(view(idx, scores=acc.scores("p", idx), rid="p"), 1)
    assert out.tolist() == [100]


@pytest.mark.parametrize(
    "module",
    ["h2o.py", "streaming_llm.py", "scissorhands.py", "snapkv.py", "random_policy.py"],
)
def test_each_adapter_is_under_50_lines(module):
    lines = (POLICY_DIR / module).read_text().splitlines()
    code = [ln for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    assert len(code) < 50, f"{module}: {len(code)} non-blank, non-comment lines"


def test_score_policies_take_an_aggregate_knob():
    for name in ("h2o", "scissorhands"):
        assert create_policy(name, 8).score_aggregate == "mean"
        assert create_policy(name, 8, {"aggregate": "max"}).score_aggregate == "max"
        with pytest.raises(
            ValueError, match=r"aggregate must be one of \['mean', 'max'\]"
        ):
            create_policy(name, 8, {"aggregate": "median"})
    with pytest.raises(ValueError, match="unknown knob"):  # no scores to reduce
        create_policy("streamingllm", 8, {"aggregate": "max"})


def test_snapkv_pools_the_window_scores_at_its_first_eviction():
    policy = create_policy("snapkv", 8, {"window": 2, "kernel_size": 3})
    assert policy.score_mode == "window" and policy.score_query_window == 2
    idx = np.arange(12)
    # The observation window looked at token 5 only. Pooled (avg, width 3),
    # 4, 5 and 6 share its weight; the window (10, 11) is kept anyway.
    scores = np.zeros(12, np.float32)
    scores[5] = 3.0
    out = policy.evict_token(view(idx, scores=scores, rid="k"), 4)
    assert sorted(out.tolist()) == [0, 1, 2, 3]  # oldest of the zero-scored
    out = policy.evict_token(view(idx, scores=scores, rid="k"), 9)
    # Decode (not pooled again): H2O's rule, so 4 and 6 go, 5 stays.
    assert 5 not in out.tolist() and {4, 6} <= set(out.tolist())
    policy.release("k")
    out = create_policy("snapkv", 8, {"window": 2, "kernel_size": 1}).evict_token(
        view(idx, scores=scores, rid="k"), 9
    )
    assert sorted(out.tolist()) == [0, 1, 2, 3, 4, 6, 7, 8, 9]  # no pooling
    for bad in ({"kernel_size": 4}, {"pooling": "median"}, {"window": 0}):
        with pytest.raises(ValueError):
            create_policy("snapkv", 8, bad)


def test_snapkv_pools_the_prefix_votes_only():
    """The window's votes for itself stay out of the prefix's pools, as the
    reference pools attn[..., -w:, :-w] zero-padded: tokens 34 and 35, with
    no vote, sit next to the window and were kept over heavier ones."""
    n, window, kernel = 40, 4, 5
    scores = np.full(n, 0.5, np.float32)
    scores[n - window :] = 50.0  # the window attends to itself
    scores[n - 6 : n - 4] = 0.0  # the two prefix tokens next to it: no vote
    scores[:8] = 1.0
    policy = create_policy("snapkv", 12, {"window": window, "kernel_size": kernel})
    out = policy.evict_token(view(np.arange(n), scores=scores, rid="p"), n - 12)
    kept = sorted(set(range(n)) - set(out.tolist()))
    # The reference: avg pool of the prefix with zero padding, top 8 + window.
    pad = np.r_[np.zeros(kernel // 2), scores[: n - window], np.zeros(kernel // 2)]
    pooled = np.convolve(pad, np.ones(kernel) / kernel, "valid")
    top = np.argsort(-pooled, kind="stable")[: 12 - window]
    assert kept == sorted([*top.tolist(), *range(n - window, n)])
    assert 34 not in kept and 35 not in kept


@pytest.mark.parametrize("how", ["avg", "max"])
def test_snapkv_pools_a_wide_kernel_as_its_shifts_would(how, monkeypatch):
    """Past _SHIFTS, pooling takes prefix sums (avg) or a doubling table
    (max), not a pass per shift: the same windows, within each request (a
    kernel of 2049 took 0.33 s at 32 x 1,024 tokens one pass per shift, and
    2**31 - 1 would have hung the step; found by review)."""
    from types import SimpleNamespace

    from vllm.vtoken.policies import selection

    rng = np.random.default_rng(3)
    lens = np.array([1, 40, 7, 90, 33])
    batch = SimpleNamespace(seg=np.repeat(np.arange(lens.size), lens))
    key = rng.random(lens.sum())
    for kernel in (35, 61, 181, 2**31 - 1):
        wide = selection.pool_along(batch, key, kernel, how)
        monkeypatch.setattr(selection, "_SHIFTS", 1 << 20)  # one pass a shift
        shifts = selection.pool_along(batch, key, min(kernel, 181), how)
        monkeypatch.undo()
        if how == "avg":
            shifts = shifts * min(kernel, 181) / kernel
        np.testing.assert_allclose(wide, shifts, rtol=1e-12)
    big = SimpleNamespace(seg=np.repeat(np.arange(32), 1024))
    selection.pool_along(big, rng.random(32 * 1024), 2**31 - 1, how)  # at once


def test_snapkv_pooling_a_kernel_wider_than_the_batch_is_one_pass_per_token():
    """A kernel far wider than the tokens pools as one as wide as them (its
    shifts past them reach nothing): it looped once per shift, 200,001 shifts
    took 1.8 s for 12 tokens, and 2**31 hung the engine core."""
    from types import SimpleNamespace

    from vllm.vtoken.policies import selection

    batch = SimpleNamespace(seg=np.zeros(12, np.int64))  # one request
    key = np.arange(12, dtype=np.float64)
    for how in ("avg", "max"):
        wide = selection.pool_along(batch, key, 2**31 + 1, how)
        fit = selection.pool_along(batch, key, 25, how)  # as wide as 12 tokens
        if how == "avg":
            np.testing.assert_allclose(wide * (2**31 + 1), fit * 25)
        else:
            np.testing.assert_array_equal(wide, fit)


@pytest.mark.parametrize(
    "attrs, message",
    [
        ({"score_mode": "mass"}, "score_mode must be None or one of"),
        ({"score_mode": "window"}, "score_mode 'window' needs score_query_window"),
        ({"score_mode": "sum", "score_window": 8}, "score_window is for score_mode"),
        ({"score_query_window": 4}, "score_query_window is for score_mode 'window'"),
        (
            {"score_mode": "persistence", "score_window": 0},
            "score_window must be an integer >= 1",
        ),
        (
            {"score_mode": "window", "score_query_window": 2.0},
            "score_query_window must be an",
        ),
    ],
)
def test_a_policys_score_attributes_are_checked_against_its_mode(attrs, message):
    """A plug-in's score attributes fail when the policy is built (start-up),
    not in the worker's first scored step."""

    class Bad(EvictionPolicy):
        name = "bad"

        def evict_token(self, req, num_evict):
            return req.live_idx[:num_evict]

    for attr, value in attrs.items():
        setattr(Bad, attr, value)
    with pytest.raises(ValueError, match=f"bad: {message}"):
        Bad(8)


def test_a_broken_plugin_entry_point_is_named(monkeypatch):
    """A plug-in that does not load fails only when chosen, naming the entry
    point and why: `import vllm` imports this package, vToken on or off."""
    import importlib.metadata as md

    import vllm.vtoken.policies as policies

    def declare(name, value):
        ep = md.EntryPoint(name, value, policies.ENTRY_POINT_GROUP)
        monkeypatch.setattr(md, "entry_points", lambda group: [ep])
        policies._register_plugins()  # at import: logs, does not raise

    monkeypatch.setattr(policies, "BROKEN", {})
    declare("gone", "no_such_module:Policy")
    with pytest.raises(
        ValueError,
        match="'gone' is unavailable: .*gone = no_such_module:Policy "
        "failed to load: ModuleNotFoundError",
    ):
        create_policy("gone", 8)
    assert create_policy("h2o", 8).name == "h2o"  # the others are unharmed
    declare("x", "numpy:ndarray")
    with pytest.raises(ValueError, match="x = numpy:ndarray is not an EvictionPolicy"):
        create_policy("x", 8)
    declare("other", "vtoken_oldest:OldestFirstPolicy")
    with pytest.raises(ValueError, match="other names a policy called 'oldest'"):
        create_policy("other", 8)
    declare("oldest", "vtoken_oldest:OldestFirstPolicy")  # registered already
    assert create_policy("oldest", 8).name == "oldest"


def test_a_plugin_cannot_take_or_break_a_registered_name(monkeypatch):
    """A plug-in named like a built-in policy, or whose module registered it
    and then failed, leaves the registry as it was: `import vllm` goes on,
    the built-in keeps its name, and the failed one is refused when chosen."""
    import importlib.metadata as md
    import sys
    import types

    import vllm.vtoken.policies as policies

    H2O = policies.POLICIES["h2o"]

    class Rival(H2O):
        name = "h2o"

    class Half(H2O):
        name = "half"

    def half_then_fail():
        policies.register_policy(Half)
        raise ImportError("half-imported")

    mod = types.ModuleType("rival_plugin")
    mod.Rival, mod.half = Rival, half_then_fail
    monkeypatch.setitem(sys.modules, "rival_plugin", mod)
    monkeypatch.setattr(policies, "BROKEN", {})
    eps = [
        md.EntryPoint("h2o", "rival_plugin:Rival", policies.ENTRY_POINT_GROUP),
        md.EntryPoint("half", "rival_plugin:half", policies.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(md, "entry_points", lambda group: eps)
    # `half` is loaded by calling it (a module-level side effect, as an import's).
    monkeypatch.setattr(md.EntryPoint, "load", lambda ep: _load(ep, mod))
    policies._register_plugins()
    assert type(create_policy("h2o", 8)) is H2O and "h2o" not in policies.BROKEN
    assert "half" not in policies.POLICIES
    with pytest.raises(ValueError, match="'half' is unavailable: .*half-imported"):
        create_policy("half", 8)


def _load(ep, mod):
    obj = getattr(mod, ep.value.split(":")[1])
    return obj() if ep.name == "half" else obj
