"""Prefix-cache hits under compaction, on the real engine.

Requests one at a time share a 256-token head; each is evicted down to its
budget and compacted. Compaction writes no cached block while the pool has
blocks to spare (docs/DESIGN.md §3.3), so every later request finds the head in
the cache, as on native (it used to find none once the first request had
compacted: a destination's hash goes, and every later hash chains on it).
"""

from __future__ import annotations

import pytest

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
