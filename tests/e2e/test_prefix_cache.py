"""Prefix-cache hits under compaction, on the real engine.

Requests one at a time share a 256-token head; each is evicted down to its
budget and compacted. Compaction writes no cached block while the pool has
blocks to spare (docs/DESIGN.md §3.3), so every later request finds the head in
the cache, as on native (it used to find none once the first request had
compacted: a destination's hash goes, and every later hash chains on it).
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import assert_within_budget

pytestmark = pytest.mark.e2e


def spec(kind: str, **engine) -> dict:
    return {
        "engine": {"enable_prefix_caching": True, **engine},
        "sharegpt": {"n": 4, "min_tokens": 256, "max_tokens": 256},
        "max_tokens": 48,
        "turns": {"kind": kind, "prefix": 256, "ask": 16},
    }


@pytest.mark.parametrize("policy", ["h2o", "scissorhands"])
def test_a_shared_prefix_hits_as_on_native(engine, policy):
    native = engine(spec("prefix"))
    run = engine(spec("prefix", kv_eviction_policy=policy, kv_budget_tokens=96))
    assert native["prompt_lens"] == run["prompt_lens"] == [272] * 3
    # The first request finds nothing; each later one, the head (16 blocks).
    assert native["cached_tokens"] == {"0": 0, "1": 256, "2": 256}
    assert run["cached_tokens"] == native["cached_tokens"]
    c = run["counters"]
    assert c["evicted_tokens"] > 0 and c["moved_tokens"] > 0
    assert c["evacuated_blocks"] > 0 and c["tight_plans"] == 0
    assert run["free_end"] == run["free_start"]


def test_a_chat_turn_hits_the_previous_prompt(engine):
    """Each turn's prompt holds the previous turn: its prompt blocks, cached
    before its first eviction, are hit; its answer, computed without the dead
    tokens, is not (native hits it too)."""
    native = engine(spec("chat"))
    run = engine(spec("chat", kv_eviction_policy="h2o", kv_budget_tokens=96))
    lens = run["prompt_lens"]
    assert lens == native["prompt_lens"] == [272, 272 + 48 + 16, 272 + 2 * 64]
    hits, native_hits = run["cached_tokens"], native["cached_tokens"]
    for i in (1, 2):
        assert hits[str(i)] == lens[i - 1] // 16 * 16  # the previous prompt
        # Native: the answer too, but for its last token (sampled, never run).
        assert native_hits[str(i)] == (lens[i - 1] + 47) // 16 * 16


def isolation_spec(policy: str, share: bool) -> dict:
    """C runs alone and finishes; A starts; mid-flight, B arrives with 192 of
    its 256 prompt tokens found in the prefix cache: A's blocks (`share`), or
    the finished C's (the control: the same batch shapes, nothing of A's)."""
    import numpy as np

    rng = np.random.default_rng(11)
    c, a = (rng.integers(100, 40_000, 256).tolist() for _ in range(2))
    b = (a if share else c)[:192] + rng.integers(100, 40_000, 64).tolist()
    return {
        "engine": {
            "enable_prefix_caching": True,
            "kv_eviction_policy": policy,
            "kv_budget_tokens": 96,
            "kv_reclaim": "naive",  # A keeps its prompt blocks: B shares them
        },
        "prompts": [c, a, b],
        "max_tokens": [4, 40, 16],
        "arrivals": [0, 8, 14],
        "record_dead": True,
    }


@pytest.mark.parametrize("policy", ["h2o", "scissorhands"])
def test_a_request_sharing_prefix_blocks_leaves_the_owner_scores_alone(engine, policy):
    """A's scores come from A's queries only: whether B reads A's prefix
    blocks or C's, A evicts the same tokens. (With scores per KV slot, B's
    prefix hit reset A's scores on the shared slots and B's attention was
    added to them.)"""
    shared = engine(isolation_spec(policy, share=True))
    control = engine(isolation_spec(policy, share=False))
    for run in (shared, control):
        assert run["cached_tokens"]["2"] == 192  # B hit A's blocks, or C's
    assert len(shared["dead"]["1"]) > 256 - 96
    assert shared["dead"]["1"] == control["dead"]["1"]


def test_a_reset_with_running_requests_resumes_them_within_budget(engine):
    """vLLM's weight-update path resets the prefix cache between steps and
    preempts every running request (reset_prefix_cache(reset_running_requests=
    True)). Each resumes within its budget: evicted to it before the
    preemption, as a preemption in schedule() finds it (they resumed with
    budget + 2 live tokens, found by a fuzzer), its dead list reaching the
    worker with the resume."""
    budget = 32
    run = engine(
        {
            "engine": {
                "enable_prefix_caching": True,
                "kv_eviction_policy": "streamingllm",
                "kv_budget_tokens": budget,
            },
            "sharegpt": {"n": 3, "min_tokens": 64, "max_tokens": 64},
            "max_tokens": 40,
            "resets": [20],
        }
    )
    assert run["resets"] == 3  # all three running, each past its budget
    assert run["counters"]["evicted_tokens"] > 3 * (64 - budget)
    assert_within_budget(run, budget)
    assert all(len(out) == 40 for out in run["outputs"].values())
    assert run["free_end"] == run["free_start"]
